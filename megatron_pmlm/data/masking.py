"""Blockwise masking (UniLMv2 Algorithm 1), the factorization order, and 80/10/10 corruption.

One call per example turns a token sequence into its `ExampleMasks`: the masked positions grouped
by factorization step (steps in a uniformly random order), and the token each masked position
shows in the corrupted (AE) input. Everything is numpy and driven by an explicit Generator, so the
offline data tools can precompute masks reproducibly from a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import MaskingConfig

# Algorithm 1 proposes (start, length) pairs; they are drawn in chunks to keep numpy calls few.
_PROPOSAL_CHUNK = 64


@dataclass(frozen=True)
class ExampleMasks:
    """The masks of one example, in factorization order.

    masked_positions: int64 [m], positions of masked tokens, step by step (ascending within a step).
    step_ids: int64 [m], the factorization step (1..k) of each entry, non-decreasing.
    corrupted_ids: int64 [m], the token each masked position shows in the AE input.
    """

    masked_positions: np.ndarray
    step_ids: np.ndarray
    corrupted_ids: np.ndarray

    @property
    def num_steps(self) -> int:
        return int(self.step_ids[-1]) if len(self.step_ids) else 0


def sample_blocks(maskable: np.ndarray, rng: np.random.Generator,
                  config: MaskingConfig = MaskingConfig()) -> list[tuple[int, int]]:
    """Algorithm 1: (start, length) blocks in the order they were accepted.

    `maskable` is a bool array over the sequence, False at special tokens and padding. A proposal
    starts anywhere in the sequence; it is rejected if it runs past the end or touches a position
    that is masked already or not maskable. Sampling stops once the masked count reaches
    `mask_prob` x (number of maskable tokens), so the last block may overshoot by a few tokens,
    exactly as in the paper.
    """
    maskable = np.asarray(maskable, dtype=bool)
    length = len(maskable)
    num_maskable = int(maskable.sum())
    if num_maskable == 0:
        return []
    budget = config.mask_prob * num_maskable
    unavailable = ~maskable
    blocks: list[tuple[int, int]] = []
    masked_count = 0
    # A free single token is hit with probability >= (1 - block_prob) / length per proposal, so this
    # bound is never reached unless block_prob == 1 and no free run of min_block_len exists.
    max_proposals = 1000 * length + 10_000
    proposals = 0
    while masked_count < budget:
        if proposals >= max_proposals:
            raise RuntimeError(
                f"blockwise masking could not reach {budget:.1f} masked tokens in a sequence of "
                f"{length} with {num_maskable} maskable tokens (block lengths "
                f"{config.min_block_len}-{config.max_block_len}, block_prob {config.block_prob})")
        starts = rng.integers(0, length, _PROPOSAL_CHUNK)
        is_block = rng.random(_PROPOSAL_CHUNK) < config.block_prob
        block_lengths = rng.integers(config.min_block_len, config.max_block_len + 1, _PROPOSAL_CHUNK)
        lengths = np.where(is_block, block_lengths, 1)
        proposals += _PROPOSAL_CHUNK
        for start, block_length in zip(starts.tolist(), lengths.tolist()):
            end = start + block_length
            if end > length or unavailable[start:end].any():
                continue
            unavailable[start:end] = True
            blocks.append((start, block_length))
            masked_count += block_length
            if masked_count >= budget:
                break
    return blocks


def mask_example(input_ids: np.ndarray, maskable: np.ndarray, rng: np.random.Generator,
                 config: MaskingConfig, vocab_size: int, special_token_ids: np.ndarray,
                 mask_token_id: int, single_token_steps: bool = False) -> ExampleMasks:
    """Masks for one example: Algorithm 1 blocks, a random factorization order, 80/10/10.

    With `single_token_steps` (the AR objective) every masked token becomes a step of its own;
    the masked positions are still chosen by Algorithm 1 so AR and PAR see the same masking budget.
    """
    input_ids = np.asarray(input_ids)
    blocks = sample_blocks(maskable, rng, config)
    if not blocks:
        empty = np.zeros(0, dtype=np.int64)
        return ExampleMasks(empty, empty.copy(), empty.copy())
    starts = np.array([b[0] for b in blocks], dtype=np.int64)
    lengths = np.array([b[1] for b in blocks], dtype=np.int64)
    if single_token_steps:
        starts = expand_ranges(starts, lengths)
        lengths = np.ones_like(starts)
    # One uniformly random factorization order over the steps (the paper samples one per example).
    order = rng.permutation(len(starts))
    starts, lengths = starts[order], lengths[order]
    positions = expand_ranges(starts, lengths)
    step_ids = np.repeat(np.arange(1, len(starts) + 1, dtype=np.int64), lengths)
    corrupted = corrupt_tokens(input_ids[positions], rng, config, vocab_size, special_token_ids,
                               mask_token_id)
    return ExampleMasks(positions, step_ids, corrupted)


def corrupt_tokens(original_ids: np.ndarray, rng: np.random.Generator, config: MaskingConfig,
                   vocab_size: int, special_token_ids: np.ndarray, mask_token_id: int) -> np.ndarray:
    """BERT's corruption: [MASK] with p=0.8, a random non-special token with p=0.1, else unchanged."""
    draw = rng.random(len(original_ids))
    replace_with_mask = draw < config.replace_with_mask_prob
    replace_with_random = (~replace_with_mask) & (
        draw < config.replace_with_mask_prob + config.replace_with_random_prob)
    random_ids = sample_non_special_ids(rng, len(original_ids), vocab_size, special_token_ids)
    corrupted = np.where(replace_with_mask, mask_token_id, original_ids)
    return np.where(replace_with_random, random_ids, corrupted).astype(np.int64)


def sample_non_special_ids(rng: np.random.Generator, count: int, vocab_size: int,
                           special_token_ids: np.ndarray) -> np.ndarray:
    """Uniform token ids over the vocabulary minus the special tokens, without rejection loops."""
    special = _special_ids_in_vocabulary(special_token_ids, vocab_size)
    return _skip_special_ids(rng.integers(0, vocab_size - len(special), count), special)


def non_special_ids(random_uint64: np.ndarray, vocab_size: int, special_token_ids: np.ndarray) -> np.ndarray:
    """Uniform uint64 draws (any shape, e.g. from `splitmix64`) -> uniform non-special token ids."""
    special = _special_ids_in_vocabulary(special_token_ids, vocab_size)
    draws = (np.asarray(random_uint64, dtype=np.uint64) % np.uint64(vocab_size - len(special))).astype(np.int64)
    return _skip_special_ids(draws, special)


def _special_ids_in_vocabulary(special_token_ids: np.ndarray, vocab_size: int) -> np.ndarray:
    special = np.unique(np.asarray(special_token_ids, dtype=np.int64))
    return special[(special >= 0) & (special < vocab_size)]


def _skip_special_ids(draws: np.ndarray, special: np.ndarray) -> np.ndarray:
    """Shift each draw past the special ids at or below it: maps [0, V - S) onto the non-special ids."""
    for special_id in special:  # a handful of ids, not tokens
        draws = draws + (draws >= special_id)
    return draws


_MIX = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(values: np.ndarray) -> np.ndarray:
    """A counter-based generator: uniform uint64 from any uint64 input, vectorized (wraps mod 2^64)."""
    with np.errstate(over="ignore"):
        z = np.asarray(values).astype(np.uint64) + _MIX
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def expand_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated [start, start + length) ranges, vectorized (no per-range Python)."""
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)
