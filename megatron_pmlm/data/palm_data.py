"""PALM batches from a `build_samples --layout palm` directory (SPEC §9 data).

The directory has the PMLM samples format (megatron_pmlm/data/samples.py): each row references a
context (columns a_start/a_len: consecutive sentences of one document) and the continuation that
follows it (b_start/b_len), and the stored masks are the context's MLM masks, in the coordinates
of `[CLS] context [SEP]`. So the sampler, the memory maps and exact resume are PMLM's; only the
batch differs: the encoder reads `[CLS] context [SEP]`, the decoder `[CLS] continuation` and
predicts `continuation [SEP]`.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..config import ConfigError
from ..models.layout import CONTEXT, IGNORE_INDEX, MASKED, PAD, pmlm_predicted_index
from ..models.palm import PalmBatch
from .loader import PretrainingLoaders, samples_loaders
from .samples import A_LEN, A_START, B_LEN, B_START, PretrainingSamples, SamplesError, assemble_tokens, read_metadata

PALM_LAYOUT = "palm"
"""metadata.json's `layout` of a PALM samples directory (PMLM directories have none)."""


def check_palm_metadata(metadata: dict, data_path) -> None:
    if metadata.get("layout") != PALM_LAYOUT:
        raise ConfigError(f"{data_path} holds PMLM samples, not PALM context/continuation pairs: build them with "
                          "python -m data_prep.build_samples --layout palm ...")


def _padded(flat: np.ndarray, lengths: np.ndarray, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a flat concatenation, right-padded to the longest: (ids [B, L], valid [B, L])."""
    width = int(lengths.max()) if len(lengths) else 0
    valid = np.arange(width)[None, :] < lengths[:, None]
    out = np.full(valid.shape, pad_id, dtype=np.int64)
    out[valid] = flat
    return out, valid


class PalmBatchBuilder:
    """Sample indices (+ training epoch) -> PalmBatch; stage 1 corrupts the context with its stored
    masks and leaves the decoder empty, stage 2 reads the clean context and the continuation."""

    def __init__(self, samples: PretrainingSamples, stage: int):
        self.samples, self.stage = samples, stage

    def __call__(self, indices: np.ndarray, epoch: int) -> PalmBatch:
        indices = np.asarray(indices, dtype=np.int64)
        samples, special = self.samples, self.samples.special
        rows = np.array(samples.rows[samples._check(indices)], dtype=np.int64)
        context_rows = rows.copy()
        context_rows[:, B_LEN] = 0
        flat, _, lengths = assemble_tokens(samples.corpora, context_rows, special)
        context, valid = _padded(flat, lengths, special.pad)
        encoder_ids = context.copy()
        roles = np.where(valid, CONTEXT, PAD)
        mlm_labels = np.full(context.shape, IGNORE_INDEX, dtype=np.int64)
        batch = len(indices)
        if self.stage == 1:
            masks = samples.masks(indices, epoch)
            counts = np.array([len(m.masked_positions) for m in masks])
            at_row = np.repeat(np.arange(batch), counts)
            positions = np.concatenate([m.masked_positions for m in masks]).astype(np.int64)
            corrupted = np.concatenate([m.corrupted_ids for m in masks]).astype(np.int64)
            mlm_labels[at_row, positions] = context[at_row, positions]
            encoder_ids[at_row, positions] = corrupted
            roles[at_row, positions] = MASKED
            decoder_ids = labels = np.zeros((batch, 0), dtype=np.int64)
        else:
            continuation_rows = rows.copy()
            continuation_rows[:, A_START], continuation_rows[:, A_LEN] = rows[:, B_START], rows[:, B_LEN]
            continuation_rows[:, B_LEN] = 0
            flat, _, lengths = assemble_tokens(samples.corpora, continuation_rows, special)
            # [CLS] y [SEP]: the decoder reads all but the last token and predicts all but the first.
            sequence, in_sequence = _padded(flat, lengths, special.pad)
            decoder_ids = sequence[:, :-1]
            labels = np.where(in_sequence[:, 1:], sequence[:, 1:], IGNORE_INDEX)
        as_tensor = torch.from_numpy
        encoder_roles, mlm_targets = as_tensor(roles.astype(np.int64)), as_tensor(mlm_labels)
        mlm_index = pmlm_predicted_index(encoder_roles, mlm_targets, pseudo_masked=False) if self.stage == 1 else None
        return PalmBatch(as_tensor(encoder_ids), encoder_roles, as_tensor(context), mlm_targets,
                         as_tensor(np.ascontiguousarray(decoder_ids)), as_tensor(np.ascontiguousarray(labels)),
                         mlm_index)


def build_palm_loaders(data_path: str | os.PathLike, micro_batch_size: int, stage: int,
                       data_parallel_rank: int = 0, data_parallel_size: int = 1, consumed_samples: int = 0,
                       seed: int | None = None, max_length: int | None = None,
                       vocab_size: int | None = None, global_batch_size: int | None = None,
                       index_cache: str | os.PathLike | None = None) -> PretrainingLoaders:
    """Train/valid PalmBatch iterators: PMLM's resumable sampler over PALM pairs (with its length
    bucketing within each global batch when `global_batch_size` is given; its epoch orders cached in
    `index_cache`, default DATA_PATH/index-cache)."""
    metadata = read_metadata(data_path)
    check_palm_metadata(metadata, data_path)
    if vocab_size is not None and vocab_size != metadata["vocab_size"]:
        raise SamplesError(f"{data_path} was built with a vocabulary of {metadata['vocab_size']} entries, "
                           f"the model has {vocab_size}")
    longest = max(int(metadata["seq_length"]), int(metadata["continuation_length"]))
    if max_length is not None and longest > max_length:
        raise ConfigError(f"{data_path} holds contexts of up to {metadata['seq_length']} and continuations of up to "
                          f"{metadata['continuation_length']} tokens, more than the model's {max_length} positions")
    seed = metadata["seed"] if seed is None else seed
    return samples_loaders(data_path, metadata, lambda samples: PalmBatchBuilder(samples, stage), micro_batch_size,
                           data_parallel_rank, data_parallel_size, consumed_samples, seed, global_batch_size,
                           index_cache)
