"""`build_batch`: the PMLM batch (models/layout.py's layout) of a list of examples and their masks."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..config import ConfigError
from ..models.layout import CONTEXT, IGNORE_INDEX, MASKED, ORIGINAL, PAD, PSEUDO, PMLMBatch, pmlm_predicted_index
from .masking import ExampleMasks


def build_batch(input_ids: Sequence[np.ndarray], token_type_ids: Sequence[np.ndarray],
                masks: Sequence[ExampleMasks], pseudo_token_id: int, pad_token_id: int,
                append_pseudo: bool = True, max_length: int | None = None,
                predict_masked: bool = True) -> PMLMBatch:
    """Assemble the PMLM tensors for a list of examples of any lengths, vectorized over tokens.

    With `append_pseudo=False` (the AE-only objective) the batch is just the corrupted sequences.
    `max_length` (the model's max_position_embeddings) refuses longer sequences up front, since
    the appended tokens reuse their twins' positions and only the sequence itself needs positions.
    The batch carries the flat indices of its predicted slots (`layout.pmlm_predicted_index`: the
    [M] slots if `predict_masked` - the objective has L_AE -, then the [P] slots), computed here on
    the CPU so that the model's loss never waits for the device to find them.
    """
    batch_size = len(input_ids)
    if not (batch_size == len(token_type_ids) == len(masks)) or batch_size == 0:
        raise ValueError("build_batch needs the same non-zero number of input_ids, token_type_ids and masks")
    seq_lengths = np.array([len(ids) for ids in input_ids])
    if max_length is not None and seq_lengths.max() > max_length:
        raise ConfigError(
            f"a sequence of {int(seq_lengths.max())} tokens exceeds the model's maximum sequence "
            f"length of {max_length} (max_position_embeddings); shorten --seq-length")
    mask_counts = np.array([len(m.masked_positions) for m in masks])
    max_len = int(seq_lengths.max())
    max_masked = int(mask_counts.max()) if append_pseudo else 0
    total = max_len + 2 * max_masked

    ids = np.full((batch_size, total), pad_token_id, dtype=np.int64)
    segments = np.zeros((batch_size, total), dtype=np.int64)
    positions = np.zeros((batch_size, total), dtype=np.int64)
    roles = np.full((batch_size, total), PAD, dtype=np.int64)
    steps = np.zeros((batch_size, total), dtype=np.int64)
    labels = np.full((batch_size, total), IGNORE_INDEX, dtype=np.int64)

    # The sequences themselves: one copy per example (a row-level loop, not per token).
    for row, (example_ids, example_segments) in enumerate(zip(input_ids, token_type_ids)):
        ids[row, :len(example_ids)] = example_ids
        segments[row, :len(example_segments)] = example_segments
    in_sequence = np.arange(max_len)[None, :] < seq_lengths[:, None]
    positions[:, :max_len] = np.arange(max_len)[None, :]
    roles[:, :max_len] = np.where(in_sequence, CONTEXT, PAD)

    # Masked slots, flattened over the batch: (row, slot index in factorization order, position).
    rows = np.repeat(np.arange(batch_size), mask_counts)
    slots = np.arange(int(mask_counts.sum())) - np.repeat(np.cumsum(mask_counts) - mask_counts, mask_counts)
    masked_positions = np.concatenate([m.masked_positions for m in masks]).astype(np.int64)
    step_ids = np.concatenate([m.step_ids for m in masks]).astype(np.int64)
    corrupted = np.concatenate([m.corrupted_ids for m in masks]).astype(np.int64)
    if len(masked_positions) and (masked_positions >= seq_lengths[rows]).any():
        raise ValueError("a masked position lies outside its sequence")

    originals = ids[rows, masked_positions]
    original_segments = segments[rows, masked_positions]
    ids[rows, masked_positions] = corrupted
    roles[rows, masked_positions] = MASKED
    steps[rows, masked_positions] = step_ids
    labels[rows, masked_positions] = originals

    if append_pseudo:
        for offset, role, token in ((max_len, ORIGINAL, originals),
                                    (max_len + max_masked, PSEUDO, pseudo_token_id)):
            columns = offset + slots
            ids[rows, columns] = token
            segments[rows, columns] = original_segments
            positions[rows, columns] = masked_positions
            roles[rows, columns] = role
            steps[rows, columns] = step_ids
        labels[rows, max_len + max_masked + slots] = originals

    tensors = [torch.from_numpy(a) for a in (ids, positions, segments, roles, steps, labels)]
    index = pmlm_predicted_index(tensors[3], tensors[5], autoencoding=predict_masked, pseudo_masked=append_pseudo)
    return PMLMBatch(*tensors, predicted_index=index)
