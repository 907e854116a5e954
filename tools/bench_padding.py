"""Padding in the training grids: `python tools/bench_padding.py SAMPLES_DIR [--micro-batch-sizes 20,8]
[--global-batch-sizes 80,160,320] [--objective ae+par] [--quanta 1,16,32,64,128 | --attention-tiles]`.

Iterates one epoch of the training loader (`megatron_pmlm.data.build_pretraining_loaders`) per
(micro batch, global batch) and reports the padding share of the [micro batch, T] grids, weighted
by grid size (padding cells / all cells), without length bucketing and with it for each global
batch size.

With --attention-tiles: the share of the query-key pairs that the attention rule lets be seen, and
the share of the tiles (`models/bucket_attention.tile_lists`, the forward's tiles) that hold one: the part of
the [T, T] grid the triton backend's kernels compute (they skip the others), against the whole grid
that a dense-bias kernel walks.

With --quanta: what padding the layout width T to a multiple of each quantum costs (the flex
backend on CUDA does, so its compiled kernels see few shapes): the cells added over the unpadded
grids, the padding share, and how many distinct widths (= compilations of the flex kernel) one
epoch shows, per micro batch with bucketing at the first global batch size. Figures go to
docs/benchmarks.md; nothing here is a test.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from megatron_pmlm.config import positive_int  # noqa: E402
from megatron_pmlm.data import build_pretraining_loaders  # noqa: E402
from megatron_pmlm.models.layout import PAD, padded_width  # noqa: E402


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


def attention_tile_shares(samples_dir: str, micro_batch_size: int, global_batch_size: int | None,
                          objective: str) -> tuple[float, float, int]:
    """(share of the query-key pairs the attention rule allows, share of the tiles that hold one,
    micro batches) over one epoch, both weighted by grid size."""
    from megatron_pmlm.models import bucket_attention
    from megatron_pmlm.models.layout import pmlm_attention_allowed

    loaders = build_pretraining_loaders(samples_dir, micro_batch_size=micro_batch_size, objective=objective,
                                        global_batch_size=global_batch_size)
    count = loaders.train.sampler.samples_per_epoch // micro_batch_size
    allowed_pairs = pairs = listed = tiles = 0
    for _ in range(count):
        batch = next(loaders.train)
        allowed = pmlm_attention_allowed(batch.roles, batch.steps)  # every objective's rule (roles, steps)
        lists = bucket_attention.tile_lists(bucket_attention.attention_codes(None, allowed)).key_tiles
        allowed_pairs += int(allowed.sum())
        pairs += allowed.numel()
        listed += int(lists[..., 0].sum())
        tiles += lists[..., 1:].numel()
    return allowed_pairs / pairs, listed / tiles, count


def tiles_table(samples_dir: str, micros: list[int], globals_: list[int], objective: str) -> None:
    from megatron_pmlm.models.bucket_attention import FORWARD_SHAPE

    print(f"objective {objective}, tiles of {FORWARD_SHAPE.block_queries} x {FORWARD_SHAPE.block_keys} pairs")
    print("| micro batch | global batch | micro batches | pairs allowed | tiles computed |")
    print("|---|---|---|---|---|")
    for micro in micros:
        for global_batch in globals_ or [None]:
            if global_batch is not None and global_batch % micro:
                continue
            allowed, computed, count = attention_tile_shares(samples_dir, micro, global_batch, objective)
            print(f"| {micro} | {global_batch or 'none'} | {count} | {allowed:.1%} | {computed:.1%} |")


def epoch_widths(samples_dir: str, micro_batch_size: int, global_batch_size: int | None,
                 objective: str, epochs: int = 1) -> tuple[list[int], int]:
    """(layout width T of every micro batch, real tokens) over `epochs` epochs (each its own shuffle)."""
    loaders = build_pretraining_loaders(samples_dir, micro_batch_size=micro_batch_size, objective=objective,
                                        global_batch_size=global_batch_size)
    widths, tokens = [], 0
    for _ in range(epochs * (loaders.train.sampler.samples_per_epoch // micro_batch_size)):
        roles = next(loaders.train).roles
        widths.append(int(roles.shape[1]))
        tokens += int((roles != PAD).sum())
    return widths, tokens


def quantum_table(samples_dir: str, micros: list[int], global_batch: int | None, objective: str,
                  quanta: list[int], epochs: int) -> None:
    print(f"objective {objective}, global batch {global_batch or 'none (no bucketing)'}, {epochs} epoch(s)")
    print("| micro batch | quantum | distinct widths (compilations) | widths | cells added | padding share |")
    print("|---|---|---|---|---|---|")
    for micro in micros:
        widths, tokens = epoch_widths(samples_dir, micro, global_batch, objective, epochs)
        unpadded = sum(widths)
        for quantum in quanta:
            padded = [padded_width(width, quantum) for width in widths]
            distinct = sorted(set(padded))
            shown = ", ".join(map(str, distinct)) if len(distinct) <= 8 else f"{distinct[0]} .. {distinct[-1]}"
            print(f"| {micro} | {quantum} | {len(distinct)} | {shown} | {sum(padded) / unpadded - 1:+.1%} | "
                  f"{1 - tokens / (micro * sum(padded)):.1%} |")
        print(f"| ({len(widths)} micro batches of {micro}) | | | | | |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/bench_padding.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("samples_dir", help="a data_prep.build_samples output directory")
    parser.add_argument("--micro-batch-sizes", default="20,8")
    parser.add_argument("--global-batch-sizes", default="80,160,320")
    parser.add_argument("--objective", default="ae+par")
    report = parser.add_mutually_exclusive_group()
    report.add_argument("--quanta", help="comma-separated layout width quanta: report their cost instead")
    report.add_argument("--attention-tiles", action="store_true",
                        help="report the share of attention tiles the triton kernels compute instead")
    parser.add_argument("--epochs", type=positive_int, default=1, help="with --quanta: epochs to iterate (each reshuffled)")
    args = parser.parse_args(argv)
    micros = [int(v) for v in args.micro_batch_sizes.split(",")]
    globals_ = [int(v) for v in args.global_batch_sizes.split(",")]
    if args.attention_tiles:
        tiles_table(args.samples_dir, micros, globals_, args.objective)
        return 0
    if args.quanta:
        quantum_table(args.samples_dir, micros, globals_[0] if globals_ else None, args.objective,
                      [int(v) for v in args.quanta.split(",")], args.epochs)
        return 0
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
