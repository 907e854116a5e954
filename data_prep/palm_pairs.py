"""PALM's context/continuation pairs (SPEC §9 data), on sentence lengths only (numpy, no torch).

From every sentence of a document on (stride one sentence), the context is the longest run of
whole consecutive sentences that fits the encoder (`[CLS] x [SEP]` <= context_length), and the
continuation is the longest run of the sentences right after it that fits the decoder
(`y [SEP]` <= continuation_length). A start whose context already reaches the document's end has
no continuation and gives no pair. Sentences longer than either budget are first cut into pieces
that fit (as build_samples does for PMLM), so every start yields a non-empty context.
"""

from __future__ import annotations

import numpy as np

from data_prep.sentences import split_long_sentences

CONTEXT_SPECIALS = 2
"""[CLS] and [SEP] around the context."""
CONTINUATION_SPECIALS = 1
"""The [SEP] the decoder predicts after the continuation ([CLS], its first input, is no target)."""


def longest_fitting_run(prefix: np.ndarray, first: np.ndarray, last: np.ndarray, budget: int) -> np.ndarray:
    """For each start sentence `first`, the end (exclusive, at most `last`) of the longest run of
    sentences whose tokens fit `budget`; `prefix` is the cumulative token count (len n + 1)."""
    end = np.searchsorted(prefix, prefix[first] + budget, side="right") - 1
    return np.minimum(end, last)


def palm_pairs(lengths: np.ndarray, starts: np.ndarray, bounds: np.ndarray, document_ids: np.ndarray,
               context_length: int, continuation_length: int) -> tuple[np.ndarray, int]:
    """Rows (corpus=0, document, a_start, a_len, b_start, b_len) of every pair of the documents
    [bounds[d], bounds[d+1]) of the sentences, and how many long sentences were cut."""
    context_budget = context_length - CONTEXT_SPECIALS
    continuation_budget = continuation_length - CONTINUATION_SPECIALS
    piece = min(context_budget, continuation_budget)
    lengths = np.asarray(lengths, dtype=np.int64)
    starts = np.asarray(starts, dtype=np.int64)
    bounds = np.asarray(bounds, dtype=np.int64)
    long_count = int((lengths > piece).sum())
    if long_count:  # tokens stay put, only the boundaries move
        lengths, pieces = split_long_sentences(lengths, piece)
        offset_in_sentence = (np.arange(len(lengths)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * piece
        starts = np.repeat(starts, pieces) + offset_in_sentence
        bounds = np.concatenate([[0], np.cumsum(pieces)])[bounds]
    sentence_document = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
    document_end = bounds[1:][sentence_document]
    prefix = np.concatenate([[0], np.cumsum(lengths)])
    first = np.arange(len(lengths))
    context_end = longest_fitting_run(prefix, first, document_end, context_budget)
    has_continuation = context_end < document_end
    first, context_end = first[has_continuation], context_end[has_continuation]
    continuation_end = longest_fitting_run(prefix, context_end, document_end[has_continuation], continuation_budget)
    rows = np.zeros((len(first), 6), dtype=np.int64)
    rows[:, 1] = np.asarray(document_ids, dtype=np.int64)[sentence_document[first]]
    rows[:, 2] = starts[first]
    rows[:, 3] = prefix[context_end] - prefix[first]
    rows[:, 4] = starts[context_end]
    rows[:, 5] = prefix[continuation_end] - prefix[context_end]
    return rows, long_count
