"""Text -> documents -> sentences -> `[SOS] S1 [EOS] S2 [EOS]` samples, in memory.

The readable definition of what `data_prep` computes at corpus scale (its tests compare against
these functions): document and sentence splitting, and BERT-style packing of sentences.
"""

from __future__ import annotations

import re
from array import array
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from ..files import file_problem
from ..tokenizer import SpecialTokenIds, WordPieceTokenizer

# A sentence ends at . ! or ? (optionally closed by quotes/brackets) followed by whitespace and an
# upper-case letter, a digit or an opening quote/bracket. Good enough for English prose; an
# abbreviation like "e.g. The" splits wrongly, which costs a sentence boundary, not correctness.
_SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z0-9\"'(\[])")


def split_sentences(paragraph: str) -> list[str]:
    text = " ".join(paragraph.split())
    return [s for s in _SENTENCE_END.split(text) if s]


def read_text_documents(paths: Iterable[str | Path]) -> Iterator[str]:
    """Documents of plain-text files: runs of non-blank lines separated by blank lines."""
    for path in paths:
        path = Path(path)
        problem = file_problem(path)
        if problem:
            raise FileNotFoundError(f"input file {path} {problem}")
        lines: list[str] = []
        with open(path, encoding="utf-8", errors="replace") as handle:
            for line in handle:
                if line.strip():
                    lines.append(line)
                elif lines:
                    yield "".join(lines)
                    lines = []
        if lines:
            yield "".join(lines)


def tokenize_documents(documents: Iterable[str], tokenizer: WordPieceTokenizer,
                       max_sentence_tokens: int) -> list[list[np.ndarray]]:
    """Each document as a list of tokenized sentences; sentences longer than `max_sentence_tokens`
    are cut into pieces, empty ones dropped, documents without tokens skipped."""
    out = []
    for document in documents:
        sentences = split_sentences(document)
        pieces = []
        for ids in tokenizer.encode_batch(sentences):
            pieces.extend(ids[i:i + max_sentence_tokens] for i in range(0, len(ids), max_sentence_tokens))
        if pieces:
            out.append(pieces)
    return out


@dataclass(frozen=True)
class Sample:
    input_ids: np.ndarray
    token_type_ids: np.ndarray


def pack_sentences(sentence_lengths: Sequence[int], sentence_starts: Sequence[int],
                   document_bounds: Sequence[int], document_ids: Sequence[int], seq_length: int,
                   rng: np.random.Generator, short_seq_prob: float = 0.1) -> np.ndarray:
    """BERT-style packing of whole sentences of one document into `[SOS] S1 [EOS] S2 [EOS]`, on
    sentence lengths only: rows (corpus=0, document, a_start, a_len, b_start, b_len), the two
    segments as token ranges (sentence_starts index the tokens of each sentence).

    Documents are [document_bounds[d], document_bounds[d+1]) of the sentences; every sentence must
    fit in seq_length - 3 tokens. With probability `short_seq_prob` a sample targets a random
    shorter length (so the model also sees short inputs). S1 and S2 are contiguous: a chunk of
    sentences is split at a random sentence boundary; a chunk of one sentence gives
    `[SOS] S1 [EOS]`. An over-long pair is cut from the longer segment first, then both towards
    equal length (what BERT's one-token-at-a-time truncation converges to).
    """
    max_tokens = seq_length - 3
    # Python ints one document at a time: whole-chunk lists cost ~36 bytes a sentence per list
    # (a chunk of 20,000 documents holds a million sentences); the rows go to a flat int64 array.
    lengths_array = np.asarray(sentence_lengths, dtype=np.int64)
    starts_array = np.asarray(sentence_starts, dtype=np.int64)
    bounds = np.asarray(document_bounds, dtype=np.int64).tolist()
    rows = array("q")

    def target_length() -> int:
        return int(rng.integers(2, max_tokens + 1)) if rng.random() < short_seq_prob else max_tokens

    for d in range(len(bounds) - 1):
        low, high = bounds[d], bounds[d + 1]
        lengths = lengths_array[low:high].tolist()
        starts = starts_array[low:high].tolist()
        prefix = list(accumulate(lengths, initial=0))  # document-relative, as are the indices below
        document_id = int(document_ids[d])
        target = target_length()
        chunk_start, chunk_tokens = 0, 0
        for i in range(high - low):
            chunk_tokens += lengths[i]
            if chunk_tokens < target and i != high - low - 1:
                continue
            count = i + 1 - chunk_start
            split = int(rng.integers(1, count)) if count > 1 else 1
            middle = chunk_start + split
            first = prefix[middle] - prefix[chunk_start]
            second = prefix[i + 1] - prefix[middle]
            budget = max_tokens if second else max_tokens + 1
            if first + second > budget:
                if first >= second:
                    keep_first = max(budget - second, (budget + 1) // 2)
                    first, second = min(first, keep_first), min(second, budget - keep_first)
                else:
                    keep_second = max(budget - first, (budget + 1) // 2)
                    first, second = min(first, budget - keep_second), min(second, keep_second)
            rows.extend((0, document_id, starts[chunk_start], first, starts[middle] if second else 0, second))
            chunk_start, chunk_tokens = i + 1, 0
            target = target_length()
    return np.frombuffer(rows, dtype=np.int64).reshape(-1, 6) if rows else np.zeros((0, 6), np.int64)


def pack_samples(documents: Sequence[Sequence[np.ndarray]], seq_length: int,
                 special: SpecialTokenIds, rng: np.random.Generator,
                 short_seq_prob: float = 0.1) -> list[Sample]:
    """`pack_sentences` over in-memory documents (lists of tokenized sentences), as token arrays."""
    if seq_length - 3 < 2:
        raise ValueError(f"seq_length {seq_length} is too short for [SOS] S1 [EOS] S2 [EOS]")
    sentences = [sentence for document in documents for sentence in document]
    if not sentences:
        return []
    lengths = np.array([len(s) for s in sentences], dtype=np.int64)
    starts = np.cumsum(lengths) - lengths
    bounds = np.concatenate([[0], np.cumsum([len(d) for d in documents])])
    rows = pack_sentences(lengths, starts, bounds, np.arange(len(documents)), seq_length, rng, short_seq_prob)
    tokens = np.concatenate(sentences).astype(np.int64)
    samples = []
    for _, _, a_start, a_len, b_start, b_len in rows.tolist():
        parts = [[special.cls], tokens[a_start:a_start + a_len], [special.sep]]
        if b_len:
            parts += [tokens[b_start:b_start + b_len], [special.sep]]
        ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
        segments = np.zeros(len(ids), dtype=np.int64)
        segments[a_len + 2:] = 1 if b_len else 0
        samples.append(Sample(ids, segments))
    return samples
