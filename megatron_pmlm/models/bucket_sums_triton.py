"""The Triton kernel behind `bucket_sums` (imported only where Triton is installed).

One program per (sequence, block of ROWS query rows) walks the keys in tiles of ROWS x KEYS_BLOCK
query-key pairs: it loads the tile's uint8 buckets once, compares them with every bin into the
one-hot [bins, pairs], loads the gradient of every head for the same pairs [heads, pairs] in its
own dtype and contracts the two on the tensor cores (`tl.dot`, fp32 accumulation: a product of a
half-precision value and 0 or 1 is exact, so the sums are the GEMMs' up to the order of additions)
into a [bins, heads] accumulator. Each program stores its accumulator, as [heads, bins], in its own
row of `partial`; the caller sums the rows (a fixed order: the result is deterministic).

LISTED (the triton attention backend's table gradient): a program walks only the key blocks its
rows' block of queries lists (`bucket_attention.TileLists.key_tiles`, in the forward's tiles); the
others hold only BLOCKED pairs, whose code matches no bin: they add nothing, so the sums are the
same bits (the listed tiles added in the same ascending order) for fewer bytes read (the share of
tiles the attention kernels skip: 22-27% on real micro batches).

The kernel is bound by the instructions it issues per byte, not by the bytes (on one H200 the
former form, a [heads, pairs] x [pairs, bins] product over an fp32 one-hot and the gradient cast to
fp32, read 0.6 TB/s). Compiled for SM 9.0, this form's loop issues 2.2x fewer instructions per
tile (4.5 KB of bf16 gradient at 12 heads: 516 a warp against 1,134; 2.6x fewer, 435, where Triton
knows the strides are multiples of 16 and loads asynchronously): the one-hot is built in the
gradient's dtype, with no conversion of the gradient, and as the product's first operand, which
halves the shared-memory round trip of its layout change (docs/benchmarks.md, "bucket_sums").
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bucket_attention_triton import device_function


@device_function
def tile_sums(total, grad_rows, bucket_rows, row, key, head, bin_ids, heads, queries, keys, grad_stride_query,
              bucket_stride_query, FULL: tl.constexpr, UPCAST: tl.constexpr):
    """`total` plus one tile's sums. FULL: every key of the tile is inside the gradient, so only
    rows are masked and the loads of a row's keys can be vectors."""
    if FULL:
        valid = row < queries
    else:
        valid = (row < queries) & (key < keys)
    # a pair outside the gradient reads bucket 0 and gradient 0: it adds nothing
    bucket = tl.load(bucket_rows + row * bucket_stride_query + key, mask=valid, other=0).to(tl.int32)
    grad = tl.load(grad_rows + (row * grad_stride_query + key)[None, :],
                   mask=(head[:, None] < heads) & valid[None, :], other=0.0)
    one_hot = bin_ids[:, None] == bucket[None, :]  # [bins, pairs]
    if UPCAST:
        return total + tl.dot(one_hot.to(tl.float32), tl.trans(grad.to(tl.float32)), input_precision="ieee")
    # IEEE for fp32 gradients (the GEMMs' sums); half precision ignores it
    return total + tl.dot(one_hot.to(grad.dtype), tl.trans(grad), input_precision="ieee")


@triton.jit
def bucket_sums_kernel(grad_ptr, bucket_ptr, partial_ptr, key_tiles_ptr, heads, queries, keys,
                       grad_stride_batch, grad_stride_head, grad_stride_query,
                       bucket_stride_batch, bucket_stride_query, row_blocks, tiles_stride_b, tiles_stride_t,
                       HEADS_BLOCK: tl.constexpr, BINS_BLOCK: tl.constexpr, ROWS: tl.constexpr,
                       KEYS_BLOCK: tl.constexpr, VECTOR: tl.constexpr, UPCAST: tl.constexpr,
                       LISTED: tl.constexpr, TILE_QUERIES: tl.constexpr, TILE_KEYS: tl.constexpr):
    """The gradient's strides come divided by VECTOR (their common divisor, 1 if none): multiplied
    back here, they tell Triton that a row's keys start at a multiple of VECTOR elements, so a full
    tile loads them as vectors (asynchronously on SM 8.0+) whatever the width. UPCAST (bf16 in Triton's interpreter, whose tl.dot
    misreads bf16 operands in Triton 3.9) multiplies the same values in fp32, where they and the
    one-hot are exact. LISTED: `key_tiles_ptr` lists, per sequence and block of TILE_QUERIES queries
    (a multiple of ROWS), how many blocks of TILE_KEYS keys (a multiple of KEYS_BLOCK) hold a pair
    that is not BLOCKED, then those blocks in ascending order: only the last listed block can reach
    past the keys."""
    program = tl.program_id(0)
    sequence = program // row_blocks
    pair = tl.arange(0, ROWS * KEYS_BLOCK)
    row = (program % row_blocks) * ROWS + pair // KEYS_BLOCK
    column = pair % KEYS_BLOCK
    head = tl.arange(0, HEADS_BLOCK)
    bin_ids = tl.arange(0, BINS_BLOCK)
    grad_rows = (grad_ptr + sequence.to(tl.int64) * (grad_stride_batch * VECTOR)
                 + head[:, None].to(tl.int64) * (grad_stride_head * VECTOR))
    bucket_rows = bucket_ptr + sequence.to(tl.int64) * bucket_stride_batch
    total = tl.full((BINS_BLOCK, HEADS_BLOCK), 0, dtype=tl.float32)
    if LISTED:
        tiles = (key_tiles_ptr + sequence * tiles_stride_b
                 + ((program % row_blocks) * ROWS // TILE_QUERIES) * tiles_stride_t)
        count = tl.load(tiles)
        for tile in range(0, count - 1):  # ascending: every listed block but the last lies inside the keys
            block_start = tl.load(tiles + 1 + tile) * TILE_KEYS
            for part in tl.static_range(TILE_KEYS // KEYS_BLOCK):
                total = tile_sums(total, grad_rows, bucket_rows, row, block_start + part * KEYS_BLOCK + column,
                                  head, bin_ids, heads, queries, keys, grad_stride_query * VECTOR,
                                  bucket_stride_query, True, UPCAST)
        if count > 0:  # the last listed block, masked per key: it may be the keys' ragged end
            block_start = tl.load(tiles + count) * TILE_KEYS
            for part in tl.static_range(TILE_KEYS // KEYS_BLOCK):
                total = tile_sums(total, grad_rows, bucket_rows, row, block_start + part * KEYS_BLOCK + column,
                                  head, bin_ids, heads, queries, keys, grad_stride_query * VECTOR,
                                  bucket_stride_query, False, UPCAST)
    else:
        full_keys = keys // KEYS_BLOCK * KEYS_BLOCK
        for key_start in range(0, full_keys, KEYS_BLOCK):
            total = tile_sums(total, grad_rows, bucket_rows, row, key_start + column, head, bin_ids, heads,
                              queries, keys, grad_stride_query * VECTOR, bucket_stride_query, True, UPCAST)
        if full_keys < keys:  # the last keys: a tile masked per key
            total = tile_sums(total, grad_rows, bucket_rows, row, full_keys + column, head, bin_ids, heads,
                              queries, keys, grad_stride_query * VECTOR, bucket_stride_query, False, UPCAST)
    tl.store(partial_ptr + program * HEADS_BLOCK * BINS_BLOCK + head[None, :] * BINS_BLOCK + bin_ids[:, None], total)
