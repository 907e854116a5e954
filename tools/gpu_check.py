#!/usr/bin/env python
"""`make gpu-check`: what to run when a GPU is lent: the `gpu` tests, then tools/bench_train.py at the
base preset, seq 128 and 512, fp16 and bf16, sdpa and flex (flex only at compute capability >= 8.0),
into one JSON and one markdown table (tokens/s, samples/s, TFLOP/s, MFU, peak memory, compilations).

    python tools/gpu_check.py [--output-dir outputs/gpu-check] [--skip-tests] [--skip-bench]

Beside those rows, in the same run, at the preferred precision (bf16, fp16 without bf16) and sdpa,
for each shape: pretrain's own step (`bench_train.py --deepspeed`: DeepSpeed ZeRO-1, the real
loader over samples built from ../shared/data, the padded vocabulary), Hugging Face
BertForMaskedLM (sdpa) at the sequence length, at our layout width and with its head on the masked
positions only (`--huggingface`), our step's ratio to each, the CPU proxies of every row (host
syncs, kernels, attention-bias bytes per step), a `--compile` row where bench_train has that flag
(the bare model and pretrain's own step, both compiled), and one step of each at seq 128 traced
by torch.profiler (Chrome trace files; their top-20 kernels in gpu-check.md, with the time the GPU
was busy and idle in the step: idle is waiting for the host's launches). The MFU peak comes from
the exact device name (bench_train.PEAK_TFLOPS), its source printed.

Order: what the goals are judged on comes first, so that a short lease measures it: pretrain's
step at seq 128 then 512 (with Hugging Face and the trace), pretrain's step at the larger micro
batches of LARGE_BATCH_SHAPES eager, the attention kernel alone (tools/bench_attention_kernels.py at
ATTENTION_KERNEL_SHAPES: sdpa with the bias against FlexAttention with it, our triton kernels launched
several ways, and no bias), the same pretrain steps with `--attention-backend triton` (our Triton flash
attention; on SM 8.0+ with Triton importable) launched as the fastest triton row there, then
pretrain's step at the larger micro batches compiled (at the first shapes an H100 waited on the host
for half of pretrain's step; at these it works), pretrain's step accumulating the micro batches of
ACCUMULATION_SHAPES (DeepSpeed's reduction and optimizer step once per k, as in a run of the paper's
global batch), the `--compile` rows at the first shapes, the other
attention backend at the preferred precision, the `gpu` tests, then the other precision.
`--budget-seconds S` bounds the whole check: a step starts only with at least its minimum left
(`minimum_seconds`: 45 s for an eager row, 75 s with pretrain's step and Hugging Face, 120 s for the
attention kernels, a `--compile` row or the tests), runs with a timeout of what is left, and what did not fit is listed as not run.
The report (`gpu-check.json`, `gpu-check.md`) is rewritten after every step, and `--archive
FILE.tar.gz` packs the whole results folder into one file at the end, also when SIGTERM/SIGINT
(a scheduler's or `timeout`'s) stops the check: one file to copy off a lent machine.

Without a CUDA device it stops at once, saying so in one line (exit 1); `--cpu-dry-run` instead
runs the benchmark part on the CPU at the tiny preset (seq 64, micro batch 4, fp32, one step) to
check the tooling. Each benchmark runs in its own process (a fresh CUDA context and peak-memory
count); a failing one is recorded and the others still run. Exit 0 only when the tests pass and
every benchmark ran (a budget that left steps out: exit 0 when what ran passed, the steps left out
named in the report).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_SHAPES = ((128, 64), (512, 20))
"""(sequence length, micro batch): seq 128 as NVIDIA's BERT phase 1, seq 512 at the paper's micro
batch per GPU (20 x 6 accumulation steps x 64 GPUs = 7,680)."""
LARGE_BATCH_SHAPES = ((128, 256), (512, 64))
"""(sequence length, micro batch) of pretrain's step once more, at 4x and 3.2x BENCH_SHAPES' micro
batch, eager and compiled: those used 6-7 GB of an H200 (the paper's micro batch was sized for a
32 GB V100), and a step's fixed host cost (launches, DeepSpeed's per-parameter Python) weighs less
in a larger one, as in a run sized to the card (on one H100: 18 GB at these). Peak memory is in the
row."""
ACCUMULATION_SHAPES = ((512, 64, 15),)
"""(sequence length, micro batch, micro batches a step) of pretrain's step once more, with gradient
accumulation, as the goal rows run it (compiled, with the kernel backend where it runs: triton):
a run of the paper's global batch takes several micro batches an optimizer step (7,680 sequences of
512: 15 micro batches of 64 on each of 8 GPUs), and DeepSpeed's ZeRO-1 reduction and optimizer step
(flatten, copies back, the step, the bf16 copy: ~11 ms of the 46 ms step at seq 128 x 64 on one
H100, most of it host time with little GPU work under it) come once per step, not once per micro
batch. Its MFU is the per-micro-batch figure such a run sees (less its all-reduce); the rows of one
micro batch a step stay the worst case."""
COMPILE_FLAGS = ("--compile", "--deepspeed", "--skip-host-proxy")
"""bench_train's flags of a `--compile` row: the bare model and pretrain's step compiled; without the
host proxy, whose shape (micro batch 1, seq 16) would be one more compilation (30-90 s of the lease)."""
ATTENTION_KERNEL_SHAPES = "512x64"
"""tools/bench_attention_kernels.py's shapes in the check: the attention kernel alone (sdpa with the
bias and its gradient against FlexAttention with the dense bias, the model's flex, and no bias) at
seq 512, where attention weighs most (~60 TFLOP/s on the first H100s: 20% of the compiled step at
seq 128, more at 512); after the eager rows at the large micro batches, before the compiled ones."""
TRITON_KERNEL_SHAPES = ("64x64w4s1/64x64w4s1,64x64w4s2/64x64w4s2,64x64w4s2/64x64w4s1,64x64w4s1/64x64w4s2,"
                        "128x64w8s1r128/64x64w4s1,64x64w4s1/64x64w8s1r128,64x64w4s1/64x64w4s1r168")
"""The triton backend's kernels launched as given beside the `triton` row (whose launch the tuner
chooses: models/launch_tuning.py), as `bench_attention_kernels.py --triton-shapes` rows: forward and
dQ / dK, dV, dS (tiles queries x keys, warps, pipeline stages): the base launch untuned (64x64w4s1
for all three, the fastest on the seventh run's H100), two stages for both passes (the former
default: 4.90 ms a layer at seq 512 x 64 there against 3.27 with one) and for either, 128 queries a
tile with 8 warps for the forward (capped at 128 registers a thread: two programs an SM, 16 bytes
spilled), the key/value pass with 8 warps capped at 128 registers (two programs of 8 warps an SM
where the default runs two of 4: ptxas gives a thread ~220 registers whatever the warps; 144 bytes
spilled) and with 4 capped at 168 (three programs an SM, 72 bytes spilled; the tuner also tries this
cap, not other warps); `tools/bench_kernel_code.py`. The fastest that is the same attention launches the triton
rows after it (`fastest_triton_launch`; the tuned row: the rows tune), and a GPU where a given
launch beats the tuned one says which to offer the tuner."""
ATTENTION_PRIORITY = 0.55
"""After sdpa's eager rows at the large micro batches (0.5), before the triton rows there (0.6),
which then launch the triton kernels as the fastest row of the attention table did
(`fastest_triton_launch`)."""
DRY_RUN_ATTENTION_SHAPES = "64x4"
MIN_ATTENTION_SECONDS = 120
"""--budget-seconds: the attention step starts only with this much left (two FlexAttention
compilations, ~20 s each on an H100, the triton kernels' in 5 launches, ~10 s each, and the timed
runs: estimated)."""
PRECISIONS = ("fp16", "bf16")
DRY_RUN_SHAPES = ((64, 4),)
"""--cpu-dry-run: the tiny preset at this (sequence length, micro batch), fp32, one timed step."""
TRACED_SEQ_LENGTH = 128
"""The shape whose step is traced (the first shape in a dry run)."""
MIN_STEP_SECONDS = 45
"""--budget-seconds: an eager benchmark row starts only with this much left (start-up, the timed
steps: ~30 s per eager row on the first H100)."""
MIN_REAL_STEP_SECONDS = 75
"""--budget-seconds: the same for a row that also times pretrain's step and Hugging Face's (an eager
row + three Hugging Face models + a DeepSpeed engine over samples built at start: estimated)."""
MIN_COMPILE_STEP_SECONDS = 120
"""--budget-seconds: the same for a `--compile` row (two compilations since `--skip-host-proxy`: the
bare model's step and pretrain's own; on one H100 at seq 128 x 256 their first steps took 22-26 s
and 16 s). A row that cannot finish is better left to the rows after it."""
MIN_TESTS_SECONDS = 120
"""--budget-seconds: the gpu tests start only with this much left (they took 200 s on the first H100)."""
REPORT_SECONDS = 15
"""--budget-seconds: kept back at the end for the report and the archive."""
SETTING_PREFIXES = ("PMLM_", "TRITON_", "TORCHINDUCTOR_")
"""Environment variables that change what the rows run (the triton backend's launch, bias and
passes; Triton's and inductor's own switches): the report names those set, so a table made with
`PMLM_TRITON_BIAS=dense` (say) is not read as the defaults'. Folders (`*_DIR`) are left out."""


def cuda_problem() -> str | None:
    """Why this machine cannot run the check (one line), or None."""
    try:
        import torch
    except ImportError as error:
        return f"no CUDA device found: torch does not import ({error})"
    if not torch.cuda.is_available():
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
        return (f"no CUDA device found (torch {torch.__version__}, {build}): make gpu-check needs a GPU; "
                "on a GPU machine install a CUDA torch (make env TORCH_SPEC=...)")
    return None


GROUP_STOP_SECONDS = 10
"""A step's process group gets this long after SIGTERM before SIGKILL."""


def run_process_group(command: list[str], timeout: float, env: dict) -> tuple[str, int]:
    """(stdout + stderr, exit code) of `command` run in a process group of its own; at the timeout
    (exit code 124), or when the check itself is stopped, the whole group is ended (SIGTERM, then
    SIGKILL): a test's torchrun workers or a benchmark's helpers never outlive their step and hold
    the GPU during the next."""
    process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=env, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
        return output, process.returncode
    except subprocess.TimeoutExpired:
        _end_group(process)
        return f"{_remaining_output(process)}\ntimed out after {timeout:.0f} s", 124
    except BaseException:
        _end_group(process)
        _remaining_output(process)
        raise
    finally:
        _end_group(process, only_leftovers=True)


def _remaining_output(process: subprocess.Popen) -> str:
    """What an ended step still had to say; bounded, since a process that left the group (a daemon)
    may hold the output pipe open."""
    try:
        return process.communicate(timeout=GROUP_STOP_SECONDS)[0]
    except subprocess.TimeoutExpired:
        process.stdout.close()
        process.wait()
        return "(its output is lost: a process outside its group holds the pipe open)"


def _end_group(process: subprocess.Popen, only_leftovers: bool = False) -> None:
    """SIGTERM to the process group, SIGKILL to what is left after GROUP_STOP_SECONDS (`only_leftovers`:
    the leader has exited; end whatever of its group is still running)."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    if not only_leftovers:
        try:
            process.wait(timeout=GROUP_STOP_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    deadline = time.time() + GROUP_STOP_SECONDS
    while time.time() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def run_tests(output_dir: Path, timeout: float) -> dict:
    """pytest -m gpu tests/test_gpu.py, its output kept in tests.log (verbose: a run the budget stops
    still names each test that ran and the one it stopped in; every test's time at the end)."""
    started = time.time()
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-v", "-rs", "--durations=0", "tests/test_gpu.py",
               f"--junitxml={output_dir / 'tests.xml'}"]
    output, returncode = run_process_group(command, timeout, {**os.environ, "DS_ACCELERATOR": "cuda"})
    (output_dir / "tests.log").write_text(output)
    lines = [line for line in output.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or "failed" in line
                                                                            or "skipped" in line)), lines[-1] if lines else "")
    return {"command": " ".join(command), "returncode": returncode, "passed": returncode == 0,
            "summary": summary.strip("= "), "seconds": time.time() - started, "log": str(output_dir / "tests.log")}


def run_attention_kernels(output_dir: Path, shapes: str, preset: str, iterations: int, warmup: int, timeout: float,
                          accelerator: str = "cuda") -> dict:
    """tools/bench_attention_kernels.py in its own process: its figures, or what went wrong."""
    figures_file = output_dir / "attention-kernels.json"
    command = [sys.executable, str(REPO_ROOT / "tools" / "bench_attention_kernels.py"), "--preset", preset,
               "--shapes", shapes, "--triton-shapes", TRITON_KERNEL_SHAPES, "--iterations", str(iterations),
               "--warmup", str(warmup), "--json", str(figures_file)]
    started = time.time()
    output, returncode = run_process_group(command, timeout, {**os.environ, "DS_ACCELERATOR": accelerator})
    (output_dir / "attention-kernels.log").write_text(output)
    result = {"name": "attention kernels", "command": " ".join(command[1:]), "seconds": time.time() - started,
              "returncode": returncode}
    if figures_file.is_file():
        result["figures"] = json.loads(figures_file.read_text())
    # exit 1 with figures: a variant failed or computed another attention (named in the figures)
    result["ok"] = returncode == 0
    if not result["ok"]:
        result["error"] = f"exit code {returncode}: " + "; ".join(output.strip().splitlines()[-3:])
    return result


def fastest_triton_launch(figures: dict | None) -> dict | None:
    """From tools/bench_attention_kernels.py's figures: the launch (`FORWARD/KEY_VALUE`) of the triton
    row (`triton` or a `triton[...]` launch; not the other triton rows: dropout, no bias, dQ's kernel) that ran at every shape
    as the same attention as sdpa in the least time over the shapes, with every candidate's ms; or
    None when no such row ran."""
    totals: dict[str, float] = {}
    excluded: set[str] = set()
    for shape in (figures or {}).get("shapes", []):
        for row in shape.get("rows", []):
            launch = row.get("launch")
            if not launch or not (row["variant"] == "triton" or row["variant"].startswith("triton[")):
                continue
            if row.get("same_attention") and "ms" in row:
                totals[launch] = totals.get(launch, 0.0) + row["ms"]
            else:
                excluded.add(launch)
    ran = {launch: ms for launch, ms in totals.items() if launch not in excluded}
    if not ran:
        return None
    best = min(ran, key=ran.get)
    return {"launch": best, "ms": ran}


def bench_has_compile() -> bool:
    """Whether tools/bench_train.py takes --compile (its --help lists it)."""
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_train.py"), "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    return "--compile" in result.stdout


def pretrain_step_flags(kind: str) -> list[str]:
    """bench_train's flags for a row that times pretrain's step, eager or compiled."""
    return list(COMPILE_FLAGS) if kind == "compile" else ["--deepspeed"]


def bench_plan(shapes, precisions: Sequence[str], backends: Sequence[str], preferred: str,
               compile_rows: bool, large_batches: Sequence[tuple[int, int]] = (),
               accumulation: Sequence[tuple[int, int, int]] = (),
               kernel_backends: Sequence[str] = ()) -> list[dict]:
    """Every bench_train process of a check, most important first (the module docstring's order):
    the row at the preferred precision with sdpa also times the real path (pretrain's step, Hugging
    Face; the trace at seq 128, or at the first shape without one) per shape; then pretrain's step
    at each of `large_batches` (named with its micro batch), eager, then compiled where bench_train
    has --compile (traced at the traced length); then pretrain's step with the gradient accumulation
    of each of `accumulation` (seq, micro batch, k; named `-mb<micro batch>-ga<k>`; compiled where
    bench_train has --compile, with the first of `kernel_backends` if any: the goal rows' step); then the --compile row per
    shape (pretrain's step compiled too); then the other backends at the preferred precision; then the
    other precisions. Each of `kernel_backends` (triton) times pretrain's step at the large micro
    batches, eager right after sdpa's eager rows there, compiled (and traced, at every length) right
    after sdpa's compiled ones: the same step with another attention kernel.
    `priority` says which group a row is in (0-3)."""
    plan = []
    traced_length = TRACED_SEQ_LENGTH if any(shape[0] == TRACED_SEQ_LENGTH for shape in shapes) else shapes[0][0]
    for seq_length, micro_batch in shapes:
        for precision in precisions:
            for backend in backends:
                real = precision == preferred and backend == "sdpa"
                plan.append({"seq_length": seq_length, "micro_batch": micro_batch, "precision": precision,
                             "backend": backend, "kind": "eager", "real": real,
                             "flags": ["--deepspeed", "--huggingface"] if real else [],
                             "traced": real and seq_length == traced_length,
                             "priority": 0 if real else 2 if precision == preferred else 3})
        if compile_rows:  # pretrain --compile too: where the goals are judged
            plan.append({"seq_length": seq_length, "micro_batch": micro_batch, "precision": preferred, "backend": "sdpa",
                         "kind": "compile", "real": True, "flags": list(COMPILE_FLAGS), "traced": False,
                         "priority": 1.5})
    for seq_length, micro_batch in large_batches:
        for kind in ("eager", "compile") if compile_rows else ("eager",):
            plan.append({"seq_length": seq_length, "micro_batch": micro_batch, "precision": preferred,
                         "backend": "sdpa", "kind": kind, "real": True,
                         "flags": pretrain_step_flags(kind),
                         # the compiled step traced too, at the traced length: where a step sized to the
                         # card spends its time once the host is hidden
                         "traced": kind == "compile" and seq_length == traced_length,
                         "name_suffix": f"-mb{micro_batch}",
                         "priority": 0.5 if kind == "eager" else 1})
        for backend in kernel_backends:
            # eager right after sdpa's eager rows; compiled after sdpa's compiled ones (the likeliest
            # fastest step: the layers compiled around the kernel, which inductor calls as it is)
            for kind in ("eager", "compile") if compile_rows else ("eager",):
                plan.append({"seq_length": seq_length, "micro_batch": micro_batch, "precision": preferred,
                             "backend": backend, "kind": kind, "real": True,
                             "flags": pretrain_step_flags(kind),
                             # compiled, traced at every length: the default path's step where
                             # triton runs (auto), whose kernels say where its time goes
                             "traced": kind == "compile", "name_suffix": f"-mb{micro_batch}",
                             "priority": 0.6 if kind == "eager" else 1.1})
    for seq_length, micro_batch, steps in accumulation:  # as the goal rows: compiled, the kernel backend
        kind = "compile" if compile_rows else "eager"
        plan.append({"seq_length": seq_length, "micro_batch": micro_batch, "precision": preferred,
                     "backend": kernel_backends[0] if kernel_backends else "sdpa", "kind": kind, "real": True,
                     "flags": [*pretrain_step_flags(kind), "--gradient-accumulation-steps", str(steps)],
                     "traced": False,
                     "name_suffix": f"-mb{micro_batch}-ga{steps}", "priority": 1.25})
    return sorted(plan, key=lambda spec: spec["priority"])  # stable: shapes keep their order in a group


def minimum_seconds(step: dict) -> float:
    """What must be left of --budget-seconds for `step` to start (a `bench_plan` row or the tests)."""
    if step["kind"] == "tests":
        return MIN_TESTS_SECONDS
    if step["kind"] == "attention":
        return MIN_ATTENTION_SECONDS
    if step["kind"] == "compile":
        return MIN_COMPILE_STEP_SECONDS
    return MIN_REAL_STEP_SECONDS if step["real"] else MIN_STEP_SECONDS


TESTS_PRIORITY = 2.5
"""Where the gpu tests run among the benchmark groups of `bench_plan`: after the other backends at
the preferred precision, before the other precisions."""


def bench_name(spec: dict, preset: str) -> str:
    return (f"{preset}-seq{spec['seq_length']}-{spec['precision']}-{spec['backend']}"
            + ("" if spec["kind"] == "eager" else f"-{spec['kind']}") + spec.get("name_suffix", ""))


def run_bench(output_dir: Path, spec: dict, iterations: int, warmup: int, timeout: float, preset: str = "base",
              accelerator: str = "cuda", env: dict | None = None) -> dict:
    """One tools/bench_train.py process; its figures, or what went wrong. `env`: more environment
    (the triton kernels' launch)."""
    seq_length, micro_batch, precision, backend = (spec["seq_length"], spec["micro_batch"], spec["precision"],
                                                   spec["backend"])
    name = bench_name(spec, preset)
    figures_file = output_dir / f"{name}.json"
    command = [sys.executable, str(REPO_ROOT / "tools" / "bench_train.py"), "--preset", preset, "--seq-length",
               str(seq_length), "--micro-batch-size", str(micro_batch), *([f"--{precision}"] if precision != "fp32"
                                                                         else []),
               "--attention-backend", backend, "--iterations", str(iterations), "--warmup", str(warmup),
               "--json", str(figures_file), *spec["flags"]]
    if spec.get("traced"):
        command += ["--profile-trace", str(output_dir / f"{name}.trace.json")]
    row = {"name": name, "seq_length": seq_length, "micro_batch_size": micro_batch, "precision": precision,
           "attention_backend": backend, "kind": spec["kind"],
           "command": " ".join([*(f"{variable}={value}" for variable, value in (env or {}).items()), *command[1:]])}
    started = time.time()
    output, returncode = run_process_group(command, timeout, {**os.environ, "DS_ACCELERATOR": accelerator,
                                                              **(env or {})})
    (output_dir / f"{name}.log").write_text(output)
    row["seconds"] = time.time() - started
    if returncode == 0 and figures_file.is_file():
        row.update(ok=True, figures=json.loads(figures_file.read_text()))
    else:
        row.update(ok=False, error=f"exit code {returncode}: " + "; ".join(output.strip().splitlines()[-3:]))
    return row


def _percent(value) -> str:
    return f"{value:.1%}" if value is not None else "?"


def _proxies(figures: dict) -> str:
    """The CPU proxies of a row (absent from figures of a bench_train without them: '?')."""
    if "kernels_per_step" not in figures:
        return "? | ? | ? | ?"
    host = (f"{figures['host_ms_per_step']:,.1f}" if "host_ms_per_step" in figures
            else "skipped" if "host_proxy_skipped" in figures else "?")
    return (f"{figures['host_syncs_per_step']} ({figures['host_syncs_all_owners']}) | {figures['kernels_per_step']:,} "
            f"| {figures['bias_bytes_per_step'] / 2**20:,.1f} | {host}")


def _outside_ops(figures: dict) -> str:
    """A step's host ms outside ATen ops (absent from figures of an older bench_train: '?')."""
    return f"{figures['host_ms_outside_ops']:,.1f}" if "host_ms_outside_ops" in figures else "?"


def backend_comparison(real_rows: list[dict]) -> list[str]:
    """Lines comparing pretrain's step with the triton backend to sdpa's at the same sequence length,
    micro batch and mode: what decides the default backend (docs/gpu.md, "The triton backend")."""
    steps = {}
    for row in real_rows:
        real = row["figures"].get("deepspeed", {})
        if "seconds_per_step" in real:
            key = (row["seq_length"], row["micro_batch_size"], "compiled" if real.get("compile") else "eager")
            steps.setdefault(key, {})[row.get("attention_backend", "sdpa")] = real["seconds_per_step"]
    pairs = [(key, backends["triton"] / backends["sdpa"]) for key, backends in steps.items()
             if "sdpa" in backends and "triton" in backends]
    if not pairs:
        return []
    return ["", "The triton backend against sdpa (pretrain's step, same sequence, micro batch and mode; below 1: "
            "triton is faster): " + "; ".join(
                f"seq {seq} x {micro_batch} {mode} {ratio:.2f}x ({'faster' if ratio < 1 else 'slower'})"
                for (seq, micro_batch, mode), ratio in pairs) + "."]


def markdown(report: dict) -> str:
    device = report["device"]
    budget = f" (budget {report['budget_seconds']:.0f} s)" if report.get("budget_seconds") else ""
    lines = [f"# gpu-check: {device['name']} (compute capability {device['capability']}), "
             f"torch {device['torch']}, CUDA {device['cuda']}", "",
             f"{report['started']}, {report['seconds']:.0f} s in all{budget}. Tests (`pytest -m gpu tests/test_gpu.py`): "
             + (f"{'passed' if report['tests']['passed'] else 'FAILED'}, {report['tests']['summary']} "
                f"({report['tests']['seconds']:.0f} s)" if report["tests"] else "not run"), ""]
    settings = report.get("environment") or {}
    lines += ["Settings from the environment (they change what the rows run): " + (
        ", ".join(f"`{name}={value}`" for name, value in settings.items()) if settings
        else "none (the code's defaults)") + ".", ""]
    peaks = report.get("peaks", {})
    if peaks:
        lines += ["MFU peaks (dense, from the device name): " + "; ".join(
            f"{precision} {peak['tflops']} TFLOP/s ({peak['source']})" if peak["tflops"] else
            f"{precision}: {peak['source']}" for precision, peak in peaks.items()), ""]
    lines += ["tools/bench_train.py, preset " + report.get("preset", "base") + ", model FLOPs "
              "(training.recipe.flops_per_token), MFU against the datasheet dense peak for the precision; first step = "
              "compilation included. Proxies (measured on the host, eager unless the mode is compile): host syncs "
              "per step in our code (all owners), kernels per step, attention-bias MiB allocated per step, host ms per "
              "step (micro batch 1, seq 16, one thread: the launch-bound floor).", "",
              "| seq | micro batch | precision | attention | mode | tokens/s | samples/s | TFLOP/s | MFU | peak memory GB "
              "| layout width (padded) | compilations (recompilations) | first step s | host syncs | kernels "
              "| bias MiB | host ms |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["bench"]:
        head = (f"| {row['seq_length']} | {row['micro_batch_size']} | {row['precision']} | {row['attention_backend']} "
                f"| {'compile' if row.get('kind') == 'compile' else 'eager'} |")
        if not row["ok"]:
            lines.append(f"{head} failed: {row['error'][:200].replace('|', '/')} |||||||||||")
            continue
        f = row["figures"]
        first = f"{f['first_step_seconds']:.1f}" if f.get("first_step_seconds") is not None else "?"
        memory = f"{f['peak_memory_gb']:.1f}" if f.get("peak_memory_gb") is not None else "?"
        lines.append(f"{head} {f['tokens_per_sec']:,.0f} | {f['samples_per_sec']:.1f} | {f['model_tflops']:.1f} | "
                     f"{_percent(f.get('mfu'))} | {memory} | {f['layout_width']} ({f['padded_width']}) | "
                     f"{f['compilations']} ({f['recompilations']}) | {first} | {_proxies(f)} |")
    real_rows = [row for row in report["bench"] if row["ok"] and "deepspeed" in row["figures"]]
    if real_rows:
        lines += ["", "## pretrain's own step (`bench_train.py --deepspeed`): the MFU goals are judged here", "",
                  "`Trainer.train_step` of a one-process `megatron_pmlm.pretrain` run: DeepSpeed ZeRO-1, the real "
                  "loader, the padded vocabulary, pretrain's dropout; the bare model (no DeepSpeed, no dropout, "
                  "random ids) beside it.", "",
                  "| seq | micro batch | precision | mode | vocabulary | tokens/s | samples/s | TFLOP/s | MFU "
                  "| bare-model MFU | real / bare step time | host syncs | kernels | host ms outside ops (bare) "
                  "| peak memory GB | first step s (compilations) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in real_rows:
            f, real = row["figures"], row["figures"].get("deepspeed", {})
            accumulated = real.get("gradient_accumulation_steps", 1)
            head = (f"| {row['seq_length']} | {row['micro_batch_size']}"
                    + (f" x {accumulated} a step" if accumulated > 1 else "") + " |")
            if "seconds_per_step" not in real:
                lines.append(f"{head} skipped: {real.get('skipped', 'no figures')} ||||||||||||||")
                continue
            while_timed = real.get("compilations_while_timed") or 0
            first = (f"{real['first_step_seconds']:.1f} ({real['compilations']}"
                     + (f"; {while_timed} more while timed" if while_timed else "") + ")"
                     if real.get("first_step_seconds") is not None else "?")
            mode = ("compile" if real.get("compile") else "eager") + (
                f", {row['attention_backend']}" if row.get("attention_backend", "sdpa") != "sdpa" else "")
            lines.append(f"{head} {real['precision']} | {mode} | "
                         f"{real['padded_vocab_size']:,} | {real['tokens_per_sec']:,.0f} | "
                         f"{real['samples_per_sec']:.1f} | {real['model_tflops']:.1f} | {_percent(real['mfu'])} | "
                         f"{_percent(f.get('mfu'))} | {real['seconds_per_step'] / accumulated / f['seconds_per_step']:.2f} | "
                         f"{real['host_syncs_per_step']} ({real['host_syncs_all_owners']}) | "
                         f"{real['kernels_per_step']:,} | {_outside_ops(real)} ({_outside_ops(f)}) | "
                         + (f"{real['peak_memory_gb']:.1f}" if real.get("peak_memory_gb") is not None else "?")
                         + f" | {first} |")
        if report.get("triton_launch"):
            from megatron_pmlm.models.launch_tuning import TUNED_LAUNCH

            fastest = report["triton_launch"]
            how = ("tuned the kernels' launch (models/launch_tuning.py), the tuned row being"
                   if fastest["launch"] == TUNED_LAUNCH
                   else f"launched the kernels as `{fastest['launch']}` (forward and dQ / dK, dV, dS),")
            lines += ["", f"The triton rows {how} "
                      "the fastest in the attention table (ms over its shapes: " + ", ".join(
                          f"{launch} {ms:.2f}" for launch, ms in sorted(fastest["ms"].items(), key=lambda i: i[1]))
                      + ")."]
        lines += backend_comparison(real_rows)
        paths = sorted({row["figures"]["deepspeed"]["table_gradient"] for row in real_rows
                        if "table_gradient" in row["figures"].get("deepspeed", {})})
        if paths:
            lines += ["", "The relative-bias table's gradient (`models/bucket_sums.py`): " + "; ".join(paths) + "."]
        lines += ["", "## Hugging Face BertForMaskedLM (sdpa, same size, precision and micro batch)", "",
                  "Forward + backward + AdamW per step; ours = the bare-model step above; ratio = ours / theirs "
                  "(below 1: ours is faster).", "",
                  "| seq | micro batch | precision | ours ms | HF at seq ms (ratio) | HF at our width T ms (ratio) "
                  "| HF, head on masked positions only, ms (ratio) |", "|---|---|---|---|---|---|---|"]
        for row in real_rows:
            f = row["figures"]
            if not f.get("huggingface"):
                continue  # the --compile row: Hugging Face is timed beside the eager one
            cells = {hf["name"]: f"{hf['seconds_per_step'] * 1e3:.1f} ({hf['ours_over_theirs']:.2f})"
                     + (f", T = {hf['length']}" if hf["name"] == "hf-width" else "")
                     for hf in f.get("huggingface", [])}
            lines.append(f"| {row['seq_length']} | {row['micro_batch_size']} | {row['precision']} | "
                         f"{f['seconds_per_step'] * 1e3:.1f} | {cells.get('hf-seq', '?')} | {cells.get('hf-width', '?')} "
                         f"| {cells.get('hf-seq-masked-head', '?')} |")
        unit = "self CUDA time" if device["cuda"] else "self CPU time"
        for row in real_rows:
            traced = [(what, figures) for what, figures in (("the bare model's step", row["figures"]),
                                                              ("pretrain's step", row["figures"].get("deepspeed", {})))
                      if figures.get("top_kernels")]
            for what, f in traced:
                lines += ["", f"## Top {len(f['top_kernels'])} kernels of {what} (seq {row['seq_length']}, micro batch "
                          f"{row['micro_batch_size']}, {row['precision']}, {row['attention_backend']}"
                          + (", compiled" if row["kind"] == "compile" else "")
                          + f", by {unit}; trace: {f['profile_trace']})", "",
                          _timeline(f.get("device_timeline")), "", "| kernel | calls | ms |", "|---|---|---|"]
                lines += [f"| `{kernel['name'][:120].replace('|', '/')}` | {kernel['calls']} | "
                          f"{kernel['self_us'] / 1e3:.2f} |" for kernel in f["top_kernels"]]
    lines += _attention_section(report.get("attention"))
    if report.get("not_run"):
        lines += ["", f"Not run ({report['not_run_reason']}): " + ", ".join(report["not_run"]) + "."]
    for note in report["notes"]:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def _attention_section(attention: dict | None) -> list[str]:
    """The attention kernels' table (tools/bench_attention_kernels.py), or nothing when not run."""
    from megatron_pmlm.models.launch_tuning import choices_text

    if not attention:
        return []
    lines = ["", "## The attention kernel alone (`tools/bench_attention_kernels.py`)", "",
             "One forward + backward of attention over a real layout's bias, q/k/v gradients (and the bias's "
             "where the variant gives one) checked against sdpa's; TFLOP/s count 14 x B x heads x T^2 x head size."]
    if not attention["ok"]:
        lines += ["", f"{'Stopped' if attention.get('budget_stopped') else 'Failed'}: "
                  f"{attention.get('error', '')[:300]}"]
    for shape in attention.get("figures", {}).get("shapes", []):
        lines += ["", f"seq {shape['seq_length']} (width {shape['width']}), micro batch {shape['micro_batch']}, "
                  f"{shape.get('dtype', '?')}; pairs the rule allows {shape.get('allowed_fraction', 0):.1%}; "
                  f"context width {shape.get('context_width', '?')} (sdpa-split's pairs "
                  f"{shape.get('split_pairs_fraction', 0):.1%} of T x T)", "",
                  "| variant | ms | TFLOP/s | same attention as sdpa (largest relative difference) |", "|---|---|---|---|"]
        for row in shape["rows"]:
            if "error" in row or "unavailable" in row:
                what = f"failed: {row['error']}" if "error" in row else f"not available: {row['unavailable']}"
                lines.append(f"| {row['variant']} | {what[:160].replace('|', '/')} | | |")
                continue
            check = "(the reference)" if row["variant"] == "sdpa" else "-"
            if "relative_difference" in row:
                worst = max(row["relative_difference"].items(), key=lambda item: item[1])
                check = f"{'yes' if row['same_attention'] else 'NO'} ({worst[1]:.1e}, {worst[0]})"
            variant = row["variant"] + choices_text(row.get("tuned_launches"))
            lines.append(f"| {variant} | {row['ms']:.3f} | {row['tflops']:.1f} | {check} |")
        for name, timing in shape.get("table_gradient", {}).items():
            if "unavailable" in timing:
                lines.append(f"| table gradient, {name} | not available: {timing['unavailable']} | | |")
            else:
                lines.append(f"| table gradient, {name} | {timing['ms']:.3f} | | "
                             f"{timing['relative_difference']:.1e} from a float64 sum |")
    return lines


def _timeline(timeline: dict | None) -> str:
    """One line: how much of the traced step the GPU was busy (bench_train.device_timeline)."""
    if not timeline:
        return "GPU timeline: none (no GPU events in this trace)."
    line = (f"GPU timeline: {timeline['kernels']:,} kernels over {timeline['span_ms']:.1f} ms, busy "
            f"{timeline['busy_ms']:.1f} ms, idle {timeline['idle_ms']:.1f} ms "
            f"({timeline['idle_ms'] / max(timeline['span_ms'], 1e-9):.0%}: waiting for the host's launches).")
    kinds = timeline.get("ms_by_kind")  # reports written before the breakdown lack it
    if kinds:
        line += " Kernel time by kind: " + ", ".join(f"{kind} {ms:.1f} ms" for kind, ms in kinds.items()) + "."
    return line


def environment_settings(environ=None) -> dict[str, str]:
    """The SETTING_PREFIXES variables set in `environ` (default: this process's), by name."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in sorted(environ)
            if name.startswith(SETTING_PREFIXES) and not name.endswith("_DIR")}


def device_peaks(name: str, precisions: Sequence[str]) -> dict:
    """{precision: {"tflops", "source"}} from bench_train's table of exact device names."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from bench_train import peak_from_device_name

    return {precision: dict(zip(("tflops", "source"), peak_from_device_name(name, precision)))
            for precision in precisions}


class Stopped(Exception):
    """SIGTERM or SIGINT reached the check: report what ran, archive it, exit."""


def _stop(signum, frame):
    raise Stopped(signal.Signals(signum).name)


def write_report(output_dir: Path, report: dict, started: float) -> None:
    """gpu-check.json and gpu-check.md as they stand (rewritten after every step)."""
    report["seconds"] = time.time() - started
    (output_dir / "gpu-check.json").write_text(json.dumps(report, indent=1))
    (output_dir / "gpu-check.md").write_text(markdown(report))


def write_archive(output_dir: Path, archive: Path) -> None:
    """The results folder as one .tar.gz (written beside, then renamed: never half an archive)."""
    partial = archive.with_name(archive.name + ".partial")
    with tarfile.open(partial, "w:gz") as tar:
        tar.add(output_dir, arcname=output_dir.name)
    os.replace(partial, archive)


def archive_problem(path: str) -> str | None:
    """Why --archive PATH cannot be written (one line), or None."""
    if not path.endswith((".tar.gz", ".tgz")):
        return f"--archive {path}: give a file name ending in .tar.gz"
    target = Path(path)
    if target.is_dir():
        return f"--archive {path} is a folder; give a file name ending in .tar.gz"
    if target.exists() and not target.is_file():
        return f"--archive {path} is not a regular file (a device, FIFO or socket); give a new file name"
    if not target.resolve().parent.is_dir():
        return f"--archive {path}: the folder {target.resolve().parent} does not exist"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="outputs/gpu-check",
                        help="results go to a new timestamped folder under it")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    parser.add_argument("--skip-bench", action="store_true", help="tests only")
    parser.add_argument("--iterations", type=int, default=10, help="timed steps per benchmark")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation among them)")
    parser.add_argument("--timeout", type=int, default=300,
                        help="seconds allowed to each benchmark process (twice that to the real-path ones)")
    parser.add_argument("--budget-seconds", type=float, default=None, metavar="S",
                        help="the whole check in S seconds: steps run most important first, each only with enough "
                             "time left and stopped when the budget ends; the ones left out are named in the "
                             "report (default: no budget)")
    parser.add_argument("--archive", metavar="FILE.tar.gz",
                        help="also pack the results folder into this one file at the end (also when stopped by "
                             "SIGTERM/SIGINT)")
    parser.add_argument("--only", metavar="PATTERNS",
                        help="run only the steps whose names match one of these comma-separated shell patterns, in "
                             "the usual order (names as in gpu-check.md: 'attention kernels', 'gpu tests', "
                             "'base-seq512-bf16-triton-mb64', ...), e.g. --only 'attention kernels,*-mb*': "
                             "a short lease spent on what is new")
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="no GPU needed: the benchmark part only, on the CPU at the tiny preset (seq 64, micro "
                             "batch 4, fp32, one warm-up and one timed step), to check the tooling and the report")
    args = parser.parse_args(argv)
    if args.budget_seconds is not None and not args.budget_seconds > REPORT_SECONDS:
        parser.error(f"--budget-seconds {args.budget_seconds:g}: give more than {REPORT_SECONDS} seconds "
                     "(kept back for the report)")
    problem = (archive_problem(args.archive) if args.archive else None) or (
        None if args.cpu_dry_run else cuda_problem())
    if problem:
        print(problem, file=sys.stderr)
        return 2 if args.archive and problem.startswith("--archive") else 1
    import torch

    sys.path.insert(0, str(REPO_ROOT))
    from megatron_pmlm.models.flex_attention import flex_capability_problem

    started = time.time()
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    output_dir = Path(args.output_dir) / stamp
    output_dir.mkdir(parents=True, exist_ok=True)
    if args.cpu_dry_run:
        device = {"name": f"CPU dry run ({os.cpu_count()} cores)", "capability": "-", "torch": torch.__version__,
                  "cuda": None, "count": 0}
        shapes, precisions, backends, preferred, preset, accelerator = DRY_RUN_SHAPES, ("fp32",), ("sdpa",), "fp32", \
            "tiny", "cpu"
        iterations, warmup, notes = 1, 1, ["--cpu-dry-run: the tooling checked on the CPU; no figure here is a GPU's"]
        kernel_problem = "--cpu-dry-run"
    else:
        capability = ".".join(map(str, torch.cuda.get_device_capability()))
        device = {"name": torch.cuda.get_device_name(), "capability": capability, "torch": torch.__version__,
                  "cuda": torch.version.cuda, "count": torch.cuda.device_count()}
        flex_problem = flex_capability_problem("cuda")
        bf16 = torch.cuda.is_bf16_supported()
        shapes, backends, preset, accelerator = BENCH_SHAPES, ("sdpa",) if flex_problem else ("sdpa", "flex"), \
            "base", "cuda"
        precisions = PRECISIONS if bf16 else tuple(p for p in PRECISIONS if p != "bf16")
        preferred, iterations, warmup, notes = "bf16" if bf16 else "fp16", args.iterations, args.warmup, []
        if flex_problem:
            notes.append(f"flex not run: {flex_problem}")
        from megatron_pmlm.models.bucket_attention import device_problem

        kernel_problem = device_problem(torch.device("cuda"))
        if kernel_problem:
            notes.append(f"triton not run: {kernel_problem}")
        if not bf16:
            notes.append("bf16 not run: this GPU has no bf16 support")
    report = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device, "preset": preset,
              "budget_seconds": args.budget_seconds, "environment": environment_settings(),
              "peaks": {} if args.cpu_dry_run else device_peaks(device["name"], precisions),
              "tests": None, "bench": [], "not_run": [], "not_run_reason": "", "notes": notes}
    for precision, peak in report["peaks"].items():
        print(f"gpu-check: {precision} peak {peak['tflops']} TFLOP/s ({peak['source']})", flush=True)
    print(f"gpu-check: {device['name']} (SM {device['capability']}); results go to {output_dir}", flush=True)

    def seconds_left() -> float:
        if args.budget_seconds is None:
            return float("inf")
        return args.budget_seconds - REPORT_SECONDS - (time.time() - started)

    def step_name(step: dict) -> str:
        return {"tests": "gpu tests", "attention": "attention kernels"}.get(step["kind"]) or bench_name(step, preset)

    def budget_spent(name: str) -> None:
        report["not_run"].append(name)
        report["not_run_reason"] = f"the budget of {args.budget_seconds:.0f} s was spent"

    steps: list[dict] = []
    triton_env: dict[str, str] = {}  # the triton kernels' launch for the rows after the attention step
    stopped_by = None
    previous_handlers = {signum: signal.signal(signum, _stop) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        if not args.skip_bench:
            compile_rows = bench_has_compile()
            if not compile_rows:
                report["notes"].append("--compile rows not run: tools/bench_train.py has no --compile flag in this "
                                       "version")
            steps += bench_plan(shapes, precisions, backends, preferred, compile_rows,
                                () if args.cpu_dry_run else LARGE_BATCH_SHAPES,
                                () if args.cpu_dry_run else ACCUMULATION_SHAPES,
                                () if kernel_problem else ("triton",))
            steps.append({"kind": "attention", "priority": ATTENTION_PRIORITY,
                          "shapes": DRY_RUN_ATTENTION_SHAPES if args.cpu_dry_run else ATTENTION_KERNEL_SHAPES})
        if not args.skip_tests and not args.cpu_dry_run:
            steps.append({"kind": "tests", "priority": TESTS_PRIORITY})
        steps.sort(key=lambda step: step["priority"])
        if args.only:
            patterns = [pattern.strip() for pattern in args.only.split(",") if pattern.strip()]
            kept = [step for step in steps if any(fnmatch.fnmatchcase(step_name(step), p) for p in patterns)]
            report["notes"].append(f"--only {args.only}: {len(kept)} of {len(steps)} steps ("
                                   + ", ".join(map(step_name, kept)) + ")")
            print(f"gpu-check: --only {args.only}: " + (", ".join(map(step_name, kept)) or "no step matches"),
                  flush=True)
            if not kept:
                print(f"gpu-check: --only {args.only} matches none of: " + ", ".join(map(step_name, steps)),
                      file=sys.stderr)
                if not any(output_dir.iterdir()):
                    output_dir.rmdir()  # nothing ran: no empty results folder left behind
                return 2
            steps = kept
        for step in steps:
            name, left = step_name(step), seconds_left()
            if left < minimum_seconds(step):
                budget_spent(name)
                print(f"gpu-check: {name} not run: {left:.0f} s of the budget left", flush=True)
                continue
            if step["kind"] == "tests":
                print("gpu-check: pytest -m gpu tests/test_gpu.py ...", flush=True)
                timeout = min(600, left)
                report["tests"] = run_tests(output_dir, timeout)
                if report["tests"]["returncode"] == 124 and timeout == left:
                    report["tests"]["budget_stopped"] = True
                    budget_spent(f"{name} (stopped when the budget ran out)")
                print(f"gpu-check: tests {'passed' if report['tests']['passed'] else 'FAILED'}: "
                      f"{report['tests']['summary']}", flush=True)
            elif step["kind"] == "attention":
                print(f"gpu-check: attention kernels at {step['shapes']} ...", flush=True)
                timeout = min(args.timeout, left)
                attention = run_attention_kernels(output_dir, step["shapes"], preset, iterations, warmup, timeout,
                                                  accelerator)
                if attention["returncode"] == 124 and timeout == left:
                    attention["budget_stopped"] = True
                    budget_spent(f"{name} (stopped when the budget ran out)")
                report["attention"] = attention
                print("gpu-check: attention kernels: " + ("done" if attention["ok"] else attention["error"][:300])
                      + f" ({attention['seconds']:.0f} s)", flush=True)
                fastest = fastest_triton_launch(attention.get("figures"))
                if fastest:
                    from megatron_pmlm.models.bucket_attention import KERNEL_SHAPES_ENV
                    from megatron_pmlm.models.launch_tuning import TUNED_LAUNCH

                    report["triton_launch"] = fastest
                    if fastest["launch"] != TUNED_LAUNCH:  # the tuned row won: the rows tune as it did
                        triton_env[KERNEL_SHAPES_ENV] = fastest["launch"]
                    print(f"gpu-check: the triton rows that follow launch {fastest['launch']} (the fastest of "
                          f"{len(fastest['ms'])} in the attention table)", flush=True)
            else:
                timeout = min(args.timeout * (2 if step["real"] else 1), left)
                row = run_bench(output_dir, step, iterations, warmup, timeout, preset, accelerator,
                                triton_env if step["backend"] == "triton" else None)
                if not row["ok"] and row["error"].startswith("exit code 124") and timeout == left:
                    row["error"] = f"stopped when the budget ran out ({left:.0f} s left when it started)"
                    row["budget_stopped"] = True
                    budget_spent(f"{name} (stopped when the budget ran out)")
                report["bench"].append(row)
                figures = row.get("figures", {})
                print(f"gpu-check: {row['name']}: " + (
                    f"{figures['tokens_per_sec']:,.0f} tokens/s, {figures['model_tflops']:.1f} TFLOP/s, MFU "
                    + (f"{figures['mfu']:.1%}" if figures.get("mfu") is not None else "?")
                    if row["ok"] else row["error"][:300]) + f" ({row['seconds']:.0f} s)", flush=True)
                real = figures.get("deepspeed", {})
                if "skipped" in real:
                    report["notes"].append(f"{row['name']}: pretrain's step skipped: {real['skipped']}")
            write_report(output_dir, report, started)
    except Stopped as stopped:
        stopped_by = str(stopped)
        report["notes"].append(f"stopped by {stopped_by} after {time.time() - started:.0f} s")
        done = ({row["name"] for row in report["bench"]} | ({"gpu tests"} if report["tests"] else set())
                | ({"attention kernels"} if report.get("attention") else set()))
        report["not_run"] += [name for name in map(step_name, steps)
                              if name not in done and name not in report["not_run"]]
        report["not_run_reason"] = report["not_run_reason"] or f"stopped by {stopped_by}"
        print(f"gpu-check: stopped by {stopped_by}", file=sys.stderr, flush=True)
    finally:
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
    write_report(output_dir, report, started)
    json_path, md_path = output_dir / "gpu-check.json", output_dir / "gpu-check.md"
    print(markdown(report))
    if args.archive:
        write_archive(output_dir, Path(args.archive))
        print(f"gpu-check: results packed into {args.archive}")
    print(f"gpu-check: results in {json_path} and {md_path} ({report['seconds']:.0f} s)")
    tests = report["tests"]
    attention = report.get("attention")
    failed = stopped_by is not None or (tests is not None and not tests["passed"] and not tests.get("budget_stopped")) or any(
        not r["ok"] and not r.get("budget_stopped") for r in report["bench"]) or (
        attention is not None and not attention["ok"] and not attention.get("budget_stopped"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
