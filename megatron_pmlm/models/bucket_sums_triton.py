"""The Triton kernel behind `bucket_sums` (imported only where Triton is installed).

One program per (sequence, block of ROWS query rows) walks the keys in tiles of ROWS x KEYS_BLOCK
query-key pairs: it loads the tile's uint8 buckets once, builds their one-hot [pairs, bins] in
registers, loads the gradient of every head for the same pairs [heads, pairs] and contracts the two
with `tl.dot` into a [heads, bins] fp32 accumulator. Each program stores its accumulator in its
own row of `partial`; the caller sums the rows (a fixed order: the result is deterministic).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def bucket_sums_kernel(grad_ptr, bucket_ptr, partial_ptr, heads, queries, keys,
                       grad_stride_batch, grad_stride_head, grad_stride_query,
                       bucket_stride_batch, bucket_stride_query, row_blocks,
                       HEADS_BLOCK: tl.constexpr, BINS_BLOCK: tl.constexpr, ROWS: tl.constexpr,
                       KEYS_BLOCK: tl.constexpr, PRECISION: tl.constexpr):
    program = tl.program_id(0)
    sequence = program // row_blocks
    pair = tl.arange(0, ROWS * KEYS_BLOCK)
    row = (program % row_blocks) * ROWS + pair // KEYS_BLOCK
    column = pair % KEYS_BLOCK
    head = tl.arange(0, HEADS_BLOCK)
    bin_ids = tl.arange(0, BINS_BLOCK)
    grad_rows = grad_ptr + sequence.to(tl.int64) * grad_stride_batch + head[:, None].to(tl.int64) * grad_stride_head
    bucket_rows = bucket_ptr + sequence.to(tl.int64) * bucket_stride_batch
    total = tl.zeros((HEADS_BLOCK, BINS_BLOCK), dtype=tl.float32)
    for key_start in range(0, keys, KEYS_BLOCK):
        key = key_start + column
        valid = (row < queries) & (key < keys)
        bucket = tl.load(bucket_rows + row * bucket_stride_query + key, mask=valid, other=0).to(tl.int32)
        one_hot = ((bucket[:, None] == bin_ids[None, :]) & valid[:, None]).to(tl.float32)
        grad = tl.load(grad_rows + (row * grad_stride_query + key)[None, :],
                       mask=(head[:, None] < heads) & valid[None, :], other=0.0).to(tl.float32)
        total += tl.dot(grad, one_hot, input_precision=PRECISION)
    tl.store(partial_ptr + program * HEADS_BLOCK * BINS_BLOCK + head[:, None] * BINS_BLOCK + bin_ids[None, :], total)
