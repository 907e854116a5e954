"""The table gradient's Triton kernel (`models/bucket_sums.py`) against the one-hot GEMMs.

On the CPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1`, which must be set before
the kernel is defined: each check is a fresh process), the same program a GPU compiles; the GPU
itself is checked in tests/test_gpu.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from megatron_pmlm.models import bucket_sums
from pmlm_testing import REPO_ROOT, kernel_code, run_interpreted

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="Triton is not installed (pyproject's test extra installs it on x86_64 Linux)")

INTERPRETED = r"""
import json, sys
import torch
from megatron_pmlm.models.relative_bias import table_gradient

results = []
generator = torch.Generator().manual_seed(0)
# (batch, heads, queries, keys, padded keys, bins): ragged tiles, heads and bins not powers of two,
# more heads and bins than the smallest block, an aligned view of a padded buffer (16-byte vectors
# of keys), rows of an odd width (no vectors), a view starting one element in (no vectors).
for batch, heads, queries, keys, padded, bins in [(3, 12, 13, 71, 72, 32), (2, 5, 4, 64, 64, 20),
                                                  (1, 17, 9, 130, 136, 40), (0, 12, 8, 8, 8, 32),
                                                  (2, 3, 5, 69, 71, 32), (2, 12, 6, 128, 129, 32)]:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        buckets = torch.randint(0, bins, (batch, queries, keys), dtype=torch.uint8, generator=generator)
        grad = torch.randn(batch, heads, queries, padded, generator=generator).to(dtype)
        grad = grad[..., 1:keys + 1] if padded == keys + 1 else grad[..., :keys]
        exact = table_gradient(grad.double(), buckets, bins, torch.float64)
        ours = torch.ops.megatron_pmlm.bucket_sums(grad, buckets, bins)
        scale = float(exact.abs().max()) if exact.numel() and exact.abs().max() > 0 else 1.0
        results.append({"shape": [batch, heads, queries, keys, padded, bins], "dtype": str(dtype),
                        "out_dtype": str(ours.dtype), "out_shape": list(ours.shape),
                        "error": float((ours.double() - exact).abs().max()) / scale if exact.numel() else 0.0})
# The fake (meta) kernel, the schema and compiled callers: torch.library's own checks.
grad = torch.randn(2, 3, 5, 8)
buckets = torch.randint(0, 32, (2, 5, 8), dtype=torch.uint8)
torch.library.opcheck(torch.ops.megatron_pmlm.bucket_sums.default, (grad, buckets, 32),
                      test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
compiled = torch.compile(lambda g, b: torch.ops.megatron_pmlm.bucket_sums(g, b, 32) * 2, backend="aot_eager",
                         fullgraph=True)
compiled_error = float((compiled(grad, buckets) - 2 * table_gradient(grad, buckets, 32, torch.float32)).abs().max())
json.dump({"results": results, "compiled_error": compiled_error}, sys.stdout)
"""


LISTED = r"""
import json, sys
import torch
from megatron_pmlm.models.bucket_attention import BLOCKED, KernelShape, _listed, _nonempty_tiles

generator = torch.Generator().manual_seed(0)
results = []
# (batch, heads, queries, keys, bins, tile queries, tile keys): the forward's tiles (64 x 64, 32 x 128,
# 128 x 64), ragged ends in both dimensions
for batch, heads, queries, keys, bins, tile_queries, tile_keys in [(2, 12, 70, 130, 32, 64, 64),
                                                                    (2, 5, 45, 200, 20, 32, 128),
                                                                    (2, 3, 150, 100, 32, 128, 64)]:
    for dtype in (torch.float32, torch.bfloat16):
        buckets = torch.randint(0, bins, (batch, queries, keys), dtype=torch.uint8, generator=generator)
        # whole tiles blocked, and blocked pairs inside the others (blocks of 16 x 16)
        tiles_allowed = torch.rand(batch, -(-queries // tile_queries), -(-keys // tile_keys), generator=generator) < 0.6
        allowed = (tiles_allowed.repeat_interleave(tile_queries, 1).repeat_interleave(tile_keys, 2)[:, :queries, :keys]
                   & (torch.rand(batch, -(-queries // 16), -(-keys // 16), generator=generator) < 0.7)
                   .repeat_interleave(16, 1).repeat_interleave(16, 2)[:, :queries, :keys])
        codes = buckets.masked_fill(~allowed, BLOCKED)
        nonempty = _nonempty_tiles(codes, KernelShape(tile_queries, tile_keys))
        key_tiles = _listed(nonempty)
        grad = torch.randn(batch, heads, queries, keys, generator=generator).to(dtype).masked_fill(~allowed[:, None], 0)
        every_tile = torch.ops.megatron_pmlm.bucket_sums(grad, codes, bins)
        # NaN in the tiles not listed: a kernel that read them would return NaN
        skipped = (~nonempty).repeat_interleave(tile_queries, 1).repeat_interleave(tile_keys, 2)[:, :queries, :keys]
        poisoned = grad.masked_fill(skipped[:, None], float("nan"))
        listed = torch.ops.megatron_pmlm.bucket_sums(poisoned, codes, bins, key_tiles, tile_queries, tile_keys)
        results.append({"case": [batch, heads, queries, keys, tile_queries, tile_keys, str(dtype)],
                        "skipped": float((~nonempty).float().mean()), "same_bits": bool(torch.equal(listed, every_tile)),
                        "nonzero": bool(every_tile.abs().sum() > 0)})
errors = []
grad, codes = torch.randn(2, 3, 70, 130), torch.randint(0, 32, (2, 70, 130), dtype=torch.uint8)
for tiles, tile_queries, tile_keys in [(torch.zeros(2, 2, 3, dtype=torch.int32), 64, 64),
                                       (torch.zeros(2, 2, 4, dtype=torch.int64), 64, 64),
                                       (torch.zeros(2, 2, 4, dtype=torch.int32), 62, 64)]:
    try:
        torch.ops.megatron_pmlm.bucket_sums(grad, codes, 32, tiles, tile_queries, tile_keys)
        errors.append(None)
    except ValueError as error:
        errors.append(str(error))
json.dump({"results": results, "errors": errors}, sys.stdout)
"""

PER_LAYER = r"""
import copy, json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from megatron_pmlm.config import model_config_from_preset
from megatron_pmlm.models import bucket_sums
from megatron_pmlm.models.compiled import compile_step_regions
from megatron_pmlm.models.model import PMLMForPreTraining
from megatron_pmlm.models.relative_bias import bias_bytes_per_step
from tools.bench_train import make_examples, pmlm_batch


class KernelCalls(TorchDispatchMode):
    count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        KernelCalls.count += func is torch.ops.megatron_pmlm.bucket_sums.default
        return func(*args, **(kwargs or {}))


def step(model, batch):
    model.zero_grad(set_to_none=True)
    loss = model.forward_batch(batch).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def run(model, batch, per_layer):
    bucket_sums.INTERPRETED = bucket_sums.KERNEL_ENABLED = per_layer
    chosen = model.bert.table_gradient_per_layer(batch.input_ids.device, torch.float32)
    KernelCalls.count = 0
    with KernelCalls():
        result = step(model, batch)
    return chosen, KernelCalls.count, result


def difference(grads, expected):
    # Largest relative difference over the parameters; a key bias's gradient is 0 up to rounding
    # (softmax ignores it: ~1e-11 here), hence the absolute floor.
    return max(float((grads[name] - expected[name]).norm() / (expected[name].norm() + 1e-6)) for name in expected)


report = {}
config = model_config_from_preset("tiny", hidden_dropout=0.0, attention_dropout=0.0, num_layers=3)
batch = pmlm_batch(make_examples(3, 24, config.vocab_size, seed=3))
for checkpointing in (False, True):
    model = PMLMForPreTraining(config, init_seed=2).train()
    model.bert.encoder.checkpoint_activations = checkpointing
    torch.nn.init.normal_(model.bert.rel_pos_bias.weight, std=0.5)
    twin = copy.deepcopy(model)
    chosen, calls, (loss, grads) = run(model, batch, True)
    shared_chosen, shared_calls, (shared_loss, shared_grads) = run(twin, batch, False)
    worst = difference(grads, shared_grads)
    report[str(checkpointing)] = {"chosen": chosen, "calls": calls, "shared_chosen": shared_chosen,
                                  "shared_calls": shared_calls, "loss_difference": float((loss - shared_loss).abs()),
                                  "same_parameters": sorted(grads) == sorted(shared_grads), "worst": worst,
                                  "table_grad_norm": float(grads["bert.rel_pos_bias.weight"].norm())}
bucket_sums.INTERPRETED = bucket_sums.KERNEL_ENABLED = True
per_layer_bytes = bias_bytes_per_step(model, batch)
with torch.no_grad():  # evaluation: the shared bias, nothing to reduce
    report["no_grad_chosen"] = model.bert.table_gradient_per_layer(torch.device("cpu"), torch.float32)
bucket_sums.INTERPRETED = bucket_sums.KERNEL_ENABLED = False
shared_bytes = bias_bytes_per_step(model, batch)
report["bias_bytes"] = {"per_layer": per_layer_bytes, "shared": shared_bytes,
                        "bias": 3 * config.num_attention_heads * batch.input_ids.shape[1] ** 2 * 4}
bucket_sums.INTERPRETED = bucket_sums.KERNEL_ENABLED = True
# --compile: the embed region builds (bias, buckets), the eager encoder loop hands each compiled
# layer the bias through LayerBiasUse.
model.bert.encoder.checkpoint_activations = False
compiled = copy.deepcopy(model)
compile_step_regions(compiled)
for each in (model, compiled):
    each.bert.layout_quantum = 16
_, eager_grads = step(model, batch)
KernelCalls.count = 0
with KernelCalls():
    _, compiled_grads = step(compiled, batch)
report["compiled"] = {"calls": KernelCalls.count, "worst": difference(compiled_grads, eager_grads)}
json.dump(report, sys.stdout)
"""


FAILING = r"""
import json, sys, warnings
import torch
from megatron_pmlm.models import bucket_sums, bucket_sums_triton
from megatron_pmlm.models.bucket_sums import one_hot_bucket_sums


class NoCompiler:
    def __getitem__(self, grid):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")


bucket_sums_triton.bucket_sums_kernel = NoCompiler()
grad = torch.randn(2, 3, 5, 8)
buckets = torch.randint(0, 32, (2, 5, 8), dtype=torch.uint8)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    first = torch.ops.megatron_pmlm.bucket_sums(grad, buckets, 32)
    second = torch.ops.megatron_pmlm.bucket_sums(grad, buckets, 32)
expected = one_hot_bucket_sums(grad, buckets, 32, torch.float32)
json.dump({"warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
           "equal": bool(torch.equal(first, expected) and torch.equal(second, expected)),
           "enabled_after": bucket_sums.KERNEL_ENABLED or bucket_sums.INTERPRETED,
           "runs_on_after": bucket_sums.runs_on(torch.device("cpu"), torch.float32)}, sys.stdout)
"""


def test_the_kernel_sums_each_bucket_as_the_one_hot_gemms_do():
    """fp32 sums of fp32, bf16 and fp16 gradients (half precision enters the tensor cores in its own
    dtype against a one-hot in the same: exact products): within fp32 rounding of a float64 sum, for
    every layout, with and without vector loads."""
    report = run_interpreted(INTERPRETED)
    assert len(report["results"]) == 18
    for result in report["results"]:
        batch, heads, _, _, _, bins = result["shape"]
        assert result["out_dtype"] == "torch.float32" and result["out_shape"] == [heads, bins], result
        assert result["error"] <= 1e-6, result
    assert report["compiled_error"] <= 1e-5


def test_the_kernel_reads_only_the_listed_tiles_and_sums_the_same_bits():
    """Given the triton backend's tile lists, the kernel skips the key blocks a block of queries does
    not list (NaN put there never reaches the sums) and returns bitwise what it returns reading every
    tile (the skipped pairs are BLOCKED: no bin), for the forward's tile shapes and ragged ends; lists
    of the wrong shape or dtype, or tiles that are not whole row and key blocks, are refused."""
    report = run_interpreted(LISTED)
    assert len(report["results"]) == 6
    for result in report["results"]:
        assert result["skipped"] > 0 and result["same_bits"] and result["nonzero"], result
    wrong_shape, wrong_dtype, wrong_tile = report["errors"]
    assert wrong_shape and "key_tiles torch.int32 (2, 2, 3) is not int32 (2, 2, 4)" in wrong_shape
    assert wrong_dtype and "key_tiles torch.int64" in wrong_dtype
    assert wrong_tile and "tiles of 62 x 64" in wrong_tile


def test_the_environment_turns_the_kernel_off(monkeypatch):
    """PMLM_TABLE_GRADIENT=gemm keeps the GEMMs on a GPU too (read once, at import: a fresh process
    here; `kernel`, the default, is checked with the function the import calls)."""
    code = ("from megatron_pmlm.models import bucket_sums; import sys; "
            "sys.stdout.write(str(bucket_sums.KERNEL_ENABLED))")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), bucket_sums.TABLE_GRADIENT_ENV: "gemm"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout == "False", result.stderr[-2000:]
    for setting, expected in (("gemm", False), ("kernel", True)):
        monkeypatch.setenv(bucket_sums.TABLE_GRADIENT_ENV, setting)
        assert bucket_sums.kernel_enabled() is expected, setting


def test_each_layer_reducing_its_own_bias_gradient_trains_as_the_shared_bias_does():
    """With the kernel (here in the interpreter, as on a GPU) each of the 3 layers reduces its own
    bias gradient into the table (3 kernel calls, the layers' tables summed in fp32): loss and every
    parameter's gradient as with the shared bias and the GEMMs (no kernel call), with and without
    activation checkpointing, and compiled (`--compile`'s regions) as eager; and the bias-sized
    writes of the layers' gradient sums are gone."""
    report = run_interpreted(PER_LAYER)
    for checkpointing in ("False", "True"):
        result = report[checkpointing]
        assert result["chosen"] and result["calls"] == 3, result
        assert not result["shared_chosen"] and result["shared_calls"] == 0, result
        assert result["same_parameters"] and result["loss_difference"] <= 1e-6, result
        assert result["worst"] <= 1e-5 and result["table_grad_norm"] > 0, result
    assert report["no_grad_chosen"] is False
    assert report["compiled"]["calls"] == 3 and report["compiled"]["worst"] <= 1e-5, report["compiled"]
    per_layer, shared, bias = (report["bias_bytes"][key] for key in ("per_layer", "shared", "bias"))
    # Gone: the engine's 2 sums of the 3 layers' bias gradients and the GEMMs' contiguous copy of
    # their sum (the CPU's math SDPA adds the mask to its scores in both: 3 adds each).
    assert shared["ops"]["add.Tensor"] - per_layer["ops"]["add.Tensor"] == 2, report["bias_bytes"]
    assert shared["ops"]["clone.default"] == 1 and "clone.default" not in per_layer["ops"], report["bias_bytes"]
    assert shared["bias_bytes"] - per_layer["bias_bytes"] == 3 * bias, report["bias_bytes"]


def test_a_kernel_that_cannot_compile_falls_back_to_the_gemms_with_one_warning():
    """Triton failing on a machine (no C compiler, a driver it does not know) must not stop a run:
    the first failure warns once, naming the switch, and the GEMMs (and the shared bias) take over."""
    report = run_interpreted(FAILING)
    assert report["equal"] and not report["enabled_after"] and not report["runs_on_after"], report
    (warning,) = report["warnings"]
    assert "Triton kernel failed here (RuntimeError: Failed to find C compiler" in warning
    assert "PMLM_TABLE_GRADIENT=gemm" in warning


def test_the_kernel_compiles_for_the_gpus_and_its_loop_issues_few_instructions_per_byte():
    """Compiled for SM 8.0 and 9.0 by Triton's own compiler (what the interpreter cannot catch: types
    the GPU code generator refuses), for bf16, fp16 and fp32 gradients: no spills (but fp32's 24
    stack bytes on SM 9.0), the tensor cores
    in the loop for half precision. The loop's instructions per KB of bf16 gradient on SM 9.0 (the
    CPU proxy of a kernel bound by what it issues, docs/benchmarks.md "bucket_sums"): 273 for this
    form at seq 512's width, 728 for the former one (an fp32 one-hot, the gradient cast to fp32); the
    bound leaves room for other Triton versions' code, not for the former form."""
    for capability in (80, 90):
        for dtype in ("bf16", "fp16", "fp32"):
            report = kernel_code("--kernels", "bucket_sums", "--capability", str(capability), "--dtype", dtype)
            (row,) = report["kernels"]
            # fp32 on SM 9.0: ptxas keeps 24 bytes on the stack (3 stores a tile), which the tool counts as
            # spills since it reads the stack too; half precision, the training dtypes, spill nothing
            spill_bound = 32 if (capability, dtype) == (90, "fp32") else 0
            assert row["registers"] > 0 and row["spilled_bytes"] <= spill_bound and row["loop_instructions"] > 0, row
            if dtype != "fp32":
                assert "HMMA" in dict(row["loop_mix"]), row
            if capability == 90 and dtype == "bf16":
                assert row["warp_instructions_per_kb"] <= 450, row
    # every kernel the tool knows compiles and shows a loop
    report = kernel_code("--width", "176")
    assert {row["kernel"] for row in report["kernels"]} == {"bucket_sums", "attention forward", "attention dropout bits",
                                                             "attention dK dV dS", "attention dQ", "attention dQ from dS"}
    assert all(row["loop_instructions"] > 0 and row["registers"] > 0 for row in report["kernels"]), report
