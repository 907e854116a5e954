"""The Triton kernel behind `ffn_activation.gelu_backward_with_bias_sums` (imported only where Triton
is installed).

One program per tile of ROWS x COLUMNS of the FFN's [tokens, ffn] activations: it reads the output
gradient and the pre-activation once, writes GELU's input gradient (erf GELU, ATen's formula in
fp32: dy x (cdf(x) + x pdf(x))) in the gradient's dtype, and stores the column sums of what it wrote
(fp32, the rounded values, as autograd's sum reads them) in its own row of `partial`; the caller
sums the rows (a fixed order: deterministic). So the bias gradient costs no second pass over the
[tokens, ffn] gradient (Inductor's schedule: 4 activations a layer at base, docs/benchmarks.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

SQRT1_2 = tl.constexpr(0.7071067811865476)
"""1 / sqrt(2): GELU's cdf is 0.5 (1 + erf(x / sqrt(2)))."""
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
"""1 / sqrt(2 pi): the normal density's constant (ATen's kBeta = M_2_SQRTPI x M_SQRT1_2 x 0.5)."""


@triton.jit
def gelu_backward_kernel(grad_ptr, pre_ptr, out_ptr, partial_ptr, rows, columns,
                         ROWS: tl.constexpr, COLUMNS: tl.constexpr, ROUND_TO_BF16: tl.constexpr):
    """grad, pre and out are [rows, columns] with rows `columns` apart (contiguous); partial is
    [row blocks, columns] fp32. ROUND_TO_BF16 (bf16 in Triton's interpreter, whose conversion from
    fp32 truncates): round to nearest even first, as the GPU's conversion does."""
    row_block = tl.program_id(0)
    row = row_block * ROWS + tl.arange(0, ROWS)
    column = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    inside = (row[:, None] < rows) & (column[None, :] < columns)
    offsets = row[:, None].to(tl.int64) * columns + column[None, :]
    grad = tl.load(grad_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    pre = tl.load(pre_ptr + offsets, mask=inside, other=0.0).to(tl.float32)
    cdf = 0.5 * (1.0 + tl.math.erf(pre * SQRT1_2))
    pdf = INV_SQRT_2PI * tl.exp(-0.5 * pre * pre)
    out = grad * (cdf + pre * pdf)
    if ROUND_TO_BF16:
        bits = out.to(tl.uint32, bitcast=True)
        out = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    out = out.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offsets, out, mask=inside)
    # outside the gradient grad is 0, so out is 0 there: the sums need no mask
    tl.store(partial_ptr + row_block.to(tl.int64) * columns + column, tl.sum(out.to(tl.float32), axis=0),
             mask=column < columns)
