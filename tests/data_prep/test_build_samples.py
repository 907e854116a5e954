"""data_prep.build_samples: samples exactly as text_data.pack_samples, masks exactly mask_example
from (seed, split, sample, epoch), determinism across workers, reuse, blending, split, errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from data_prep.build_samples import (BuildConfig, BuildError, blend_counts, build, main, pack_sentences,
                                     parse_data_path, parse_split)
from data_prep.preprocess import PreprocessConfig, run
from megatron_pmlm.config import MaskingConfig
from megatron_pmlm.data.indexed import IndexedDatasetReader
from megatron_pmlm.data.samples import PretrainingSamples, assemble_tokens
from megatron_pmlm.data.masking import mask_example
from megatron_pmlm.data.text_data import pack_samples
from megatron_pmlm.tokenizer import WordPieceTokenizer



def _config(data_path, output, **overrides) -> BuildConfig:
    values = dict(split="90,8,2", seq_length=64, mask_epochs=2, seed=7, progress=False)
    values.update(overrides)
    return BuildConfig(data_path=[str(p) for p in data_path], output=str(output), **values)


def test_packing_is_exactly_pack_samples(tokenized, vocab_file):
    reader = IndexedDatasetReader(tokenized)
    special = WordPieceTokenizer(vocab_file).special
    documents = [reader.document(d) for d in range(reader.num_documents)]
    for seq_length in (64, 512):  # 64 exercises truncation and short targets, 512 long packing
        expected = pack_samples(documents, seq_length, special, np.random.default_rng(3), short_seq_prob=0.3)
        rows = pack_sentences(reader.sequence_lengths, reader.sequence_starts(np.arange(reader.num_sequences)),
                              reader.document_indices, np.arange(reader.num_documents), seq_length,
                              np.random.default_rng(3), short_seq_prob=0.3)
        ids, segments, lengths = assemble_tokens([reader], rows, special)
        assert len(rows) == len(expected) > 50
        cuts = np.cumsum(lengths)[:-1]
        for sample, got_ids, got_segments in zip(expected, np.split(ids, cuts), np.split(segments, cuts)):
            np.testing.assert_array_equal(got_ids, sample.input_ids)
            np.testing.assert_array_equal(got_segments, sample.token_type_ids)
        assert lengths.max() <= seq_length


def test_stored_masks_are_mask_example_from_the_seed(built, build_settings, vocab_file):
    seq_length, mask_epochs, seed = (build_settings[k] for k in ("seq_length", "mask_epochs", "seed"))
    tokenizer = WordPieceTokenizer(vocab_file)
    special_ids = tokenizer.special.all_ids()
    for split_id, split in enumerate(("train", "valid")):
        samples = PretrainingSamples(built, split)
        assert len(samples) > 10 and samples.mask_epochs == mask_epochs
        for index in (0, len(samples) // 2, len(samples) - 1):
            (ids,), (segments,) = samples.tokens([index])
            assert len(ids) <= seq_length and ids[0] == tokenizer.special.cls and ids[-1] == tokenizer.special.sep
            for epoch in range(mask_epochs):
                rng = np.random.default_rng([seed, split_id, index, epoch])
                expected = mask_example(ids, ~np.isin(ids, special_ids), rng, MaskingConfig(),
                                        tokenizer.vocab_size, special_ids, tokenizer.special.mask)
                (stored,) = samples.masks([index], epoch)
                np.testing.assert_array_equal(stored.masked_positions, expected.masked_positions)
                np.testing.assert_array_equal(stored.step_ids, expected.step_ids)
                np.testing.assert_array_equal(stored.corrupted_ids, expected.corrupted_ids)
    # Over the split: about 15% of the maskable tokens, never a special token, epochs differ.
    samples = PretrainingSamples(built, "train")
    indices = np.arange(len(samples))
    ids_list, _ = samples.tokens(indices)
    masks0, masks1 = samples.masks(indices, 0), samples.masks(indices, 1)
    maskable = sum(int((~np.isin(ids, special_ids)).sum()) for ids in ids_list)
    masked = sum(len(m.masked_positions) for m in masks0)
    assert 0.15 <= masked / maskable < 0.19
    for ids, mask in zip(ids_list[:200], masks0[:200]):
        assert not np.isin(ids[mask.masked_positions], special_ids).any()
    assert any(not np.array_equal(a.masked_positions, b.masked_positions) for a, b in zip(masks0, masks1))


def test_build_is_deterministic_across_workers_and_reused(tmp_path, tokenized, built, build_settings, capsys):
    again = tmp_path / "again"
    metadata = build(BuildConfig(data_path=[str(tokenized)], output=str(again), workers=2, samples_per_task=300,
                                 progress=False, **build_settings))
    for split in ("train", "valid", "test"):
        for name in ("samples", "mask_offsets", "mask_positions", "mask_steps", "mask_corrupted"):
            assert (again / split / f"{name}.bin").read_bytes() == (built / split / f"{name}.bin").read_bytes(), \
                (split, name)
    assert metadata["splits"]["train"]["num_samples"] == json.loads((built / "metadata.json").read_text())[
        "splits"]["train"]["num_samples"]
    # Same settings: reused, not rewritten.
    stamp = (again / "train" / "mask_steps.bin").stat().st_mtime_ns
    build(BuildConfig(data_path=[str(tokenized)], output=str(again), progress=False, **build_settings))
    assert "up to date" in capsys.readouterr().err
    assert (again / "train" / "mask_steps.bin").stat().st_mtime_ns == stamp
    # Other settings: refused unless --overwrite; a different seed gives different masks.
    with pytest.raises(BuildError, match="output exists"):
        build(_config([tokenized], again, seed=99))
    build(_config([tokenized], again, seed=99, overwrite=True))
    assert json.loads((again / "metadata.json").read_text())["seed"] == 99
    assert not list(tmp_path.glob("again.tmp-*")), "no temporary directory left behind"


def test_split_is_by_contiguous_documents(built):
    documents = {split: np.asarray(PretrainingSamples(built, split).rows[:, 1]) for split in ("train", "valid", "test")}
    assert documents["train"].max() < documents["valid"].min() <= documents["valid"].max() < documents["test"].min()
    metadata = json.loads((built / "metadata.json").read_text())
    assert metadata["split_fractions"] == pytest.approx([0.9, 0.08, 0.02])


def test_blending_follows_the_weights(tmp_path, wiki_and_books):
    wiki, books = wiki_and_books
    natural = build(_config([wiki, books], tmp_path / "natural", split="1"))
    sizes = natural["splits"]["train"]["natural_samples_per_corpus"]
    assert natural["splits"]["train"]["samples_per_corpus"] == sizes  # no weights: each corpus once
    weighted = build(_config(["3", wiki, "1", books], tmp_path / "weighted", split="1", num_samples=[1000]))
    counts = weighted["splits"]["train"]["samples_per_corpus"]
    assert counts == [750, 250]
    rows = np.asarray(PretrainingSamples(tmp_path / "weighted", "train").rows)
    assert np.bincount(rows[:, 0]).tolist() == [750, 250]
    # Interleaved in proportion: every window of 100 holds about 75 wiki samples.
    assert all(70 <= (rows[i:i + 100, 0] == 0).sum() <= 80 for i in range(0, 900, 100))
    # Oversampling repeats whole passes: every books sample appears, some twice.
    books_rows = rows[rows[:, 0] == 1]
    unique = np.unique(books_rows, axis=0)
    assert len(unique) == min(250, sizes[1])
    assert blend_counts(np.array([1.0, 1.0, 1.0]), 10).tolist() == [4, 3, 3]


def test_long_sentences_are_split_at_build_time(tmp_path, corpus_slices, vocab_file):
    prefix = tmp_path / "long"
    run(PreprocessConfig(inputs=[str(corpus_slices[0])], output_prefix=str(prefix), vocab_file=str(vocab_file),
                         max_sentence_tokens=5000, progress=False))
    metadata = build(_config([prefix], tmp_path / "samples", seq_length=24))
    assert metadata["long_sentences_split"] > 0
    samples = PretrainingSamples(tmp_path / "samples", "train")
    ids, _ = samples.tokens(np.arange(len(samples)))
    assert max(len(i) for i in ids) <= 24
    # No token lost at the cut: the samples cover nearly the whole training text.
    assert sum(len(i) - 3 for i in ids) > 0.9 * sum(samples.rows[:, 3] + samples.rows[:, 5])


def test_bad_arguments_and_inputs(tmp_path, tokenized, corpus_slices, vocab_file, capsys):
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == [(0.3, "a"), (0.7, "b")]
    for bad, message in ((["0.3", "a", "b"], "mixes|odd|WEIGHT"), (["1", "a", "2"], "odd"),
                         (["-1", "a"], "negative"), (["0", "a"], "sum to zero")):
        with pytest.raises(BuildError, match=message):
            parse_data_path(bad)
    with pytest.raises(BuildError, match="--split"):
        parse_split("a,b")
    with pytest.raises(BuildError, match=r"missing\.idx does not exist"):
        build(_config([tmp_path / "missing"], tmp_path / "out"))
    with pytest.raises(BuildError, match="yields no training sample"):
        build(_config([tokenized], tmp_path / "out", split="0,1,0"))
    assert not (tmp_path / "out").exists()
    other_vocab = tmp_path / "vocab.txt"
    other_vocab.write_text(Path(vocab_file).read_text() + "extra\n")
    with pytest.raises(BuildError, match="not the vocabulary the corpora were tokenized with"):
        build(_config([tokenized], tmp_path / "out", vocab_file=str(other_vocab)))
    assert main(["--data-path", str(tmp_path / "missing"), "--output", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "missing.idx" in capsys.readouterr().err
    assert main(["--data-path", str(tokenized), "--output", str(tmp_path / "cli"), "--seq-length", "32",
                 "--mask-epochs", "1", "--split", "8,2", "--mask-prob", "0.3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "train:" in out and "valid:" in out
    assert json.loads((tmp_path / "cli" / "metadata.json").read_text())["masking"]["mask_prob"] == 0.3
