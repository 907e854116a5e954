"""The Triton kernels behind `bucket_attention` (imported only where Triton is installed).

Flash attention (online softmax, nothing [T, T] kept between the passes) whose additive bias is read
per tile from a uint8 code per query-key pair: the pair's relative-distance bucket, whose bias is
`table[head, bucket]`, or BLOCKED where the attention rule forbids the pair (-inf). The softmax
runs in base 2 (`exp2`, the kernel table holding the bias times log2 e). Attention dropout is drawn
from Philox, keyed by a seed tensor and the pair's row and group; each Philox call gives 128 bits,
cut into eight 16-bit draws for eight keys a thread of the tensor cores' layout holds, so a tile
needs one call per eight pairs. The draws are kept as bits (1/8 byte a pair and head), drawn by a
kernel of their own before the forward (by default) or by the forward itself, and every pass reads
them instead of drawing again: Philox's rounds (~60 integer instructions a call, at half the rate of
float arithmetic) would cost each pass more than its matrix products. A tile whose
pairs are all BLOCKED (PMLM's context rows against the pseudo tokens' keys, padding: ~25% of the
tiles on real data) is skipped: each program walks a list of the tiles it has work in
(`bucket_attention.tile_lists`).

- `attention_forward_kernel`: one program per (sequence x head, block of queries), over its listed
  blocks of keys; writes the output, each row's log-sum-exp (+inf for a row that sees no key: its
  output is 0) and, with dropout, the kept pairs' bits (or reads them, BITS_DRAWN).
- `attention_dropout_bits_kernel`: the kept pairs' bits of the same tiles, drawn before the forward
  (`bucket_attention.DROPOUT_BITS_APART`).
- `attention_backward_delta_kernel`: rowsum(dO * O) and the base-2 log-sum-exp per query, padded,
  for both backward kernels.
- `attention_backward_key_value_kernel`: one program per (sequence x head, block of keys), over its
  listed blocks of queries (each tile transposed, keys x queries, on SM 9.0): dK, dV and, when
  asked, dS (the bias's gradient; 0 in skipped tiles).
- `attention_backward_query_kernel`: one program per (sequence x head, block of queries), over its
  listed blocks of keys: dQ.
- `attention_query_grad_from_scores_kernel`: dQ from dS over the forward's listed tiles.

With BIAS_SUMS the dK, dV and dQ kernels also write their accumulators' column sums, from which the
fused Q, K, V projection's bias gradient is summed (`bucket_attention.PROJECTION_BIAS_SUMS`).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.errors import InterpreterError
from triton.runtime.interpreter import InterpretedFunction


class InterpretedDeviceFunction(InterpretedFunction):
    """A helper in Triton's interpreter, called as the interpreter's own call does once it has
    patched triton.language (which the calling kernel's launch has done for this module)."""

    def __call__(self, *args, **kwargs):
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as error:
            raise InterpreterError(repr(error)) from error


def device_function(function):
    """`triton.jit` for a function the kernels call. In Triton's interpreter (TRITON_INTERPRET=1, the
    CPU tests) every call of a jitted function patches triton.language again for the function's
    module: ~30% of an interpreted kernel's time, with nothing to patch here, since the launch of a
    kernel of the same module (the same globals) has patched it. Triton's own jitted helpers
    (tl.zeros, tl.cdiv, tl.max, tl.sum) patch it too: the kernels call what those call (tl.full,
    integer division; `row_max` and `row_sum` the reductions in the interpreter)."""
    jitted = triton.jit(function)
    if type(jitted) is InterpretedFunction and hasattr(jitted, "rewrite"):
        jitted.__class__ = InterpretedDeviceFunction
    return jitted  # on a GPU (or another Triton's interpreter): Triton's own, as it is


@device_function
def mm(a, b, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """a @ b with fp32 accumulation. In Triton's interpreter (whose tl.dot misreads bf16 operands in
    Triton 3.9) the same values are multiplied in fp32: operands are rounded to the input dtype
    first, as on a GPU."""
    if INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


PHILOX_ROUNDS = tl.constexpr(7)
"""Philox4x32 rounds a dropout draw takes: 7, as FlashAttention's dropout (and PyTorch's SDPA flash
kernel built from it: 6 rounds and a last one in `philox.cuh`), the fewest its authors found to pass
TestU01's BigCrush (Salmon et al., 2011); Triton's default 10 would cost 30% more of the forward's
Philox instructions, the largest part of its loop."""
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@device_function
def exp2(x, INTERPRETED: tl.constexpr):
    """2^x in fp32. On a GPU with results under 2^-126 flushed to 0: one MUFU.EX2 an element instead
    of MUFU.EX2 behind a range check and two multiplies (`tl.exp2`'s subnormal handling), and a
    softmax term 2^-126 below its row's largest adds nothing to the row."""
    if INTERPRETED:
        return tl.exp2(x)
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@device_function
def row_max(x, INTERPRETED: tl.constexpr):
    """tl.max(x, 1) of fp32 x. In Triton's interpreter tl.max, itself a jitted function, patches
    triton.language again at every call (~2 ms, 18% of an interpreted forward kernel's time): there
    its reduction is called directly, which the interpreter computes with numpy as it computes tl.max."""
    if INTERPRETED:
        return tl.reduce(x, 1, tl.standard._elementwise_max)
    return tl.max(x, 1)


@device_function
def row_sum(x, INTERPRETED: tl.constexpr):
    """tl.sum(x, 1) of fp32 x; in Triton's interpreter its reduction called directly, as `row_max`'s."""
    if INTERPRETED:
        return tl.reduce(x, 1, tl.standard._sum_combine)
    return tl.sum(x, 1)


@device_function
def column_sum(x, INTERPRETED: tl.constexpr):
    """tl.sum(x, 0) of fp32 x; in Triton's interpreter its reduction called directly, as `row_max`'s."""
    if INTERPRETED:
        return tl.reduce(x, 0, tl.standard._sum_combine)
    return tl.sum(x, 0)


@device_function
def store_bias_sums(sums_ptr, grad, sequence, head, block, sums_stride_b, sums_stride_block, dims,
                    HEAD_DIM: tl.constexpr, INTERPRETED: tl.constexpr):
    """The column sums of this program's [rows, head size] gradient accumulator (fp32, before its
    rounding to the gradient's dtype), at [sequence, block, head] of a [B, blocks, ..., heads, head
    size] buffer: summed over sequences and blocks they are the projection bias's gradient for this
    head (`bucket_attention`'s PROJECTION_BIAS_SUMS). Rows past the sequence hold 0 (nothing sees
    them), so the sums need no mask; once per program, after its loop."""
    tl.store(sums_ptr + sequence * sums_stride_b + block * sums_stride_block + head * HEAD_DIM + dims,
             column_sum(grad, INTERPRETED))


@device_function
def computed_once(x, INTERPRETED: tl.constexpr):
    """x, through an opaque copy on a GPU. The draws feed two layouts (the kept bits' coalesced store,
    the accumulator's), and Triton recomputes a cheap-looking chain in each layout rather than move
    values between threads: Philox twice a tile. It does not duplicate inline PTX with side effects,
    so behind this copy Philox runs once and the draws move (the forward's loop: 1,077 -> 1,006
    instructions a tile, `tools/bench_kernel_code.py`)."""
    if INTERPRETED:
        return x
    return tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=x.dtype, is_pure=False, pack=1)


@device_function
def dropout_keep(seed, sequence_head, rows, column_start, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 INTERPRETED: tl.constexpr):
    """([BLOCK_M, BLOCK_N] booleans: which pairs (rows, column_start + j) dropout keeps, the same as
    [BLOCK_M, BLOCK_N / 8] uint8 bytes: `stored_keep`'s layout), drawn by `kept_bytes`."""
    packed = kept_bytes(seed, sequence_head, rows, column_start, threshold, BLOCK_M, BLOCK_N, INTERPRETED)
    return unpacked_keep(packed, BLOCK_M, BLOCK_N), packed.to(tl.uint8)


@device_function
def kept_bytes(seed, sequence_head, rows, column_start, threshold, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               INTERPRETED: tl.constexpr):
    """[BLOCK_M, BLOCK_N / 8] int32 bytes: bit k of byte 8 x block + c set where dropout keeps the pair
    (rows, key 64 x block + 8k + c). A pair is kept when its 16-bit
    draw is >= threshold (the drop probability x 65536). One Philox call (counter: the group, the
    row, the sequence and head) draws the 8 pairs of a group: in each block of 64 keys, group c
    (0-7) holds keys c, c + 8, ..., c + 56, its draw k the key 8k + c and bit k of byte 8 x block + c.
    A thread of the tensor cores' accumulator layout holds whole groups (columns 8k + c for its c),
    so a group's eight draws are one thread's Philox call; the groups are counted from the row's
    first key, so any tiling whose key blocks are multiples of 64 draws the same bits."""
    groups = column_start // 8 + tl.arange(0, BLOCK_N // 8)  # 8 x block + c
    zeros = tl.full((BLOCK_M, BLOCK_N // 8), 0, dtype=tl.uint32)
    group = zeros + groups[None, :].to(tl.uint32)
    row = zeros + rows[:, None].to(tl.uint32)
    stream = zeros + sequence_head.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, group, row, stream, zeros, PHILOX_ROUNDS)
    r0, r1 = computed_once(r0, INTERPRETED), computed_once(r1, INTERPRETED)
    r2, r3 = computed_once(r2, INTERPRETED), computed_once(r3, INTERPRETED)
    # The draws are the 16-bit halves; each compared in the high half of an unsigned word (the high
    # half as it is: one instruction), with the threshold shifted there too.
    high = threshold.to(tl.uint32) << 16
    k0, k1 = (r0 << 16) >= high, r0 >= high
    k2, k3 = (r1 << 16) >= high, r1 >= high
    k4, k5 = (r2 << 16) >= high, r2 >= high
    k6, k7 = (r3 << 16) >= high, r3 >= high
    return (k0.to(tl.int32) | (k1.to(tl.int32) << 1) | (k2.to(tl.int32) << 2) | (k3.to(tl.int32) << 3)
            | (k4.to(tl.int32) << 4) | (k5.to(tl.int32) << 5) | (k6.to(tl.int32) << 6) | (k7.to(tl.int32) << 7))


@device_function
def unpacked_keep(byte, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] booleans from [BLOCK_M, BLOCK_N / 8] int32 bytes (`dropout_keep`'s groups:
    bit k of byte 8 x block + c is key 64 x block + 8k + c), each key's bit shifted out of its
    group's byte, broadcast over k. Triton moves the bytes between the layouts (1/8 of the pairs):
    built from the eight draws by nested joins instead, it moved the spread booleans through shared
    memory, four times a tile (the forward's loop: 997 -> 878 instructions, 12 -> 6 barriers a tile,
    `tools/bench_kernel_code.py`)."""
    by_block = tl.reshape(byte, (BLOCK_M, BLOCK_N // 64, 1, 8))  # [rows, block, 1, c]
    draw = tl.arange(0, 8)[None, None, :, None]  # k
    return tl.reshape((tl.broadcast_to(by_block, (BLOCK_M, BLOCK_N // 64, 8, 8)) >> draw) & 1,
                      (BLOCK_M, BLOCK_N)) != 0


@device_function
def stored_keep(bits_ptr, sequence_head, rows, column_start, bits_stride_bh, bits_stride_t,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BLOCK_M, BLOCK_N] booleans: the pairs (rows, column_start + j) the forward kept, read from its
    bits, a byte a group (`dropout_keep`; the bits cover whole tiles, so no bounds mask)."""
    byte = tl.load(bits_address(bits_ptr, sequence_head, rows, column_start, bits_stride_bh, bits_stride_t,
                                BLOCK_N)).to(tl.int32)
    return unpacked_keep(byte, BLOCK_M, BLOCK_N)


@device_function
def bits_address(bits_ptr, sequence_head, rows, column_start, bits_stride_bh, bits_stride_t, BLOCK_N: tl.constexpr):
    """[rows, BLOCK_N / 8] addresses of the kept pairs' bytes for keys column_start... (a byte a
    `dropout_keep` group): where the forward stores them and the backward reads them."""
    groups = column_start // 8 + tl.arange(0, BLOCK_N // 8)
    return bits_ptr + sequence_head.to(tl.int64) * bits_stride_bh + rows[:, None] * bits_stride_t + groups[None, :]


@device_function
def rows_of(ptr, sequence, head, stride_b, stride_h, stride_t, rows, dims, count):
    """The [rows, head size] tile of one (sequence, head) of a [B, heads, T, head size] tensor
    (any strides, the last 1), zeros past `count` rows."""
    return tl.load(ptr + sequence * stride_b + head * stride_h + rows[:, None] * stride_t + dims[None, :],
                   mask=(rows < count)[:, None], other=0.0)


@device_function
def store_rows(ptr, value, sequence, head, stride_b, stride_h, stride_t, rows, dims, count):
    """`rows_of`'s inverse: `value` stored in the tensor's dtype, rows past `count` left alone."""
    tl.store(ptr + sequence * stride_b + head * stride_h + rows[:, None] * stride_t + dims[None, :],
             value.to(ptr.dtype.element_ty), mask=(rows < count)[:, None])


@device_function
def program_tile(heads, length, BLOCK: tl.constexpr):
    """(sequence x head index, sequence, head, this program's block, its BLOCK rows or keys) of a
    one-dimensional grid of B x heads x blocks programs (blocks of BLOCK over `length`), the blocks
    of one (sequence, head) numbered together. A GPU starts programs in the order of their numbers,
    so the programs of one head run at the same time and share the keys and values (the forward,
    dQ) or the queries and output gradients (dK, dV) they all walk in L2: read from HBM once a head,
    not once a block, as a grid ordered heads first did (its next block of a head came B x heads
    programs later, after more data than L2 holds: 11 reads at seq 512, 3 at seq 128). FlashAttention's
    grids put the query blocks first for the same reason."""
    blocks = (length + BLOCK - 1) // BLOCK
    program = tl.program_id(0)
    sequence_head = program // blocks
    block = program % blocks
    index = block * BLOCK + tl.arange(0, BLOCK)
    return (sequence_head, (sequence_head // heads).to(tl.int64), (sequence_head % heads).to(tl.int64), block,
            index)


@device_function
def biased_scores(a, b, codes_ptr, table_ptr, table_row, rows, cols, code_stride, scale,
                  DENSE: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """The tile's scores in base 2 (log2 e x (scale x a @ b^T + bias)), which `exp2` takes as they
    are: the kernel's bias holds the table's values times log2 e, so the scale, the bias and the
    change of base are one fused multiply-add a pair. (a, b): (q, k) for the [queries, keys] tile,
    (k, q) for its transpose; `rows`, `cols`: the tile's rows and columns in the codes (or dense
    bias) read. The bias is `table[head, code]`, gathered per pair through the codes, or with DENSE
    read as it lies in the dense bias (`dense_kernel_bias`: the same values, built once per micro
    batch), whose rows are as long as the codes'. BLOCKED's entry is -inf, and the padded codes are
    BLOCKED past [queries, keys], so the forbidden pairs and those outside the sequence get -inf
    with no mask: one load and one add a pair."""
    if DENSE:
        scores = mm(a, tl.trans(b), PRECISION, INTERPRETED) * (scale * LOG2E)
        return scores + tl.load(table_ptr + table_row + rows[:, None] * code_stride + cols[None, :]).to(tl.float32)
    code = tl.load(codes_ptr + rows[:, None] * code_stride + cols[None, :])
    # the product issued before the gather, whose values are not held across it (26 registers fewer in the forward)
    return mm(a, tl.trans(b), PRECISION, INTERPRETED) * (scale * LOG2E) + tl.load(table_ptr + table_row + code)


@device_function
def table_offset(sequence, head, table_stride_b, table_stride_h, DENSE: tl.constexpr):
    """Where this (sequence, head)'s bias starts: its dense bias, or its row of the table (which every
    sequence shares: no term for the sequence, whose product costs the forward 26 registers)."""
    if DENSE:
        return sequence * table_stride_b + head * table_stride_h
    return head * table_stride_h


@triton.jit
def attention_forward_kernel(
        q_ptr, k_ptr, v_ptr, codes_ptr, key_tiles_ptr, table_ptr, seed_ptr, out_ptr, lse_ptr, bits_ptr,
        heads, queries, keys,
        q_stride_b, q_stride_h, q_stride_t, k_stride_b, k_stride_h, k_stride_t,
        v_stride_b, v_stride_h, v_stride_t, o_stride_b, o_stride_h, o_stride_t,
        code_stride_b, code_stride_t, tiles_stride_b, tiles_stride_t, table_stride_b, table_stride_h, lse_stride_bh,
        bits_stride_bh, bits_stride_t, scale, threshold, keep_scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DENSE: tl.constexpr,
        DROPOUT: tl.constexpr, BITS_DRAWN: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """BITS_DRAWN: with dropout, the kept pairs read from the bits `attention_dropout_bits_kernel`
    wrote for these tiles; otherwise drawn here (and stored for the backward)."""
    sequence_head, sequence, head, block, rows = program_tile(heads, queries, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_valid = rows < queries
    tiles = key_tiles_ptr + sequence * tiles_stride_b + block * tiles_stride_t
    q = rows_of(q_ptr, sequence, head, q_stride_b, q_stride_h, q_stride_t, rows, dims, queries)
    codes_base = codes_ptr + sequence * code_stride_b
    table_row = table_offset(sequence, head, table_stride_b, table_stride_h, DENSE)
    seed = 0
    if DROPOUT and not BITS_DRAWN:
        seed = tl.load(seed_ptr)
    running_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    running_sum = tl.full((BLOCK_M,), 0, dtype=tl.float32)
    acc = tl.full((BLOCK_M, HEAD_DIM), 0, dtype=tl.float32)
    for tile in range(0, tl.load(tiles)):  # the key blocks holding a pair this block's queries see
        column_start = tl.load(tiles + 1 + tile) * BLOCK_N
        cols = column_start + tl.arange(0, BLOCK_N)
        k = rows_of(k_ptr, sequence, head, k_stride_b, k_stride_h, k_stride_t, cols, dims, keys)
        v = rows_of(v_ptr, sequence, head, v_stride_b, v_stride_h, v_stride_t, cols, dims, keys)
        scores = biased_scores(q, k, codes_base, table_ptr, table_row, rows, cols, code_stride_t, scale,
                               DENSE, PRECISION, INTERPRETED)
        new_max = tl.maximum(running_max, row_max(scores, INTERPRETED))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with no key so far
        p = exp2(scores - safe_max[:, None], INTERPRETED)
        correction = exp2(running_max - safe_max, INTERPRETED)
        running_sum = running_sum * correction + row_sum(p, INTERPRETED)
        if DROPOUT and BITS_DRAWN:  # the bits drawn beforehand for this tile
            keep = stored_keep(bits_ptr, sequence_head, rows, column_start, bits_stride_bh, bits_stride_t,
                               BLOCK_M, BLOCK_N)
            p = tl.where(keep, p, 0.0)
        elif DROPOUT:
            keep, packed = dropout_keep(seed, sequence_head, rows, column_start, threshold, BLOCK_M, BLOCK_N,
                                        INTERPRETED)
            p = tl.where(keep, p, 0.0)  # the kept terms; 1 / (1 - dropout) applied to the output once
            tl.store(bits_address(bits_ptr, sequence_head, rows, column_start, bits_stride_bh, bits_stride_t,
                                  BLOCK_N), packed)  # the bits cover whole tiles
        acc = acc * correction[:, None] + mm(p.to(v.dtype), v, PRECISION, INTERPRETED)
        running_max = new_max
    seen = running_sum > 0
    out = acc / tl.where(seen, running_sum, 1.0)[:, None]
    if DROPOUT:
        out *= keep_scale
    lse = tl.where(seen, (running_max + tl.log2(tl.where(seen, running_sum, 1.0))) * LN2, float("inf"))  # natural log
    store_rows(out_ptr, out, sequence, head, o_stride_b, o_stride_h, o_stride_t, rows, dims, queries)
    tl.store(lse_ptr + sequence_head.to(tl.int64) * lse_stride_bh + rows, lse, mask=row_valid)


@triton.jit
def attention_dropout_bits_kernel(seed_ptr, key_tiles_ptr, bits_ptr, heads, queries, tiles_stride_b, tiles_stride_t,
                                  bits_stride_bh, bits_stride_t, threshold, BLOCK_M: tl.constexpr,
                                  BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """The kept pairs' bits of the tiles a block of queries lists (`key_tiles`), as the forward kernel
    draws them (`kept_bytes`: the same bytes, stored where it stores them), for a forward that reads
    them (BITS_DRAWN): Philox's integer arithmetic here, at a kernel's full occupancy, and not in the
    forward's loop, whose registers it set (204 against 128 a thread: two programs an SM, not four,
    `tools/bench_kernel_code.py`)."""
    sequence_head, sequence, head, block, rows = program_tile(heads, queries, BLOCK_M)
    tiles = key_tiles_ptr + sequence * tiles_stride_b + block * tiles_stride_t
    seed = tl.load(seed_ptr)
    for tile in range(0, tl.load(tiles)):
        column_start = tl.load(tiles + 1 + tile) * BLOCK_N
        packed = kept_bytes(seed, sequence_head, rows, column_start, threshold, BLOCK_M, BLOCK_N, INTERPRETED)
        tl.store(bits_address(bits_ptr, sequence_head, rows, column_start, bits_stride_bh, bits_stride_t, BLOCK_N),
                 packed.to(tl.uint8))


@triton.jit
def attention_backward_delta_kernel(out_ptr, do_ptr, lse_ptr, delta_ptr, lse2_ptr, heads, queries,
                                    o_stride_b, o_stride_h, o_stride_t, do_stride_b, do_stride_h, do_stride_t,
                                    lse_stride_bh, stats_stride_bh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                                    INTERPRETED: tl.constexpr):
    """The backward kernels' per-row statistics, fp32 [B x heads, padded queries], in one pass over O
    and dO: delta = rowsum(dO * O) (the softmax backward's row term) and the log-sum-exp in base 2
    (what `exp2` takes). Written for every row of the padded length, 0 and +inf past the queries (a
    row that sees no key), so the backward kernels load them with no mask."""
    sequence_head = tl.program_id(0)  # grid (B x heads, blocks): one pass, nothing its blocks share
    sequence, head = (sequence_head // heads).to(tl.int64), (sequence_head % heads).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_valid = rows < queries
    out = rows_of(out_ptr, sequence, head, o_stride_b, o_stride_h, o_stride_t, rows, dims, queries).to(tl.float32)
    do = rows_of(do_ptr, sequence, head, do_stride_b, do_stride_h, do_stride_t, rows, dims, queries).to(tl.float32)
    lse = tl.load(lse_ptr + sequence_head.to(tl.int64) * lse_stride_bh + rows, mask=row_valid, other=float("inf"))
    stats = sequence_head.to(tl.int64) * stats_stride_bh + rows
    tl.store(delta_ptr + stats, row_sum(out * do, INTERPRETED))
    tl.store(lse2_ptr + stats, lse * LOG2E)


@triton.jit
def attention_backward_key_value_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, codes_ptr, query_tiles_ptr, table_ptr, bits_ptr, lse2_ptr, delta_ptr,
        dk_ptr, dv_ptr, ds_ptr, sums_ptr,
        heads, queries, keys,
        q_stride_b, q_stride_h, q_stride_t, k_stride_b, k_stride_h, k_stride_t,
        v_stride_b, v_stride_h, v_stride_t, do_stride_b, do_stride_h, do_stride_t,
        dk_stride_b, dk_stride_h, dk_stride_t, dv_stride_b, dv_stride_h, dv_stride_t,
        ds_stride_b, ds_stride_h, ds_stride_t,
        code_stride_b, code_stride_t, tiles_stride_b, tiles_stride_t, table_stride_b, table_stride_h, stats_stride_bh,
        bits_stride_bh, bits_stride_t, sums_stride_b, sums_stride_block, sums_stride_part, scale, keep_scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TRANSPOSED: tl.constexpr,
        DENSE: tl.constexpr, DROPOUT: tl.constexpr, WRITE_DS: tl.constexpr, ZERO_SKIPPED: tl.constexpr,
        BIAS_SUMS: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """TRANSPOSED: each tile computed as keys x queries (S^T = K Q^T), as FlashAttention-2's backward
    does, for the tensor cores that read both operands from shared memory (SM 9.0's wgmma): K and V,
    this program's own, are the left operands, staged once; P^T and dS^T come out of one product in
    the layout the next takes as its left operand; Q and dO, staged by the loop's pipeline, are only
    right operands (read transposed in place). As [queries, keys] tiles there, K and V were written to
    shared memory again every tile and P^T, dS^T once each (28% more shared-memory traffic a tile,
    `tools/bench_kernel_code.py`). Otherwise [queries, keys] tiles, for SM 8.x, whose mma holds
    left operands in registers: K and V held so for the whole loop spill with dropout. `codes_ptr`:
    the codes as the tile reads them ([keys, queries] when TRANSPOSED: `padded_codes`' transpose);
    the statistics and the dS rows are padded to whole tiles (no mask in the loop). ZERO_SKIPPED: dS
    written as 0 in the tiles skipped too, for a reader of every tile (dQ's cuBLAS GEMM). BIAS_SUMS:
    dK's and dV's column sums too, [B, key blocks, 2, heads, head size] (`store_bias_sums`)."""
    sequence_head, sequence, head, block, cols = program_tile(heads, keys, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    tiles = query_tiles_ptr + sequence * tiles_stride_b + block * tiles_stride_t
    tile_count = tl.load(tiles)
    k = rows_of(k_ptr, sequence, head, k_stride_b, k_stride_h, k_stride_t, cols, dims, keys)
    v = rows_of(v_ptr, sequence, head, v_stride_b, v_stride_h, v_stride_t, cols, dims, keys)
    codes_base = codes_ptr + sequence * code_stride_b
    ds_base = ds_ptr + sequence * ds_stride_b + head * ds_stride_h
    stats_base = sequence_head.to(tl.int64) * stats_stride_bh
    table_row = table_offset(sequence, head, table_stride_b, table_stride_h, DENSE)
    dk = tl.full((BLOCK_N, HEAD_DIM), 0, dtype=tl.float32)
    dv = tl.full((BLOCK_N, HEAD_DIM), 0, dtype=tl.float32)
    for tile in range(0, tile_count):  # the query blocks holding a pair that sees one of these keys
        rows = tl.load(tiles + 1 + tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        q = rows_of(q_ptr, sequence, head, q_stride_b, q_stride_h, q_stride_t, rows, dims, queries)
        do = rows_of(do_ptr, sequence, head, do_stride_b, do_stride_h, do_stride_t, rows, dims, queries)
        lse = tl.load(lse2_ptr + stats_base + rows)  # base 2; +inf in rows that see no key
        delta = tl.load(delta_ptr + stats_base + rows)
        if TRANSPOSED:  # [keys, queries]
            scores = biased_scores(k, q, codes_base, table_ptr, table_row, cols, rows, code_stride_t, scale,
                                   DENSE, PRECISION, INTERPRETED)
            dp = mm(v, tl.trans(do), PRECISION, INTERPRETED)
            lse, delta = lse[None, :], delta[None, :]
            if DROPOUT:  # unpacked as read, then transposed: Triton moves the bytes, not the booleans
                keep = tl.trans(stored_keep(bits_ptr, sequence_head, rows, block * BLOCK_N,
                                            bits_stride_bh, bits_stride_t, BLOCK_M, BLOCK_N))
        else:  # [queries, keys]
            scores = biased_scores(q, k, codes_base, table_ptr, table_row, rows, cols, code_stride_t, scale,
                                   DENSE, PRECISION, INTERPRETED)
            dp = mm(do, tl.trans(v), PRECISION, INTERPRETED)
            lse, delta = lse[:, None], delta[:, None]
            if DROPOUT:
                keep = stored_keep(bits_ptr, sequence_head, rows, block * BLOCK_N, bits_stride_bh,
                                   bits_stride_t, BLOCK_M, BLOCK_N)
        p = exp2(scores - lse, INTERPRETED)  # 0 where blocked, and in rows that see no key
        if DROPOUT:  # 1 / (1 - dropout) applied to dV once, and in dS's fused multiply-add
            p_dropped = tl.where(keep, p, 0.0)
            ds = p * (tl.where(keep, dp, 0.0) * keep_scale - delta)
        else:
            p_dropped = p
            ds = p * (dp - delta)
        if TRANSPOSED:  # P^T and dS^T: the left operands as they are
            dv += mm(p_dropped.to(do.dtype), do, PRECISION, INTERPRETED)
            dk_step = ds.to(q.dtype)
            if WRITE_DS:  # rows and keys padded to whole tiles: no mask (0 past the pairs: BLOCKED)
                tl.store(ds_base + rows[None, :] * ds_stride_t + cols[:, None], ds.to(ds_ptr.dtype.element_ty))
        else:
            dv += mm(tl.trans(p_dropped.to(do.dtype)), do, PRECISION, INTERPRETED)
            dk_step = tl.trans(ds.to(q.dtype))
            if WRITE_DS:
                tl.store(ds_base + rows[:, None] * ds_stride_t + cols[None, :], ds.to(ds_ptr.dtype.element_ty))
        dk += mm(dk_step, q, PRECISION, INTERPRETED)
    if WRITE_DS and ZERO_SKIPPED:  # the skipped tiles' dS is 0 (every pair blocked), for dQ's GEMM
        for tile in range(tile_count, (queries + BLOCK_M - 1) // BLOCK_M):
            rows = tl.load(tiles + 1 + tile) * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(ds_base + rows[:, None] * ds_stride_t + cols[None, :],
                     tl.full((BLOCK_M, BLOCK_N), 0, dtype=ds_ptr.dtype.element_ty))
    dk *= scale
    if DROPOUT:
        dv *= keep_scale
    if BIAS_SUMS:
        store_bias_sums(sums_ptr, dk, sequence, head, block, sums_stride_b, sums_stride_block, dims, HEAD_DIM,
                        INTERPRETED)
        store_bias_sums(sums_ptr + sums_stride_part, dv, sequence, head, block, sums_stride_b, sums_stride_block,
                        dims, HEAD_DIM, INTERPRETED)
    store_rows(dk_ptr, dk, sequence, head, dk_stride_b, dk_stride_h, dk_stride_t, cols, dims, keys)
    store_rows(dv_ptr, dv, sequence, head, dv_stride_b, dv_stride_h, dv_stride_t, cols, dims, keys)


@triton.jit
def attention_backward_query_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, codes_ptr, key_tiles_ptr, table_ptr, bits_ptr, lse2_ptr, delta_ptr, dq_ptr,
        sums_ptr, heads, queries, keys,
        q_stride_b, q_stride_h, q_stride_t, k_stride_b, k_stride_h, k_stride_t,
        v_stride_b, v_stride_h, v_stride_t, do_stride_b, do_stride_h, do_stride_t,
        dq_stride_b, dq_stride_h, dq_stride_t,
        code_stride_b, code_stride_t, tiles_stride_b, tiles_stride_t, table_stride_b, table_stride_h, stats_stride_bh,
        bits_stride_bh, bits_stride_t, sums_stride_b, sums_stride_block, scale, keep_scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DENSE: tl.constexpr,
        DROPOUT: tl.constexpr, BIAS_SUMS: tl.constexpr, PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """dQ, recomputing each listed tile's scores, softmax, kept bits and dP; BIAS_SUMS: its column
    sums too, [B, query blocks, heads, head size] (`store_bias_sums`)."""
    sequence_head, sequence, head, block, rows = program_tile(heads, queries, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    q = rows_of(q_ptr, sequence, head, q_stride_b, q_stride_h, q_stride_t, rows, dims, queries)
    do = rows_of(do_ptr, sequence, head, do_stride_b, do_stride_h, do_stride_t, rows, dims, queries)
    stats_base = sequence_head.to(tl.int64) * stats_stride_bh
    lse = tl.load(lse2_ptr + stats_base + rows)  # base 2, padded (the delta kernel's)
    delta = tl.load(delta_ptr + stats_base + rows)
    codes_base = codes_ptr + sequence * code_stride_b
    table_row = table_offset(sequence, head, table_stride_b, table_stride_h, DENSE)
    tiles = key_tiles_ptr + sequence * tiles_stride_b + block * tiles_stride_t
    dq = tl.full((BLOCK_M, HEAD_DIM), 0, dtype=tl.float32)
    for tile in range(0, tl.load(tiles)):
        column_start = tl.load(tiles + 1 + tile) * BLOCK_N
        cols = column_start + tl.arange(0, BLOCK_N)
        k = rows_of(k_ptr, sequence, head, k_stride_b, k_stride_h, k_stride_t, cols, dims, keys)
        v = rows_of(v_ptr, sequence, head, v_stride_b, v_stride_h, v_stride_t, cols, dims, keys)
        scores = biased_scores(q, k, codes_base, table_ptr, table_row, rows, cols, code_stride_t, scale,
                               DENSE, PRECISION, INTERPRETED)
        p = exp2(scores - lse[:, None], INTERPRETED)
        dp = mm(do, tl.trans(v), PRECISION, INTERPRETED)
        if DROPOUT:
            keep = stored_keep(bits_ptr, sequence_head, rows, column_start, bits_stride_bh, bits_stride_t,
                               BLOCK_M, BLOCK_N)
            ds = p * (tl.where(keep, dp, 0.0) * keep_scale - delta[:, None])
        else:
            ds = p * (dp - delta[:, None])
        dq += mm(ds.to(k.dtype), k, PRECISION, INTERPRETED)
    dq *= scale
    if BIAS_SUMS:
        store_bias_sums(sums_ptr, dq, sequence, head, block, sums_stride_b, sums_stride_block, dims, HEAD_DIM,
                        INTERPRETED)
    store_rows(dq_ptr, dq, sequence, head, dq_stride_b, dq_stride_h, dq_stride_t, rows, dims, queries)


@triton.jit
def attention_query_grad_from_scores_kernel(
        ds_ptr, k_ptr, dq_ptr, key_tiles_ptr, sums_ptr, heads, queries, keys,
        ds_stride_b, ds_stride_h, ds_stride_t, k_stride_b, k_stride_h, k_stride_t,
        dq_stride_b, dq_stride_h, dq_stride_t, tiles_stride_b, tiles_stride_t, sums_stride_b, sums_stride_block, scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BIAS_SUMS: tl.constexpr,
        PRECISION: tl.constexpr, INTERPRETED: tl.constexpr):
    """dq = scale x dS @ K over the tiles a block of queries lists (`key_tiles`, the forward's): the
    GEMM `_query_grad_from_scores` runs, reading only the tiles that hold a pair that is seen (the
    others' dS is 0, and need not be written). dS as the key/value pass stored it (the inputs' dtype),
    read up to the queries and keys only (past them the buffer holds what no pass wrote). BIAS_SUMS:
    dQ's column sums too (`store_bias_sums`)."""
    sequence_head, sequence, head, block, rows = program_tile(heads, queries, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    tiles = key_tiles_ptr + sequence * tiles_stride_b + block * tiles_stride_t
    ds_base = ds_ptr + sequence * ds_stride_b + head * ds_stride_h
    dq = tl.full((BLOCK_M, HEAD_DIM), 0, dtype=tl.float32)
    for tile in range(0, tl.load(tiles)):
        cols = tl.load(tiles + 1 + tile) * BLOCK_N + tl.arange(0, BLOCK_N)
        ds = tl.load(ds_base + rows[:, None] * ds_stride_t + cols[None, :],
                     mask=(rows < queries)[:, None] & (cols < keys)[None, :], other=0.0)
        k = rows_of(k_ptr, sequence, head, k_stride_b, k_stride_h, k_stride_t, cols, dims, keys)
        dq += mm(ds, k, PRECISION, INTERPRETED)
    dq *= scale
    if BIAS_SUMS:
        store_bias_sums(sums_ptr, dq, sequence, head, block, sums_stride_b, sums_stride_block, dims, HEAD_DIM,
                        INTERPRETED)
    store_rows(dq_ptr, dq, sequence, head, dq_stride_b, dq_stride_h, dq_stride_t, rows, dims, queries)


@triton.jit
def dense_bias_kernel(codes_ptr, table_ptr, bias_ptr, heads, size, table_stride_h, bias_stride_b, bias_stride_h,
                      BLOCK: tl.constexpr):
    """bias[b, h, half, i, j] = table[h, codes[b, half, i, j]] for one (sequence, half) and BLOCK rows of
    the padded codes ([B, 2, size, size]), every head: the dense form of the kernel table
    (`bucket_attention.dense_kernel_bias`), in the bias's dtype."""
    sequence_half = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    half_offset = (sequence_half % 2).to(tl.int64) * size * size
    sequence = (sequence_half // 2).to(tl.int64)
    for column_start in range(0, size, BLOCK):
        cells = half_offset + rows[:, None] * size + (column_start + tl.arange(0, BLOCK))[None, :]
        code = tl.load(codes_ptr + sequence_half.to(tl.int64) * size * size + rows[:, None] * size
                       + (column_start + tl.arange(0, BLOCK))[None, :])
        for head in range(heads):
            value = tl.load(table_ptr + head * table_stride_h + code)
            tl.store(bias_ptr + sequence * bias_stride_b + head * bias_stride_h + cells,
                     value.to(bias_ptr.dtype.element_ty))


@triton.jit
def dropout_keep_kernel(seed_ptr, keep_ptr, heads, queries, keys, threshold,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    """The [B x heads, queries, keys] keep mask the attention kernels draw (for tests and checks)."""
    sequence_head = tl.program_id(0)
    query_block = tl.program_id(1)
    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    seed = tl.load(seed_ptr)
    for column_start in range(0, keys, BLOCK_N):
        cols = column_start + tl.arange(0, BLOCK_N)
        keep, _ = dropout_keep(seed, sequence_head, rows, column_start, threshold, BLOCK_M, BLOCK_N, INTERPRETED)
        tl.store(keep_ptr + (sequence_head.to(tl.int64) * queries + rows[:, None]) * keys + cols[None, :],
                 keep.to(tl.int8), mask=(rows[:, None] < queries) & (cols[None, :] < keys))
