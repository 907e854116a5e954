"""megatron_pmlm.data loader: exact resumption for 2 ranks, batches equal build_batch on the
stored samples and masks, the AR step order, mask epoch e mod K, and validation of the files."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_pmlm.config import ConfigError
from megatron_pmlm.data import (PretrainingSampler, PretrainingSamples, SamplesError,
                                build_pretraining_loaders)
from megatron_pmlm.data.indexed import IndexedDatasetReader
from megatron_pmlm.data.loader import PMLMBatchBuilder, to_single_token_steps
from megatron_pmlm.models.layout import MASKED, ORIGINAL, PSEUDO
from megatron_pmlm.data.batches import build_batch
from megatron_pmlm.data.masking import ExampleMasks
from megatron_pmlm.models.objectives import get_objective


def _run(num_samples, consumed, steps, micro_batch_size=3, world=2, seed=5):
    samplers = [PretrainingSampler(num_samples, consumed, micro_batch_size, rank, world, seed) for rank in range(world)]
    return [[(tuple(i.tolist()), e) for i, e in (next(s) for _ in range(steps))] for s in samplers]


def test_sampler_resumes_exactly_for_two_ranks():
    num_samples, micro, world = 50, 3, 2  # 48 samples per epoch, 8 steps per epoch
    uninterrupted = _run(num_samples, 0, 30, micro, world)
    for stop_step in (0, 5, 8, 13):
        consumed = stop_step * micro * world
        first = _run(num_samples, 0, stop_step, micro, world)
        resumed = _run(num_samples, consumed, 30 - stop_step, micro, world)
        for rank in range(world):
            assert first[rank] + resumed[rank] == uninterrupted[rank], (stop_step, rank)
    # Within an epoch the two ranks together see every sample at most once, 48 of 50 in all.
    epoch0 = [i for rank in range(world) for batch, e in uninterrupted[rank] if e == 0 for i in batch]
    assert len(epoch0) == len(set(epoch0)) == 48
    epochs = sorted({e for batch, e in uninterrupted[0]})
    assert epochs == [0, 1, 2, 3]
    order0 = [batch for batch, e in uninterrupted[0] if e == 0]
    order1 = [batch for batch, e in uninterrupted[0] if e == 1]
    assert order0 != order1, "each epoch reshuffles"
    with pytest.raises(ConfigError, match="multiple"):
        PretrainingSampler(num_samples, 7, micro, 0, world)
    with pytest.raises(ConfigError, match="cannot fill"):
        PretrainingSampler(5, 0, micro, 0, world)


def test_loader_resume_matches_uninterrupted_batches(built):
    kwargs = dict(micro_batch_size=4, data_parallel_size=2, objective="ae+par")
    for rank in range(2):
        whole = build_pretraining_loaders(built, data_parallel_rank=rank, **kwargs).train
        batches = [next(whole) for _ in range(6)]
        assert whole.consumed_samples == 6 * 8
        restarted = build_pretraining_loaders(built, data_parallel_rank=rank, consumed_samples=3 * 8, **kwargs).train
        for expected in batches[3:]:
            got = next(restarted)
            for a, b in zip(expected.as_tuple(), got.as_tuple()):
                assert torch.equal(a, b)


def test_batches_equal_build_batch_on_stored_samples(built, tokenized):
    samples = PretrainingSamples(built, "train")
    reader = IndexedDatasetReader(tokenized)
    indices = np.array([5, 0, len(samples) - 1, 17])
    epoch = 4
    builder = PMLMBatchBuilder(samples, get_objective("ae+par"), seed=1)
    batch = builder(indices, epoch)
    # The reference: each sample assembled by hand from the corpus, masks read one by one.
    input_ids, segments, masks = [], [], []
    special = samples.special
    for index in indices.tolist():
        _, _, a_start, a_len, b_start, b_len = (int(v) for v in samples.rows[index])
        a = np.asarray(reader.tokens[a_start:a_start + a_len], dtype=np.int64)
        b = np.asarray(reader.tokens[b_start:b_start + b_len], dtype=np.int64)
        ids = np.concatenate([[special.cls], a, [special.sep]] + ([b, [special.sep]] if b_len else []))
        input_ids.append(ids)
        segments.append(np.r_[np.zeros(a_len + 2, np.int64), np.ones(b_len + 1 if b_len else 0, np.int64)])
        row = index * samples.mask_epochs + epoch % samples.mask_epochs
        lo, hi = int(samples.mask_offsets[row]), int(samples.mask_offsets[row + 1])
        masks.append(ExampleMasks(np.asarray(samples.mask_positions[lo:hi], np.int64),
                                  np.asarray(samples.mask_steps[lo:hi], np.int64),
                                  np.asarray(samples.mask_corrupted[lo:hi], np.int64)))
    expected = build_batch(input_ids, segments, masks, special.pseudo, special.pad)
    for a, b in zip(expected.as_tuple(), batch.as_tuple()):
        assert torch.equal(a, b)
    assert (batch.roles == PSEUDO).any() and (batch.roles == ORIGINAL).any()
    # Epoch e reads mask epoch e mod K.
    for a, b in zip(builder(indices, epoch - samples.mask_epochs).as_tuple(), batch.as_tuple()):
        assert torch.equal(a, b)
    assert not torch.equal(builder(indices, epoch + 1).roles, batch.roles)
    # AE only: no appended tokens, the same [M] slots.
    ae = PMLMBatchBuilder(samples, get_objective("ae"), seed=1)(indices, epoch)
    assert ae.input_ids.shape[1] == max(len(i) for i in input_ids)
    assert torch.equal(ae.roles == MASKED, batch.roles[:, :ae.roles.shape[1]] == MASKED)


def test_ar_objective_makes_single_token_steps_in_a_seeded_order(built):
    samples = PretrainingSamples(built, "train")
    indices = np.arange(8)
    stored = samples.masks(indices, 0)
    converted = to_single_token_steps(stored, indices, epoch=0, seed=11)
    for before, after in zip(stored, converted):
        assert sorted(after.masked_positions.tolist()) == sorted(before.masked_positions.tolist())
        assert after.step_ids.tolist() == list(range(1, len(before.masked_positions) + 1))
        lookup = dict(zip(before.masked_positions.tolist(), before.corrupted_ids.tolist()))
        assert [lookup[p] for p in after.masked_positions.tolist()] == after.corrupted_ids.tolist()
    # A function of (seed, sample, epoch): the same alone or in another batch; another epoch differs.
    alone = to_single_token_steps(samples.masks(indices[3:4], 0), indices[3:4], epoch=0, seed=11)
    assert alone[0].masked_positions.tolist() == converted[3].masked_positions.tolist()
    other_epoch = to_single_token_steps(stored, indices, epoch=1, seed=11)
    assert any(a.masked_positions.tolist() != b.masked_positions.tolist() for a, b in zip(converted, other_epoch))
    batch = PMLMBatchBuilder(samples, get_objective("ar"), seed=11)(indices, 0)
    pseudo_steps = batch.steps[batch.roles == PSEUDO]
    assert len(pseudo_steps) == sum(len(m.masked_positions) for m in stored)
    for row in range(len(indices)):
        steps = batch.steps[row][batch.roles[row] == PSEUDO]
        assert steps.tolist() == list(range(1, len(steps) + 1))


def test_build_pretraining_loaders_api(built, build_settings):
    loaders = build_pretraining_loaders(built, micro_batch_size=2, objective="ae+par", max_length=128)
    batch = next(loaders.train)
    assert batch.input_ids.shape[0] == 2 and loaders.train.consumed_samples == 2
    assert loaders.valid is not None
    first, second = next(loaders.valid()), next(loaders.valid())
    assert torch.equal(first.input_ids, second.input_ids), "validation batches are the same every time"
    assert loaders.metadata["seed"] == build_settings["seed"]
    with pytest.raises(ConfigError, match="more than the model's 64 positions"):
        build_pretraining_loaders(built, micro_batch_size=2, max_length=64)
    with pytest.raises(SamplesError, match="--split 90,8,2, not 949,50,1"):
        build_pretraining_loaders(built, micro_batch_size=2, split="949,50,1")
    with pytest.raises(SamplesError, match="vocabulary of 30522 entries, the model has 100"):
        build_pretraining_loaders(built, micro_batch_size=2, vocab_size=100)


def test_missing_truncated_or_stale_files_are_named(tmp_path, built, tokenized):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    PretrainingSamples(copy, "train")
    steps = copy / "train" / "mask_steps.bin"
    steps.write_bytes(steps.read_bytes()[:-2])
    with pytest.raises(SamplesError, match=r"mask_steps\.bin: .* truncated"):
        PretrainingSamples(copy, "train")
    steps.unlink()
    with pytest.raises(SamplesError, match=r"missing file: .*mask_steps\.bin"):
        PretrainingSamples(copy, "train")
    with pytest.raises(SamplesError, match=r"metadata\.json is missing .*looks like a tokenized corpus"):
        PretrainingSamples(tokenized, "train")
    metadata = json.loads((copy / "metadata.json").read_text())
    metadata["format_version"] = 99
    (copy / "metadata.json").write_text(json.dumps(metadata))
    with pytest.raises(SamplesError, match="format version 99"):
        PretrainingSamples(copy, "train")
    # A corpus re-tokenized after the build: detected by its size.
    corpus = tmp_path / "corpus"
    for ext in (".bin", ".idx"):
        shutil.copy(f"{tokenized}{ext}", f"{corpus}{ext}")
    stale = tmp_path / "stale"
    shutil.copytree(built, stale)
    metadata = json.loads((stale / "metadata.json").read_text())
    metadata["blend"][0]["prefix"] = str(corpus)
    (stale / "metadata.json").write_text(json.dumps(metadata))
    PretrainingSamples(stale, "train")
    Path(f"{corpus}.bin").write_bytes(Path(f"{corpus}.bin").read_bytes() + b"\0\0")
    with pytest.raises(SamplesError, match=r"corpus\.bin"):
        PretrainingSamples(stale, "train")


def test_prepare_pretraining_data_then_train_batches(tmp_path, corpus_slices, vocab_file, capsys):
    from data_prep.pipeline import prepare_pretraining_data

    samples_dir = prepare_pretraining_data(corpus_slices[1:], vocab_file, tmp_path / "demo", seq_length=64,
                                           mask_epochs=2, split="9,1", progress=False)
    loaders = build_pretraining_loaders(samples_dir, micro_batch_size=4, objective="ae+ar", max_length=64)
    batch = next(loaders.train)
    assert batch.input_ids.shape[0] == 4 and (batch.roles == PSEUDO).any()
    stamp = Path(f"{tmp_path / 'demo' / 'corpus'}.bin").stat().st_mtime_ns
    capsys.readouterr()
    assert prepare_pretraining_data(corpus_slices[1:], vocab_file, tmp_path / "demo", seq_length=64,
                                    mask_epochs=2, split="9,1", progress=False) == samples_dir
    assert "up to date" in capsys.readouterr().err, "the second call reuses both steps"
    assert Path(f"{tmp_path / 'demo' / 'corpus'}.bin").stat().st_mtime_ns == stamp
    prepare_pretraining_data(corpus_slices[1:], vocab_file, tmp_path / "demo", seq_length=32,
                             mask_epochs=2, split="9,1", progress=False)
    assert read_metadata_seq(samples_dir) == 32


def read_metadata_seq(directory) -> int:
    return json.loads((Path(directory) / "metadata.json").read_text())["seq_length"]


def test_length_bucketing_keeps_each_global_batch_and_is_the_same_for_every_data_parallel_size():
    """Each optimizer step's samples are those of the unbucketed sampler, dealt out longest first;
    dp=1 with 4 accumulation steps and dp=2 with 2 see the same micro batches; resume is exact."""
    rng = np.random.default_rng(0)
    num_samples, micro, global_batch = 103, 3, 12
    lengths = rng.integers(10, 500, num_samples)

    def micro_batches(world, consumed=0, count=16):
        samplers = [PretrainingSampler(num_samples, consumed, micro, rank, world, seed=5, global_batch_size=global_batch,
                                       sample_lengths=lengths) for rank in range(world)]
        return [next(s) for _ in range(count // world) for s in samplers]

    single, double = micro_batches(1), micro_batches(2)
    assert [b[0].tolist() for b in single] == [b[0].tolist() for b in double]
    plain = PretrainingSampler(num_samples, 0, global_batch, 0, 1, seed=5)
    for step in range(4):
        bucketed = np.concatenate([b[0] for b in single[step * 4:(step + 1) * 4]])
        assert sorted(bucketed.tolist()) == sorted(next(plain)[0].tolist())
        assert (np.diff(lengths[bucketed]) <= 0).all()  # longest first
    resumed = micro_batches(1, consumed=5 * micro, count=11)
    assert [b[0].tolist() for b in resumed] == [b[0].tolist() for b in single[5:16]]
    with pytest.raises(ConfigError, match="not a multiple of micro batch"):
        PretrainingSampler(num_samples, 0, micro, 0, 2, global_batch_size=9, sample_lengths=lengths)
