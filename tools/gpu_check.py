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
syncs, kernels, attention-bias bytes per step), a `--compile` row where bench_train has that flag,
and one step of seq 128 traced by torch.profiler (a Chrome trace file; its top-20 kernels in
gpu-check.md). The MFU peak comes from the exact device name (bench_train.PEAK_TFLOPS), its source
printed.

Without a CUDA device it stops at once, saying so in one line (exit 1); `--cpu-dry-run` instead
runs the benchmark part on the CPU at the tiny preset (seq 64, micro batch 4, fp32, one step) to
check the tooling. Each benchmark runs in its own process (a fresh CUDA context and peak-memory
count); a failing one is recorded and the others still run. Exit 0 only when the tests pass and
every benchmark ran.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_SHAPES = ((128, 64), (512, 20))
"""(sequence length, micro batch): seq 128 as NVIDIA's BERT phase 1, seq 512 at the paper's micro
batch per GPU (20 x 6 accumulation steps x 64 GPUs = 7,680)."""
PRECISIONS = ("fp16", "bf16")
DRY_RUN_SHAPES = ((64, 4),)
"""--cpu-dry-run: the tiny preset at this (sequence length, micro batch), fp32, one timed step."""
TRACED_SEQ_LENGTH = 128
"""The shape whose step is traced (the first shape in a dry run)."""


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


def run_tests(output_dir: Path, timeout: int) -> dict:
    """pytest -m gpu tests/test_gpu.py, its output kept in tests.log."""
    started = time.time()
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "tests/test_gpu.py",
               f"--junitxml={output_dir / 'tests.xml'}"]
    try:
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, "DS_ACCELERATOR": "cuda"})
        output, returncode = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired as expired:
        output, returncode = f"{expired.stdout or ''}\ntimed out after {timeout} s", 124
    (output_dir / "tests.log").write_text(output)
    lines = [line for line in output.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or "failed" in line
                                                                            or "skipped" in line)), lines[-1] if lines else "")
    return {"command": " ".join(command), "returncode": returncode, "passed": returncode == 0,
            "summary": summary.strip("= "), "seconds": time.time() - started, "log": str(output_dir / "tests.log")}


def bench_has_compile() -> bool:
    """Whether tools/bench_train.py takes --compile (its --help lists it)."""
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_train.py"), "--help"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=300)
    return "--compile" in result.stdout


def bench_plan(shapes, precisions: Sequence[str], backends: Sequence[str], preferred: str,
               compile_rows: bool) -> list[dict]:
    """Every bench_train process of a check: the precision x attention rows, the one at the preferred
    precision with sdpa also timing the real path (pretrain's step, Hugging Face; the trace at seq
    128, or at the first shape without one); then per shape the --compile row where bench_train has
    the flag."""
    plan = []
    traced_length = TRACED_SEQ_LENGTH if any(shape[0] == TRACED_SEQ_LENGTH for shape in shapes) else shapes[0][0]
    for seq_length, micro_batch in shapes:
        for precision in precisions:
            for backend in backends:
                real = precision == preferred and backend == "sdpa"
                plan.append({"seq_length": seq_length, "micro_batch": micro_batch, "precision": precision,
                             "backend": backend, "kind": "eager", "real": real,
                             "flags": ["--deepspeed", "--huggingface"] if real else [],
                             "traced": real and seq_length == traced_length})
        if compile_rows:
            plan.append({"seq_length": seq_length, "micro_batch": micro_batch, "precision": preferred, "backend": "sdpa",
                         "kind": "compile", "real": False, "flags": ["--compile"], "traced": False})
    return plan


def run_bench(output_dir: Path, spec: dict, iterations: int, warmup: int, timeout: int, preset: str = "base",
              accelerator: str = "cuda") -> dict:
    """One tools/bench_train.py process; its figures, or what went wrong."""
    seq_length, micro_batch, precision, backend = (spec["seq_length"], spec["micro_batch"], spec["precision"],
                                                   spec["backend"])
    name = f"{preset}-seq{seq_length}-{precision}-{backend}" + ("" if spec["kind"] == "eager" else f"-{spec['kind']}")
    figures_file = output_dir / f"{name}.json"
    command = [sys.executable, str(REPO_ROOT / "tools" / "bench_train.py"), "--preset", preset, "--seq-length",
               str(seq_length), "--micro-batch-size", str(micro_batch), *([f"--{precision}"] if precision != "fp32"
                                                                         else []),
               "--attention-backend", backend, "--iterations", str(iterations), "--warmup", str(warmup),
               "--json", str(figures_file), *spec["flags"]]
    if spec.get("traced"):
        command += ["--profile-trace", str(output_dir / f"{name}.trace.json")]
    row = {"name": name, "seq_length": seq_length, "micro_batch_size": micro_batch, "precision": precision,
           "attention_backend": backend, "kind": spec["kind"], "command": " ".join(command[1:])}
    started = time.time()
    try:
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, "DS_ACCELERATOR": accelerator})
        output, returncode = result.stdout + result.stderr, result.returncode
    except subprocess.TimeoutExpired as expired:
        output, returncode = f"{expired.stdout or ''}\ntimed out after {timeout} s", 124
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
    host = f"{figures['host_ms_per_step']:,.1f}" if "host_ms_per_step" in figures else "?"
    return (f"{figures['host_syncs_per_step']} ({figures['host_syncs_all_owners']}) | {figures['kernels_per_step']:,} "
            f"| {figures['bias_bytes_per_step'] / 2**20:,.1f} | {host}")


def markdown(report: dict) -> str:
    device = report["device"]
    lines = [f"# gpu-check: {device['name']} (compute capability {device['capability']}), "
             f"torch {device['torch']}, CUDA {device['cuda']}", "",
             f"{report['started']}, {report['seconds']:.0f} s in all. Tests (`pytest -m gpu tests/test_gpu.py`): "
             + (f"{'passed' if report['tests']['passed'] else 'FAILED'}, {report['tests']['summary']} "
                f"({report['tests']['seconds']:.0f} s)" if report["tests"] else "not run"), ""]
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
                  "| seq | micro batch | precision | vocabulary | tokens/s | samples/s | TFLOP/s | MFU | bare-model MFU "
                  "| real / bare step time | host syncs | kernels | peak memory GB |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in real_rows:
            f, real = row["figures"], row["figures"].get("deepspeed", {})
            head = f"| {row['seq_length']} | {row['micro_batch_size']} |"
            if "seconds_per_step" not in real:
                lines.append(f"{head} skipped: {real.get('skipped', 'no figures')} |||||||||||")
                continue
            lines.append(f"{head} {real['precision']} | {real['padded_vocab_size']:,} | {real['tokens_per_sec']:,.0f} | "
                         f"{real['samples_per_sec']:.1f} | {real['model_tflops']:.1f} | {_percent(real['mfu'])} | "
                         f"{_percent(f.get('mfu'))} | {real['seconds_per_step'] / f['seconds_per_step']:.2f} | "
                         f"{real['host_syncs_per_step']} ({real['host_syncs_all_owners']}) | "
                         f"{real['kernels_per_step']:,} | "
                         + (f"{real['peak_memory_gb']:.1f} |" if real.get("peak_memory_gb") is not None else "? |"))
        lines += ["", "## Hugging Face BertForMaskedLM (sdpa, same size, precision and micro batch)", "",
                  "Forward + backward + AdamW per step; ours = the bare-model step above; ratio = ours / theirs "
                  "(below 1: ours is faster).", "",
                  "| seq | micro batch | precision | ours ms | HF at seq ms (ratio) | HF at our width T ms (ratio) "
                  "| HF, head on masked positions only, ms (ratio) |", "|---|---|---|---|---|---|---|"]
        for row in real_rows:
            f = row["figures"]
            cells = {hf["name"]: f"{hf['seconds_per_step'] * 1e3:.1f} ({hf['ours_over_theirs']:.2f})"
                     + (f", T = {hf['length']}" if hf["name"] == "hf-width" else "")
                     for hf in f.get("huggingface", [])}
            lines.append(f"| {row['seq_length']} | {row['micro_batch_size']} | {row['precision']} | "
                         f"{f['seconds_per_step'] * 1e3:.1f} | {cells.get('hf-seq', '?')} | {cells.get('hf-width', '?')} "
                         f"| {cells.get('hf-seq-masked-head', '?')} |")
        for row in real_rows:
            f = row["figures"]
            if not f.get("top_kernels"):
                continue
            unit = "self CUDA time" if device["cuda"] else "self CPU time"
            lines += ["", f"## Top {len(f['top_kernels'])} kernels of one step (seq {row['seq_length']}, micro batch "
                      f"{row['micro_batch_size']}, {row['precision']}, by {unit}; trace: {f['profile_trace']})", "",
                      "| kernel | calls | ms |", "|---|---|---|"]
            lines += [f"| `{kernel['name'][:120].replace('|', '/')}` | {kernel['calls']} | {kernel['self_us'] / 1e3:.2f} |"
                      for kernel in f["top_kernels"]]
    for note in report["notes"]:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def device_peaks(name: str, precisions: Sequence[str]) -> dict:
    """{precision: {"tflops", "source"}} from bench_train's table of exact device names."""
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    from bench_train import peak_from_device_name

    return {precision: dict(zip(("tflops", "source"), peak_from_device_name(name, precision)))
            for precision in precisions}


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
    parser.add_argument("--cpu-dry-run", action="store_true",
                        help="no GPU needed: the benchmark part only, on the CPU at the tiny preset (seq 64, micro "
                             "batch 4, fp32, one warm-up and one timed step), to check the tooling and the report")
    args = parser.parse_args(argv)
    problem = None if args.cpu_dry_run else cuda_problem()
    if problem:
        print(problem, file=sys.stderr)
        return 1
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
        if not bf16:
            notes.append("bf16 not run: this GPU has no bf16 support")
    report = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "device": device, "preset": preset,
              "peaks": {} if args.cpu_dry_run else device_peaks(device["name"], precisions),
              "tests": None, "bench": [], "notes": notes}
    for precision, peak in report["peaks"].items():
        print(f"gpu-check: {precision} peak {peak['tflops']} TFLOP/s ({peak['source']})", flush=True)
    print(f"gpu-check: {device['name']} (SM {device['capability']}); results go to {output_dir}", flush=True)
    if not args.skip_tests and not args.cpu_dry_run:
        print("gpu-check: pytest -m gpu tests/test_gpu.py ...", flush=True)
        report["tests"] = run_tests(output_dir, timeout=600)
        print(f"gpu-check: tests {'passed' if report['tests']['passed'] else 'FAILED'}: {report['tests']['summary']}",
              flush=True)
    if not args.skip_bench:
        compile_rows = bench_has_compile()
        if not compile_rows:
            report["notes"].append("--compile rows not run: tools/bench_train.py has no --compile flag in this version")
        for spec in bench_plan(shapes, precisions, backends, preferred, compile_rows):
            timeout = args.timeout * (2 if spec["real"] else 1)
            row = run_bench(output_dir, spec, iterations, warmup, timeout, preset, accelerator)
            report["bench"].append(row)
            figures = row.get("figures", {})
            print(f"gpu-check: {row['name']}: " + (
                f"{figures['tokens_per_sec']:,.0f} tokens/s, {figures['model_tflops']:.1f} TFLOP/s, MFU "
                + (f"{figures['mfu']:.1%}" if figures.get("mfu") is not None else "?")
                if row["ok"] else row["error"][:300]) + f" ({row['seconds']:.0f} s)", flush=True)
            real = figures.get("deepspeed", {})
            if "skipped" in real:
                report["notes"].append(f"{row['name']}: pretrain's step skipped: {real['skipped']}")
    report["seconds"] = time.time() - started
    json_path, md_path = output_dir / "gpu-check.json", output_dir / "gpu-check.md"
    json_path.write_text(json.dumps(report, indent=1))
    md_path.write_text(markdown(report))
    print(markdown(report))
    print(f"gpu-check: results in {json_path} and {md_path} ({report['seconds']:.0f} s)")
    failed = (report["tests"] is not None and not report["tests"]["passed"]) or any(not r["ok"] for r in report["bench"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
