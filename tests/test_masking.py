"""Algorithm 1 (blockwise masking), the factorization order and 80/10/10, checked statistically."""

from __future__ import annotations

import numpy as np
import pytest

from megatron_pmlm.config import ConfigError, MaskingConfig
from megatron_pmlm.data.masking import mask_example, sample_blocks, sample_non_special_ids

SEQ_LEN = 512
SPECIAL_POSITIONS = [0, 200, SEQ_LEN - 1]  # [CLS] S1 [SEP] S2 [SEP]
VOCAB = 1000
SPECIAL_IDS = np.arange(5)
MASK_ID = 3


def _maskable():
    maskable = np.ones(SEQ_LEN, dtype=bool)
    maskable[SPECIAL_POSITIONS] = False
    return maskable


def paper_algorithm_1(maskable, rng, mask_prob=0.15, block_prob=0.4):
    """A literal, token-by-token transcription of the paper's pseudo-code, as a reference."""
    budget = mask_prob * maskable.sum()
    masked = set()
    blocks = []
    while sum(length for _, length in blocks) < budget:
        p = int(rng.integers(0, len(maskable)))
        length = int(rng.integers(2, 7)) if rng.random() < block_prob else 1
        span = list(range(p, p + length))
        if span[-1] < len(maskable) and all(maskable[i] and i not in masked for i in span):
            masked.update(span)
            blocks.append((p, length))
    return blocks


def _stats(block_lists, num_maskable):
    lengths = np.concatenate([[b[1] for b in blocks] for blocks in block_lists])
    fractions = np.array([sum(b[1] for b in blocks) / num_maskable for blocks in block_lists])
    return lengths, fractions


def test_algorithm_1_statistics():
    rng = np.random.default_rng(0)
    maskable = _maskable()
    num_maskable = int(maskable.sum())
    samples = [sample_blocks(maskable, rng) for _ in range(3000)]
    lengths, fractions = _stats(samples, num_maskable)

    # 15% budget, reached and overshot by less than one maximal block.
    assert fractions.min() >= 0.15
    assert fractions.max() < 0.15 + 6 / num_maskable
    assert 0.150 <= fractions.mean() <= 0.156

    # Steps are single tokens or blocks of 2-6, the block lengths uniform.
    assert set(np.unique(lengths)) <= {1, 2, 3, 4, 5, 6}
    block_lengths = lengths[lengths > 1]
    histogram = np.bincount(block_lengths, minlength=7)[2:] / len(block_lengths)
    # Longer blocks are rejected a little more often (they overlap more), hence a mild tilt.
    assert np.all(np.abs(histogram - 0.2) < 0.03), histogram

    # 40% of PROPOSALS are blocks; overlapping proposals are rejected, long ones more often, so the
    # accepted steps are ~37% blocks. The paper's own pseudo-code gives the same split:
    block_share = (lengths > 1).mean()
    reference = [paper_algorithm_1(maskable, np.random.default_rng(1000 + i)) for i in range(1500)]
    ref_lengths, ref_fractions = _stats(reference, num_maskable)
    ref_block_share = (ref_lengths > 1).mean()
    assert 0.34 <= block_share <= 0.40
    assert abs(block_share - ref_block_share) < 0.015, (block_share, ref_block_share)
    assert abs(fractions.mean() - ref_fractions.mean()) < 0.001


def test_blocks_never_overlap_nor_touch_special_tokens():
    rng = np.random.default_rng(1)
    maskable = _maskable()
    maskable[300:310] = False  # e.g. padding in the middle of nowhere
    for _ in range(500):
        blocks = sample_blocks(maskable, rng)
        covered = np.concatenate([np.arange(s, s + n) for s, n in blocks])
        assert len(covered) == len(set(covered.tolist()))
        assert covered.max() < SEQ_LEN
        assert maskable[covered].all()


def test_factorization_order_is_a_uniform_permutation():
    rng = np.random.default_rng(2)
    ids = rng.integers(5, VOCAB, 40)
    maskable = np.ones(40, dtype=bool)
    config = MaskingConfig(mask_prob=0.1)  # a few steps per example
    first_step_blocks = []
    for _ in range(3000):
        masks = mask_example(ids, maskable, rng, config, VOCAB, SPECIAL_IDS, MASK_ID)
        steps, positions = masks.step_ids, masks.masked_positions
        assert steps[0] == 1 and np.all(np.diff(steps) >= 0) and np.all(np.diff(steps) <= 1)
        # Within a step the positions are one contiguous, ascending block.
        for step in range(1, masks.num_steps + 1):
            block = positions[steps == step]
            assert np.array_equal(block, np.arange(block[0], block[0] + len(block)))
        if masks.num_steps == 2:
            # Which step comes first must not depend on position: left block first half the time.
            first = positions[steps == 1][0]
            second = positions[steps == 2][0]
            first_step_blocks.append(first < second)
    share = np.mean(first_step_blocks)
    assert len(first_step_blocks) > 300
    assert abs(share - 0.5) < 0.06, share


def test_corruption_80_10_10():
    rng = np.random.default_rng(3)
    corrupted_kind = []
    for _ in range(400):
        ids = rng.integers(5, VOCAB, SEQ_LEN)
        ids[SPECIAL_POSITIONS] = [1, 2, 2]
        masks = mask_example(ids, _maskable(), rng, MaskingConfig(), VOCAB, SPECIAL_IDS, MASK_ID)
        original = ids[masks.masked_positions]
        kind = np.where(masks.corrupted_ids == MASK_ID, 0, np.where(masks.corrupted_ids == original, 2, 1))
        corrupted_kind.append(kind)
        assert not np.isin(masks.corrupted_ids[kind == 1], SPECIAL_IDS).any()
    kinds = np.bincount(np.concatenate(corrupted_kind), minlength=3) / sum(len(k) for k in corrupted_kind)
    # "unchanged" also catches the 1/995 chance a random token equals the original.
    assert abs(kinds[0] - 0.8) < 0.01 and abs(kinds[1] - 0.1) < 0.01 and abs(kinds[2] - 0.1) < 0.01, kinds


def test_single_token_steps_for_ar():
    rng = np.random.default_rng(4)
    ids = rng.integers(5, VOCAB, 128)
    masks = mask_example(ids, np.ones(128, bool), rng, MaskingConfig(), VOCAB, SPECIAL_IDS, MASK_ID,
                         single_token_steps=True)
    assert np.array_equal(masks.step_ids, np.arange(1, len(masks.step_ids) + 1))
    assert not np.all(np.diff(masks.masked_positions) > 0)  # a random order, not left to right


def test_random_tokens_skip_special_ids_exactly():
    rng = np.random.default_rng(5)
    special = np.array([0, 1, 7, 9])
    draws = sample_non_special_ids(rng, 200_000, 12, special)
    counts = np.bincount(draws, minlength=12)
    assert counts[special].sum() == 0
    allowed = np.setdiff1d(np.arange(12), special)
    assert np.all(np.abs(counts[allowed] / len(draws) - 1 / len(allowed)) < 0.005)


def test_no_maskable_tokens_gives_no_masks_and_bad_config_is_refused():
    rng = np.random.default_rng(6)
    masks = mask_example(np.array([1, 2]), np.zeros(2, bool), rng, MaskingConfig(), VOCAB, SPECIAL_IDS, MASK_ID)
    assert len(masks.masked_positions) == 0 and masks.num_steps == 0
    with pytest.raises(ConfigError, match="mask_prob"):
        MaskingConfig(mask_prob=1.5)
    with pytest.raises(ConfigError, match="min_block_len"):
        MaskingConfig(min_block_len=4, max_block_len=2)
