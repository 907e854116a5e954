"""Our Triton kernels' launch chosen where they run: per kernel and problem size, the fastest of the
launches that compute the same numbers.

A launch's pipeline stages and its register cap (ptxas's .maxnreg) change how a program's loads
overlap and how many programs an SM holds, not what it computes: the same tiles and warps run the
same arithmetic on the same values in the same order, so every candidate writes the same bits
(exact resume and every rank's choice stay free of it; tests/test_gpu.py checks it bitwise). Which
is fastest depends on the GPU and the size: on one H100 (the seventh run, dense bias) a second
stage made the forward faster and the key/value pass slower at seq 128 x 256, and the key/value
pass faster at 512 x 64. So the first launch of each (kernel, problem) times each candidate with
CUDA events, keeps the fastest for the process, announces it once and launches it, as Inductor does
for its own kernels; like Inductor's occupancy step (`triton_heuristics`, which halves a
reduction's block where registers bound the programs an SM holds), a candidate capped to fit one
more program an SM is added where registers, not shared memory or threads, are what bound them.

`PMLM_TRITON_LAUNCH_TUNING`: `auto` (the default) tunes on a GPU, `off` launches the base shape,
`on` tunes in Triton's interpreter too (how the tests on the CPU run the tuner; the interpreter
ignores launch options, so there it exercises the choice, not its speed). A launch given through
`PMLM_TRITON_KERNEL_SHAPES` (or `bucket_attention.kernel_shapes`) is launched as given.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any, Callable, Hashable, NamedTuple

import torch

from .accelerated import announce, value_from_environment

TUNING_ENV = "PMLM_TRITON_LAUNCH_TUNING"
TUNING_CHOICES = ("auto", "off", "on")
TUNING, TUNING_PROBLEM = value_from_environment(TUNING_ENV, TUNING_CHOICES)
"""Read at import; `tuning` switches it for a block. TUNING_PROBLEM: what is wrong with TUNING_ENV
(the model refuses to start with it, as with the attention backend's other settings)."""

TUNED_LAUNCH = "tuned"
"""What the attention tool and `make gpu-check` write for a launch the tuner chose (its choices beside it)."""
STAGE_CHOICES = (1, 2)
"""Pipeline stages the tuner tries (the H100 runs: 3 was slower than both at every size measured)."""
TIMED_LAUNCHES = 5
"""Launches timed together, per candidate and round, on a GPU."""
ROUNDS = 2
"""Rounds over the candidates; each candidate keeps its fastest (a candidate timed while the GPU
clocks up, or beside another process's kernel, gets another chance)."""
MIN_REGISTER_CAP = 64
"""The lowest register cap a launch may ask (`max_registers`): below, the kernels spill most of their
tiles (ptxas allocates registers in steps of 8 a thread)."""


class Launch(NamedTuple):
    """Triton's launch options for a kernel whose tiles are fixed elsewhere (`bucket_sums`); the
    attention kernels' `KernelShape` carries its tiles too. Written `w4s3`, `w4s1r168`."""

    num_warps: int = 4
    num_stages: int = 3
    max_registers: int = 0

    def __str__(self) -> str:
        return f"w{self.num_warps}s{self.num_stages}" + (f"r{self.max_registers}" if self.max_registers else "")

    def launch_options(self) -> dict:
        """Triton's launch keywords."""
        options = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.max_registers:
            options["maxnreg"] = self.max_registers
        return options


@dataclasses.dataclass(frozen=True)
class SMResources:
    """What one streaming multiprocessor holds for the programs resident on it."""

    registers: int = 65536
    shared_bytes: int = 228 * 1024
    threads: int = 2048


HOPPER = SMResources()
"""An H100's or H200's SM (an A100's has the same registers and threads, 164 KiB of shared memory)."""


def sm_resources(device: torch.device) -> SMResources:
    """`device`'s SM as torch reports it (what it does not report: Hopper's)."""
    properties = torch.cuda.get_device_properties(device)
    return SMResources(registers=getattr(properties, "regs_per_multiprocessor", None) or HOPPER.registers,
                       shared_bytes=getattr(properties, "shared_memory_per_multiprocessor", None) or HOPPER.shared_bytes,
                       threads=getattr(properties, "max_threads_per_multi_processor", None) or HOPPER.threads)


def resident_programs(registers: int, warps: int, shared_bytes: int, sm: SMResources = HOPPER) -> int:
    """Programs of a kernel an SM holds at once: its register file over a program's registers (ptxas
    allocates them in steps of 8 a thread), its shared memory (1 KiB reserved a program) and threads.
    Fewer programs hide less of the memory's latency, which a kernel launched with one pipeline stage
    does not hide itself."""
    by_registers = sm.registers // (-(-max(registers, 1) // 8) * 8 * warps * 32)
    by_shared = sm.shared_bytes // (shared_bytes + 1024)
    return min(by_registers, by_shared, sm.threads // (warps * 32), 32)


def register_cap_for_one_more_program(registers: int, warps: int, shared_bytes: int,
                                      sm: SMResources = HOPPER) -> int | None:
    """The largest register cap at which an SM holds one more program of a kernel that uses
    `registers` a thread uncapped, or None where a cap cannot add one (shared memory or threads
    bound the programs, or the cap would fall under MIN_REGISTER_CAP). The H100's forward at seq
    128: 211 registers, 2 programs -> 168, 3 programs (docs/benchmarks.md)."""
    programs = resident_programs(registers, warps, shared_bytes, sm)
    cap = sm.registers // ((programs + 1) * warps * 32) // 8 * 8
    if cap < MIN_REGISTER_CAP or cap >= registers:
        return None
    return cap if resident_programs(cap, warps, shared_bytes, sm) > programs else None


@dataclasses.dataclass
class Choice:
    """A tuned launch: the shape kept, and each candidate's time (ms a launch; None: it failed)."""

    shape: Any
    times: dict


_CHOSEN: dict[Hashable, Choice] = {}
"""(kernel, base shape, device, problem) -> the launch chosen, for the process."""


def tunes(device: torch.device, interpreted: bool, pinned: bool) -> bool:
    """Whether launches on `device` are tuned: by TUNING, never where the launch was given."""
    if pinned or TUNING == "off":
        return False
    return TUNING == "on" or (device.type == "cuda" and not interpreted)


def chosen_launches() -> dict[Hashable, Choice]:
    """The launches chosen so far in this process (a copy; the tests and tools read it)."""
    return dict(_CHOSEN)


def forget_choices() -> None:
    """Forget every choice: the next launch of each problem is tuned again (tools timing launches
    against each other, the tests)."""
    _CHOSEN.clear()


def tuned_launch(kernel_name: str, base, problem: tuple, launch: Callable[[Any], Any], device: torch.device,
                 tune: bool, describe: Callable[[], str] | None = None) -> None:
    """launch(shape) with the shape chosen for (kernel, base, device, problem): `base` where `tune`
    is False; else, at the first call, each candidate timed (`base` and its other STAGE_CHOICES,
    each with a register cap that fits one more program where that exists), the fastest kept and
    announced. `launch` returns what Triton's launch returns (the compiled kernel: its registers
    and shared memory give the caps). A candidate that fails to compile or launch is left out; the
    base's failure is raised as it is. `describe`: the problem in words for the announcement (called
    once a problem: a launch's host time stays what it was)."""
    if not tune:
        launch(base)
        return
    key = (kernel_name, base, str(device), problem)
    choice = _CHOSEN.get(key)
    if choice is None:
        choice = _CHOSEN[key] = _fastest(base, launch, device)
        timings = ", ".join(f"{shape} {'failed' if ms is None else f'{ms:.3f}'}" for shape, ms in choice.times.items())
        announce(f"triton launch tuning: {kernel_name}{f' for {describe()}' if describe else ''}: {choice.shape} "
                 f"(ms a launch: {timings})")
    launch(choice.shape)


def choices_text(choices: dict | None) -> str:
    """' (tuned: forward 64x64w4s2, ...)' for {kernel name: launch chosen}, '' for none: how the tools
    print a row whose launch the tuner chose."""
    if not choices:
        return ""
    return " (tuned: " + ", ".join(f"{name.removeprefix('attention_').removesuffix('_kernel')} {shape}"
                                   for name, shape in sorted(choices.items())) + ")"


def _candidates(base) -> list:
    stages = [base.num_stages] + [stage for stage in STAGE_CHOICES if stage != base.num_stages]
    return [base._replace(num_stages=stage) for stage in stages]


def _fastest(base, launch: Callable[[Any], Any], device: torch.device) -> Choice:
    sm = sm_resources(device) if device.type == "cuda" else HOPPER
    candidates, times = _candidates(base), {}
    for shape in candidates:  # compile each (the first launch); an uncapped one adds its capped sibling
        try:
            compiled = launch(shape)
        except Exception:
            if shape == base:
                raise
            times[shape] = None
            continue
        registers = getattr(compiled, "n_regs", 0)
        shared = getattr(getattr(compiled, "metadata", None), "shared", 0)
        cap = (register_cap_for_one_more_program(registers, shape.num_warps, shared, sm)
               if registers and not shape.max_registers and torch.version.hip is None else None)  # ptxas's cap
        if cap is not None:
            candidates.append(shape._replace(max_registers=cap))
    timed = [shape for shape in candidates if shape not in times]
    for _ in range(ROUNDS):
        for shape in timed:
            elapsed = _time(lambda: launch(shape), device)
            times[shape] = elapsed if times.get(shape) is None else min(times[shape], elapsed)
    best = min(timed, key=lambda shape: times[shape])
    return Choice(best, {shape: times.get(shape) for shape in candidates})


def _time(run: Callable[[], Any], device: torch.device) -> float:
    """Milliseconds a launch: CUDA events around TIMED_LAUNCHES on a GPU, the wall clock around one
    elsewhere (Triton's interpreter runs synchronously)."""
    if device.type != "cuda":
        start = time.perf_counter()
        run()
        return (time.perf_counter() - start) * 1e3
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMED_LAUNCHES):
        run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / TIMED_LAUNCHES


@contextlib.contextmanager
def tuning(value: str):
    """TUNING set to `value` inside the block (how the tests and tools switch it)."""
    global TUNING
    if value not in TUNING_CHOICES:
        raise ValueError(f"launch tuning {value!r}: give {', '.join(TUNING_CHOICES)}")
    saved, TUNING = TUNING, value
    try:
        yield
    finally:
        TUNING = saved
