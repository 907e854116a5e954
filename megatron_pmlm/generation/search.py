"""The search every decoder shares (SPEC §7.2), over any `StepScorer` (a model's next-word scores,
one step at a time): greedy and beam search as s2s-ft runs them, n-gram blocking, the length
penalty and the final choice of hypotheses, the decoding settings, and decoding in batches.
The scorers and decoders are generation/decoding.py's: a PMLM in s2s-ft's layout, and PALM's
decoder."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Callable, Collection, Protocol, Sequence

import torch

from ..config import ConfigError


BANNED_SCORE = -10000.0
"""s2s-ft's penalty for a banned word, a forced-short [SEP] and every step after a [SEP]: a large
finite number rather than -inf, so a finished hypothesis keeps competing (and losing) in the beam."""


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


class StepScorer(Protocol):
    """What the searches ask of a model at each step (one row per hypothesis)."""

    def scores(self, step: int, previous: torch.Tensor | None) -> torch.Tensor:
        """[rows, V] scores of the next word (greedy takes their argmax); `previous` [rows]: the
        words chosen at step - 1 (None at step 0)."""

    def log_probs(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores as log-probabilities (beam search sums them)."""

    def reorder(self, index: torch.Tensor) -> None:
        """Rows become rows `index` (beam replication at step 0, back-pointers later)."""


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


# The UniLM toolkit's sentence separator in summaries, as a WordPiece tokenizer without an [X_SEP]
# token splits it when the fine-tuning targets spell it out ("sentence one . [X_SEP] sentence two .").
_SPLIT_X_SEP = re.compile(r"(?<!\S)\[ x _ sep \](?!\S)", re.IGNORECASE)


def detokenize(tokens: Sequence[str], stop_tokens: Collection[str] = ("[SEP]", "[PAD]")) -> str:
    """B.7: the tokens before the first [SEP] or [PAD]; a '##' piece joins the word before it;
    words are separated by single spaces (punctuation stays a word of its own).

    Summaries' sentence separator, as the UniLM toolkit writes it: a newline token (RoBERTa-style
    vocabularies) becomes " [X_SEP] " (s2s-ft's decode_seq2seq.py); an [X_SEP] token stays "[X_SEP]"
    (UniLM v1's vocabulary maps [unused1] to it); the separator spelt out in the targets and split
    by the tokenizer ("[ x _ sep ]") is joined back into "[X_SEP]". The toolkit's CNN/DM evaluation
    (and `eval_s2s --benchmark cnndm`) splits the summary into sentences there."""
    words: list[str] = []
    for token in tokens:
        if token in stop_tokens:
            break
        if token.startswith("##") and words:
            words[-1] += token[2:]
        else:
            words.append(token)
    return _SPLIT_X_SEP.sub("[X_SEP]", " [X_SEP] ".join(" ".join(words).split("\n")))


def generated_length(ids: Sequence[int], stop_ids: Collection[int]) -> int:
    """Tokens of the output text: those before the first stop id."""
    return next((i for i, token in enumerate(ids) if token in stop_ids), len(ids))
