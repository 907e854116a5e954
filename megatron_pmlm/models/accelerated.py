"""Fused kernels chosen automatically on a GPU; on the CPU everything stays torch's default.

The choice changes speed only: apex's FusedLayerNorm has LayerNorm's parameters (`weight`, `bias`, so
checkpoints are unchanged) and falls back to `F.layer_norm` for CPU tensors.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
from torch import nn


def training_device_type() -> str:
    """The device type training runs on: cuda when a GPU is present and DS_ACCELERATOR (DeepSpeed's
    accelerator choice, which the entry points set to cuda on a GPU machine) names no other; else cpu."""
    if torch.cuda.is_available() and os.environ.get("DS_ACCELERATOR", "cuda") == "cuda":
        return "cuda"
    return "cpu"


def fused_layer_norm_class() -> type[nn.Module] | None:
    """apex's FusedLayerNorm when apex (NVIDIA's, built from source with CUDA) imports and a GPU is
    present; None otherwise."""
    if not torch.cuda.is_available():
        return None
    try:
        from apex.normalization import FusedLayerNorm
    except ImportError:
        return None
    return FusedLayerNorm


def layer_norm(hidden_size: int, eps: float) -> nn.Module:
    """A LayerNorm over the last dimension: apex's fused one where available, else torch's."""
    fused = fused_layer_norm_class()
    return fused(hidden_size, eps=eps) if fused is not None else nn.LayerNorm(hidden_size, eps=eps)


def value_from_environment(name: str, choices: tuple[str, ...]) -> tuple[str, str | None]:
    """(the environment variable `name`'s value among `choices`, the first being the default; what is
    wrong with its value or None: a malformed value keeps the default, and the model refuses to start
    with it)."""
    value = os.environ.get(name, choices[0])
    if value not in choices:
        others = " or ".join(choices[1:]) if len(choices) > 2 else choices[1]
        return choices[0], f"{name}={value!r}: give {choices[0]} (the default) or {others}"
    return value, None


def alternative_from_environment(name: str, default: str, alternative: str) -> tuple[bool, str | None]:
    """(whether the environment variable `name` picks `alternative` over `default`, what is wrong with
    its value or None: a malformed value keeps the default, and the model refuses to start with it)."""
    value, problem = value_from_environment(name, (default, alternative))
    return value == alternative, problem


def announce(line: str, rank: int = 0) -> None:
    """`line` on standard error, on rank `rank` only (-1: the last rank): what the model does once
    that a user waits for (a compilation, a launch tuned)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == rank % dist.get_world_size():
        print(line, file=sys.stderr, flush=True)


def warn_kernel_failed(kernel: str, fallback: str, switch: str, error: Exception) -> None:
    """The one warning after one of our Triton kernels failed to compile or launch on this machine:
    which kernel, the error's first line, what runs instead from now on, and the setting that skips it."""
    first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
    warnings.warn(f"megatron-pmlm: {kernel}'s Triton kernel failed here ({type(error).__name__}: {first_line}); "
                  f"{fallback} from now on (set {switch} to skip the kernel)", RuntimeWarning, stacklevel=4)
