"""The pseudo-masked input layout (UniLMv2 §3.2) and its attention rule (SPEC §3).

A PMLM example is the corrupted sequence (masked positions show [MASK] / a random token / the
original, as chosen by 80/10/10) followed by, for every masked position, a copy of its ORIGINAL
token and a pseudo mask [P]; the appended tokens carry the position and segment ids of the position
they stand for. Who may attend to whom is a function of two per-token vectors, the role and the
factorization step, so the n x n mask is derived per batch on the fly and never stored.

Batch layout (T = N + 2 * M, N = longest sequence, M = most masked tokens in the batch):
    [0, N)        the corrupted sequences, right-padded
    [N, N + M)    the originals of the masked tokens, in factorization order, right-padded
    [N + M, T)    their [P] tokens, in the same order
(data/batches.py's `build_batch` assembles it from examples and their masks.)
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable

import torch
import torch.nn.functional as F

# Token roles. CONTEXT: unmasked tokens (specials included); MASKED: the [M] slots of the corrupted
# sequence; ORIGINAL: appended copies of masked tokens; PSEUDO: appended [P]; PAD: padding.
CONTEXT, MASKED, ORIGINAL, PSEUDO, PAD = 0, 1, 2, 3, 4
ROLE_NAMES = {CONTEXT: "context", MASKED: "[M]", ORIGINAL: "original", PSEUDO: "[P]", PAD: "pad"}

IGNORE_INDEX = -100

AttentionRule = Callable[..., torch.Tensor]
"""(query roles, query steps[, key roles, key steps]) -> boolean [B, queries, keys]."""


def pmlm_attention_allowed(roles: torch.Tensor, steps: torch.Tensor, key_roles: torch.Tensor | None = None,
                           key_steps: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [B, T, T] (query, key): may the query attend to the key? SPEC §3.

    - context and [M] are seen by every token (padding queries included, so no row is empty);
    - the original of step j is seen by originals of steps k >= j and by [P] of steps k > j;
    - the [P] of step j is seen only by the [P] tokens of step j;
    - padding is seen by nobody.
    Keys default to the queries; incremental decoding passes the cached slots plus the new ones as
    keys and only the new slots as queries, so one rule serves training and decoding.
    """
    key_roles = roles if key_roles is None else key_roles
    key_steps = steps if key_steps is None else key_steps
    q_role, k_role = roles[:, :, None], key_roles[:, None, :]
    q_step, k_step = steps[:, :, None], key_steps[:, None, :]
    key_is_visible_context = (k_role == CONTEXT) | (k_role == MASKED)
    key_is_earlier_original = (k_role == ORIGINAL) & (
        ((q_role == ORIGINAL) & (k_step <= q_step)) | ((q_role == PSEUDO) & (k_step < q_step)))
    key_is_same_step_pseudo = (k_role == PSEUDO) & (q_role == PSEUDO) & (k_step == q_step)
    return key_is_visible_context | key_is_earlier_original | key_is_same_step_pseudo


def padded_width(width: int, quantum: int) -> int:
    """The smallest multiple of `quantum` (>= 1) that holds `width` columns."""
    return -(-width // quantum) * quantum


def pad_layout_inputs(quantum: int, input_ids: torch.Tensor, position_ids: torch.Tensor,
                      token_type_ids: torch.Tensor, roles: torch.Tensor, steps: torch.Tensor,
                      labels: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """The [B, T] tensors widened to a multiple of `quantum` columns with padding slots: role PAD
    (seen by nobody, so no real slot's output changes), token, position, segment and step 0, no
    label. Unchanged (the same tensors) when T is a multiple already."""
    extra = padded_width(input_ids.shape[1], quantum) - input_ids.shape[1]
    tensors = (input_ids, position_ids, token_type_ids, roles, steps) + (() if labels is None else (labels,))
    if not extra:
        return tensors
    fills = (0, 0, 0, PAD, 0, IGNORE_INDEX)
    return tuple(F.pad(tensor, (0, extra), value=fill) for tensor, fill in zip(tensors, fills))


def predicted_slots(roles: torch.Tensor, labels: torch.Tensor, role: int) -> torch.Tensor:
    """Where a loss is taken: the labelled slots of `role` (MASKED for L_AE, PSEUDO for L_PAR)."""
    return (roles == role) & (labels != IGNORE_INDEX)


def pmlm_predicted_index(roles: torch.Tensor, labels: torch.Tensor, autoencoding: bool = True,
                         pseudo_masked: bool = True) -> torch.Tensor:
    """Flat indices into the [B * T] slots (row-major) of the PMLM losses' slots: the labelled [M]
    slots (if `autoencoding`), then the labelled [P] slots (if `pseudo_masked`), each row-major.

    `nonzero` makes the host wait for the device: the batch builders call this on the CPU tensors
    when the batch is made (`PMLMBatch.predicted_index`), so the training step never does."""
    parts = [predicted_slots(roles, labels, role).flatten().nonzero()[:, 0]
             for role, enabled in ((MASKED, autoencoding), (PSEUDO, pseudo_masked)) if enabled]
    return torch.cat(parts) if parts else roles.new_zeros(0, dtype=torch.long)


def labelled_index(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices into the [B * T] slots (row-major) of every labelled slot (seq2seq fine-tuning's
    losses); computed on the CPU by the batch builder, like `pmlm_predicted_index`."""
    return (labels != IGNORE_INDEX).flatten().nonzero()[:, 0]


def gather_slots(tensor: torch.Tensor, index: torch.Tensor, width: int | None = None) -> torch.Tensor:
    """Rows `index` of a [B, T, ...] tensor flattened to [B * T, ...]: a gather whose output size the
    host knows (the index's length), unlike boolean indexing, which waits for the device.

    `width`: the layout width `index` counts in, where `tensor` is wider (the encoder's output at the
    padded width, `BertModel.padded_forward`): the index is widened instead of the tensor cut, so
    neither a copy of the cut tensor nor its backward is needed."""
    if width is not None:
        index = widen_flat_index(index, width, tensor.shape[1])
    return tensor.flatten(0, 1).index_select(0, index)


def widen_flat_index(index: torch.Tensor, width: int, new_width: int) -> torch.Tensor:
    """Flat [B * width] slot indices as indices into the same slots of the [B * new_width] layout
    (right-padded rows): index + row x (new_width - width); on the device, no host sync. Compiled,
    the addition is made even when the widths are equal: a branch on them would specialise the
    compiled region (`dynamic=True`) on that equality, and the first width that differs (or equals)
    would compile it again."""
    if not torch.compiler.is_compiling() and new_width == width:
        return index
    return torch.add(index, index // width, alpha=new_width - width)


@dataclass
class PMLMBatch:
    """Model inputs and targets of one batch; every tensor is [B, T] unless noted."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    token_type_ids: torch.Tensor
    roles: torch.Tensor
    steps: torch.Tensor
    labels: torch.Tensor
    """Original token at [M] (AE) and [P] (PAR) slots, IGNORE_INDEX elsewhere."""
    predicted_index: torch.Tensor | None = None
    """[slots] int64: flat indices into [B * T] (row-major) of the slots the loss is taken at, in
    the order the model family's loss reads them (PMLM: `pmlm_predicted_index`, [M] then [P];
    UniLM v1: `unilm.unilm_predicted_index`; seq2seq: `labelled_index`). The batch builders compute
    it on the CPU, so the model gathers those slots with `index_select` instead of boolean indexing,
    which would make the host wait for the device twice per objective per micro batch. None: the
    model derives it from roles and labels, with that wait (for callers that build batches by hand)."""

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "PMLMBatch":
        """The batch on `device`; `non_blocking` overlaps the copies with compute when the tensors
        are in pinned memory."""
        return PMLMBatch(**{f.name: None if getattr(self, f.name) is None else
                            getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    @property
    def ae_label_mask(self) -> torch.Tensor:
        return predicted_slots(self.roles, self.labels, MASKED)

    @property
    def par_label_mask(self) -> torch.Tensor:
        return predicted_slots(self.roles, self.labels, PSEUDO)

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        """The model's positional inputs: the six [B, T] tensors, then `predicted_index` if set."""
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)

    def num_tokens(self) -> int:
        """Tokens the model processes (padding excluded): what throughput is counted in."""
        return int((self.roles != PAD).sum())

    def padded_to(self, quantum: int) -> "PMLMBatch":
        """The same batch with its width padded to a multiple of `quantum` (`pad_layout_inputs`)."""
        padded = pad_layout_inputs(quantum, *self.as_tuple()[:6])
        index = self.predicted_index
        if index is not None:
            index = widen_flat_index(index, self.input_ids.shape[1], padded[0].shape[1])
        return PMLMBatch(*padded, predicted_index=index)
