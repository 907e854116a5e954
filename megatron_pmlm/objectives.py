"""The pre-training objectives of UniLMv2's Table 6: which losses are on and how steps are formed."""

from __future__ import annotations

from dataclasses import dataclass

from .config import ConfigError
from .metrics import PMLM_METRICS, MetricSpec


@dataclass(frozen=True)
class Objective:
    name: str
    autoencoding: bool
    """L_AE: predict the masked tokens at their [M] slots (BERT-style)."""
    pseudo_masked: bool
    """L_PAR (or L_AR): append originals and [P] tokens and predict at the [P] slots."""
    single_token_steps: bool
    """AR: every masked token is a factorization step of its own (else blocks are steps)."""


OBJECTIVES: dict[str, Objective] = {
    "ae": Objective("ae", autoencoding=True, pseudo_masked=False, single_token_steps=False),
    "ar": Objective("ar", autoencoding=False, pseudo_masked=True, single_token_steps=True),
    "par": Objective("par", autoencoding=False, pseudo_masked=True, single_token_steps=False),
    "ae+ar": Objective("ae+ar", autoencoding=True, pseudo_masked=True, single_token_steps=True),
    "ae+par": Objective("ae+par", autoencoding=True, pseudo_masked=True, single_token_steps=False),
}
DEFAULT_OBJECTIVE = "ae+par"


def get_objective(name: str) -> Objective:
    try:
        return OBJECTIVES[name]
    except KeyError:
        raise ConfigError(
            f"unknown objective {name!r}; choose one of: {', '.join(OBJECTIVES)}") from None


def objective_metrics(objective: Objective) -> MetricSpec:
    """What the objective's model reports per micro batch (the trainer logs these names)."""
    return PMLM_METRICS
