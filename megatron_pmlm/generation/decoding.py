"""Sequence-to-sequence decoding as the authors' s2s-ft toolkit does it (SPEC §7.2).

The tokens are those of s2s-ft's `BertForSeq2SeqDecoder` (`forward` = greedy, `beam_search`) on
the same weights; the layout is expressed in the pre-training roles and steps, so the one attention
rule (`layout.pmlm_attention_allowed`) serves training and decoding alike:

    slot (P = longest source + 2)     role      step    sees
    [CLS] source [SEP]                CONTEXT   0       the source
    source padding                    PAD       0       the source (and is seen by nobody)
    target slot P + k                 ORIGINAL  k + 1   the source, target slots <= k
    [MASK] predicting slot P + k      PSEUDO    k + 1   the source, target slots < k, itself

Target slot k holds y_k, fed back at step k + 1; the [MASK] of step t sits at slot P + t, its
output is the prediction, and it is dropped afterwards (nothing ever sees a [MASK]). Each step runs
only the new slots against a key/value cache of the committed ones. With `pos_shift` (causal-mode
models) the source has no [SEP], target slot 0 holds [SEP] and slot k + 1 holds y_k; there is no
[MASK]: the prediction is read from the last slot run.

The searches (search.py's `greedy_search`, `beam_search`) take any `StepScorer`, a model's next-word scores one
step at a time: s2s-ft's layout of a PMLM model here, PALM's decoder with its copy distribution in
`PalmDecoder` (`decode_palm`), so both share the beam, n-gram blocking and length penalty.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..models.layout import CONTEXT, ORIGINAL, PAD, PSEUDO
from ..models.model import KeyValueCache, PMLMForPreTraining
from .search import DecodeOutput, DecodingConfig, beam_search, greedy_search, resolve_tokens


REFERENCE_LAYERNORM_EPSILON = 1e-5
"""s2s-ft's decoder hard-codes LayerNorm eps 1e-5 whatever the model was trained with (1e-12)."""


@dataclass
class Slots:
    """Model inputs for a run of slots, each [rows, slots]."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    token_type_ids: torch.Tensor
    roles: torch.Tensor
    steps: torch.Tensor

    def model_inputs(self) -> tuple[torch.Tensor, ...]:
        return self.input_ids, self.position_ids, self.token_type_ids, self.roles, self.steps

    @property
    def length(self) -> int:
        return self.input_ids.shape[1]

    def cat(self, other: "Slots") -> "Slots":
        return Slots(*(torch.cat([a, b], 1) for a, b in zip(self.model_inputs(), other.model_inputs())))

    def first(self, count: int) -> "Slots":
        return Slots(*(t[:, :count] for t in self.model_inputs()))

    def select_rows(self, index: torch.Tensor) -> "Slots":
        return Slots(*(t.index_select(0, index) for t in self.model_inputs()))


@dataclass
class DecoderBatch:
    """SPEC §7.2 B.1 (s2s-ft's Preprocess4Seq2seqDecoder) for one batch: source slots [0, P) hold
    [CLS] src [SEP] + padding, P = longest source + specials; target slots [P, L). Real source slot
    i has position i, padding 0, target slot P + k position n + specials + k (n: this example's
    source length), so an example's positions do not depend on its batch-mates."""

    source_ids: torch.Tensor
    """[B, P]"""
    source_roles: torch.Tensor
    """[B, P]: CONTEXT, PAD for padding."""
    position_ids: torch.Tensor
    """[B, L]"""
    source_type_id: int
    target_type_id: int

    @property
    def size(self) -> int:
        return self.source_ids.shape[0]

    @property
    def prefix_length(self) -> int:
        return self.source_ids.shape[1]

    @property
    def total_length(self) -> int:
        return self.position_ids.shape[1]

    @property
    def num_steps(self) -> int:
        return self.total_length - self.prefix_length

    def token_type_ids(self) -> torch.Tensor:
        """[B, L]: source_type_id over the source slots (padding included), target_type_id after."""
        types = torch.full_like(self.position_ids, self.target_type_id)
        types[:, :self.prefix_length] = self.source_type_id
        return types

    def source_slots(self) -> Slots:
        prefix = self.prefix_length
        return Slots(self.source_ids, self.position_ids[:, :prefix],
                     torch.full_like(self.source_ids, self.source_type_id), self.source_roles,
                     torch.zeros_like(self.source_ids))

    def target_slots(self, first: int, ids: torch.Tensor, role: int = ORIGINAL) -> Slots:
        """Target slots P + first ... holding `ids` [B, count]: ORIGINAL of step k + 1 at slot k, or
        with role=PSEUDO the [MASK] that predicts slot k (same step, so it sees the slots before)."""
        count = ids.shape[1]
        start = self.prefix_length + first
        steps = torch.arange(first + 1, first + 1 + count, device=ids.device).expand_as(ids)
        return Slots(ids, self.position_ids[:, start:start + count], torch.full_like(ids, self.target_type_id),
                     torch.full_like(ids, role), steps)

    def select_rows(self, index: torch.Tensor) -> "DecoderBatch":
        return replace(self, source_ids=self.source_ids.index_select(0, index),
                       source_roles=self.source_roles.index_select(0, index),
                       position_ids=self.position_ids.index_select(0, index))


def build_decoder_batch(sources: Sequence[Sequence[int]], config: DecodingConfig, cls_id: int, sep_id: int,
                        pad_id: int, source_type_id: int = 0, target_type_id: int = 1,
                        device: torch.device | str = "cpu") -> DecoderBatch:
    """B.1 from source wordpiece ids (cut here to config.max_source_tokens)."""
    if not sources:
        raise ValueError("build_decoder_batch needs at least one source")
    sources = [np.asarray(source, dtype=np.int64)[:config.max_source_tokens] for source in sources]
    lengths = np.array([len(source) for source in sources])
    specials = config.source_specials
    prefix = int(lengths.max()) + specials
    total = min(config.max_target_length + prefix, config.max_seq_length)

    ids = np.full((len(sources), prefix), pad_id, dtype=np.int64)
    ids[:, 0] = cls_id
    for row, source in enumerate(sources):  # one copy per example
        ids[row, 1:1 + len(source)] = source
    if not config.pos_shift:
        ids[np.arange(len(sources)), lengths + 1] = sep_id

    slot = np.arange(total)[None, :]
    real_source = lengths[:, None] + specials  # real source slots per example
    positions = np.where(slot < real_source, slot, 0)
    positions = np.where(slot >= prefix, slot - prefix + real_source, positions)
    roles = np.where(slot[:, :prefix] < real_source, CONTEXT, PAD)
    as_tensor = lambda a: torch.as_tensor(a, dtype=torch.long, device=device)  # noqa: E731
    return DecoderBatch(as_tensor(ids), as_tensor(roles), as_tensor(positions), source_type_id, target_type_id)


class _CachedRunner:
    """Runs the new slots against the committed ones' cached keys/values (B.2)."""

    def __init__(self, model: PMLMForPreTraining):
        self.model = model
        self.cache = KeyValueCache(len(model.bert.encoder.layer))

    def run(self, new: Slots, commit: int) -> torch.Tensor:
        hidden = self.model.bert.forward_incremental(*new.model_inputs(), cache=self.cache)
        self.cache.commit(commit)
        return hidden[:, -1]

    def reorder(self, index: torch.Tensor) -> None:
        self.cache.reorder(index)


class _RecomputeRunner:
    """The same steps by a full forward over every committed slot plus the new ones (to check the
    cache against, and to measure what it saves)."""

    def __init__(self, model: PMLMForPreTraining):
        self.model = model
        self.committed: Slots | None = None

    def run(self, new: Slots, commit: int) -> torch.Tensor:
        everything = new if self.committed is None else self.committed.cat(new)
        hidden = self.model.bert(*everything.model_inputs())
        self.committed = everything.first(everything.length - new.length + commit)
        return hidden[:, -1]

    def reorder(self, index: torch.Tensor) -> None:
        self.committed = self.committed.select_rows(index)


class Seq2SeqDecoder:
    """Greedy and beam-search decoding of a PMLM model, token for token s2s-ft's decoder.

    `special` needs .cls, .sep, .mask, .pad ids (tokenizer.SpecialTokenIds); `token_to_id` maps
    config.ngram_ignore_tokens to ids. `full_recompute` runs the whole sequence every step instead
    of the cache (identical outputs up to float rounding; for tests and benchmarks).
    """

    def __init__(self, model: PMLMForPreTraining, special, config: DecodingConfig, source_type_id: int = 0,
                 target_type_id: int = 1, token_to_id: Callable[[str], int | None] | None = None,
                 full_recompute: bool = False):
        if config.ngram_ignore_tokens and token_to_id is None:
            raise ValueError("ngram_ignore_tokens needs token_to_id to map them to ids")
        if model.config.max_position_embeddings < config.max_seq_length:
            raise ConfigError(f"the model has {model.config.max_position_embeddings} positions, fewer than "
                              f"--max-seq-length {config.max_seq_length} (build_decoding_model extends the table)")
        type_count = model.config.type_vocab_size
        for name, value in (("source_type_id", source_type_id), ("target_type_id", target_type_id)):
            if not 0 <= value < type_count:
                raise ConfigError(f"{name} {value} is outside the model's {type_count} segment types")
        self.model = model
        self.special = special
        self.config = config
        self.source_type_id = source_type_id
        self.target_type_id = target_type_id
        self.full_recompute = full_recompute
        self.device = next(model.parameters()).device
        self.ignore_ids = resolve_tokens(config.ngram_ignore_tokens, token_to_id) if token_to_id else []

    @property
    def max_source_tokens(self) -> int:
        return self.config.max_source_tokens

    def build_batch(self, sources: Sequence[Sequence[int]]) -> DecoderBatch:
        return build_decoder_batch(sources, self.config, self.special.cls, self.special.sep, self.special.pad,
                                   self.source_type_id, self.target_type_id, self.device)

    @torch.inference_mode()
    def decode(self, sources: Sequence[Sequence[int]]) -> DecodeOutput:
        """One batch of source wordpiece ids (no specials); greedy when beam_size is 1, as s2s-ft."""
        batch = self.build_batch(sources)
        return self.greedy(batch) if self.config.beam_size == 1 else self.beam_search(batch)

    def _runner(self):
        return _RecomputeRunner(self.model) if self.full_recompute else _CachedRunner(self.model)

    def _step(self, batch: DecoderBatch, step: int, previous: torch.Tensor | None) -> tuple[Slots, int]:
        """The slots step `step` runs and how many of them stay (B.2). `previous` [rows]: the word
        chosen at step - 1 for each row."""
        rows = batch.size
        if self.config.pos_shift:
            if step == 0:
                sep = torch.full((rows, 1), self.special.sep, dtype=torch.long, device=self.device)
                new = batch.source_slots().cat(batch.target_slots(0, sep))
            else:
                new = batch.target_slots(step, previous[:, None])
            return new, new.length
        new = batch.source_slots() if step == 0 else batch.target_slots(step - 1, previous[:, None])
        mask = torch.full((rows, 1), self.special.mask, dtype=torch.long, device=self.device)
        return new.cat(batch.target_slots(step, mask, role=PSEUDO)), new.length

    def _predict(self, runner, batch: DecoderBatch, step: int, previous: torch.Tensor | None) -> torch.Tensor:
        """Vocabulary logits [rows, V] of this step's prediction slot."""
        return self.model.mlm_logits(runner.run(*self._step(batch, step, previous)))

    @torch.inference_mode()
    def greedy(self, batch: DecoderBatch) -> DecodeOutput:
        """s2s-ft's `forward`: argmax at every step. It may stop once every row has produced a
        [SEP] or [PAD], since the text ends there."""
        return greedy_search(_Seq2SeqScorer(self, batch), batch.num_steps, batch.size,
                             (self.special.sep, self.special.pad), self.device)

    @torch.inference_mode()
    def beam_search(self, batch: DecoderBatch) -> DecodeOutput:
        """s2s-ft's `beam_search` (B.4-B.6), see `beam_search` below."""
        return beam_search(_Seq2SeqScorer(self, batch), batch.num_steps, batch.size, self.config, self.special.sep,
                           self.model.config.vocab_size, self.ignore_ids, self.device)


class _Seq2SeqScorer:
    """A PMLM model's next-word logits over the s2s-ft layout (Seq2SeqDecoder._step)."""

    def __init__(self, decoder: "Seq2SeqDecoder", batch: DecoderBatch):
        self.decoder, self.batch, self.runner = decoder, batch, decoder._runner()

    def scores(self, step: int, previous: torch.Tensor | None) -> torch.Tensor:
        return self.decoder._predict(self.runner, self.batch, step, previous)

    def log_probs(self, scores: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(scores.float(), dim=-1)

    def reorder(self, index: torch.Tensor) -> None:
        if index.numel() != self.batch.size:  # the beam's first step: one row per hypothesis
            self.batch = self.batch.select_rows(index)
        self.runner.reorder(index)


class _PalmScorer:
    """PALM's log P(w) under the copy mixture, one decoder token at a time (palm.next_log_probs)."""

    def __init__(self, model, state, bos_id: int):
        self.model, self.state, self.bos_id = model, state, bos_id

    def scores(self, step: int, previous: torch.Tensor | None) -> torch.Tensor:
        from ..models.palm import next_log_probs

        if previous is None:
            previous = torch.full((self.state.encoder_hidden.shape[0],), self.bos_id, dtype=torch.long,
                                  device=self.state.encoder_hidden.device)
        return next_log_probs(self.model, self.state, previous)

    def log_probs(self, scores: torch.Tensor) -> torch.Tensor:
        return scores  # already log P

    def reorder(self, index: torch.Tensor) -> None:
        self.state.reorder(index)


class PalmDecoder:
    """Continuation decoding of a PALM model (greedy or beam search with the copy distribution):
    the encoder reads `[CLS] context [SEP]`, the decoder starts from [CLS] and stops at [SEP]. The
    searches, n-gram blocking, min length and length penalty are Seq2SeqDecoder's."""

    def __init__(self, model, special, config: DecodingConfig, token_to_id: Callable[[str], int | None] | None = None):
        if config.ngram_ignore_tokens and token_to_id is None:
            raise ValueError("ngram_ignore_tokens needs token_to_id to map them to ids")
        positions = model.config.max_position_embeddings
        if config.max_target_length > positions:
            raise ConfigError(f"--max-target-length {config.max_target_length} exceeds the model's {positions} "
                              "decoder positions")
        self.model, self.special, self.config = model, special, config
        self.device = next(model.parameters()).device
        self.max_source_tokens = min(config.max_seq_length, positions) - 2
        self.ignore_ids = resolve_tokens(config.ngram_ignore_tokens, token_to_id) if token_to_id else []

    def build_batch(self, contexts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Encoder ids `[CLS] context [SEP]` (cut to max_source_tokens) and roles, right-padded."""
        if not contexts:
            raise ValueError("PalmDecoder needs at least one context")
        contexts = [np.asarray(c, dtype=np.int64)[:self.max_source_tokens] for c in contexts]
        lengths = np.array([len(c) + 2 for c in contexts])
        ids = np.full((len(contexts), int(lengths.max())), self.special.pad, dtype=np.int64)
        ids[:, 0] = self.special.cls
        for row, context in enumerate(contexts):  # one copy per example
            ids[row, 1:1 + len(context)] = context
        ids[np.arange(len(contexts)), lengths - 1] = self.special.sep
        roles = np.where(np.arange(ids.shape[1])[None, :] < lengths[:, None], CONTEXT, PAD)
        as_tensor = lambda a: torch.as_tensor(a, dtype=torch.long, device=self.device)  # noqa: E731
        return as_tensor(ids), as_tensor(roles)

    @torch.inference_mode()
    def decode(self, contexts: Sequence[Sequence[int]]) -> DecodeOutput:
        from ..models.palm import start_decoding

        encoder_ids, roles = self.build_batch(contexts)
        state = start_decoding(self.model, encoder_ids, roles, encoder_ids)
        scorer = _PalmScorer(self.model, state, self.special.cls)
        steps, rows = self.config.max_target_length, encoder_ids.shape[0]
        if self.config.beam_size == 1:
            return greedy_search(scorer, steps, rows, (self.special.sep, self.special.pad), self.device)
        return beam_search(scorer, steps, rows, self.config, self.special.sep, self.model.config.vocab_size,
                           self.ignore_ids, self.device)


def decode_in_batches(decoder: Seq2SeqDecoder | PalmDecoder, sources: Sequence[Sequence[int]], batch_size: int,
                      progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """Generated ids for every source, in input order. As s2s-ft, sources (cut to the budget) are
    sorted by decreasing length (stable) before batching, so batches pad little."""
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1, got {batch_size}")
    budget = decoder.max_source_tokens
    order = sorted(range(len(sources)), key=lambda i: -min(len(sources[i]), budget))
    outputs: list[list[int]] = [[] for _ in sources]
    for start in range(0, len(order), batch_size):
        chunk = order[start:start + batch_size]
        result = decoder.decode([sources[i] for i in chunk])
        for index, ids in zip(chunk, result.token_ids):
            outputs[index] = ids
        if progress is not None:
            progress(len(chunk))
    return outputs


def build_decoding_model(loaded, max_seq_length: int, dtype: torch.dtype = torch.float32,
                         device: torch.device | str = "cpu",
                         layernorm_epsilon: float | None = REFERENCE_LAYERNORM_EPSILON) -> PMLMForPreTraining:
    """The model of a `pretrained.LoadedModel` ready to decode: no dropout, a position table of at
    least max_seq_length rows (s2s-ft's reuse_position_embedding), eval mode. LayerNorm uses
    s2s-ft's decoder eps (1e-5) so the tokens match it; None keeps the trained value."""
    from ..pretrained import resize_position_embeddings

    overrides = dict(max_position_embeddings=max(loaded.config.max_position_embeddings, max_seq_length),
                     padded_vocab_size=0, hidden_dropout=0.0, attention_dropout=0.0)
    if layernorm_epsilon is not None:
        overrides["layernorm_epsilon"] = layernorm_epsilon
    config = replace(loaded.config, **overrides)
    model = PMLMForPreTraining(config)
    state = resize_position_embeddings(loaded.state_dict, config.max_position_embeddings)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{loaded.source}: weights do not fit the model (missing {missing[:4]}, unexpected "
                          f"{unexpected[:4]})")
    return model.to(device=device, dtype=dtype).eval()


def build_palm_decoding_model(loaded, device: str = "cpu"):
    """The model of a `palm_adapter.LoadedPalm`, without dropout, in eval mode (stage 2)."""
    from dataclasses import replace

    from ..config import ConfigError
    from ..models.palm import PalmForPreTraining

    config = replace(loaded.config, padded_vocab_size=0, hidden_dropout=0.0, attention_dropout=0.0)
    model = PalmForPreTraining(config, stage=2)
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{loaded.source}: weights do not fit the PALM model (missing {missing[:4]}, unexpected "
                          f"{unexpected[:4]})")
    return model.to(device).eval()
