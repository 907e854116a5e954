"""The FFN's GELU whose backward kernel also sums the bias gradient (`models/ffn_activation.py`).

On the CPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, which must be set before the
module is imported: each check is a fresh process), the same program a GPU compiles; the GPU itself
is checked in tests/test_gpu.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from megatron_pmlm.models import ffn_activation
import pmlm_testing
from pmlm_testing import REPO_ROOT, compiled_for_gpus

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (pyproject's test extra installs it on x86_64 Linux)")

INTERPRETED = r"""
import copy, json, sys, warnings
import torch
from megatron_pmlm.config import model_config_from_preset
from megatron_pmlm.models import ffn_activation, ffn_activation_triton
from megatron_pmlm.models.model import BertLayer
from megatron_pmlm.parallel.layers import LocalLayers

report = {"kernel": []}
generator = torch.Generator().manual_seed(0)
# ragged tiles (rows and columns not multiples of the tile), one row, a [B, T, ffn] activation
for shape in [(37, 96), (5, 130), (1, 3), (3, 11, 256)]:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        pre = (torch.randn(shape, generator=generator) * 2).to(dtype)
        grad = torch.randn(shape, generator=generator).to(dtype)
        ours, sums = torch.ops.megatron_pmlm.gelu_backward_with_bias_sums(grad, pre)
        aten = torch.ops.aten.gelu_backward(grad, pre)
        # one unit in the last place of the output, plus the fp32 rounding of dy x (cdf + x pdf)'s terms:
        # Triton's and ATen's erf and exp are different fp32 implementations
        bound = (torch.finfo(dtype).eps * aten.double().abs()
                 + 4 * torch.finfo(torch.float32).eps * grad.double().abs() * (1 + pre.double().abs()))
        excess = ((ours.double() - aten.double()).abs() - bound).max()
        exact_sums = ours.double().reshape(-1, shape[-1]).sum(0)
        report["kernel"].append({"shape": list(shape), "dtype": str(dtype), "out": [str(ours.dtype), list(ours.shape)],
                                 "sums": [str(sums.dtype), list(sums.shape)], "excess": float(excess),
                                 "sums_error": float((sums.double() - exact_sums).abs().max()
                                                     / exact_sums.abs().max())})
torch.library.opcheck(torch.ops.megatron_pmlm.gelu_backward_with_bias_sums.default,
                      (torch.randn(4, 6), torch.randn(4, 6)),
                      test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))

# A layer: the kernel's path against autograd's (the same parameters and input), eager and compiled.
def step(layer, hidden, kernel):
    ffn_activation.INTERPRETED = kernel
    layer.zero_grad(set_to_none=True)
    hidden = hidden.detach().requires_grad_()
    out = layer(hidden, None)
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    grads["input"] = hidden.grad.clone()
    return out.detach(), grads

def difference(grads, expected):
    # Largest relative difference over the gradients, with a floor of 1e-3 of the largest gradient:
    # the key bias's gradient is 0 up to rounding (softmax ignores it), ~1e-7 here.
    floor = 1e-3 * max(float(value.double().norm()) for value in expected.values())
    return max(float((grads[name].double() - expected[name].double()).norm())
               / max(float(expected[name].double().norm()), floor) for name in expected)

for dtype in (torch.float32, torch.bfloat16):
    config = model_config_from_preset("tiny", hidden_dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(1)
    layer = BertLayer(config, LocalLayers()).to(dtype).train()
    hidden = torch.randn(3, 20, config.hidden_size).to(dtype)
    ffn_activation.INTERPRETED = True
    chosen = ffn_activation.applies(layer.intermediate.dense, hidden)
    out, grads = step(layer, hidden, True)
    reference_out, reference = step(layer, hidden, False)
    worst = difference(grads, reference)
    compiled = copy.deepcopy(layer)
    compiled.forward = torch.compile(compiled.forward, backend="aot_eager", fullgraph=True)
    compiled_out, compiled_grads = step(compiled, hidden, True)
    compiled_worst = difference(compiled_grads, grads)
    report[str(dtype)] = {"chosen": chosen, "same_output": bool(torch.equal(out, reference_out)), "worst": worst,
                          "bias_grad_dtype": str(grads["intermediate.dense.bias"].dtype),
                          "compiled_same_output": bool(torch.equal(compiled_out, out)),
                          "compiled_worst": compiled_worst}
with torch.no_grad():
    report["no_grad_chosen"] = ffn_activation.applies(layer.intermediate.dense, hidden)

# A kernel that cannot compile on a machine: one warning, the same values by torch's ops from then on.
class NoCompiler:
    def __getitem__(self, grid):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

ffn_activation_triton.gelu_backward_kernel = NoCompiler()
ffn_activation.INTERPRETED = True
grad, pre = torch.randn(4, 6), torch.randn(4, 6)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = torch.ops.megatron_pmlm.gelu_backward_with_bias_sums(grad, pre)
    second = torch.ops.megatron_pmlm.gelu_backward_with_bias_sums(grad, pre)
expected = torch.ops.aten.gelu_backward(grad, pre)
report["failing"] = {"warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                     "equal": all(torch.equal(pair[0], expected) for pair in (first, second)),
                     "applies_after": ffn_activation.applies(layer.intermediate.dense, hidden)}
json.dump(report, sys.stdout)
"""


def run_interpreted(source: str) -> dict:
    return pmlm_testing.run_interpreted(source, unset=(ffn_activation.BIAS_GRADIENT_ENV,))


def test_the_gelu_backward_kernel_sums_the_bias_gradient_and_trains_the_layer_as_autograd_does():
    """The kernel (in the interpreter, as on a GPU): GELU's input gradient within one unit in the last
    place of ATen's and fp32's rounding of its terms (fp32, bf16 rounded to nearest as a GPU rounds,
    fp16), for ragged tiles and a
    [B, T, ffn] activation; its column sums the fp32 sums of what it wrote; torch.library's checks
    of the op. A tiny layer trained through it: the same output, and every gradient as autograd's
    (fp32 within the order of fp32 additions, bf16 within its rounding), eager and compiled (one
    graph); not taken without gradients. A kernel that cannot compile warns once, naming the switch,
    and torch's ops give the same values from then on."""
    report = run_interpreted(INTERPRETED)
    assert len(report["kernel"]) == 12
    for row in report["kernel"]:
        assert row["out"] == [row["dtype"], row["shape"]] and row["sums"] == ["torch.float32", row["shape"][-1:]], row
        assert row["excess"] <= 0 and row["sums_error"] <= 1e-6, row
    for dtype, bound in (("torch.float32", 1e-6), ("torch.bfloat16", 2e-2)):
        result = report[dtype]
        assert result["chosen"] and result["same_output"] and result["compiled_same_output"], result
        assert result["worst"] <= bound and result["compiled_worst"] <= bound, result
        assert result["bias_grad_dtype"] == dtype, result
    assert report["no_grad_chosen"] is False
    failing = report["failing"]
    assert failing["equal"] and not failing["applies_after"], failing
    (warning,) = failing["warnings"]
    assert "Triton kernel failed here (RuntimeError: Failed to find C compiler" in warning
    assert "PMLM_FFN_BIAS_GRADIENT=autograd" in warning


def test_the_environment_turns_the_kernel_off_and_a_bad_value_stops_the_model(monkeypatch):
    """PMLM_FFN_BIAS_GRADIENT=autograd keeps autograd's bias gradient on a GPU too (read once, at
    import: a fresh process here, given a malformed value, which it keeps and refuses); another value
    than kernel or autograd: the model refuses to start, naming the variable."""
    code = ("import sys; from megatron_pmlm.config import model_config_from_preset, ConfigError\n"
            "from megatron_pmlm.models import ffn_activation\nfrom megatron_pmlm.models.model import BertModel\n"
            "try:\n    BertModel(model_config_from_preset('tiny'))\n    built = 'built'\n"
            "except ConfigError as error:\n    built = str(error)\n"
            "sys.stdout.write(f'{ffn_activation.KERNEL_ENABLED}|{built}')")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), ffn_activation.BIAS_GRADIENT_ENV: "fast"}
    env.pop("TRITON_INTERPRET", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT)
    assert result.returncode == 0 and result.stdout.startswith(
        "False|PMLM_FFN_BIAS_GRADIENT='fast': give kernel (the default"), (result.stdout, result.stderr[-2000:])
    pmlm_testing.check_kernel_switch(monkeypatch, ffn_activation, ffn_activation.BIAS_GRADIENT_ENV,
                                     {"autograd": False, "kernel": True}, "fast")


def test_the_path_is_taken_only_where_it_computes_the_same_model(monkeypatch):
    """A GPU (here: the interpreter) and a plain Linear with a trained bias, in training; never
    megatron-core's tensor-parallel layers, a frozen bias, ZeRO-3's partitioned parameters, a linear
    with forward hooks, without gradients, nor on the CPU otherwise."""
    hidden = torch.randn(2, 3, 8)
    linear = nn.Linear(8, 16)
    monkeypatch.setattr(ffn_activation, "KERNEL_ENABLED", True)
    monkeypatch.setattr(ffn_activation, "INTERPRETED", False)
    assert not ffn_activation.applies(linear, hidden)  # the CPU without the interpreter
    monkeypatch.setattr(ffn_activation, "INTERPRETED", True)
    assert ffn_activation.applies(linear, hidden)
    assert not ffn_activation.applies(linear, hidden.long())

    class Subclass(nn.Linear):  # megatron-core's and other wrappers are not plain Linears
        pass

    assert not ffn_activation.applies(Subclass(8, 16), hidden)
    frozen = nn.Linear(8, 16)
    frozen.bias.requires_grad_(False)
    assert not ffn_activation.applies(frozen, hidden)
    assert not ffn_activation.applies(nn.Linear(8, 16, bias=False), hidden)
    partitioned = nn.Linear(8, 16)
    partitioned.weight.ds_id = 0  # what ZeRO-3 marks its parameters with
    assert not ffn_activation.applies(partitioned, hidden)
    hooked = nn.Linear(8, 16)  # the path does not call the module: its hooks would not run
    hooked.register_forward_hook(lambda module, args, output: None)
    assert not ffn_activation.applies(hooked, hidden)
    with torch.no_grad():
        assert not ffn_activation.applies(linear, hidden)


COMPILED_FOR_GPUS = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_pmlm.models.ffn_activation import COLUMNS, ROWS
from megatron_pmlm.models.ffn_activation_triton import gelu_backward_kernel

report = []
for capability in (80, 90):
    for dtype in ("*bf16", "*fp16", "*fp32"):
        signature = {"grad_ptr": dtype, "pre_ptr": dtype, "out_ptr": dtype, "partial_ptr": "*fp32", "rows": "i32",
                     "columns": "i32", "ROWS": "constexpr", "COLUMNS": "constexpr", "ROUND_TO_BF16": "constexpr"}
        compiled = triton.compile(ASTSource(fn=gelu_backward_kernel, signature=signature,
                                            constexprs={"ROWS": ROWS, "COLUMNS": COLUMNS, "ROUND_TO_BF16": False}),
                                  target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
        report.append({"capability": capability, "dtype": dtype, "cubin": len(compiled.asm.get("cubin", b"")),
                       "shared": compiled.metadata.shared})
json.dump(report, sys.stdout)
"""


def test_the_gelu_backward_kernel_compiles_for_the_gpus_it_is_meant_for():
    """Triton's own compiler, without a GPU, down to SM 8.0 and 9.0 machine code for bf16, fp16 and
    fp32 (what the interpreter cannot catch: types, functions and globals the GPU code generator
    refuses; a float global not declared constexpr failed here), within an A100's shared memory."""
    report = compiled_for_gpus(COMPILED_FOR_GPUS)
    assert len(report) == 6 and all(row["cubin"] > 0 and row["shared"] <= 164 * 1024 for row in report), report
