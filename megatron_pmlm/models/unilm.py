"""UniLM v1 pre-training (SPEC §8): four cloze LMs that differ only in who sees whom, plus NSP.

The four self-attention masks are written in the PMLM layout's roles and steps, so the one
attention rule (`layout.pmlm_attention_allowed`) - and with it TP, PP, ZeRO, activation
checkpointing, the flex backend, resume and conversion - serves UniLM v1 unchanged:

    LM type          segment ids        roles / steps (query i may see key j iff ...)
    bidirectional    0 (A), 1 (B)       every token CONTEXT (or [M] when masked), step 0: always
    left-to-right    2                  [SOS] CONTEXT; the rest ORIGINAL, step = position: j <= i
    right-to-left    3                  last [EOS] CONTEXT; the rest ORIGINAL, step = n-1-position: j >= i
    seq2seq          4 (source), 5      source CONTEXT/[M]; target ORIGINAL, step = 1, 2, ... :
                                        j in the source, or both in the target and j <= i

An ORIGINAL token is seen by ORIGINAL tokens of later-or-equal steps and by no CONTEXT token, and
sees every CONTEXT/[M] token: exactly "ordered after" (the rule's docstring). Masked tokens of an
ordered stretch keep their ORIGINAL role and show their corrupted token ([MASK], random, or kept)
in place, as in UniLM v1; nothing is appended. Segment ids follow the released v1 loader's
`--new_segment_ids` (type vocabulary 6), so the segment embedding also tells the LM type, and the
model reads the LM type of a row back from the segment id of its [SOS].

NSP: the next-sentence label lives in the [SOS] slot of `labels` (the [SOS] is never masked, so
the slot is free): 0 when B is the true continuation, 1 when it is random (Hugging Face's
`next_sentence_label` convention), IGNORE_INDEX for rows that are not bidirectional or have no B.

The batches - LM types, n-gram masks and NSP partners, drawn in the loader - are
data/unilm_batches.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .layout import IGNORE_INDEX, gather_slots
from .metrics import UNILM_LM_TYPES

LM_TYPES = UNILM_LM_TYPES
BIDIRECTIONAL, LEFT_TO_RIGHT, RIGHT_TO_LEFT, SEQ2SEQ = range(4)
# Segment ids of the released UniLM v1 loader (--new_segment_ids): (first segment, second segment).
LM_SEGMENT_IDS = np.array([[0, 1], [2, 2], [3, 3], [4, 5]], dtype=np.int64)
LM_FIRST_SEGMENT_IDS = tuple(int(segment) for segment in LM_SEGMENT_IDS[:, 0])
"""The first segment's id per LM type as host ints (a numpy table's `.tolist()` inside a compiled
region is a graph break)."""
TYPE_VOCAB_SIZE = 6
NSP_IS_NEXT, NSP_IS_RANDOM = 0, 1


def lm_type_of_segment(first_segment_ids: torch.Tensor) -> torch.Tensor:
    """The LM type (index into LM_TYPES) of rows whose [SOS] carries `first_segment_ids`, -1 for
    none. Comparisons with the table's host ints: no index tensor is copied to the device."""
    lm_type = torch.full_like(first_segment_ids, -1)
    for index, segment in enumerate(LM_FIRST_SEGMENT_IDS):
        lm_type = torch.where(first_segment_ids == segment, index, lm_type)
    return lm_type


# --- losses -------------------------------------------------------------------------------------

class BertPooler(nn.Module):
    """BERT's pooler (Hugging Face name `bert.pooler.dense`): tanh(dense(hidden of [SOS]))."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


@dataclass
class UniLMLosses:
    loss: torch.Tensor
    loss_mlm: torch.Tensor
    loss_nsp: torch.Tensor
    counts: torch.Tensor
    """metrics.UNILM_METRICS's fields after the two losses, in order."""

    def metrics(self) -> torch.Tensor:
        return self.metrics_with_grad().detach()

    def metrics_with_grad(self) -> torch.Tensor:
        """The metrics vector with the total loss first, still differentiable (the pipeline's last
        stage returns this and backpropagates its first entry)."""
        return torch.cat([torch.stack([self.loss.float(), self.loss_mlm.detach().float()]),
                          self.counts.detach().float()])


def unilm_predicted_index(labels: torch.Tensor) -> torch.Tensor:
    """Flat indices into the [B * T] slots (row-major) of the masked-LM losses' slots: the labelled
    ones but the [SOS] slot, which holds the NSP label. `nonzero` waits for the device: the batch
    builder calls this on the CPU (`PMLMBatch.predicted_index`)."""
    selected = labels != IGNORE_INDEX
    selected[:, 0] = False
    return selected.flatten().nonzero()[:, 0]


def unilm_slots(token_type_ids: torch.Tensor, labels: torch.Tensor,
                predicted_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the predicted slots' flat index, `unilm_predicted_index`, computed here when None; the LM
    type of each predicted slot; the NSP targets [B]). Given the index, nothing here waits for the
    device."""
    if predicted_index is None:
        predicted_index = unilm_predicted_index(labels)
    lm_type = lm_type_of_segment(token_type_ids[:, 0])
    return predicted_index, lm_type.index_select(0, predicted_index // labels.shape[1]), labels[:, 0]


def unilm_losses(hidden: torch.Tensor, token_type_ids: torch.Tensor, labels: torch.Tensor, mlm_head,
                 layers, nsp_logits=None, predicted_index: torch.Tensor | None = None) -> UniLMLosses:
    """The plain/tensor-parallel model's losses: the heads on `hidden`, then `unilm_losses_from_logits`.
    `hidden` may be padded wider than `labels` (`BertModel.padded_forward`); `mlm_head(hidden) -> (logits,
    bias)`; `predicted_index`: see `unilm_slots`."""
    predicted_index, slot_lm, nsp_targets = unilm_slots(token_type_ids, labels, predicted_index)
    logits, bias = mlm_head(gather_slots(hidden, predicted_index, labels.shape[1]))
    return unilm_losses_from_logits(logits, gather_slots(labels, predicted_index), slot_lm, layers,
                                    None if nsp_logits is None else nsp_logits(hidden), nsp_targets, bias)


def unilm_losses_from_logits(logits: torch.Tensor, targets: torch.Tensor, slot_lm: torch.Tensor, layers,
                             nsp_row_logits: torch.Tensor | None = None,
                             nsp_targets: torch.Tensor | None = None,
                             logit_bias: torch.Tensor | None = None) -> UniLMLosses:
    """L = mean cross entropy over every masked token of the batch (the LMs' losses summed over
    their tokens, one normaliser) + the NSP cross entropy over the bidirectional rows that have one.
    Per-LM sums and counts go to the metrics so each LM's loss is logged on its own. Shared by the
    model and the pipeline's last stage. `logit_bias`: the head's output bias, added chunk by chunk
    (`ParallelLayers.biased_cross_entropy`); None: already in `logits`."""
    if logit_bias is None:
        logit_bias = logits.new_zeros(logits.shape[-1])
    token_losses, predicted = layers.biased_cross_entropy(logits, targets, logit_bias)
    correct = predicted == targets
    # torch.full, not torch.tensor: a fill on the device, no copy from (pageable) host memory, which
    # on CUDA waits for the stream.
    count = torch.full((), targets.numel(), device=logits.device)
    loss_mlm = token_losses.sum() / count.clamp(min=1)
    per_lm = []
    for index in range(len(LM_TYPES)):
        in_lm = slot_lm == index
        per_lm += [(token_losses.detach() * in_lm).sum(), in_lm.sum()]
    if nsp_row_logits is not None:
        # Every row goes through the head (a zero weight where there is no label), so the pooler
        # always has a gradient: ZeRO and DDP expect every parameter to take part.
        has_nsp = nsp_targets != IGNORE_INDEX
        row_logits = nsp_row_logits.float()
        row_losses = nn.functional.cross_entropy(row_logits, nsp_targets.clamp(min=0), reduction="none")
        nsp_count = has_nsp.sum()
        loss_nsp = (row_losses * has_nsp).sum() / nsp_count.clamp(min=1)
        nsp_correct = ((row_logits.argmax(-1) == nsp_targets) & has_nsp).sum()
        nsp_loss_sum = (row_losses.detach() * has_nsp).sum()
    else:
        zero = logits.new_zeros(())
        loss_nsp, nsp_count, nsp_correct, nsp_loss_sum = zero, zero, zero, zero
    counts = torch.stack([correct.sum().float(), count.float(), nsp_correct.float(), nsp_count.float(),
                          nsp_loss_sum.float()] + [value.float() for value in per_lm])
    return UniLMLosses(loss=loss_mlm + loss_nsp, loss_mlm=loss_mlm, loss_nsp=loss_nsp, counts=counts)
