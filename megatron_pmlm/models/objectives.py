"""The pre-training objectives: UniLMv2's Table 6 (which losses are on and how steps are formed) and
UniLM v1's cloze LMs (which LM types are mixed, `unilm.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError
from .metrics import PMLM_METRICS, UNILM_METRICS, MetricSpec


@dataclass(frozen=True)
class Objective:
    name: str
    autoencoding: bool
    """L_AE: predict the masked tokens at their [M] slots (BERT-style)."""
    pseudo_masked: bool
    """L_PAR (or L_AR): append originals and [P] tokens and predict at the [P] slots."""
    single_token_steps: bool
    """AR: every masked token is a factorization step of its own (else blocks are steps)."""
    lm_mixture: tuple[tuple[str, float], ...] = ()
    """UniLM v1: the LM types (unilm.LM_TYPES) and the probability of each per example; empty for PMLM."""

    @property
    def is_unilm(self) -> bool:
        return bool(self.lm_mixture)

    @property
    def next_sentence_prediction(self) -> bool:
        """UniLM v1 predicts the next sentence with the bidirectional LM (SPEC §8)."""
        return any(name == "bi" for name, _ in self.lm_mixture)


def _unilm(name: str, *mixture: tuple[str, float]) -> Objective:
    return Objective(name, autoencoding=False, pseudo_masked=False, single_token_steps=False, lm_mixture=mixture)


OBJECTIVES: dict[str, Objective] = {
    "ae": Objective("ae", autoencoding=True, pseudo_masked=False, single_token_steps=False),
    "ar": Objective("ar", autoencoding=False, pseudo_masked=True, single_token_steps=True),
    "par": Objective("par", autoencoding=False, pseudo_masked=True, single_token_steps=False),
    "ae+ar": Objective("ae+ar", autoencoding=True, pseudo_masked=True, single_token_steps=True),
    "ae+par": Objective("ae+par", autoencoding=True, pseudo_masked=True, single_token_steps=False),
    # UniLM v1 §2.4: "within one training batch, 1/3 of the time we use the bidirectional LM
    # objective, 1/3 the sequence-to-sequence LM objective, and both left-to-right and right-to-left
    # LM objectives are sampled with rate of 1/6"; drawn per example.
    "unilm": _unilm("unilm", ("bi", 1 / 3), ("s2s", 1 / 3), ("l2r", 1 / 6), ("r2l", 1 / 6)),
    "unilm-bi": _unilm("unilm-bi", ("bi", 1.0)),
    "unilm-l2r": _unilm("unilm-l2r", ("l2r", 1.0)),
    "unilm-r2l": _unilm("unilm-r2l", ("r2l", 1.0)),
    "unilm-s2s": _unilm("unilm-s2s", ("s2s", 1.0)),
}
DEFAULT_OBJECTIVE = "ae+par"
PMLM_OBJECTIVES = tuple(name for name, objective in OBJECTIVES.items() if not objective.is_unilm)
UNILM_OBJECTIVES = tuple(name for name, objective in OBJECTIVES.items() if objective.is_unilm)


def get_objective(name: str) -> Objective:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ConfigError(
            f"unknown objective {name!r}; choose one of: {', '.join(OBJECTIVES)}") from None


def objective_metrics(objective: Objective) -> MetricSpec:
    """What the objective's model reports per micro batch (the trainer logs these names)."""
    return UNILM_METRICS if objective.is_unilm else PMLM_METRICS
