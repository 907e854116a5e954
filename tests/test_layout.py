"""The pseudo-masked layout and its attention rules, on the paper's worked example (Figures 4-5)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_pmlm.config import ConfigError
from megatron_pmlm.data.batches import build_batch
from megatron_pmlm.data.masking import ExampleMasks
from megatron_pmlm.models.layout import CONTEXT, IGNORE_INDEX, MASKED, ORIGINAL, PAD, PSEUDO, pmlm_attention_allowed

PAD_ID, CLS, SEP, MASK, P = 0, 1, 2, 3, 4


def worked_example():
    """x1..x6 at positions 1..6 (between [CLS] and [SEP]); masked {2,4,5}; order {4,5} -> {2}."""
    ids = np.array([CLS, 11, 12, 13, 14, 15, 16, SEP])
    masks = ExampleMasks(masked_positions=np.array([4, 5, 2]), step_ids=np.array([1, 1, 2]),
                         corrupted_ids=np.array([MASK, MASK, MASK]))
    return ids, np.zeros(8, dtype=np.int64), masks


def test_worked_example_layout():
    ids, segments, masks = worked_example()
    batch = build_batch([ids], [segments], [masks], pseudo_token_id=P, pad_token_id=PAD_ID)
    # corrupted sequence | originals x4 x5 x2 | [P]4 [P]5 [P]2
    assert batch.input_ids[0].tolist() == [CLS, 11, MASK, 13, MASK, MASK, 16, SEP, 14, 15, 12, P, P, P]
    assert batch.position_ids[0].tolist() == list(range(8)) + [4, 5, 2, 4, 5, 2]
    assert batch.roles[0].tolist() == [CONTEXT, CONTEXT, MASKED, CONTEXT, MASKED, MASKED, CONTEXT, CONTEXT,
                                       ORIGINAL, ORIGINAL, ORIGINAL, PSEUDO, PSEUDO, PSEUDO]
    assert batch.steps[0].tolist() == [0, 0, 2, 0, 1, 1, 0, 0, 1, 1, 2, 1, 1, 2]
    labels = batch.labels[0].tolist()
    assert labels[2] == 12 and labels[4] == 14 and labels[5] == 15  # AE at [M]
    assert labels[11:] == [14, 15, 12]  # PAR at [P]
    assert all(label == IGNORE_INDEX for label in labels[:2] + [labels[3]] + labels[6:11])


def test_worked_example_attention_matches_figure_5():
    ids, segments, masks = worked_example()
    batch = build_batch([ids], [segments], [masks], pseudo_token_id=P, pad_token_id=PAD_ID)
    allowed = pmlm_attention_allowed(batch.roles, batch.steps)[0]
    names = ["CLS", "x1", "M2", "x3", "M4", "M5", "x6", "SEP", "x4", "x5", "x2", "P4", "P5", "P2"]
    context_and_m = {"CLS", "x1", "M2", "x3", "M4", "M5", "x6", "SEP"}
    expected = {name: set(context_and_m) for name in names}
    expected["x4"] |= {"x4", "x5"}            # originals of step 1 see step 1's originals
    expected["x5"] |= {"x4", "x5"}
    expected["x2"] |= {"x4", "x5", "x2"}      # step 2's original sees steps <= 2
    expected["P4"] |= {"P4", "P5"}            # p(x4, x5 | x1, x3, x6, [M]s): no originals at all
    expected["P5"] |= {"P4", "P5"}
    expected["P2"] |= {"x4", "x5", "P2"}      # p(x2 | x1, x3, x4, x5, x6, [M]s)
    for q, query in enumerate(names):
        seen = {names[k] for k in range(len(names)) if allowed[q, k]}
        assert seen == expected[query], query


def test_padding_and_batches_of_different_lengths():
    ids_a, seg_a, masks_a = worked_example()
    ids_b = np.array([CLS, 21, 22, SEP, 23, SEP])
    seg_b = np.array([0, 0, 0, 0, 1, 1])
    masks_b = ExampleMasks(np.array([4]), np.array([1]), np.array([99]))
    batch = build_batch([ids_a, ids_b], [seg_a, seg_b], [masks_a, masks_b], P, PAD_ID)
    assert batch.input_ids.shape == (2, 8 + 2 * 3)
    roles_b = batch.roles[1].tolist()
    # row b: 6 tokens, 2 pads, 1 original + 2 unused slots, 1 [P] + 2 unused slots
    assert roles_b == [CONTEXT, CONTEXT, CONTEXT, CONTEXT, MASKED, CONTEXT, PAD, PAD,
                       ORIGINAL, PAD, PAD, PSEUDO, PAD, PAD]
    assert batch.input_ids[1, 4] == 99 and batch.input_ids[1, 8] == 23 and batch.input_ids[1, 11] == P
    assert batch.token_type_ids[1, 8] == 1 and batch.token_type_ids[1, 11] == 1  # twins' segment
    allowed = pmlm_attention_allowed(batch.roles, batch.steps)
    assert not allowed[1][:, batch.roles[1] == PAD].any()  # nobody attends padding
    assert allowed.any(dim=-1).all()  # every row, padding included, has something to attend


def test_ae_only_layout_has_no_appended_tokens():
    ids, segments, masks = worked_example()
    batch = build_batch([ids], [segments], [masks], P, PAD_ID, append_pseudo=False)
    assert batch.input_ids.shape == (1, 8)
    assert batch.par_label_mask.sum() == 0 and batch.ae_label_mask.sum() == 3


def test_sequences_longer_than_the_model_are_refused():
    ids, segments, masks = worked_example()
    with pytest.raises(ConfigError, match="exceeds the model's maximum sequence length of 6"):
        build_batch([ids], [segments], [masks], P, PAD_ID, max_length=6)


def test_the_mask_is_derived_not_stored():
    ids, segments, masks = worked_example()
    batch = build_batch([ids], [segments], [masks], P, PAD_ID)
    # [B, T] vectors only, no [T, T] mask; plus the predicted slots' flat index
    assert all(t.dim() == 2 for t in batch.as_tuple()[:6]) and batch.predicted_index.dim() == 1
    assert isinstance(pmlm_attention_allowed(batch.roles, batch.steps), torch.Tensor)
