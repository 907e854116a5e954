"""Sequence-to-sequence fine-tuning as the authors' s2s-ft toolkit does it (SPEC §7.1), expressed
with the pre-training layout's roles and steps, so the one attention rule serves every mode:

    mode            s2s-ft   batch columns                     predicted at
    pseudo-masked   v2       [source | targets | [P] of each]   every [P] (labels: the target)
    masked          v1       [source | targets]                 a random subset of target slots
    causal          v0       [source | [SEP] targets]           every target slot (the next token)

Source tokens are CONTEXT (they see the source only); target slot j is the ORIGINAL of step j + 1
(it sees the source and targets up to itself); its [P] is the PSEUDO of the same step (it sees the
source, earlier targets and itself). Padding is PAD (seen by nobody). Position ids are s2s-ft's:
source slot i -> i, target slot j (and its [P]) -> source length + j, padding -> 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np
import torch

from ..config import ConfigError
from ..files import file_problem
from ..parallel.layers import LabelSmoothing, ParallelLayers, chunked_biased_cross_entropy
from .layout import CONTEXT, IGNORE_INDEX, ORIGINAL, PAD, PSEUDO, PMLMBatch, gather_slots, labelled_index
from .model import PMLMForPreTraining
from .metrics import MetricSpec

MODES = {"pseudo-masked": "v2", "masked": "v1", "causal": "v0"}
"""Our mode names and s2s-ft's `--mask_way` for each."""


@dataclass
class Seq2SeqConfig:
    """s2s-ft's example construction and loss; defaults are its code's (run_seq2seq.py)."""

    mode: str = "pseudo-masked"
    max_source_length: int = 464
    """Source budget, [CLS] and [SEP] included (s2s-ft --max_source_seq_length)."""
    max_target_length: int = 48
    """Target budget, the final [SEP] included (s2s-ft --max_target_seq_length)."""
    target_mask_prob: float = 0.5
    """Word drop: the chance a visible target token is corrupted too (pseudo-masked, causal), or
    the fraction of target tokens masked (masked)."""
    target_keep_prob: float = 0.1
    """Corruption c(x): keep the token with this probability ..."""
    target_random_prob: float = 0.1
    """... or draw a uniform random id; else [MASK]."""
    max_masked_targets: int = 0
    """Masked mode's cap on masked target tokens per example; 0: max_target_length (s2s-ft's
    --num_max_mask_token defaults to 0, which masks a single token: set it)."""
    label_smoothing: float = 0.1
    source_type_id: int = 0
    target_type_id: int = 1

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"unknown --mode {self.mode!r}; choose one of: {', '.join(MODES)}")
        if self.max_source_length < 2 or self.max_target_length < 2:
            raise ConfigError(f"--max-source-length and --max-target-length must be at least 2 (got "
                              f"{self.max_source_length}, {self.max_target_length})")
        for name in ("target_mask_prob", "target_keep_prob", "target_random_prob", "label_smoothing"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ConfigError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(self, name)}")
        if self.target_keep_prob + self.target_random_prob > 1.0:
            raise ConfigError("--target-keep-prob + --target-random-prob must not exceed 1")
        if self.label_smoothing >= 1.0:
            raise ConfigError("--label-smoothing must be below 1")
        if self.max_masked_targets < 0:
            raise ConfigError(f"--max-masked-targets must be >= 0, got {self.max_masked_targets}")

    @property
    def pseudo_masked(self) -> bool:
        return self.mode == "pseudo-masked"

    @property
    def causal(self) -> bool:
        return self.mode == "causal"

    @property
    def max_length(self) -> int:
        """Positions the model needs: source plus target budget (s2s-ft enlarges the table to this)."""
        return self.max_source_length + self.max_target_length


# ------------------------------------------------------------------------------------------------
# Reading pairs
# ------------------------------------------------------------------------------------------------

def read_pairs(jsonl: str | None = None, src: str | None = None, tgt: str | None = None,
               what: str = "train") -> tuple[list[str], list[str]]:
    """(sources, targets) from s2s-ft's JSONL (`src`, `tgt` fields) or two aligned text files."""
    if jsonl and (src or tgt):
        raise ConfigError(f"give either --{what}-file or --{what}-src/--{what}-tgt, not both")
    if jsonl:
        path = _existing(jsonl, f"--{what}-file")
        sources, targets = [], []
        with path.open(encoding="utf-8") as handle:
            for number, line in enumerate(handle, start=1):
                if not line.strip():
                    raise ConfigError(f"{path}:{number}: empty line")
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ConfigError(f"{path}:{number}: not JSON ({error.msg})") from None
                if not isinstance(record, dict):
                    raise ConfigError(f"{path}:{number}: not a JSON object")
                for key in ("src", "tgt"):
                    if key not in record:
                        raise ConfigError(f"{path}:{number}: no {key!r} field")
                    if not isinstance(record[key], str) or not record[key].strip():
                        raise ConfigError(f"{path}:{number}: {key!r} is empty or not a string")
                sources.append(record["src"])
                targets.append(record["tgt"])
        if not sources:
            raise ConfigError(f"{path} holds no examples")
        return sources, targets
    if not (src and tgt):
        raise ConfigError(f"--{what}-src and --{what}-tgt go together (or use --{what}-file F.jsonl)")
    sides = []
    for flag, name in ((f"--{what}-src", src), (f"--{what}-tgt", tgt)):
        path = _existing(name, flag)
        lines = path.read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                raise ConfigError(f"{path}:{number}: empty line")
        if not lines:
            raise ConfigError(f"{path} holds no examples")
        sides.append((path, lines))
    (src_path, sources), (tgt_path, targets) = sides
    if len(sources) != len(targets):
        raise ConfigError(f"{src_path} has {len(sources)} lines but {tgt_path} has {len(targets)}: "
                          "source and target files must be aligned line by line")
    return sources, targets


def _existing(name: str, flag: str) -> Path:
    path = Path(name)
    problem = file_problem(path)
    if problem:
        raise ConfigError(f"{flag} {path} {problem}")
    return path


# ------------------------------------------------------------------------------------------------
# Examples
# ------------------------------------------------------------------------------------------------

@dataclass
class SpecialIds:
    cls: int
    sep: int
    mask: int
    pad: int


@dataclass
class Seq2SeqExamples:
    """Tokenized, truncated examples (specials in place), kept as flat arrays plus offsets."""

    source_ids: list[np.ndarray]
    target_ids: list[np.ndarray]
    truncated_sources: int
    truncated_targets: int

    def __len__(self) -> int:
        return len(self.source_ids)


def build_examples(sources: Sequence[np.ndarray], targets: Sequence[np.ndarray], config: Seq2SeqConfig,
                   special: SpecialIds) -> Seq2SeqExamples:
    """SPEC §7.1 A.1: each side truncated against its own budget, head kept; the final [SEP] is
    appended even after truncation (a cut target teaches an early stop). Causal mode: source
    `([CLS]+src)[:max_src]` and target `([SEP]+tgt)[:max_tgt]`, no final [SEP]."""
    cls, sep = np.array([special.cls]), np.array([special.sep])
    out_sources, out_targets, cut_sources, cut_targets = [], [], 0, 0
    for source, target in zip(sources, targets):
        source, target = np.asarray(source, dtype=np.int64), np.asarray(target, dtype=np.int64)
        if config.causal:
            full_source, full_target = np.concatenate([cls, source]), np.concatenate([sep, target])
            new_source = full_source[:config.max_source_length]
            new_target = full_target[:config.max_target_length]
        else:
            full_source, full_target = np.concatenate([cls, source]), target
            new_source = np.concatenate([full_source[:config.max_source_length - 1], sep])
            new_target = np.concatenate([target[:config.max_target_length - 1], sep])
            full_source = np.concatenate([full_source, sep])
            full_target = np.concatenate([full_target, sep])
        cut_sources += len(new_source) < len(full_source)
        cut_targets += len(new_target) < len(full_target)
        out_sources.append(new_source)
        out_targets.append(new_target)
    return Seq2SeqExamples(out_sources, out_targets, cut_sources, cut_targets)


def corrupt(tokens: np.ndarray, rng: np.random.Generator, config: Seq2SeqConfig, vocab_size: int,
            mask_id: int) -> np.ndarray:
    """s2s-ft's get_masked_token, vectorized: keep / uniform random id in [0, V) / [MASK]."""
    draw = rng.random(len(tokens))
    random_ids = rng.integers(0, vocab_size, len(tokens))
    keep = draw < config.target_keep_prob
    random = ~keep & (draw < config.target_keep_prob + config.target_random_prob)
    return np.where(keep, tokens, np.where(random, random_ids, mask_id))


def example_rng(seed: int, sample_index: int) -> np.random.Generator:
    """One generator per (seed, global sample index): the corruption of a sample does not depend on
    the batch it lands in, the data-parallel size or a resume."""
    return np.random.default_rng([seed, sample_index])


def build_seq2seq_batch(sources: Sequence[np.ndarray], targets: Sequence[np.ndarray],
                        rngs: Sequence[np.random.Generator], config: Seq2SeqConfig, special: SpecialIds,
                        vocab_size: int) -> PMLMBatch:
    """The batch tensors of one micro-batch (SPEC §7.1 A.2-A.4), padded to its longest example.

    s2s-ft pads each side to its maximum; padding is seen by nobody, so padding to the batch's
    longest side instead gives the same outputs for less compute.
    """
    batch = len(sources)
    source_lengths = np.array([len(s) for s in sources])
    target_lengths = np.array([len(t) for t in targets])
    source_width, target_width = int(source_lengths.max()), int(target_lengths.max())
    blocks = 3 if config.pseudo_masked else 2
    total = source_width + (blocks - 1) * target_width
    ids = np.full((batch, total), special.pad, dtype=np.int64)
    positions = np.zeros((batch, total), dtype=np.int64)
    segments = np.full((batch, total), config.target_type_id, dtype=np.int64)
    segments[:, :source_width] = config.source_type_id
    roles = np.full((batch, total), PAD, dtype=np.int64)
    steps = np.zeros((batch, total), dtype=np.int64)
    labels = np.full((batch, total), IGNORE_INDEX, dtype=np.int64)

    source_columns = np.arange(source_width)[None, :]
    in_source = source_columns < source_lengths[:, None]
    positions[:, :source_width] = np.where(in_source, source_columns, 0)
    roles[:, :source_width] = np.where(in_source, CONTEXT, PAD)
    target_columns = np.arange(target_width)[None, :]
    in_target = target_columns < target_lengths[:, None]
    target_positions = np.where(in_target, source_lengths[:, None] + target_columns, 0)
    target_steps = np.where(in_target, target_columns + 1, 0)
    target_block = slice(source_width, source_width + target_width)
    positions[:, target_block] = target_positions
    roles[:, target_block] = np.where(in_target, ORIGINAL, PAD)
    steps[:, target_block] = target_steps
    if config.pseudo_masked:
        pseudo_block = slice(source_width + target_width, total)
        positions[:, pseudo_block] = target_positions
        roles[:, pseudo_block] = np.where(in_target, PSEUDO, PAD)
        steps[:, pseudo_block] = target_steps

    for row, (source, target, rng) in enumerate(zip(sources, targets, rngs)):  # a row at a time, tokens vectorized
        ids[row, :len(source)] = source
        start, length = source_width, len(target)
        visible, labelled = _target_inputs(target, rng, config, special, vocab_size)
        ids[row, start:start + length] = visible
        if config.pseudo_masked:
            pseudo, row_labels = labelled
            ids[row, start + target_width:start + target_width + length] = pseudo
            labels[row, start + target_width:start + target_width + length] = row_labels
        else:
            labels[row, start:start + length] = labelled
    tensors = [torch.from_numpy(a) for a in (ids, positions, segments, roles, steps, labels)]
    return PMLMBatch(*tensors, predicted_index=labelled_index(tensors[-1]))


def _target_inputs(target: np.ndarray, rng: np.random.Generator, config: Seq2SeqConfig, special: SpecialIds,
                   vocab_size: int):
    """(visible target inputs, labels) of one example; for pseudo-masked, labels = ([P] inputs, labels)."""
    length = len(target)
    if config.mode == "pseudo-masked":
        pseudo = corrupt(target, rng, config, vocab_size, special.mask)
        dropped = rng.random(length) < config.target_mask_prob
        return np.where(dropped, pseudo, target), (pseudo, target)
    if config.mode == "masked":
        cap = config.max_masked_targets or config.max_target_length
        count = max(1, min(cap, int(config.target_mask_prob * length)))
        chosen = rng.permutation(length)[:count]
        visible = target.copy()
        visible[chosen] = corrupt(target[chosen], rng, config, vocab_size, special.mask)
        labels = np.full(length, IGNORE_INDEX, dtype=np.int64)
        labels[chosen] = target[chosen]
        return visible, labels
    # causal: slot j predicts the next token, the last one [SEP]; slots j >= 1 are word-dropped.
    labels = np.append(target[1:], special.sep)
    dropped = rng.random(length) < config.target_mask_prob
    dropped[0] = False
    visible = np.where(dropped, corrupt(target, rng, config, vocab_size, special.mask), target)
    return visible, labels


# ------------------------------------------------------------------------------------------------
# Batches over an epoch-shuffled dataset, resumable from the consumed-sample count
# ------------------------------------------------------------------------------------------------

def sample_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, 1 << 20, epoch]).permutation(num_examples)


def seq2seq_batches(examples: Seq2SeqExamples, config: Seq2SeqConfig, special: SpecialIds, vocab_size: int,
                    micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int, seed: int,
                    consumed_samples: int = 0, shuffle: bool = True) -> Iterator[PMLMBatch]:
    """This rank's micro-batches, forever: global sample g is example order[g mod N] of epoch g // N;
    each step's samples are split into consecutive micro-batches of `micro_batch_size` per rank,
    interleaved over ranks, so the global batch is the same for every data-parallel size."""
    count = len(examples)
    cached_epoch, order = -1, None
    start = consumed_samples
    while True:
        indices = start + data_parallel_rank * micro_batch_size + np.arange(micro_batch_size)
        start += micro_batch_size * data_parallel_size
        example_ids = []
        for index in indices:
            epoch = int(index) // count
            if epoch != cached_epoch:
                cached_epoch = epoch
                order = sample_order(count, seed, epoch) if shuffle else np.arange(count)
            example_ids.append(int(order[int(index) % count]))
        yield build_seq2seq_batch([examples.source_ids[i] for i in example_ids],
                                  [examples.target_ids[i] for i in example_ids],
                                  [example_rng(seed, int(i)) for i in indices], config, special, vocab_size)


# ------------------------------------------------------------------------------------------------
# Loss
# ------------------------------------------------------------------------------------------------

SEQ2SEQ_METRICS = MetricSpec(("loss", "correct", "count"), (("acc", "correct", "count"),))


@dataclass
class Seq2SeqLosses:
    loss: torch.Tensor
    correct: torch.Tensor
    count: torch.Tensor

    def metrics(self) -> torch.Tensor:
        """[loss, correct, count], detached, for logging (SEQ2SEQ_METRICS)."""
        return torch.stack([self.loss.detach().float(), self.correct.float(), self.count.float()])


def label_smoothing_for(smoothing: float, vocab_size: int, pad_id: int) -> LabelSmoothing | None:
    """The chunked cross entropy's smoothing term for s2s-ft's LabelSmoothingLoss (SPEC §7.1 A.5);
    None at 0, where that loss is the plain cross entropy."""
    return LabelSmoothing(smoothing, vocab_size, pad_id) if smoothing else None


def label_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, smoothing: float, pad_id: int) -> torch.Tensor:
    """Per-token KL(q || p) of s2s-ft's LabelSmoothingLoss (SPEC §7.1 A.5), in closed form, over
    the logits' whole last dimension (the real vocabulary).

    q(label) = 1 - eps, q(pad) = 0, every other id eps / (V - 2); KL = sum_v q (log q - log p), so
    = const - (1 - eps) log p(label) - eps / (V - 2) * (sum_v log p(v) - log p(label) - log p(pad)).
    With eps = 0 this is the plain cross-entropy. log p is computed in fp32, a chunk of rows at a
    time (`chunked_biased_cross_entropy`).
    """
    smoothing_term = label_smoothing_for(smoothing, logits.shape[-1], pad_id)
    return chunked_biased_cross_entropy(logits, labels, None, label_smoothing=smoothing_term)[0]


class PMLMForSeq2Seq(PMLMForPreTraining):
    """The pre-training model (same weights, same attention rule) with s2s-ft's loss: a token mean,
    over the micro-batch, of the label-smoothed loss at every labelled slot."""

    def __init__(self, config, seq2seq: Seq2SeqConfig, pad_token_id: int = 0, init_seed: int = 0, layers=None):
        super().__init__(config, "ae+par", layers=layers, init_seed=init_seed)
        self.seq2seq = seq2seq
        self.pad_token_id = pad_token_id

    def forward(self, input_ids, position_ids, token_type_ids, roles, steps, labels,
                predicted_index: torch.Tensor | None = None) -> Seq2SeqLosses:
        """`predicted_index`: the labelled slots' flat indices (`layout.labelled_index`, made with
        the batch on the CPU); None: computed here, a host-device sync."""
        hidden = self.bert.padded_forward(input_ids, position_ids, token_type_ids, roles, steps)
        return self.losses(hidden, token_type_ids, roles, labels, predicted_index)

    def losses(self, hidden: torch.Tensor, token_type_ids: torch.Tensor, roles: torch.Tensor, labels: torch.Tensor,
               predicted_index: torch.Tensor | None = None) -> Seq2SeqLosses:
        """The label-smoothed loss from the encoder's output (at the layout's width or padded wider,
        `BertModel.padded_forward`; one region under --compile)."""
        if predicted_index is None:
            predicted_index = labelled_index(labels)
        # Only labelled slots go through the vocabulary projection.
        logits, bias = self.mlm_logits_and_bias(gather_slots(hidden, predicted_index, labels.shape[1]))
        smoothing = label_smoothing_for(self.seq2seq.label_smoothing, self.config.vocab_size, self.pad_token_id)
        return seq2seq_losses(logits, bias, gather_slots(labels, predicted_index), smoothing, self.layers)


def seq2seq_losses(logits: torch.Tensor, bias: torch.Tensor, targets: torch.Tensor,
                   smoothing: LabelSmoothing | None, layers: ParallelLayers) -> Seq2SeqLosses:
    """s2s-ft's loss of the labelled slots' logits (compute dtype) and output bias (-inf at the
    vocabulary padding, which q leaves out too): the label-smoothed loss summed over the slots
    over their count, by the chunked cross entropy (no fp32 [tokens, vocab] tensor)."""
    token_losses, predicted = layers.biased_cross_entropy(logits, targets, bias, smoothing)
    count = torch.full((), targets.numel(), device=logits.device)  # a fill, not a host copy
    loss = token_losses.sum() / (count.float() + 1e-5)  # s2s-ft's loss_mask_and_normalize
    return Seq2SeqLosses(loss, (predicted == targets).sum(), count)
