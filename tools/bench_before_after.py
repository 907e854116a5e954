#!/usr/bin/env python
"""One training step of this checkout against another revision's, on the same machine in one run:
seconds per step and the CPU proxies of issue 33 (host syncs of our code, kernels, attention-bias
bytes), each tree measured with THIS checkout's counters.

    python tools/bench_before_after.py --baseline 9982ca5                    # base, seq 128, micro batch 4
    python tools/bench_before_after.py --baseline 9982ca5 --seq-length 512 --micro-batch-size 2 --json ba.json

The baseline revision is checked out with `git worktree add` into a temporary folder (removed at
the end). Each tree runs in its own process, importing its own `megatron_pmlm` and its own
`tools/bench_train.py` (the same random examples and masks, built by each tree's own batch code);
the counters (`training/host_syncs.py`, `training/kernel_count.py`, `models/relative_bias.py`'s
`bias_bytes_per_step`) are loaded from this checkout by file path, so both trees are counted the
same way. A step: forward + backward + AdamW over one micro batch, fp32, dropout 0, eager (this
checkout also with `--compile` where it has it: every region of the step compiled), torch's fused
AdamW (one kernel, as on CUDA; before 2026-11-26 the default per-parameter one). Times are the
median of --iterations after --warmup, the trees' steps interleaved round by round, one process
running at a time, so a busy machine slows them alike.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COUNTERS = {"host_syncs": "megatron_pmlm/training/host_syncs.py",
            "kernel_count": "megatron_pmlm/training/kernel_count.py",
            "relative_bias": "megatron_pmlm/models/relative_bias.py"}


def _load_counter(name: str):
    spec = importlib.util.spec_from_file_location(f"_counters_{name}", REPO / COUNTERS[name])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_tree(root: str, preset: str, seq_length: int, micro_batch: int, seed: int, compile_layers: bool,
                 rounds: int, warmup: int, control) -> dict:
    """Run inside the child process: the step of the tree at `root`, timed when `control` says go."""
    sys.path.insert(0, root)
    sys.path.insert(0, str(Path(root) / "tools"))
    import torch

    import bench_train  # the tree's own examples and batches
    from megatron_pmlm.config import model_config_from_preset
    from megatron_pmlm.models.model import PMLMForPreTraining

    torch.manual_seed(seed)
    config = model_config_from_preset(preset, hidden_dropout=0.0, attention_dropout=0.0)
    model = PMLMForPreTraining(config, "ae+par", init_seed=seed).train()
    if compile_layers:  # as --compile does: every region of the step
        from megatron_pmlm.models.compiled import compile_step_regions

        _load_counter("kernel_count").prepare_compiled_counting()  # before compiling: kernels seen by the profiler
        compile_step_regions(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # as bench_train: the step a GPU runs
    batch = bench_train.pmlm_batch(bench_train.make_examples(micro_batch, seq_length, config.vocab_size, seed))

    def step():
        model(*batch.as_tuple()).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    import time

    for _ in range(warmup):
        step()
    times = []
    for _ in range(rounds):
        control()
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    control()  # the counting below runs alone too
    host_syncs, kernel_count, relative_bias = (_load_counter(name) for name in COUNTERS)
    with host_syncs.HostSyncCounter() as syncs:
        step()
    figures = {"root": root, "layout_width": int(batch.input_ids.shape[1]), "seconds_per_step": statistics.median(times),
               "times": times, "host_syncs_per_step": syncs.count("ours"), "host_syncs": syncs.report("ours")}
    figures["kernels_per_step"] = kernel_count.count_kernels(step, compiled=compile_layers)
    from megatron_pmlm.models.flex_attention import default_layout_quantum  # the tree's own
    from megatron_pmlm.models.layout import padded_width

    quantum = model.bert.layout_quantum or default_layout_quantum(config.attention_backend, batch.input_ids.device)
    bias = relative_bias.bias_bytes_per_step(model, batch, width=padded_width(batch.input_ids.shape[1], quantum))
    figures["bias_bytes_per_step"] = bias["bias_bytes"]
    figures["sdpa_pad_bytes_per_step"] = bias["sdpa_pad_bytes"]
    return figures


def _child(argv: list[str]) -> int:
    """`--child ROOT COMPILE SETTINGS_JSON`: measure, pacing each timed step on a line from standard
    input. Nothing of this checkout's package is imported before the tree's own is on the path."""
    root, compile_layers, settings = argv[0], argv[1] == "1", json.loads(argv[2])
    args = argparse.Namespace(**settings)

    def control():
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            raise SystemExit(1)

    figures = measure_tree(root, args.preset, args.seq_length, args.micro_batch_size, args.seed, compile_layers,
                           args.iterations, args.warmup, control)
    print("RESULT " + json.dumps(figures), flush=True)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from megatron_pmlm.config import HelpFormatter, non_negative_int, positive_int

    parser = argparse.ArgumentParser(prog="python tools/bench_before_after.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--baseline", default="HEAD~1", help="the git revision to compare with")
    parser.add_argument("--preset", default="base", help="tiny, base or large")
    parser.add_argument("--seq-length", type=positive_int, default=128, help="tokens per sample before the appended ones")
    parser.add_argument("--micro-batch-size", type=positive_int, default=4, help="samples per step")
    parser.add_argument("--iterations", type=positive_int, default=5, help="timed steps per tree")
    parser.add_argument("--warmup", type=non_negative_int, default=1, help="untimed steps first (compilation among them)")
    parser.add_argument("--seed", type=non_negative_int, default=1234, help="token ids, masks and weights")
    parser.add_argument("--no-compile", action="store_true", help="skip this checkout's --compile row")
    parser.add_argument("--json", help="also write the figures to this file ('-': standard output)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        return _child(argv[1:])
    # SIGTERM ends the run through its `finally` blocks: the children and the baseline's worktree go too.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    sys.path.insert(0, str(REPO))
    from megatron_pmlm.files import OutputError, check_output, write_json_atomically

    args = build_parser().parse_args(argv)
    try:
        if args.json:
            check_output(args.json, "--json")
    except OutputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    revision = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "--quiet", f"{args.baseline}^{{commit}}"],
                              capture_output=True, text=True)
    if revision.returncode != 0:
        print(f"error: --baseline {args.baseline!r} is not a commit of {REPO}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="pmlm-baseline-") as temporary:
        baseline = Path(temporary) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--quiet", str(baseline),
                        revision.stdout.strip()], check=True)
        try:
            rows = [("baseline " + args.baseline, str(baseline), False), ("this checkout", str(REPO), False)]
            if not args.no_compile and (REPO / "megatron_pmlm" / "models" / "compiled.py").exists():
                rows.append(("this checkout, --compile", str(REPO), True))
            results = run_interleaved(rows, vars(args))
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(baseline)], check=False)
    report(results, args)
    if args.json:
        write_json_atomically(args.json, {"settings": vars(args), "rows": results})
    return 0


def run_interleaved(rows, settings: dict) -> list[dict]:
    """Start one child per row, then release their timed steps round-robin."""
    env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    env.pop("PYTHONPATH", None)
    settings = json.dumps(settings)
    children = [(name, subprocess.Popen([sys.executable, __file__, "--child", root, "1" if compiled else "0", settings],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                                        cwd=root)) for name, root, compiled in rows]
    results: dict[str, dict] = {}

    def next_signal(name, child) -> str:
        """The child's next "ready" (it is idle, waiting for "go") or its RESULT line."""
        for line in child.stdout:
            if line.startswith("ready"):
                return "ready"
            if line.startswith("RESULT "):
                results[name] = json.loads(line[len("RESULT "):])
                return "result"
        child.wait()
        raise RuntimeError(f"{name}: the measuring process failed (exit {child.returncode})")

    try:
        for name, child in children:  # after their (concurrent) warm-up steps
            next_signal(name, child)
        active = list(children)
        while active:  # one child runs at a time: a timed step, or at the end its counting
            for name, child in list(active):
                child.stdin.write("go\n")
                child.stdin.flush()
                if next_signal(name, child) == "result":
                    if child.wait() != 0:
                        raise RuntimeError(f"{name}: the measuring process failed (exit {child.returncode})")
                    active.remove((name, child))
    finally:
        for _, child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
    return [{"row": name, **results[name]} for name, _ in children]


def report(rows: list[dict], args) -> None:
    print(f"{args.preset}, seq {args.seq_length}, micro batch {args.micro_batch_size}, fp32, "
          f"median of {args.iterations} interleaved steps")
    print("| tree | layout width (before padding) | s/step | host syncs (ours) | kernels/step | bias MiB/step | GPU SDPA pad MiB/step |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['row']} | {row['layout_width']} | {row['seconds_per_step']:.3f} | {row['host_syncs_per_step']} | "
              f"{row['kernels_per_step']:,} | {row['bias_bytes_per_step'] / 2**20:,.1f} | "
              f"{row['sdpa_pad_bytes_per_step'] / 2**20:,.1f} |")


if __name__ == "__main__":
    sys.exit(main())
