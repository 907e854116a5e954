"""Text -> documents -> sentences -> `[SOS] S1 [EOS] S2 [EOS]` samples, in memory.

The readable definition of what `data_prep` computes at corpus scale (its tests compare against
these functions): document and sentence splitting, and BERT-style packing of sentences.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np

from .tokenizer import SpecialTokenIds, WordPieceTokenizer

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
        if not path.is_file():
            raise FileNotFoundError(f"input file not found: {path}")
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


def pack_samples(documents: Sequence[Sequence[np.ndarray]], seq_length: int,
                 special: SpecialTokenIds, rng: np.random.Generator,
                 short_seq_prob: float = 0.1) -> list[Sample]:
    """BERT-style packing of whole sentences of one document into `[SOS] S1 [EOS] S2 [EOS]`.

    With probability `short_seq_prob` a sample targets a random shorter length (so the model also
    sees short inputs). S1 and S2 are contiguous: a chunk of sentences is split at a random
    sentence boundary. A chunk of one sentence gives `[SOS] S1 [EOS]`.
    """
    max_tokens = seq_length - 3
    if max_tokens < 2:
        raise ValueError(f"seq_length {seq_length} is too short for [SOS] S1 [EOS] S2 [EOS]")
    samples = []
    for sentences in documents:
        target = _target_length(max_tokens, rng, short_seq_prob)
        chunk: list[np.ndarray] = []
        chunk_tokens = 0
        for index, sentence in enumerate(sentences):
            chunk.append(sentence)
            chunk_tokens += len(sentence)
            if chunk_tokens >= target or index == len(sentences) - 1:
                samples.append(_make_sample(chunk, max_tokens, special, rng))
                chunk, chunk_tokens = [], 0
                target = _target_length(max_tokens, rng, short_seq_prob)
    return samples


def _target_length(max_tokens: int, rng: np.random.Generator, short_seq_prob: float) -> int:
    return int(rng.integers(2, max_tokens + 1)) if rng.random() < short_seq_prob else max_tokens


def _make_sample(chunk: list[np.ndarray], max_tokens: int, special: SpecialTokenIds,
                 rng: np.random.Generator) -> Sample:
    split = int(rng.integers(1, len(chunk))) if len(chunk) > 1 else 1
    first = np.concatenate(chunk[:split])
    second = np.concatenate(chunk[split:]) if split < len(chunk) else np.zeros(0, dtype=first.dtype)
    # Cut the longer segment first, then both towards equal length, until the pair fits (what
    # BERT's one-token-at-a-time truncation converges to). A single segment also gets the room of
    # the [EOS] it does not need.
    budget = max_tokens if len(second) else max_tokens + 1
    if len(first) + len(second) > budget:
        if len(first) >= len(second):
            keep_first = max(budget - len(second), (budget + 1) // 2)
            first, second = first[:keep_first], second[:budget - keep_first]
        else:
            keep_second = max(budget - len(first), (budget + 1) // 2)
            first, second = first[:budget - keep_second], second[:keep_second]
    parts = [[special.cls], first, [special.sep]] + ([second, [special.sep]] if len(second) else [])
    ids = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    segments = np.zeros(len(ids), dtype=np.int64)
    if len(second):
        segments[len(first) + 2:] = 1
    return Sample(ids, segments)
