#!/usr/bin/env python
"""What the pipeline stages send each other, counted on any machine (the CPU too).

    python tools/bench_pipeline_traffic.py --nproc 2 -- --data-path SAMPLES_DIR --preset tiny \
        --micro-batch-size 8 --global-batch-size 32 --train-iters 2 --pipeline-model-parallel-size 2
    python tools/bench_pipeline_traffic.py --nproc 2 --json traffic.json -- ... --attention-backend flex

Starts `pretrain` with the arguments after `--` on `--nproc` processes (torchrun, DS_ACCELERATOR=cpu
unless set) and counts every tensor DeepSpeed's pipeline sends (`deepspeed.runtime.pipe.p2p.send`:
the activations forward, their gradients back, `dynamic_shape`'s shape messages, the loss). Per
rank: bytes and sends in all and per micro batch, and the largest tensors sent by shape and dtype.
A stage boundary should carry the hidden states [B, T, hidden] and small layout tensors, never a
[B, heads, T, T] attention bias (docs/benchmarks.md, "Pipeline stages: what crosses between them").
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

LARGEST_SHAPES = 5
"""Distinct (shape, dtype) of the most bytes listed per rank."""


def count_sends(report_dir: Path) -> None:
    """In a training process: wrap DeepSpeed's p2p send and write this rank's counts at exit."""
    from megatron_pmlm.parallel.deepspeed_import import import_deepspeed

    import_deepspeed()
    import deepspeed.runtime.pipe.p2p as p2p

    sent: Counter = Counter()
    by_shape: Counter = Counter()
    original = p2p.send

    def send(tensor, dest_stage, async_op=False):
        size = tensor.numel() * tensor.element_size()
        sent["bytes"] += size
        sent["sends"] += 1
        by_shape[(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))] += size
        return original(tensor, dest_stage, async_op)

    p2p.send = send  # the engine calls p2p.send through the module, so this reaches every send

    def write() -> None:
        rank = int(os.environ.get("RANK", "0"))
        largest = [{"shape": list(shape), "dtype": dtype, "bytes": size}
                   for (shape, dtype), size in by_shape.most_common(LARGEST_SHAPES)]
        (report_dir / f"rank-{rank}.json").write_text(json.dumps(
            {"rank": rank, "bytes": sent["bytes"], "sends": sent["sends"], "largest": largest}))

    atexit.register(write)


def micro_batches_per_rank(pretrain_argv: list[str], nproc: int) -> int:
    """Micro batches each stage runs: iterations x global batch / (micro batch x data-parallel size)."""
    from megatron_pmlm.pretrain import build_parser

    args = build_parser().parse_args(pretrain_argv)
    model_parallel = args.pipeline_model_parallel_size * args.tensor_model_parallel_size
    if nproc % model_parallel:
        raise SystemExit(f"--nproc {nproc} is not a multiple of the pipeline x tensor size {model_parallel}")
    if args.global_batch_size is None:
        raise SystemExit("give pretrain's --global-batch-size after --, so the micro batches can be counted")
    data_parallel = nproc // model_parallel
    return args.train_iters * args.global_batch_size // (args.micro_batch_size * data_parallel)


def launch(nproc: int, pretrain_argv: list[str]) -> dict:
    micro_batches = micro_batches_per_rank(pretrain_argv, nproc)
    with tempfile.TemporaryDirectory(prefix="pipeline-traffic-") as report_dir:
        env = {**os.environ, "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                   str(Path(__file__).resolve()), "--worker", report_dir, "--", *pretrain_argv]
        result = subprocess.run(command, env=env)
        if result.returncode:
            raise SystemExit(f"pretrain exited with {result.returncode}")
        ranks = sorted((json.loads(path.read_text()) for path in Path(report_dir).glob("rank-*.json")),
                       key=lambda rank: rank["rank"])
    for rank in ranks:
        rank["bytes_per_micro_batch"] = rank["bytes"] / micro_batches
        rank["sends_per_micro_batch"] = rank["sends"] / micro_batches
    return {"micro_batches_per_rank": micro_batches, "pretrain_args": pretrain_argv, "ranks": ranks}


def print_report(report: dict) -> None:
    print(f"micro batches per rank: {report['micro_batches_per_rank']}")
    print("| rank | bytes sent | per micro batch | sends per micro batch | largest tensors sent (shape dtype: bytes) |")
    print("|---|---:|---:|---:|---|")
    for rank in report["ranks"]:
        largest = "; ".join(f"{entry['shape']} {entry['dtype']}: {entry['bytes']:,}" for entry in rank["largest"])
        print(f"| {rank['rank']} | {rank['bytes']:,} | {rank['bytes_per_micro_batch']:,.0f} | "
              f"{rank['sends_per_micro_batch']:.1f} | {largest} |")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours, pretrain_argv = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     usage="%(prog)s [--nproc N] [--json FILE] -- PRETRAIN_ARGS...")
    parser.add_argument("--nproc", type=int, default=2, help="processes (default 2: two pipeline stages)")
    parser.add_argument("--json", help="also write the figures here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # inside torchrun: count, then run pretrain
    args = parser.parse_args(ours)
    if args.worker:
        count_sends(Path(args.worker))
        from megatron_pmlm.pretrain import main as pretrain_main

        return pretrain_main(pretrain_argv)
    if not pretrain_argv:
        parser.error("give pretrain's arguments after --")
    if args.nproc < 2:
        parser.error(f"--nproc {args.nproc}: a pipeline needs at least 2 processes")
    from megatron_pmlm.files import check_output, write_json_atomically

    if args.json:
        check_output(args.json, "--json")  # before minutes of training, not after
    report = launch(args.nproc, pretrain_argv)
    print_report(report)
    if args.json:
        write_json_atomically(args.json, report, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
