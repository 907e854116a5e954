"""Hidden dropout drawn as bits in compiled regions (`models/hidden_dropout.py`).

On the CPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, which must be set before the
module is imported: the checks run in a fresh process), the same program a GPU compiles; the GPU
itself is checked in tests/test_gpu.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from megatron_pmlm.models import hidden_dropout
import pmlm_testing
from pmlm_testing import REPO_ROOT, compiled_for_gpus

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (pyproject's test extra installs it on x86_64 Linux)")

INTERPRETED = r"""
import copy, json, sys, warnings
import numpy as np
import torch
import torch._inductor.config as inductor_config
from megatron_pmlm.config import model_config_from_preset
from megatron_pmlm.models import hidden_dropout, hidden_dropout_triton
from megatron_pmlm.models.hidden_dropout import HiddenDropout, dropout_by_bits, kept_positions
from megatron_pmlm.models.model import BertLayer
from megatron_pmlm.parallel.layers import LocalLayers
from pmlm_testing import philox_keep_bits

op = torch.ops.megatron_pmlm.dropout_keep_bits
report = {"kernel": []}
# widths not a multiple of 8 or of a program's 256 columns, one row, a seed past 32 bits, nothing
# dropped, nearly everything dropped, no rows, no columns
for seed, rows, columns, threshold in ((12345, 70, 100, 6554), (2 ** 61 + 987654321, 33, 768, 6554), (7, 1, 5, 0),
                                       (3, 40, 64, 65535), (5, 0, 16, 6554), (5, 4, 0, 6554)):
    bits = op(torch.tensor([seed]), rows, columns, threshold)
    report["kernel"].append({"shape": list(bits.shape), "expected": [rows, (columns + 7) // 8], "dtype": str(bits.dtype),
                             "equal": bool(np.array_equal(bits.numpy(), philox_keep_bits(seed, rows, columns, threshold)))})
report["kept"] = float(kept_positions(op(torch.tensor([99]), 512, 768, 6554), (512, 768)).float().mean())
report["refused"] = []
for args in ((torch.tensor([1], dtype=torch.int32), 4, 8, 1), (torch.tensor([1, 2]), 4, 8, 1),
             (torch.tensor([1]), 4, 8, 65536), (torch.tensor([1]), -1, 8, 1)):
    try:
        op(*args)
        report["refused"].append(None)
    except ValueError as error:
        report["refused"].append(str(error))
torch.library.opcheck(op.default, (torch.tensor([3]), 6, 20, 6554),
                      test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))

# The module compiled by Inductor (its random numbers from torch's generator, as eager's): the same
# output and input gradient as the bits path run eagerly with the same seed, the op in the graph.
graphs = []
def keep_graph(graph_module, inputs):
    from torch._inductor.compile_fx import compile_fx
    graphs.append(graph_module.code)
    return compile_fx(graph_module, inputs)

drop = HiddenDropout(0.1).train()
x = torch.randn(3, 10, 24)
grad = torch.randn(3, 10, 24)
with inductor_config.patch(fallback_random=True):
    compiled = torch.compile(drop, backend=keep_graph, fullgraph=True)
    torch.manual_seed(5)
    ours = x.clone().requires_grad_()
    out = compiled(ours)
    out.backward(grad)
torch.manual_seed(5)
reference = x.clone().requires_grad_()
hidden_dropout.COMPILED_ONLY = False
expected = drop(reference)
hidden_dropout.COMPILED_ONLY = True
expected.backward(grad)
threshold, scale = hidden_dropout.dropout_threshold(0.1)
kept = expected != 0
report["module"] = {"graphs": len(graphs), "op_in_graph": "dropout_keep_bits" in graphs[0],
                    "same_output": bool(torch.equal(out, expected)), "same_grad": bool(torch.equal(ours.grad, reference.grad)),
                    "scaled": bool(torch.equal(expected[kept], x[kept] * scale)),
                    "grad_scaled": bool(torch.equal(reference.grad, torch.where(kept, grad * scale, 0.0))),
                    "kept": float(kept.float().mean()), "scale": scale}
torch.manual_seed(5)
eager = drop(x)  # not traced: nn.Dropout's own
torch.manual_seed(5)
report["eager_is_torch"] = bool(torch.equal(eager, torch.nn.functional.dropout(x, 0.1)))
report["eval_identity"] = bool(torch.equal(compiled.eval()(x), x))

# A layer compiled (both hidden dropouts, the residual sums' selective checkpointing): the same output
# and gradients as its bits path run eagerly, and under activation checkpointing (the recomputation
# draws the same bits again) the same gradients.
config = model_config_from_preset("tiny", hidden_dropout=0.1, attention_dropout=0.0)
torch.manual_seed(1)
layer = BertLayer(config, LocalLayers()).train()
hidden = torch.randn(2, 12, config.hidden_size)
weights = torch.linspace(-1, 1, config.hidden_size)

def step(forward, checkpointed=False):
    layer.zero_grad(set_to_none=True)
    inputs = hidden.clone().requires_grad_()
    torch.manual_seed(11)
    out = (torch.utils.checkpoint.checkpoint(forward, inputs, None, use_reentrant=False) if checkpointed
           else forward(inputs, None))
    (out * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    grads["input"] = inputs.grad.clone()
    return out.detach(), grads

layer_graphs = []
def keep_layer_graph(graph_module, inputs):
    from torch._dynamo.backends.common import aot_autograd
    layer_graphs.append(sum(node.target in (op, op.default)  # the checkpointed regions too
                            for module in graph_module.modules() if isinstance(module, torch.fx.GraphModule)
                            for node in module.graph.nodes))
    return aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g)(graph_module, inputs)

compiled_layer = torch.compile(layer.forward, backend=keep_layer_graph, fullgraph=True)
out, grads = step(compiled_layer)
checkpointed_out, checkpointed = step(compiled_layer, checkpointed=True)
hidden_dropout.COMPILED_ONLY = False
eager_out, eager_grads = step(layer.forward)
hidden_dropout.COMPILED_ONLY = True
def worst(grads, expected):
    return max(float((grads[name] - expected[name]).abs().max() / expected[name].abs().max().clamp_min(1e-12))
               for name in expected)
report["layer"] = {"ops_in_graph": layer_graphs[0], "graphs": len(layer_graphs),
                   "same_output": bool(torch.allclose(out, eager_out, rtol=1e-5, atol=1e-6)),
                   "worst": worst(grads, eager_grads), "checkpointed_same_output": bool(torch.equal(checkpointed_out, out)),
                   "checkpointed_worst": worst(checkpointed, grads)}

# A kernel that cannot compile on a machine: one warning, then torch's generator seeded with the seed
# (the same bits for the same seed), and the path no longer taken by new traces.
class NoCompiler:
    def __getitem__(self, grid):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

hidden_dropout_triton.dropout_keep_bits_kernel = NoCompiler()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = op(torch.tensor([42]), 300, 64, 6554)
    second = op(torch.tensor([42]), 300, 64, 6554)
    other = op(torch.tensor([43]), 300, 64, 6554)
report["failing"] = {"warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
                     "same_seed_same_bits": bool(torch.equal(first, second)), "other_seed_differs": not torch.equal(first, other),
                     "kept": float(kept_positions(first, (300, 64)).float().mean()),
                     "applies_after": hidden_dropout.applies(x, 0.1) or hidden_dropout.INTERPRETED}
json.dump(report, sys.stdout)
"""


def run_interpreted(source: str) -> dict:
    return pmlm_testing.run_interpreted(source, unset=(hidden_dropout.DROPOUT_ENV,))


def test_compiled_hidden_dropout_draws_philox_bits_and_applies_them_as_the_eager_path_does():
    """The kernel (in the interpreter, as on a GPU): the bits of Philox4x32-7 (numpy's reference from
    the round function) for ragged widths, one row, seeds past 32 bits, thresholds 0 and 65535, empty
    shapes; ~90% kept at 0.1; bad arguments refused naming them; torch.library's checks. Compiled by
    Inductor: the op in the graph, and the same output and gradient as the same path run eagerly
    (kept values scaled by 65536 / 58982, the rest 0); outside compiled code nn.Dropout's own; eval
    mode the identity. A compiled layer: both hidden dropouts drawn so, its output and gradients the
    eager path's, and activation checkpointing's recomputation draws the same bits (the same
    gradients). A kernel that cannot compile warns once, naming the switch; torch's generator gives
    the same bits for the same seed."""
    report = run_interpreted(INTERPRETED)
    assert len(report["kernel"]) == 6
    for row in report["kernel"]:
        assert row["equal"] and row["shape"] == row["expected"] and row["dtype"] == "torch.uint8", row
    assert abs(report["kept"] - (1 - 6554 / 65536)) < 5 * (0.09 / (512 * 768)) ** 0.5, report["kept"]
    seed_dtype, seed_shape, threshold, rows = report["refused"]
    assert "the seed must be one int64, got torch.int32" in seed_dtype and "got torch.int64 (2,)" in seed_shape
    assert "threshold 65536 out of range" in threshold and "rows -1" in rows
    module = report["module"]
    assert module["graphs"] == 1 and module["op_in_graph"], module
    assert module["same_output"] and module["same_grad"] and module["scaled"] and module["grad_scaled"], module
    assert 0.85 < module["kept"] < 0.95 and module["scale"] == 65536 / (65536 - 6554), module
    assert report["eager_is_torch"] and report["eval_identity"]
    layer = report["layer"]
    assert layer["graphs"] == 1 and layer["ops_in_graph"] == 2, layer
    assert layer["same_output"] and layer["worst"] <= 1e-5, layer
    assert layer["checkpointed_same_output"] and layer["checkpointed_worst"] == 0.0, layer
    failing = report["failing"]
    assert failing["same_seed_same_bits"] and failing["other_seed_differs"], failing
    assert 0.85 < failing["kept"] < 0.95 and not failing["applies_after"], failing
    (warning,) = failing["warnings"]
    assert "hidden dropout's Triton kernel failed here (RuntimeError: Failed to find C compiler" in warning
    assert "PMLM_HIDDEN_DROPOUT=torch" in warning


def test_the_environment_turns_the_bits_off_and_a_bad_value_stops_the_model(monkeypatch):
    """PMLM_HIDDEN_DROPOUT=torch keeps Inductor's dropout (read once, at import: a fresh process here);
    bits is the default; another value than bits or torch: the model refuses to start, naming the
    variable."""
    code = "import sys; from megatron_pmlm.models import hidden_dropout; sys.stdout.write(str(hidden_dropout.KERNEL_ENABLED))"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), hidden_dropout.DROPOUT_ENV: "torch"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            cwd=REPO_ROOT)
    assert result.returncode == 0 and result.stdout == "False", (result.stdout, result.stderr[-2000:])
    pmlm_testing.check_kernel_switch(monkeypatch, hidden_dropout, hidden_dropout.DROPOUT_ENV,
                                     {"bits": True, "torch": False}, "fast")


def test_the_path_is_taken_only_in_compiled_training_on_a_gpu(monkeypatch):
    """Traced by torch.compile, 0 < p < 1, floating point, on a GPU (here: the interpreter); never
    eagerly (nn.Dropout's one kernel), on the CPU otherwise, nor for p = 0 or 1."""
    hidden = torch.randn(2, 3, 8)
    monkeypatch.setattr(hidden_dropout, "KERNEL_ENABLED", True)
    monkeypatch.setattr(hidden_dropout, "INTERPRETED", True)
    assert not hidden_dropout.applies(hidden, 0.1)  # eager
    monkeypatch.setattr(hidden_dropout, "COMPILED_ONLY", False)  # as if traced
    assert hidden_dropout.applies(hidden, 0.1)
    assert not hidden_dropout.applies(hidden, 0.0) and not hidden_dropout.applies(hidden, 1.0)
    assert not hidden_dropout.applies(hidden.long(), 0.1)
    monkeypatch.setattr(hidden_dropout, "INTERPRETED", False)
    assert not hidden_dropout.applies(hidden, 0.1)  # the CPU without the interpreter


COMPILED_FOR_GPUS = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_pmlm.models.hidden_dropout import BYTES, ROWS
from megatron_pmlm.models.hidden_dropout_triton import dropout_keep_bits_kernel

report = []
signature = {"seed_ptr": "*i64", "bits_ptr": "*u8", "rows": "i32", "columns": "i32", "byte_columns": "i32",
             "threshold": "i32", "ROWS": "constexpr", "BYTES": "constexpr"}
for capability in (80, 90):
    compiled = triton.compile(ASTSource(fn=dropout_keep_bits_kernel, signature=signature,
                                        constexprs={"ROWS": ROWS, "BYTES": BYTES}),
                              target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
    report.append({"capability": capability, "cubin": len(compiled.asm.get("cubin", b"")),
                   "shared": compiled.metadata.shared})
json.dump(report, sys.stdout)
"""


def test_the_dropout_bits_kernel_compiles_for_the_gpus_it_is_meant_for():
    """Triton's own compiler, without a GPU, down to SM 8.0 and 9.0 machine code (what the interpreter
    cannot catch: types and globals the GPU code generator refuses)."""
    report = compiled_for_gpus(COMPILED_FOR_GPUS)
    assert len(report) == 2 and all(row["cubin"] > 0 for row in report), report
