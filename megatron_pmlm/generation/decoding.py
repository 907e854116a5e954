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

The searches (`greedy_search`, `beam_search`) take any `StepScorer`, a model's next-word scores one
step at a time: s2s-ft's layout of a PMLM model here, PALM's decoder with its copy distribution in
`PalmDecoder` (`decode_palm`), so both share the beam, n-gram blocking and length penalty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Callable, Collection, Protocol, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from ..config import ConfigError
from ..models.layout import CONTEXT, ORIGINAL, PAD, PSEUDO
from ..models.model import KeyValueCache, PMLMForPreTraining

BANNED_SCORE = -10000.0
"""s2s-ft's penalty for a banned word, a forced-short [SEP] and every step after a [SEP]: a large
finite number rather than -inf, so a finished hypothesis keeps competing (and losing) in the beam."""

REFERENCE_LAYERNORM_EPSILON = 1e-5
"""s2s-ft's decoder hard-codes LayerNorm eps 1e-5 whatever the model was trained with (1e-12)."""


@dataclass
class DecodingConfig:
    """s2s-ft's decoding settings (decode_seq2seq.py); defaults are its command line's."""

    beam_size: int = 1
    """1: greedy (argmax every step), which like s2s-ft ignores min_length, n-gram blocking and the
    length penalty; those apply to beam search only."""
    length_penalty: float = 0.0
    """When > 0, a finished hypothesis of f tokens (its [SEP] included) is ranked by
    score / ((5 + f) / 6) ** length_penalty; the search itself keeps raw log-probability sums."""
    min_length: int = 1
    """Beam search bans [SEP] until this many tokens precede it (0: off)."""
    max_target_length: int = 128
    """Decoding steps (tokens generated, [SEP] included)."""
    max_seq_length: int = 512
    """Source + target slots; sources are cut to max_seq_length - 2 - max_target_length wordpieces
    (+1 with pos_shift)."""
    no_repeat_ngram_size: int = 0
    """Beam search never repeats an n-gram of this size within a hypothesis (0: off); s2s-ft's
    --forbid_duplicate_ngrams with --ngram_size."""
    ngram_ignore_tokens: list[str] = field(default_factory=list)
    """Tokens exempt from blocking (s2s-ft's --forbid_ignore_word): an n-gram ending in one is never
    banned, and nothing is banned while one is among the last n - 1 tokens."""
    pos_shift: bool = False
    """Decode a causal-mode (s2s-ft v0) model: no source [SEP], the target starts with [SEP]."""

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ConfigError(f"--beam-size must be at least 1, got {self.beam_size}")
        if not math.isfinite(self.length_penalty):
            raise ConfigError(f"--length-penalty must be a finite number, got {self.length_penalty}")
        if self.max_target_length < 1:
            raise ConfigError(f"--max-target-length must be at least 1, got {self.max_target_length}")
        if not 0 <= self.min_length <= self.max_target_length:
            raise ConfigError(f"--min-length must be in [0, --max-target-length = {self.max_target_length}], "
                              f"got {self.min_length}")
        if self.max_target_length > self.max_seq_length - 3:
            raise ConfigError(f"--max-target-length {self.max_target_length} leaves no room for a source in "
                              f"--max-seq-length {self.max_seq_length} (at most max_seq_length - 3)")
        if self.no_repeat_ngram_size < 0:
            raise ConfigError(f"--no-repeat-ngram-size must be >= 0 (0: off), got {self.no_repeat_ngram_size}")
        if any(not isinstance(token, str) or not token for token in self.ngram_ignore_tokens):
            raise ConfigError(f"--ngram-ignore-tokens must be non-empty tokens, got {self.ngram_ignore_tokens!r}")

    @property
    def source_specials(self) -> int:
        """[CLS] and [SEP] before the target, or [CLS] alone with pos_shift (s2s-ft's delta)."""
        return 1 if self.pos_shift else 2

    @property
    def max_source_tokens(self) -> int:
        return self.max_seq_length - 2 - self.max_target_length + int(self.pos_shift)


def parse_ignore_tokens(text: str | None) -> list[str]:
    """--ngram-ignore-tokens: split on whitespace and on s2s-ft's '|'; [bracketed] names upper-cased."""
    tokens = [token for token in (text or "").replace("|", " ").split() if token]
    return [token.upper() if token.startswith("[") and token.endswith("]") else token for token in tokens]


def resolve_tokens(tokens: Sequence[str], token_to_id: Callable[[str], int | None]) -> list[int]:
    ids = []
    for token in tokens:
        token_id = token_to_id(token)
        if token_id is None:
            raise ConfigError(f"--ngram-ignore-tokens: {token!r} is not in the vocabulary")
        ids.append(token_id)
    return ids


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


class NGramBlocker:
    """B.5 (s2s-ft's get_dup_ngram_candidates, vectorized over hypotheses): for each hypothesis,
    the words that would complete an n-gram it already contains are banned at the next step.

    With tail = its last n - 1 tokens, every earlier window equal to the tail bans the token that
    followed it, unless that token is exempt; nothing is banned while the tail holds an exempt
    token. (For n = 1, s2s-ft's `seq[-(n - 1):]` is the whole sequence: every generated word is
    banned unless one of them is exempt. Kept as is.)
    """

    def __init__(self, n: int, vocab_size: int, exempt_ids: Collection[int] = (), device="cpu"):
        self.n = n
        self.vocab_size = vocab_size
        self.exempt = torch.tensor(sorted(set(exempt_ids)), dtype=torch.long, device=device)

    def banned(self, sequences: torch.Tensor) -> torch.Tensor | None:
        """Boolean [rows, vocab] for generated tokens [rows, length]; None before length n."""
        rows, length = sequences.shape
        n = self.n
        if length < n:
            return None
        following = sequences[:, n - 1:]  # the token after window i, i in [0, length - n]
        if n > 1:
            tail = sequences[:, length - n + 1:]
            windows = sequences.unfold(1, n - 1, 1)[:, :length - n + 1]  # [rows, windows, n - 1]
            ban = (windows == tail[:, None, :]).all(-1)
        else:
            tail = sequences
            ban = torch.ones_like(following, dtype=torch.bool)
        if self.exempt.numel():
            ban &= ~torch.isin(following, self.exempt)
            ban &= ~torch.isin(tail, self.exempt).any(-1, keepdim=True)
        banned = torch.zeros(rows, self.vocab_size, dtype=torch.bool, device=sequences.device)
        row_index = torch.arange(rows, device=sequences.device)[:, None].expand_as(following)
        banned[row_index[ban], following[ban]] = True
        return banned


def choose_hypotheses(step_ids: torch.Tensor, step_scores: torch.Tensor, back_pointers: torch.Tensor,
                      sep_id: int, length_penalty: float) -> list[list[int]]:
    """B.6 from the search's record ([steps, B, K] words, cumulative scores, back-pointers).

    The last usable step is the first whose K words are all [SEP] (else the final step); the
    candidates are every [SEP] up to it and every hypothesis of it, ranked by score (divided by
    ((5 + f + 1) / 6) ** lp for step f when lp > 0, in float64 as s2s-ft's Python floats); the
    strict maximum wins, so ties go to the earliest step, then the lowest k. Backtracking follows
    the pointers; the sequence ends with the chosen word (its [SEP] included).
    """
    num_steps, batch, beam = step_ids.shape
    step_index = torch.arange(num_steps, device=step_ids.device)[:, None]
    is_sep = step_ids == sep_id
    all_sep = is_sep.all(-1)  # [steps, B]
    last = torch.where(all_sep, step_index, num_steps).min(0).values.clamp(max=num_steps - 1)  # [B]
    candidate = (is_sep | (step_index == last)[..., None]) & (step_index <= last)[..., None]
    scores = step_scores.double()
    if length_penalty > 0:
        penalties = [math.pow((5 + f + 1) / 6.0, length_penalty) for f in range(num_steps)]
        scores = scores / torch.tensor(penalties, dtype=torch.float64, device=scores.device)[:, None, None]
    scores = scores.masked_fill(~candidate, -math.inf)
    flat = scores.permute(1, 0, 2).reshape(batch, num_steps * beam)  # step-major: ties -> earliest step, lowest k
    best_score, best = flat.max(-1)
    frame = torch.div(best, beam, rounding_mode="floor")
    position = best % beam
    found = best_score > -math.inf  # s2s-ft's `s > max_score` starting from -inf

    tokens = torch.zeros(batch, num_steps, dtype=torch.long, device=step_ids.device)
    for f in range(num_steps - 1, -1, -1):  # one pass over the steps for the whole batch
        if f < num_steps - 1:
            previous = back_pointers[f + 1].gather(1, position[:, None]).squeeze(1)
            position = torch.where(f < frame, previous, position)
        tokens[:, f] = step_ids[f].gather(1, position[:, None]).squeeze(1)
    lengths = torch.where(found, frame + 1, 0).tolist()
    return [row[:length] for row, length in zip(tokens.tolist(), lengths)]


@dataclass
class DecodeOutput:
    token_ids: list[list[int]]
    """Per example, the generated ids: greedy, every step run; beam search, the chosen hypothesis
    up to its [SEP]. Text ends at the first [SEP] or [PAD] (detokenize)."""
    step_ids: torch.Tensor | None = None
    """Beam search's record, [steps, B, K]: words, cumulative scores, back-pointers (s2s-ft's
    score traces)."""
    step_scores: torch.Tensor | None = None
    back_pointers: torch.Tensor | None = None


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


class StepScorer(Protocol):
    """What the searches ask of a model at each step (one row per hypothesis)."""

    def scores(self, step: int, previous: torch.Tensor | None) -> torch.Tensor:
        """[rows, V] scores of the next word (greedy takes their argmax); `previous` [rows]: the
        words chosen at step - 1 (None at step 0)."""

    def log_probs(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores as log-probabilities (beam search sums them)."""

    def reorder(self, index: torch.Tensor) -> None:
        """Rows become rows `index` (beam replication at step 0, back-pointers later)."""


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


def greedy_search(scorer: StepScorer, num_steps: int, rows: int, stop_ids: Collection[int],
                  device) -> DecodeOutput:
    """Argmax at every step; stops once every row has produced a stop id."""
    chosen = []
    stop = torch.tensor(sorted(stop_ids), device=device)
    stopped = torch.zeros(rows, dtype=torch.bool, device=device)
    previous = None
    for step in range(num_steps):
        previous = scorer.scores(step, previous).argmax(-1)
        chosen.append(previous)
        stopped |= torch.isin(previous, stop)
        if bool(stopped.all()):
            break
    return DecodeOutput(torch.stack(chosen, 1).tolist())


def beam_search(scorer: StepScorer, num_steps: int, examples: int, config: DecodingConfig, sep: int,
                vocab_size: int, ignore_ids: Collection[int] = (), device="cpu") -> DecodeOutput:
    """s2s-ft's `beam_search` (B.4-B.6): rows b * K + k after the first step; finished
    hypotheses stay in the beam paying BANNED_SCORE per step. It stops once every example has
    had a step whose K words are all [SEP] (B.6 never looks past that step)."""
    beam = config.beam_size
    blocker = (NGramBlocker(config.no_repeat_ngram_size, vocab_size, ignore_ids, device)
               if config.no_repeat_ngram_size else None)
    record_ids, record_scores, record_pointers = [], [], []
    exhausted = torch.zeros(examples, dtype=torch.bool, device=device)
    previous = banned = generated = scores = finished = None
    for step in range(num_steps):
        log_probs = scorer.log_probs(scorer.scores(step, previous))
        if banned is not None:
            log_probs += banned.to(log_probs.dtype) * BANNED_SCORE
        if config.min_length and step + 1 <= config.min_length:
            log_probs[:, sep] = BANNED_SCORE
        top_scores, top_ids = torch.topk(log_probs, k=beam)  # [rows, K]
        if step == 0:  # one row per example: its top K start the K hypotheses
            words, scores = top_ids, top_scores
            pointers = torch.zeros_like(words)
            source_rows = torch.arange(examples, device=device).repeat_interleave(beam)
        else:
            top_scores += finished.view(-1, 1) * BANNED_SCORE + scores.view(-1, 1)
            scores, best = torch.topk(top_scores.view(examples, beam * beam), k=beam)
            pointers = torch.div(best, beam, rounding_mode="floor")
            words = top_ids.view(examples, beam * beam).gather(1, best)
            source_rows = (torch.arange(examples, device=device)[:, None] * beam + pointers).view(-1)
        scorer.reorder(source_rows)
        finished = (words == sep).to(scores.dtype)
        record_ids.append(words)
        record_scores.append(scores)
        record_pointers.append(pointers)
        previous = words.view(-1)
        if blocker is not None:
            generated = (previous[:, None] if generated is None else
                         torch.cat([generated.index_select(0, source_rows), previous[:, None]], 1))
            banned = blocker.banned(generated)
        exhausted |= (words == sep).all(-1)
        if bool(exhausted.all()):
            break
    step_ids, step_scores, back_pointers = (torch.stack(r) for r in (record_ids, record_scores, record_pointers))
    token_ids = choose_hypotheses(step_ids, step_scores, back_pointers, sep, config.length_penalty)
    return DecodeOutput(token_ids, step_ids, step_scores, back_pointers)


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


def detokenize(tokens: Sequence[str], stop_tokens: Collection[str] = ("[SEP]", "[PAD]")) -> str:
    """B.7: the tokens before the first [SEP] or [PAD]; a '##' piece joins the word before it;
    words are separated by single spaces (punctuation stays a word of its own)."""
    words: list[str] = []
    for token in tokens:
        if token in stop_tokens:
            break
        if token.startswith("##") and words:
            words[-1] += token[2:]
        else:
            words.append(token)
    return " [X_SEP] ".join(" ".join(words).split("\n"))


def generated_length(ids: Sequence[int], stop_ids: Collection[int]) -> int:
    """Tokens of the output text: those before the first stop id."""
    return next((i for i, token in enumerate(ids) if token in stop_ids), len(ids))


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
