#!/usr/bin/env python3
"""The triton attention kernels' reads from HBM under a model of the GPU's L2, for the order their
programs are numbered in: heads first (the grid (B x heads, blocks) until 2026-11-29, whose next
block of a head came B x heads programs later) or blocks first (`bucket_attention_triton.program_tile`:
the blocks of a head numbered together, so they run at the same time and share the head's keys and
values, or queries and output gradients, in L2). A CPU proxy for a GPU's bytes, from the tile lists of
a real PMLM micro batch at the base preset's heads.

The model: programs start in the order of their numbers, `--programs-per-sm` x `--sms` at a time (a
wave); within a wave each program reads its tiles in turn, one tile of every program before the
next (the programs run side by side); the L2 keeps the most recently read `--l2-mb` (LRU, whole
tiles); a read not found there comes from HBM. Each kernel's reads (bf16, head size 64):
- forward (and dQ's kernel, which walks the same tiles): its query tile, then per key tile it walks
  the K and V tiles and the codes tile (1 byte a pair, shared by the sequence's heads);
- dK, dV, dS: its K and V tiles, then per query tile it walks the Q and dO tiles, the two row
  statistics (fp32), the codes tile and, with dropout, the kept pairs' bits (1/8 byte a pair).
Writes are not counted (each program writes its own tiles once, in either order).

    python tools/bench_attention_order.py                          # seq 128 x 256 and 512 x 64
    python tools/bench_attention_order.py --shapes 512x64 --json -
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_pmlm.config import HelpFormatter, model_config_from_preset, positive_int  # noqa: E402
from megatron_pmlm.files import OutputError, check_output, exit_quietly_on_closed_pipe, write_json_atomically  # noqa: E402
from tools.bench_attention_kernels import parse_shapes  # noqa: E402

ORDERS = ("heads first", "blocks first")
HEAD_DIM_BYTES = 64 * 2
"""A row of one head's q, k, v, O or dO in bf16 (base: head size 64)."""


def tile_lists(seq_length: int, micro_batch: int, block: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(key tiles per query block [B, query blocks, 1 + key blocks], query tiles per key block) of a
    real PMLM micro batch (tools/bench_train.py's examples), as the kernels walk them."""
    from megatron_pmlm.models import bucket_attention
    from megatron_pmlm.models.layout import pmlm_attention_allowed
    from tools.bench_train import make_examples, pmlm_batch

    config = model_config_from_preset("base")
    batch = pmlm_batch(make_examples(micro_batch, seq_length, config.vocab_size, seed=seed))
    codes = bucket_attention.attention_codes(None, pmlm_attention_allowed(batch.roles, batch.steps))
    shape = bucket_attention.KernelShape(block, block, 4, 1)
    with bucket_attention.kernel_shapes(shape, shape):
        tiles = bucket_attention.tile_lists(codes)
    return tiles.key_tiles, tiles.query_tiles


def program_reads(kernel: str, sequence: int, head: int, block: int, walked: list[int], rows: int,
                  dropout: bool) -> list[list[tuple]]:
    """One program's reads, tile by tile: [(object, bytes), ...] for its first step, then one list per
    tile it walks."""
    tile = rows * HEAD_DIM_BYTES
    codes = rows * rows
    if kernel == "forward":
        first = [(("q", sequence, head, block), tile)]
        steps = [[(("k", sequence, head, t), tile), (("v", sequence, head, t), tile), (("codes", sequence, block, t), codes)]
                 for t in walked]
    else:
        first = [(("k", sequence, head, block), tile), (("v", sequence, head, block), tile)]
        steps = [[(("q", sequence, head, t), tile), (("do", sequence, head, t), tile),
                  (("stats", sequence, head, t), 2 * rows * 4), (("codes_t", sequence, block, t), codes)]
                 + ([(("bits", sequence, head, t, block), codes // 8)] if dropout else [])
                 for t in walked]
    return [first] + steps


def hbm_bytes(kernel: str, tiles: torch.Tensor, heads: int, rows: int, order: str, wave: int, l2_bytes: int,
              dropout: bool) -> dict:
    """Bytes read, and read from HBM, by one kernel's programs in `order` under the L2 model."""
    batch, blocks = tiles.shape[:2]
    counts, lists = tiles[..., 0].tolist(), tiles[..., 1:].tolist()
    programs = ([(b * heads + h, block) for b in range(batch) for h in range(heads) for block in range(blocks)]
                if order == "blocks first" else
                [(b * heads + h, block) for block in range(blocks) for b in range(batch) for h in range(heads)])
    cache: collections.OrderedDict = collections.OrderedDict()
    held = read = from_hbm = 0
    for start in range(0, len(programs), wave):
        running = [program_reads(kernel, sh // heads, sh % heads, block,
                                 lists[sh // heads][block][:counts[sh // heads][block]], rows, dropout)
                   for sh, block in programs[start:start + wave]]
        for step in range(max(len(reads) for reads in running)):
            for reads in running:
                for name, size in reads[step] if step < len(reads) else ():
                    read += size
                    if name in cache:
                        cache.move_to_end(name)
                        continue
                    from_hbm += size
                    cache[name] = size
                    held += size
                    while held > l2_bytes:
                        held -= cache.popitem(last=False)[1]
    return {"read_gb": read / 1e9, "hbm_gb": from_hbm / 1e9}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--shapes", type=parse_shapes, default=[(128, 256), (512, 64)], help="SEQxMICRO_BATCH[,...]")
    parser.add_argument("--heads", type=positive_int, default=12, help="attention heads (base: 12)")
    parser.add_argument("--block", type=int, choices=(64, 128), default=64, help="a tile's queries and keys")
    parser.add_argument("--l2-mb", type=float, default=50.0, help="the L2 modelled, MB (an H100's: 50)")
    parser.add_argument("--sms", type=positive_int, default=132, help="streaming multiprocessors (an H100 SXM's: 132)")
    parser.add_argument("--programs-per-sm", type=positive_int, default=2,
                        help="programs an SM holds (the default launch's forward: 2; tools/bench_kernel_code.py)")
    parser.add_argument("--dropout", action=argparse.BooleanOptionalAction, default=True,
                        help="the key/value pass reads the kept pairs' bits")
    parser.add_argument("--json", type=Path, help="also write the figures here ('-': standard output alone)")
    args = parser.parse_args(argv)
    if args.l2_mb <= 0:
        parser.error(f"--l2-mb {args.l2_mb}: give a positive size")
    if args.json and str(args.json) != "-":
        try:
            check_output(args.json, "--json")
        except OutputError as error:
            parser.error(str(error))
    out = sys.stderr if str(args.json) == "-" else sys.stdout
    results = {"heads": args.heads, "block": args.block, "l2_mb": args.l2_mb, "sms": args.sms,
               "programs_per_sm": args.programs_per_sm, "dropout": args.dropout, "shapes": []}
    wave, l2_bytes = args.sms * args.programs_per_sm, int(args.l2_mb * 1e6)
    for seq_length, micro_batch in args.shapes:
        key_tiles, query_tiles = tile_lists(seq_length, micro_batch, args.block)
        shape = {"seq_length": seq_length, "micro_batch": micro_batch, "kernels": {}}
        print(f"seq {seq_length} x {micro_batch}: {key_tiles.shape[1]} blocks of {args.block} a head, "
              f"{args.heads} heads; L2 {args.l2_mb:g} MB, {wave} programs at a time", file=out)
        for kernel, tiles in (("forward", key_tiles), ("dK dV dS", query_tiles)):
            figures = {order: hbm_bytes(kernel, tiles, args.heads, args.block, order, wave, l2_bytes, args.dropout)
                       for order in ORDERS}
            shape["kernels"][kernel] = figures
            before, after = (figures[order]["hbm_gb"] for order in ORDERS)
            print(f"  {kernel:<9} reads {figures['blocks first']['read_gb']:.2f} GB a layer; from HBM: heads first "
                  f"{before:.2f} GB, blocks first {after:.2f} GB ({after / before:.0%})", file=out)
        results["shapes"].append(shape)
    if args.json:
        if str(args.json) == "-":
            json.dump(results, sys.stdout, indent=1)
            print()
        else:
            write_json_atomically(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(exit_quietly_on_closed_pipe(main))
