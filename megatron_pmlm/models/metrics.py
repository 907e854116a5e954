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

# UniLM v1 (unilm.unilm_losses): the total, the masked-LM loss over all its LMs' tokens, NSP, and
# per-LM token-weighted losses, so each LM's loss is logged on its own (train/loss_unilm_bi, ...).
UNILM_LM_TYPES = ("bi", "l2r", "r2l", "s2s")
UNILM_METRICS = MetricSpec(
    ("loss", "loss_mlm", "mlm_correct", "mlm_count", "nsp_correct", "nsp_count", "nsp_loss_sum")
    + tuple(f"{lm}_{field}" for lm in UNILM_LM_TYPES for field in ("loss_sum", "count")),
    (("mlm_acc", "mlm_correct", "mlm_count"), ("nsp_acc", "nsp_correct", "nsp_count"),
     ("loss_nsp", "nsp_loss_sum", "nsp_count"))
    + tuple((f"loss_unilm_{lm}", f"{lm}_loss_sum", f"{lm}_count") for lm in UNILM_LM_TYPES))


class MetricSums:
    """Sums of per-micro-batch losses and counts, reduced and averaged at log time.

    The sums live on the device of the metrics they add (float64, as before), so adding a micro
    batch reads nothing back to the host; `averages` reads them once, when a line is logged.
    """

    def __init__(self, spec: MetricSpec = PMLM_METRICS, device: torch.device | str | None = None) -> None:
        self.spec = spec
        self.values = torch.zeros(len(spec.names) + 1, dtype=torch.float64, device=device)  # + micro-batch count

    def add_tensor(self, metrics: torch.Tensor) -> None:
        """metrics: one micro batch's vector, in `spec.names` order (on any device: the sums follow
        it while they are still empty)."""
        if self.values.device != metrics.device:
            self._follow(metrics.device)
        self.values[:-1] += metrics.detach().double()
        self.values[-1] += 1

    def merge(self, other: "MetricSums") -> None:
        if self.values.device != other.values.device:
            self._follow(other.values.device)
        self.values += other.values

    def _follow(self, device: torch.device) -> None:
        """Sums made before the metrics' device was known (the Trainer passes it) move there once."""
        self.values = self.values.to(device)

    def averages(self) -> dict[str, float]:
        """The logged values: the sums' one read to the host."""
        values = self.values.tolist()
        v = dict(zip(self.spec.names, values))
        batches = max(1.0, values[-1])
        out = {name: v[name] / batches for name in self.spec.losses}
        for name, correct, count in self.spec.accuracies:
            out[name] = v[correct] / max(1.0, v[count])
        return out
