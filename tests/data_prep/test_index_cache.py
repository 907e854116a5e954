"""The loader's index cache (data/index_cache.py): the cached epoch order deals exactly the batches
the sampler dealt before it existed; exact resume with and without a cache file; one build per
epoch (a second rank or start reuses the file); old epochs deleted; the read-only samples folder
refused with the remedy; `--index-cache` honoured by pretrain."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_pmlm.data import PretrainingSampler, SamplesError, build_pretraining_loaders
from megatron_pmlm.data import index_cache
from megatron_pmlm.data.index_cache import INDEX_CACHE_FOLDER, index_cache_folder



class ReferenceSampler:
    """The sampler as it was before the cache (main at 86df4f5), its algorithm kept as the reference:
    a permutation per epoch, each global batch sorted longest first when it is reached."""

    def __init__(self, num_samples, consumed_samples, micro_batch_size, rank, world, seed, shuffle=True,
                 global_batch_size=None, sample_lengths=None):
        self.global_batch = micro_batch_size * world
        self.num_samples, self.consumed_samples = num_samples, consumed_samples
        self.micro_batch_size, self.rank, self.seed, self.shuffle = micro_batch_size, rank, seed, shuffle
        self.sample_lengths, self.bucket_size = None, self.global_batch
        if sample_lengths is not None and global_batch_size is not None:
            self.sample_lengths, self.bucket_size = np.asarray(sample_lengths), global_batch_size
        self.samples_per_epoch = num_samples - num_samples % self.bucket_size
        self._epoch, self._order, self._bucket_key, self._bucket = -1, None, None, None

    def order(self, epoch):
        if epoch != self._epoch:
            self._order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
                           if self.shuffle else np.arange(self.num_samples))
            self._epoch = epoch
        return self._order

    def __next__(self):
        epoch, offset = divmod(self.consumed_samples, self.samples_per_epoch)
        start = offset + self.rank * self.micro_batch_size
        if self.sample_lengths is None:
            indices = self.order(epoch)[start:start + self.micro_batch_size]
        else:
            bucket_start = offset - offset % self.bucket_size
            indices = self.bucket(epoch, bucket_start)[start - bucket_start:start - bucket_start + self.micro_batch_size]
        self.consumed_samples += self.global_batch
        return indices, epoch

    def bucket(self, epoch, bucket_start):
        if self._bucket_key != (epoch, bucket_start):
            members = self.order(epoch)[bucket_start:bucket_start + self.bucket_size]
            self._bucket = members[np.argsort(-self.sample_lengths[members], kind="stable")]
            self._bucket_key = (epoch, bucket_start)
        return self._bucket


def _draws(sampler, steps):
    return [(indices.tolist(), epoch) for indices, epoch in (next(sampler) for _ in range(steps))]


@pytest.mark.parametrize("bucketed", [True, False])
def test_cached_order_deals_the_same_batches_as_the_sampler_before_the_cache(tmp_path, monkeypatch, bucketed):
    """Several seeds, data-parallel sizes and ranks, resume points across 4 epochs, shuffled and
    not, lengths with many ties; the sort in chunks of a few buckets (as at 80M samples)."""
    monkeypatch.setattr(index_cache, "SORT_CHUNK_SAMPLES", 40)
    num_samples, micro, global_batch = 103, 3, 24
    lengths = np.random.default_rng(0).integers(10, 30, num_samples)  # few distinct values: ties matter
    checked = 0
    for seed in (1, 5, 1234):
        for shuffle in (True, False):
            for world in (1, 2, 4):
                for consumed in (0, micro * world * 5, micro * world * 11):
                    for rank in range(world):
                        settings = dict(seed=seed, shuffle=shuffle,
                                        global_batch_size=global_batch if bucketed else None,
                                        sample_lengths=lengths if bucketed else None)
                        expected = _draws(ReferenceSampler(num_samples, consumed, micro, rank, world, **settings), 40)
                        cached = PretrainingSampler(num_samples, consumed, micro, rank, world,
                                                    index_cache=tmp_path / "cache", **settings)
                        assert _draws(cached, 40) == expected, (seed, shuffle, world, consumed, rank)
                        in_memory = PretrainingSampler(num_samples, consumed, micro, rank, world, **settings)
                        assert _draws(in_memory, 40) == expected, (seed, shuffle, world, consumed, rank)
                        checked += 1
    assert checked == 3 * 2 * (1 + 2 + 4) * 3
    assert len({epoch for _, epoch in expected}) >= 4


def test_lengths_beyond_16_bits_sort_as_before(tmp_path):
    """The writer sorts 16-bit keys where the lengths fit (a radix sort), wider keys otherwise."""
    lengths = np.random.default_rng(2).integers(30_000, 70_000, 500)
    settings = dict(seed=9, global_batch_size=40, sample_lengths=lengths)
    expected = _draws(ReferenceSampler(500, 0, 4, 1, 2, **settings), 150)
    assert _draws(PretrainingSampler(500, 0, 4, 1, 2, index_cache=tmp_path, **settings), 150) == expected


def test_resume_mid_epoch_continues_exactly_with_and_without_a_cache_file(built, tmp_path):
    """Real samples, length bucketing, 2 ranks: a restart in the middle of epoch 1 (its cache file
    there, or an empty cache folder) gives the uninterrupted run's batches."""
    kwargs = dict(micro_batch_size=4, data_parallel_size=2, global_batch_size=16, objective="ae+par")
    whole = [build_pretraining_loaders(built, data_parallel_rank=rank, index_cache=tmp_path / "run", **kwargs).train
             for rank in range(2)]
    steps_per_epoch = whole[0].sampler.samples_per_epoch // 8
    total = steps_per_epoch + 4
    batches = [[next(loader) for _ in range(total)] for loader in whole]
    assert whole[0].sampler.consumed_samples // whole[0].sampler.samples_per_epoch == 1  # now in epoch 1
    restart = steps_per_epoch + 1  # mid-epoch 1
    for folder in ("run", "fresh"):
        for rank in range(2):
            resumed = build_pretraining_loaders(built, data_parallel_rank=rank, consumed_samples=restart * 8,
                                                index_cache=tmp_path / folder, **kwargs).train
            for expected in batches[rank][restart:]:
                got = next(resumed)
                assert torch.equal(got.input_ids, expected.input_ids), (folder, rank)
                assert torch.equal(got.roles, expected.roles), (folder, rank)
    assert sorted(p.name.rsplit("-", 1)[1] for p in (tmp_path / "fresh").glob("*.npy")) == ["epoch1.npy"]


def test_a_second_rank_and_a_second_start_reuse_the_file(tmp_path):
    lengths = np.random.default_rng(1).integers(1, 500, 1000)
    settings = dict(seed=3, global_batch_size=40, sample_lengths=lambda: lengths, index_cache=tmp_path)
    next(PretrainingSampler(1000, 0, 4, 0, 2, **settings))
    (path,) = tmp_path.glob("*-epoch0.npy")
    before = path.stat()
    calls = []
    for rank in (1, 0):  # the other rank, then a restarted run's first rank
        sampler = PretrainingSampler(1000, 8 * rank, 4, rank, 2, **dict(settings, sample_lengths=lambda: calls.append(1)))
        next(sampler)
    after = path.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert calls == [], "the lengths are read only where an epoch is built"
    assert isinstance(sampler.order(0), np.memmap)


def test_old_epochs_are_deleted_and_other_runs_files_kept(tmp_path):
    num_samples, micro = 40, 4
    other = PretrainingSampler(num_samples, 0, micro, seed=99, index_cache=tmp_path)
    next(other)
    sampler = PretrainingSampler(num_samples, 0, micro, seed=7, index_cache=tmp_path)
    next(sampler)
    (first,) = tmp_path.glob("*seed7*-epoch0.npy")
    (tmp_path / f".{first.name}.node-1234.tmp").write_bytes(b"half")  # a killed writer's leftover
    sampler = PretrainingSampler(num_samples, 0, micro, seed=7, index_cache=tmp_path)
    seen = []
    for _ in range(10 * 4 + 1):  # into epoch 4
        seen.append(next(sampler)[1])
    assert seen[-1] == 4
    mine = sorted(p.name for p in tmp_path.glob("*seed7*.npy"))
    assert [name.rsplit("-", 1)[1] for name in mine] == ["epoch3.npy", "epoch4.npy"]
    assert len(list(tmp_path.glob("*seed99*-epoch0.npy"))) == 1
    assert not list(tmp_path.glob(".*.tmp"))


def test_cache_files_honour_the_umask_and_bad_files_are_named(tmp_path):
    old = os.umask(0o027)
    try:
        next(PretrainingSampler(40, 0, 4, index_cache=tmp_path / "cache"))
    finally:
        os.umask(old)
    (path,) = (tmp_path / "cache").glob("*.npy")
    assert path.stat().st_mode & 0o777 == 0o640
    np.save(path, np.arange(7, dtype=np.int32))  # a file of another length under this key
    with pytest.raises(SamplesError, match=f"{path.name}: holds .* delete it to rebuild"):
        next(PretrainingSampler(40, 0, 4, index_cache=tmp_path / "cache"))


def _without_write_override() -> list[str]:
    """A command prefix under which a read-only folder is read-only: root writes everywhere
    unless it drops CAP_DAC_OVERRIDE (util-linux `setpriv`)."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without setpriv: a read-only folder cannot be made here")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--inh-caps",
            "-dac_override,-dac_read_search", "--"]


def test_a_read_only_samples_folder_is_refused_and_index_cache_goes_elsewhere(pretraining_samples, tmp_path):
    """pretrain on a read-only samples folder: one error line naming the folder and --index-cache,
    exit 2, nothing written; with --index-cache DIR it trains and the epoch order lands in DIR."""
    samples = tmp_path / "samples"
    shutil.copytree(pretraining_samples, samples, ignore=shutil.ignore_patterns(INDEX_CACHE_FOLDER))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    command = [*_without_write_override(), sys.executable, "-m", "megatron_pmlm.pretrain", "--data-path", str(samples),
               "--preset", "tiny", "--micro-batch-size", "4", "--global-batch-size", "8", "--train-iters", "2",
               "--eval-iters", "0"]
    samples.chmod(0o555)
    try:
        refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
        trained = subprocess.run([*command, "--index-cache", str(tmp_path / "cache")], capture_output=True, text=True,
                                 env=env, timeout=300)
    finally:
        samples.chmod(0o755)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr
    assert f"cannot write the loader's index cache in {samples / INDEX_CACHE_FOLDER}" in refused.stderr
    assert "pass --index-cache DIR" in refused.stderr
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert len(list((tmp_path / "cache").glob("*-bucket8-epoch0.npy"))) == 1
    assert not (samples / INDEX_CACHE_FOLDER).exists()


def test_index_cache_folder_defaults_inside_the_samples_folder(tmp_path):
    assert index_cache_folder(tmp_path) == tmp_path / INDEX_CACHE_FOLDER
    assert (tmp_path / INDEX_CACHE_FOLDER).is_dir()
    assert index_cache_folder(tmp_path, tmp_path / "elsewhere") == tmp_path / "elsewhere"
    assert list((tmp_path / "elsewhere").iterdir()) == []  # the probe file is gone


def test_the_writers_compact_lengths_equal_the_samples_lengths(built, monkeypatch):
    from megatron_pmlm.data import PretrainingSamples, loader

    samples = PretrainingSamples(built, "train")
    monkeypatch.setattr(loader, "SORT_CHUNK_SAMPLES", 7)  # several chunks, a short last one
    compact = loader.compact_lengths(samples)
    assert compact.dtype == np.int32 and compact.tolist() == samples.lengths().tolist()
    assert samples.lengths(5, 9).tolist() == samples.lengths()[5:9].tolist()


def test_bench_loader_index_reports_one_cache_shared_by_the_ranks(tmp_path):
    """The benchmark at a few thousand samples: its sparse folder loads, 2 ranks report, one cache
    file is built, and the ranks report their memory."""
    import json

    result = subprocess.run([sys.executable, "tools/bench_loader_index.py", "--samples", "5000", "--ranks", "2",
                             "--global-batch-size", "64", "--batches", "2", "--work", str(tmp_path)],
                            capture_output=True, text=True, timeout=300, cwd=Path(__file__).resolve().parents[2],
                            env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert result.returncode == 0, result.stderr[-3000:]
    made, fresh, reused = (json.loads(line) for line in result.stdout.splitlines())
    assert made["synthetic_samples"] == 5000
    assert fresh["ranks"] == reused["ranks"] == 2
    assert len(fresh["cache_files"]) == 1 and fresh["cache_files"] == reused["cache_files"]
    assert "bucket64-epoch0.npy" in fresh["cache_files"][0]
    assert all(mib > 0 for mib in fresh["rss_anon_mib"] + fresh["peak_rss_anon_mib"])
    assert (tmp_path / "samples" / "train" / "mask_offsets.bin").stat().st_blocks == 0  # sparse
