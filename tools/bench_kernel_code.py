#!/usr/bin/env python
"""Our Triton kernels compiled for a GPU without one: registers, spilled bytes, shared memory, and
the machine instructions (SASS) of each kernel's hot loop, per tile and per KB of data it reads.

    python tools/bench_kernel_code.py [--capability 90] [--width 674] [--json FILE]

A CPU proxy for kernels that issue more instructions than their bytes need: on one H200 the table
gradient's kernel (`bucket_sums`) read 0.6 TB/s of the ~4.3 the card moves, and the instructions its
loop issues per byte say why and what a change saves, without a GPU. Triton's own compiler builds
the code (ptxas and cuobjdump ship with Triton) as a launch at layout width `--width` on that GPU
would: bf16 data at the base preset's 12 heads, the attention kernels at their default launch with
the recipe's dropout and the relative-bias table, and Triton's launch-time specialisation (every
pointer aligned to 16 bytes, as fresh allocations are, and each integer argument that is a multiple
of 16 marked so: strides of a width of 176, seq 128's, are; of 674, seq 512's, the rows of the
codes and the sizes are not). Figures: docs/benchmarks.md, "bucket_sums".
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_pmlm.files import OutputError, check_output, logs_to_stderr, write_json_atomically  # noqa: E402
from megatron_pmlm.models.launch_tuning import resident_programs  # noqa: E402

HEADS = 12
"""The base preset's heads: the rows of data each bucket_sums tile reads per pair."""
POINTER_TYPES = {"grad_ptr": "{dtype}", "bucket_ptr": "*u8", "partial_ptr": "*fp32", "codes_ptr": "*u8",
                 "key_tiles_ptr": "*i32", "query_tiles_ptr": "*i32", "table_ptr": "*fp32", "seed_ptr": "*i64",
                 "lse_ptr": "*fp32", "delta_ptr": "*fp32", "keep_ptr": "*i8", "bits_ptr": "*u8",
                 "sums_ptr": "*fp32"}
FLOAT_ARGUMENTS = ("scale", "keep_scale")


def recipe_attention_dropout() -> float:
    """ModelConfig's attention dropout (the recipe's 0.1)."""
    from megatron_pmlm.config import ModelConfig

    return ModelConfig.attention_dropout


def kernel_specs(dtype: str, width: int, dropout: float, launch: tuple | None = None,
                 transposed: bool = True, dense: bool = False, bits_apart: bool = True) -> list[dict]:
    """(name, kernel, constexprs, launch options, integer arguments, bytes a hot-loop iteration reads)
    of each kernel, as the code launches it at layout width `width` (bucket_sums.py's tile and vector
    loads, bucket_attention.py's default shapes and buffers; batch 1), with attention dropout
    `dropout`; the attention kernels launched as `launch` (forward and dQ shape, dK dV dS shape;
    default: bucket_attention's defaults), the dK dV dS kernel's tiles `transposed` or not
    (`bucket_attention.key_value_transposed`), the bias gathered from the table or read `dense`
    (`bucket_attention.DENSE_BIAS`), the dropout's bits drawn by their own kernel before the forward
    (`bits_apart`) or in the forward (`bucket_attention.DROPOUT_BITS_APART`)."""
    from megatron_pmlm.models import bucket_attention, bucket_sums, bucket_attention_triton, bucket_sums_triton

    size = {"*bf16": 2, "*fp16": 2, "*fp32": 4}[dtype]
    head_dim = 64
    T, H, vector = width, HEADS, 16 // size
    padded = -(-T // 8) * 8  # the bias gradient's rows (relative_bias.aligned_bias_buffer)
    tiled = -(-T // bucket_attention.CODE_TILE) * bucket_attention.CODE_TILE  # the codes' and bits' padding
    qkv = (T * 3 * H * head_dim, head_dim, 3 * H * head_dim)  # the fused projection's [B, T, 3, H, D]
    heads_last = (T * H * head_dim, head_dim, H * head_dim)  # outputs and gradients: [B, T, H, D]
    threshold = bucket_attention.dropout_threshold(dropout)[0]
    # dS padded to whole tiles of the dK dV dS kernel (bucket_attention.score_grad_buffer)
    forward, key_value = launch or (bucket_attention.DEFAULT_FORWARD_SHAPE, bucket_attention.DEFAULT_KEY_VALUE_SHAPE)
    key_block = key_value.block_keys
    ds_row = -(-T // key_block) * key_block
    ds_rows = -(-T // key_value.block_queries) * key_value.block_queries
    attention_arguments = dict(
        heads=H, threshold=threshold, queries=T, keys=T, lse_stride_bh=T,
        # bucket_attention.kernel_table's rows, or the dense bias [B, H, 2, tiled, tiled]
        table_stride_b=H * 2 * tiled * tiled if dense else 0,
        table_stride_h=2 * tiled * tiled if dense else bucket_attention.BLOCKED + 1,
        # padded_codes: the codes and their transpose, [B, 2, tiled, tiled]
        code_stride_b=2 * tiled * tiled, code_stride_t=tiled, bits_stride_bh=tiled * tiled // 8, bits_stride_t=tiled // 8,
        stats_stride_bh=tiled,  # the backward's padded per-row statistics
        ds_stride_b=H * ds_rows * ds_row, ds_stride_h=ds_rows * ds_row, ds_stride_t=ds_row,
        # the Q, K, V bias gradient's column sums (bucket_attention.PROJECTION_BIAS_SUMS): [B, blocks, parts, H, D]
        sums_stride_b=-(-T // key_value.block_keys) * 2 * H * head_dim, sums_stride_block=2 * H * head_dim,
        sums_stride_part=H * head_dim,
        **{f"{name}_stride_{axis}": value for name in ("q", "k", "v") for axis, value in zip("bht", qkv)},
        **{f"{name}_stride_{axis}": value for name in ("o", "do", "dq", "dk", "dv")
           for axis, value in zip("bht", heads_last)})

    def tiles(forward_shape, key_value_shape):
        query_blocks, key_blocks = -(-T // forward_shape.block_queries), -(-T // forward_shape.block_keys)
        return dict(tiles_stride_b=query_blocks * (1 + key_blocks), tiles_stride_t=1 + key_blocks)
    attention = dict(HEAD_DIM=head_dim, DROPOUT=threshold > 0, PRECISION="tf32", INTERPRETED=False, DENSE=dense)
    bias_sums = dict(BIAS_SUMS=True)  # the backward's, in training: the Q, K, V bias gradient's column sums too
    bits_drawn = bool(threshold) and bits_apart  # the forward reads the bits their own kernel drew
    bias_type = {"table_ptr": dtype} if dense else {}  # the dense bias in the inputs' dtype
    return [
        {"name": "bucket_sums", "kernel": bucket_sums_triton.bucket_sums_kernel,
         "constexprs": dict(HEADS_BLOCK=bucket_sums._block(HEADS), BINS_BLOCK=32, ROWS=bucket_sums.ROWS,
                            KEYS_BLOCK=bucket_sums.KEYS_BLOCK, UPCAST=False,
                            # strides a multiple of 16 bytes, as the bias buffer's rows (padded to 8)
                            VECTOR=16 // size,
                            # walking the forward's tile lists, as the triton backend's table gradient does
                            LISTED=True, TILE_QUERIES=forward.block_queries, TILE_KEYS=forward.block_keys),
         "options": bucket_sums.LAUNCH.launch_options(),
         "arguments": dict(heads=H, queries=T, keys=T, grad_stride_batch=H * T * padded // vector,
                           grad_stride_head=T * padded // vector, grad_stride_query=padded // vector,
                           bucket_stride_batch=T * T, bucket_stride_query=T, row_blocks=-(-T // bucket_sums.ROWS),
                           **tiles(forward, key_value)),
         # the gradient of every head for the tile's pairs, and the pairs' buckets
         "loop_bytes": bucket_sums.ROWS * bucket_sums.KEYS_BLOCK * (HEADS * size + 1)},
        {"name": "attention forward", "kernel": bucket_attention_triton.attention_forward_kernel,
         "constexprs": dict(attention, BLOCK_M=forward.block_queries, BLOCK_N=forward.block_keys,
                            BITS_DRAWN=bits_drawn),
         "options": forward.launch_options(), "pointer_types": bias_type,
         "arguments": dict(attention_arguments, **tiles(forward, key_value)),
         # a tile of keys and values, and the tile's codes (and its kept pairs' bits, read)
         "loop_bytes": (forward.block_keys * head_dim * size * 2 + forward.block_queries * forward.block_keys
                        + (forward.block_queries * forward.block_keys // 8 if bits_drawn else 0))},
        {"name": "attention dropout bits", "kernel": bucket_attention_triton.attention_dropout_bits_kernel,
         "constexprs": dict(BLOCK_M=forward.block_queries, BLOCK_N=forward.block_keys, INTERPRETED=False),
         "options": {"num_warps": bucket_attention.DROPOUT_BITS_WARPS, "num_stages": 1},
         "arguments": dict(attention_arguments, **tiles(forward, key_value)),
         # the tile's bits, written
         "loop_bytes": forward.block_queries * forward.block_keys // 8},
        {"name": "attention dK dV dS", "kernel": bucket_attention_triton.attention_backward_key_value_kernel,
         "constexprs": dict(attention, **bias_sums, BLOCK_M=key_value.block_queries, BLOCK_N=key_value.block_keys,
                            TRANSPOSED=transposed, WRITE_DS=True, ZERO_SKIPPED=True),
         "options": key_value.launch_options(),
         "pointer_types": bias_type,
         "arguments": dict(attention_arguments, **tiles(key_value, forward)),
         # a tile of queries and output gradients, codes, kept bits, and dS written
         "loop_bytes": (key_value.block_queries * head_dim * size * 2 + key_value.block_queries * key_value.block_keys
                        * (1 + size) + key_value.block_queries * key_value.block_keys // 8)},
        {"name": "attention dQ", "kernel": bucket_attention_triton.attention_backward_query_kernel,
         "constexprs": dict(attention, **bias_sums, BLOCK_M=forward.block_queries, BLOCK_N=forward.block_keys),
         "options": forward.launch_options(), "pointer_types": bias_type,
         "arguments": dict(attention_arguments, **tiles(forward, key_value)),
         "loop_bytes": (forward.block_keys * head_dim * size * 2 + forward.block_queries * forward.block_keys
                        + forward.block_queries * forward.block_keys // 8)},
        {"name": "attention dQ from dS", "kernel": bucket_attention_triton.attention_query_grad_from_scores_kernel,
         "constexprs": dict(HEAD_DIM=head_dim, BLOCK_M=forward.block_queries, BLOCK_N=forward.block_keys,
                            **bias_sums, PRECISION=attention["PRECISION"], INTERPRETED=False),
         "options": forward.launch_options(),
         "arguments": dict(attention_arguments, **tiles(forward, key_value)),
         # a tile of dS and a tile of keys
         "loop_bytes": forward.block_queries * forward.block_keys * size + forward.block_keys * head_dim * size},
    ]


def signature(kernel, dtype: str, constexprs: dict) -> dict:
    types = {}
    for parameter in kernel.params:
        name = parameter.name
        if parameter.is_constexpr:
            types[name] = "constexpr"
        elif name.endswith("_ptr"):
            types[name] = POINTER_TYPES.get(name, "{dtype}").format(dtype=dtype)
        else:
            types[name] = "fp32" if name in FLOAT_ARGUMENTS else "i32"
    return types


def binary_tools():
    """Triton's cuobjdump (it ships ptxas and cuobjdump with its NVIDIA backend)."""
    import triton

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        raise SystemExit(f"bench_kernel_code: Triton's cuobjdump is missing ({cuobjdump}): this Triton "
                         "cannot show the machine code here")
    return str(cuobjdump)


INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", re.M)
BRANCH = re.compile(r"\bBRA\s+(?:\w+\s+)?(?:`\()?(0x[0-9a-f]+)")


def opcode(text: str) -> str:
    """'@!P0 LDG.E.128 R4, desc[...]' -> 'LDG'."""
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


SHARED_WIDTHS = {"U8": 1, "S8": 1, "U16": 2, "S16": 2, "64": 8, "128": 16}
"""Bytes a thread moves by an LDS/STS with that width suffix (none: 4)."""


def shared_traffic(loop: list[str]) -> tuple[int, int]:
    """(bytes a thread moves through shared memory with LDS, STS, LDSM and STSM, the block's barriers)
    in one iteration of `loop`: what changing a tensor's layout between threads costs, beside the
    pipeline's asynchronous copies (LDGSTS) and the tensor cores' own reads. LDSM/STSM .4 move 16
    bytes a thread (.2 8, .1 4)."""
    moved = barriers = 0
    for text in loop:
        parts = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")
        name, suffixes = parts[0], parts[1:]
        if name in ("LDS", "STS"):
            moved += next((SHARED_WIDTHS[suffix] for suffix in suffixes if suffix in SHARED_WIDTHS), 4)
        elif name in ("LDSM", "STSM"):  # e.g. LDSM.16.M88.4: four 8 x 8 matrices
            moved += 4 * int(suffixes[-1]) if suffixes and suffixes[-1] in ("1", "2", "4") else 16
        elif name == "BAR":
            barriers += 1
    return moved, barriers


def hot_loop(sass: str) -> list[str]:
    """The instructions of the largest innermost loop (a backward branch's range holding no other)."""
    lines = [(int(address, 16), text) for address, text in INSTRUCTION.findall(sass)]
    loops = []
    for address, text in lines:
        match = BRANCH.search(text)
        if match and int(match.group(1), 16) < address:
            loops.append((int(match.group(1), 16), address))
    innermost = [(start, end) for start, end in loops
                 if not any(start < other_start and other_end < end for other_start, other_end in loops)]
    if not innermost:
        return []
    start, end = max(innermost, key=lambda loop: loop[1] - loop[0])
    return [text for address, text in lines if start <= address <= end]


def compile_kernel(spec: dict, dtype: str, capability: int, cuobjdump: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = spec["kernel"]
    constexprs = {name: value for name, value in spec["constexprs"].items() if name in kernel.arg_names}
    types = {**signature(kernel, dtype, constexprs), **spec.get("pointer_types", {})}
    missing = [name for name in kernel.arg_names if types[name] == "i32" and name not in spec["arguments"]]
    if missing:
        raise ValueError(f"{spec['name']}: no modelled value for {', '.join(missing)}")
    # Triton specialises a launch on each pointer aligned to 16 bytes and each integer that is a
    # multiple of 16 (their alignment lets it load vectors)
    attributes = {(index,): [["tt.divisibility", 16]] for index, name in enumerate(kernel.arg_names)
                  if types[name].startswith("*") or (types[name] == "i32" and spec["arguments"][name] % 16 == 0)}
    compiled = triton.compile(ASTSource(fn=kernel, signature=types, constexprs=constexprs, attrs=attributes),
                              target=GPUTarget("cuda", capability, 32), options=spec["options"])
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    resources = dict(re.findall(r"\b(REG|LOCAL|STACK):(\d+)", usage))
    loop = hot_loop(sass)
    mix = collections.Counter(opcode(text) for text in loop)
    warps = spec["options"]["num_warps"]
    shared_moved, barriers = shared_traffic(loop)
    return {"kernel": spec["name"], "capability": capability, "dtype": dtype.lstrip("*"),
            "num_warps": warps, "registers": int(resources.get("REG", 0)),
            # ptxas reports a kernel's spills as its stack (Triton's kernels call no functions)
            "spilled_bytes": int(resources.get("LOCAL", 0)) + int(resources.get("STACK", 0)), "shared_bytes": compiled.metadata.shared,
            "instructions": len(INSTRUCTION.findall(sass)), "loop_instructions": len(loop),
            "loop_bytes": spec["loop_bytes"],
            "loop_shared_bytes": shared_moved * warps * 32, "loop_barriers": barriers,
            "warp_instructions_per_kb": round(len(loop) * warps * 1024 / spec["loop_bytes"], 1) if loop else None,
            "loop_mix": mix.most_common(12),
            "programs_per_sm": resident_programs(int(resources.get("REG", 0)), warps, compiled.metadata.shared)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--capability", type=int, default=90, help="the GPU's compute capability x 10 (80: A100)")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="the data's dtype")
    parser.add_argument("--kernels", default="", help="comma-separated names (default: all): "
                        "bucket_sums, attention forward, attention dropout bits, attention dK dV dS, attention dQ, "
                        "attention dQ from dS")
    parser.add_argument("--width", type=int, default=674,
                        help="the layout width T the launch is modelled at (674: seq 512's; 176: seq 128's)")
    parser.add_argument("--dropout", type=float, default=None,
                        help="the attention kernels' dropout (default: the recipe's; 0: the kernels without it)")
    parser.add_argument("--launch", help="the attention kernels launched as FORWARD/KEY_VALUE, e.g. "
                        "128x64w8s2/64x64w4s2 or with a register cap 64x64w4s1r168/64x64w4s1 (default: "
                        "bucket_attention's defaults)")
    parser.add_argument("--key-value-tiles", choices=("transposed", "rows"),
                        help="the dK dV dS kernel's tiles keys x queries or queries x keys (default: as "
                        "bucket_attention.transposed_tiles picks them for --capability and the launch)")
    parser.add_argument("--bias", choices=("table", "dense"), default="table",
                        help="the attention kernels gather table[head, code] per pair, or read the dense bias "
                        "(bucket_attention.DENSE_BIAS)")
    parser.add_argument("--dropout-bits", choices=("apart", "forward"), default="apart",
                        help="the attention dropout's kept pairs drawn by their own kernel before the forward, "
                        "which reads them, or by the forward (bucket_attention.DROPOUT_BITS_APART)")
    parser.add_argument("--json", help="also write the figures to this file ('-': standard output)")
    args = parser.parse_args(argv)
    launch = None
    if args.launch:
        from megatron_pmlm.models.bucket_attention import parse_kernel_shapes

        try:
            launch = parse_kernel_shapes(args.launch)
        except ValueError as error:
            parser.error(f"--launch: {error}")
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if args.json:
        try:
            check_output(args.json, "--json")
        except OutputError as error:
            parser.error(str(error))
    if importlib.util.find_spec("triton") is None:
        parser.error("Triton is not installed here (pyproject's test extra installs it on x86_64 Linux)")
    cuobjdump = binary_tools()
    if args.width < 1:
        parser.error(f"--width {args.width}: give a layout width of at least 1")
    if args.dropout is None:
        args.dropout = recipe_attention_dropout()
    elif not 0.0 <= args.dropout < 1.0:
        parser.error(f"--dropout {args.dropout}: give a probability in [0, 1)")
    from megatron_pmlm.models import bucket_attention

    if args.key_value_tiles is None:
        transposed = bucket_attention.transposed_tiles((args.capability // 10, args.capability % 10),
                                                       launch[1] if launch else bucket_attention.KEY_VALUE_SHAPE)
        args.key_value_tiles = "transposed" if transposed else "rows"
    specs = kernel_specs("*" + args.dtype, args.width, args.dropout, launch, args.key_value_tiles == "transposed",
                         args.bias == "dense", args.dropout_bits == "apart")
    if not args.dropout:
        specs = [spec for spec in specs if spec["name"] != "attention dropout bits"]  # nothing to draw

    args.launch = "/".join(map(str, launch or (bucket_attention.DEFAULT_FORWARD_SHAPE,
                                               bucket_attention.DEFAULT_KEY_VALUE_SHAPE)))
    wanted = [name.strip() for name in args.kernels.split(",") if name.strip()]
    unknown = sorted(set(wanted) - {spec["name"] for spec in specs})
    if unknown:
        parser.error(f"--kernels: unknown {', '.join(unknown)} (known: {', '.join(spec['name'] for spec in specs)})")
    with logs_to_stderr(args.json):  # --json -: the JSON alone on standard output
        rows = [compile_kernel(spec, "*" + args.dtype, args.capability, cuobjdump)
                for spec in specs if not wanted or spec["name"] in wanted]
        report(args, rows)
        if args.json:
            write_json_atomically(args.json, {"capability": args.capability, "dtype": args.dtype,
                                              "width": args.width, "dropout": args.dropout, "launch": args.launch,
                                              "key_value_tiles": args.key_value_tiles, "bias": args.bias,
                                              "dropout_bits": args.dropout_bits,
                                              "kernels": rows}, indent=1)
    return 0


def report(args: argparse.Namespace, rows: list[dict]) -> None:
    """The figures as a markdown table (standard output; standard error under --json -)."""
    out = sys.stdout
    print(f"SM {args.capability / 10:.1f}, {args.dtype}, layout width {args.width}, attention dropout {args.dropout}, "
          f"attention launch {args.launch}, dK dV dS tiles {args.key_value_tiles}, bias {args.bias}, dropout bits "
          f"{args.dropout_bits}: instructions "
          "of each kernel's "
          "hot loop (one iteration = one tile)", file=out)
    print("| kernel | warps | registers | spilled B | shared KiB | programs an SM | loop instructions | KB a tile "
          "| warp instructions / KB | shared-memory KB a tile | barriers a tile | loop's commonest |", file=out)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|", file=out)
    for row in rows:
        mix = ", ".join(f"{name} {count}" for name, count in row["loop_mix"][:6])
        print(f"| {row['kernel']} | {row['num_warps']} | {row['registers']} | {row['spilled_bytes']} | "
              f"{row['shared_bytes'] / 1024:.0f} | {row['programs_per_sm']} | {row['loop_instructions']} | "
              f"{row['loop_bytes'] / 1024:.1f} | "
              f"{row['warp_instructions_per_kb']} | {row['loop_shared_bytes'] / 1024:.1f} | {row['loop_barriers']} | "
              f"{mix} |", file=out)


if __name__ == "__main__":
    sys.exit(main())
