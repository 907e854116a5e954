"""The relative-bias table's gradient: the [B, heads, T, T] gradient of the dense bias summed per
distance bucket into the [heads, bins] table, by one-hot GEMMs (`one_hot_bucket_sums`, any device)
or in one pass by a Triton kernel (`bucket_sums`, CUDA); `relative_bias.table_gradient` picks.

The GEMMs, on a GPU, cost far more than the gradient's own bytes:
per query-key pair it writes and reads an fp32 one-hot row (bins x 4 = 128 bytes at 32 bins) and
an fp32 copy of the gradient (heads x 4), against heads x 2 bytes of bf16 gradient, and cuBLAS
runs the skinny [heads, pairs] @ [pairs, bins] product on CUDA cores (the H100 trace: 1.8 ms at
seq 128 x 256 for the GEMMs alone). `bucket_sums` reads the gradient and the uint8 buckets once:
each tile's one-hot lives in registers and is contracted on the tensor cores (`tl.dot`, fp32
accumulation; half-precision gradients enter in their own dtype, the one-hot in the same: each
product is exact; fp32 gradients as IEEE fp32), per-program partial tables are summed in a fixed
order: the same sums as the GEMMs' (fp32, up to the order of additions), deterministic.

It is a custom op (`torch.ops.megatron_pmlm.bucket_sums`): eager and compiled code call the same
kernel, which inductor treats as an opaque call. `table_gradient` uses it for CUDA gradients when
Triton is installed (it comes with PyTorch's CUDA builds), unless PMLM_TABLE_GRADIENT=gemm; the
CPU keeps the GEMMs, and so does a run whose first kernel launch fails (one warning). Its tests
run the kernel in Triton's interpreter on the CPU (`TRITON_INTERPRET=1`), which executes the same
program on CPU tensors.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from . import launch_tuning
from .accelerated import warn_kernel_failed

TABLE_GRADIENT_ENV = "PMLM_TABLE_GRADIENT"
"""`gemm` keeps the one-hot GEMMs on a GPU too (a fallback, and what `bench_attention_kernels` compares)."""
ROWS = 4
"""Query rows per program; with KEYS_BLOCK, 256 query-key pairs per tile."""
KEYS_BLOCK = 64
"""Keys per tile: 64 contiguous bf16 gradient values (128 bytes) per head and row."""
LAUNCH = launch_tuning.Launch(num_warps=4, num_stages=3)
"""The kernel's base launch (Triton's defaults); on a GPU its stages and register cap are tuned per
problem (`launch_tuning`: the tiles and warps stay, so the sums stay the same bits)."""
MIN_BLOCK = 16
"""tl.dot's smallest dimension: heads and bins are padded up to a power of two >= this."""
ONE_HOT_CHUNK_BYTES = 64 * 2 ** 20
"""Largest one-hot block `one_hot_bucket_sums` materialises at once."""


def kernel_enabled() -> bool:
    """Whether CUDA gradients go through the kernel: Triton importable and not turned off."""
    return (os.environ.get(TABLE_GRADIENT_ENV, "kernel") != "gemm"
            and importlib.util.find_spec("triton") is not None)


KERNEL_ENABLED = kernel_enabled()
"""Read once at import: compiled code reads a constant, not the environment."""
INTERPRETED = KERNEL_ENABLED and os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernel on CPU tensors: the tests take the GPU's paths on the CPU."""


def runs_on(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the table gradient of a bias gradient on `device` in `dtype` goes through the kernel:
    on CUDA (any device under Triton's interpreter), in fp32, bf16 or fp16, the kernel enabled."""
    return (((device.type == "cuda" and KERNEL_ENABLED) or INTERPRETED)
            and dtype in (torch.float32, torch.float16, torch.bfloat16))


def one_hot_bucket_sums(grad: torch.Tensor, buckets: torch.Tensor, bins: int, dtype: torch.dtype) -> torch.Tensor:
    """The same sums as `bucket_sums`, in `dtype`, by one-hot GEMMs on any device (the CPU's way):
    grad[b, :, rows] [heads, rows x keys] @ one_hot(buckets[b, rows]) [rows x keys, bins],
    accumulated in fp32 for half-precision gradients. When whole sequences' one-hots fit
    ONE_HOT_CHUNK_BYTES, one GEMM covers as many sequences as fit: a handful of kernels for the
    micro batch, whatever the gradient's dtype and layout (each chunk of the gradient is copied to a
    contiguous [heads, sequences, queries, keys] in the accumulation dtype, at most heads / bins of
    the one-hot's bytes). Otherwise chunks of query rows, one sequence at a time (an aligned view is
    then batched over rows instead of copied)."""
    batch, heads, queries, keys = grad.shape
    accumulate = torch.float32 if grad.dtype in (torch.float16, torch.bfloat16) else grad.dtype
    one_hot_row_bytes = keys * bins * torch.finfo(accumulate).bits // 8
    rows_per_chunk = max(1, ONE_HOT_CHUNK_BYTES // one_hot_row_bytes)
    bin_ids = torch.arange(bins, dtype=buckets.dtype, device=buckets.device)
    sequences_per_chunk = rows_per_chunk // queries
    if sequences_per_chunk >= 1:
        total = torch.zeros(heads, bins, dtype=accumulate, device=grad.device)
        for start in range(0, batch, sequences_per_chunk):
            sequences = slice(start, start + sequences_per_chunk)
            one_hot = (buckets[sequences, :, :, None] == bin_ids).to(accumulate)  # [sequences, queries, keys, bins]
            # [heads, sequences x queries x keys] @ [sequences x queries x keys, bins]: one plain GEMM per
            # chunk (on an H100 cuBLAS ran the batched form, [sequences, heads, pairs] @ [sequences,
            # pairs, bins], as a slow GEMV-like kernel: 1 ms a chunk at seq 128 x 16)
            chunk = grad[sequences].transpose(0, 1).to(accumulate, memory_format=torch.contiguous_format)
            total.addmm_(chunk.reshape(heads, -1), one_hot.view(-1, bins))
        return total.to(dtype)
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    flat_rows = grad.stride(2) == keys  # rows follow each other: [heads, rows x keys] is a view
    total = torch.zeros(heads, bins, dtype=accumulate, device=grad.device)
    for b in range(batch):
        for start in range(0, queries, rows_per_chunk):
            rows = slice(start, start + rows_per_chunk)
            one_hot = (buckets[b, rows, :, None] == bin_ids).to(accumulate)  # [rows, keys, bins]
            chunk = grad[b, :, rows].to(accumulate)  # [heads, rows, keys]
            if flat_rows:
                total.addmm_(chunk.reshape(heads, -1), one_hot.view(-1, bins))
            else:
                total += torch.bmm(chunk.transpose(0, 1), one_hot).sum(0)
    return total.to(dtype)


def _block(size: int) -> int:
    return max(MIN_BLOCK, 1 << (size - 1).bit_length())


@torch.library.custom_op("megatron_pmlm::bucket_sums", mutates_args=())
def bucket_sums(grad: torch.Tensor, buckets: torch.Tensor, bins: int, key_tiles: torch.Tensor | None = None,
                tile_queries: int = 0, tile_keys: int = 0) -> torch.Tensor:
    """[heads, bins] fp32: grad[b, h, i, j] ([B, heads, queries, keys], any strides but the last 1)
    summed over the pairs (b, i, j) whose buckets[b, i, j] ([B, queries, keys], integer) is each bin
    (a bucket >= bins, BLOCKED, counts in none). `key_tiles`, optional: int32 [B, query blocks, 1 + key
    blocks] listing per block of `tile_queries` queries the blocks of `tile_keys` keys that hold a
    bucket < bins (`bucket_attention.TileLists.key_tiles`): the kernel reads only those (the same
    sums: the others add nothing)."""
    batch, heads, queries, keys = grad.shape
    if buckets.shape != (batch, queries, keys):
        raise ValueError(f"bucket_sums: buckets {tuple(buckets.shape)} do not match the gradient {tuple(grad.shape)}")
    if key_tiles is not None:
        _check_tiles(key_tiles, batch, queries, keys, tile_queries, tile_keys)
    if not (KERNEL_ENABLED or INTERPRETED):  # turned off by a failure (below): the GEMMs
        return one_hot_bucket_sums(grad, buckets, bins, torch.float32)
    try:
        return _kernel_sums(grad, buckets, bins, key_tiles, tile_queries, tile_keys)
    except Exception as error:  # Triton cannot compile or launch here: the run goes on with the GEMMs
        _turn_off(error)
        return one_hot_bucket_sums(grad, buckets, bins, torch.float32)


def _turn_off(error: Exception) -> None:
    """After the kernel failed: one warning, and the GEMMs (with the shared bias) from then on."""
    global KERNEL_ENABLED, INTERPRETED
    KERNEL_ENABLED = INTERPRETED = False
    warn_kernel_failed("the relative-bias table gradient", "using the one-hot GEMMs", f"{TABLE_GRADIENT_ENV}=gemm",
                       error)


def _check_tiles(key_tiles: torch.Tensor, batch: int, queries: int, keys: int, tile_queries: int,
                 tile_keys: int) -> None:
    if tile_queries <= 0 or tile_queries % ROWS or tile_keys <= 0 or tile_keys % KEYS_BLOCK:
        raise ValueError(f"bucket_sums: tiles of {tile_queries} x {tile_keys}: the queries must be a positive "
                         f"multiple of {ROWS} and the keys of {KEYS_BLOCK}")
    expected = (batch, -(-queries // tile_queries), 1 + -(-keys // tile_keys))
    if key_tiles.dtype != torch.int32 or key_tiles.shape != expected:
        raise ValueError(f"bucket_sums: key_tiles {key_tiles.dtype} {tuple(key_tiles.shape)} is not int32 {expected} "
                         f"(tiles of {tile_queries} x {tile_keys} over {queries} x {keys})")


def _kernel_sums(grad: torch.Tensor, buckets: torch.Tensor, bins: int, key_tiles: torch.Tensor | None = None,
                 tile_queries: int = 0, tile_keys: int = 0) -> torch.Tensor:
    from .bucket_sums_triton import bucket_sums_kernel

    batch, heads, queries, keys = grad.shape
    grad = grad if grad.stride(-1) == 1 else grad.contiguous()
    buckets = buckets if buckets.stride(-1) == 1 else buckets.contiguous()
    heads_block, bins_block = _block(heads), _block(bins)
    # 16-byte vectors of a row's keys where the gradient's start and strides allow them
    vector = 16 // grad.element_size()
    while vector > 1 and (grad.data_ptr() % (vector * grad.element_size())
                          or any(stride % vector for stride in grad.stride()[:3])):
        vector //= 2
    row_blocks = -(-queries // ROWS)
    programs = batch * row_blocks
    partial = torch.empty(programs, heads_block, bins_block, dtype=torch.float32, device=grad.device)
    if programs:
        constants = dict(HEADS_BLOCK=heads_block, BINS_BLOCK=bins_block, ROWS=ROWS, KEYS_BLOCK=KEYS_BLOCK,
                         VECTOR=vector,
                         # the interpreter misreads bf16 tl.dot operands (Triton 3.9); fp16 runs as on a GPU
                         UPCAST=INTERPRETED and grad.dtype == torch.bfloat16,
                         LISTED=key_tiles is not None, TILE_QUERIES=tile_queries, TILE_KEYS=tile_keys)
        tiles_arg = key_tiles if key_tiles is not None else partial  # never read unless LISTED
        tiles_strides = (key_tiles.stride(0), key_tiles.stride(1)) if key_tiles is not None else (0, 0)

        def launch(options: launch_tuning.Launch):
            return bucket_sums_kernel[(programs,)](
                grad, buckets, partial, tiles_arg, heads, queries, keys, grad.stride(0) // vector,
                grad.stride(1) // vector, grad.stride(2) // vector, buckets.stride(0), buckets.stride(1), row_blocks,
                *tiles_strides, **constants, **options.launch_options())

        if not launch_tuning.tunes(grad.device, INTERPRETED, pinned=False):
            launch(LAUNCH)
        else:  # keyed on the grid, the keys a program walks (what pipeline stages overlap), the constants
            tiles = -(-keys // KEYS_BLOCK)
            problem = (programs, tiles, grad.dtype, tuple(sorted(constants.items())))
            launch_tuning.tuned_launch("bucket_sums_kernel", LAUNCH, problem, launch, grad.device, True,
                                       lambda: f"{programs} programs of {tiles} tiles, {grad.dtype}")
    return partial[:, :heads, :bins].sum(0)  # one kernel, the padding of the blocks left out


@bucket_sums.register_fake
def _(grad: torch.Tensor, buckets: torch.Tensor, bins: int, key_tiles: torch.Tensor | None = None,
      tile_queries: int = 0, tile_keys: int = 0) -> torch.Tensor:
    return grad.new_empty(grad.shape[1], bins, dtype=torch.float32)
