#!/usr/bin/env python
"""`make gpu-check`: what to run when a GPU is lent: the `gpu` tests, then tools/bench_train.py at the
base preset, seq 128 and 512, fp16 and bf16, sdpa and flex (flex only at compute capability >= 8.0),
into one JSON and one markdown table (tokens/s, samples/s, TFLOP/s, MFU, peak memory, compilations).

    python tools/gpu_check.py [--output-dir outputs/gpu-check] [--skip-tests] [--skip-bench]

Without a CUDA device it stops at once, saying so in one line (exit 1). Each benchmark runs in its
own process (a fresh CUDA context and peak-memory count); a failing one is recorded and the others
still run. Exit 0 only when the tests pass and every benchmark ran.
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

REPO_ROOT = Path(__file__).resolve().parents[1]
BENCH_SHAPES = ((128, 64), (512, 20))
"""(sequence length, micro batch): seq 128 as NVIDIA's BERT phase 1, seq 512 at the paper's micro
batch per GPU (20 x 6 accumulation steps x 64 GPUs = 7,680)."""
PRECISIONS = ("fp16", "bf16")


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


def run_bench(output_dir: Path, seq_length: int, micro_batch: int, precision: str, backend: str,
              iterations: int, warmup: int, timeout: int) -> dict:
    """One tools/bench_train.py process at the base preset; its figures, or what went wrong."""
    name = f"base-seq{seq_length}-{precision}-{backend}"
    figures_file = output_dir / f"{name}.json"
    command = [sys.executable, str(REPO_ROOT / "tools" / "bench_train.py"), "--preset", "base", "--seq-length",
               str(seq_length), "--micro-batch-size", str(micro_batch), f"--{precision}", "--attention-backend",
               backend, "--iterations", str(iterations), "--warmup", str(warmup), "--json", str(figures_file)]
    row = {"name": name, "seq_length": seq_length, "micro_batch_size": micro_batch, "precision": precision,
           "attention_backend": backend, "command": " ".join(command[1:])}
    started = time.time()
    try:
        result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                                env={**os.environ, "DS_ACCELERATOR": "cuda"})
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


def markdown(report: dict) -> str:
    device = report["device"]
    lines = [f"# gpu-check: {device['name']} (compute capability {device['capability']}), "
             f"torch {device['torch']}, CUDA {device['cuda']}", "",
             f"{report['started']}, {report['seconds']:.0f} s in all. Tests (`pytest -m gpu tests/test_gpu.py`): "
             + (f"{'passed' if report['tests']['passed'] else 'FAILED'}, {report['tests']['summary']} "
                f"({report['tests']['seconds']:.0f} s)" if report["tests"] else "not run"), "",
             "tools/bench_train.py, preset base, model FLOPs (training.recipe.flops_per_token), MFU against the datasheet "
             "dense peak for the precision; first step = compilation included.", "",
             "| seq | micro batch | precision | attention | tokens/s | samples/s | TFLOP/s | MFU | peak memory GB "
             "| layout width (padded) | compilations (recompilations) | first step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["bench"]:
        head = f"| {row['seq_length']} | {row['micro_batch_size']} | {row['precision']} | {row['attention_backend']} |"
        if not row["ok"]:
            lines.append(f"{head} failed: {row['error'][:200].replace('|', '/')} |||||||")
            continue
        f = row["figures"]
        mfu = f"{f['mfu']:.1%}" if f.get("mfu") is not None else "?"
        first = f"{f['first_step_seconds']:.1f}" if f.get("first_step_seconds") is not None else "?"
        lines.append(f"{head} {f['tokens_per_sec']:,.0f} | {f['samples_per_sec']:.1f} | {f['model_tflops']:.1f} | "
                     f"{mfu} | {f['peak_memory_gb']:.1f} | {f['layout_width']} ({f['padded_width']}) | "
                     f"{f['compilations']} ({f['recompilations']}) | {first} |")
    for note in report["notes"]:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/gpu_check.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", default="outputs/gpu-check",
                        help="results go to a new timestamped folder under it")
    parser.add_argument("--skip-tests", action="store_true", help="benchmarks only")
    parser.add_argument("--skip-bench", action="store_true", help="tests only")
    parser.add_argument("--iterations", type=int, default=10, help="timed steps per benchmark")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (compilation among them)")
    parser.add_argument("--timeout", type=int, default=300, help="seconds allowed to each benchmark process")
    args = parser.parse_args(argv)
    problem = cuda_problem()
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
    capability = ".".join(map(str, torch.cuda.get_device_capability()))
    flex_problem = flex_capability_problem("cuda")
    backends = ("sdpa",) if flex_problem else ("sdpa", "flex")
    bf16 = torch.cuda.is_bf16_supported()
    report = {"started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": {"name": torch.cuda.get_device_name(), "capability": capability, "torch": torch.__version__,
                         "cuda": torch.version.cuda, "count": torch.cuda.device_count()},
              "tests": None, "bench": [], "notes": []}
    if flex_problem:
        report["notes"].append(f"flex not run: {flex_problem}")
    if not bf16:
        report["notes"].append("bf16 not run: this GPU has no bf16 support")
    print(f"gpu-check: {report['device']['name']} (SM {capability}); results go to {output_dir}", flush=True)
    if not args.skip_tests:
        print("gpu-check: pytest -m gpu tests/test_gpu.py ...", flush=True)
        report["tests"] = run_tests(output_dir, timeout=600)
        print(f"gpu-check: tests {'passed' if report['tests']['passed'] else 'FAILED'}: {report['tests']['summary']}",
              flush=True)
    if not args.skip_bench:
        for seq_length, micro_batch in BENCH_SHAPES:
            for precision in PRECISIONS:
                if precision == "bf16" and not bf16:
                    continue
                for backend in backends:
                    row = run_bench(output_dir, seq_length, micro_batch, precision, backend, args.iterations,
                                    args.warmup, args.timeout)
                    report["bench"].append(row)
                    figures = row.get("figures", {})
                    print(f"gpu-check: {row['name']}: " + (
                        f"{figures['tokens_per_sec']:,.0f} tokens/s, {figures['model_tflops']:.1f} TFLOP/s, MFU "
                        + (f"{figures['mfu']:.1%}" if figures.get("mfu") is not None else "?")
                        if row["ok"] else row["error"][:300]) + f" ({row['seconds']:.0f} s)", flush=True)
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
