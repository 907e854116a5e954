"""Non-finite gradients under bf16 without a per-step scan or a host sync.

Under bf16 with ZeRO-1/2, DeepSpeed's own check (skip a step whose gradients hold NaN/inf) scans
every gradient tensor before every step: 13 kernel launches per tensor and two waits for the device
(`training_config.build_deepspeed_config` turns it off; a user's DeepSpeed file can turn it back on).
bf16 has float32's range, so no loss scale overflows: a non-finite gradient means the run diverged
or met a bad batch. `GradientNormWatch` reads the global gradient norm the step measures anyway
(`Trainer.global_grad_norm`: DeepSpeed's, or training/gradient_norm.py's on the flat partitions; a
device tensor, inf when any gradient is not finite), counts such steps on the device, and
`check` (at each log line and before each checkpoint, where the loop reads the device anyway)
stops the run naming the first one: no checkpoint is ever written from damaged weights, and the
last one saved is the place to resume from. Megatron-LM stops the same way
(`--check-for-nan-in-loss-and-grad`), reading the norm every step.
"""

from __future__ import annotations

import torch


class NonFiniteGradients(RuntimeError):
    """A step's global gradient norm was NaN or infinite (bf16, DeepSpeed's per-step check off)."""


class GradientNormWatch:
    """Counts steps whose global gradient norm is not finite, on the device, and the first one."""

    def __init__(self, device: torch.device) -> None:
        self.steps = torch.zeros((), dtype=torch.long, device=device)
        self.first_iteration = torch.zeros((), dtype=torch.long, device=device)

    def record(self, grad_norm, iteration: int) -> None:
        """After the optimizer step of `iteration` (1-based): no host sync (the ZeRO-1/2 norms are
        device tensors; a number, if one comes, is copied over)."""
        if grad_norm is None:
            return
        grad_norm = torch.as_tensor(grad_norm, device=self.steps.device).detach()
        bad = ~torch.isfinite(grad_norm)
        self.first_iteration = torch.where(bad & (self.steps == 0), iteration, self.first_iteration)
        self.steps = self.steps + bad

    def check(self, iteration: int, when: str) -> None:
        """Raise NonFiniteGradients if a step up to `iteration` had a non-finite norm (reads the
        device: call it where the loop reads it anyway)."""
        steps, first = torch.stack([self.steps, self.first_iteration]).tolist()
        if not steps:
            return
        raise NonFiniteGradients(
            f"the global gradient norm was not finite (NaN or inf) at iteration {first} ({steps} iteration(s) "
            f"in all up to {iteration}): the weights are damaged since iteration {first}, so {when} stops "
            "the run (no checkpoint was saved after it). Resume from the last checkpoint with --load, e.g. with a "
            "lower --lr; or set \"bf16\": {\"check_grad_overflow\": true} in --deepspeed-config to have DeepSpeed "
            "skip such steps (a scan of every gradient before each step)")
