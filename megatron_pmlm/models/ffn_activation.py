"""The FFN's GELU in training, whose backward also sums the FFN bias's gradient.

Why: compiled, a layer's elementwise kernels move ~56 activations ([tokens, hidden] tensors) at
base; the FFN's bias gradient is 4 of them: Inductor reduces it in a kernel of its own that reads
GELU's [tokens, ffn] input gradient again after the GELU backward kernel wrote it
(tools/bench_layer_graph.py; docs/benchmarks.md, "The compiled layer's kernels on a GPU"). Here
one Triton kernel (`ffn_activation_triton`) writes that gradient and the per-tile column sums of
what it wrote, and the bias gradient is those sums summed: the second pass is gone.

How it stays the same model: the FFN's first linear still adds its bias in the GEMM (cuBLAS's
epilogue), with the bias detached there; `gelu_with_bias_gradient(pre, bias)` returns GELU(pre) and
hands `bias` its gradient, the column sums of GELU's input gradient: what autograd gave it through
the GEMM (the same sums up to the order of their fp32 additions; GELU's input gradient within a
unit in the last place of ATen's, whose fp32 erf and exp differ from Triton's). Parameters, checkpoints and
Hugging Face exports are unchanged.

Where: a CUDA tensor with Triton installed (Triton's interpreter on the CPU, for tests), a plain
`nn.Linear` (tensor parallelism keeps megatron-core's layers as they are) whose bias is trained and
not partitioned by ZeRO-3 (its parameters are gathered by hooks around the module's own forward)
and that has no forward hooks of its own (this path computes the linear without calling it),
training with gradients. Elsewhere the layer runs as before. `PMLM_FFN_BIAS_GRADIENT=autograd` keeps
autograd's way on a GPU too (for comparisons); another value than `kernel` or `autograd` stops the
run at start-up. A kernel that cannot compile or launch on a machine warns once and torch's ops
(autograd's values) take over.
"""

from __future__ import annotations

import importlib.util
import os

import torch
import torch.nn.functional as F
from torch import nn

from .accelerated import alternative_from_environment, warn_kernel_failed

BIAS_GRADIENT_ENV = "PMLM_FFN_BIAS_GRADIENT"
"""`kernel` (the default): the FFN bias gradient from the GELU backward kernel; `autograd`: as before."""
ROWS = 32
"""Tokens a kernel program covers (a fixed tile: the order of the sums never depends on the GPU)."""
COLUMNS = 128
"""FFN features a kernel program covers: 128 contiguous values of a row (256 bytes in bf16)."""


def _from_environment() -> tuple[bool, str | None]:
    """(whether BIAS_GRADIENT_ENV leaves the kernel on, what is wrong with its value or None: a
    malformed value keeps autograd's way and the model refuses to start, `model.check_attention_backend`)."""
    autograd, problem = alternative_from_environment(BIAS_GRADIENT_ENV, "kernel", "autograd")
    return not (autograd or problem) and importlib.util.find_spec("triton") is not None, problem


KERNEL_ENABLED, ENVIRONMENT_PROBLEM = _from_environment()
"""Read once at import: compiled code reads a constant, not the environment."""
INTERPRETED = KERNEL_ENABLED and os.environ.get("TRITON_INTERPRET") == "1"
"""Triton's interpreter runs the kernel on CPU tensors: the tests take the GPU's path on the CPU."""


def applies(linear: nn.Module, hidden: torch.Tensor) -> bool:
    """Whether the FFN whose first linear is `linear`, on `hidden`, takes the kernel's path."""
    bias = getattr(linear, "bias", None)
    return (type(linear) is nn.Linear and bias is not None and bias.requires_grad and torch.is_grad_enabled()
            and not hasattr(linear.weight, "ds_id") and not (linear._forward_pre_hooks or linear._forward_hooks)
            and ((hidden.device.type == "cuda" and KERNEL_ENABLED) or INTERPRETED)
            and hidden.dtype in (torch.float32, torch.float16, torch.bfloat16))


def ffn_gelu(linear: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """GELU(linear(hidden)), the bias's gradient summed by the GELU backward kernel (see the module)."""
    return gelu_with_bias_gradient(F.linear(hidden, linear.weight, linear.bias.detach()), linear.bias)


class _GeluWithBiasGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, pre: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(pre)
        ctx.bias_dtype = bias.dtype
        return F.gelu(pre)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (pre,) = ctx.saved_tensors
        grad_pre, bias_grad = torch.ops.megatron_pmlm.gelu_backward_with_bias_sums(grad, pre)
        return grad_pre, bias_grad.to(ctx.bias_dtype)


def gelu_with_bias_gradient(pre: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """GELU(pre) (erf), where `pre` already holds `bias` (added with it detached): `bias` gets the sum
    of GELU's input gradient over every dimension but the last."""
    return _GeluWithBiasGradient.apply(pre, bias)


@torch.library.custom_op("megatron_pmlm::gelu_backward_with_bias_sums", mutates_args=())
def gelu_backward_with_bias_sums(grad: torch.Tensor, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(GELU's input gradient, in grad's dtype and pre's shape; its fp32 sums over every dimension but
    the last)."""
    if grad.shape != pre.shape:
        raise ValueError(f"gelu_backward_with_bias_sums: grad {tuple(grad.shape)} and pre {tuple(pre.shape)} differ")
    if KERNEL_ENABLED and (grad.device.type == "cuda" or INTERPRETED):
        try:
            return _kernel(grad, pre)
        except Exception as error:  # Triton cannot compile or launch here: autograd's way from now on
            _turn_off(error)
    grad_pre = torch.ops.aten.gelu_backward(grad, pre)
    return grad_pre, grad_pre.reshape(-1, grad_pre.shape[-1]).sum(0, dtype=torch.float32)


def _turn_off(error: Exception) -> None:
    """After the kernel failed: one warning, and torch's ops (autograd's values) from then on."""
    global KERNEL_ENABLED, INTERPRETED
    KERNEL_ENABLED = INTERPRETED = False
    warn_kernel_failed("the FFN GELU backward", "using torch's GELU backward and bias sum",
                       f"{BIAS_GRADIENT_ENV}=autograd", error)


def _kernel(grad: torch.Tensor, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from .ffn_activation_triton import gelu_backward_kernel

    columns = grad.shape[-1]
    grad2 = grad.reshape(-1, columns).contiguous()
    pre2 = pre.reshape(-1, columns).contiguous()
    rows = grad2.shape[0]
    out = torch.empty_like(grad2)
    row_blocks = -(-rows // ROWS)
    partial = torch.empty(row_blocks, columns, dtype=torch.float32, device=grad.device)
    if rows and columns:
        gelu_backward_kernel[(row_blocks, -(-columns // COLUMNS))](grad2, pre2, out, partial, rows, columns,
                                                                   ROWS=ROWS, COLUMNS=COLUMNS,
                                                                   ROUND_TO_BF16=INTERPRETED and grad.dtype == torch.bfloat16)
    return out.view(grad.shape), partial.sum(0) if row_blocks else partial.new_zeros(columns)


@gelu_backward_with_bias_sums.register_fake
def _(grad: torch.Tensor, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(grad, memory_format=torch.contiguous_format),
            grad.new_empty(grad.shape[-1], dtype=torch.float32))
