"""The global gradient norm where DeepSpeed's ZeRO-1/2 optimizer is told not to compute it.

Before each step DeepSpeed's ZeRO-1/2 optimizer casts every gradient tensor to float64 and takes its
norm: two kernel launches per tensor (406 a step at base) and a Python loop over them, for a number
that, in bf16 with DeepSpeed's scan off and no clipping, only the log line and the non-finite watch
(training/nonfinite.py) read. `training_config.build_deepspeed_config` turns it off there (`"zero_optimization":
{"compute_grad_norm": false}`), and `PartitionGradientNorm` measures the same norm from what
DeepSpeed then hands the AdamW it wraps: one parameter group per `step()` call, each group's
gradients as this rank's flat float32 partition of the averaged gradients (the loss scale already
divided out). One sum of squares per group, summed over the data-parallel group: the norm of the
whole model's gradient, as DeepSpeed reports it (inf when a gradient is not finite), left on the
device, so the step waits for nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.distributed import collective_device


class PartitionGradientNorm:
    """Records the global gradient norm from a step pre-hook on the optimizer DeepSpeed's ZeRO-1/2
    optimizer steps; `norm` is the last step's (a float32 scalar on the device; None before one).

    `group`: the process group the partitions are spread over (the data-parallel group). Under
    tensor or pipeline parallelism a flat partition cannot tell a replicated parameter from a split
    one; `build_deepspeed_config` keeps DeepSpeed's norm there."""

    def __init__(self, optimizer: torch.optim.Optimizer, group=None) -> None:
        self.group_count = len(optimizer.param_groups)
        """Groups per step. DeepSpeed steps them one call each (the groups swapped for a one-group
        list); a checkpoint load replaces the group dicts, so they are counted, not recognised."""
        self.group = group
        self.norm: torch.Tensor | None = None
        self._groups_seen = 0
        self._squares: list[torch.Tensor] = []
        optimizer.register_step_pre_hook(self._before_step)

    def _before_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        for group in optimizer.param_groups:
            # A sum of squares, not `vector_norm`: the CPU's float32 norm kernel accumulates in one
            # running sum (0.9% low over 85 M elements); `sum` adds pairwise, as CUDA does.
            self._squares += [param.grad.detach().float().pow(2).sum() for param in group["params"]
                              if param.grad is not None]
        self._groups_seen += len(optimizer.param_groups)
        if self._groups_seen >= self.group_count:
            self.norm = self._global_norm(self._squares)
            self._groups_seen, self._squares = 0, []

    def _global_norm(self, squares: list[torch.Tensor]) -> torch.Tensor:
        norm = norm_from_squares(torch.stack(squares).sum(), self.group)
        return torch.where(torch.isfinite(norm), norm, torch.full_like(norm, float("inf")))


def norm_from_squares(squares: torch.Tensor, group=None) -> torch.Tensor:
    """The norm of gradients whose squares summed on this rank are `squares`, summed over the ranks of
    `group` first (None, or a group of one: this rank's alone); on the device the collective runs on
    when there is one, without a host read."""
    if group is not None and dist.get_world_size(group) > 1:
        squares = squares.to(collective_device())
        dist.all_reduce(squares, group=group)
    return squares.sqrt()
