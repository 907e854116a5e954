"""The `triton` attention backend: flash attention that reads the relative-position bias per tile.

The sdpa backend hands every layer a dense [B, heads, T, T] bias, and SDPA then runs PyTorch's
memory-efficient kernel (cutlass's SM 8.0 code: ~60 TFLOP/s on an H100, 20-40% of a base step), the
only fused kernel that takes a bias with a gradient; flash and cuDNN refuse it (cuDNN's SDPA also
refuses a dropout that is not a multiple of 1/16, and gives the bias no gradient). Here each layer
gets a uint8 code per query-key pair instead (`attention_codes`: the relative-distance bucket, or
BLOCKED where the rule forbids the pair), 1 byte a pair for all heads, and the kernels
(`bucket_attention_triton.py`) add `table[head, code]` to each score tile as they compute it:

- no bias is built, read per layer, or kept (the dense bf16 bias is 2 x heads bytes a pair, read
  forward and backward in every layer);
- attention dropout is drawn by a kernel of its own before the forward (Philox, 16 bits a draw, so
  the probability is rounded to a multiple of 1/65536: 0.1 runs as 6554/65536; the kept values are
  scaled by the exact inverse of the kept fraction), as bits (1/8 byte a pair and head) that the
  forward and both backward passes read: drawn in the forward, Philox's arithmetic set its
  registers (`DROPOUT_BITS_APART`), and drawing again would cost the backward passes more than
  their matrix products;
- a tile whose pairs are all BLOCKED is skipped: on real PMLM batches ~25% of
  the tiles (the context's queries never see the pseudo tokens, nobody sees padding), listed once
  per micro batch (`tile_lists`) and walked by every layer's kernels;
- the backward writes the score gradient dS (the bias's gradient) once, in the queries' dtype, and
  reduces it into the [heads, bins] table gradient with `bucket_sums` (one pass): the same sums as the
  sdpa path's.

Each call is a custom op (`torch.ops.megatron_pmlm.bucket_attention`), opaque to torch.compile. The
kernels run on CUDA (SM 8.0+), and on CPU tensors in Triton's interpreter (`TRITON_INTERPRET=1`),
which is how the tests check them against a float64 reference.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import re
from typing import NamedTuple

import torch

from ..config import ConfigError
from .accelerated import alternative_from_environment, value_from_environment
from . import bucket_sums, launch_tuning
from .launch_tuning import MIN_REGISTER_CAP

BLOCKED = 255
"""The code of a query-key pair the attention rule forbids (its score is -inf)."""
DROPOUT_RESOLUTION = 1 << 16
"""Dropout compares a 16-bit draw per pair with round(probability x this)."""


class KernelShape(NamedTuple):
    """How a kernel is launched: its tile (queries x keys: BLOCK_SIZES x KEY_BLOCK_SIZES) and
    Triton's launch options, `max_registers` a thread may use (ptxas's .maxnreg; 0: the compiler's
    choice). Written `64x64w4s3`, or `64x64w4s1r168` with a register cap
    (tools/bench_attention_kernels.py --triton-shapes)."""

    block_queries: int
    block_keys: int
    num_warps: int = 4
    num_stages: int = 3
    max_registers: int = 0

    def __str__(self) -> str:
        cap = f"r{self.max_registers}" if self.max_registers else ""
        return f"{self.block_queries}x{self.block_keys}w{self.num_warps}s{self.num_stages}{cap}"

    def launch_options(self) -> dict:
        """Triton's launch keywords for this shape."""
        return launch_tuning.Launch(self.num_warps, self.num_stages, self.max_registers).launch_options()


BLOCK_SIZES = (32, 64, 128)
"""Blocks of queries the kernels take: tl.dot wants powers of two >= 16."""
KEY_BLOCK_SIZES = (64, 128)
"""Blocks of keys the kernels take: dropout draws and stores its bits in groups that span 64 keys."""
CODE_TILE = max(BLOCK_SIZES)
"""The kernels read the codes, and the kept pairs' bits, padded to a multiple of this in both
dimensions (BLOCKED past the real pairs): every tile any launch walks lies inside them, so the
kernels load them without bounds masks (with `kernel_table`, 33-50% fewer instructions in the
kernels' loops at seq 512's width: `tools/bench_kernel_code.py`, docs/benchmarks.md)."""
DEFAULT_FORWARD_SHAPE = KernelShape(64, 64, num_warps=4, num_stages=1)
DEFAULT_KEY_VALUE_SHAPE = KernelShape(64, 64, num_warps=4, num_stages=1)
"""One pipeline stage: on one H100 (seventh run, seq 512 x 64, the key/value pass transposed) a
layer's forward and backward took 3.27 ms launched so against 4.90 with 2 stages and 6.08 with 3,
and pretrain's compiled step went from 21.1% to 24.3% MFU (docs/benchmarks.md). (The sixth run,
before the transposed pass and the kept pairs read from their bytes, had found 2 stages faster
than 3: 5.84 against 7.68 ms.)"""
KEY_VALUE_BLOCK_SIZES = (64, 128)
"""Blocks of queries the dK, dV, dS kernel takes: launched with 32 queries x 128 keys (4 warps, 3
stages) it gave dK 3.2e-2 from sdpa's on an H100 (Triton 3.6; the others 4e-3), while Triton's
interpreter agrees with float64 there: a launch no GPU has shown right is refused."""
KERNEL_SHAPES_ENV = "PMLM_TRITON_KERNEL_SHAPES"
"""`FORWARD/KEY_VALUE` (e.g. `128x64w8s3/64x64w4s3`): launch the kernels so instead of the defaults,
read at import (how `make gpu-check` runs pretrain's step with the launch its attention table found
fastest; a GPU other than those measured may want its own)."""


def parse_kernel_shape(text: str) -> KernelShape:
    """'128x64w8s3' -> KernelShape(128, 64, 8, 3), '64x64w4s1r168' -> ... max_registers=168;
    ValueError naming what is wrong."""
    match = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)(?:r(\d+))?", text.strip())
    if not match:
        raise ValueError(f"kernel shape {text!r}: give QUERIESxKEYSwWARPSsSTAGES, e.g. 128x64w8s3 (a register "
                         "cap after it: 64x64w4s1r168)")
    shape = KernelShape(*(int(value) for value in match.groups() if value is not None))
    problem = shape_problem(shape)
    if problem:
        raise ValueError(problem)
    return shape


def parse_kernel_shapes(text: str) -> tuple[KernelShape, KernelShape]:
    """'FORWARD/KEY_VALUE' -> (forward and dQ shape, dK dV dS shape)."""
    halves = text.split("/")
    if len(halves) != 2:
        raise ValueError(f"{text!r}: give FORWARD/KEY_VALUE, e.g. 128x64w8s3/64x64w4s3")
    forward, key_value = parse_kernel_shape(halves[0]), parse_kernel_shape(halves[1])
    problem = key_value_shape_problem(key_value)
    if problem:
        raise ValueError(problem)
    return forward, key_value


def shape_problem(shape: KernelShape) -> str | None:
    """Why the kernels cannot be launched as `shape`, or None."""
    if shape.block_queries not in BLOCK_SIZES or shape.block_keys not in KEY_BLOCK_SIZES:
        return (f"kernel shape {shape}: blocks of queries must be {' or '.join(map(str, BLOCK_SIZES))}, "
                f"of keys {' or '.join(map(str, KEY_BLOCK_SIZES))}")
    if shape.num_warps not in (1, 2, 4, 8, 16) or not 1 <= shape.num_stages <= 8:
        return f"kernel shape {shape}: warps must be 1, 2, 4, 8 or 16 and stages 1-8"
    if shape.max_registers and not (MIN_REGISTER_CAP <= shape.max_registers <= 255 and shape.max_registers % 8 == 0):
        return (f"kernel shape {shape}: a register cap must be a multiple of 8 from {MIN_REGISTER_CAP} to 255 "
                "(registers a thread)")
    return None


def key_value_shape_problem(shape: KernelShape) -> str | None:
    """Why the dK, dV, dS kernel cannot be launched as `shape` (beyond `shape_problem`), or None."""
    if shape.block_queries not in KEY_VALUE_BLOCK_SIZES:
        return (f"kernel shape {shape} for dK, dV, dS: its blocks of queries must be "
                f"{' or '.join(map(str, KEY_VALUE_BLOCK_SIZES))}")
    return shape_problem(shape)


def _launch_from_environment() -> tuple[KernelShape, KernelShape, str | None]:
    value = os.environ.get(KERNEL_SHAPES_ENV)
    if not value:
        return DEFAULT_FORWARD_SHAPE, DEFAULT_KEY_VALUE_SHAPE, None
    try:
        return (*parse_kernel_shapes(value), None)
    except ValueError as error:
        return DEFAULT_FORWARD_SHAPE, DEFAULT_KEY_VALUE_SHAPE, f"{KERNEL_SHAPES_ENV}: {error}"


FORWARD_SHAPE, KEY_VALUE_SHAPE, LAUNCH_PROBLEM = _launch_from_environment()
"""FORWARD_SHAPE: the forward's and the dQ kernel's tiles and base launch (both walk the key blocks
of a block of queries: `key_tiles`); KEY_VALUE_SHAPE: the dK, dV, dS kernel's (it walks the query
blocks of a block of keys: `query_tiles`). On a GPU each kernel's stages and register cap are then
tuned per problem size (`launch_tuning`) unless the launch was given. `make gpu-check` times other
launches beside the defaults (docs/gpu.md). LAUNCH_PROBLEM: what is wrong with KERNEL_SHAPES_ENV
(the model refuses to start)."""
SHAPES_PINNED = bool(os.environ.get(KERNEL_SHAPES_ENV))
"""Whether the launch was given (KERNEL_SHAPES_ENV, `kernel_shapes`): launched as given, not tuned."""
HEAD_DIMS = (16, 32, 64, 128)
"""Head sizes the kernels take (tl.dot wants a power of two >= 16)."""
ROWSUM_BLOCK = 64
"""Query rows per program of the backward's rowsum(dO * O) kernel (a pass over O and dO alone)."""
ROWSUM_WARPS = 4
DROPOUT_BITS_WARPS = 4
"""Warps a program of the dropout bits' kernel (a block of queries' listed tiles, Philox and stores only)."""
DQ_ENV = "PMLM_TRITON_DQ"
"""`kernel`: compute dQ with its own kernel (recomputing the scores, their softmax and dP tile by
tile) also where the backward writes dS; by default (`gemm`) dQ = scale x dS @ K there, a batched
GEMM a head; `tiles`: the same product by our kernel over the listed tiles only."""


_DQ_WAY, DQ_PROBLEM = value_from_environment(DQ_ENV, ("gemm", "kernel", "tiles"))
_DQ_KERNEL = _DQ_WAY == "kernel"
DQ_FROM_SCORES = not _DQ_KERNEL
"""Where the backward writes the score gradient dS for the table (training with a relative bias),
dQ comes from it by batched GEMMs, one a head (cuBLAS: 2 x B x heads x T^2 x head size FLOPs
reading dS once, 0.73 GB a layer at seq 512 x 64) instead of the dQ kernel, which recomputes q k^T,
the softmax, the kept bits and dP for every tile (a quarter of the three kernels' loop
instructions). The same dS
in the same dtype enters the same products (the kernel too rounds dS to the inputs' dtype for
them); only the order of the fp32 sums differs. Read at import; `dq_from_scores` switches it.
DQ_PROBLEM: what is wrong with DQ_ENV (the model refuses to start, as for LAUNCH_PROBLEM)."""
DQ_OVER_TILES = _DQ_WAY == "tiles"
"""Where dQ comes from dS: by `attention_query_grad_from_scores_kernel` over the tiles the forward's
lists name (`key_tiles`) instead of cuBLAS over every tile: dS is 0 in the others, so the key/value
pass need not write them (with the forward's tiles its own) and neither reader reads them, 22-27%
of dS's bytes on real micro batches. The same products and dQ's one rounding, the fp32 sums in
another order. Read at import; `dq_over_tiles` switches it (the attention tool's `triton-dq-tiles`)."""

BIAS_ENV = "PMLM_TRITON_BIAS"
"""`dense`: the kernels read each tile's bias from a dense [B, heads, 2, P, P] copy built once per
micro batch in the inputs' dtype (`dense_kernel_bias`) instead of gathering `table[head, code]` per
pair (`table`, the default). An experiment for a GPU lease to time (`make gpu-check`'s
`triton-dense-bias` rows); the model's inputs honour it where they know the compute dtype (not in
pipeline stages)."""


DENSE_BIAS, BIAS_PROBLEM = alternative_from_environment(BIAS_ENV, "table", "dense")
"""Whether `kernel_inputs` builds the dense kernel bias (given a dtype); `dense_bias` switches it.
BIAS_PROBLEM: what is wrong with BIAS_ENV (the model refuses to start, as for LAUNCH_PROBLEM)."""

QKV_BIAS_ENV = "PMLM_TRITON_QKV_BIAS_GRADIENT"
"""`autograd`: the fused Q, K, V projection's bias gets its gradient from autograd (the column sums
of the packed q, k, v gradient, a reduction of its own); `kernel` (the default): from the backward
kernels' column sums (`PROJECTION_BIAS_SUMS`)."""
_QKV_BIAS_BY_AUTOGRAD, QKV_BIAS_PROBLEM = alternative_from_environment(QKV_BIAS_ENV, "kernel", "autograd")
PROJECTION_BIAS_SUMS = not _QKV_BIAS_BY_AUTOGRAD
"""Where the model's fused Q, K, V projection is a plain `nn.Linear` stack in training (`summed_bias`):
its bias is added detached and its gradient, the column sums of the packed gradient of q, k, v, is
summed from what the backward kernels hold anyway. The key/value pass sums its dK and dV
accumulators' columns once a program after its loop (no work in the loop), a dQ kernel (the
`kernel` or `tiles` ways of PMLM_TRITON_DQ) its dQ's; dQ by cuBLAS (the default) is summed by torch
in the backward op. Compiled, Inductor's reduction that read the whole packed gradient again (3 of
the ~46 activations a layer its kernels move, tools/bench_layer_graph.py) goes, 2 of them with dQ by
cuBLAS. The same sums up to the order of their fp32 additions, and taken before dK's and dV's (and
a dQ kernel's) rounding to the inputs' dtype. Read at import. QKV_BIAS_PROBLEM: what is wrong
with QKV_BIAS_ENV (the model refuses to start, as for LAUNCH_PROBLEM)."""

DROPOUT_BITS_ENV = "PMLM_TRITON_DROPOUT_BITS"
"""`forward`: the forward kernel draws the attention dropout's kept pairs itself (Philox in its loop)
and stores them for the backward; `apart` (the default): a kernel of their own draws them before
the forward (`DROPOUT_BITS_APART`)."""
_DRAWN_IN_FORWARD, DROPOUT_BITS_PROBLEM = alternative_from_environment(DROPOUT_BITS_ENV, "apart", "forward")
DROPOUT_BITS_APART = not _DRAWN_IN_FORWARD
"""With attention dropout, `attention_dropout_bits_kernel` draws the kept pairs' bits of the tiles the
forward computes, and the forward reads them as the backward kernels do: the same bits (the same
Philox calls, stored where the forward stored them), so the same outputs and gradients. Philox's
integer arithmetic set the forward's registers (204 a thread at the default launch on SM 9.0: two
programs an SM) and a fifth of its loop's instructions; reading the bits it takes 128 registers
(four programs an SM, as without dropout) and 781 instructions a tile instead of 998
(`tools/bench_kernel_code.py`), for a kernel that issues the draws at full occupancy and writes 1/8
byte a pair and head. Read at import; `dropout_bits_apart` switches it (the attention tool's
`triton-dropout-in-forward`). DROPOUT_BITS_PROBLEM: what is wrong with DROPOUT_BITS_ENV (the model
refuses to start, as for LAUNCH_PROBLEM)."""

KEY_VALUE_ENV = "PMLM_TRITON_KEY_VALUE_TILES"
"""`rows`: the dK, dV, dS kernel computes [queries, keys] tiles on every GPU; `auto` (the default):
transposed where `transposed_tiles` says (a way back without a code change, should a GPU's Triton
build the transposed kernel wrong or slow)."""
_ROWS_ONLY, KEY_VALUE_PROBLEM = alternative_from_environment(KEY_VALUE_ENV, "auto", "rows")
KEY_VALUE_TRANSPOSED: bool | None = False if _ROWS_ONLY else None
"""Whether the dK, dV, dS kernel computes its tiles transposed (keys x queries, FlashAttention-2's
orientation); None: by the device (`key_value_transposed`). `key_value_tiles` sets it for a block
(how the attention tool times both). KEY_VALUE_PROBLEM: what is wrong with KEY_VALUE_ENV (the model
refuses to start, as for LAUNCH_PROBLEM)."""
TRANSPOSED_SINCE = (9, 0)
"""The compute capability from which the key/value pass is transposed (`transposed_tiles`)."""

TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
INTERPRETED = TRITON_INSTALLED and os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernels on CPU tensors (the tests)."""


class TileLists(NamedTuple):
    """Which tiles of a micro batch hold a pair that is not BLOCKED (`tile_lists`)."""

    key_tiles: torch.Tensor
    """int32 [B, query blocks, 1 + key blocks] in FORWARD_SHAPE's tiles: per block of queries, how
    many key blocks hold a pair it sees, then those blocks (ascending), then the others (what the
    forward and dQ kernels walk)."""
    query_tiles: torch.Tensor
    """int32 [B, key blocks, 1 + query blocks] in KEY_VALUE_SHAPE's tiles: the same per block of keys
    (what the dK, dV kernel walks)."""


class BucketAttentionInputs(NamedTuple):
    """What every layer's attention takes under the triton backend, built once per micro batch."""

    codes: torch.Tensor
    """uint8 [B, queries, keys] (`attention_codes`)."""
    table: torch.Tensor | None
    """fp32 [heads, bins]: the relative-bias table as the layers read it (a differentiable copy made
    inside the bias module's forward, so ZeRO-3 has it gathered), or None without a relative bias."""
    tiles: TileLists
    """The tiles the kernels compute (`tile_lists` of the codes)."""
    padded_codes: torch.Tensor
    """The codes as the kernels read them, and their transpose (`padded_codes`)."""
    kernel_table: torch.Tensor
    """The table as the kernels read it (`kernel_table`), or its dense form (`dense_kernel_bias`)."""


def kernel_inputs(codes: torch.Tensor, table: torch.Tensor | None,
                  dense_dtype: torch.dtype | None = None) -> BucketAttentionInputs:
    """The codes, the table, and what the kernels read of them (the codes' tile lists, the padded
    codes, the kernel table): what the model builds once per micro batch for every layer. With
    DENSE_BIAS, a table and `dense_dtype` (the inputs' dtype), the kernel table's dense form (where the
    kernels run: elsewhere the attention refuses the device, as without it)."""
    padded = padded_codes(codes)
    kernel = kernel_table(table, codes.device)
    if DENSE_BIAS and table is not None and dense_dtype is not None and runs_on(codes.device):
        kernel = dense_kernel_bias(kernel, padded, dense_dtype)
    return BucketAttentionInputs(codes, table, tile_lists(codes), padded, kernel)


@torch.library.custom_op("megatron_pmlm::dense_kernel_bias", mutates_args=())
def dense_kernel_bias(kernel: torch.Tensor, padded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, heads, 2, P, P] in `dtype`: `kernel[head, code]` for each pair of the padded codes and of
    their transpose ([B, 2, P, P], `padded_codes`), what the kernels read per tile instead of
    gathering through the codes (`DENSE_BIAS`): one pass per micro batch, 2 x heads x P^2 values a
    sequence (1.8 GB in bf16 at seq 512 x 64). A custom op: opaque to torch.compile, as the
    attention ops are."""
    from .bucket_attention_triton import dense_bias_kernel

    batch, _, size, _ = padded.shape
    heads = kernel.shape[0]
    bias = torch.empty(batch, heads, 2, size, size, dtype=dtype, device=padded.device)
    if bias.numel():
        _launch(dense_bias_kernel, (batch * 2, size // CODE_TILE), padded, kernel, bias, heads, size,
                kernel.stride(0), bias.stride(0), bias.stride(1), BLOCK=CODE_TILE)
    return bias


@dense_kernel_bias.register_fake
def _(kernel, padded, dtype):
    batch, _, size, _ = padded.shape
    return padded.new_empty(batch, kernel.shape[0], 2, size, size, dtype=dtype)


def _table_args(kernel: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, int, int, bool]:
    """(what a kernel reads of the kernel table, its stride per sequence, per head, whether dense): the
    dense bias's half for the tile's orientation, or the table, every head reading row 0 of a single
    row (no table, or one head)."""
    if kernel.dim() == 5:
        view = kernel[:, :, int(transposed)]
        return view, view.stride(0), view.stride(1), True
    return kernel, 0, kernel.stride(0) if kernel.shape[0] > 1 else 0, False


def padded_codes(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 2, P, P] (P: the longer of queries and keys rounded up to CODE_TILE): [:, 0] the
    [B, queries, keys] codes, [:, 1] their transpose (keys x queries, what the dK, dV, dS kernel's
    transposed tiles read as the forward reads [:, 0]: `key_value_transposed`), BLOCKED in the added
    rows and columns: one copy per micro batch, shared by the layers."""
    batch, queries, keys = codes.shape
    size = _padded(max(queries, keys))
    padded = codes.new_full((batch, 2, size, size), BLOCKED)
    padded[:, 0, :queries, :keys] = codes
    padded[:, 1, :keys, :queries] = codes.transpose(1, 2)
    return padded


def _codes_args(padded: torch.Tensor, transposed: bool) -> tuple[torch.Tensor, int, int]:
    """(the codes as a kernel reads them: `padded_codes`' [:, 0] or its transpose [:, 1], their
    stride per sequence, per row)."""
    view = padded[:, int(transposed)]
    return view, view.stride(0), view.stride(1)


def score_grad_buffer(batch: int, heads: int, queries: int, keys: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """An uninitialised [batch, heads, queries, keys] view of the buffer the backward writes dS into:
    padded to whole tiles of the dK, dV, dS kernel (its rows to whole blocks of keys, its queries to
    whole blocks of queries), so the kernel stores whole tiles with no mask (the padding gets 0: its
    pairs are BLOCKED); `bucket_sums` and the dQ GEMM read the view."""
    shape = KEY_VALUE_SHAPE
    return torch.empty(batch, heads, _blocks(queries, shape.block_queries) * shape.block_queries,
                       _blocks(keys, shape.block_keys) * shape.block_keys, dtype=dtype,
                       device=device)[..., :queries, :keys]


def _padded(size: int) -> int:
    return _blocks(size, CODE_TILE) * CODE_TILE


def kernel_table(table: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """fp32 [heads, BLOCKED + 1]: `table`'s rows times log2 e, 0 for the codes no bucket uses, -inf at
    BLOCKED, as the kernels read it: they compute the softmax in base 2 (`exp2`), the scale, the bias
    and the change of base one fused multiply-add a pair; a forbidden pair gets -inf from the same
    load and add as an allowed pair its bias (no mask, no select). Without a table, [1, BLOCKED + 1],
    the one row every head reads. Never differentiated: the table's gradient comes from the scores'
    (`bucket_sums`)."""
    rows = table.shape[0] if table is not None else 1
    kernel = torch.zeros(rows, BLOCKED + 1, dtype=torch.float32, device=device)
    if table is not None:
        kernel[:, :table.shape[1]] = table.detach() * math.log2(math.e)
    kernel[:, BLOCKED] = float("-inf")
    return kernel


def transposed_tiles(capability: tuple[int, int], shape: KernelShape) -> bool:
    """Whether the dK, dV, dS kernel launched as `shape` on a GPU of `capability` computes its tiles
    transposed: from SM 9.0 on, whose tensor cores read both operands from shared memory, so K and V
    stay there for the whole loop and the transposed tiles move 28% fewer bytes through it (73
    against 101.5 KB a 64 x 64 tile), for tiles with at least as many keys as queries (128 queries x
    64 keys transposed spill; 64 x 128 as [queries, keys] spill). SM 8.x's mma holds its left
    operands in registers, where K and V for the whole loop make the kernel spill with dropout (344
    bytes). `tools/bench_kernel_code.py`, docs/benchmarks.md."""
    return capability >= TRANSPOSED_SINCE and shape.block_keys >= shape.block_queries


def key_value_transposed(device: torch.device) -> bool:
    """Whether the dK, dV, dS kernel computes its tiles transposed on `device`: `KEY_VALUE_TRANSPOSED`,
    else `transposed_tiles` of its capability and KEY_VALUE_SHAPE (in the interpreter, as on an
    H100: the kernel the CPU tests is the one it runs)."""
    if KEY_VALUE_TRANSPOSED is not None:
        return KEY_VALUE_TRANSPOSED
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else TRANSPOSED_SINCE
    return transposed_tiles(capability, KEY_VALUE_SHAPE)


def runs_on(device: torch.device) -> bool:
    """Whether the kernels can run on `device`: CUDA with Triton installed, or any device in the interpreter."""
    return TRITON_INSTALLED and (device.type == "cuda" or INTERPRETED)


def device_problem(device: torch.device) -> str | None:
    """Why the triton backend cannot run on `device`, or None."""
    if not TRITON_INSTALLED:
        return ("--attention-backend triton needs Triton (it comes with PyTorch's CUDA builds): "
                "use --attention-backend sdpa")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 0):
            return (f"--attention-backend triton needs a GPU of compute capability >= 8.0; this GPU is SM "
                    f"{capability[0]}.{capability[1]}: use --attention-backend sdpa")
        return None
    if INTERPRETED:
        return None
    return (f"--attention-backend triton runs on CUDA GPUs (on the CPU only in Triton's interpreter, "
            f"TRITON_INTERPRET=1, for tests); this run is on {device.type}: use --attention-backend sdpa")


def head_dim_problem(head_dim: int) -> str | None:
    if head_dim not in HEAD_DIMS:
        return (f"--attention-backend triton takes head sizes {', '.join(map(str, HEAD_DIMS))}; this model's is "
                f"{head_dim} (hidden size / heads): use --attention-backend sdpa")
    return None


def attention_codes(buckets: torch.Tensor | None, allowed: torch.Tensor) -> torch.Tensor:
    """uint8 [B, queries, keys]: each pair's relative-distance bucket (0 without a relative bias)
    where `allowed`, BLOCKED elsewhere; one pass over the pairs per batch, shared by every layer."""
    if buckets is None:  # no relative bias: code 0 (never read) or BLOCKED
        return (~allowed).to(torch.uint8).mul_(BLOCKED)
    if buckets.dtype != torch.uint8:
        raise ValueError(f"attention_codes: buckets must be uint8 (at most {BLOCKED} bins), got {buckets.dtype}")
    return buckets.masked_fill(~allowed, BLOCKED)  # a Python scalar: no tensor copied to the device


def tile_lists(codes: torch.Tensor) -> TileLists:
    """The tiles of uint8 [B, queries, keys] `codes` that hold a pair that is not BLOCKED, as lists
    each kernel program walks (in the tiles of FORWARD_SHAPE and KEY_VALUE_SHAPE): a few small tensor
    ops per micro batch, on the codes' device, no host synchronisation."""
    forward = _nonempty_tiles(codes, FORWARD_SHAPE)
    key_value = (forward if KEY_VALUE_SHAPE[:2] == FORWARD_SHAPE[:2] else _nonempty_tiles(codes, KEY_VALUE_SHAPE))
    return TileLists(_listed(forward), _listed(key_value.transpose(1, 2)))


def _nonempty_tiles(codes: torch.Tensor, shape: KernelShape) -> torch.Tensor:
    """bool [B, query blocks, key blocks]: whether the tile holds a pair that is not BLOCKED."""
    batch, queries, keys = codes.shape
    rows, columns = shape.block_queries, shape.block_keys
    query_blocks, key_blocks = _blocks(queries, rows), _blocks(keys, columns)
    seen = torch.zeros(batch, query_blocks * rows, key_blocks * columns, dtype=torch.bool, device=codes.device)
    seen[:, :queries, :keys] = codes != BLOCKED
    return seen.view(batch, query_blocks, rows, key_blocks, columns).any(4).any(2)


def _listed(nonempty: torch.Tensor) -> torch.Tensor:
    """[..., 1 + n] int32 from bool [..., n]: the count of True, then their indices, then the others'."""
    counts = nonempty.sum(-1, dtype=torch.int32)
    order = torch.sort((~nonempty).to(torch.uint8), dim=-1, stable=True).indices.to(torch.int32)
    return torch.cat([counts[..., None], order], -1)


def dropout_threshold(dropout_p: float) -> tuple[int, float]:
    """(the 16-bit threshold below which a draw drops its pair, the scale of the kept values)."""
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"attention dropout must be in [0, 1), got {dropout_p}")
    threshold = min(round(dropout_p * DROPOUT_RESOLUTION), DROPOUT_RESOLUTION - 1)  # a draw can pass
    return threshold, DROPOUT_RESOLUTION / (DROPOUT_RESOLUTION - threshold)


def _heads_last(batch: int, length: int, heads: int, head_dim: int, like: torch.Tensor) -> torch.Tensor:
    """A [batch, heads, length, head_dim] view of [batch, length, heads, head_dim] memory: the layout
    the model's `transpose(1, 2).reshape(batch, length, -1)` takes without a copy."""
    return like.new_empty(batch, length, heads, head_dim).transpose(1, 2)


def _precision(dtype: torch.dtype) -> str:
    """fp32 inputs keep fp32 products (IEEE); half-precision inputs go to the tensor cores as they are."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _blocks(size: int, block: int) -> int:
    """Tiles of `block` covering `size` (a grid dimension)."""
    return -(-size // block)


def _strides(tensor: torch.Tensor) -> tuple[int, int, int]:
    if tensor.stride(-1) != 1:
        raise ValueError(f"bucket_attention: the last dimension must be contiguous, got strides {tensor.stride()}")
    return tensor.stride(0), tensor.stride(1), tensor.stride(2)


def _check(query, key, value, codes, key_tiles, query_tiles, table, kernel) -> None:
    batch, heads, queries, head_dim = query.shape
    keys = key.shape[2]
    if key.shape != (batch, heads, keys, head_dim) or value.shape != key.shape:
        raise ValueError(f"bucket_attention: query {tuple(query.shape)}, key {tuple(key.shape)} and value "
                         f"{tuple(value.shape)} do not match")
    size = _padded(max(queries, keys))
    if codes.shape != (batch, 2, size, size) or codes.dtype != torch.uint8 or codes.stride(-1) != 1:
        raise ValueError(f"bucket_attention: codes must be uint8 {[batch, 2, size, size]} (padded_codes of the "
                         f"[{batch}, {queries}, {keys}] codes), got {codes.dtype} {tuple(codes.shape)}")
    forward, key_value = FORWARD_SHAPE, KEY_VALUE_SHAPE
    for name, tiles, shape in (
            ("key_tiles", key_tiles,
             (batch, _blocks(queries, forward.block_queries), 1 + _blocks(keys, forward.block_keys))),
            ("query_tiles", query_tiles,
             (batch, _blocks(keys, key_value.block_keys), 1 + _blocks(queries, key_value.block_queries)))):
        if tiles.shape != shape or tiles.dtype != torch.int32 or tiles.stride(-1) != 1:
            raise ValueError(f"bucket_attention: {name} must be int32 {list(shape)} (tile_lists of the codes), "
                             f"got {tiles.dtype} {tuple(tiles.shape)}")
    if table is not None and (table.dim() != 2 or table.shape[0] != heads or table.shape[1] >= BLOCKED):
        raise ValueError(f"bucket_attention: table must be [{heads}, bins < {BLOCKED}], got {tuple(table.shape)}")
    rows = heads if table is not None else 1
    if kernel.dim() == 5:
        if kernel.shape != (batch, heads, 2, size, size) or kernel.dtype != query.dtype or not kernel.is_contiguous():
            raise ValueError(f"bucket_attention: a dense kernel bias must be {query.dtype} "
                             f"{[batch, heads, 2, size, size]} (dense_kernel_bias), got {kernel.dtype} "
                             f"{tuple(kernel.shape)}")
    elif kernel.shape != (rows, BLOCKED + 1) or kernel.dtype != torch.float32 or kernel.stride(-1) != 1:
        raise ValueError(f"bucket_attention: kernel_table must be float32 [{rows}, {BLOCKED + 1}] (kernel_table of "
                         f"the table), got {kernel.dtype} {tuple(kernel.shape)}")
    problem = head_dim_problem(head_dim)
    if problem:
        raise ValueError(problem)


@torch.library.custom_op("megatron_pmlm::bucket_attention", mutates_args=())
def bucket_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, codes: torch.Tensor,
                             key_tiles: torch.Tensor, query_tiles: torch.Tensor, table: torch.Tensor | None,
                             kernel_table: torch.Tensor, dropout_p: float, scale: float
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(output [B, heads, queries, head_dim] in [B, queries, heads, head_dim] memory, fp32 log-sum-exp
    [B, heads, queries], the int64 dropout seed [1], the kept pairs' bits: uint8 [B, heads, queries,
    keys / 8] both rounded up as the codes are, bit b of byte g the pair of key 8g + b, or [0]
    without dropout) of softmax(scale x q k^T + table[h, codes]) v with dropout; `codes`:
    `padded_codes`, `kernel_table`: the function of that name's, of `table`. The seed is drawn from the device's generator (activation checkpointing
    restores it, so a recomputation draws the same mask)."""
    return _forward(query, key, value, codes, key_tiles, query_tiles, table, kernel_table, dropout_p, scale)


def _forward(query, key, value, codes, key_tiles, query_tiles, table, kernel_table, dropout_p: float, scale: float
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward kernel's launch for either op (q, k, v apart or views of one packed tensor), after
    the dropout bits' kernel where it draws them (`DROPOUT_BITS_APART`)."""
    from .bucket_attention_triton import attention_dropout_bits_kernel, attention_forward_kernel

    _check(query, key, value, codes, key_tiles, query_tiles, table, kernel_table)
    batch, heads, queries, head_dim = query.shape
    keys = key.shape[2]
    out = _heads_last(batch, queries, heads, head_dim, query)
    lse = query.new_empty(batch, heads, queries, dtype=torch.float32)
    seed = (torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=query.device) if dropout_p > 0
            else torch.zeros(1, dtype=torch.int64, device=query.device))
    threshold, keep_scale = dropout_threshold(dropout_p)
    keep_bits = query.new_empty(_bits_shape(batch, heads, queries, keys) if threshold else (0,), dtype=torch.uint8)
    bits_strides = (keep_bits.stride(1), keep_bits.stride(2)) if threshold else (0, 0)
    bits_arg = keep_bits if threshold else lse  # never touched without dropout (no null pointer passed)
    shape = FORWARD_SHAPE
    programs = (batch * heads, _blocks(queries, shape.block_queries))
    grid = (math.prod(programs),)  # the blocks of a (sequence, head) numbered together: `program_tile`
    bits_drawn = bool(threshold) and DROPOUT_BITS_APART
    if batch * heads and queries:
        if bits_drawn:  # the kept pairs of the tiles the forward computes, drawn before it
            _launch(attention_dropout_bits_kernel, grid, seed, key_tiles, keep_bits, heads, queries,
                    key_tiles.stride(0), key_tiles.stride(1), *bits_strides, threshold, BLOCK_M=shape.block_queries,
                    BLOCK_N=shape.block_keys, INTERPRETED=INTERPRETED, num_warps=DROPOUT_BITS_WARPS)
        forward_codes, *forward_strides = _codes_args(codes, False)
        table_arg, *table_strides, dense = _table_args(kernel_table, False)
        constants = dict(HEAD_DIM=head_dim, BLOCK_M=shape.block_queries, BLOCK_N=shape.block_keys, DENSE=dense,
                         DROPOUT=threshold > 0, BITS_DRAWN=bits_drawn, PRECISION=_precision(query.dtype),
                         INTERPRETED=INTERPRETED)

        def launch(launch_shape: KernelShape):
            return _launch(attention_forward_kernel, grid,
                query, key, value, forward_codes, key_tiles, table_arg, seed, out, lse, bits_arg,
                heads, queries, keys, *_strides(query), *_strides(key), *_strides(value), *_strides(out),
                *forward_strides, key_tiles.stride(0), key_tiles.stride(1),
                *table_strides, queries, *bits_strides, scale, threshold, keep_scale,
                **constants, **launch_shape.launch_options())

        _tuned_launch(attention_forward_kernel, shape, programs, (_blocks(keys, shape.block_keys), constants), launch,
                      query.device)
    return out, lse, seed, keep_bits


@bucket_attention_forward.register_fake
def _forward_fake(query, key, value, codes, key_tiles, query_tiles, table, kernel_table, dropout_p, scale):
    batch, heads, queries, head_dim = query.shape
    keys = key.shape[2]
    return (_heads_last(batch, queries, heads, head_dim, query),
            query.new_empty(batch, heads, queries, dtype=torch.float32),
            query.new_empty(1, dtype=torch.int64),
            query.new_empty(_bits_shape(batch, heads, queries, keys) if dropout_threshold(dropout_p)[0] else (0,),
                            dtype=torch.uint8))


def _bits_shape(batch: int, heads: int, queries: int, keys: int) -> tuple[int, int, int, int]:
    """The kept pairs' bits cover the padded codes: the kernels write and read whole tiles."""
    return batch, heads, _padded(queries), _padded(keys) // 8


@torch.library.custom_op("megatron_pmlm::bucket_attention_backward", mutates_args=())
def bucket_attention_backward(grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              out: torch.Tensor, lse: torch.Tensor, keep_bits: torch.Tensor, codes: torch.Tensor,
                              key_tiles: torch.Tensor, query_tiles: torch.Tensor, table: torch.Tensor | None,
                              kernel_table: torch.Tensor, dropout_p: float, scale: float, table_gradient: bool
                              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, the table's fp32 gradient [heads, bins], empty without `table_gradient`)."""
    batch, heads, queries, head_dim = query.shape
    keys = key.shape[2]
    dq = _heads_last(batch, queries, heads, head_dim, query)
    dk = _heads_last(batch, keys, heads, head_dim, key)
    dv = _heads_last(batch, keys, heads, head_dim, value)
    table_grad, _ = _backward_into(dq, dk, dv, grad_out, query, key, value, out, lse, keep_bits, codes, key_tiles,
                                   query_tiles, table, kernel_table, dropout_p, scale, table_gradient)
    return dq, dk, dv, table_grad


def _launch(kernel, grid: tuple, *args, **kwargs):
    """kernel[grid](*args, **kwargs), returning what Triton's launch returns (the compiled kernel:
    the launch tuner reads its registers); where Triton cannot compile or launch it on this machine
    (its ptxas, a driver older than its PTX, too little shared memory for a launch), a ConfigError
    naming the kernel and the way out (pretrain and finetune_s2s print it in one line), the error
    kept as its cause. In Triton's interpreter (the tests) errors pass as they are."""
    try:
        return kernel[grid](*args, **kwargs)
    except Exception as error:
        if INTERPRETED:
            raise
        name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
        first_line = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
        raise ConfigError(f"the triton attention backend's {name} could not be compiled or launched here "
                          f"({type(error).__name__}: {first_line}); run with --attention-backend sdpa "
                          f"(auto picks triton on CUDA GPUs of compute capability 8.0+ with Triton)") from error


def _tuned_launch(kernel, shape: KernelShape, programs: tuple, problem: tuple, launch, device: torch.device) -> None:
    """launch(shape) with `shape`'s stages and register cap tuned for these programs (B x heads,
    blocks) and problem (the blocks each program walks at most, the constants) where `launch_tuning`
    tunes: on a GPU, unless the launch was given. Widths that make the same programs and walk share
    one choice: a run whose layouts take many widths tunes a few times, not at each."""
    if not launch_tuning.tunes(device, INTERPRETED, SHAPES_PINNED):
        launch(shape)
        return
    name = getattr(getattr(kernel, "fn", kernel), "__name__", "kernel")
    blocks, constants = problem
    key = (programs, blocks, tuple(sorted(constants.items())))

    def describe() -> str:  # for the announcement: built once a problem, not at every launch
        settings = ", ".join(f"{setting.lower()} {value}" for setting, value in sorted(constants.items())
                             if setting not in ("BLOCK_M", "BLOCK_N", "INTERPRETED"))
        return f"{programs[0]} x {programs[1]} programs of up to {blocks} tiles; {settings}"

    launch_tuning.tuned_launch(name, shape, key, launch, device, True, describe)


def _query_grad_from_scores(dq: torch.Tensor, score_grad: torch.Tensor, key: torch.Tensor, scale: float) -> None:
    """dq <- scale x dS @ K, one batched GEMM a head, each reading its head of the [B, heads, queries,
    keys] score gradient (a view of the padded dS buffer) and of K, and writing its head of dq, in
    place: K and dq are views of [B, T, heads, head_dim]-ordered memory (the packed q, k, v and their
    packed gradient), whose batch and head dimensions no single batched GEMM can merge. One GEMM over
    B x heads needed K copied and its product copied into dq (two copies of 0.1 ms a layer at seq
    128 x 256 on an H100, 3% of pretrain's step); cuBLAS takes each head's strided views as they
    are. The scale is applied in fp32 before the one rounding to dq's dtype (baddbmm's alpha; beta 0:
    dq's uninitialised memory is not read)."""
    for head in range(score_grad.shape[1]):
        dq[:, head].baddbmm_(score_grad[:, head], key[:, head], beta=0.0, alpha=scale)


def _query_grad_over_tiles(dq: torch.Tensor, score_grad: torch.Tensor, key: torch.Tensor, key_tiles: torch.Tensor,
                           scale: float, precision: str, sums: torch.Tensor | None) -> None:
    """dq <- scale x dS @ K over the forward's listed tiles (`attention_query_grad_from_scores_kernel`),
    in place: dq and K views of [B, T, heads, head_dim]-ordered memory, dS the padded buffer's view;
    dq's column sums into `sums` ([B, query blocks, heads, head_dim] fp32) where given."""
    from .bucket_attention_triton import attention_query_grad_from_scores_kernel

    batch, heads, queries, head_dim = dq.shape
    keys = key.shape[2]
    forward = FORWARD_SHAPE
    programs = (batch * heads, _blocks(queries, forward.block_queries))
    constants = dict(HEAD_DIM=head_dim, BLOCK_M=forward.block_queries, BLOCK_N=forward.block_keys,
                     BIAS_SUMS=sums is not None, PRECISION=precision, INTERPRETED=INTERPRETED)

    def launch(launch_shape: KernelShape):
        return _launch(attention_query_grad_from_scores_kernel, (math.prod(programs),),
            score_grad, key, dq, key_tiles, _sums_arg(sums, dq), heads, queries, keys, *_strides(score_grad),
            *_strides(key), *_strides(dq), key_tiles.stride(0), key_tiles.stride(1), *_sums_strides(sums, 2), scale,
            **constants, **launch_shape.launch_options())

    _tuned_launch(attention_query_grad_from_scores_kernel, forward, programs,
                  (_blocks(keys, forward.block_keys), constants), launch, dq.device)


def _sums_arg(sums: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """The column sums' buffer, or a tensor the kernel never touches (BIAS_SUMS off: no null pointer)."""
    return placeholder if sums is None else sums


def _sums_strides(sums: torch.Tensor | None, count: int) -> tuple[int, ...]:
    """The sums buffer's strides over (sequence, block[, part]) the kernels take (0s without one)."""
    return (0,) * count if sums is None else sums.stride()[:count]


def _backward_into(dq, dk, dv, grad_out, query, key, value, out, lse, keep_bits, codes, key_tiles, query_tiles, table,
                   kernel_table, dropout_p: float, scale: float, table_gradient: bool, bias_sums: bool = False
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The backward kernels' launches for either op, writing dq, dk, dv (given: apart, or views of one
    packed gradient): (the table's fp32 gradient, empty without `table_gradient`; with `bias_sums`, the
    column sums of dq, dk and dv over sequences and positions, fp32 [3, heads, head_dim], else None)."""
    from .bucket_attention_triton import (attention_backward_delta_kernel, attention_backward_key_value_kernel,
                                          attention_backward_query_kernel)

    batch, heads, queries, head_dim = query.shape
    keys = key.shape[2]
    grad_out = grad_out if grad_out.stride(-1) == 1 else grad_out.contiguous()
    # per row, fp32, padded as the codes are: rowsum(dO * O) and the base-2 log-sum-exp (the delta kernel's)
    delta, lse2 = lse.new_empty(2, batch * heads, _padded(queries))
    write_scores = table is not None and table_gradient
    score_grad = (score_grad_buffer(batch, heads, queries, keys, query.dtype, query.device) if write_scores
                  else dq)  # never written without a table gradient
    dq_reads_scores = write_scores and DQ_FROM_SCORES
    dq_by_gemm = dq_reads_scores and not DQ_OVER_TILES
    threshold, keep_scale = dropout_threshold(dropout_p)
    bits_strides = (keep_bits.stride(1), keep_bits.stride(2)) if threshold else (0, 0)
    bits_arg = keep_bits if threshold else lse  # never read without dropout
    common = dict(HEAD_DIM=head_dim, DROPOUT=threshold > 0, PRECISION=_precision(query.dtype), INTERPRETED=INTERPRETED)
    forward, key_value = FORWARD_SHAPE, KEY_VALUE_SHAPE
    # per program, the column sums of its dK and dV, and of its dQ where a kernel of ours computes dQ
    key_value_sums = (lse.new_empty(batch, _blocks(keys, key_value.block_keys), 2, heads, head_dim) if bias_sums
                      else None)
    query_sums = (lse.new_empty(batch, _blocks(queries, forward.block_queries), heads, head_dim)
                  if bias_sums and not dq_by_gemm else None)
    if batch * heads and queries and keys:
        _launch(attention_backward_delta_kernel, (batch * heads, _blocks(delta.shape[-1], ROWSUM_BLOCK)),
            out, grad_out, lse, delta, lse2, heads, queries, *_strides(out), *_strides(grad_out), lse.stride(1),
            delta.stride(0), HEAD_DIM=head_dim, BLOCK_M=ROWSUM_BLOCK, INTERPRETED=INTERPRETED,
            num_warps=ROWSUM_WARPS)
        transposed = key_value_transposed(query.device)
        key_value_codes, *key_value_strides = _codes_args(codes, transposed)
        table_arg, *table_strides, dense = _table_args(kernel_table, transposed)
        programs = (batch * heads, _blocks(keys, key_value.block_keys))
        grid = (math.prod(programs),)
        # dS's skipped tiles are written (as 0) for cuBLAS, which reads every tile, or where the
        # forward's tiles (what the other readers walk) are not the key/value pass's own
        zero_skipped = write_scores and (dq_by_gemm or forward[:2] != key_value[:2])
        constants = dict(DENSE=dense, BLOCK_M=key_value.block_queries, BLOCK_N=key_value.block_keys,
                         TRANSPOSED=transposed, WRITE_DS=write_scores, ZERO_SKIPPED=zero_skipped,
                         BIAS_SUMS=bias_sums, **common)

        def launch(launch_shape: KernelShape):
            return _launch(attention_backward_key_value_kernel, grid,
                query, key, value, grad_out, key_value_codes, query_tiles, table_arg, bits_arg, lse2, delta, dk, dv,
                score_grad, _sums_arg(key_value_sums, lse2), heads, queries, keys, *_strides(query), *_strides(key),
                *_strides(value), *_strides(grad_out), *_strides(dk), *_strides(dv), *_strides(score_grad),
                *key_value_strides, query_tiles.stride(0), query_tiles.stride(1), *table_strides, delta.stride(0),
                *bits_strides, *_sums_strides(key_value_sums, 3), scale, keep_scale, **constants,
                **launch_shape.launch_options())

        _tuned_launch(attention_backward_key_value_kernel, key_value, programs,
                      (_blocks(queries, key_value.block_queries), constants), launch, query.device)
        if dq_by_gemm:
            _query_grad_from_scores(dq, score_grad, key, scale)
        elif dq_reads_scores:
            _query_grad_over_tiles(dq, score_grad, key, key_tiles, scale, common["PRECISION"], query_sums)
        else:
            forward_codes, *forward_strides = _codes_args(codes, False)
            table_arg, *table_strides, dense = _table_args(kernel_table, False)
            programs = (batch * heads, _blocks(queries, forward.block_queries))
            grid = (math.prod(programs),)
            constants = dict(BLOCK_M=forward.block_queries, BLOCK_N=forward.block_keys, DENSE=dense,
                             BIAS_SUMS=bias_sums, **common)

            def launch(launch_shape: KernelShape):
                return _launch(attention_backward_query_kernel, grid,
                    query, key, value, grad_out, forward_codes, key_tiles, table_arg, bits_arg, lse2, delta, dq,
                    _sums_arg(query_sums, lse2), heads, queries, keys, *_strides(query), *_strides(key),
                    *_strides(value), *_strides(grad_out), *_strides(dq), *forward_strides, key_tiles.stride(0),
                    key_tiles.stride(1), *table_strides, delta.stride(0), *bits_strides,
                    *_sums_strides(query_sums, 2), scale, keep_scale, **constants, **launch_shape.launch_options())

            _tuned_launch(attention_backward_query_kernel, forward, programs, (_blocks(keys, forward.block_keys),
                                                                                 constants), launch, query.device)
    else:
        for tensor in (dq, dk, dv):
            tensor.zero_()
    if write_scores:
        bins = table.shape[1]
        # reading only the tiles the forward walked: the others' pairs are all BLOCKED (no bin)
        table_grad = (bucket_sums.bucket_sums(score_grad, codes[:, 0, :queries, :keys], bins, key_tiles,
                                              FORWARD_SHAPE.block_queries, FORWARD_SHAPE.block_keys)
                      if queries and keys else torch.zeros(heads, bins, dtype=torch.float32, device=query.device))
    else:
        table_grad = query.new_empty(0, dtype=torch.float32)
    if not bias_sums:
        return table_grad, None
    if not (batch * heads and queries and keys):
        return table_grad, lse.new_zeros(3, heads, head_dim)
    # dQ by cuBLAS: its column sums by torch (fp32 sums of what the GEMM wrote, as autograd's)
    query_part = query_sums.sum((0, 1)) if query_sums is not None else dq.sum((0, 2), dtype=torch.float32)
    return table_grad, torch.cat([query_part[None], key_value_sums.sum((0, 1))])


@bucket_attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, keep_bits, codes, key_tiles, query_tiles, table, kernel_table, dropout_p,
      scale, table_gradient):
    batch, heads, queries, head_dim = query.shape
    keys = key.shape[2]
    bins = table.shape[1] if table is not None and table_gradient else None
    return (_heads_last(batch, queries, heads, head_dim, query), _heads_last(batch, keys, heads, head_dim, key),
            _heads_last(batch, keys, heads, head_dim, value),
            query.new_empty((heads, bins) if bins is not None else (0,), dtype=torch.float32))


def _setup_context(ctx, inputs, output):
    query, key, value, codes, key_tiles, query_tiles, table, kernel_table, dropout_p, scale = inputs
    out, lse, _, keep_bits = output
    ctx.save_for_backward(query, key, value, out, lse, keep_bits, codes, key_tiles, query_tiles, table, kernel_table)
    ctx.dropout_p, ctx.scale = dropout_p, scale


def _backward(ctx, grad_out, grad_lse, grad_seed, grad_keep_bits):
    query, key, value, out, lse, keep_bits, codes, key_tiles, query_tiles, table, kernel_table = ctx.saved_tensors
    table_gradient = table is not None and ctx.needs_input_grad[6]
    dq, dk, dv, table_grad = torch.ops.megatron_pmlm.bucket_attention_backward(
        grad_out, query, key, value, out, lse, keep_bits, codes, key_tiles, query_tiles, table, kernel_table,
        ctx.dropout_p, ctx.scale, table_gradient)
    return (dq, dk, dv, None, None, None, table_grad.to(table.dtype) if table_gradient else None, None, None, None)


bucket_attention_forward.register_autograd(_backward, setup_context=_setup_context)


def unpacked(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v as [B, heads, T, head_dim] views of a fused projection's output [B, T, 3 x heads x
    head_dim] (query, key, value stacked in that order along the last dimension)."""
    batch, length, width = qkv.shape
    split = qkv.view(batch, length, 3, heads, width // (3 * heads))
    return tuple(split[:, :, part].transpose(1, 2) for part in range(3))


@torch.library.custom_op("megatron_pmlm::bucket_attention_packed", mutates_args=())
def bucket_attention_packed_forward(qkv: torch.Tensor, heads: int, codes: torch.Tensor, key_tiles: torch.Tensor,
                                    query_tiles: torch.Tensor, table: torch.Tensor | None,
                                    kernel_table: torch.Tensor, dropout_p: float, scale: float,
                                    projection_bias: torch.Tensor | None = None
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`bucket_attention_forward` with q, k, v read from one fused projection's output [B, T, 3 x
    heads x head_dim] (`unpacked`): its backward writes their gradients into one tensor of that
    shape, the fused projection's output gradient, so no concatenation copies them together
    (1.6 ms of a compiled step at seq 128 x 256 on an H100 was that copy). `projection_bias`: the
    projection's bias, already in `qkv` (added detached), not read here: its gradient, the column sums
    of qkv's, comes from the backward kernels (`PROJECTION_BIAS_SUMS`)."""
    return _forward(*unpacked(qkv, heads), codes, key_tiles, query_tiles, table, kernel_table, dropout_p, scale)


@bucket_attention_packed_forward.register_fake
def _(qkv, heads, codes, key_tiles, query_tiles, table, kernel_table, dropout_p, scale, projection_bias=None):
    query, key, value = unpacked(qkv, heads)
    return _forward_fake(query, key, value, codes, key_tiles, query_tiles, table, kernel_table, dropout_p, scale)


@torch.library.custom_op("megatron_pmlm::bucket_attention_packed_backward", mutates_args=())
def bucket_attention_packed_backward(grad_out: torch.Tensor, qkv: torch.Tensor, heads: int, out: torch.Tensor,
                                     lse: torch.Tensor, keep_bits: torch.Tensor, codes: torch.Tensor,
                                     key_tiles: torch.Tensor, query_tiles: torch.Tensor, table: torch.Tensor | None,
                                     kernel_table: torch.Tensor, dropout_p: float, scale: float,
                                     table_gradient: bool, bias_gradient: bool = False
                                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the gradient of `qkv`, in its shape, the table's fp32 gradient [heads, bins] or empty, and with
    `bias_gradient` the column sums of qkv's gradient, fp32 [3 x heads x head_dim], or empty)."""
    grad_qkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
    table_grad, bias_grad = _backward_into(*unpacked(grad_qkv, heads), grad_out, *unpacked(qkv, heads), out, lse,
                                           keep_bits, codes, key_tiles, query_tiles, table, kernel_table, dropout_p,
                                           scale, table_gradient, bias_gradient)
    return grad_qkv, table_grad, bias_grad.flatten() if bias_gradient else qkv.new_empty(0, dtype=torch.float32)


@bucket_attention_packed_backward.register_fake
def _(grad_out, qkv, heads, out, lse, keep_bits, codes, key_tiles, query_tiles, table, kernel_table, dropout_p, scale,
      table_gradient, bias_gradient=False):
    bins = table.shape[1] if table is not None and table_gradient else None
    return (torch.empty_like(qkv, memory_format=torch.contiguous_format),
            qkv.new_empty((heads, bins) if bins is not None else (0,), dtype=torch.float32),
            qkv.new_empty(qkv.shape[-1] if bias_gradient else 0, dtype=torch.float32))


def _setup_packed_context(ctx, inputs, output):
    qkv, heads, codes, key_tiles, query_tiles, table, kernel_table, dropout_p, scale, projection_bias = inputs
    out, lse, _, keep_bits = output
    ctx.save_for_backward(qkv, out, lse, keep_bits, codes, key_tiles, query_tiles, table, kernel_table)
    ctx.heads, ctx.dropout_p, ctx.scale = heads, dropout_p, scale
    ctx.bias_dtype = None if projection_bias is None else projection_bias.dtype


def _packed_backward(ctx, grad_out, grad_lse, grad_seed, grad_keep_bits):
    qkv, out, lse, keep_bits, codes, key_tiles, query_tiles, table, kernel_table = ctx.saved_tensors
    table_gradient = table is not None and ctx.needs_input_grad[5]
    bias_gradient = ctx.bias_dtype is not None and ctx.needs_input_grad[9]
    grad_qkv, table_grad, bias_grad = torch.ops.megatron_pmlm.bucket_attention_packed_backward(
        grad_out, qkv, ctx.heads, out, lse, keep_bits, codes, key_tiles, query_tiles, table, kernel_table,
        ctx.dropout_p, ctx.scale, table_gradient, bias_gradient)
    return (grad_qkv, None, None, None, None, table_grad.to(table.dtype) if table_gradient else None, None, None,
            None, bias_grad.to(ctx.bias_dtype) if bias_gradient else None)


bucket_attention_packed_forward.register_autograd(_packed_backward, setup_context=_setup_packed_context)


def bucket_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, inputs: BucketAttentionInputs,
                     dropout_p: float = 0.0, scale: float | None = None) -> torch.Tensor:
    """softmax(scale x q k^T + bias) v with attention dropout, bias[b, h, i, j] = table[h, codes[b, i, j]]
    (-inf where codes is BLOCKED): [B, heads, queries, head_dim] (a view of [B, queries, heads,
    head_dim] memory), differentiable in q, k, v and the table. `inputs`: `kernel_inputs(codes,
    table)`, which the model makes once per micro batch for every layer."""
    if not runs_on(query.device):
        raise ConfigError(device_problem(query.device))
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return bucket_attention_forward(query, key, value, inputs.padded_codes, inputs.tiles.key_tiles,
                                    inputs.tiles.query_tiles, inputs.table, inputs.kernel_table, float(dropout_p),
                                    float(scale))[0]


def bucket_attention_packed(qkv: torch.Tensor, heads: int, inputs: BucketAttentionInputs, dropout_p: float = 0.0,
                            scale: float | None = None, projection_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`bucket_attention` of the q, k, v a fused projection wrote side by side ([B, T, 3 x heads x
    head_dim], `unpacked`), whose gradient comes back as one tensor of that shape. `projection_bias`
    ([3 x heads x head_dim], `summed_bias`): the projection's bias, which `qkv` already holds (added
    detached), given its gradient here, the column sums of qkv's gradient, from the backward kernels."""
    if not runs_on(qkv.device):
        raise ConfigError(device_problem(qkv.device))
    if qkv.dim() != 3 or qkv.shape[-1] % (3 * heads) or qkv.stride(-1) != 1:
        raise ValueError(f"bucket_attention_packed: qkv must be [B, T, 3 x {heads} heads x head size] with a "
                         f"contiguous last dimension, got {tuple(qkv.shape)} strides {qkv.stride()}")
    if projection_bias is not None and tuple(projection_bias.shape) != (qkv.shape[-1],):
        raise ValueError(f"bucket_attention_packed: projection_bias must be [{qkv.shape[-1]}] (qkv's last "
                         f"dimension), got {tuple(projection_bias.shape)}")
    head_dim = qkv.shape[-1] // (3 * heads)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    return bucket_attention_packed_forward(qkv, heads, inputs.padded_codes, inputs.tiles.key_tiles,
                                           inputs.tiles.query_tiles, inputs.table, inputs.kernel_table,
                                           float(dropout_p), float(scale), projection_bias)[0]


def summed_bias(linears) -> torch.Tensor | None:
    """The stacked biases of a fused Q, K, V projection (`nn.Linear`s, biases trained, not partitioned
    by ZeRO-3) when their gradient is to come from the kernels (`PROJECTION_BIAS_SUMS`, training with
    gradients), else None (autograd's way: megatron-core's layers keep theirs)."""
    if not (PROJECTION_BIAS_SUMS and torch.is_grad_enabled()):
        return None
    biases = [getattr(linear, "bias", None) for linear in linears]
    if not all(type(linear) is torch.nn.Linear and bias is not None and bias.requires_grad
               and not hasattr(bias, "ds_id") for linear, bias in zip(linears, biases)):
        return None
    return torch.cat(biases)


@contextlib.contextmanager
def _module_setting(name: str, value):
    """This module's setting `name` (read at launch) set to `value` inside the block."""
    saved, globals()[name] = globals()[name], value
    try:
        yield
    finally:
        globals()[name] = saved


def dq_from_scores(enabled: bool):
    """dQ by the GEMM over dS (`DQ_FROM_SCORES`) or by its own kernel inside the block: how the
    attention tool times both."""
    return _module_setting("DQ_FROM_SCORES", enabled)


def dq_over_tiles(enabled: bool):
    """dQ from dS by our kernel over the listed tiles (`DQ_OVER_TILES`) or by cuBLAS inside the block:
    how the attention tool times both."""
    return _module_setting("DQ_OVER_TILES", enabled)


def dropout_bits_apart(enabled: bool):
    """The attention dropout's bits drawn by their own kernel before the forward (`DROPOUT_BITS_APART`)
    or by the forward itself inside the block: how the attention tool times both."""
    return _module_setting("DROPOUT_BITS_APART", enabled)


def dense_bias(enabled: bool):
    """`kernel_inputs` builds the dense kernel bias (`DENSE_BIAS`) inside the block, or not: how the
    attention tool times both."""
    return _module_setting("DENSE_BIAS", enabled)


def key_value_tiles(transposed: bool | None):
    """The dK, dV, dS kernel's tiles transposed (True), as [queries, keys] (False) or by the device
    (None) inside the block (`KEY_VALUE_TRANSPOSED`)."""
    return _module_setting("KEY_VALUE_TRANSPOSED", transposed)


@contextlib.contextmanager
def kernel_shapes(forward: KernelShape, key_value: KernelShape):
    """Launch the kernels as `forward` (forward, dQ) and `key_value` (dK, dV, dS) inside the block,
    untuned: how the attention tool times other tiles and launch options. Tile lists made inside the block
    are in its tiles (the kernels refuse lists of other tiles)."""
    global FORWARD_SHAPE, KEY_VALUE_SHAPE, SHAPES_PINNED
    problem = shape_problem(forward) or key_value_shape_problem(key_value)
    if problem:
        raise ValueError(problem)
    saved = FORWARD_SHAPE, KEY_VALUE_SHAPE, SHAPES_PINNED
    FORWARD_SHAPE, KEY_VALUE_SHAPE, SHAPES_PINNED = forward, key_value, True
    try:
        yield
    finally:
        FORWARD_SHAPE, KEY_VALUE_SHAPE, SHAPES_PINNED = saved


def stored_keep_mask(keep_bits: torch.Tensor, queries: int, keys: int) -> torch.Tensor:
    """bool [B, heads, queries, keys] from the forward's kept-pair bits (tests and checks): in each
    block of 64 keys, bit k of byte c is key 8k + c (the kernels' `dropout_keep`)."""
    bits = torch.arange(8, device=keep_bits.device, dtype=torch.uint8)
    kept = (keep_bits[..., :queries, :, None] >> bits) & 1  # [.., groups, k]
    kept = kept.unflatten(-2, (-1, 8)).transpose(-1, -2)  # [.., block, k, c]
    return kept.bool().flatten(-3)[..., :keys]


def dropout_keep_mask(seed: torch.Tensor, batch: int, heads: int, queries: int, keys: int,
                      dropout_p: float) -> torch.Tensor:
    """bool [batch, heads, queries, keys]: the pairs the kernels keep for `seed`, drawn again by a
    kernel of their own (tests and checks: the forward's bits are these)."""
    from .bucket_attention_triton import dropout_keep_kernel

    threshold, _ = dropout_threshold(dropout_p)
    keep = torch.empty(batch, heads, queries, keys, dtype=torch.int8, device=seed.device)
    if keep.numel():
        block = 64  # any tile draws the same bits
        dropout_keep_kernel[(batch * heads, _blocks(queries, block))](
            seed, keep, heads, queries, keys, threshold, BLOCK_M=block, BLOCK_N=block, INTERPRETED=INTERPRETED)
    return keep.bool()


def reference_attention(query, key, value, codes, table, keep=None, dropout_p: float = 0.0,
                        scale: float | None = None) -> torch.Tensor:
    """The same attention in plain torch ops with a dense bias (tests): `keep` the dropout mask."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    allowed = codes != BLOCKED
    if table is not None:
        bias = table[:, codes.long().clamp(max=table.shape[1] - 1)].permute(1, 0, 2, 3)
    else:
        bias = torch.zeros(codes.shape, dtype=query.dtype, device=query.device)[:, None]
    scores = query @ key.transpose(-1, -2) * scale + bias
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, -1).nan_to_num(0.0)  # a row that sees no key: output 0
    if keep is not None:
        _, keep_scale = dropout_threshold(dropout_p)
        probs = probs * keep * keep_scale
    return probs @ value
