"""The Triton kernels behind `bucket_attention` (imported only where Triton is installed).

Flash attention (online softmax, nothing [T, T] kept between the passes) whose additive bias is read
per tile from a uint8 code per query-key pair: the pair's relative-distance bucket, whose bias is
`table[head, bucket]`, or BLOCKED where the attention rule forbids the pair (-inf). Attention
dropout is drawn in the forward kernel from Philox, keyed by a seed tensor and the pair's index;
each Philox call gives 128 bits, cut into eight 16-bit draws, so a tile needs one call per eight
pairs. The forward also writes what it kept as bits (1/8 byte a pair and head), which both backward
kernels read instead of drawing again: Philox's ten rounds (~100 integer operations a call, at half
the rate of float arithmetic) would cost each pass more than its matrix products. A tile whose
pairs are all BLOCKED (PMLM's context rows against the pseudo tokens' keys, padding: ~25% of the
tiles on real data) is skipped: each program walks a list of the tiles it has work in
(`bucket_attention.tile_lists`).

- `attention_forward_kernel`: one program per (sequence x head, block of queries), over its listed
  blocks of keys; writes the output, each row's log-sum-exp (+inf for a row that sees no key: its
  output is 0) and, with dropout, the kept pairs' bits.
- `attention_backward_delta_kernel`: rowsum(dO * O) per query, for both backward kernels.
- `attention_backward_key_value_kernel`: one program per (sequence x head, block of keys), over its
  listed blocks of queries: dK, dV and, when asked, dS (the bias's gradient; 0 in skipped tiles).
- `attention_backward_query_kernel`: one program per (sequence x head, block of queries), over its
  listed blocks of keys: dQ.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def mm(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST (Triton's interpreter, whose tl.dot misreads bf16
    operands in Triton 3.9) multiplies the same values in fp32: operands are rounded to the input
    dtype first, as on a GPU."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def dropout_keep(seed, sequence_head, rows, column_start, queries, keys, threshold,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """([BLOCK_M, BLOCK_N] booleans: which pairs (rows, column_start + j) dropout keeps, the same as
    [BLOCK_M, BLOCK_N / 8] uint8 bytes: bit b of byte g is the pair of key column_start + 8g + b).
    A pair is kept when its 16-bit draw is >= threshold (the drop probability x 65536). Pairs are
    drawn in groups of 8 consecutive keys, one Philox call per group; the group index counts from
    the sequence and head's first pair, so any tiling draws the same bits."""
    groups_per_row = (keys + 7) // 8
    groups = column_start // 8 + tl.arange(0, BLOCK_N // 8)
    offsets = ((sequence_head.to(tl.int64) * queries + rows[:, None].to(tl.int64)) * groups_per_row
               + groups[None, :].to(tl.int64))
    r0, r1, r2, r3 = tl.randint4x(seed, offsets)
    low = 0xFFFF
    # draws < 2^16: compared as int32 (no mixed signedness)
    k0, k1 = (r0 & low).to(tl.int32) >= threshold, (r0 >> 16).to(tl.int32) >= threshold
    k2, k3 = (r1 & low).to(tl.int32) >= threshold, (r1 >> 16).to(tl.int32) >= threshold
    k4, k5 = (r2 & low).to(tl.int32) >= threshold, (r2 >> 16).to(tl.int32) >= threshold
    k6, k7 = (r3 & low).to(tl.int32) >= threshold, (r3 >> 16).to(tl.int32) >= threshold
    # Nested joins put draw k(4n + 2m + l) at key 4l + 2m + n of its group (each join a new minor
    # dimension); the bytes follow the same order.
    keep = tl.reshape(tl.join(tl.join(tl.join(k0, k1), tl.join(k2, k3)), tl.join(tl.join(k4, k5), tl.join(k6, k7))),
                      (BLOCK_M, BLOCK_N))
    packed = (k0.to(tl.int32) | (k4.to(tl.int32) << 1) | (k2.to(tl.int32) << 2) | (k6.to(tl.int32) << 3)
              | (k1.to(tl.int32) << 4) | (k5.to(tl.int32) << 5) | (k3.to(tl.int32) << 6) | (k7.to(tl.int32) << 7))
    return keep, packed.to(tl.uint8)


@triton.jit
def stored_keep(bits_ptr, sequence_head, rows, cols, bits_stride_bh, bits_stride_t):
    """[rows, cols] booleans: the pairs the forward kept, read from its bits (see `dropout_keep`; the
    bits cover whole tiles, so no bounds mask)."""
    byte = tl.load(bits_ptr + sequence_head.to(tl.int64) * bits_stride_bh + rows[:, None] * bits_stride_t
                   + (cols // 8)[None, :])
    return ((byte.to(tl.int32) >> (cols % 8)[None, :]) & 1) != 0


@triton.jit
def rows_of(ptr, sequence, head, stride_b, stride_h, stride_t, rows, dims, count):
    """The [rows, head size] tile of one (sequence, head) of a [B, heads, T, head size] tensor
    (any strides, the last 1), zeros past `count` rows."""
    return tl.load(ptr + sequence * stride_b + head * stride_h + rows[:, None] * stride_t + dims[None, :],
                   mask=(rows < count)[:, None], other=0.0)


@triton.jit
def store_rows(ptr, value, sequence, head, stride_b, stride_h, stride_t, rows, dims, count):
    """`rows_of`'s inverse: `value` stored in the tensor's dtype, rows past `count` left alone."""
    tl.store(ptr + sequence * stride_b + head * stride_h + rows[:, None] * stride_t + dims[None, :],
             value.to(ptr.dtype.element_ty), mask=(rows < count)[:, None])


@triton.jit
def program_tile(heads, BLOCK: tl.constexpr):
    """(sequence x head index, sequence, head, this program's BLOCK rows or keys) of a grid
    (B x heads, blocks)."""
    sequence_head = tl.program_id(0)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    return sequence_head, (sequence_head // heads).to(tl.int64), (sequence_head % heads).to(tl.int64), index


@triton.jit
def biased_scores(q, k, codes_ptr, table_ptr, table_row, rows, cols, code_stride_query, scale,
                  PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """scale x q @ k^T plus table[head, code] for the tile's pairs. The kernel table's BLOCKED entry is
    -inf, and the padded codes are BLOCKED past [queries, keys], so the forbidden pairs and those
    outside the sequence get -inf with no mask: one load and one add a pair."""
    code = tl.load(codes_ptr + rows[:, None] * code_stride_query + cols[None, :])
    return mm(q, tl.trans(k), PRECISION, UPCAST) * scale + tl.load(table_ptr + table_row + code)


@triton.jit
def attention_forward_kernel(
        q_ptr, k_ptr, v_ptr, codes_ptr, key_tiles_ptr, table_ptr, seed_ptr, out_ptr, lse_ptr, bits_ptr,
        heads, queries, keys,
        q_stride_b, q_stride_h, q_stride_t, k_stride_b, k_stride_h, k_stride_t,
        v_stride_b, v_stride_h, v_stride_t, o_stride_b, o_stride_h, o_stride_t,
        code_stride_b, code_stride_t, tiles_stride_b, tiles_stride_t, table_stride_h, lse_stride_bh,
        bits_stride_bh, bits_stride_t, scale, threshold, keep_scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
        UPCAST: tl.constexpr):
    sequence_head, sequence, head, rows = program_tile(heads, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_valid = rows < queries
    tiles = key_tiles_ptr + sequence * tiles_stride_b + tl.program_id(1) * tiles_stride_t
    q = rows_of(q_ptr, sequence, head, q_stride_b, q_stride_h, q_stride_t, rows, dims, queries)
    codes_base = codes_ptr + sequence * code_stride_b
    table_row = head * table_stride_h
    seed = 0
    if DROPOUT:
        seed = tl.load(seed_ptr)
    row_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    row_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for tile in range(0, tl.load(tiles)):  # the key blocks holding a pair this block's queries see
        column_start = tl.load(tiles + 1 + tile) * BLOCK_N
        cols = column_start + tl.arange(0, BLOCK_N)
        k = rows_of(k_ptr, sequence, head, k_stride_b, k_stride_h, k_stride_t, cols, dims, keys)
        v = rows_of(v_ptr, sequence, head, v_stride_b, v_stride_h, v_stride_t, cols, dims, keys)
        scores = biased_scores(q, k, codes_base, table_ptr, table_row, rows, cols, code_stride_t, scale,
                               PRECISION, UPCAST)
        new_max = tl.maximum(row_max, tl.max(scores, 1))
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # a row with no key so far
        p = tl.exp(scores - safe_max[:, None])
        correction = tl.exp(row_max - safe_max)
        row_sum = row_sum * correction + tl.sum(p, 1)
        if DROPOUT:
            keep, packed = dropout_keep(seed, sequence_head, rows, column_start, queries, keys, threshold,
                                        BLOCK_M, BLOCK_N)
            p = tl.where(keep, p * keep_scale, 0.0)
            groups = column_start // 8 + tl.arange(0, BLOCK_N // 8)
            tl.store(bits_ptr + sequence_head.to(tl.int64) * bits_stride_bh + rows[:, None] * bits_stride_t
                     + groups[None, :], packed)  # the bits cover whole tiles
        acc = acc * correction[:, None] + mm(p.to(v.dtype), v, PRECISION, UPCAST)
        row_max = new_max
    seen = row_sum > 0
    out = acc / tl.where(seen, row_sum, 1.0)[:, None]
    lse = tl.where(seen, row_max + tl.log(tl.where(seen, row_sum, 1.0)), float("inf"))
    store_rows(out_ptr, out, sequence, head, o_stride_b, o_stride_h, o_stride_t, rows, dims, queries)
    tl.store(lse_ptr + sequence_head.to(tl.int64) * lse_stride_bh + rows, lse, mask=row_valid)


@triton.jit
def attention_backward_delta_kernel(out_ptr, do_ptr, delta_ptr, heads, queries,
                                    o_stride_b, o_stride_h, o_stride_t, do_stride_b, do_stride_h, do_stride_t,
                                    delta_stride_bh, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """delta = rowsum(dO * O) in fp32, [B x heads, queries]: the softmax backward's per-row term, read
    by both backward kernels (one pass over O and dO, no fp32 copies of them)."""
    sequence_head, sequence, head, rows = program_tile(heads, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_valid = rows < queries
    out = rows_of(out_ptr, sequence, head, o_stride_b, o_stride_h, o_stride_t, rows, dims, queries).to(tl.float32)
    do = rows_of(do_ptr, sequence, head, do_stride_b, do_stride_h, do_stride_t, rows, dims, queries).to(tl.float32)
    tl.store(delta_ptr + sequence_head.to(tl.int64) * delta_stride_bh + rows, tl.sum(out * do, 1), mask=row_valid)


@triton.jit
def attention_backward_key_value_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, codes_ptr, query_tiles_ptr, table_ptr, bits_ptr, lse_ptr, delta_ptr,
        dk_ptr, dv_ptr, ds_ptr,
        heads, queries, keys,
        q_stride_b, q_stride_h, q_stride_t, k_stride_b, k_stride_h, k_stride_t,
        v_stride_b, v_stride_h, v_stride_t, do_stride_b, do_stride_h, do_stride_t,
        dk_stride_b, dk_stride_h, dk_stride_t, dv_stride_b, dv_stride_h, dv_stride_t,
        ds_stride_b, ds_stride_h, ds_stride_t,
        code_stride_b, code_stride_t, tiles_stride_b, tiles_stride_t, table_stride_h, lse_stride_bh,
        bits_stride_bh, bits_stride_t, scale, keep_scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DROPOUT: tl.constexpr, WRITE_DS: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    sequence_head, sequence, head, cols = program_tile(heads, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)
    col_valid = cols < keys
    tiles = query_tiles_ptr + sequence * tiles_stride_b + tl.program_id(1) * tiles_stride_t
    tile_count = tl.load(tiles)
    k = rows_of(k_ptr, sequence, head, k_stride_b, k_stride_h, k_stride_t, cols, dims, keys)
    v = rows_of(v_ptr, sequence, head, v_stride_b, v_stride_h, v_stride_t, cols, dims, keys)
    codes_base = codes_ptr + sequence * code_stride_b
    ds_base = ds_ptr + sequence * ds_stride_b + head * ds_stride_h
    stats_base = sequence_head.to(tl.int64) * lse_stride_bh
    table_row = head * table_stride_h
    dk = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), dtype=tl.float32)
    for tile in range(0, tile_count):  # the query blocks holding a pair that sees one of these keys
        rows = tl.load(tiles + 1 + tile) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_valid = rows < queries
        q = rows_of(q_ptr, sequence, head, q_stride_b, q_stride_h, q_stride_t, rows, dims, queries)
        do = rows_of(do_ptr, sequence, head, do_stride_b, do_stride_h, do_stride_t, rows, dims, queries)
        lse = tl.load(lse_ptr + stats_base + rows, mask=row_valid, other=float("inf"))
        delta = tl.load(delta_ptr + stats_base + rows, mask=row_valid, other=0.0)
        scores = biased_scores(q, k, codes_base, table_ptr, table_row, rows, cols, code_stride_t, scale,
                               PRECISION, UPCAST)
        p = tl.exp(scores - lse[:, None])  # 0 where blocked, and in rows that see no key (lse = +inf)
        dp = mm(do, tl.trans(v), PRECISION, UPCAST)
        if DROPOUT:
            keep = stored_keep(bits_ptr, sequence_head, rows, cols, bits_stride_bh, bits_stride_t)
            p_dropped = tl.where(keep, p * keep_scale, 0.0)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        else:
            p_dropped = p
        dv += mm(tl.trans(p_dropped.to(do.dtype)), do, PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        if WRITE_DS:
            tl.store(ds_base + rows[:, None] * ds_stride_t + cols[None, :], ds.to(ds_ptr.dtype.element_ty),
                     mask=row_valid[:, None] & col_valid[None, :])
        dk += mm(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
    if WRITE_DS:  # the skipped tiles' dS is 0 (every pair blocked): written, as the table's sums read it
        for tile in range(tile_count, tl.cdiv(queries, BLOCK_M)):
            rows = tl.load(tiles + 1 + tile) * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(ds_base + rows[:, None] * ds_stride_t + cols[None, :],
                     tl.zeros((BLOCK_M, BLOCK_N), dtype=ds_ptr.dtype.element_ty),
                     mask=(rows < queries)[:, None] & col_valid[None, :])
    dk *= scale
    store_rows(dk_ptr, dk, sequence, head, dk_stride_b, dk_stride_h, dk_stride_t, cols, dims, keys)
    store_rows(dv_ptr, dv, sequence, head, dv_stride_b, dv_stride_h, dv_stride_t, cols, dims, keys)


@triton.jit
def attention_backward_query_kernel(
        q_ptr, k_ptr, v_ptr, do_ptr, codes_ptr, key_tiles_ptr, table_ptr, bits_ptr, lse_ptr, delta_ptr, dq_ptr,
        heads, queries, keys,
        q_stride_b, q_stride_h, q_stride_t, k_stride_b, k_stride_h, k_stride_t,
        v_stride_b, v_stride_h, v_stride_t, do_stride_b, do_stride_h, do_stride_t,
        dq_stride_b, dq_stride_h, dq_stride_t,
        code_stride_b, code_stride_t, tiles_stride_b, tiles_stride_t, table_stride_h, lse_stride_bh,
        bits_stride_bh, bits_stride_t, scale, keep_scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        DROPOUT: tl.constexpr, PRECISION: tl.constexpr,
        UPCAST: tl.constexpr):
    sequence_head, sequence, head, rows = program_tile(heads, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_valid = rows < queries
    q = rows_of(q_ptr, sequence, head, q_stride_b, q_stride_h, q_stride_t, rows, dims, queries)
    do = rows_of(do_ptr, sequence, head, do_stride_b, do_stride_h, do_stride_t, rows, dims, queries)
    stats_base = sequence_head.to(tl.int64) * lse_stride_bh
    lse = tl.load(lse_ptr + stats_base + rows, mask=row_valid, other=float("inf"))
    delta = tl.load(delta_ptr + stats_base + rows, mask=row_valid, other=0.0)
    codes_base = codes_ptr + sequence * code_stride_b
    table_row = head * table_stride_h
    tiles = key_tiles_ptr + sequence * tiles_stride_b + tl.program_id(1) * tiles_stride_t
    dq = tl.zeros((BLOCK_M, HEAD_DIM), dtype=tl.float32)
    for tile in range(0, tl.load(tiles)):
        column_start = tl.load(tiles + 1 + tile) * BLOCK_N
        cols = column_start + tl.arange(0, BLOCK_N)
        k = rows_of(k_ptr, sequence, head, k_stride_b, k_stride_h, k_stride_t, cols, dims, keys)
        v = rows_of(v_ptr, sequence, head, v_stride_b, v_stride_h, v_stride_t, cols, dims, keys)
        scores = biased_scores(q, k, codes_base, table_ptr, table_row, rows, cols, code_stride_t, scale,
                               PRECISION, UPCAST)
        p = tl.exp(scores - lse[:, None])
        dp = mm(do, tl.trans(v), PRECISION, UPCAST)
        if DROPOUT:
            keep = stored_keep(bits_ptr, sequence_head, rows, cols, bits_stride_bh, bits_stride_t)
            dp = tl.where(keep, dp * keep_scale, 0.0)
        ds = p * (dp - delta[:, None])
        dq += mm(ds.to(k.dtype), k, PRECISION, UPCAST)
    dq *= scale
    store_rows(dq_ptr, dq, sequence, head, dq_stride_b, dq_stride_h, dq_stride_t, rows, dims, queries)


@triton.jit
def dropout_keep_kernel(seed_ptr, keep_ptr, heads, queries, keys, threshold,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [B x heads, queries, keys] keep mask the attention kernels draw (for tests and checks)."""
    sequence_head = tl.program_id(0)
    query_block = tl.program_id(1)
    rows = query_block * BLOCK_M + tl.arange(0, BLOCK_M)
    seed = tl.load(seed_ptr)
    for column_start in range(0, keys, BLOCK_N):
        cols = column_start + tl.arange(0, BLOCK_N)
        keep, _ = dropout_keep(seed, sequence_head, rows, column_start, queries, keys, threshold, BLOCK_M, BLOCK_N)
        tl.store(keep_ptr + (sequence_head.to(tl.int64) * queries + rows[:, None]) * keys + cols[None, :],
                 keep.to(tl.int8), mask=(rows[:, None] < queries) & (cols[None, :] < keys))
