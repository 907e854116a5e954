"""Hidden dropout in compiled regions: the kept positions drawn as bits by one Triton kernel.

Why: compiled, Inductor draws dropout inside its fused LayerNorm kernels with `tl.rand`, one Philox
call of ten rounds per element, and AOT autograd saves the mask as a byte per element for the
backward. Compiled for an H100 (SM 9.0, on the CPU: docs/benchmarks.md), the attention and FFN output
LayerNorm kernels ran ~116 instructions an element, ~70% of them Philox's: more than their bytes take
at the HBM's rate, so those kernels waited on arithmetic. Here one kernel (`hidden_dropout_triton`)
draws eight positions a Philox call (seven rounds, 16-bit draws: the attention kernels' dropout) and
writes them as bits (1/16 of a bf16 activation); the graph applies them with torch ops that Inductor
fuses into the same LayerNorm kernels forward and backward (39 instructions an element), and the
backward reads the bits instead of the byte mask.

What stays: `HiddenDropout` is `nn.Dropout` (same module names, no state), and outside compiled
training regions it is nn.Dropout's forward. The drop probability is p rounded to a multiple of
1/65536 (0.1 runs as 6554/65536, as the attention kernels' dropout) and the kept values are scaled
by the exact inverse of the kept fraction, so each output's expectation is its input. The bits are a
function of a seed drawn from the device's generator (`torch.randint`, as Inductor draws its own
seeds): a resumed run (whose generator states come back) and activation checkpointing's
recomputation (which restores them) draw the same bits. Which positions are dropped differs from
Inductor's draws, as Inductor's differed from eager's.

Where: traced by torch.compile (`--compile`: eager would launch several unfused kernels where
nn.Dropout launches one), training, 0 < p < 1, a CUDA tensor with Triton installed (Triton's
interpreter on the CPU, for tests). `PMLM_HIDDEN_DROPOUT=torch` keeps Inductor's dropout (for
comparisons); another value than `bits` or `torch` stops the run at start-up. A kernel that cannot
compile or launch warns once, and from then on torch's generator, seeded with the seed, draws the
bits (the same bits for the same seed: checkpointing's recomputation still matches).
"""

from __future__ import annotations

import importlib.util
import os

import torch
from torch import nn

from .accelerated import alternative_from_environment, warn_kernel_failed
from .bucket_attention import dropout_threshold

DROPOUT_ENV = "PMLM_HIDDEN_DROPOUT"
"""`bits` (the default): compiled regions draw hidden dropout with `dropout_keep_bits`; `torch`: with
Inductor's own dropout, as before."""
ROWS = 32
"""Rows (tokens) a kernel program draws."""
BYTES = 32
"""Bytes of a row (8 positions each: 256 of its columns) a kernel program draws."""
COMPILED_ONLY = True
"""The bits are drawn only where torch.compile traces the call (tests turn this off to run the same
path eagerly)."""


def _from_environment() -> tuple[bool, str | None]:
    """(whether DROPOUT_ENV leaves the kernel on, what is wrong with its value or None: a malformed
    value keeps Inductor's dropout and the model refuses to start, `model.check_attention_backend`)."""
    inductors, problem = alternative_from_environment(DROPOUT_ENV, "bits", "torch")
    return not (inductors or problem) and importlib.util.find_spec("triton") is not None, problem


KERNEL_ENABLED, ENVIRONMENT_PROBLEM = _from_environment()
"""Read once at import: compiled code reads a constant, not the environment."""
INTERPRETED = KERNEL_ENABLED and os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernel on CPU tensors: the tests take the GPU's path on the CPU."""


def applies(hidden: torch.Tensor, p: float) -> bool:
    """Whether dropout with probability `p` of `hidden` (in training) draws its positions as bits."""
    return (0.0 < p < 1.0 and (torch.compiler.is_compiling() or not COMPILED_ONLY)
            and ((hidden.device.type == "cuda" and KERNEL_ENABLED) or INTERPRETED)
            and hidden.dtype in (torch.float32, torch.float16, torch.bfloat16) and hidden.dim() >= 1)


class HiddenDropout(nn.Dropout):
    """nn.Dropout whose compiled training calls draw the kept positions as bits (see the module)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.training and not self.inplace and applies(hidden, self.p):
            return dropout_by_bits(hidden, self.p)
        return super().forward(hidden)


def dropout_by_bits(hidden: torch.Tensor, p: float) -> torch.Tensor:
    """Dropout of `hidden` along its last dimension's positions, each kept when its 16-bit draw
    passes round(p x 65536), the kept values scaled by 65536 / (65536 - that)."""
    threshold, scale = dropout_threshold(p)
    columns = hidden.shape[-1]
    rows = hidden.numel() // columns if columns else 0
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64, device=hidden.device)
    bits = torch.ops.megatron_pmlm.dropout_keep_bits(seed, rows, columns, threshold)
    return torch.where(kept_positions(bits, hidden.shape), hidden * scale, 0.0)


def kept_positions(bits: torch.Tensor, shape) -> torch.Tensor:
    """bool `shape` from [rows, ceil(columns / 8)] bits: bit k of byte c is column 8c + k."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    keep = ((bits.unsqueeze(-1) >> shifts) & 1) != 0
    return keep.flatten(-2)[:, :shape[-1]].reshape(shape)


UNPACKING_OPS = (torch.ops.aten.__rshift__.Tensor, torch.ops.aten.bitwise_and.Scalar, torch.ops.aten.ne.Scalar)
"""The ops of `kept_positions` that compute: cheaper recomputed from the bits in the backward than
saved (a byte a position); `model._save_residual_sums` says so to AOT autograd's partitioner."""


@torch.library.custom_op("megatron_pmlm::dropout_keep_bits", mutates_args=())
def dropout_keep_bits(seed: torch.Tensor, rows: int, columns: int, threshold: int) -> torch.Tensor:
    """uint8 [rows, ceil(columns / 8)]: bit k of byte c set where position (row, 8c + k) is kept, its
    16-bit draw (keyed by the int64 `seed` [1]) >= `threshold`."""
    if seed.dtype != torch.int64 or seed.numel() != 1:
        raise ValueError(f"dropout_keep_bits: the seed must be one int64, got {seed.dtype} {tuple(seed.shape)}")
    if not 0 <= threshold < 1 << 16 or rows < 0 or columns < 0 or rows >= 1 << 32:
        raise ValueError(f"dropout_keep_bits: rows {rows}, columns {columns}, threshold {threshold} out of range")
    if KERNEL_ENABLED and (seed.device.type == "cuda" or INTERPRETED):
        try:
            return _kernel(seed, rows, columns, threshold)
        except Exception as error:  # Triton cannot compile or launch here: torch's generator from now on
            _turn_off(error)
    return _generator_bits(seed, rows, columns, threshold)


@dropout_keep_bits.register_fake
def _(seed: torch.Tensor, rows: int, columns: int, threshold: int) -> torch.Tensor:
    return seed.new_empty(rows, (columns + 7) // 8, dtype=torch.uint8)


def _kernel(seed: torch.Tensor, rows: int, columns: int, threshold: int) -> torch.Tensor:
    from .hidden_dropout_triton import dropout_keep_bits_kernel

    byte_columns = (columns + 7) // 8
    bits = torch.empty(rows, byte_columns, dtype=torch.uint8, device=seed.device)
    if bits.numel():
        dropout_keep_bits_kernel[(-(-rows // ROWS), -(-byte_columns // BYTES))](
            seed, bits, rows, columns, byte_columns, threshold, ROWS=ROWS, BYTES=BYTES)
    return bits


def _generator_bits(seed: torch.Tensor, rows: int, columns: int, threshold: int) -> torch.Tensor:
    """The fallback: 16-bit draws from torch's generator seeded with the seed (read to the host), the
    same bits for the same seed."""
    generator = torch.Generator(device=seed.device).manual_seed(int(seed.item()))
    byte_columns = (columns + 7) // 8
    draws = torch.randint(0, 1 << 16, (rows, byte_columns * 8), generator=generator, device=seed.device,
                          dtype=torch.int32)
    keep = (draws >= threshold) & (torch.arange(byte_columns * 8, device=seed.device) < columns)
    weights = 1 << torch.arange(8, device=seed.device, dtype=torch.int32)
    return (keep.view(rows, byte_columns, 8).to(torch.int32) * weights).sum(-1).to(torch.uint8)


def _turn_off(error: Exception) -> None:
    """After the kernel failed: one warning, and torch's generator from then on."""
    global KERNEL_ENABLED, INTERPRETED
    KERNEL_ENABLED = INTERPRETED = False
    warn_kernel_failed("the hidden dropout", "drawing its bits with torch's generator", f"{DROPOUT_ENV}=torch", error)
