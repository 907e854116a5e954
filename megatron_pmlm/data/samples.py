"""The on-disk samples of `data_prep.build_samples` and their O(1) memory-mapped reader.

A built dataset is a directory:
    metadata.json          seed, seq length, vocabulary hash/size, special ids, split, blend, K,
                           counts, dtypes, format version (validated on open)
    SPLIT/samples.bin      int64 [n, 6]: corpus, document, a_start, a_len, b_start, b_len
    SPLIT/mask_offsets.bin int64 [n * K + 1]: masks of (sample i, mask epoch e) are entries
                           offsets[i*K + e] : offsets[i*K + e + 1] of the three arrays below
    SPLIT/mask_positions.bin (uint16 for seq < 65,536), mask_steps.bin (uint8 while the steps of a
                           sample fit, else as positions), mask_corrupted.bin (token dtype)

Samples are stored as references into the tokenized corpora (.bin/.idx), not as tokens: a sample
`[SOS] A [EOS] B [EOS]` is two contiguous token ranges of one document (its sentences are adjacent
in .bin), so 48 bytes describe it whatever its length, nothing of the 160 GB corpus is copied,
and reading one costs two slices of a memmap. The masks are stored per (sample, mask epoch) as
flat arrays in factorization order, about 0.15 x 5 bytes per token, never n x n.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .masking import ExampleMasks, expand_ranges
from ..tokenizer import SpecialTokenIds
from .indexed import IndexedDatasetError, IndexedDatasetReader, bin_path, idx_path

SAMPLES_FORMAT_VERSION = 1
METADATA_FILE = "metadata.json"
SPLIT_NAMES = ("train", "valid", "test")
SAMPLE_COLUMNS = ("corpus", "document", "a_start", "a_len", "b_start", "b_len")
CORPUS, DOCUMENT, A_START, A_LEN, B_START, B_LEN = range(6)
MASK_ARRAYS = ("mask_positions", "mask_steps", "mask_corrupted")


class SamplesError(ValueError):
    """A built samples directory is missing, truncated or inconsistent; the message names the file."""


def assemble_tokens(corpora: list[IndexedDatasetReader], rows: np.ndarray,
                    special: SpecialTokenIds) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Token ids, segment ids and lengths of `[SOS] A [EOS] (B [EOS])` for sample rows, flat.

    One fancy-index gather per corpus; returns (ids [total], segments [total], lengths [b]).
    """
    rows = np.asarray(rows, dtype=np.int64).reshape(-1, len(SAMPLE_COLUMNS))
    a_len, b_len = rows[:, A_LEN], rows[:, B_LEN]
    has_b = b_len > 0
    lengths = 2 + a_len + np.where(has_b, b_len + 1, 0)
    sample_start = np.cumsum(lengths) - lengths
    total = int(lengths.sum())
    ids = np.empty(total, dtype=np.int64)
    segments = np.zeros(total, dtype=np.int64)
    # Destinations: A at start+1, its [EOS] after it, B after that, its [EOS] last.
    a_dest = expand_ranges(sample_start + 1, a_len)
    b_dest = expand_ranges(sample_start + 2 + a_len, b_len)
    a_source_all = expand_ranges(rows[:, A_START], a_len)
    b_source_all = expand_ranges(rows[:, B_START], b_len)
    a_corpus = np.repeat(rows[:, CORPUS], a_len)
    b_corpus = np.repeat(rows[:, CORPUS], b_len)
    for corpus_index in np.unique(rows[:, CORPUS]).tolist():  # a handful of corpora, not tokens
        tokens = corpora[corpus_index].tokens
        in_a, in_b = a_corpus == corpus_index, b_corpus == corpus_index
        ids[a_dest[in_a]] = tokens[a_source_all[in_a]]
        ids[b_dest[in_b]] = tokens[b_source_all[in_b]]
    ids[sample_start] = special.cls
    ids[sample_start + 1 + a_len] = special.sep
    ids[(sample_start + lengths - 1)[has_b]] = special.sep
    segments[b_dest] = 1
    segments[(sample_start + lengths - 1)[has_b]] = 1
    return ids, segments, lengths


def _raw_array(path: Path, dtype: np.dtype, count: int, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """Memory-map a raw array file whose size must be exactly count x itemsize."""
    if not path.is_file():
        raise SamplesError(f"missing file: {path}")
    dtype = np.dtype(dtype)
    expected = count * dtype.itemsize
    size = path.stat().st_size
    if size != expected:
        raise SamplesError(f"{path}: {size} bytes, expected {expected} ({count} x {dtype}): "
                           f"truncated or from another build; rebuild with data_prep.build_samples")
    if count == 0:
        return np.zeros(shape or (0,), dtype=dtype)
    array = np.memmap(path, mode="r", dtype=dtype, shape=(count,))
    return array.reshape(shape) if shape else array


def read_metadata(directory: str | os.PathLike) -> dict:
    directory = Path(directory)
    path = directory / METADATA_FILE
    if not path.is_file():
        hint = (" (this looks like a tokenized corpus: build samples from it with "
                "python -m data_prep.build_samples)") if idx_path(directory).is_file() else ""
        raise SamplesError(f"not a built samples directory: {path} is missing{hint}")
    try:
        metadata = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise SamplesError(f"{path}: not valid JSON ({error})") from None
    if metadata.get("format_version") != SAMPLES_FORMAT_VERSION:
        raise SamplesError(f"{path}: format version {metadata.get('format_version')!r}, this reader "
                           f"expects {SAMPLES_FORMAT_VERSION}; rebuild with data_prep.build_samples")
    return metadata


IDENTITY_BUILD_FIELDS = ("layout", "seq_length", "continuation_length", "short_seq_prob", "mask_epochs", "seed",
                         "split", "num_samples", "masking", "documents_per_chunk")
"""The build settings that change the samples (read from metadata["settings"]); the number of
workers and samples per task do not, and the paths are where the data is, not what it is."""


def samples_identity(metadata: dict, idx_sha256: list[str | None] | None = None) -> dict:
    """What the samples are, from their content rather than their path, so a moved samples folder
    (or corpus) keeps it: the vocabulary's sha256, each corpus's weight, .bin/.idx sizes and token
    count (plus the .idx's sha256 where build_samples recorded it: hashing the multi-GB .bin would
    cost minutes at every build, its size and the .idx's offsets pin it), the samples per split
    and the build settings. Cheap: read from metadata.json, never by re-reading the corpus, so
    folders built before it was recorded (no "identity" there) get the same parts but the .idx
    checksums. "digest": the sha256 of the rest, shortened, for log lines."""
    settings = metadata.get("settings", {}) or {}
    corpora = []
    for position, entry in enumerate(metadata.get("blend", [])):
        corpus = {name: entry.get(name) for name in ("weight", "bin_bytes", "idx_bytes", "num_tokens")}
        if idx_sha256 and idx_sha256[position]:
            corpus["idx_sha256"] = idx_sha256[position]
        corpora.append(corpus)
    identity = {"vocab_sha256": metadata.get("vocab_sha256"), "corpora": corpora,
                "samples": {name: info.get("num_samples") for name, info in (metadata.get("splits") or {}).items()},
                "build": {name: settings.get(name, metadata.get(name)) for name in IDENTITY_BUILD_FIELDS}}
    canonical = json.dumps(identity, sort_keys=True, default=str).encode()
    identity["digest"] = hashlib.sha256(canonical).hexdigest()[:16]
    return identity


def data_identity(metadata: dict) -> dict:
    """The identity recorded by build_samples, else the one computed from an older metadata.json."""
    recorded = metadata.get("identity")
    return recorded if isinstance(recorded, dict) and recorded.get("digest") else samples_identity(metadata)


def identity_changes(saved: dict, now: dict) -> list[str]:
    """What differs between two identities of samples with the same vocabulary, as "NAME A -> B"."""
    changes = []
    saved_build, now_build = saved.get("build") or {}, now.get("build") or {}
    for name in sorted(set(saved_build) | set(now_build)):
        if saved_build.get(name) != now_build.get(name):
            changes.append(f"{name} {saved_build.get(name)} -> {now_build.get(name)}")
    saved_samples, now_samples = saved.get("samples") or {}, now.get("samples") or {}
    for name in sorted(set(saved_samples) | set(now_samples)):
        if saved_samples.get(name) != now_samples.get(name):
            changes.append(f"{name} samples {saved_samples.get(name)} -> {now_samples.get(name)}")
    saved_corpora, now_corpora = saved.get("corpora") or [], now.get("corpora") or []
    if len(saved_corpora) != len(now_corpora):
        changes.append(f"corpora {len(saved_corpora)} -> {len(now_corpora)}")
    else:
        for position, (before, after) in enumerate(zip(saved_corpora, now_corpora)):
            differing = [name for name in sorted(set(before) | set(after))
                         if name in before and name in after and before[name] != after[name]]
            if differing:
                changes.append(f"corpus {position} ({', '.join(differing)}) differs")
    return changes or [f"identity {saved.get('digest')} -> {now.get('digest')}"]


def open_corpora(metadata: dict, base: Path) -> list[IndexedDatasetReader]:
    """The tokenized corpora of a build, checked against the sizes recorded at build time."""
    corpora = []
    for entry in metadata["blend"]:
        prefix = Path(entry["prefix"])
        if not prefix.is_absolute():
            prefix = base / prefix
        try:
            reader = IndexedDatasetReader(prefix)
        except IndexedDatasetError as error:
            raise SamplesError(f"corpus of this build cannot be opened: {error}") from None
        for path, recorded in ((bin_path(prefix), entry["bin_bytes"]), (idx_path(prefix), entry["idx_bytes"])):
            if path.stat().st_size != recorded:
                raise SamplesError(f"{path} changed since the samples were built ({path.stat().st_size} "
                                   f"bytes, built from {recorded}); rebuild the samples")
        corpora.append(reader)
    return corpora


class PretrainingSamples:
    """One split of a built dataset: O(1) access to sample i and its masks of any mask epoch."""

    def __init__(self, directory: str | os.PathLike, split: str = "train",
                 corpora: list[IndexedDatasetReader] | None = None):
        self.directory = Path(directory)
        self.metadata = read_metadata(self.directory)
        if split not in self.metadata["splits"]:
            raise SamplesError(f"{self.directory}: no split {split!r} (has: {', '.join(self.metadata['splits'])})")
        self.split = split
        info = self.metadata["splits"][split]
        self.num_samples = int(info["num_samples"])
        self.mask_epochs = int(self.metadata["mask_epochs"])
        self.seq_length = int(self.metadata["seq_length"])
        self.special = SpecialTokenIds(**self.metadata["special_ids"])
        self.vocab_size = int(self.metadata["vocab_size"])
        self.corpora = corpora if corpora is not None else open_corpora(self.metadata, self.directory)
        split_dir = self.directory / split
        self.rows = _raw_array(split_dir / "samples.bin", np.int64, self.num_samples * len(SAMPLE_COLUMNS),
                               (self.num_samples, len(SAMPLE_COLUMNS)))
        self.mask_offsets = _raw_array(split_dir / "mask_offsets.bin", np.int64,
                                       self.num_samples * self.mask_epochs + 1)
        num_entries = int(info["num_mask_entries"])
        if int(self.mask_offsets[-1]) != num_entries:
            raise SamplesError(f"{split_dir / 'mask_offsets.bin'}: ends at {int(self.mask_offsets[-1])}, "
                               f"metadata says {num_entries} mask entries")
        dtypes = self.metadata["dtypes"]
        self.mask_positions, self.mask_steps, self.mask_corrupted = (
            _raw_array(split_dir / f"{name}.bin", np.dtype(dtypes[name]), num_entries) for name in MASK_ARRAYS)

    def __len__(self) -> int:
        return self.num_samples

    def lengths(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """The lengths in tokens, `[SOS] A [EOS] (B [EOS])`, of samples start..stop (default: every
        sample), vectorized over the rows."""
        rows = np.asarray(self.rows[start:stop])
        return 2 + rows[:, A_LEN] + np.where(rows[:, B_LEN] > 0, rows[:, B_LEN] + 1, 0)

    def tokens(self, indices: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """(input_ids, segment_ids) per sample, as views of two flat arrays."""
        indices = self._check(indices)
        ids, segments, lengths = assemble_tokens(self.corpora, self.rows[indices], self.special)
        cuts = np.cumsum(lengths)[:-1]
        return np.split(ids, cuts), np.split(segments, cuts)

    def masks(self, indices: np.ndarray, epoch: int) -> list[ExampleMasks]:
        """The stored masks of training epoch `epoch` (mask epoch epoch mod K), in factorization order."""
        indices = self._check(indices)
        rows = indices * self.mask_epochs + (epoch % self.mask_epochs)
        starts, ends = self.mask_offsets[rows], self.mask_offsets[rows + 1]
        entries = expand_ranges(starts, ends - starts)
        cuts = np.cumsum(ends - starts)[:-1]
        arrays = [np.split(np.asarray(a[entries], dtype=np.int64), cuts)
                  for a in (self.mask_positions, self.mask_steps, self.mask_corrupted)]
        return [ExampleMasks(p, s, c) for p, s, c in zip(*arrays)]

    def _check(self, indices) -> np.ndarray:
        indices = np.atleast_1d(np.asarray(indices, dtype=np.int64))
        if len(indices) and (indices.min() < 0 or indices.max() >= self.num_samples):
            raise IndexError(f"sample index out of range for the {self.split} split of "
                             f"{self.num_samples} samples ({self.directory})")
        return indices


@dataclass(frozen=True)
class SampleView:
    """One sample and its masks, for inspection."""

    input_ids: np.ndarray
    segment_ids: np.ndarray
    masks: ExampleMasks
    row: np.ndarray


def get_sample(samples: PretrainingSamples, index: int, mask_epoch: int = 0) -> SampleView:
    ids, segments = samples.tokens([index])
    return SampleView(ids[0], segments[0], samples.masks([index], mask_epoch)[0], np.asarray(samples.rows[index]))


def recorded_vocab_sha256(run_args: dict[str, Any]) -> str | None:
    """The sha256 of the vocabulary a checkpoint's run was trained with, where it is recorded: the
    samples' identity saved with the checkpoint, else the metadata.json of the run's samples
    (data_prep.build_samples writes it); None when unknown."""
    identity = run_args.get("data_identity")
    if isinstance(identity, dict) and identity.get("vocab_sha256"):
        return identity["vocab_sha256"]
    data_path = run_args.get("data_path")
    if not data_path:
        return None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return json.loads((Path(data_path) / "metadata.json").read_text()).get("vocab_sha256") or None
    return None
