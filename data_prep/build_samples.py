"""Samples with precomputed block masks: `python -m data_prep.build_samples --data-path [W] PREFIX ... --output DIR`.

From tokenized corpora (data_prep.preprocess), per corpus: documents split train/valid/test in
contiguous ranges (`--split 949,50,1`), sentences packed BERT-style into `[SOS] S1 [EOS] S2 [EOS]`
exactly as `text_data.pack_samples` does (short-sequence probability 0.1, cut at sentence boundaries
within one document), corpora blended Megatron-style by weight; then for every sample K mask
epochs of Algorithm 1 + factorization order + 80/10/10 (`masking.mask_example`), each from a
generator seeded by (seed, split, sample, mask epoch). Deterministic given the seed and independent
of `--workers`. With `--layout palm` the samples are PALM's context/continuation pairs instead
(data_prep/palm_pairs.py: a context of whole sentences, at most --context-length tokens with
[CLS]/[SEP], and the sentences that follow, at most --continuation-length tokens with [SEP],
sliding by one sentence), in the same format, with the masks of the context alone.
The directory is written under a temporary name and renamed when complete; a
rerun with the same settings reuses it. Format: megatron_pmlm/data/samples.py.
Memory stays flat in the corpus size: the packed rows and the blend's picks stream to scratch files
in the temporary folder and are memory-mapped, the blend and the masks run window by window, and
at most 2 x --workers tasks are in flight; the main process adds 8 bytes a sample, each worker one
task (docs/data_prep.md, "At the paper's scale").
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from data_prep.palm_pairs import palm_pairs
from data_prep.sentences import split_long_sentences
from megatron_pmlm.config import (HelpFormatter, MaskingConfig, add_dataclass_arguments, dataclass_overrides,
                                  non_negative_int, positive_int)
from megatron_pmlm.data.indexed import (IndexedDatasetError, IndexedDatasetReader, bin_path, idx_path,
                                        token_dtype_for_vocab)
from megatron_pmlm.data.samples import (METADATA_FILE, SAMPLE_COLUMNS, SAMPLES_FORMAT_VERSION, SPLIT_NAMES,
                                        assemble_tokens, samples_identity)
from megatron_pmlm.data.masking import mask_example
from megatron_pmlm.files import check_output_folder, write_output_marker
from megatron_pmlm.data.text_data import pack_sentences
from megatron_pmlm.tokenizer import SpecialTokenIds, WordPieceTokenizer


class BuildError(ValueError):
    """Bad arguments or inputs for build_samples; the message names the culprit."""


LAYOUTS = ("pmlm", "palm")
PALM_CONTEXT_LENGTH = 400
"""PALM §3.1: the context, the first 80% of a fragment of at most 500 tokens."""
PALM_CONTINUATION_LENGTH = 100
PALM_BLOCK_PROB = 0.0
"""PALM's stage 1 is BERT's masked LM: single tokens, no blocks."""
SCRATCH_FOLDER = ".scratch"
"""In the temporary output folder: the packed rows and the blend's picks, removed before the rename."""


@dataclass
class BuildConfig:
    data_path: list[str]
    """`[W1] PREFIX1 [W2] PREFIX2 ...` (weights optional: without them each corpus counts once)."""
    output: str
    vocab_file: str | None = None
    """Default: the vocabulary recorded in PREFIX.json by preprocess (its hash is checked)."""
    split: str = "949,50,1"
    seq_length: int = 512
    short_seq_prob: float = 0.1
    mask_epochs: int = 10
    """K: training epoch e reads mask epoch e mod K."""
    seed: int = 1234
    num_samples: list[int] | None = None
    """Samples per split (train[,valid[,test]]) of the blend; default: the natural total of the split."""
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    workers: int = 1
    documents_per_chunk: int = 20000
    """Packing draws from one generator per chunk of documents, seeded by (seed, corpus, split,
    chunk): part of the result (recorded in the metadata), unlike the number of workers."""
    samples_per_task: int = 2048
    """Samples per masking task (no effect on the result: each sample has its own generators)."""
    overwrite: bool = False
    progress: bool | None = None
    layout: str = "pmlm"
    """pmlm: packed `[SOS] A [EOS] B [EOS]` samples; palm: context (seq_length = its length) and
    continuation pairs."""
    continuation_length: int = PALM_CONTINUATION_LENGTH
    """palm: the continuation's tokens plus its [SEP]."""

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise BuildError(f"--layout must be one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.layout == "palm" and self.seq_length < 3:
            raise BuildError(f"--context-length {self.seq_length} leaves no room for a sentence in [CLS] x [SEP]")
        if self.layout == "palm" and self.continuation_length < 2:
            raise BuildError(f"--continuation-length {self.continuation_length} leaves no room for a sentence "
                             "before [SEP]")
        if self.layout == "pmlm" and self.seq_length < 5:
            raise BuildError(f"--seq-length {self.seq_length} is too short for [SOS] S1 [EOS] S2 [EOS]")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise BuildError(f"--short-seq-prob must be in [0, 1], got {self.short_seq_prob}")
        if self.mask_epochs < 1:
            raise BuildError(f"--mask-epochs must be >= 1, got {self.mask_epochs}")
        if self.workers < 1:
            raise BuildError(f"--workers must be >= 1, got {self.workers}")


def parse_data_path(tokens: Sequence[str]) -> list[tuple[float | None, str]]:
    """Megatron's `--data-path`: either all prefixes, or weight/prefix pairs."""
    if not tokens:
        raise BuildError("--data-path needs at least one PREFIX")

    def is_number(text: str) -> bool:
        try:
            float(text)
            return True
        except ValueError:
            return False

    if not is_number(tokens[0]):
        if any(is_number(t) for t in tokens):
            raise BuildError(f"--data-path mixes weights and bare prefixes: {' '.join(tokens)}")
        return [(None, t) for t in tokens]
    if len(tokens) % 2:
        raise BuildError(f"--data-path needs WEIGHT PREFIX pairs, got an odd count: {' '.join(tokens)}")
    pairs = []
    for weight, prefix in zip(tokens[0::2], tokens[1::2]):
        if not is_number(weight) or is_number(prefix):
            raise BuildError(f"--data-path: expected WEIGHT PREFIX, got {weight!r} {prefix!r}")
        if float(weight) < 0:
            raise BuildError(f"--data-path: negative weight {weight} for {prefix}")
        pairs.append((float(weight), prefix))
    if sum(w for w, _ in pairs) <= 0:
        raise BuildError("--data-path: the weights sum to zero")
    return pairs


def parse_split(text: str) -> np.ndarray:
    """'949,50,1' (or '98,2', or '1') -> normalized train/valid/test fractions."""
    try:
        parts = [float(p) for p in text.replace("/", ",").split(",")]
    except ValueError:
        raise BuildError(f"--split {text!r}: expected comma-separated numbers like 949,50,1") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise BuildError(f"--split {text!r}: expected up to three non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    return np.array(parts) / sum(parts)


def split_document_ranges(num_documents: int, fractions: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous document ranges per split, Megatron's rounding."""
    bounds = [0]
    for fraction in fractions:
        bounds.append(bounds[-1] + int(round(fraction * num_documents)))
    shift = bounds[-1] - num_documents
    bounds = [max(0, b - shift) if i else 0 for i, b in enumerate(bounds)]
    bounds[-1] = num_documents
    return [(bounds[i], bounds[i + 1]) for i in range(3)]


def empty_split_warnings(entries: list[dict], fractions: np.ndarray, config: "BuildConfig",
                         splits_meta: dict[str, dict]) -> list[str]:
    """Why a split that --split gives a share ends empty: the split takes whole documents, so a corpus
    of few documents leaves a small share none (a one-document corpus is all training)."""
    warnings = []
    for split_id, name in enumerate(SPLIT_NAMES):
        if fractions[split_id] == 0 or splits_meta[name]["num_samples"] or (
                config.num_samples and split_id < len(config.num_samples) and config.num_samples[split_id] == 0):
            continue
        documents = sum(high - low for entry in entries
                        for low, high in [split_document_ranges(entry["num_documents"], fractions)[split_id]])
        total = sum(entry["num_documents"] for entry in entries)
        if documents == 0:
            needed = int(np.ceil(0.5 / fractions[split_id]))
            why = (f"too few documents for --split {config.split}: it takes whole documents, and "
                   f"{total:,} document(s) give the {name} split's {fractions[split_id]:.1%} share none "
                   f"(it needs about {needed:,} per corpus; or give it a larger share)")
        else:
            why = f"its {documents:,} document(s) yield no sample"
        warnings.append(f"the {name} split is empty: {why}")
    return warnings


_READERS: dict[str, IndexedDatasetReader] = {}


def _reader(prefix: str) -> IndexedDatasetReader:
    if prefix not in _READERS:
        _READERS[prefix] = IndexedDatasetReader(prefix)
    return _READERS[prefix]


PACK_BLOCK_SENTENCES = 1 << 16
"""A packing task reads its chunk's documents in blocks of about this many sentences (one document
at least): the per-sentence arrays of a block, not of the whole chunk (which can hold millions of
sentences), are what a worker holds. The blocks share the chunk's generator, so the result is the
chunk's whatever the block size."""


def _document_blocks(reader: IndexedDatasetReader, doc_lo: int, doc_hi: int) -> Iterator[tuple[int, int, int]]:
    """Consecutive (first document, end document, first sentence) of about PACK_BLOCK_SENTENCES sentences."""
    ends = np.asarray(reader.document_indices[doc_lo:doc_hi + 1], dtype=np.int64)
    low = 0
    while low < doc_hi - doc_lo:
        high = int(np.searchsorted(ends, ends[low] + PACK_BLOCK_SENTENCES, side="right")) - 1
        high = min(max(high, low + 1), doc_hi - doc_lo)
        yield doc_lo + low, doc_lo + high, int(ends[low])
        low = high


def _block_sentences(reader: IndexedDatasetReader, doc_lo: int, doc_hi: int,
                     sentence_lo: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Lengths, token starts and document bounds (from 0) of the sentences of documents [doc_lo, doc_hi)."""
    sentence_hi = int(reader.document_indices[doc_hi])
    lengths = np.asarray(reader.sequence_lengths[sentence_lo:sentence_hi], dtype=np.int64)
    starts = reader.sequence_starts(np.arange(sentence_lo, sentence_hi))
    bounds = np.asarray(reader.document_indices[doc_lo:doc_hi + 1], dtype=np.int64) - sentence_lo
    return lengths, starts, bounds


def _chunk_rows(parts: list[np.ndarray], corpus_index: int) -> np.ndarray:
    rows = np.concatenate(parts) if parts else np.zeros((0, len(SAMPLE_COLUMNS)), np.int64)
    rows[:, 0] = corpus_index
    return rows


def pack_task(task: tuple) -> tuple[int, np.ndarray, int]:
    """Pack documents [doc_lo, doc_hi) of one corpus: (task id, rows, long sentences split)."""
    task_id, prefix, corpus_index, doc_lo, doc_hi, seq_length, short_seq_prob, seed_key = task
    reader = _reader(prefix)
    max_tokens = seq_length - 3
    rng = np.random.default_rng(seed_key)
    parts, long_count = [], 0
    for block_lo, block_hi, sentence_lo in _document_blocks(reader, doc_lo, doc_hi):
        lengths, starts, bounds = _block_sentences(reader, block_lo, block_hi, sentence_lo)
        long_in_block = int((lengths > max_tokens).sum())
        if long_in_block:  # split, as preprocess does: tokens stay put, only the boundaries move
            lengths, pieces = split_long_sentences(lengths, max_tokens)
            offset_in_sentence = (np.arange(len(lengths)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * max_tokens
            starts = np.repeat(starts, pieces) + offset_in_sentence
            bounds = np.concatenate([[0], np.cumsum(pieces)])[bounds]
        long_count += long_in_block
        parts.append(pack_sentences(lengths, starts, bounds, np.arange(block_lo, block_hi), seq_length, rng,
                                    short_seq_prob))
    return task_id, _chunk_rows(parts, corpus_index), long_count


def palm_pair_task(task: tuple) -> tuple[int, np.ndarray, int]:
    """PALM pairs of documents [doc_lo, doc_hi) of one corpus: (task id, rows, long sentences cut)."""
    task_id, prefix, corpus_index, doc_lo, doc_hi, context_length, continuation_length = task
    reader = _reader(prefix)
    parts, long_count = [], 0
    for block_lo, block_hi, sentence_lo in _document_blocks(reader, doc_lo, doc_hi):
        lengths, starts, bounds = _block_sentences(reader, block_lo, block_hi, sentence_lo)
        rows, long_in_block = palm_pairs(lengths, starts, bounds, np.arange(block_lo, block_hi), context_length,
                                         continuation_length)
        parts.append(rows)
        long_count += long_in_block
    return task_id, _chunk_rows(parts, corpus_index), long_count


def mask_task(task: tuple) -> tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Masks of K mask epochs for a chunk of blended samples: (task id, entries per (sample, epoch),
    positions, steps, corrupted ids), flat in factorization order."""
    (task_id, rows, first_index, prefixes, special_json, vocab_size, masking_json, mask_epochs,
     seed, split_id) = task
    special = SpecialTokenIds(**special_json)
    masking = MaskingConfig(**masking_json)
    special_ids = special.all_ids()
    ids, _, lengths = assemble_tokens([_reader(p) for p in prefixes], rows, special)
    counts, positions, steps, corrupted = [], [], [], []
    start = 0
    for offset, length in enumerate(lengths.tolist()):
        sample_ids = ids[start:start + length]
        start += length
        maskable = ~np.isin(sample_ids, special_ids)
        for epoch in range(mask_epochs):
            rng = np.random.default_rng([seed, split_id, first_index + offset, epoch])
            masks = mask_example(sample_ids, maskable, rng, masking, vocab_size, special_ids, special.mask)
            counts.append(len(masks.masked_positions))
            positions.append(masks.masked_positions)
            steps.append(masks.step_ids)
            corrupted.append(masks.corrupted_ids)
    empty = np.zeros(0, np.int64)
    return (task_id, np.array(counts, dtype=np.int64), np.concatenate(positions or [empty]),
            np.concatenate(steps or [empty]), np.concatenate(corrupted or [empty]))


IN_FLIGHT_PER_WORKER = 2
"""Tasks submitted ahead of the one being consumed, per worker: keeps every worker busy while
bounding what waits in memory (the pool's own imap would buffer every finished result)."""


def _run_tasks(function, tasks: Iterable, total: int, workers: int, description: str, show: bool) -> Iterator:
    """Results in task order, from a spawn pool (or in-process for one worker), with a progress bar.
    `tasks` is drawn lazily, at most IN_FLIGHT_PER_WORKER x workers tasks ahead of the consumer."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc=description, disable=not show, dynamic_ncols=True)
    if workers == 1 or total <= 1:
        for task in tasks:
            yield function(task)
            bar.update()
    else:
        context = multiprocessing.get_context("spawn")
        with context.Pool(min(workers, total)) as pool:
            in_flight: deque = deque()
            for task in tasks:
                in_flight.append(pool.apply_async(function, (task,)))
                if len(in_flight) >= IN_FLIGHT_PER_WORKER * workers:
                    yield in_flight.popleft().get()
                    bar.update()
            while in_flight:
                yield in_flight.popleft().get()
                bar.update()
    bar.close()


# ---------------------------------------------------------------------------------------------
# Blending: each corpus contributes weight x total samples of a split, interleaved evenly.

def blend_counts(weights: np.ndarray, total: int) -> np.ndarray:
    """Largest-remainder rounding of weights x total (sums to total exactly)."""
    exact = weights / weights.sum() * total
    counts = np.floor(exact).astype(np.int64)
    remainder = total - int(counts.sum())
    counts[np.argsort(-(exact - counts), kind="stable")[:remainder]] += 1
    return counts


def _keys_below(count: int, threshold: float) -> int:
    """How many of a corpus's blend keys (k + 0.5) / count, k < count, are below threshold (they rise
    with k), with the very float arithmetic numpy applies to the keys."""
    k = min(count, max(0, int(threshold * count)))
    while k > 0 and (k - 1 + 0.5) / count >= threshold:
        k -= 1
    while k < count and (k + 0.5) / count < threshold:
        k += 1
    return k


def blended_windows(rows_per_corpus: Sequence[np.ndarray], counts: np.ndarray, seed: int, split_id: int,
                    scratch: Path, window: int) -> Iterator[np.ndarray]:
    """The blend, in consecutive windows of about `window` samples (at most window + corpora):
    counts[c] samples of corpus c (whole shuffled passes, then a partial one), the corpora
    interleaved in proportion, deterministically.

    The order is a stable sort of every sample by its key (k + 0.5) / counts[c]; all keys below a
    threshold form a prefix of each corpus, so the windows between thresholds j / W are sorted
    one at a time. The picks (8 bytes a sample) go to files in `scratch` and are memory-mapped: no
    array of every sample's rows, keys or order is ever built."""
    active = [c for c, count in enumerate(counts.tolist()) if count > 0]
    picks: dict[int, np.ndarray] = {}
    paths = []
    try:
        for corpus in active:
            count, available = int(counts[corpus]), len(rows_per_corpus[corpus])
            rng = np.random.default_rng([seed, split_id, corpus, 7])
            path = scratch / f"picks-{split_id}-{corpus}.bin"
            paths.append(path)
            with open(path, "wb") as handle:
                for start in range(0, count, available):  # whole passes, the last one cut
                    handle.write(rng.permutation(available)[:count - start].tobytes())
            picks[corpus] = np.memmap(path, dtype=np.int64, mode="r", shape=(count,))
        total = int(sum(int(counts[c]) for c in active))
        num_windows = max(1, -(-total // window))
        low = dict.fromkeys(active, 0)
        for j in range(1, num_windows + 1):
            high = {c: int(counts[c]) if j == num_windows else _keys_below(int(counts[c]), j / num_windows)
                    for c in active}
            parts, keys = [], []
            for corpus in active:
                if high[corpus] > low[corpus]:
                    indices = np.asarray(picks[corpus][low[corpus]:high[corpus]])
                    parts.append(np.asarray(rows_per_corpus[corpus][indices], dtype=np.int64))
                    keys.append((np.arange(low[corpus], high[corpus]) + 0.5) / int(counts[corpus]))
            low = high
            if parts:
                yield np.concatenate(parts)[np.argsort(np.concatenate(keys), kind="stable")]
    finally:
        picks.clear()
        for path in paths:
            path.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------

def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _file_sha256(path: Path, chunk_bytes: int = 1 << 24) -> str:
    """sha256 of a possibly large file (a corpus .idx), read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def _corpus_entries(config: BuildConfig) -> tuple[list[dict], WordPieceTokenizer]:
    pairs = parse_data_path(config.data_path)
    entries, vocab_file, vocab_hash = [], config.vocab_file, None
    for weight, prefix in pairs:
        try:
            reader = IndexedDatasetReader(prefix)
        except IndexedDatasetError as error:
            raise BuildError(str(error)) from None
        meta_path = Path(f"{prefix}.json")
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if meta.get("vocab_sha256"):
            if vocab_hash and meta["vocab_sha256"] != vocab_hash:
                raise BuildError(f"{prefix} was tokenized with another vocabulary than the corpora before it")
            vocab_hash = meta["vocab_sha256"]
            vocab_file = vocab_file or meta.get("vocab_file")
        entries.append({"prefix": str(Path(prefix).resolve()), "weight": weight,
                        "num_documents": reader.num_documents, "num_sentences": reader.num_sequences,
                        "num_tokens": reader.num_tokens, "bin_bytes": bin_path(prefix).stat().st_size,
                        "idx_bytes": idx_path(prefix).stat().st_size})
    if not vocab_file:
        raise BuildError("no vocabulary: pass --vocab-file (the corpora have no PREFIX.json from preprocess)")
    tokenizer = WordPieceTokenizer(vocab_file)
    if vocab_hash and _sha256(Path(vocab_file)) != vocab_hash:
        raise BuildError(f"{vocab_file} is not the vocabulary the corpora were tokenized with (sha256 differs)")
    for entry in entries:
        dtype = _reader(entry["prefix"]).dtype
        if np.issubdtype(dtype, np.integer) and tokenizer.vocab_size - 1 > np.iinfo(dtype).max:
            raise BuildError(f"{entry['prefix']}: tokens of dtype {dtype} cannot hold a vocabulary of "
                             f"{tokenizer.vocab_size}")
    return entries, tokenizer


def build(config: BuildConfig) -> dict:
    """Build (or reuse) the samples directory; returns its metadata."""
    started = time.perf_counter()
    output = Path(config.output)
    # `-`, a device, FIFO or socket whatever the flags; --overwrite over a folder of ours only.
    if config.overwrite:
        check_output_folder(output, "--output", True, recognise=_older_samples, error=BuildError)
    elif not output.is_dir():
        check_output_folder(output, "--output", False, error=BuildError)
    entries, tokenizer = _corpus_entries(config)
    fractions = parse_split(config.split)
    settings = {"data_path": [[e["weight"], e["prefix"], e["bin_bytes"], e["idx_bytes"]] for e in entries],
                "split": config.split, "seq_length": config.seq_length, "short_seq_prob": config.short_seq_prob,
                "mask_epochs": config.mask_epochs, "seed": config.seed, "num_samples": config.num_samples,
                "masking": asdict(config.masking), "documents_per_chunk": config.documents_per_chunk,
                "vocab_sha256": _sha256(tokenizer.vocab_file)}
    if config.layout == "palm":  # PMLM builds keep their settings (and reuse) unchanged
        settings.update(layout="palm", continuation_length=config.continuation_length)
    if output.exists():
        previous = (output / METADATA_FILE)
        if previous.is_file() and json.loads(previous.read_text()).get("settings") == settings:
            print(f"{output} is up to date with these settings: reusing it", file=sys.stderr)
            return json.loads(previous.read_text())
        if not config.overwrite:
            raise BuildError(f"output exists: {output} (built with other settings, or not a samples "
                             f"directory); use --overwrite to replace it")
    show = sys.stderr.isatty() if config.progress is None else config.progress
    prefixes = [e["prefix"] for e in entries]

    # 1. Pack every corpus, split by contiguous document ranges.
    pack_tasks, task_keys = [], []
    for corpus, entry in enumerate(entries):
        for split_id, (low, high) in enumerate(split_document_ranges(entry["num_documents"], fractions)):
            for chunk, doc_lo in enumerate(range(low, high, config.documents_per_chunk)):
                doc_hi = min(high, doc_lo + config.documents_per_chunk)
                if config.layout == "palm":
                    pack_tasks.append((len(pack_tasks), entry["prefix"], corpus, doc_lo, doc_hi, config.seq_length,
                                       config.continuation_length))
                else:
                    pack_tasks.append((len(pack_tasks), entry["prefix"], corpus, doc_lo, doc_hi, config.seq_length,
                                       config.short_seq_prob, [config.seed, corpus, split_id, chunk]))
                task_keys.append((corpus, split_id))
    tmp = output.with_name(f"{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_output_marker(tmp)
    position_dtype = np.dtype(np.uint16) if config.seq_length < 65536 else np.dtype(np.int32)
    # Steps never outnumber the masked tokens: at most the budget plus one overshooting block.
    max_steps = int(np.ceil(config.masking.mask_prob * config.seq_length)) + config.masking.max_block_len
    step_dtype = np.dtype(np.uint8) if max_steps < 256 else position_dtype
    token_dtype = token_dtype_for_vocab(tokenizer.vocab_size)
    splits_meta = {}
    try:
        # The packed rows stream to scratch files (48 bytes a sample, memory-mapped for the blend),
        # which go before the folder is renamed into place.
        scratch = tmp / SCRATCH_FOLDER
        scratch.mkdir()
        natural_counts = {(c, s): 0 for c in range(len(entries)) for s in range(3)}
        natural_files = {key: open(scratch / f"natural-{key[0]}-{key[1]}.bin", "wb") for key in natural_counts}
        long_sentences = 0
        pack_function = palm_pair_task if config.layout == "palm" else pack_task
        try:
            for task_id, rows, long_count in _run_tasks(pack_function, pack_tasks, len(pack_tasks), config.workers,
                                                        "packing", show):
                natural_files[task_keys[task_id]].write(np.ascontiguousarray(rows, dtype=np.int64).tobytes())
                natural_counts[task_keys[task_id]] += len(rows)
                long_sentences += long_count
        finally:
            for handle in natural_files.values():
                handle.close()
        for corpus, entry in enumerate(entries):
            if entry["weight"] != 0 and natural_counts[(corpus, 0)] == 0:
                raise BuildError(f"corpus {entry['prefix']} yields no training sample ({entry['num_documents']} "
                                 f"documents, split {config.split})")
        natural = {key: _rows_file(scratch / f"natural-{key[0]}-{key[1]}.bin", count)
                   for key, count in natural_counts.items()}
        for split_id, name in enumerate(SPLIT_NAMES):
            sizes = np.array([natural_counts[(c, split_id)] for c in range(len(entries))])
            weights = np.array([sizes[c] if e["weight"] is None else e["weight"] for c, e in enumerate(entries)],
                               dtype=np.float64)
            weights = np.where(sizes > 0, weights, 0.0)
            total = int(sizes.sum())
            if config.num_samples and split_id < len(config.num_samples):
                total = config.num_samples[split_id]
            counts = blend_counts(weights, total) if weights.sum() > 0 else np.zeros(len(entries), np.int64)
            blended = blended_windows([natural[(c, split_id)] for c in range(len(entries))], counts, config.seed,
                                      split_id, scratch, config.samples_per_task)
            splits_meta[name] = _write_split(tmp / name, blended, config, prefixes, tokenizer, split_id,
                                             position_dtype, step_dtype, token_dtype, show)
            splits_meta[name]["samples_per_corpus"] = counts.tolist()
            splits_meta[name]["natural_samples_per_corpus"] = sizes.tolist()
        metadata = {
            "format_version": SAMPLES_FORMAT_VERSION, "settings": settings,
            "seed": config.seed, "seq_length": config.seq_length, "short_seq_prob": config.short_seq_prob,
            "mask_epochs": config.mask_epochs, "masking": asdict(config.masking), "split": config.split,
            "split_fractions": fractions.tolist(), "blend": entries,
            "vocab_file": str(Path(tokenizer.vocab_file).resolve()), "vocab_sha256": settings["vocab_sha256"],
            "vocab_size": tokenizer.vocab_size, "special_ids": asdict(tokenizer.special),
            "dtypes": {"mask_positions": position_dtype.str, "mask_steps": step_dtype.str,
                       "mask_corrupted": token_dtype.str, "samples": "<i8", "mask_offsets": "<i8"},
            "sample_columns": list(SAMPLE_COLUMNS), "long_sentences_split": long_sentences,
            "splits": splits_meta, "build_seconds": round(time.perf_counter() - started, 2)}
        natural.clear()
        shutil.rmtree(scratch)
        if config.layout == "palm":
            metadata.update(layout="palm", continuation_length=config.continuation_length)
        # What the samples are, whatever their path: recorded with each checkpoint, compared on resume.
        metadata["identity"] = samples_identity(metadata, [_file_sha256(idx_path(prefix)) for prefix in prefixes])
        (tmp / METADATA_FILE).write_text(json.dumps(metadata, indent=1))
        for warning in empty_split_warnings(entries, fractions, config, splits_meta):
            print(f"warning: {warning}", file=sys.stderr)
        if output.is_dir() and not output.is_symlink():
            shutil.rmtree(output)
        elif output.is_symlink() or output.exists():  # a link (its target is kept) or a regular file
            output.unlink()
        os.replace(tmp, output)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return metadata


def _older_samples(folder: Path) -> bool:
    """A samples directory build_samples wrote before folders got OUTPUT_MARKER (its metadata.json)."""
    try:
        metadata = json.loads((folder / METADATA_FILE).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(metadata, dict) and {"format_version", "settings", "splits"} <= set(metadata)


def _rows_file(path: Path, count: int) -> np.ndarray:
    """Sample rows written raw (int64, SAMPLE_COLUMNS wide) to `path`, memory-mapped read-only."""
    if count == 0:
        return np.zeros((0, len(SAMPLE_COLUMNS)), dtype=np.int64)
    return np.memmap(path, dtype=np.int64, mode="r", shape=(count, len(SAMPLE_COLUMNS)))


def _mask_tasks(rows: np.ndarray, config: BuildConfig, prefixes: list[str], tokenizer: WordPieceTokenizer,
                split_id: int) -> Iterator[tuple]:
    """mask_task's tasks, one chunk of samples_per_task rows at a time (copied out of the map)."""
    for start in range(0, len(rows), config.samples_per_task):
        chunk = np.array(rows[start:start + config.samples_per_task], dtype=np.int64)
        if config.layout == "palm":  # the MLM masks cover [CLS] context [SEP] only
            chunk[:, 5] = 0
        yield (start // config.samples_per_task, chunk, start, prefixes, asdict(tokenizer.special),
               tokenizer.vocab_size, asdict(config.masking), config.mask_epochs, config.seed, split_id)


def _write_split(directory: Path, blended: Iterable[np.ndarray], config: BuildConfig, prefixes: list[str],
                 tokenizer: WordPieceTokenizer, split_id: int, position_dtype: np.dtype,
                 step_dtype: np.dtype, token_dtype: np.dtype, show: bool) -> dict:
    """samples.bin from the blend's windows, then the masks of its memory-mapped rows, task by task."""
    directory.mkdir(parents=True)
    num_samples = num_tokens = 0
    with open(directory / "samples.bin", "wb") as samples_file:
        for window in blended:
            samples_file.write(np.ascontiguousarray(window, dtype=np.int64).tobytes())
            num_samples += len(window)
            num_tokens += int((2 + window[:, 3] + np.where(window[:, 5] > 0, window[:, 5] + 1, 0)).sum())
    rows = _rows_file(directory / "samples.bin", num_samples)
    total_entries = 0
    with open(directory / "mask_offsets.bin", "wb") as offsets_file, \
            open(directory / "mask_positions.bin", "wb") as positions_file, \
            open(directory / "mask_steps.bin", "wb") as steps_file, \
            open(directory / "mask_corrupted.bin", "wb") as corrupted_file:
        offsets_file.write(np.zeros(1, np.int64).tobytes())
        for _, counts, positions, steps, corrupted in _run_tasks(
                mask_task, _mask_tasks(rows, config, prefixes, tokenizer, split_id),
                -(-num_samples // config.samples_per_task), config.workers, f"masking {SPLIT_NAMES[split_id]}",
                show):
            if len(steps) and steps.max() > np.iinfo(step_dtype).max:
                raise BuildError(f"{int(steps.max())} factorization steps do not fit {step_dtype}")
            offsets_file.write((total_entries + np.cumsum(counts)).astype(np.int64).tobytes())
            positions_file.write(positions.astype(position_dtype).tobytes())
            steps_file.write(steps.astype(step_dtype).tobytes())
            corrupted_file.write(corrupted.astype(token_dtype).tobytes())
            total_entries += int(counts.sum())
    return {"num_samples": num_samples, "num_mask_entries": total_entries, "num_tokens": num_tokens,
            "mean_length": num_tokens / num_samples if num_samples else 0.0}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_prep.build_samples", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--data-path", nargs="+", required=True, help="[W1] PREFIX1 [W2] PREFIX2 ...")
    parser.add_argument("--output", required=True, help="the samples directory to write")
    parser.add_argument("--vocab-file", help="default: the vocabulary recorded by preprocess in PREFIX.json")
    parser.add_argument("--split", default="949,50,1", help="train,valid,test proportions of each corpus's documents")
    parser.add_argument("--layout", default="pmlm", choices=LAYOUTS,
                        help="pmlm: packed sentence pairs for PMLM; palm: PALM's context/continuation pairs")
    parser.add_argument("--seq-length", type=positive_int, default=None,
                        help="pmlm: longest sample, specials included (default: 512)")
    parser.add_argument("--short-seq-prob", type=float, default=None,
                        help="pmlm: probability of a shorter random target (default: 0.1)")
    parser.add_argument("--context-length", type=positive_int, default=None,
                        help=f"palm: longest context, [CLS] and [SEP] included (default: {PALM_CONTEXT_LENGTH})")
    parser.add_argument("--continuation-length", type=positive_int, default=None,
                        help=f"palm: longest continuation, its [SEP] included (default: {PALM_CONTINUATION_LENGTH})")
    parser.add_argument("--mask-epochs", type=int, default=10,
                        help="K precomputed masks per sample; training epoch e uses mask epoch e mod K")
    parser.add_argument("--seed", type=non_negative_int, default=1234, help="drives packing, blending and masks")
    parser.add_argument("--num-samples", help="samples per split of the blend: TRAIN[,VALID[,TEST]]")
    parser.add_argument("--workers", type=int, default=1, help="processes computing masks")
    parser.add_argument("--documents-per-chunk", type=positive_int, default=20000,
                        help="packing unit (one generator per chunk); part of the result")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, batch jobs)")
    add_dataclass_arguments(parser, MaskingConfig)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        try:
            num_samples = [int(n) for n in args.num_samples.split(",")] if args.num_samples else None
        except ValueError:
            raise BuildError(f"--num-samples {args.num_samples!r}: expected TRAIN[,VALID[,TEST]] integers") from None
        masking = dataclass_overrides(args, MaskingConfig)
        if args.layout == "palm":
            for flag, value in (("--seq-length", args.seq_length), ("--short-seq-prob", args.short_seq_prob)):
                if value is not None:
                    raise BuildError(f"{flag} is for --layout pmlm; PALM pairs take --context-length and "
                                     "--continuation-length")
            seq_length = PALM_CONTEXT_LENGTH if args.context_length is None else args.context_length
            short_seq_prob = BuildConfig.short_seq_prob
            masking = {"block_prob": PALM_BLOCK_PROB, **masking}
        else:
            for flag, value in (("--context-length", args.context_length),
                                ("--continuation-length", args.continuation_length)):
                if value is not None:
                    raise BuildError(f"{flag} is for --layout palm; PMLM samples take --seq-length")
            seq_length = BuildConfig.seq_length if args.seq_length is None else args.seq_length
            short_seq_prob = BuildConfig.short_seq_prob if args.short_seq_prob is None else args.short_seq_prob
        config = BuildConfig(
            data_path=args.data_path, output=args.output, vocab_file=args.vocab_file, split=args.split,
            seq_length=seq_length, short_seq_prob=short_seq_prob, mask_epochs=args.mask_epochs,
            seed=args.seed, num_samples=num_samples, masking=MaskingConfig(**masking), layout=args.layout,
            continuation_length=(PALM_CONTINUATION_LENGTH if args.continuation_length is None
                                 else args.continuation_length),
            workers=args.workers, documents_per_chunk=args.documents_per_chunk, overwrite=args.overwrite, progress=False if args.no_progress else None)
        metadata = build(config)
    except (BuildError, IndexedDatasetError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    for name, info in metadata["splits"].items():
        print(f"{name}: {info['num_samples']:,} samples ({info['num_tokens']:,} tokens, mean length "
              f"{info['mean_length']:.1f}), per corpus {info['samples_per_corpus']}, "
              f"{info['num_mask_entries']:,} masked tokens over {metadata['mask_epochs']} mask epochs")
    if metadata["long_sentences_split"]:
        limit = ("the context or continuation budget" if metadata.get("layout") == "palm" else "seq_length - 3")
        print(f"sentences longer than {limit} split: {metadata['long_sentences_split']:,}")
    print(f"wrote {config.output} in {metadata['build_seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
