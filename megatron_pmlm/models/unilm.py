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

Everything random - the LM type of a sample, its NSP partner, its n-gram masks - is a counter-based
hash of (seed, epoch, sample index, position), vectorized over the batch: the same sample gets the
same draw whatever batch, data-parallel layout or restart it appears in, and nothing consumes
extra samples (a random second segment is read by reference from another sample's first segment;
the sampler still yields every sample exactly once per epoch). The masks are drawn in the loader,
not stored by `build_samples`, because NSP changes a bidirectional sample's second segment and the
LM type changes which positions may be masked: a store of masks would need every combination.

NSP: the next-sentence label lives in the [SOS] slot of `labels` (the [SOS] is never masked, so
the slot is free): 0 when B is the true continuation, 1 when it is random (Hugging Face's
`next_sentence_label` convention), IGNORE_INDEX for rows that are not bidirectional or have no B.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..config import ConfigError, UniLMMaskingConfig
from ..data.samples import A_LEN, A_START, B_LEN, B_START, CORPUS, DOCUMENT, PretrainingSamples, assemble_tokens
from .layout import CONTEXT, IGNORE_INDEX, MASKED, ORIGINAL, PAD, PMLMBatch
from ..training.metrics import UNILM_LM_TYPES
from ..data.masking import non_special_ids, splitmix64 as _splitmix64

LM_TYPES = UNILM_LM_TYPES
BIDIRECTIONAL, LEFT_TO_RIGHT, RIGHT_TO_LEFT, SEQ2SEQ = range(4)
# Segment ids of the released UniLM v1 loader (--new_segment_ids): (first segment, second segment).
LM_SEGMENT_IDS = np.array([[0, 1], [2, 2], [3, 3], [4, 5]], dtype=np.int64)
TYPE_VOCAB_SIZE = 6
NSP_IS_NEXT, NSP_IS_RANDOM = 0, 1


def lm_type_of_segment(first_segment_ids: torch.Tensor) -> torch.Tensor:
    """The LM type (index into LM_TYPES) of rows whose [SOS] carries `first_segment_ids`."""
    table = torch.full((TYPE_VOCAB_SIZE,), -1, dtype=torch.long, device=first_segment_ids.device)
    table[torch.from_numpy(LM_SEGMENT_IDS[:, 0]).to(first_segment_ids.device)] = torch.arange(
        len(LM_TYPES), device=first_segment_ids.device)
    return table[first_segment_ids.clamp(0, TYPE_VOCAB_SIZE - 1)]


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
    return PMLMBatch(*(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in tensors))


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


def unilm_slots(token_type_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(predicted slots [B, T] - the labelled ones but the [SOS] slot, which holds the NSP label -,
    the LM type of each predicted slot, the NSP targets [B])."""
    selected = labels != IGNORE_INDEX
    selected[:, 0] = False
    lm_type = lm_type_of_segment(token_type_ids[:, 0])
    return selected, lm_type[:, None].expand_as(selected)[selected], labels[:, 0]


def unilm_losses(hidden: torch.Tensor, token_type_ids: torch.Tensor, labels: torch.Tensor, mlm_logits,
                 layers, nsp_logits=None) -> UniLMLosses:
    """The plain/tensor-parallel model's losses: the heads on `hidden`, then `unilm_losses_from_logits`."""
    selected, slot_lm, nsp_targets = unilm_slots(token_type_ids, labels)
    return unilm_losses_from_logits(mlm_logits(hidden[selected]), labels[selected], slot_lm, layers,
                                    None if nsp_logits is None else nsp_logits(hidden), nsp_targets)


def unilm_losses_from_logits(logits: torch.Tensor, targets: torch.Tensor, slot_lm: torch.Tensor, layers,
                             nsp_row_logits: torch.Tensor | None = None,
                             nsp_targets: torch.Tensor | None = None) -> UniLMLosses:
    """L = mean cross entropy over every masked token of the batch (the LMs' losses summed over
    their tokens, one normaliser) + the NSP cross entropy over the bidirectional rows that have one.
    Per-LM sums and counts go to the metrics so each LM's loss is logged on its own. Shared by the
    model and the pipeline's last stage."""
    token_losses = layers.cross_entropy(logits, targets)
    correct = layers.predicted_ids(logits) == targets
    count = torch.tensor(targets.numel(), device=logits.device)
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
