"""Padding in the training grids: `python tools/bench_padding.py SAMPLES_DIR [--micro-batch-sizes 20,8]
[--global-batch-sizes 80,160,320] [--objective ae+par]`.

Iterates one epoch of the training loader (`megatron_pmlm.data.build_pretraining_loaders`) per
(micro batch, global batch) and reports the padding share of the [micro batch, T] grids, weighted
by grid size (padding cells / all cells), without length bucketing and with it for each global
batch size. Figures go to docs/benchmarks.md; nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from megatron_pmlm.data import build_pretraining_loaders  # noqa: E402
from megatron_pmlm.layout import PAD  # noqa: E402


def padding_share(samples_dir: str, micro_batch_size: int, global_batch_size: int | None, objective: str) -> tuple[float, int]:
    """(grid-weighted padding share, micro batches) over one epoch."""
    loaders = build_pretraining_loaders(samples_dir, micro_batch_size=micro_batch_size, objective=objective,
                                        global_batch_size=global_batch_size)
    count = loaders.train.sampler.samples_per_epoch // micro_batch_size
    padding = cells = 0
    for _ in range(count):
        roles = next(loaders.train).roles
        padding += int((roles == PAD).sum())
        cells += roles.numel()
    return padding / cells, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/bench_padding.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("samples_dir", help="a data_prep.build_samples output directory")
    parser.add_argument("--micro-batch-sizes", default="20,8")
    parser.add_argument("--global-batch-sizes", default="80,160,320")
    parser.add_argument("--objective", default="ae+par")
    args = parser.parse_args(argv)
    micros = [int(v) for v in args.micro_batch_sizes.split(",")]
    globals_ = [int(v) for v in args.global_batch_sizes.split(",")]
    print("| micro batch | no bucketing | " + " | ".join(f"global batch {g}" for g in globals_) + " |")
    print("|---" * (len(globals_) + 2) + "|")
    for micro in micros:
        cells = []
        for global_batch in [None, *globals_]:
            if global_batch is not None and global_batch % micro:
                cells.append("-")
                continue
            share, count = padding_share(args.samples_dir, micro, global_batch, args.objective)
            cells.append(f"{share:.1%} ({count} micro batches)")
        print(f"| {micro} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
