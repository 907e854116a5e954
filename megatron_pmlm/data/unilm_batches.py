"""UniLM v1's batches (models/unilm.py: the four LMs, their segment ids and layout in roles and
steps): the LM type of each sample, its n-gram masks and NSP partner, and the PMLMBatch they make.

Everything random - the LM type of a sample, its NSP partner, its n-gram masks - is a counter-based
hash of (seed, epoch, sample index, position), vectorized over the batch: the same sample gets the
same draw whatever batch, data-parallel layout or restart it appears in, and nothing consumes
extra samples (a random second segment is read by reference from another sample's first segment;
the sampler still yields every sample exactly once per epoch). The masks are drawn in the loader,
not stored by `build_samples`, because NSP changes a bidirectional sample's second segment and the
LM type changes which positions may be masked: a store of masks would need every combination.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..config import ConfigError, UniLMMaskingConfig
from ..models.layout import CONTEXT, IGNORE_INDEX, MASKED, ORIGINAL, PAD, PMLMBatch
from ..models.unilm import (BIDIRECTIONAL, LEFT_TO_RIGHT, LM_SEGMENT_IDS, LM_TYPES, NSP_IS_NEXT, NSP_IS_RANDOM,
                            RIGHT_TO_LEFT, SEQ2SEQ, unilm_predicted_index)
from .masking import non_special_ids, splitmix64 as _splitmix64
from .samples import A_LEN, A_START, B_LEN, B_START, CORPUS, DOCUMENT, PretrainingSamples, assemble_tokens


# --- counter-based randomness -------------------------------------------------------------------

# Independent streams of one sample's randomness.
_STREAM_LM_TYPE, _STREAM_NSP, _STREAM_PARTNER, _STREAM_ORDER, _STREAM_NGRAM, _STREAM_NGRAM_LEN, \
    _STREAM_TRIM, _STREAM_CORRUPT, _STREAM_RANDOM_TOKEN = range(1, 10)


def sample_keys(seed: int, epoch: int, sample_indices: np.ndarray) -> np.ndarray:
    """One uint64 key per sample: all of a sample's draws in an epoch are hashes of it."""
    with np.errstate(over="ignore"):
        base = _splitmix64(np.uint64(seed) * np.uint64(0x2545F4914F6CDD1D) + np.uint64(epoch) + np.uint64(7))
        return _splitmix64(base ^ np.asarray(sample_indices, dtype=np.uint64))


def _hash(keys: np.ndarray, stream: int, counters: np.ndarray | int = 0) -> np.ndarray:
    """uint64 draws for (sample key, stream, counter); counters broadcast against keys."""
    with np.errstate(over="ignore"):
        mixed = keys ^ (np.uint64(stream) << np.uint64(56))
        return _splitmix64(_splitmix64(mixed) ^ np.asarray(counters, dtype=np.uint64))


def _uniform(keys: np.ndarray, stream: int, counters: np.ndarray | int = 0) -> np.ndarray:
    """Floats in [0, 1) with 53 random bits."""
    return (_hash(keys, stream, counters) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def draw_lm_types(keys: np.ndarray, mixture: tuple[tuple[str, float], ...]) -> np.ndarray:
    """LM type per sample, drawn independently with the mixture's probabilities."""
    names = [name for name, _ in mixture]
    weights = np.array([weight for _, weight in mixture], dtype=np.float64)
    cumulative = np.cumsum(weights / weights.sum())
    choice = np.searchsorted(cumulative, _uniform(keys, _STREAM_LM_TYPE), side="right")
    choice = np.minimum(choice, len(names) - 1)
    return np.array([LM_TYPES.index(name) for name in names], dtype=np.int64)[choice]


# --- n-gram masking (UniLM v1) ------------------------------------------------------------------

def ngram_masks(is_candidate: np.ndarray, lengths: np.ndarray, keys: np.ndarray,
                config: UniLMMaskingConfig) -> np.ndarray:
    """Boolean [B, N]: UniLM v1's masked positions, vectorized over the batch.

    The released loader's rule with the paper's numbers: visit the candidate positions in a random
    order; a visited position already masked is skipped; otherwise with probability `ngram_prob`
    mask n ~ U{min_ngram..max_ngram} tokens from it, else one (a span stops at the first
    non-candidate or past the last candidate); stop once `n_pred = max(1, round(mask_prob x
    length))` are masked; if the last span overshoots, keep a random n_pred of them. The loop runs
    over visiting ranks (about n_pred of them), each step a few array operations on the batch.
    """
    batch, width = is_candidate.shape
    rows = np.arange(batch)
    positions = np.arange(width, dtype=np.uint64)[None, :]
    n_pred = np.maximum(1, np.round(config.mask_prob * lengths)).astype(np.int64)
    num_candidates = is_candidate.sum(1)
    n_pred = np.minimum(n_pred, num_candidates)
    order_keys = np.where(is_candidate, _uniform(keys[:, None], _STREAM_ORDER, positions), 2.0)
    visit_order = np.argsort(order_keys, axis=1, kind="stable")
    is_ngram = _uniform(keys[:, None], _STREAM_NGRAM, positions) < config.ngram_prob
    ngram_length = config.min_ngram + (_hash(keys[:, None], _STREAM_NGRAM_LEN, positions)
                                       % np.uint64(config.max_ngram - config.min_ngram + 1)).astype(np.int64)
    span_length = np.where(is_ngram, ngram_length, 1)  # indexed by the visited position
    last_candidate = np.where(num_candidates > 0,
                              width - 1 - np.argmax(is_candidate[:, ::-1], axis=1), -1)
    masked = np.zeros((batch, width), dtype=bool)
    count = np.zeros(batch, dtype=np.int64)
    for rank in range(int(num_candidates.max(initial=0))):
        active = (rank < num_candidates) & (count < n_pred)
        if not active.any():
            break
        start = visit_order[:, rank]
        extending = active & ~masked[rows, start]
        span = span_length[rows, start]
        for offset in range(config.max_ngram):
            position = start + offset
            inside = position <= last_candidate
            extending &= (offset < span) & inside & is_candidate[rows, np.minimum(position, width - 1)]
            if not extending.any():
                break
            newly = extending & ~masked[rows, np.minimum(position, width - 1)]
            masked[rows[extending], position[extending]] = True
            count += newly
    # Overshoot: keep a random n_pred of the masked positions.
    trim_keys = np.where(masked, _uniform(keys[:, None], _STREAM_TRIM, positions), 2.0)
    rank_of = np.argsort(np.argsort(trim_keys, axis=1, kind="stable"), axis=1, kind="stable")
    return masked & (rank_of < n_pred[:, None])


# --- batches ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class UniLMDraws:
    """What was drawn for a batch (kept for tests and `data_prep.inspect`-style views)."""

    lm_types: np.ndarray
    nsp_labels: np.ndarray
    """NSP_IS_NEXT / NSP_IS_RANDOM for bidirectional rows with a second segment, else -1."""
    partners: np.ndarray
    """The sample whose first segment became the random second segment (NSP_IS_RANDOM rows), else -1."""


def nsp_partners(samples: PretrainingSamples, indices: np.ndarray, keys: np.ndarray,
                 max_attempts: int = 64) -> np.ndarray:
    """For each sample, another sample of the split from the same corpus but another document,
    drawn by hash (attempt after attempt, vectorized, for the rows still without one)."""
    rows = samples.rows
    partner = np.full(len(indices), -1, dtype=np.int64)
    own = rows[indices]
    for attempt in range(max_attempts):
        todo = partner < 0
        if not todo.any():
            return partner
        candidate = (_hash(keys[todo], _STREAM_PARTNER, attempt) % np.uint64(len(samples))).astype(np.int64)
        other = rows[candidate]
        ok = (other[:, CORPUS] == own[todo, CORPUS]) & (other[:, DOCUMENT] != own[todo, DOCUMENT]) & \
             (other[:, A_LEN] > 0)
        partner[np.flatnonzero(todo)[ok]] = candidate[ok]
    missing = int(indices[partner < 0][0])
    raise ConfigError(f"next-sentence prediction found no sample from another document for sample {missing} of "
                      f"{samples.directory} ({samples.split}) in {max_attempts} draws: the corpus needs several "
                      f"documents (use an objective without NSP, e.g. unilm-s2s, for a single-document corpus)")


class UniLMBatchBuilder:
    """Sample indices (+ epoch) -> a PMLMBatch of UniLM v1 examples (no appended tokens)."""

    def __init__(self, samples: PretrainingSamples, objective, seed: int, max_length: int | None = None,
                 config: UniLMMaskingConfig = UniLMMaskingConfig()):
        if not objective.lm_mixture:
            raise ConfigError(f"objective {objective.name} is not a UniLM v1 objective")
        self.samples, self.objective, self.seed, self.max_length, self.config = (
            samples, objective, seed, max_length, config)

    def draw(self, indices: np.ndarray, epoch: int) -> tuple[np.ndarray, UniLMDraws]:
        """The sample rows with NSP partners swapped in, and what was drawn."""
        keys = sample_keys(self.seed, epoch, indices)
        lm_types = draw_lm_types(keys, self.objective.lm_mixture)
        rows = np.array(self.samples.rows[indices], dtype=np.int64)
        has_b = rows[:, B_LEN] > 0
        nsp = (lm_types == BIDIRECTIONAL) & has_b
        nsp_labels = np.full(len(indices), -1, dtype=np.int64)
        nsp_labels[nsp] = NSP_IS_NEXT
        random_next = nsp & (_uniform(keys, _STREAM_NSP) < self.config.nsp_random_prob)
        partners = np.full(len(indices), -1, dtype=np.int64)
        if random_next.any():
            partners[random_next] = nsp_partners(self.samples, indices[random_next], keys[random_next])
            partner_rows = self.samples.rows[partners[random_next]]
            # The partner's first segment, cut to this sample's B length, so the length never grows.
            rows[random_next, B_START] = partner_rows[:, A_START]
            rows[random_next, B_LEN] = np.minimum(partner_rows[:, A_LEN], rows[random_next, B_LEN])
            nsp_labels[random_next] = NSP_IS_RANDOM
        return rows, UniLMDraws(lm_types, nsp_labels, partners)

    def __call__(self, indices: np.ndarray, epoch: int) -> PMLMBatch:
        return self.build(indices, epoch)[0]

    def build(self, indices: np.ndarray, epoch: int) -> tuple[PMLMBatch, UniLMDraws]:
        indices = np.asarray(indices, dtype=np.int64)
        special = self.samples.special
        rows, draws = self.draw(indices, epoch)
        flat_ids, flat_segments, lengths = assemble_tokens(self.samples.corpora, rows, special)
        if self.max_length is not None and lengths.max() > self.max_length:
            raise ConfigError(f"a sequence of {int(lengths.max())} tokens exceeds the model's maximum sequence "
                              f"length of {self.max_length} (max_position_embeddings); shorten --seq-length")
        batch, width = len(indices), int(lengths.max())
        in_sequence = np.arange(width)[None, :] < lengths[:, None]
        ids = np.full((batch, width), special.pad, dtype=np.int64)
        ids[in_sequence] = flat_ids
        second = np.zeros((batch, width), dtype=bool)
        second[in_sequence] = flat_segments == 1
        keys = sample_keys(self.seed, epoch, indices)
        pmlm_batch = build_unilm_batch(ids, lengths, second, draws.lm_types, draws.nsp_labels, keys, special,
                                       self.samples.vocab_size, self.config)
        return pmlm_batch, draws


def build_unilm_batch(ids: np.ndarray, lengths: np.ndarray, second: np.ndarray, lm_types: np.ndarray,
                      nsp_labels: np.ndarray, keys: np.ndarray, special, vocab_size: int,
                      config: UniLMMaskingConfig = UniLMMaskingConfig()) -> PMLMBatch:
    """UniLM v1 examples -> PMLMBatch: n-gram masks, 80/10/10, and the LM types' segment ids, roles
    and steps (the module docstring's table). `ids` [B, N] right-padded `[SOS] A [EOS] B [EOS]`,
    `second` marks B and its [EOS], `keys` are the per-sample random keys."""
    batch, width = ids.shape
    in_sequence = np.arange(width)[None, :] < lengths[:, None]
    is_candidate = in_sequence & ~np.isin(ids, special.all_ids())
    masked = ngram_masks(is_candidate, lengths, keys, config)
    positions = np.arange(width, dtype=np.uint64)[None, :]
    draw = _uniform(keys[:, None], _STREAM_CORRUPT, positions)
    random_ids = non_special_ids(_hash(keys[:, None], _STREAM_RANDOM_TOKEN, positions), vocab_size,
                                 special.all_ids())
    corrupted = np.where(draw < config.replace_with_mask_prob, special.mask,
                         np.where(draw < config.replace_with_mask_prob + config.replace_with_random_prob,
                                  random_ids, ids))
    labels = np.where(masked, ids, IGNORE_INDEX)
    input_ids = np.where(masked, corrupted, ids)

    segment_ids = np.where(in_sequence, LM_SEGMENT_IDS[lm_types][:, :1], 0)
    segment_ids = np.where(second & in_sequence, LM_SEGMENT_IDS[lm_types][:, 1:], segment_ids)
    column = np.arange(width)[None, :]
    kind = lm_types[:, None]
    ordered = in_sequence & (
        ((kind == LEFT_TO_RIGHT) & (column > 0)) |
        ((kind == RIGHT_TO_LEFT) & (column < lengths[:, None] - 1)) |
        ((kind == SEQ2SEQ) & second))
    first_target = np.argmax(second, axis=1)
    steps = np.select([kind == LEFT_TO_RIGHT, kind == RIGHT_TO_LEFT, kind == SEQ2SEQ],
                      [column, lengths[:, None] - 1 - column, column - first_target[:, None] + 1], 0)
    steps = np.where(ordered, steps, 0)
    roles = np.where(ordered, ORIGINAL, np.where(masked, MASKED, CONTEXT))
    roles = np.where(in_sequence, roles, PAD)
    labels[:, 0] = np.where(nsp_labels >= 0, nsp_labels, IGNORE_INDEX)  # [SOS] is never masked
    position_ids = np.repeat(np.arange(width)[None, :], batch, axis=0)
    tensors = (input_ids, position_ids, segment_ids, roles, steps, labels)
    tensors = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in tensors]
    return PMLMBatch(*tensors, predicted_index=unilm_predicted_index(tensors[-1]))


def expected_visibility(lm_type: int, length: int, first_target: int) -> np.ndarray:
    """Boolean [length, length] (query i, key j) straight from SPEC §8's table, written without roles
    or steps: what `check_leakage` holds the model to."""
    i, j = np.arange(length)[:, None], np.arange(length)[None, :]
    if lm_type == BIDIRECTIONAL:
        return np.ones((length, length), dtype=bool)
    if lm_type == LEFT_TO_RIGHT:
        return j <= i
    if lm_type == RIGHT_TO_LEFT:
        return j >= i
    return (j < first_target) | ((i >= first_target) & (j >= first_target) & (j <= i))
