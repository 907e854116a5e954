"""A CPU proxy for a step's GPU cost: how many kernels it launches (SPEC §14: eager launches one
kernel per op). It runs on any machine, so a change that cuts launches shows on the CPU before a GPU
is lent (the attention bias's bytes: `models.relative_bias.bias_bytes_per_step`).

Eager, `count_kernels(step, compiled=False)` counts the ATen ops a `TorchDispatchMode` sees while
`step()` runs, less the ones that launch nothing: view and alias ops (`OpOverload.is_view`:
`view`, `t`, `expand`, `detach`, `split`, ...; and the `inplace_view` ones such as `as_strided_`)
and bare allocations (`empty`, `empty_strided`, `empty_like`). A dispatch mode switches
torch.compile off, so compiled code is counted from a `torch.profiler` trace of one step instead:
the kernels inductor generated (C++ `cpp_fused_*` on the CPU, `triton_*` on CUDA), the extern calls
its graphs make (the ATen ops directly under a `## Call CompiledFxGraph` event: GEMMs, attention),
and the outermost ATen ops run outside compiled graphs (same view/allocation exclusions).
`prepare_compiled_counting()` must run before the first compilation: it makes inductor's C++
kernels visible to the profiler (`cpp.enable_kernel_profile`, one record-function per call).
"""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Callable, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

ALLOCATION_ONLY_OPS = frozenset({aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default})
"""Ops that reserve memory and run no kernel."""
GENERATED_KERNEL_PREFIXES = ("cpp_fused", "triton_")
"""Profiler names of inductor's generated kernels (CPU graphs prefix them with `graph_N_`)."""
COMPILED_GRAPH_EVENT = "## Call CompiledFxGraph"


def launches_kernel(func) -> bool:
    """Whether an ATen op does device work: not a view/alias, not a metadata-only in-place op,
    not a bare allocation."""
    return not (func.is_view or torch.Tag.inplace_view in func.tags or func in ALLOCATION_ONLY_OPS)


class _KernelCounter(TorchDispatchMode):
    supports_higher_order_operators = True
    """A higher-order operator (flex_attention) is one fused kernel on a GPU: counted once."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator) or launches_kernel(func):
            self.kernels += 1
        return func(*args, **(kwargs or {}))


GEMM_OPS = frozenset({torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.linear.default})


class GemmCounter(TorchDispatchMode):
    """Counts the matrix products (addmm, mm, linear) dispatched while active, the backward's too."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in GEMM_OPS
        return func(*args, **(kwargs or {}))


def prepare_compiled_counting() -> None:
    """Call before torch.compile compiles anything whose kernels `count_kernels(..., compiled=True)`
    is to see on the CPU."""
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True


def count_kernels(step_fn: Callable[[], object], compiled: bool) -> int:
    """Kernels one call of `step_fn` launches (see the module docstring for what counts)."""
    if not compiled:
        # Compiled regions run eagerly inside and compiled after (see host_syncs.HostSyncCounter).
        with torch.compiler.set_stance("force_eager"), _KernelCounter() as counter:
            step_fn()
        return counter.kernels
    return sum(kernel_sources(step_fn).values())


def kernel_sources(step_fn: Callable[[], object]) -> Counter:
    """One call of `step_fn` under torch.profiler, its kernels by source (`profiled_kernel_sources`),
    compiled or eager."""
    from torch.profiler import profile

    with profile() as trace:
        step_fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    return profiled_kernel_sources(trace.events())


def _aten_launches_kernel(name: str) -> bool:
    """The profiler's "aten::op" name judged like `launches_kernel` (by the op's default overload,
    or any overload when it has none)."""
    packet = getattr(aten, name.removeprefix("aten::"), None)
    if packet is None:
        return True
    overloads = [getattr(packet, overload) for overload in packet.overloads()]
    return not overloads or all(launches_kernel(op) for op in overloads)


def profiled_kernel_sources(events: Sequence) -> Counter:
    """The kernels of one profiled step (generated kernels + extern calls of compiled graphs +
    outermost kernel-launching ATen ops outside them) by where they come from, "<phase>: <what>": the phase is
    optimizer (inside `Optimizer.step`/`zero_grad`), backward (inside an autograd node, named after
    it: which forward op's backward it is) or forward; what is the ATen op, or "generated" / "extern
    <op>" for a compiled graph's own kernels. Works for eager steps too (their outermost ATen ops)."""
    sources: Counter = Counter()
    for event, in_graph in _profiled_kernels(events):
        phase, parent = "forward", event.cpu_parent
        while parent is not None:
            if parent.name.startswith("Optimizer."):
                phase = "optimizer"
                break
            if parent.name.startswith("autograd::engine::evaluate_function: ") and phase == "forward":
                phase = "backward " + parent.name.split(": ", 1)[1]
            parent = parent.cpu_parent
        what = ("generated" if any(prefix in event.name for prefix in GENERATED_KERNEL_PREFIXES)
                else f"extern {event.name}" if in_graph else event.name)
        sources[f"{phase}: {what}"] += 1
    return sources


def _profiled_kernels(events: Sequence):
    """(event, inside a compiled graph) for every kernel of `torch.profiler`'s CPU events of one step."""
    for event in events:
        if getattr(event, "device_type", torch.autograd.DeviceType.CPU) != torch.autograd.DeviceType.CPU:
            continue  # a CUDA kernel's own device event: its launch is counted on the host side
        name = event.name
        if any(prefix in name for prefix in GENERATED_KERNEL_PREFIXES):
            yield event, True
            continue
        if not name.startswith("aten::"):
            continue
        parent, outermost_aten, in_graph = event.cpu_parent, True, False
        direct_graph_call = parent is not None and parent.name.startswith(COMPILED_GRAPH_EVENT)
        while parent is not None:
            if parent.name.startswith("aten::"):
                outermost_aten = False
            if parent.name.startswith(COMPILED_GRAPH_EVENT):
                in_graph = True
            parent = parent.cpu_parent
        if direct_graph_call or (outermost_aten and not in_graph and _aten_launches_kernel(name)):
            yield event, direct_graph_call


STEP_EVENT = "## host_ms_outside_ops step"
BACKWARD_EVENT_PREFIX = "autograd::engine::evaluate_function: "
OUTSIDE_OPS_CALLS = 5
"""Calls of the step `host_ms_outside_ops` takes the median of."""


def host_ms_outside_ops(step_fn: Callable[[], object], calls: int = OUTSIDE_OPS_CALLS) -> float:
    """The median over `calls` calls of `step_fn` of the milliseconds the host spends outside ATen
    ops (one call varies by a fifth on a shared CPU): Python, hooks,
    the framework's bookkeeping (DeepSpeed's per-parameter loops among them). From a torch.profiler
    trace: the step's wall time less the time inside its outermost ATen ops, those of the calling
    thread and of the autograd engine's threads (a GPU's backward runs on one of its own; a
    loader's background thread is not the step's). On a GPU an op's host time is its launch, so
    this is what a launch-bound step waits on besides launches; on a CPU it leaves the arithmetic
    out (but not the allocator's: freeing a large CPU tensor is outside any op). The profiler's own
    cost per op (~1-2 us) is included: compare figures of one machine."""
    return statistics.median(_host_ms_outside_ops(step_fn) for _ in range(calls))


def _host_ms_outside_ops(step_fn: Callable[[], object]) -> float:
    from torch.profiler import profile, record_function

    with profile() as trace:
        with record_function(STEP_EVENT):
            step_fn()
    events = trace.events()
    step = next(event for event in events if event.name == STEP_EVENT)
    inside = 0.0
    for event in events:
        if not event.name.startswith("aten::"):
            continue
        parent, outermost, in_backward = event.cpu_parent, True, False
        while parent is not None:
            outermost = outermost and not parent.name.startswith("aten::")
            in_backward = in_backward or parent.name.startswith(BACKWARD_EVENT_PREFIX)
            parent = parent.cpu_parent
        if outermost and (event.thread == step.thread or in_backward):
            inside += event.time_range.elapsed_us()
    return (step.time_range.elapsed_us() - inside) / 1e3
