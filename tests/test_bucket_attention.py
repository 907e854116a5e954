"""The triton attention backend (`models/bucket_attention.py`): flash attention reading the relative
bias per tile, dropout drawn in the kernel.

On the CPU the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set before they are
defined: each check is a fresh process), the same programs a GPU compiles, against a float64
reference with a dense bias; tests/test_gpu.py checks them on CUDA.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from megatron_pmlm.config import ConfigError, model_config_from_preset
from megatron_pmlm.models import bucket_attention, launch_tuning
from megatron_pmlm.models.model import check_attention_backend
from pmlm_testing import REPO_ROOT, compiled_for_gpus, kernel_code, run_interpreted, run_module, run_tool, torchrun

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="Triton is not installed (pyproject's test extra installs it on x86_64 Linux)")

KERNELS = r"""
import json, sys
import torch
from megatron_pmlm.models import bucket_attention as ba

def errors(ours, exact):
    return [float((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-12)) for a, b in zip(ours, exact)]

def case(batch, heads, queries, keys, head_dim, bins, dtype, dropout, with_table, generator, blocked_tiles=False):
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=generator).to(dtype).requires_grad_()
               for length in (queries, keys, keys))
    allowed = torch.rand(batch, queries, keys, generator=generator) > 0.3
    allowed[0, queries // 2] = False  # a row that sees no key
    if blocked_tiles:  # whole tiles nobody sees, as PMLM's layout and padding make them
        allowed[:, :64, 64:128] = False  # context queries, pseudo tokens' keys
        allowed[:, 128:] = False  # a block of padded queries
        allowed[1, :, 128:] = False  # a block of keys nobody sees
    codes = ba.attention_codes(torch.randint(0, bins, (batch, queries, keys), dtype=torch.uint8,
                                             generator=generator), allowed)
    table = (torch.randn(heads, bins, generator=generator) * 2).requires_grad_() if with_table else None
    inputs = ba.kernel_inputs(codes, table, dtype)  # the dense bias, in the inputs' dtype, under ba.dense_bias
    tiles = inputs.tiles
    out, lse, seed, keep_bits = ba.bucket_attention_forward(q, k, v, inputs.padded_codes, *tiles, table,
                                                            inputs.kernel_table, dropout, head_dim ** -0.5)
    keep = ba.dropout_keep_mask(seed, batch, heads, queries, keys, dropout) if dropout else None
    grad = torch.randn(out.shape, generator=generator).to(dtype)
    inputs = [q, k, v] + ([table] if with_table else [])
    ours = [out] + list(torch.autograd.grad(out, inputs, grad))
    exact_inputs = [x.detach().double().requires_grad_() for x in inputs]
    exact_table = exact_inputs[3] if with_table else None
    reference = ba.reference_attention(*exact_inputs[:3], codes, exact_table, keep=keep, dropout_p=dropout)
    exact = [reference] + list(torch.autograd.grad(reference, exact_inputs, grad.double()))
    result = {"shape": [batch, heads, queries, keys, head_dim, bins], "dtype": str(dtype), "dropout": dropout,
              "table": with_table, "errors": errors(ours, exact),
              "empty_row": float(out[0, :, queries // 2].abs().max()),
              "finite": all(bool(torch.isfinite(t).all()) for t in ours),
              "out_strides": list(out.stride()),
              "skipped_tiles": int((tiles.key_tiles[..., 1:].shape[-1] - tiles.key_tiles[..., 0]).sum())}
    if dtype != torch.float32 and not dropout:
        # What PyTorch's own attention loses in this dtype, same inputs, same reference.
        bias = (table.detach()[:, codes.long().clamp(max=bins - 1)].permute(1, 0, 2, 3) if with_table
                else torch.zeros(batch, 1, queries, keys))
        bias = bias.masked_fill(~allowed[:, None], float("-inf")).to(dtype)
        sdpa_inputs = [x.detach().requires_grad_() for x in (q, k, v)]
        sdpa = torch.nn.functional.scaled_dot_product_attention(*sdpa_inputs, attn_mask=bias).nan_to_num(0.0)
        result["sdpa_errors"] = errors([sdpa] + list(torch.autograd.grad(sdpa, sdpa_inputs, grad)), exact[:4])
    if dropout:
        # the forward's bits (what the backward reads) are the draws, wherever a pair is computed
        computed = (codes != ba.BLOCKED)[:, None].expand_as(keep)
        result["stored_bits_are_the_draws"] = bool(torch.equal(ba.stored_keep_mask(keep_bits, queries, keys)[computed],
                                                               keep[computed]))
        result["kept"] = float(keep.float().mean())
        result["kept_fraction"] = 1 - ba.dropout_threshold(dropout)[0] / ba.DROPOUT_RESOLUTION
    return result

generator = torch.Generator().manual_seed(0)
results = []
# (batch, heads, queries, keys, head_dim, bins): ragged tiles, queries != keys, 3 and 12 heads,
# several key blocks, head sizes 16 and 64.
for shape in [(2, 3, 40, 37, 16, 8), (1, 2, 70, 130, 32, 32), (2, 12, 17, 17, 64, 32)]:
    for dtype in (torch.float32, torch.bfloat16):
        results.append(case(*shape, dtype, 0.0, True, generator))
    results.append(case(*shape, torch.float32, 0.1, True, generator))
results.append(case(2, 3, 40, 37, 16, 8, torch.float32, 0.0, False, generator))
results.append(case(2, 3, 40, 37, 16, 8, torch.bfloat16, 0.25, False, generator))
# Tiles with no pair to compute are skipped: the same results.
for dtype, dropout in ((torch.float32, 0.0), (torch.float32, 0.1), (torch.bfloat16, 0.0)):
    results.append(case(2, 2, 150, 140, 16, 8, dtype, dropout, True, generator, blocked_tiles=True))
# Other tiles and launch options (what the attention tool times): the same attention, the same dropout.
with ba.kernel_shapes(ba.KernelShape(32, 64, 2, 2), ba.KernelShape(128, 128, 8, 1)):
    results.append(case(2, 2, 150, 140, 16, 8, torch.float32, 0.1, True, generator, blocked_tiles=True))
with ba.kernel_shapes(ba.KernelShape(64, 128, 4, 2), ba.KernelShape(64, 128, 4, 2)):  # 2 dropout blocks a tile
    results.append(case(2, 2, 150, 140, 16, 8, torch.float32, 0.1, True, generator, blocked_tiles=True))
# The key/value pass's tiles as [queries, keys] (SM 8.x's orientation; the interpreter, as SM 9.0,
# computes them transposed): the same attention, the same dropout.
with ba.key_value_tiles(False):
    for dtype, dropout in ((torch.float32, 0.1), (torch.bfloat16, 0.0)):
        results.append(case(2, 2, 150, 140, 16, 8, dtype, dropout, True, generator, blocked_tiles=True))
# The bias read from its dense form (ba.DENSE_BIAS), both orientations of the key/value tiles.
with ba.dense_bias(True):
    for dtype, dropout in ((torch.float32, 0.1), (torch.bfloat16, 0.0)):
        results.append(case(2, 2, 150, 140, 16, 8, dtype, dropout, True, generator, blocked_tiles=True))
    with ba.key_value_tiles(False):
        results.append(case(2, 2, 150, 140, 16, 8, torch.float32, 0.1, True, generator, blocked_tiles=True))
# Two calls draw two seeds; the same seed draws the same mask.
q = torch.randn(1, 2, 64, 16)
codes = torch.zeros(1, 64, 64, dtype=torch.uint8)
inputs = ba.kernel_inputs(codes, None)
seeds = [ba.bucket_attention_forward(q, q, q, inputs.padded_codes, *inputs.tiles, None, inputs.kernel_table, 0.1,
                                     0.25)[2] for _ in range(2)]
masks = [ba.dropout_keep_mask(seed, 1, 2, 64, 64, 0.1) for seed in (seeds[0], seeds[0], seeds[1])]
report = {"results": results, "seeds_differ": bool(seeds[0] != seeds[1]),
          "same_seed_same_mask": bool(torch.equal(masks[0], masks[1])),
          "other_seed_other_mask": not bool(torch.equal(masks[0], masks[2]))}
# The kernels compute the listed tiles and no others: a list that leaves out a tile with work in it
# changes exactly the outputs (forward) or key gradients (backward) of that tile.
q, k, v = (torch.randn(2, 2, 130, 16, generator=generator).requires_grad_() for _ in range(3))
codes = torch.randint(0, 8, (2, 130, 130), dtype=torch.uint8, generator=generator)
table = torch.randn(2, 8, generator=generator)
inputs = ba.kernel_inputs(codes, table)
tiles = inputs.tiles
out = ba.bucket_attention(q, k, v, inputs)
dk = torch.autograd.grad(out.sum(), k)[0]
fewer = ba.TileLists(tiles.key_tiles.clone(), tiles.query_tiles.clone())
fewer.key_tiles[0, 1, 0] -= 1  # sequence 0, queries 64-127: key block 2 (keys 128-129) left out
fewer.query_tiles[1, 0, 0] -= 1  # sequence 1, keys 0-63: query block 2 (queries 128-129) left out
changed_out = ba.bucket_attention(q, k, v, inputs._replace(tiles=fewer))
changed_dk = torch.autograd.grad(changed_out.sum(), k)[0]
out_moved = (changed_out - out).abs().amax(dim=(1, 3)) > 0  # [B, queries]
dk_moved = (changed_dk - dk).abs().amax(dim=(1, 3)) > 0  # [B, keys]
report["listed_tiles_only"] = {
    "out_rows": [int(i) for i in out_moved.nonzero()[:, 0] * 1000 + out_moved.nonzero()[:, 1]],  # 1000 x sequence + row
    "out_rows_expected": [64 + i for i in range(64)],
    "dk_moved_in_sequence_1_past_key_63": bool(dk_moved[1, 64:].any()),
    "dk_rows_sequence_1": int(dk_moved[1].sum())}
# Schema, fake tensors and AOT autograd: torch.library's own checks (no dropout: deterministic).
k = torch.randn(2, 3, 20, 16)
table = torch.randn(3, 8, requires_grad=True)
codes = ba.attention_codes(torch.randint(0, 8, (2, 20, 20), dtype=torch.uint8), torch.rand(2, 20, 20) > 0.2)
torch.library.opcheck(torch.ops.megatron_pmlm.bucket_attention.default,
                      (k.clone().requires_grad_(), k.clone().requires_grad_(), k.clone().requires_grad_(),
                       ba.padded_codes(codes), *ba.tile_lists(codes), table, ba.kernel_table(table, k.device), 0.0,
                       0.25),
                      test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
# The packed op (q, k, v side by side in a fused projection's output, their gradient one tensor):
# the same attention and gradients as the op taking them apart, the same dropout for the same seed.
qkv = torch.randn(2, 20, 3 * 3 * 16, generator=generator)
inputs = ba.kernel_inputs(codes, table)
packed_report = {}
for dropout in (0.0, 0.1):
    leaf = qkv.clone().requires_grad_()
    apart = [t.detach().clone().requires_grad_() for t in ba.unpacked(qkv, 3)]
    grad = torch.randn(2, 3, 20, 16, generator=generator)
    torch.manual_seed(3)
    out = ba.bucket_attention_packed(leaf, 3, inputs, dropout)
    got = [out, *torch.autograd.grad(out, (leaf, table), grad)]
    torch.manual_seed(3)
    ref = ba.bucket_attention(*apart, inputs, dropout)
    want = [ref, *torch.autograd.grad(ref, (*apart, table), grad)]
    want = [want[0], torch.stack([g.transpose(1, 2) for g in want[1:4]], 2).reshape(qkv.shape), want[4]]
    packed_report[str(dropout)] = [float((a - b).abs().max()) for a, b in zip(got, want)]
report["packed"] = packed_report
# dQ by the GEMM over dS (the default where dS is written) against dQ's own kernel: the same dQ up to
# the order of the fp32 sums, in fp32 and bf16, with dropout (the same seed) and without.
dq_report = {}
for dtype in (torch.float32, torch.bfloat16):
    for dropout in (0.0, 0.1):
        leaves = [t.detach().to(dtype).requires_grad_() for t in ba.unpacked(qkv, 3)]
        grad = torch.randn(2, 3, 20, 16, generator=generator).to(dtype)
        found = []
        for by_gemm in (True, False):
            with ba.dq_from_scores(by_gemm):
                torch.manual_seed(5)
                out = ba.bucket_attention(*leaves, inputs, dropout)
                found.append(torch.autograd.grad(out, (leaves[0], table), grad))
        (dq_gemm, table_gemm), (dq_kernel, table_kernel) = found
        dq_report[f"{dtype}-{dropout}"] = [float((dq_gemm.double() - dq_kernel.double()).abs().max()
                                                 / dq_kernel.double().abs().max()),
                                           float((table_gemm - table_kernel).abs().max())]
report["dq_from_scores"] = dq_report
report["dq_default"] = ba.DQ_FROM_SCORES
report["packed_grad_shape"] = list(got[1].shape)
for projection_bias in (None, torch.randn(qkv.shape[-1], requires_grad=True)):  # its gradient from the kernels' sums
    torch.library.opcheck(torch.ops.megatron_pmlm.bucket_attention_packed.default,
                          (qkv.clone().requires_grad_(), 3, ba.padded_codes(codes), *ba.tile_lists(codes), table,
                           ba.kernel_table(table, k.device), 0.0, 0.25, projection_bias),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
json.dump(report, sys.stdout)
"""

BF16_ROUNDING = 4 * 2.0 ** -8
"""Four roundings of bf16 (8 bits of mantissa): the floor of the bf16 comparisons with float64."""


MODEL = r"""
import copy, dataclasses, json, sys
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from megatron_pmlm.config import model_config_from_preset
from megatron_pmlm.models import bucket_sums
from megatron_pmlm.models.compiled import compile_step_regions
from megatron_pmlm.models.model import PMLMForPreTraining
from tools.bench_train import make_examples, pmlm_batch

bucket_sums.INTERPRETED = bucket_sums.KERNEL_ENABLED = False  # the sdpa twin as on the CPU: shared bias, GEMMs


class KernelCalls(TorchDispatchMode):
    count = packed = bias_sums = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        KernelCalls.count += func in (torch.ops.megatron_pmlm.bucket_attention.default,
                                      torch.ops.megatron_pmlm.bucket_attention_backward.default,
                                      torch.ops.megatron_pmlm.bucket_attention_packed.default,
                                      torch.ops.megatron_pmlm.bucket_attention_packed_backward.default)
        if func is torch.ops.megatron_pmlm.bucket_attention_packed_backward.default:
            KernelCalls.packed += 1
            KernelCalls.bias_sums += bool(args[14])  # the Q, K, V bias gradient from the kernels' sums
        return func(*args, **(kwargs or {}))


def step(model, batch, seed=0):
    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    loss = model.forward_batch(batch).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def difference(grads, expected):
    # Largest relative difference over the parameters (a key bias's gradient is 0 up to rounding).
    return max(float((grads[n] - expected[n]).norm() / (expected[n].norm() + 1e-6)) for n in expected)


def twins(config, checkpointing):
    sdpa = PMLMForPreTraining(config, init_seed=2).train()
    with torch.no_grad():
        sdpa.bert.rel_pos_bias.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(4))
    ours = PMLMForPreTraining(dataclasses.replace(config, attention_backend="triton"), init_seed=2).train()
    ours.load_state_dict(sdpa.state_dict())
    for model in (sdpa, ours):
        model.bert.encoder.checkpoint_activations = checkpointing
    return sdpa, ours


config = model_config_from_preset("tiny", hidden_dropout=0.0, attention_dropout=0.0, num_layers=3)
batch = pmlm_batch(make_examples(3, 24, config.vocab_size, seed=3))
report = {}
for checkpointing in (False, True):
    sdpa, ours = twins(config, checkpointing)
    KernelCalls.count = KernelCalls.packed = KernelCalls.bias_sums = 0
    with KernelCalls():
        loss, grads = step(ours, batch)
    calls, packed, bias_sums = KernelCalls.count, KernelCalls.packed, KernelCalls.bias_sums
    ref_loss, ref_grads = step(sdpa, batch)
    report[str(checkpointing)] = {"calls": calls, "packed_backwards": packed, "bias_sums": bias_sums,
                                  "loss": float((loss - ref_loss).abs()),
                                  "worst": difference(grads, ref_grads), "same": sorted(grads) == sorted(ref_grads),
                                  "table_grad_norm": float(grads["bert.rel_pos_bias.weight"].norm())}
# The bias read from its dense form (bucket_attention.DENSE_BIAS, built in the layers' dtype): the same.
from megatron_pmlm.models import bucket_attention
with bucket_attention.dense_bias(True):
    sdpa, ours = twins(config, False)
    loss, grads = step(ours, batch)
    inputs = ours.bert.embed(batch.input_ids, batch.position_ids, batch.token_type_ids, batch.roles, batch.steps)[1]
ref_loss, ref_grads = step(sdpa, batch)
report["dense"] = {"loss": float((loss - ref_loss).abs()), "worst": difference(grads, ref_grads),
                   "kernel_bias": list(inputs.kernel_table.shape)}
# Attention dropout drawn in the kernel: recomputing a checkpointed layer redraws the same mask.
dropout = dataclasses.replace(config, attention_dropout=0.1)
_, plain = twins(dropout, False)
_, checkpointed = twins(dropout, True)
plain_loss, plain_grads = step(plain, batch, seed=5)
checkpointed_loss, checkpointed_grads = step(checkpointed, batch, seed=5)
other_loss, other_grads = step(plain, batch, seed=6)
report["dropout"] = {"checkpointed": difference(checkpointed_grads, plain_grads),
                     "loss": float((plain_loss - checkpointed_loss).abs()),
                     "other_seed_changes_loss": float((plain_loss - other_loss).abs()),
                     # the gradients, not the loss alone: two masks can leave a tiny model's loss
                     # within 2e-5 of each other (1 pair of seeds in 28 here)
                     "other_seed_changes_grads": difference(other_grads, plain_grads)}
# --compile: the custom op is opaque to inductor; compiled = eager.
_, ours = twins(config, False)
compiled = copy.deepcopy(ours)
compile_step_regions(compiled)
for model in (ours, compiled):
    model.bert.layout_quantum = 16
_, eager_grads = step(ours, batch)
KernelCalls.count = 0
with KernelCalls():
    _, compiled_grads = step(compiled, batch)
report["compiled"] = {"calls": KernelCalls.count, "worst": difference(compiled_grads, eager_grads)}
# The bias bytes proxy (bench_train's bias_bytes_per_step): no bias built, each layer's dS buffer.
from megatron_pmlm.models.bucket_attention import score_grad_buffer
from megatron_pmlm.models.relative_bias import bias_bytes_per_step
_, fresh = twins(config, False)
width = batch.input_ids.shape[1]
one_layer = score_grad_buffer(batch.input_ids.shape[0], config.num_attention_heads, width, width, torch.float32,
                              torch.device("meta")).untyped_storage().nbytes()
report["bias_bytes"] = [bias_bytes_per_step(fresh, batch, width=width)["bias_bytes"], config.num_layers * one_layer]
# One graph each, no break: a layer (the custom op is one node) and the embedding region that builds
# the codes, the table's copy and the tile lists.
layer = ours.bert.encoder.layer[0]
inputs = ours.bert.embed(batch.input_ids, batch.position_ids, batch.token_type_ids, batch.roles, batch.steps)
explained = {"layer": torch._dynamo.explain(layer)(inputs[0], inputs[1]),
             "embed": torch._dynamo.explain(ours.bert.embed)(batch.input_ids, batch.position_ids,
                                                             batch.token_type_ids, batch.roles, batch.steps)}
report["graphs"] = {name: [e.graph_count, e.graph_break_count, [str(r.reason) for r in e.break_reasons]]
                    for name, e in explained.items()}
json.dump(report, sys.stdout)
"""


@needs_triton
def test_the_kernels_compute_attention_with_the_bias_read_per_tile():
    """Output, dQ, dK, dV and the table's gradient against float64 with a dense bias: fp32 within
    1e-5 (relative to the largest value), bf16 within twice what PyTorch's own SDPA loses in bf16 on
    the same inputs (or 4 bf16 roundings: dS enters its products rounded to bf16, as in
    FlashAttention); dropout against the reference given the kernels' own mask, the kept fraction
    that of the 16-bit threshold; a row that sees no key gives 0 and finite gradients; the output
    lies in [B, queries, heads, head_dim] memory; a fresh seed per call; torch.library's checks. The
    key/value pass's tiles both ways: transposed (SM 9.0's, the interpreter's) and as [queries,
    keys] (SM 8.x's), and the bias read from its dense form (`dense_bias`)."""
    report = run_interpreted(KERNELS)
    assert len(report["results"]) == 21
    for result in report["results"]:
        assert result["finite"] and result["empty_row"] == 0.0, result
        batch, heads, queries, _, head_dim, _ = result["shape"]
        assert result["out_strides"] == [queries * heads * head_dim, head_dim, heads * head_dim, 1], result
        if result["dtype"] == "torch.float32":
            assert max(result["errors"]) <= 1e-5, result
        elif "sdpa_errors" in result:
            for ours, sdpa in zip(result["errors"], result["sdpa_errors"]):
                assert ours <= max(2 * sdpa, BF16_ROUNDING), result
            assert result["errors"][-1] <= 0.02, result  # the table's gradient: bf16 dS summed in fp32
        else:
            assert max(result["errors"]) <= 0.03, result
        if result["dropout"]:
            assert abs(result["kept"] - result["kept_fraction"]) <= 0.03, result
            assert result["stored_bits_are_the_draws"], result
    assert report["seeds_differ"] and report["same_seed_same_mask"] and report["other_seed_other_mask"]
    assert all(result["skipped_tiles"] >= 4 for result in report["results"][-10:]), report["results"][-10:]
    listed = report["listed_tiles_only"]
    assert listed["out_rows"] == listed["out_rows_expected"], listed
    assert listed["dk_rows_sequence_1"] > 0 and not listed["dk_moved_in_sequence_1_past_key_63"], listed
    assert report["packed"] == {"0.0": [0.0, 0.0, 0.0], "0.1": [0.0, 0.0, 0.0]}, report["packed"]
    assert report["packed_grad_shape"] == [2, 20, 144]
    assert report["dq_default"], "dQ by the GEMM over dS is the default"
    for case, (dq_difference, table_difference) in report["dq_from_scores"].items():
        # fp32: rounding of reordered sums; bf16: the same bf16 dS, one rounding of dQ either way
        assert dq_difference <= (1e-6 if "float32" in case else 2 * 2.0 ** -8), (case, dq_difference)
        assert table_difference == 0.0, (case, table_difference)  # dS itself is the same


@needs_triton
def test_the_triton_backend_trains_as_sdpa_does():
    """A 3-layer model with the triton backend: loss and every gradient equal the sdpa backend's
    (no dropout), with and without activation checkpointing, one forward and one backward kernel
    call per layer (and the recomputation's forward), the packed op's (q, k, v from the fused
    projection's output, their gradient one tensor, their bias's gradient the kernels' sums); with attention dropout a checkpointed layer's
    recomputation redraws the same mask (gradients equal to the plain run's), another seed draws
    another; compiled = eager, a layer and the region building the kernels' inputs one graph each;
    the bias-bytes proxy counts each layer's dS buffer and nothing else (no bias is built); the bias
    read from its dense form (`dense_bias`) trains as the table's gather does."""
    report = run_interpreted(MODEL)
    for checkpointing in ("False", "True"):
        result = report[checkpointing]
        # 3 forward and 3 backward calls; checkpointed, 3 more forward calls (the recomputation)
        assert result["calls"] == (9 if checkpointing == "True" else 6) and result["same"], result
        assert result["packed_backwards"] == 3, result  # q, k, v read from the fused projection's output
        assert result["bias_sums"] == 3, result  # their bias's gradient summed by the kernels
        assert result["loss"] <= 1e-5 and result["worst"] <= 1e-4 and result["table_grad_norm"] > 0, result
    dense = report["dense"]  # the dense bias: [B, heads, 2, P, P], the same loss and gradients
    assert dense["loss"] <= 1e-5 and dense["worst"] <= 1e-4 and len(dense["kernel_bias"]) == 5, dense
    dropout = report["dropout"]
    assert dropout["checkpointed"] <= 1e-5 and dropout["loss"] == 0.0, dropout
    assert dropout["other_seed_changes_loss"] > 0 and dropout["other_seed_changes_grads"] > 1e-2, dropout
    assert report["compiled"]["calls"] == 6 and report["compiled"]["worst"] <= 1e-5, report["compiled"]
    measured, expected = report["bias_bytes"]
    assert measured == expected, report["bias_bytes"]
    assert report["graphs"] == {"layer": [1, 0, []], "embed": [1, 0, []]}, report["graphs"]


@needs_triton
def test_tensor_parallel_2_with_the_triton_backend_equals_tensor_parallel_1_sdpa():
    """TP=2 (megatron-core layers, gloo): each rank's kernels take its heads and its rows of the
    table; loss and every merged gradient equal one process's sdpa model's."""
    script = REPO_ROOT / "tests" / "distributed" / "tp_flex_equivalence.py"
    result = subprocess.run([*torchrun(2), str(script), "triton"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
                                 "TRITON_INTERPRET": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "TP=2 triton matches TP=1 sdpa" in result.stdout


PIPELINE_STAGE = r"""
import json, sys
import torch
from megatron_pmlm.config import model_config_from_preset
from megatron_pmlm.models.layout import pmlm_attention_allowed
from megatron_pmlm.models.model import PMLMForPreTraining, attention_inputs
from megatron_pmlm.models.pipeline import LayerPipe, StageCache
from megatron_pmlm.parallel.layers import LocalLayers
from tools.bench_train import make_examples, pmlm_batch

config = model_config_from_preset("tiny", vocab_size=2048, hidden_dropout=0.0, attention_dropout=0.0,
                                  attention_backend="triton", num_layers=3)
model = PMLMForPreTraining(config, init_seed=2)
with torch.no_grad():
    model.bert.rel_pos_bias.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(4))
batch = pmlm_batch(make_examples(3, 48, 2048, seed=1))
cache = StageCache()
stage = [LayerPipe(config, LocalLayers(), stage_cache=cache) for _ in model.bert.encoder.layer]
for pipe, layer in zip(stage, model.bert.encoder.layer):
    pipe.load_state_dict(layer.state_dict())
hidden = torch.randn(*batch.input_ids.shape, config.hidden_size)
report = {}
for name, with_table in (("table", True), ("no_table", False)):
    table = model.bert.rel_pos_bias.weight.to(torch.float32, copy=True) if with_table else None
    # the model's way: one BucketAttentionInputs for every layer
    reference_hidden = hidden.clone().requires_grad_()
    inputs = (model.bert.rel_pos_bias(batch.position_ids, None, pmlm_attention_allowed(batch.roles, batch.steps),
                                      kernel_inputs=True)
              if with_table else attention_inputs("triton", None, pmlm_attention_allowed, batch.position_ids,
                                                  batch.roles, batch.steps, torch.float32))
    out = reference_hidden
    for layer in model.bert.encoder.layer:
        out = layer(out, inputs)
    reference = [out] + list(torch.autograd.grad(out.square().sum(), [reference_hidden] + ([inputs.table] if with_table else [])))
    # a stage's: the table (or an integer placeholder) and the layout travel with the hidden states
    stage_hidden = hidden.clone().requires_grad_()
    sent = table.detach().requires_grad_() if with_table else batch.position_ids.new_zeros(1)
    builds = cache.builds
    activations = (stage_hidden, sent, batch.position_ids, batch.steps, batch.token_type_ids, batch.roles,
                   batch.labels, batch.predicted_index)
    for pipe in stage:
        activations = pipe(activations)
    ours = [activations[0]] + list(torch.autograd.grad(activations[0].square().sum(),
                                                       [stage_hidden] + ([sent] if with_table else [])))
    report[name] = {"builds": cache.builds - builds,
                    "worst": max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(ours, reference))}
json.dump(report, sys.stdout)
"""


@needs_triton
def test_a_pipeline_stage_of_triton_layers_computes_what_the_model_does():
    """Pipeline stages receive the fp32 table (or a placeholder without one) and the layout, not the
    kernels' inputs: the stage's first layer builds the codes and tile lists, the others reuse them;
    output and the gradients of the hidden states and the table equal the model's layers given
    `attention_inputs`."""
    report = run_interpreted(PIPELINE_STAGE)
    for case in ("table", "no_table"):
        assert report[case]["builds"] == 1 and report[case]["worst"] <= 1e-6, report


def _listed_by_loop(codes, rows: int, columns: int) -> list:
    """[sequence][block of queries] -> [count, non-empty key blocks..., the others...], by loops."""
    _, queries, keys = codes.shape
    query_blocks, key_blocks = -(-queries // rows), -(-keys // columns)
    lists = []
    for sequence in codes:
        per_block = []
        for i in range(query_blocks):
            has = [bool((sequence[i * rows:(i + 1) * rows, j * columns:(j + 1) * columns] != bucket_attention.BLOCKED).any())
                   for j in range(key_blocks)]
            listed = [j for j in range(key_blocks) if has[j]]
            per_block.append([len(listed)] + listed + [j for j in range(key_blocks) if not has[j]])
        lists.append(per_block)
    return lists


def test_tile_lists_name_the_tiles_with_a_pair_to_compute():
    """`tile_lists`: per block of queries (keys), the count of key (query) blocks holding a pair that
    is not BLOCKED, those blocks ascending, then the rest; ragged edges count only real pairs; in the
    tiles of the kernels' shapes (other shapes through `kernel_shapes`, as the attention tool times them)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 32, (3, 150, 200), dtype=torch.uint8, generator=generator)
    codes[:, :64, 64:128] = bucket_attention.BLOCKED
    codes[1, 128:] = bucket_attention.BLOCKED
    codes[2, :, 192:] = bucket_attention.BLOCKED  # the last key block's only real keys
    codes[0, 64:128, 128:192] = bucket_attention.BLOCKED
    codes[0, 70, 130] = 5  # a lone pair keeps its tile
    tiles = bucket_attention.tile_lists(codes)
    assert tiles.key_tiles.dtype == tiles.query_tiles.dtype == torch.int32
    assert tiles.key_tiles.shape == (3, 3, 5) and tiles.query_tiles.shape == (3, 4, 4)
    assert tiles.key_tiles.tolist() == _listed_by_loop(codes, 64, 64)
    assert tiles.query_tiles.tolist() == _listed_by_loop(codes.transpose(1, 2), 64, 64)
    assert tiles.key_tiles[0, 0].tolist() == [3, 0, 2, 3, 1] and tiles.key_tiles[1, 2, 0] == 0
    assert tiles.key_tiles[0, 1, 0] == 4 and tiles.query_tiles[2, 3].tolist() == [0, 0, 1, 2]
    shape = bucket_attention.KernelShape
    with bucket_attention.kernel_shapes(shape(32, 64, 2, 2), shape(64, 128)):
        other = bucket_attention.tile_lists(codes)
    assert other.key_tiles.tolist() == _listed_by_loop(codes, 32, 64)
    assert other.query_tiles.tolist() == _listed_by_loop(codes.transpose(1, 2), 128, 64)
    assert bucket_attention.FORWARD_SHAPE == bucket_attention.DEFAULT_FORWARD_SHAPE == shape(64, 64, 4, 1)  # restored
    for wrong in (shape(48, 64), shape(64, 32)):  # keys in blocks of 64 at least: dropout's groups span 64
        with pytest.raises(ValueError, match=f"kernel shape {wrong}: blocks of queries must be 32 or 64 or 128, "
                                             "of keys 64 or 128"):
            with bucket_attention.kernel_shapes(wrong, shape(64, 64)):
                pass
    # dK, dV, dS with 32 queries a tile gave wrong dK on an H100 (sixth gpu-check): refused
    with pytest.raises(ValueError, match="kernel shape 32x128w4s3 for dK, dV, dS: its blocks of queries must be 64 "
                                         "or 128"):
        with bucket_attention.kernel_shapes(shape(64, 64), shape(32, 128)):
            pass
    assert bucket_attention.KEY_VALUE_SHAPE == bucket_attention.DEFAULT_KEY_VALUE_SHAPE == shape(64, 64, 4, 1)


def test_the_kernels_launch_as_the_environment_says_and_a_bad_value_is_refused(monkeypatch):
    """PMLM_TRITON_KERNEL_SHAPES=FORWARD/KEY_VALUE (how `make gpu-check` runs pretrain with the launch
    its attention table found fastest) sets both launches at import; a malformed value makes a
    triton model refuse to start, naming the variable (sdpa is not concerned); PMLM_TRITON_DQ,
    PMLM_TRITON_BIAS, PMLM_TRITON_KEY_VALUE_TILES, PMLM_TRITON_QKV_BIAS_GRADIENT and
    PMLM_TRITON_DROPOUT_BITS likewise. Two new interpreters show the values
    read at import (the alternatives, then malformed values: the defaults kept, the model refused);
    each value's reading and refusal are checked here with the functions the import calls."""
    from megatron_pmlm.models.accelerated import alternative_from_environment

    probe = ("from megatron_pmlm.models import bucket_attention as ba; import dataclasses\n"
             "from megatron_pmlm.config import ConfigError, model_config_from_preset\n"
             "from megatron_pmlm.models.model import check_attention_backend\n"
             "print(ba.FORWARD_SHAPE, ba.KEY_VALUE_SHAPE, ba.DQ_FROM_SCORES, ba.DENSE_BIAS, ba.KEY_VALUE_TRANSPOSED,\n"
             "      ba.PROJECTION_BIAS_SUMS, ba.DROPOUT_BITS_APART)\n"
             "config = model_config_from_preset('tiny', attention_backend='triton')\n"
             "check_attention_backend(dataclasses.replace(config, attention_backend='sdpa'))\n"
             "try:\n    check_attention_backend(config)\nexcept ConfigError as error:\n    print('refused:', error)\n")
    variables = (bucket_attention.KERNEL_SHAPES_ENV, bucket_attention.DQ_ENV, bucket_attention.BIAS_ENV,
                 bucket_attention.KEY_VALUE_ENV, bucket_attention.QKV_BIAS_ENV, bucket_attention.DROPOUT_BITS_ENV)
    outputs = []
    for values in (("32x64w8s3/128x128w4s1", "kernel", "dense", "rows", "autograd", "forward"),
                   ("64x64/64x64w4s3", "GEMM", "bf16", "keys", "sums", "inline")):
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **dict(zip(variables, values))}
        result = subprocess.run([sys.executable, "-c", probe], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(result.stdout.splitlines())
    assert outputs[0] == ["32x64w8s3 128x128w4s1 False True False False False"], outputs[0]
    assert outputs[1] == ["64x64w4s1 64x64w4s1 True False None True True",
                          "refused: PMLM_TRITON_KERNEL_SHAPES: kernel shape '64x64': give QUERIESxKEYSwWARPSsSTAGES, "
                          "e.g. 128x64w8s3 (a register cap after it: 64x64w4s1r168)"], outputs[1]

    default = (bucket_attention.DEFAULT_FORWARD_SHAPE, bucket_attention.DEFAULT_KEY_VALUE_SHAPE)
    monkeypatch.delenv(bucket_attention.KERNEL_SHAPES_ENV, raising=False)
    assert bucket_attention._launch_from_environment() == (*default, None)
    assert [str(shape) for shape in default] == ["64x64w4s1", "64x64w4s1"]
    monkeypatch.setenv(bucket_attention.KERNEL_SHAPES_ENV, "64x64")
    assert bucket_attention._launch_from_environment() == (
        *default, "PMLM_TRITON_KERNEL_SHAPES: '64x64': give FORWARD/KEY_VALUE, e.g. 128x64w8s3/64x64w4s3")
    monkeypatch.setenv(bucket_attention.KERNEL_SHAPES_ENV, "64x64w4s2/32x128w4s3")
    *launch, dk_problem = bucket_attention._launch_from_environment()
    assert tuple(launch) == default and dk_problem == (
        "PMLM_TRITON_KERNEL_SHAPES: kernel shape 32x128w4s3 for dK, dV, dS: its blocks of queries must be 64 or 128")
    # a register cap a thread (the same parser the variable goes through)
    capped = bucket_attention.parse_kernel_shapes("64x64w4s1r168/64x64w4s1")
    assert [str(shape) for shape in capped] == ["64x64w4s1r168", "64x64w4s1"], capped
    assert capped[0].launch_options() == {"num_warps": 4, "num_stages": 1, "maxnreg": 168}
    assert "maxnreg" not in capped[1].launch_options()
    for cap in ("r300", "r100", "r32"):
        with pytest.raises(ValueError, match=f"kernel shape 64x64w4s1{cap}: a register cap must be a multiple of 8 "
                                             "from 64 to 255"):
            bucket_attention.parse_kernel_shapes(f"64x64w4s1{cap}/64x64w4s1")
    # PMLM_TRITON_DQ: gemm (the default) or kernel; PMLM_TRITON_BIAS: table (the default) or dense;
    # PMLM_TRITON_KEY_VALUE_TILES: auto (the default) or rows; PMLM_TRITON_QKV_BIAS_GRADIENT: kernel (the
    # default) or autograd; PMLM_TRITON_DROPOUT_BITS: apart (the default) or forward; anything else refused
    # the same way
    for variable, default_value, alternative, wrong in ((bucket_attention.DQ_ENV, "gemm", "kernel", "GEMM"),
                                                        (bucket_attention.BIAS_ENV, "table", "dense", "bf16"),
                                                        (bucket_attention.KEY_VALUE_ENV, "auto", "rows", "keys"),
                                                        (bucket_attention.QKV_BIAS_ENV, "kernel", "autograd", "sums"),
                                                        (bucket_attention.DROPOUT_BITS_ENV, "apart", "forward",
                                                         "inline")):
        for value, expected in ((alternative, (True, None)), (default_value, (False, None)),
                                (wrong, (False, f"{variable}={wrong!r}: give {default_value} (the default) or "
                                                f"{alternative}"))):
            monkeypatch.setenv(variable, value)
            assert alternative_from_environment(variable, default_value, alternative) == expected, (variable, value)
        monkeypatch.delenv(variable)
    config = model_config_from_preset("tiny", attention_backend="triton")
    for name, problem in (("LAUNCH_PROBLEM", dk_problem), ("DQ_PROBLEM", "PMLM_TRITON_DQ='GEMM': give gemm"),
                          ("BIAS_PROBLEM", "PMLM_TRITON_BIAS='bf16': give table"),
                          ("KEY_VALUE_PROBLEM", "PMLM_TRITON_KEY_VALUE_TILES='keys': give auto"),
                          ("QKV_BIAS_PROBLEM", "PMLM_TRITON_QKV_BIAS_GRADIENT='sums': give kernel"),
                          ("DROPOUT_BITS_PROBLEM", "PMLM_TRITON_DROPOUT_BITS='inline': give apart")):
        with monkeypatch.context() as patch:
            patch.setattr(bucket_attention, name, problem)
            check_attention_backend(dataclasses.replace(config, attention_backend="sdpa"))  # sdpa not concerned
            with pytest.raises(ConfigError, match=re.escape(problem)):
                check_attention_backend(config)


def test_bench_padding_reports_the_share_of_tiles_the_kernels_compute(pretraining_samples):
    """`tools/bench_padding.py --attention-tiles` on real samples (seq 64: T up to ~80, 2 x 2 tiles):
    PMLM's context rows never see the pseudo tokens, so some tiles are skipped (fewer than all, more
    than the allowed pairs' share); UniLM v1 appends nothing: one tile per sequence, all computed."""
    shares = {}
    for objective in ("ae+par", "unilm"):
        result = run_tool("bench_padding.py", str(pretraining_samples), "--micro-batch-sizes", "8",
                          "--global-batch-sizes", "16", "--attention-tiles", "--objective", objective)
        assert result.returncode == 0, result.stderr[-3000:]
        row = [line for line in result.stdout.splitlines() if line.startswith("| 8 |")]
        assert len(row) == 1, result.stdout
        cells = [cell.strip() for cell in row[0].strip("|").split("|")]
        shares[objective] = (float(cells[3].rstrip("%")), float(cells[4].rstrip("%")))
    allowed, computed = shares["ae+par"]
    assert 0 < allowed < computed < 100, shares
    assert shares["unilm"][1] == 100.0, shares
    result = run_tool("bench_padding.py", str(pretraining_samples), "--attention-tiles", "--quanta", "16", timeout=120)
    assert result.returncode == 2 and "argument --quanta: not allowed with argument --attention-tiles" in result.stderr, \
        result.stderr


def test_the_triton_backend_is_refused_where_it_cannot_run():
    """One line naming the culprit: a head size the kernels do not take; the CPU outside Triton's
    interpreter."""
    config = model_config_from_preset("tiny", attention_backend="triton")
    with pytest.raises(ConfigError, match="head sizes 16, 32, 64, 128; this model's is 24"):
        check_attention_backend(dataclasses.replace(config, hidden_size=96, num_attention_heads=4))
    if not bucket_attention.INTERPRETED:
        with pytest.raises(ConfigError, match="runs on CUDA GPUs .* this run is on cpu: use --attention-backend sdpa"):
            check_attention_backend(config, "cpu")
    check_attention_backend(config)  # the configuration alone is fine


def test_auto_is_triton_where_its_kernels_run_and_sdpa_elsewhere(monkeypatch):
    """--attention-backend auto (pretrain's and finetune_s2s's default): triton on a CUDA GPU the kernels
    run on with a head size they take, sdpa on the CPU, on an older GPU, without Triton, or with
    another head size; a named backend stays as it is."""
    from megatron_pmlm.models.model import resolve_attention_backend

    config = model_config_from_preset("tiny")
    odd_heads = dataclasses.replace(config, hidden_size=96, num_attention_heads=4)  # head size 24
    assert resolve_attention_backend("auto", config, "cpu") == "sdpa"
    monkeypatch.setattr(bucket_attention, "device_problem", lambda device: None)  # a GPU of SM 8.0+ with Triton
    assert resolve_attention_backend("auto", config, "cuda") == "triton"
    assert resolve_attention_backend("auto", odd_heads, "cuda") == "sdpa"
    monkeypatch.setattr(bucket_attention, "device_problem", lambda device: "a GPU of compute capability 7.0")
    assert resolve_attention_backend("auto", config, "cuda") == "sdpa"
    for backend in ("sdpa", "flex", "triton"):
        assert resolve_attention_backend(backend, config, "cuda") == backend


COMPILED_FOR_GPUS = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from megatron_pmlm.models import bucket_attention_triton as kernels

sys.path.insert(0, "tools")
from bench_kernel_code import signature  # the argument types the kernels take, as a launch passes them

report = []
for capability, dtype, dropout, table in ((80, "*bf16", True, True), (90, "*bf16", True, True),
                                          (90, "*fp16", False, False)):
    constants = dict(HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, DROPOUT=dropout, PRECISION="tf32", INTERPRETED=False,
                     TRANSPOSED=capability >= 90)  # the key/value tiles as bucket_attention.transposed_tiles has them
    for kernel in (kernels.attention_forward_kernel, kernels.attention_backward_delta_kernel,
                   kernels.attention_backward_key_value_kernel, kernels.attention_backward_query_kernel):
        own = {name: value for name, value in dict(constants, WRITE_DS=table).items() if name in kernel.arg_names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature(kernel, dtype, own), constexprs=own),
                                  target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})
        report.append({"kernel": kernel.fn.__name__, "capability": capability, "dtype": dtype,
                       "cubin": len(compiled.asm.get("cubin", b"")), "shared": compiled.metadata.shared})
json.dump(report, sys.stdout)
"""


@needs_triton
def test_the_kernels_compile_for_the_gpus_they_are_meant_for():
    """Triton's own compiler, without a GPU, down to SM 8.0 and 9.0 machine code (ptxas ships with
    Triton): the four kernels, bf16 with dropout and dS written (both), fp16 without either (9.0);
    each kernel's shared memory within an A100's 164 KiB. What the interpreter cannot catch (types
    the GPU code generator refuses) fails here, not on a lent GPU."""
    report = compiled_for_gpus(COMPILED_FOR_GPUS)
    assert len(report) == 12
    for entry in report:
        assert entry["cubin"] > 0 and 0 < entry["shared"] <= 164 * 1024, entry


PATCHING = r"""
import json
import torch
import triton
import triton.runtime.interpreter as interpreter
from megatron_pmlm.models import bucket_attention as ba, bucket_attention_triton as kernels

patched = []
patch_lang = interpreter._patch_lang
def recording(fn):
    patched.append(f"{fn.__module__}.{fn.__name__}")
    return patch_lang(fn)
interpreter._patch_lang = recording
generator = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 2, 64, 16, generator=generator).requires_grad_() for _ in range(3))
codes = ba.attention_codes(torch.randint(0, 8, (1, 64, 64), dtype=torch.uint8, generator=generator),
                           torch.rand(1, 64, 64, generator=generator) > 0.3)
table = torch.randn(2, 8, generator=generator).requires_grad_()
inputs = ba.kernel_inputs(codes, table, torch.float32)
out = ba.bucket_attention_forward(q, k, v, inputs.padded_codes, *inputs.tiles, table, inputs.kernel_table, 0.0,
                                  16 ** -0.5)[0]
ours = [out, *torch.autograd.grad(out.sum(), (q, k, v, table))]
exact_inputs = [x.detach().double().requires_grad_() for x in (q, k, v, table)]
reference = ba.reference_attention(*exact_inputs[:3], codes, exact_inputs[3])
exact = [reference, *torch.autograd.grad(reference.sum(), exact_inputs)]
print(json.dumps({"patched": patched, "error": max(float((a.double() - b).abs().max()) for a, b in zip(ours, exact)),
                  "helper": type(kernels.mm).__name__}))
"""


@needs_triton
def test_the_kernels_helpers_run_in_the_interpreter_without_patching_the_language_again():
    """Triton's interpreter patches triton.language at every call of a jitted function (~30% of an
    interpreted kernel's time, the CPU suite's triton tests); the launch of a kernel has patched it for
    the kernels' module already, so `device_function` helpers are called without it: only the launched
    kernels are patched for, and the results stay exact. Triton's own jitted library functions patch
    it too (tl.zeros, tl.max, tl.sum, tl.cdiv: a third of the interpreted forward's patching after
    the helpers'), so the kernels call what those call instead; without dropout none is patched for
    (its draws are tl.philox's). Compiled for a GPU the helpers are Triton's JITFunctions, unchanged."""
    import triton

    report = run_interpreted(PATCHING)
    ours = [name for name in report["patched"] if name.startswith("megatron_pmlm.")]
    assert ours and all(name.endswith("_kernel") for name in ours), ours
    assert ours == report["patched"], sorted(set(report["patched"]) - set(ours))
    assert {"megatron_pmlm.models.bucket_attention_triton.attention_forward_kernel",
            "megatron_pmlm.models.bucket_attention_triton.attention_backward_key_value_kernel"} <= set(ours), ours
    assert report["helper"] == "InterpretedDeviceFunction" and report["error"] <= 1e-5, report
    if os.environ.get("TRITON_INTERPRET") != "1":
        from megatron_pmlm.models import bucket_attention_triton

        assert type(bucket_attention_triton.mm) is triton.JITFunction


@needs_triton
def test_the_kernels_loops_issue_few_instructions_per_tile():
    """The CPU proxy of kernels bound by what they issue (tools/bench_kernel_code.py, SM 9.0, bf16,
    the recipe's dropout, seq 512's width; docs/benchmarks.md "The triton backend's kernels"): the
    instructions of each kernel's loop per tile. The bounds leave room for other Triton versions'
    code, not for the forms before the base-2 softmax and the thread-local dropout groups (forward
    1,612, dK dV dS 1,334, dQ 865; now ~880, ~800 and ~630), and no spills. Shared memory: the dK dV
    dS kernel computes its tiles transposed (K and V staged once, P^T and dS^T left operands in
    registers: ~73 KB a tile through LDS/STS/LDSM/STSM, 101.5 as [queries, keys]), and the forward
    unpacks its kept pairs from their bytes (6 barriers a tile, 12 when the booleans were joined).
    Read at 2 pipeline stages, the launch these figures were established at: the default's one
    stage (faster on an H100) has Triton load synchronously, with more barriers a tile. The forward
    drawing its dropout (`--dropout-bits forward`) against the forward reading the bits their own
    kernel drew (the default, `bucket_attention.DROPOUT_BITS_APART`): fewer registers (more programs
    an SM) and fewer instructions a tile; the bits' kernel spills nothing."""
    report = kernel_code("--kernels", "attention forward,attention dK dV dS,attention dQ", "--launch",
                         "64x64w4s2/64x64w4s2", "--dropout-bits", "forward")
    loops = {row["kernel"]: row["loop_instructions"] for row in report["kernels"]}
    assert loops["attention forward"] <= 1100 and loops["attention dK dV dS"] <= 1000, loops
    assert loops["attention dQ"] <= 800, loops
    assert all(row["spilled_bytes"] == 0 for row in report["kernels"]), report
    shared = {row["kernel"]: row["loop_shared_bytes"] for row in report["kernels"]}
    barriers = {row["kernel"]: row["loop_barriers"] for row in report["kernels"]}
    assert shared["attention dK dV dS"] <= 85 * 1024, shared
    assert barriers["attention forward"] <= 8, barriers
    # --dropout 0: the forward as a run without attention dropout launches it (no Philox, no bits)
    plain = kernel_code("--kernels", "attention forward", "--dropout", "0")
    assert report["dropout"] == 0.1 and plain["dropout"] == 0.0, (report["dropout"], plain["dropout"])
    assert plain["kernels"][0]["loop_instructions"] < loops["attention forward"] - 200, plain
    # the dropout's bits drawn apart (the default) at the default launch: the forward reads them
    apart = {row["kernel"]: row for row in kernel_code("--kernels", "attention forward,attention dropout bits",
                                                       "--width", "176")["kernels"]}
    drawing = kernel_code("--kernels", "attention forward", "--width", "176", "--dropout-bits", "forward")["kernels"][0]
    forward, bits = apart["attention forward"], apart["attention dropout bits"]
    assert forward["registers"] < drawing["registers"] and forward["programs_per_sm"] > drawing["programs_per_sm"], \
        (forward, drawing)
    assert forward["loop_instructions"] < drawing["loop_instructions"] - 150 and forward["spilled_bytes"] == 0, forward
    assert bits["spilled_bytes"] == 0 and 0 < bits["loop_instructions"] <= 400, bits
    refused = run_tool("bench_kernel_code.py", "--dropout", "1", timeout=120)
    assert refused.returncode == 2 and "--dropout 1.0: give a probability in [0, 1)" in refused.stderr, refused.stderr
    # --launch: another launch as gpu-check times it (8 warps, 128 queries a tile)
    wide = kernel_code("--kernels", "attention dK dV dS", "--launch", "64x64w4s2/128x64w8s2")
    assert wide["launch"] == "64x64w4s2/128x64w8s2", wide["launch"]
    assert wide["kernels"][0]["num_warps"] == 8 and wide["kernels"][0]["spilled_bytes"] == 0, wide
    # --bias dense: the bias read from its dense form, no gather (fewer instructions, less shared memory)
    dense = kernel_code("--kernels", "attention forward,attention dK dV dS", "--bias", "dense", "--launch",
                        "64x64w4s2/64x64w4s2")
    assert report["bias"] == "table" and dense["bias"] == "dense", dense["bias"]
    for row in dense["kernels"]:
        assert row["loop_instructions"] < loops[row["kernel"]] and row["loop_shared_bytes"] < shared[row["kernel"]], row
    # the key/value tiles transposed on SM 9.0 unless a tile has more queries than keys; never on SM 8.x
    assert report["key_value_tiles"] == "transposed" and wide["key_value_tiles"] == "rows", wide
    shape = bucket_attention.KernelShape
    assert bucket_attention.transposed_tiles((9, 0), shape(64, 128, 8, 2))
    assert not bucket_attention.transposed_tiles((8, 0), shape(64, 64, 4, 2))
    refused = run_tool("bench_kernel_code.py", "--launch", "64x64w4s2/32x128w4s3", timeout=120)
    assert refused.returncode == 2 and ("--launch: kernel shape 32x128w4s3 for dK, dV, dS: its blocks of queries "
                                        "must be 64 or 128") in refused.stderr, refused.stderr
    # a register cap (ptxas's .maxnreg): the forward drawing its dropout at seq 128's width holds 211 registers
    # a thread, two programs an SM; capped at 168, three, with no spill
    uncapped = drawing  # the forward drawing its dropout, at seq 128's width
    capped = kernel_code("--kernels", "attention forward", "--width", "176", "--launch", "64x64w4s1r168/64x64w4s1",
                         "--dropout-bits", "forward")
    (forward,) = capped["kernels"]
    assert capped["launch"] == "64x64w4s1r168/64x64w4s1", capped["launch"]
    assert uncapped["registers"] > 168 and uncapped["programs_per_sm"] == 2, uncapped
    assert forward["registers"] <= 168 and forward["spilled_bytes"] == 0 and forward["programs_per_sm"] == 3, forward
    # the cap the launch tuner offers beside the uncapped launch (models/launch_tuning.py) is that one
    assert launch_tuning.register_cap_for_one_more_program(uncapped["registers"], 4, uncapped["shared_bytes"]) == 168


@needs_triton
def test_check_leakage_passes_with_the_triton_backend_and_catches_a_broken_mask():
    """`check_leakage --attention-backend triton` (the kernels in Triton's interpreter) passes for
    PMLM and UniLM v1 (its four LM masks): who sees whom is the rule's through the codes; a mask
    broken on purpose fails. (The fine-tuning modes pass too: `--mode pseudo-masked`, by hand.)"""
    # one example each: an example checks every position of every factorization step (UniLM: of each
    # of its four LM masks) in the interpreter; the broken mask leaks in every example
    for extra, returncode in ((["--objective", "ae+par"], 0), (["--objective", "unilm"], 0),
                              (["--inject-fault", "implicit"], 1)):
        result = run_module("megatron_pmlm.check_leakage", "--attention-backend", "triton", "--examples", "1", *extra,
                            env={"TRITON_INTERPRET": "1"})
        assert result.returncode == returncode, (extra, result.stdout[-2000:], result.stderr[-2000:])
        assert ("PASS: no leakage" in result.stdout) == (returncode == 0), (extra, result.stdout[-2000:])
    # Outside the interpreter the CPU cannot run the kernels: one line, exit 2.
    result = run_module("megatron_pmlm.check_leakage", "--attention-backend", "triton", env={"TRITON_INTERPRET": None})
    assert result.returncode == 2 and "runs on CUDA GPUs" in result.stderr, result.stderr[-2000:]


def test_a_kernel_triton_cannot_build_here_stops_the_run_in_one_line_naming_the_way_out(monkeypatch):
    """`--attention-backend auto` runs the triton kernels by default on SM 8.0+: where Triton cannot
    compile or launch one (its ptxas, an old driver, a launch too large for the GPU), a ConfigError
    (pretrain's one-line "error: ...", exit 2) names the kernel, Triton's reason and
    --attention-backend sdpa, Triton's error kept as the cause; in the interpreter errors pass as they are."""
    class OutOfResources(Exception):  # the type Triton raises for a launch that does not fit
        pass

    def attention_forward_kernel(*args, **kwargs):
        raise OutOfResources("out of resource: shared memory, Required: 262144, Hardware limit: 232448")

    class Kernel:
        fn = attention_forward_kernel

        def __getitem__(self, grid):
            return attention_forward_kernel

    monkeypatch.setattr(bucket_attention, "INTERPRETED", False)
    with pytest.raises(ConfigError) as refused:
        bucket_attention._launch(Kernel(), (1, 1), 1, 2, BLOCK_M=64)
    assert str(refused.value) == (
        "the triton attention backend's attention_forward_kernel could not be compiled or launched here "
        "(OutOfResources: out of resource: shared memory, Required: 262144, Hardware limit: 232448); run with "
        "--attention-backend sdpa (auto picks triton on CUDA GPUs of compute capability 8.0+ with Triton)")
    assert type(refused.value.__cause__).__name__ == "OutOfResources"
    monkeypatch.setattr(bucket_attention, "INTERPRETED", True)
    with pytest.raises(OutOfResources):
        bucket_attention._launch(Kernel(), (1, 1))


DQ_OVER_TILES = r"""
import json, sys
import torch
from megatron_pmlm.models import bucket_attention as ba

score_grad_buffer = ba.score_grad_buffer


def poisoned_buffer(*args, **kwargs):  # what no pass writes reads as NaN, wherever it lies
    return score_grad_buffer(*args, **kwargs).fill_(float("nan"))


ba.score_grad_buffer = poisoned_buffer


def gradients(dtype, dropout, shapes, over_tiles, from_scores=True):
    batch, heads, queries, keys, head_dim, bins = 2, 3, 150, 140, 16, 32
    generator = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(batch, heads, length, head_dim, generator=generator).to(dtype).requires_grad_()
               for length in (queries, keys, keys))
    allowed = torch.rand(batch, queries, keys, generator=generator) > 0.3
    allowed[:, :64, 64:128] = False  # whole tiles nobody sees: context queries, pseudo tokens' keys
    allowed[:, 128:] = False  # a block of padded queries
    allowed[1, :, 128:] = False  # a block of keys nobody sees
    codes = ba.attention_codes(torch.randint(0, bins, (batch, queries, keys), dtype=torch.uint8,
                                             generator=generator), allowed)
    table = (torch.randn(heads, bins, generator=generator) * 2).requires_grad_()
    grad = torch.randn(batch, heads, queries, head_dim, generator=generator).to(dtype)
    with ba.kernel_shapes(*shapes), ba.dq_over_tiles(over_tiles), ba.dq_from_scores(from_scores):
        inputs = ba.kernel_inputs(codes, table, dtype)
        torch.manual_seed(5)
        out = ba.bucket_attention(q, k, v, inputs, dropout)
        return torch.autograd.grad(out, (q, k, v, table), grad)


shape = ba.KernelShape
same, taller, wider = (shape(64, 64, 4, 1), shape(64, 64, 4, 1)), (shape(128, 64, 4, 1), shape(64, 64, 4, 1)), \
    (shape(32, 128, 4, 1), shape(64, 64, 4, 1))
report = {}
for shapes, dtype, dropout in [(same, torch.float32, 0.0), (same, torch.float32, 0.1), (same, torch.bfloat16, 0.1),
                               (taller, torch.bfloat16, 0.1), (wider, torch.float32, 0.0)]:
    by_gemm, over_tiles = gradients(dtype, dropout, shapes, False), gradients(dtype, dropout, shapes, True)
    report[f"{shapes[0]}/{shapes[1]} {dtype} {dropout}"] = {
        "finite": all(bool(torch.isfinite(g).all()) for g in by_gemm + over_tiles),
        "dq": float((over_tiles[0].double() - by_gemm[0].double()).abs().max() / by_gemm[0].double().abs().max()),
        "dk_dv_table_same_bits": all(torch.equal(a, b) for a, b in zip(over_tiles[1:], by_gemm[1:]))}
# dQ by its own kernel (PMLM_TRITON_DQ=kernel): no reader of dS's skipped tiles either
by_gemm, by_kernel = gradients(torch.float32, 0.1, same, False), gradients(torch.float32, 0.1, same, False, False)
report["dq kernel torch.float32 0.1"] = {
    "finite": all(bool(torch.isfinite(g).all()) for g in by_kernel),
    "dq": float((by_kernel[0].double() - by_gemm[0].double()).abs().max() / by_gemm[0].double().abs().max()),
    "dk_dv_table_same_bits": all(torch.equal(a, b) for a, b in zip(by_kernel[1:], by_gemm[1:]))}
json.dump({"cases": report, "default": ba.DQ_OVER_TILES}, sys.stdout)
"""


@needs_triton
def test_dq_over_the_listed_tiles_equals_the_gemm_and_reads_no_unwritten_score_gradient():
    """PMLM_TRITON_DQ=tiles: dQ = scale x dS @ K by our kernel over the forward's listed tiles, and the
    key/value pass then skips writing dS's skipped tiles (the forward's tiles its own): dQ equals the
    GEMM's up to the order of its fp32 sums (bf16: one rounding either way), dK, dV and the table's
    gradient are the same bits; the dS buffer filled with NaN first, nothing unwritten is read, with
    the tiles the same or the forward's taller or wider than the key/value pass's (then it writes
    the zeros as for the GEMM), with and without dropout; nor with dQ by its own kernel
    (PMLM_TRITON_DQ=kernel), where the zeros are left out too."""
    report = run_interpreted(DQ_OVER_TILES)
    assert report["default"] is False, "cuBLAS stays dQ's default until a GPU times the kernel"
    assert len(report["cases"]) == 6
    for case, result in report["cases"].items():
        assert result["finite"] and result["dk_dv_table_same_bits"], (case, result)
        assert result["dq"] <= (1e-6 if "float32" in case else 2 * 2.0 ** -8), (case, result)


SKIPPED_TILES_LAYOUT = r"""
import json, sys
import torch
from megatron_pmlm.models import bucket_attention as ba


def layout_codes(batch, length, bins, generator):
    # the codes of a layout with tiles to skip, as PMLM's and padding make them (length > 128)
    allowed = torch.rand(batch, length, length, generator=generator) > 0.3
    allowed[:, :64, 64:128] = False  # whole tiles nobody sees: context queries, pseudo tokens' keys
    allowed[:, 128:] = False  # a block of padded queries
    allowed[1, :, 128:] = False  # a block of keys nobody sees
    allowed[0, 5] = False  # a row that sees no key
    return ba.attention_codes(torch.randint(0, bins, (batch, length, length), dtype=torch.uint8,
                                            generator=generator), allowed)
"""


PROJECTION_BIAS = SKIPPED_TILES_LAYOUT + r"""
import itertools

batch, heads, length, head_dim, bins = 2, 2, 150, 16, 8
generator = torch.Generator().manual_seed(7)
codes = layout_codes(batch, length, bins, generator)
table = (torch.randn(heads, bins, generator=generator) * 2).requires_grad_()
scale = head_dim ** -0.5


def run(inputs, raw, bias, grad, dropout, sums):
    # the packed op as the model calls it: the bias added detached and given for its gradient, or added
    # by autograd (its gradient then autograd's reduction of the packed gradient)
    leaf = raw.clone().requires_grad_()
    qkv = leaf + bias.detach() if sums else leaf + bias
    torch.manual_seed(3)
    out, _, seed, _ = torch.ops.megatron_pmlm.bucket_attention_packed(
        qkv, heads, inputs.padded_codes, *inputs.tiles, inputs.table, inputs.kernel_table, dropout, scale,
        bias if sums else None)
    wrt = (leaf, bias) + ((inputs.table,) if inputs.table is not None else ())
    return out, seed, torch.autograd.grad(out, wrt, grad)


report = {}
# every way of dQ with and without dropout in fp32; bf16's roundings once a way; no table: dQ by its kernel
cases = [(way, torch.float32, dropout, True) for way, dropout in itertools.product(("gemm", "kernel", "tiles"),
                                                                                   (0.0, 0.1))]
cases += [("gemm", torch.bfloat16, 0.1, True), ("kernel", torch.bfloat16, 0.0, True), ("tiles", torch.bfloat16, 0.1, True)]
cases += [("gemm", torch.float32, 0.1, False), ("gemm", torch.bfloat16, 0.0, False)]
for way, dtype, dropout, with_table in cases:
    inputs = ba.kernel_inputs(codes, table if with_table else None)
    raw = torch.randn(batch, length, 3 * heads * head_dim, generator=generator).to(dtype)
    bias = torch.randn(3 * heads * head_dim, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(batch, heads, length, head_dim, generator=generator).to(dtype)
    with ba.dq_from_scores(way != "kernel"), ba.dq_over_tiles(way == "tiles"):
        out, seed, summed = run(inputs, raw, bias, grad, dropout, True)
        out_autograd, _, by_autograd = run(inputs, raw, bias, grad, dropout, False)
    # float64: the gradient of the same q, k, v (the bias added in the inputs' dtype) through the
    # reference attention with the kernels' dropout mask, summed over sequences and positions
    exact_qkv = (raw + bias.detach()).double().requires_grad_()
    keep = ba.dropout_keep_mask(seed, batch, heads, length, length, dropout) if dropout else None
    reference = ba.reference_attention(*ba.unpacked(exact_qkv, heads), codes,
                                       table.detach().double() if with_table else None, keep=keep, dropout_p=dropout)
    (exact_grad,) = torch.autograd.grad(reference, exact_qkv, grad.double())
    exact, scale_of = exact_grad.sum((0, 1)), exact_grad.abs().sum((0, 1)).clamp(min=1e-30)
    error = lambda bias_grad: float(((bias_grad.double() - exact) / scale_of).abs().max())
    report[f"{way} {dtype} {dropout} table={with_table}"] = {
        "kernels": error(summed[1]), "autograd": error(by_autograd[1]), "dtype": str(summed[1].dtype),
        # nothing else changes: the output, the packed gradient and the table's, bit for bit
        "same_bits": torch.equal(out, out_autograd) and torch.equal(summed[0], by_autograd[0])
                     and all(torch.equal(a, b) for a, b in zip(summed[2:], by_autograd[2:])),
        "finite": bool(torch.isfinite(summed[1]).all())}
json.dump(report, sys.stdout)
"""


@needs_triton
def test_the_kernels_sum_the_qkv_bias_gradient_as_autograd_does():
    """PMLM_TRITON_QKV_BIAS_GRADIENT=kernel (the default): the fused projection's bias added detached
    and handed to the packed op, whose backward kernels sum its gradient (dK, dV in the key/value
    pass, dQ in a dQ kernel or by torch after cuBLAS): against float64 (the gradient of the same
    inputs through the reference attention, the kernels' dropout mask) within 1e-6 of the summed
    magnitudes in fp32, and in bf16 within one more bf16 rounding (2^-9) of autograd's sums of the
    bf16 gradient (both within 2^-6: dS and dQ enter rounded to bf16), with dQ by cuBLAS, by its kernel and over the listed
    tiles, with dropout, without a table; skipped tiles, a padded block, a key block nobody sees and
    a row that sees no key; the output, the packed gradient and the table's the same bits as with
    autograd's bias gradient."""
    report = run_interpreted(PROJECTION_BIAS)
    assert len(report) == 11
    for case, result in report.items():
        assert result["same_bits"] and result["finite"], (case, result)
        float32 = "float32" in case
        assert result["dtype"] == ("torch.float32" if float32 else "torch.bfloat16"), (case, result)
        if float32:
            assert result["kernels"] <= 1e-6 and result["autograd"] <= 1e-6, (case, result)
        else:  # bf16's roundings (dS, dQ, the gradient's): no more than one more than autograd's
            assert result["kernels"] <= min(2.0 ** -6, result["autograd"] + 2.0 ** -9), (case, result)


DROPOUT_BITS = SKIPPED_TILES_LAYOUT + r"""
batch, heads, length, head_dim, bins = 2, 2, 150, 16, 8
generator = torch.Generator().manual_seed(13)
codes = layout_codes(batch, length, bins, generator)
table = (torch.randn(heads, bins, generator=generator) * 2).requires_grad_()
computed = (codes != ba.BLOCKED)[:, None].expand(batch, heads, length, length)
shape = ba.KernelShape
report = {}
for tiles, dtype, with_grads in [((64, 64), torch.float32, True), ((64, 64), torch.bfloat16, False),
                                 ((128, 64), torch.float32, False), ((32, 128), torch.bfloat16, False)]:
    with ba.kernel_shapes(shape(*tiles, 4, 1), shape(64, 64, 4, 1)):
        inputs = ba.kernel_inputs(codes, table)
        q, k, v = (torch.randn(batch, heads, length, head_dim, generator=generator).to(dtype).requires_grad_()
                   for _ in range(3))
        grad = torch.randn(batch, heads, length, head_dim, generator=generator).to(dtype)
        found = []
        for apart in (True, False):
            with ba.dropout_bits_apart(apart):
                torch.manual_seed(1)
                out, lse, seed, bits = ba.bucket_attention_forward(q, k, v, inputs.padded_codes, *inputs.tiles, table,
                                                                   inputs.kernel_table, 0.1, head_dim ** -0.5)
                grads = torch.autograd.grad(out, (q, k, v, table), grad) if with_grads else ()
            found.append((out, lse, seed, ba.stored_keep_mask(bits, length, length)[computed], grads))
        (out, lse, seed, kept, grads), (out_f, lse_f, seed_f, kept_f, grads_f) = found
        drawn = ba.dropout_keep_mask(seed, batch, heads, length, length, 0.1)[computed]
        report[f"{tiles} {dtype}"] = {
            "same": torch.equal(out, out_f) and torch.equal(lse, lse_f) and torch.equal(seed, seed_f),
            "same_bits": torch.equal(kept, kept_f), "bits_are_the_draws": torch.equal(kept, drawn),
            "same_gradients": all(torch.equal(a, b) for a, b in zip(grads, grads_f)), "gradients": len(grads),
            "dropped": float(1 - kept.float().mean())}
json.dump({"cases": report, "default": ba.DROPOUT_BITS_APART}, sys.stdout)
"""


@needs_triton
def test_dropout_bits_drawn_before_the_forward_are_the_ones_it_drew():
    """PMLM_TRITON_DROPOUT_BITS=apart (the default): `attention_dropout_bits_kernel` draws the kept
    pairs of the tiles the forward lists and the forward reads them: the same output, log-sum-exp
    and seed bit for bit as the forward drawing them (`forward`), the same bits where a pair is
    computed (those of the kernels' own draws, `dropout_keep_mask`), the same gradients; with the
    forward's tiles 64 x 64, 128 x 64 and 32 x 128, in fp32 and bf16, over skipped tiles and a padded
    block."""
    report = run_interpreted(DROPOUT_BITS)
    assert report["default"] is True
    assert len(report["cases"]) == 4
    for case, result in report["cases"].items():
        assert result["same"] and result["same_bits"] and result["bits_are_the_draws"], (case, result)
        assert result["same_gradients"] and 0.05 < result["dropped"] < 0.15, (case, result)
    assert report["cases"]["(64, 64) torch.float32"]["gradients"] == 4


def test_dq_from_the_score_gradient_is_written_into_the_packed_gradient_without_copies():
    """`_query_grad_from_scores` writes scale x dS @ K head by head into dq, a view of the packed
    q, k, v gradient, reading K as a view of the packed q, k, v: the float64 product, nothing
    written outside dq (the rest stays NaN), and no copy, clone or contiguous among the ops it
    dispatches (the single GEMM over batch x heads it replaced needed two copies a layer)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    batch, heads, length, head_dim, padded = 3, 4, 37, 16, 64
    qkv = torch.randn(batch, length, 3 * heads * head_dim)
    _, key, _ = bucket_attention.unpacked(qkv, heads)
    score_grad = torch.randn(batch, heads, padded, padded)[:, :, :length, :length]
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        grad_qkv = torch.full(qkv.shape, float("nan"), dtype=dtype)
        dq, _, _ = bucket_attention.unpacked(grad_qkv, heads)
        _, key_in_dtype, _ = bucket_attention.unpacked(qkv.to(dtype), heads)
        scores_in_dtype = score_grad.to(dtype)
        with Ops() as ops:
            bucket_attention._query_grad_from_scores(dq, scores_in_dtype, key_in_dtype, 0.125)
        expected = 0.125 * torch.matmul(scores_in_dtype.double(), key_in_dtype.double())
        error = ((dq.double() - expected).abs().max() / expected.abs().max()).item()
        assert error < tolerance, (dtype, error)
        assert torch.isnan(grad_qkv[..., heads * head_dim:]).all(), "written outside dq"
        assert not {"copy_", "clone", "contiguous", "_to_copy"} & set(ops.names), ops.names
