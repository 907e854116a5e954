"""What a model's `metrics()` vector holds and how the trainer sums and averages it.

Each model family (PMLM pre-training, seq2seq fine-tuning) names its losses and
accuracy counters in a `MetricSpec`; the one trainer logs whatever the spec names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MetricSpec:
    """What a model's `metrics()` vector holds: losses (averaged over micro-batches) and
    (correct, count) pairs (summed, then divided: accuracy over tokens)."""

    names: tuple[str, ...]
    accuracies: tuple[tuple[str, str, str], ...]
    """Ratios of sums: (reported name, numerator field, denominator field). Accuracies over tokens,
    or a loss that only some micro batches have (its sum over them / their number)."""

    @property
    def losses(self) -> tuple[str, ...]:
        return tuple(n for n in self.names if n.startswith("loss"))


PMLM_METRICS = MetricSpec(("loss", "loss_ae", "loss_par", "ae_correct", "ae_count", "par_correct", "par_count"),
                          (("mlm_acc", "ae_correct", "ae_count"), ("par_acc", "par_correct", "par_count")))


class MetricSums:
    """Sums of per-micro-batch losses and counts, reduced and averaged at log time."""

    def __init__(self, spec: MetricSpec = PMLM_METRICS) -> None:
        self.spec = spec
        self.values = torch.zeros(len(spec.names) + 1, dtype=torch.float64)  # + micro-batch count

    def add_tensor(self, metrics: torch.Tensor) -> None:
        """metrics: one micro batch's vector, in `spec.names` order."""
        self.values[:-1] += metrics.detach().double().cpu()
        self.values[-1] += 1

    def merge(self, other: "MetricSums") -> None:
        self.values += other.values

    def averages(self) -> dict[str, float]:
        v = dict(zip(self.spec.names, self.values.tolist()))
        batches = max(1.0, float(self.values[-1]))
        out = {name: v[name] / batches for name in self.spec.losses}
        for name, correct, count in self.spec.accuracies:
            out[name] = v[correct] / max(1.0, v[count])
        return out
