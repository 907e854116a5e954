"""Count the kernels one training step runs, eager or compiled, with one ruler (the profiler).

A BERT layer in eager PyTorch is one kernel per op (SPEC §14); `--compile` fuses them. On a GPU
the count is exact: the CUDA kernels the profiler saw launched. On the CPU it is the proxy the
issue asks for: the ATen ops that compute (top-level ones: called from Python, autograd or a
compiled graph, not from inside another ATen op; views, aliases and bare allocations excluded,
since they launch nothing) plus the kernels inductor generated (`cpp_fused_*`), which the profiler
sees when `profile_compiled_kernels()` was called before compiling. A TorchDispatchMode cannot
serve here: while one is active, dynamo runs compiled functions eagerly.

    profile_compiled_kernels()      # before the first compiled call
    kernels = count_kernels(step)   # step(): forward + backward (+ optimizer), once
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

ALLOCATIONS = frozenset({"aten::empty", "aten::empty_strided", "aten::empty_like", "aten::new_empty",
                         "aten::new_empty_strided", "aten::resize_"})
"""Ops that only reserve memory: no kernel."""
GENERATED_KERNEL_MARKERS = ("cpp_fused", "cpp_kernel", "triton_")
"""Substrings of the names inductor gives its generated kernels in profiler records."""
COMPILED_GRAPH_MARKER = "## Call CompiledFxGraph"


def profile_compiled_kernels() -> None:
    """Make inductor's C++ kernels visible to the profiler (a record per kernel call). Takes
    effect for graphs compiled afterwards (it is part of inductor's cache key)."""
    from torch._inductor import config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True


@functools.lru_cache(maxsize=None)
def is_view_or_alias(name: str) -> bool:
    """Whether the ATen op `aten::NAME` returns an alias of an input (a view: no kernel)."""
    packet = getattr(torch.ops.aten, name.removeprefix("aten::"), None)
    if packet is None:
        return False
    for overload in packet.overloads():
        returns = getattr(packet, overload)._schema.returns
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return True
    return False


def _is_cpu_kernel(event) -> bool:
    name = event.name
    if any(marker in name for marker in GENERATED_KERNEL_MARKERS):
        return True
    if not name.startswith("aten::") or name in ALLOCATIONS or is_view_or_alias(name):
        return False
    parent = event.cpu_parent
    while parent is not None:  # called from inside a computing ATen op: part of that op's kernel
        if parent.name.startswith("aten::") and not is_view_or_alias(parent.name):
            return False  # (inside a view-returning op such as contiguous or reshape it is the work)
        parent = parent.cpu_parent
    return True


def count_kernels(step_fn: Callable[[], object]) -> int:
    """Kernels `step_fn()` runs, called once under the profiler: CUDA kernels on a GPU, else the
    CPU proxy of the module docstring. Raises if a compiled graph ran whose kernels the profiler
    cannot see (compiled before `profile_compiled_kernels()`)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as profiler:
        step_fn()
        if cuda:
            torch.cuda.synchronize()
    events = profiler.events()
    if cuda:
        return sum(1 for event in events if event.device_type == torch.autograd.DeviceType.CUDA)
    from torch._inductor import config as inductor_config

    graph_calls = sum(1 for event in events if event.name.startswith(COMPILED_GRAPH_MARKER))
    generated = sum(1 for event in events if any(marker in event.name for marker in GENERATED_KERNEL_MARKERS))
    if graph_calls and not generated and not inductor_config.cpp.enable_kernel_profile:
        raise RuntimeError("compiled graphs ran but their kernels are invisible to the profiler: call "
                           "kernel_count.profile_compiled_kernels() before compiling")
    return sum(1 for event in events if _is_cpu_kernel(event))
