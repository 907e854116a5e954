"""Sentence-length arithmetic shared by preprocess and build_samples (numpy only, no torch)."""

from __future__ import annotations

import numpy as np


def split_long_sentences(lengths: np.ndarray, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """Sentence lengths after cutting each into pieces of at most `max_tokens` (tokens stay put,
    only the boundaries change); returns (new lengths, pieces per original sentence)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    pieces = np.maximum(1, -(-lengths // max_tokens))
    new_lengths = np.full(int(pieces.sum()), max_tokens, dtype=np.int64)
    last_piece = np.cumsum(pieces) - 1
    new_lengths[last_piece] = lengths - (pieces - 1) * max_tokens
    return new_lengths, pieces
