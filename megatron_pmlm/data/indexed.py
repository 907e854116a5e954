"""Megatron's memory-mapped indexed dataset (.bin/.idx, SPEC §11): writer, validating reader, merge.

The format is megatron-core's own (`megatron.core.datasets.indexed_dataset.IndexedDataset` opens what
we write); we keep our own small reader so the data tools and the loader do not import
megatron-core (seconds of start-up), and so a truncated or foreign file fails on open with a message
naming it instead of an assertion deep in a memmap.

.idx, little-endian: magic (9 bytes), version u64 = 1, dtype code u8, sequence count u64, document
count u64, int32 sequence lengths, int64 byte pointers into .bin, int64 document indices (starting
at 0; each the sequence index where a document ends). Here a sequence is one sentence.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Sequence

import numpy as np

from ..files import file_problem

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
DTYPE_CODES: dict[int, type] = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64,
                                6: np.float64, 7: np.float32, 8: np.uint16}
_CODE_OF_DTYPE = {np.dtype(v): k for k, v in DTYPE_CODES.items()}
CHECK_BLOCK_ENTRIES = 1 << 20
"""The document indices are checked in blocks of this many entries: a whole-array diff would cost 16
bytes a document of private memory in every process that opens the corpus (each build_samples
worker, each loader rank)."""


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair is missing, truncated, foreign or inconsistent; the message names the file."""


def token_dtype_for_vocab(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (Megatron's rule: vocabulary < 65,500), else int32."""
    return np.dtype(np.uint16) if vocab_size < 65500 else np.dtype(np.int32)


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


def write_index(path: Path, dtype: np.dtype, sequence_lengths: np.ndarray,
                document_indices: np.ndarray) -> None:
    """Write an .idx file (not atomic by itself: callers write to a temporary name and rename)."""
    dtype = np.dtype(dtype)
    lengths = np.asarray(sequence_lengths, dtype=np.int32)
    doc_index = np.asarray(document_indices, dtype=np.int64)
    pointers = np.zeros(len(lengths), dtype=np.int64)
    if len(lengths):
        np.cumsum(lengths[:-1].astype(np.int64) * dtype.itemsize, out=pointers[1:])
    with open(path, "wb") as handle:
        handle.write(INDEX_MAGIC)
        handle.write(struct.pack("<Q", INDEX_VERSION))
        handle.write(struct.pack("<B", _CODE_OF_DTYPE[dtype]))
        handle.write(struct.pack("<Q", len(lengths)))
        handle.write(struct.pack("<Q", len(doc_index)))
        handle.write(lengths.tobytes())
        handle.write(pointers.tobytes())
        handle.write(doc_index.tobytes())


class IndexedDatasetWriter:
    """Streams documents (lists of sentences) into PREFIX.bin/.idx under temporary names.

    `finalize()` writes the index and renames both files into place; until then nothing exists
    under the final names, so a crash leaves no half-written dataset behind (only `*.tmp` files,
    which `abort()` removes).
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype):
        self.prefix = Path(prefix)
        self.dtype = np.dtype(dtype)
        if self.dtype not in _CODE_OF_DTYPE:
            raise ValueError(f"unsupported token dtype {self.dtype}")
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self._bin_tmp = Path(f"{bin_path(prefix)}.tmp")
        self._idx_tmp = Path(f"{idx_path(prefix)}.tmp")
        self._bin = open(self._bin_tmp, "wb")
        self._lengths: list[np.ndarray] = []
        self._doc_ends: list[np.ndarray] = []
        self._num_sequences = 0

    def add_documents(self, tokens: np.ndarray, sequence_lengths: np.ndarray,
                      sequences_per_document: np.ndarray) -> None:
        """Append documents given flat: all tokens, each sentence's length, each document's sentence
        count (documents with zero sentences are not allowed: drop them before)."""
        sequence_lengths = np.asarray(sequence_lengths, dtype=np.int64)
        sequences_per_document = np.asarray(sequences_per_document, dtype=np.int64)
        if int(sequence_lengths.sum()) != len(tokens) or int(sequences_per_document.sum()) != len(sequence_lengths):
            raise ValueError("add_documents: token, sentence and document counts disagree")
        if len(sequences_per_document) and sequences_per_document.min() <= 0:
            raise ValueError("add_documents: a document without sentences")
        self._bin.write(np.asarray(tokens, dtype=self.dtype).tobytes())
        self._lengths.append(sequence_lengths.astype(np.int32))
        self._doc_ends.append(self._num_sequences + np.cumsum(sequences_per_document))
        self._num_sequences += len(sequence_lengths)

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.concatenate(self._lengths) if self._lengths else np.zeros(0, np.int32)
        doc_index = np.concatenate([np.zeros(1, np.int64)] + self._doc_ends)
        write_index(self._idx_tmp, self.dtype, lengths, doc_index)
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))

    def abort(self) -> None:
        self._bin.close()
        for tmp in (self._bin_tmp, self._idx_tmp):
            tmp.unlink(missing_ok=True)


class IndexedDatasetReader:
    """Validating, memory-mapped view of PREFIX.bin/.idx: O(1) access to any sentence.

    Checked on open: both files exist, magic and version, dtype code, .idx size against its counts,
    document indices (start at 0, non-decreasing, end at the sequence count), pointers consistent
    with lengths, and the .bin size against the total token count.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = Path(prefix)
        index_file, data_file = idx_path(prefix), bin_path(prefix)
        for path in (index_file, data_file):
            problem = file_problem(path)
            if problem:
                raise IndexedDatasetError(f"indexed dataset file {path} {problem}")
        size = index_file.stat().st_size
        with open(index_file, "rb") as handle:
            header = handle.read(_HEADER_BYTES)
        if len(header) < _HEADER_BYTES or header[:9] != INDEX_MAGIC:
            raise IndexedDatasetError(f"{index_file}: not a Megatron indexed dataset index (bad magic)")
        version, code, num_sequences, num_doc_entries = struct.unpack("<QBQQ", header[9:])
        if version != INDEX_VERSION:
            raise IndexedDatasetError(f"{index_file}: unsupported index version {version}")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{index_file}: unknown dtype code {code}")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER_BYTES + 4 * num_sequences + 8 * num_sequences + 8 * num_doc_entries
        if size != expected:
            raise IndexedDatasetError(
                f"{index_file}: {size} bytes, expected {expected} for {num_sequences} sequences and "
                f"{num_doc_entries} document entries (truncated or foreign file)")
        index = np.memmap(index_file, mode="r", dtype=np.uint8)
        offset = _HEADER_BYTES
        self.sequence_lengths = np.frombuffer(index, np.int32, num_sequences, offset)
        offset += 4 * num_sequences
        self.sequence_pointers = np.frombuffer(index, np.int64, num_sequences, offset)
        offset += 8 * num_sequences
        self.document_indices = np.frombuffer(index, np.int64, num_doc_entries, offset)
        docs = self.document_indices
        block = CHECK_BLOCK_ENTRIES
        if num_doc_entries == 0 or docs[0] != 0 or docs[-1] != num_sequences or any(
                (np.diff(docs[start:start + block + 1]) < 0).any() for start in range(0, num_doc_entries, block)):
            raise IndexedDatasetError(f"{index_file}: inconsistent document indices")
        # O(1) checks only (an index of a 160 GB corpus has over a billion entries): the first and
        # last pointers must agree with the lengths; the .bin size with the last pointer.
        itemsize = self.dtype.itemsize
        if num_sequences:
            last = int(self.sequence_pointers[-1])
            if self.sequence_pointers[0] != 0 or last % itemsize or last < 0 or self.sequence_lengths[-1] < 0:
                raise IndexedDatasetError(f"{index_file}: sequence pointers disagree with the lengths")
            self.num_tokens = last // itemsize + int(self.sequence_lengths[-1])
        else:
            self.num_tokens = 0
        bin_size = data_file.stat().st_size
        if bin_size != self.num_tokens * self.dtype.itemsize:
            raise IndexedDatasetError(
                f"{data_file}: {bin_size} bytes, but {index_file} describes {self.num_tokens} tokens of "
                f"{self.dtype} ({self.num_tokens * self.dtype.itemsize} bytes): truncated or mismatched")
        self.tokens = (np.memmap(data_file, mode="r", dtype=self.dtype) if bin_size
                       else np.zeros(0, self.dtype))

    def sequence_starts(self, sequences: np.ndarray) -> np.ndarray:
        """Token offsets (in elements) of the given sentences in `tokens`."""
        return self.sequence_pointers[sequences] // self.dtype.itemsize

    @property
    def num_sequences(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def __len__(self) -> int:
        return self.num_sequences

    def __getitem__(self, i: int) -> np.ndarray:
        start = int(self.sequence_pointers[i]) // self.dtype.itemsize
        return np.asarray(self.tokens[start:start + int(self.sequence_lengths[i])])

    def document(self, d: int) -> list[np.ndarray]:
        return [self[i] for i in range(int(self.document_indices[d]), int(self.document_indices[d + 1]))]


def merge_indexed_datasets(prefixes: Sequence[str | os.PathLike], output_prefix: str | os.PathLike) -> None:
    """Concatenate datasets (same dtype) into one, streaming: memory is bounded by the largest part,
    not the total (a 160 GB corpus has an index of tens of GB). Atomic rename at the end."""
    readers = [IndexedDatasetReader(p) for p in prefixes]
    if not readers:
        raise ValueError("merge_indexed_datasets: nothing to merge")
    dtype = readers[0].dtype
    for reader in readers:
        if reader.dtype != dtype:
            raise IndexedDatasetError(f"{idx_path(reader.prefix)}: dtype {reader.dtype} differs from {dtype}")
    output_prefix = Path(output_prefix)
    bin_tmp, idx_tmp = Path(f"{bin_path(output_prefix)}.tmp"), Path(f"{idx_path(output_prefix)}.tmp")
    num_sequences = sum(r.num_sequences for r in readers)
    num_doc_entries = 1 + sum(r.num_documents for r in readers)
    try:
        with open(bin_tmp, "wb") as out:
            for reader in readers:
                with open(bin_path(reader.prefix), "rb") as part:
                    shutil.copyfileobj(part, out, 16 << 20)
        with open(idx_tmp, "wb") as out:
            out.write(INDEX_MAGIC)
            out.write(struct.pack("<QBQQ", INDEX_VERSION, _CODE_OF_DTYPE[dtype], num_sequences, num_doc_entries))
            for reader in readers:
                out.write(np.ascontiguousarray(reader.sequence_lengths).tobytes())
            byte_offset = 0
            for reader in readers:
                out.write((reader.sequence_pointers + np.int64(byte_offset)).tobytes())
                byte_offset += reader.num_tokens * dtype.itemsize
            out.write(np.zeros(1, np.int64).tobytes())
            sequence_offset = 0
            for reader in readers:
                out.write((reader.document_indices[1:] + np.int64(sequence_offset)).tobytes())
                sequence_offset += reader.num_sequences
        os.replace(bin_tmp, bin_path(output_prefix))
        os.replace(idx_tmp, idx_path(output_prefix))
    finally:
        bin_tmp.unlink(missing_ok=True)
        idx_tmp.unlink(missing_ok=True)
