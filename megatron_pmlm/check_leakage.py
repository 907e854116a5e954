"""Check the PMLM attention rules on a real model by perturbing tokens and watching the outputs.

    python -m megatron_pmlm.check_leakage [--preset tiny] [--objective ae+par] [--examples 8]
    python -m megatron_pmlm.check_leakage --objective unilm     (UniLM v1: every LM type, SPEC §8)

For random examples, every masked token's appended original and [P] and every context/[M] token is
checked against the two invariants of SPEC §3, in float64 with dropout off:
  no leakage      outputs at [P] of step k do not move when originals of steps >= k (or [P] of other
                  steps) change; context/[M] outputs never move when appended tokens change, and
                  equal a plain forward over the corrupted sequence alone (AE = BERT);
  not too strict  outputs at [P] of step k move when an original of an earlier step changes, and
                  every output moves when a context or [M] token changes.
UniLM v1 objectives: each token of each example is changed in turn under each LM type of the
objective, and who moved must equal SPEC §8's table exactly (left-to-right: j <= i; right-to-left:
j >= i; seq2seq: the source never reacts to the target, a target token never to a later one).
A multi-layer model is needed for implicit (multi-hop) leakage to show; every preset has >= 2 layers.
Exits 1 on any violation. `--inject-fault` breaks the mask on purpose to show the check catches it.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from .config import ATTENTION_BACKENDS, ConfigError, MaskingConfig, model_config_from_preset, positive_int
from .data.batches import build_batch
from .files import exit_quietly_on_closed_pipe, quiet_libraries
from .data.masking import mask_example
from .models.layout import (CONTEXT, MASKED, ORIGINAL, PAD, PSEUDO, ROLE_NAMES, AttentionRule, PMLMBatch,
                            pmlm_attention_allowed)
from .models.model import PMLMForPreTraining
from .models.objectives import OBJECTIVES, get_objective
from .models.unilm import TYPE_VOCAB_SIZE as UNILM_TYPE_VOCAB_SIZE

# Unmoved outputs are bit-identical up to batched-matmul reassociation (~1e-15 in float64);
# moved ones differ by far more than this.
TOLERANCE = 1e-9
NUM_SPECIAL = 5  # synthetic vocabulary: ids 0..4 are [PAD] [CLS] [SEP] [MASK] [P]
PAD_ID, CLS_ID, SEP_ID, MASK_ID, PSEUDO_ID = range(NUM_SPECIAL)


def _broken_rule(fault: str) -> AttentionRule:
    """Deliberately wrong attention rules, to show the check catches them."""

    def rule(roles: torch.Tensor, steps: torch.Tensor, key_roles=None, key_steps=None) -> torch.Tensor:
        if key_roles is not None:
            raise NotImplementedError("the injected faults are for full forward passes")
        allowed = pmlm_attention_allowed(roles, steps)
        q_role, k_role = roles[:, :, None], roles[:, None, :]
        same_step = steps[:, :, None] == steps[:, None, :]
        if fault == "explicit":  # a [P] sees its own original
            allowed = allowed | ((q_role == PSEUDO) & (k_role == ORIGINAL) & same_step)
        elif fault == "implicit":  # context sees the originals: a two-hop path to every [P]
            allowed = allowed | ((q_role == CONTEXT) & (k_role == ORIGINAL))
        elif fault == "over-restrictive":  # a [P] no longer sees originals of earlier steps
            allowed = allowed & ~((q_role == PSEUDO) & (k_role == ORIGINAL))
        elif fault == "later-originals":  # an original sees originals of later steps (a causal mask's future)
            allowed = allowed | ((q_role == ORIGINAL) & (k_role == ORIGINAL))
        return allowed

    return rule


FAULTS = ("explicit", "implicit", "over-restrictive", "later-originals")


@dataclass
class LeakageReport:
    checks: Counter = field(default_factory=Counter)
    violations: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)
    ae_max_difference: float | None = 0.0
    """None where there is no AE view to compare (fine-tuning modes)."""

    def record(self, category: str, ok: np.ndarray, detail: str) -> None:
        self.checks[category] += int(ok.size)
        bad = int((~ok).sum())
        if bad:
            self.violations[category] += bad
            if len(self.examples) < 10:
                self.examples.append(f"{category}: {bad} position(s) - {detail}")

    @property
    def passed(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        lines = [f"{'check':<48}{'positions':>10}{'violations':>12}"]
        for category in sorted(self.checks):
            lines.append(f"{category:<48}{self.checks[category]:>10}{self.violations[category]:>12}")
        if self.ae_max_difference is not None:
            lines.append(f"AE outputs vs a plain forward over the corrupted sequence: max |diff| "
                         f"{self.ae_max_difference:.2e}")
        lines.extend("  " + e for e in self.examples)
        lines.append("PASS: no leakage, masks not over-restrictive" if self.passed else
                     f"FAIL: {sum(self.violations.values())} violation(s)")
        return "\n".join(lines)


def random_example(rng: np.random.Generator, seq_length: int, vocab_size: int):
    """[CLS] S1 [SEP] S2 [SEP] of random ordinary tokens and random segment lengths."""
    length = int(rng.integers(max(8, seq_length // 2), seq_length + 1))
    ids = rng.integers(NUM_SPECIAL, vocab_size, length)
    first_sep = int(rng.integers(2, length - 2))
    ids[0], ids[first_sep], ids[-1] = CLS_ID, SEP_ID, SEP_ID
    segments = np.zeros(length, dtype=np.int64)
    segments[first_sep + 1:] = 1
    return ids, segments


def _hidden(model: PMLMForPreTraining, batch: PMLMBatch) -> torch.Tensor:
    return model.bert(batch.input_ids, batch.position_ids, batch.token_type_ids, batch.roles, batch.steps)


def _replace_ids(base: PMLMBatch, rows_columns: list[np.ndarray], rng: np.random.Generator,
                 vocab_size: int) -> PMLMBatch:
    """A batch of copies of one example; copy r has the tokens at columns rows_columns[r] replaced."""
    count = len(rows_columns)
    expanded = {name: getattr(base, name).expand(count, -1).clone() for name in
                ("input_ids", "position_ids", "token_type_ids", "roles", "steps", "labels")}
    ids = expanded["input_ids"]
    for row, columns in enumerate(rows_columns):  # a row per perturbation, columns vectorized
        current = ids[row, columns]
        shift = torch.from_numpy(rng.integers(1, vocab_size - NUM_SPECIAL, len(columns)))
        ids[row, columns] = NUM_SPECIAL + (current - NUM_SPECIAL + shift) % (vocab_size - NUM_SPECIAL)
    return PMLMBatch(**expanded)


@torch.no_grad()
def check_example(model: PMLMForPreTraining, ids: np.ndarray, segments: np.ndarray, masks,
                  rng: np.random.Generator, vocab_size: int, report: LeakageReport) -> None:
    objective = model.objective
    batch = build_batch([ids], [segments], [masks], PSEUDO_ID, PAD_ID,
                        append_pseudo=objective.pseudo_masked)
    roles, steps = batch.roles[0].numpy(), batch.steps[0].numpy()
    base = _hidden(model, batch)[0]
    seq_len = len(ids)

    # AE view equals BERT over the corrupted sequence alone.
    plain = build_batch([ids], [segments], [masks], PSEUDO_ID, PAD_ID, append_pseudo=False)
    plain_hidden = _hidden(model, plain)[0]
    difference = float((plain_hidden - base[:seq_len]).abs().max())
    report.ae_max_difference = max(report.ae_max_difference, difference)
    report.record("AE outputs equal plain forward", np.array([difference <= TOLERANCE]),
                  f"max |diff| {difference:.2e}")

    perturbations, descriptions = [], []
    num_steps = masks.num_steps if objective.pseudo_masked else 0
    for step in range(1, num_steps + 1):
        perturbations.append(np.flatnonzero((roles == ORIGINAL) & (steps == step)))
        descriptions.append(("original", step))
        perturbations.append(np.flatnonzero((roles == PSEUDO) & (steps == step)))
        descriptions.append(("[P]", step))
    context_positions = np.flatnonzero(roles == CONTEXT)
    masked_positions = np.flatnonzero(roles == MASKED)
    perturbations.append(rng.choice(context_positions, 1))
    descriptions.append(("context", 0))
    if len(masked_positions):
        perturbations.append(rng.choice(masked_positions, 1))
        descriptions.append(("[M]", 0))

    perturbed = _hidden(model, _replace_ids(batch, perturbations, rng, vocab_size))
    moved = ((perturbed - base[None]).abs().amax(dim=-1) > TOLERANCE).numpy()  # [perturbations, T]

    visible_context = (roles == CONTEXT) | (roles == MASKED)
    for row, ((kind, step), columns) in enumerate(zip(descriptions, perturbations)):
        row_moved = moved[row]
        if kind == "original":
            report.record("context/[M] ignore originals", ~row_moved[visible_context],
                          f"changing the original of step {step} moved context/[M] outputs")
            later = (roles == PSEUDO) & (steps <= step)
            report.record("[P] of step k ignore originals of steps >= k", ~row_moved[later],
                          f"changing the original of step {step} moved [P] of a step <= {step}")
            earlier = (roles == PSEUDO) & (steps > step)
            report.record("[P] of step k see originals of steps < k", row_moved[earlier],
                          f"changing the original of step {step} did not move [P] of a later step")
        elif kind == "[P]":
            others = (roles != PAD) & ~((roles == PSEUDO) & (steps == step))
            report.record("only [P] of the same step see a [P]", ~row_moved[others],
                          f"changing [P] of step {step} moved outputs outside that step's [P]")
        else:
            non_pad = roles != PAD
            report.record("every token sees context and [M]", row_moved[non_pad],
                          f"changing a {kind} token at column {int(columns[0])} left some outputs unchanged "
                          f"(roles {sorted({ROLE_NAMES[r] for r in roles[non_pad & ~row_moved]})})")


def run_check(preset: str = "tiny", objective: str = "ae+par", examples: int = 8,
              seq_length: int | None = None, seed: int = 0, rel_pos: bool = True,
              fault: str | None = None, vocab_size: int = 1000, attention_backend: str = "sdpa") -> LeakageReport:
    obj = get_objective(objective)
    if examples < 1:  # no example checked would read as "no leakage"
        raise ConfigError(f"--examples must be at least 1, got {examples}")
    if fault is not None and fault not in FAULTS:
        raise ConfigError(f"unknown fault {fault!r}; choose one of: {', '.join(FAULTS)}")
    config = model_config_from_preset(preset, vocab_size=vocab_size, hidden_dropout=0.0,
                                      attention_dropout=0.0, rel_pos=rel_pos,
                                      type_vocab_size=UNILM_TYPE_VOCAB_SIZE if obj.is_unilm else None,
                                      attention_backend=attention_backend)
    seq_length = seq_length or min(64, config.max_position_embeddings)
    if seq_length > config.max_position_embeddings:
        raise ConfigError(f"--seq-length {seq_length} exceeds the model's maximum "
                          f"{config.max_position_embeddings}")
    if seq_length < 8:
        raise ConfigError(f"--seq-length must be at least 8, got {seq_length}")
    torch.manual_seed(seed)
    rule = _broken_rule(fault) if fault else pmlm_attention_allowed
    model = PMLMForPreTraining(config, obj, attention_rule=rule).double().eval()
    rng = np.random.default_rng(seed)
    special = np.arange(NUM_SPECIAL)
    report = LeakageReport(ae_max_difference=None if obj.is_unilm else 0.0)
    if obj.is_unilm:
        for index in range(examples):
            ids, segments = random_example(rng, seq_length, vocab_size)
            check_unilm_example(model, ids, segments, seed * 1_000_003 + index, rng, vocab_size, report)
        return report
    for _ in range(examples):
        ids, segments = random_example(rng, seq_length, vocab_size)
        masks = mask_example(ids, ids >= NUM_SPECIAL, rng, MaskingConfig(), vocab_size, special,
                             MASK_ID, single_token_steps=obj.single_token_steps)
        check_example(model, ids, segments, masks, rng, vocab_size, report)
    return report


@torch.no_grad()
def check_unilm_example(model: PMLMForPreTraining, ids: np.ndarray, segments: np.ndarray, example_key: int,
                        rng: np.random.Generator, vocab_size: int, report: LeakageReport) -> None:
    """Every LM type of the objective on one example: change each token in turn and compare who
    moved with SPEC §8's table (unilm.expected_visibility, written without roles or steps). Exact
    both ways: no output reacts to a token it may not see, every output reacts to every token it may."""
    from .tokenizer import SpecialTokenIds
    from .config import UniLMMaskingConfig
    from .data.unilm_batches import build_unilm_batch, expected_visibility
    from .models.unilm import LM_TYPES

    special = SpecialTokenIds(pad=PAD_ID, unk=PAD_ID, cls=CLS_ID, sep=SEP_ID, mask=MASK_ID, pseudo=PSEUDO_ID)
    length = len(ids)
    second = segments[None, :] == 1
    first_target = int(np.argmax(segments == 1))
    for lm_name, _ in model.objective.lm_mixture:
        lm_type = LM_TYPES.index(lm_name)
        batch = build_unilm_batch(ids[None, :], np.array([length]), second, np.array([lm_type]), np.array([-1]),
                                  np.array([example_key], dtype=np.uint64), special, vocab_size, UniLMMaskingConfig())
        base = _hidden(model, batch)[0]
        perturbed = _hidden(model, _replace_ids(batch, [np.array([column]) for column in range(length)], rng,
                                                vocab_size))
        moved = ((perturbed - base[None]).abs().amax(dim=-1) > TOLERANCE).numpy()  # [changed key j, output i]
        allowed = expected_visibility(lm_type, length, first_target).T  # [key j, query i]
        report.record(f"{lm_name}: no output reacts to a token it may not see", ~moved[~allowed],
                      f"{lm_name} LM: changing a token moved an output that may not see it "
                      f"(first (key, query): {tuple(int(v) for v in np.argwhere(moved & ~allowed)[:1].ravel())})")
        report.record(f"{lm_name}: every output reacts to what it sees", moved[allowed],
                      f"{lm_name} LM: changing a token left an output that sees it unchanged")


@torch.no_grad()
def run_seq2seq_check(preset: str = "tiny", mode: str = "pseudo-masked", examples: int = 8,
                      seq_length: int | None = None, seed: int = 0, rel_pos: bool = True,
                      vocab_size: int = 1000, attention_backend: str = "sdpa") -> LeakageReport:
    """Perturbation check of a fine-tuning mode's batches (SPEC §7.1): the source never reacts to
    the target; a target token reacts to the source and to targets up to itself, never to a later
    one; a [P] reacts to the source, earlier targets and itself only. Exact (float64)."""
    from .models.seq2seq import Seq2SeqConfig, SpecialIds, build_examples, build_seq2seq_batch, example_rng

    config = model_config_from_preset(preset, vocab_size=vocab_size, hidden_dropout=0.0,
                                      attention_dropout=0.0, rel_pos=rel_pos, attention_backend=attention_backend)
    seq_length = seq_length or min(64, config.max_position_embeddings)
    if not 8 <= seq_length <= config.max_position_embeddings:
        raise ConfigError(f"--seq-length must be in [8, {config.max_position_embeddings}], got {seq_length}")
    s2s = Seq2SeqConfig(mode=mode, max_source_length=seq_length // 2, max_target_length=seq_length // 2)
    special = SpecialIds(cls=CLS_ID, sep=SEP_ID, mask=MASK_ID, pad=PAD_ID)
    torch.manual_seed(seed)
    model = PMLMForPreTraining(config).double().eval()
    rng = np.random.default_rng(seed)
    report = LeakageReport(ae_max_difference=None)
    for index in range(examples):
        source = rng.integers(NUM_SPECIAL, vocab_size, int(rng.integers(2, seq_length // 2)))
        target = rng.integers(NUM_SPECIAL, vocab_size, int(rng.integers(2, seq_length // 2)))
        built = build_examples([source], [target], s2s, special)
        batch = build_seq2seq_batch(built.source_ids, built.target_ids, [example_rng(seed, index)], s2s, special,
                                    vocab_size)
        roles, steps = batch.roles[0].numpy(), batch.steps[0].numpy()
        base = _hidden(model, batch)[0]
        targets = np.flatnonzero(roles == ORIGINAL)
        pseudos = np.flatnonzero(roles == PSEUDO)
        perturbations = ([np.array([c]) for c in targets] + [np.array([c]) for c in pseudos]
                         + [rng.choice(np.flatnonzero(roles == CONTEXT), 1)])
        moved = ((_hidden(model, _replace_ids(batch, perturbations, rng, vocab_size)) - base[None]).abs()
                 .amax(dim=-1) > TOLERANCE).numpy()
        source_slots, real = roles == CONTEXT, roles != PAD
        for row, columns in enumerate(perturbations):
            column = int(columns[0])
            row_moved, role, step = moved[row], roles[column], steps[column]
            if role == ORIGINAL:
                report.record("source ignores the target", ~row_moved[source_slots],
                              f"changing target step {step} moved source outputs")
                earlier = (roles == ORIGINAL) & (steps < step) | (roles == PSEUDO) & (steps <= step)
                report.record("no output reacts to a later target token", ~row_moved[earlier],
                              f"changing target step {step} moved an output of an earlier or equal step")
                later = (roles == ORIGINAL) & (steps >= step) | (roles == PSEUDO) & (steps > step)
                report.record("targets and [P] see earlier targets", row_moved[later],
                              f"changing target step {step} left a later target or [P] unchanged")
            elif role == PSEUDO:
                report.record("nothing but itself sees a [P]", ~row_moved[real & (np.arange(len(roles)) != column)],
                              f"changing the [P] of step {step} moved other outputs")
            else:
                report.record("every token sees the source", row_moved[real],
                              f"changing source column {column} left some outputs unchanged")
    return report


def main(argv=None) -> int:
    quiet_libraries()
    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.check_leakage",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--objective", default="ae+par", help=f"one of {', '.join(OBJECTIVES)}")
    parser.add_argument("--mode", default=None, choices=["pseudo-masked", "masked", "causal"],
                        help="check a sequence-to-sequence fine-tuning mode's masks instead of a pre-training objective")
    parser.add_argument("--examples", type=positive_int, default=8, help="random examples to check")
    parser.add_argument("--seq-length", type=int, default=None, help="default: min(64, model maximum)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-rel-pos", action="store_true")
    parser.add_argument("--attention-backend", default="sdpa", choices=ATTENTION_BACKENDS,
                        help="check the masks as this backend computes them")
    parser.add_argument("--inject-fault", choices=FAULTS, default=None,
                        help="break the attention mask on purpose; the check must then fail")
    args = parser.parse_args(argv)
    if args.mode and args.inject_fault:
        print("error: --inject-fault applies to pre-training objectives, not to --mode", file=sys.stderr)
        return 2
    try:
        if args.mode:
            report = run_seq2seq_check(args.preset, args.mode, args.examples, args.seq_length, args.seed,
                                       not args.no_rel_pos, attention_backend=args.attention_backend)
        else:
            report = run_check(args.preset, args.objective, args.examples, args.seq_length, args.seed,
                               not args.no_rel_pos, args.inject_fault, attention_backend=args.attention_backend)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"leakage check: preset {args.preset}, "
          + (f"fine-tuning mode {args.mode}" if args.mode else f"objective {args.objective}")
          + f", {args.examples} examples, attention backend {args.attention_backend}"
          + (f", injected fault: {args.inject_fault}" if args.inject_fault else ""))
    print(report.summary())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(exit_quietly_on_closed_pipe(main))
