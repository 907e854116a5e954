"""The Triton kernel behind `hidden_dropout.dropout_keep_bits` (imported only where Triton is installed).

One program per tile of ROWS rows x BYTES bytes of the [rows, ceil(columns / 8)] uint8 output: for
each (row, byte c) one Philox4x32 call (the attention kernels' PHILOX_ROUNDS; key: the seed; counter:
c, the row, 0, 0) gives 128 bits, cut into eight 16-bit draws, draw k deciding column 8c + k (the low
half of word k // 2 for even k, its high half for odd k); a column is kept when its draw is >= the
threshold (the drop probability x 65536) and is bit k of byte c. Columns past the last (a width not a
multiple of 8) are 0 bits. Eight columns a Philox call, where Inductor's `tl.rand` makes one call of
ten rounds per element.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .bucket_attention_triton import PHILOX_ROUNDS


@triton.jit
def dropout_keep_bits_kernel(seed_ptr, bits_ptr, rows, columns, byte_columns, threshold,
                             ROWS: tl.constexpr, BYTES: tl.constexpr):
    """seed_ptr: int64 [1]; bits_ptr: uint8 [rows, byte_columns] (rows `byte_columns` apart)."""
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    byte = tl.program_id(1) * BYTES + tl.arange(0, BYTES)
    zeros = tl.full((ROWS, BYTES), 0, dtype=tl.uint32)
    seed = tl.load(seed_ptr)
    r0, r1, r2, r3 = tl.philox(seed, zeros + byte[None, :].to(tl.uint32), zeros + row[:, None].to(tl.uint32),
                               zeros, zeros, PHILOX_ROUNDS)
    # each 16-bit draw compared in the high half of a word (the high half as it is: one instruction)
    high = threshold.to(tl.uint32) << 16
    packed = (((r0 << 16) >= high).to(tl.int32) | ((r0 >= high).to(tl.int32) << 1)
              | (((r1 << 16) >= high).to(tl.int32) << 2) | ((r1 >= high).to(tl.int32) << 3)
              | (((r2 << 16) >= high).to(tl.int32) << 4) | ((r2 >= high).to(tl.int32) << 5)
              | (((r3 << 16) >= high).to(tl.int32) << 6) | ((r3 >= high).to(tl.int32) << 7))
    real = tl.minimum(tl.maximum(columns - byte * 8, 0), 8)  # columns of each byte inside the width
    packed = packed & ((1 << real[None, :]) - 1)
    inside = (row[:, None] < rows) & (byte[None, :] < byte_columns)
    tl.store(bits_ptr + row[:, None].to(tl.int64) * byte_columns + byte[None, :], packed.to(tl.uint8), mask=inside)
