"""data_prep.preprocess: tokens equal the in-memory path, megatron-core reads the output, shards
and ranks join into the same bytes, resumption, every input kind, and the bad-input errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from data_prep.preprocess import PreprocessConfig, main, run, shard_dir
from data_prep.sources import InputError
from megatron_pmlm.data.indexed import IndexedDatasetError, IndexedDatasetReader
from megatron_pmlm.data.text_data import read_text_documents, tokenize_documents
from megatron_pmlm.tokenizer import WordPieceTokenizer


def _config(inputs, prefix, vocab_file, **overrides) -> PreprocessConfig:
    return PreprocessConfig(inputs=[str(p) for p in inputs], output_prefix=str(prefix),
                            vocab_file=str(vocab_file), progress=False, **overrides)


def _documents(prefix) -> list[list[list[int]]]:
    reader = IndexedDatasetReader(prefix)
    return [[s.tolist() for s in reader.document(d)] for d in range(reader.num_documents)]


def _same_files(a: Path, b: Path) -> bool:
    return all(Path(f"{a}{ext}").read_bytes() == Path(f"{b}{ext}").read_bytes() for ext in (".bin", ".idx"))


def test_tokens_equal_the_in_memory_path(tokenized, corpus_slices, vocab_file):
    tokenizer = WordPieceTokenizer(vocab_file)
    expected = tokenize_documents(read_text_documents(corpus_slices), tokenizer, 509)
    got = _documents(tokenized)
    assert len(got) == len(expected) > 100
    assert got == [[s.tolist() for s in doc] for doc in expected]
    meta = json.loads(Path(f"{tokenized}.json").read_text())
    assert meta["stats"]["documents"] == len(expected)
    assert meta["special_ids"]["cls"] == tokenizer.special.cls and meta["dtype"] == "uint16"
    assert not shard_dir(tokenized).exists(), "shards are removed after the merge"


def test_megatron_core_indexed_dataset_reads_the_output(tokenized):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    ours = IndexedDatasetReader(tokenized)
    theirs = IndexedDataset(str(tokenized))
    assert len(theirs) == ours.num_sequences
    np.testing.assert_array_equal(theirs.index.document_indices, ours.document_indices)
    assert theirs.index.dtype == np.uint16
    for i in (0, 1, len(theirs) // 2, len(theirs) - 1):
        np.testing.assert_array_equal(theirs[i], ours[i])


def test_workers_and_ranks_give_identical_bytes_and_resume(tmp_path, corpus_slices, vocab_file, tokenized):
    # Two worker processes, many shards: the same bytes as the single-process session fixture.
    parallel = tmp_path / "parallel"
    run(_config(corpus_slices, parallel, vocab_file, shard_size_mb=0.05, workers=2))
    assert _same_files(parallel, tokenized)

    # Two "nodes": each rank tokenizes its shards, nothing is merged until --merge-only.
    multi = tmp_path / "multi"
    assert run(_config(corpus_slices, multi, vocab_file, shard_size_mb=0.05, rank=0, world_size=2)) is None
    done = sorted(p.name for p in shard_dir(multi).glob("shard-*.json"))
    assert done and all(int(name[6:11]) % 2 == 0 for name in done)
    assert not Path(f"{multi}.bin").exists()
    with pytest.raises(InputError, match="not finished"):
        run(_config(corpus_slices, multi, vocab_file, shard_size_mb=0.05, merge_only=True))

    # A rerun on one process resumes: rank 0's shards are skipped, the rest tokenized, then merged.
    summary = run(_config(corpus_slices, multi, vocab_file, shard_size_mb=0.05))
    assert summary["shards_skipped"] == len(done)
    assert _same_files(multi, tokenized)

    # And the multi-node path proper: rank 1 after rank 0, then --merge-only.
    nodes = tmp_path / "nodes"
    for rank in (0, 1):
        run(_config(corpus_slices, nodes, vocab_file, shard_size_mb=0.05, rank=rank, world_size=2))
    run(_config(corpus_slices, nodes, vocab_file, shard_size_mb=0.05, merge_only=True))
    assert _same_files(nodes, tokenized)


def test_changed_inputs_do_not_reuse_old_shards(tmp_path, corpus_slices, vocab_file):
    prefix = tmp_path / "out"
    run(_config(corpus_slices[:1], prefix, vocab_file, shard_size_mb=0.05, rank=0, world_size=2))
    with pytest.raises(InputError, match="different run"):
        run(_config(corpus_slices[1:], prefix, vocab_file, shard_size_mb=0.05))
    # --overwrite on two ranks: nobody deletes the directory, but the stale markers do not count.
    for rank in (0, 1):
        run(_config(corpus_slices[1:], prefix, vocab_file, shard_size_mb=0.05, overwrite=True, rank=rank,
                    world_size=2))
    marker = json.loads((shard_dir(prefix) / "shard-00000.json").read_text())
    assert marker["shard"]["path"] == str(corpus_slices[1]), "the stale shard 0 was tokenized again"
    run(_config(corpus_slices[1:], prefix, vocab_file, shard_size_mb=0.05, merge_only=True))
    single = tmp_path / "single"
    run(_config(corpus_slices[1:], single, vocab_file))
    assert _same_files(prefix, single)


def test_jsonl_and_hf_datasets_give_the_same_tokens_as_text(tmp_path, corpus_slices, vocab_file):
    import datasets

    text_prefix = tmp_path / "text"
    run(_config(corpus_slices[1:2], text_prefix, vocab_file))
    documents = list(read_text_documents(corpus_slices[1:2]))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(documents)))
    table = datasets.Dataset.from_dict({"text": documents})
    table.save_to_disk(str(tmp_path / "saved"))
    table.to_parquet(str(tmp_path / "docs.parquet"))
    expected = _documents(text_prefix)
    for name, inputs, key in (("jsonl", [jsonl], "body"), ("saved", [tmp_path / "saved"], "text"),
                              ("parquet", [tmp_path / "docs.parquet"], "text")):
        prefix = tmp_path / f"from-{name}"
        run(_config(inputs, prefix, vocab_file, json_key=key, shard_size_mb=0.01))
        assert _documents(prefix) == expected, name
    for name in ("saved", "docs.parquet"):
        with pytest.raises(InputError, match=rf"{name}: no column 'body' \(has: text\)"):
            run(_config([tmp_path / name], tmp_path / f"nokey-{name}", vocab_file, json_key="body"))
    # A glob mixing kinds: JSONL then text, in sorted order.
    mixed = tmp_path / "mixed"
    shutil.copy(corpus_slices[1], tmp_path / "zz.txt")
    run(_config([str(tmp_path / "*.jsonl"), str(tmp_path / "zz.txt")], mixed, vocab_file, json_key="body"))
    assert _documents(mixed) == expected + expected


def test_bad_jsonl_lines_name_file_and_line_or_are_skipped(tmp_path, vocab_file):
    jsonl = tmp_path / "bad.jsonl"
    jsonl.write_text('{"text": "One sentence here. Another one."}\n\n{"text": "broken\n'
                     '{"other": "no text key"}\n{"text": "Last document."}\n')
    prefix = tmp_path / "out"
    with pytest.raises(InputError, match=r"bad\.jsonl, line 3: malformed JSON"):
        run(_config([jsonl], prefix, vocab_file))
    assert not list(tmp_path.glob("out.bin*")) and not list(tmp_path.glob("out.idx*"))
    assert not list(tmp_path.glob("out.shards/*.tmp")), "nothing half-written"
    summary = run(_config([jsonl], prefix, vocab_file, skip_bad_lines=True, overwrite=True))
    assert summary["bad_lines"] == 2 and summary["documents"] == 2
    missing_key = tmp_path / "key.jsonl"
    missing_key.write_text('{"text": "fine."}\n{"body": "no text key"}\n')
    with pytest.raises(InputError, match=r"key\.jsonl, line 2: no key 'text' \(has: body\)"):
        run(_config([missing_key], tmp_path / "key", vocab_file))


def test_invalid_utf8_is_replaced_and_counted_or_refused(tmp_path, vocab_file):
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"First document is fine.\n\nThe caf\xe9 was open. It sold tea.\n\nThird \xff\xfe one.\n")
    summary = run(_config([path], tmp_path / "out", vocab_file))
    assert summary["invalid_utf8"] == 3 and summary["documents"] == 3
    assert summary["invalid_utf8_files"] == {str(path): 3}
    with pytest.raises(InputError, match=r"latin1\.txt, line 3: invalid UTF-8"):
        run(_config([path], tmp_path / "strict", vocab_file, strict_utf8=True))
    assert not Path(f"{tmp_path / 'strict'}.bin").exists()


def test_long_sentences_are_split_and_counted(tmp_path, vocab_file):
    path = tmp_path / "long.txt"
    words = " ".join(f"word{i}" for i in range(300))
    path.write_text(f"Short start. {words} end.\n")
    summary = run(_config([path], tmp_path / "out", vocab_file, max_sentence_tokens=50))
    reader = IndexedDatasetReader(tmp_path / "out")
    assert summary["long_sentences_split"] == 1
    assert reader.sequence_lengths.max() <= 50 and reader.num_sequences > 5 and reader.num_documents == 1
    tokenizer = WordPieceTokenizer(vocab_file)
    whole = np.concatenate(tokenizer.encode_batch(["Short start.", f"{words} end."]))
    np.testing.assert_array_equal(np.asarray(reader.tokens), whole)


def test_bad_inputs_and_existing_output_are_refused(tmp_path, corpus_slices, vocab_file, capsys):
    with pytest.raises(InputError, match="input not found: .*nope.txt"):
        run(_config([tmp_path / "nope.txt"], tmp_path / "a", vocab_file))
    with pytest.raises(InputError, match=r"input not found: .*\*\.none"):
        run(_config([str(tmp_path / "*.none")], tmp_path / "a", vocab_file))
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n   \n")
    with pytest.raises(InputError, match="empty input"):
        run(_config([empty], tmp_path / "a", vocab_file))
    assert not list(tmp_path.glob("a.*")), "an empty input leaves nothing behind"
    (tmp_path / "zero.txt").write_text("")
    with pytest.raises(InputError, match="empty input"):
        run(_config([tmp_path / "zero.txt"], tmp_path / "a", vocab_file))
    prefix = tmp_path / "exists"
    run(_config(corpus_slices[1:2], prefix, vocab_file))
    with pytest.raises(InputError, match=r"output exists: .*exists\.bin"):
        run(_config(corpus_slices[1:2], prefix, vocab_file))
    # The command line: exit status 2, the message on stderr, a summary on success.
    assert main(["--input", str(empty), "--output-prefix", str(tmp_path / "cli"), "--vocab-file",
                 str(vocab_file), "--no-progress"]) == 2
    assert "error: empty input" in capsys.readouterr().err
    assert main(["--input", str(corpus_slices[1]), "--output-prefix", str(prefix), "--vocab-file",
                 str(vocab_file), "--overwrite", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "documents" in out and "MB/s" in out and "tokens" in out
    # A corpus or a binary given as the vocabulary: one line, nothing written.
    binary = tmp_path / "weights.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    for wrong, message in ((corpus_slices[1], "lacks the special token(s) [PAD]"), (binary, "is not UTF-8 text")):
        assert main(["--input", str(corpus_slices[1]), "--output-prefix", str(tmp_path / "wrong"), "--vocab-file",
                     str(wrong), "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert message in err and "vocab.txt" in err and len(err.strip().splitlines()) == 1, err
        assert not list(tmp_path.glob("wrong*")), "a bad vocabulary leaves nothing behind"


def test_truncated_or_foreign_files_are_detected_naming_the_file(tmp_path, tokenized):
    for ext in (".bin", ".idx", ".json"):
        shutil.copy(f"{tokenized}{ext}", tmp_path / f"c{ext}")
    copy = tmp_path / "c"
    IndexedDatasetReader(copy)
    data = Path(f"{copy}.bin").read_bytes()
    Path(f"{copy}.bin").write_bytes(data[:-10])
    with pytest.raises(IndexedDatasetError, match=r"c\.bin: .*truncated"):
        IndexedDatasetReader(copy)
    Path(f"{copy}.bin").write_bytes(data)
    index = Path(f"{copy}.idx").read_bytes()
    Path(f"{copy}.idx").write_bytes(index[:-8])
    with pytest.raises(IndexedDatasetError, match=r"c\.idx: .*truncated or foreign"):
        IndexedDatasetReader(copy)
    Path(f"{copy}.idx").write_bytes(b"PK\x03\x04 not an index at all" + index[30:])
    with pytest.raises(IndexedDatasetError, match=r"c\.idx: not a Megatron indexed dataset"):
        IndexedDatasetReader(copy)
    Path(f"{copy}.idx").unlink()
    with pytest.raises(IndexedDatasetError, match=r"c\.idx does not exist"):
        IndexedDatasetReader(copy)


def test_train_vocab_writes_a_vocabulary_with_the_pseudo_token(tmp_path, corpus_slices):
    prefix = tmp_path / "own"
    summary = run(PreprocessConfig(inputs=[str(corpus_slices[1])], output_prefix=str(prefix),
                                   train_vocab=400, progress=False))
    vocab = tmp_path / "own-vocab" / "vocab.txt"
    tokenizer = WordPieceTokenizer(vocab)
    assert "[P]" in vocab.read_text().split("\n") and tokenizer.special.pseudo != tokenizer.special.mask
    reader = IndexedDatasetReader(prefix)
    assert reader.num_tokens == summary["tokens"] > 0 and int(np.max(reader.tokens)) < tokenizer.vocab_size
    assert json.loads(Path(f"{prefix}.json").read_text())["vocab_file"] == str(vocab.resolve())
    # --vocab-only (slurm/prepare_data.sh TRAIN_VOCAB=SIZE: one task trains, every rank then tokenizes)
    only = tmp_path / "only"
    assert run(PreprocessConfig(inputs=[str(corpus_slices[1])], output_prefix=str(only), train_vocab=400,
                                vocab_only=True, progress=False)) is None
    assert "[P]" in (tmp_path / "only-vocab" / "vocab.txt").read_text().split("\n")
    assert not list(tmp_path.glob("only.*")), "--vocab-only tokenizes nothing"


def test_slurm_ranks_as_separate_processes_then_merge(tmp_path, corpus_slices, vocab_file, tokenized):
    """What slurm/prepare_data.sh does: srun starts one process per task (SLURM_PROCID of
    SLURM_NTASKS), each tokenizes its shards concurrently, then one --merge-only step joins them."""
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    prefix = tmp_path / "slurm"
    command = [sys.executable, "-m", "data_prep.preprocess", "--input", *map(str, corpus_slices),
               "--output-prefix", str(prefix), "--vocab-file", str(vocab_file), "--shard-size-mb", "0.05",
               "--no-progress"]
    ranks = [subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "SLURM_PROCID": str(rank), "SLURM_NTASKS": "2"})
             for rank in range(2)]
    for rank, process in enumerate(ranks):
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        assert f"rank {rank}/2" in err and "--merge-only" in err
    assert not Path(f"{prefix}.bin").exists()
    merged = subprocess.run(command + ["--merge-only"], cwd=repo, capture_output=True, text=True, timeout=120,
                            env={**os.environ, "SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert merged.returncode == 0, merged.stderr
    assert "documents" in merged.stdout
    assert _same_files(prefix, tokenized)


@pytest.fixture(scope="module")
def mpi() -> None:
    """Open MPI and mpi4py, installed here when missing (tests/mpi_runtime.py); a skip only where
    they are missing and cannot be installed."""
    from mpi_runtime import MpiUnavailable, ensure_mpi

    try:
        ensure_mpi()
    except MpiUnavailable as reason:
        pytest.skip(str(reason))


def _mpi_preprocess(*arguments: str, timeout: float = 300):
    import subprocess
    import sys

    from mpi_runtime import mpi_env, mpirun

    repo = Path(__file__).resolve().parents[2]
    return subprocess.run([*mpirun(2), sys.executable, "-m", "data_prep.preprocess", *arguments, "--no-progress"],
                          cwd=repo, capture_output=True, text=True, timeout=timeout, env=mpi_env())


def test_mpi_ranks_tokenize_and_rank_zero_merges(mpi, tmp_path, corpus_slices, vocab_file, tokenized):
    """Under mpirun with mpi4py (optional extra `mpi`): ranks split the shards, rank 0 merges after
    the others are done, into the bytes one process writes."""
    prefix = tmp_path / "mpi"
    result = _mpi_preprocess("--input", *map(str, corpus_slices), "--output-prefix", str(prefix),
                             "--vocab-file", str(vocab_file), "--shard-size-mb", "0.05")
    assert result.returncode == 0, result.stderr
    assert "rank 1/2" in result.stderr and "rank 0 merges" in result.stderr
    assert "documents" in result.stdout and f"wrote {prefix}.bin" in result.stdout
    assert _same_files(prefix, tokenized)


def test_mpi_rank_failure_ends_every_rank(mpi, tmp_path, corpus_slices, vocab_file):
    """Rank 1's shard has a malformed line: mpirun exits with its status 2 and the message, at once;
    rank 0 does not wait for it forever (in the collective before the merge, or in MPI_Finalize)."""
    documents = list(read_text_documents(corpus_slices[:1]))
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    (tmp_path / "b.jsonl").write_text('{"text": "fine."}\n{"text": "broken\n')
    result = _mpi_preprocess("--input", str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"), "--output-prefix",
                             str(tmp_path / "out"), "--vocab-file", str(vocab_file), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "b.jsonl, line 2: malformed JSON" in result.stderr
    assert not list(tmp_path.glob("out.bin*")) and not list(tmp_path.glob("out.idx*"))


def test_an_mpi_launch_without_mpi4py_is_refused(monkeypatch, tmp_path, corpus_slices, vocab_file):
    """Without mpi4py every rank under mpirun would take itself for the only one and write the same
    files: refused, unless the launcher started one process or the ranks are given."""
    from data_prep.preprocess import detect_rank_and_world

    monkeypatch.setitem(__import__("sys").modules, "mpi4py", None)  # `import mpi4py` fails as if absent
    for name in ("SLURM_NTASKS", "SLURM_PROCID", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "2")
    with pytest.raises(InputError, match=r"MPI launcher \(OMPI_COMM_WORLD_SIZE=2\) but mpi4py is not installed"):
        detect_rank_and_world(None, None)
    assert main(["--input", str(corpus_slices[1]), "--output-prefix", str(tmp_path / "out"), "--vocab-file",
                 str(vocab_file), "--no-progress"]) == 2
    assert not list(tmp_path.glob("out*"))
    assert detect_rank_and_world(1, 2) == (1, 2, None)
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "1")
    assert detect_rank_and_world(None, None) == (0, 1, None)


def test_without_mpi_and_without_root_the_mpi_tests_skip_saying_why(monkeypatch):
    import mpi_runtime

    monkeypatch.setattr(mpi_runtime, "missing_programs", lambda: ["mpirun", "mpicc"])
    monkeypatch.setattr(mpi_runtime, "has_mpi4py", lambda: False)
    monkeypatch.setattr(mpi_runtime.os, "geteuid", lambda: 1000)
    with pytest.raises(mpi_runtime.MpiUnavailable, match=r"missing \(mpirun, mpicc\).*not root.*apt-get install "
                                                         r"openmpi-bin libopenmpi-dev.*make mpi"):
        mpi_runtime.ensure_mpi()
