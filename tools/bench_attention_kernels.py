"""The attention kernel alone, with the pseudo-masked layout's bias and its gradient: which kernel to
build on (issue 33; on one H100 the step's attention ran at ~60 TFLOP/s, 20% of a compiled step at
seq 128 and more at 512, where its share grows with T^2).

    python tools/bench_attention_kernels.py [--preset base] [--shapes 128x256,512x64] [--json out.json]

For each shape (sequence length x micro batch): the real layout of a micro batch (tools/bench_train.py's
batches), its dense additive bias as the model builds it (`model.attention_inputs`, sdpa: relative
positions and -inf where the rule forbids) and FlexAttention's block mask and bias table (flex), random
queries, keys and values at the preset's heads and head size; then one forward + backward of the
attention alone, per variant:

- `sdpa`: F.scaled_dot_product_attention with the bias, its gradient included (the model's sdpa
  backend; on an H100 torch picks the memory-efficient kernel);
- `sdpa-bias-frozen`: the same with a bias that needs no gradient (what dBias costs; torch may pick
  another kernel, e.g. cuDNN's);
- `sdpa-contiguous-bias`: the bias and its gradient as a contiguous [B, heads, T, T] tensor instead of
  the model's view of a buffer padded to a multiple of 8 (whether the layout changes torch's choice);
- `sdpa-cudnn` (a probe, CUDA only): SDPA held to cuDNN's kernel with the bias and its gradient; where
  torch refuses, its reason is the row;
- `flex-dense-bias`: FlexAttention (compiled on CUDA) under the block mask, its score_mod adding the
  same dense bias, whose gradient comes from the kernel (one add per score, each to its own element);
- `flex-table`: the model's flex backend (`flex_attention.flex_attention_forward`: the score_mod reads
  the relative-bias table per tile; the table's gradient by atomic adds);
- `triton`: the model's triton backend (`models/bucket_attention.py`: flash attention in Triton that
  reads the table per tile from each pair's uint8 bucket code; the table's gradient from the score
  gradient by `bucket_sums`), compared with sdpa including the table's gradient (sdpa's bias
  gradient reduced per bucket in float64); CUDA, or Triton's interpreter. On a GPU its launch is
  tuned as the model's is (`models/launch_tuning.py`; the warm-up tunes): its row's launch reads
  `tuned`, and `tuned_launches` names each kernel's choice;
- `triton[FORWARD/KEY_VALUE]` (one per `--triton-shapes` entry, e.g. `128x64w8s3/64x128w8s2`): the
  triton variant launched with other tiles (queries x keys) and Triton options (warps, pipeline
  stages) for its forward and dQ kernels / its dK, dV, dS kernel (`bucket_attention.kernel_shapes`),
  compared with sdpa as `triton` is; a shape the GPU cannot hold (shared memory) is reported as not
  available: which launch to make the default;
- `sdpa-split`: sdpa in two calls split at the layout's context width N (the corrupted sequences):
  the context rows, which see only the context keys, as N x N, the appended rows against all T keys,
  each with its part of the bias as a leaf of its own (views of the model's buffer, so each part's
  gradient comes alone, no slice of the whole); ~18% fewer pairs than T x T at seq 512: whether
  the model's sdpa path should do this (not built into the model: this row decides);
- `sdpa-dropout`, `sdpa-split-dropout`, `triton-dropout`: sdpa, the split sdpa and triton with the
  recipe's attention dropout (0.1), timed only (their outputs are random): what the dropout costs
  each kernel;
- `flash-no-bias`: SDPA without any bias (not the model's attention: the floor a fused kernel reaches);
- `triton-dq-kernel`: `triton` with dQ from its own kernel (recomputing the scores, their softmax and
  dP per tile) instead of the batched GEMM over dS the backward computes it by now
  (`bucket_attention.DQ_FROM_SCORES`): which way is faster, checked against sdpa as `triton` is;
- `triton-dq-tiles`, `triton-dropout-dq-tiles`: `triton`, `triton-dropout` with dQ = scale x dS @ K
  by our kernel over the listed tiles instead of cuBLAS over every tile, dS's skipped tiles then not
  written (`bucket_attention.DQ_OVER_TILES`, PMLM_TRITON_DQ=tiles): whether reading 22-27% fewer
  bytes beats cuBLAS (the first checked against sdpa, the second timed only);
- `triton-no-bias`: the triton kernels on the same work as `flash-no-bias` (every pair, no table,
  no dropout; timed only): what our kernels' own machinery costs against FlashAttention's, apart
  from the bias, the skipped tiles and the table's gradient;
- `triton-kv-rows`, `triton-dropout-kv-rows`: `triton`, `triton-dropout` with the dK, dV, dS
  kernel's tiles computed as [queries, keys] (SM 8.x's orientation) instead of transposed
  (`bucket_attention.key_value_transposed`: SM 9.0's, FlashAttention-2's): on an H100, which
  orientation is faster (the first checked against sdpa as `triton` is, the second timed only);
- `triton-dense-bias`, `triton-dropout-dense-bias`: `triton`, `triton-dropout` reading each tile's
  bias from a dense [B, heads, 2, P, P] copy in the inputs' dtype, built once per micro batch
  (`bucket_attention.DENSE_BIAS`; built before the timing, as the model builds it once for all its
  layers) instead of gathering `table[head, code]` per pair: whether the gathers or the bytes cost
  more (the first checked against sdpa, the second timed only);
- `triton-dropout-in-forward`: `triton-dropout` with the forward drawing the dropout itself (Philox in
  its loop) instead of reading the bits a kernel of their own drew before it
  (`bucket_attention.DROPOUT_BITS_APART`, PMLM_TRITON_DROPOUT_BITS=forward): which is faster (timed
  only; both give the same bits).

Beside them, per shape, the relative-bias table's gradient from sdpa's bias gradient: the one-hot
GEMMs (`relative_bias.table_gradient` on the CPU) against the Triton kernel a GPU uses
(`models/bucket_sums.py`), and what a step of the preset's layers does with their bias gradients:
autograd's sums then the GEMMs (the former path) against the kernel on each layer's gradient (the
GPU's path now, `relative_bias.LayerBiasUse`); each checked against a float64 sum.

Each variant's output and q/k/v gradients are compared with `sdpa`'s (and `flex-dense-bias`'s bias
gradient with sdpa's); times are the mean of --iterations after --warmup (compilation), on CUDA
between device events. TFLOP/s count 14 x B x heads x T^2 x head size (forward 4, backward 10) for
every variant alike, masked pairs included. Nothing here is a test; figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megatron_pmlm.config import HelpFormatter, model_config_from_preset, positive_int  # noqa: E402
from megatron_pmlm.files import OutputError, check_output, write_json_atomically  # noqa: E402

VARIANTS = ("sdpa", "sdpa-bias-frozen", "sdpa-contiguous-bias", "sdpa-cudnn", "sdpa-split", "flex-dense-bias",
            "flex-table", "triton", "sdpa-dropout", "sdpa-split-dropout", "triton-dropout", "flash-no-bias",
            "triton-no-bias", "triton-dq-kernel", "triton-dq-tiles", "triton-dropout-dq-tiles", "triton-kv-rows",
            "triton-dropout-kv-rows", "triton-dense-bias", "triton-dropout-dense-bias", "triton-dropout-in-forward")
REFERENCE = "sdpa"
PROBES = ("sdpa-cudnn",)
"""Variants that ask whether a kernel takes our inputs at all: one that cannot run them (torch
refuses the backend) or computes something else is reported, not counted as the tool's failure."""
TIMED_ONLY = ("flash-no-bias", "sdpa-dropout", "sdpa-split-dropout", "triton-dropout", "triton-no-bias",
              "triton-dropout-dq-tiles", "triton-dropout-kv-rows", "triton-dropout-dense-bias",
              "triton-dropout-in-forward")
"""Variants not compared with sdpa: another attention (no bias), or random (dropout)."""
RECIPE_ATTENTION_DROPOUT = 0.1
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}
"""Largest relative difference (norm of the difference over the reference's norm) from `sdpa`'s
output and gradients that a variant may show and still compute the same attention."""


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'128x256,512x64' -> [(128, 256), (512, 64)] (sequence length x micro batch)."""
    shapes = []
    for part in text.split(","):
        try:
            seq_length, micro_batch = (int(value) for value in part.lower().split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"shape {part!r}: give SEQxBATCH, e.g. 128x256") from None
        if seq_length < 8 or micro_batch < 1:
            raise argparse.ArgumentTypeError(f"shape {part!r}: sequence length >= 8 and micro batch >= 1")
        shapes.append((seq_length, micro_batch))
    return shapes


def parse_triton_shapes(text: str) -> dict:
    """'128x64w8s3/64x64w4s3,...' -> {variant name: (forward shape, key/value shape)}."""
    from megatron_pmlm.models.bucket_attention import parse_kernel_shapes

    variants = {}
    for entry in filter(None, (entry.strip() for entry in text.split(","))):
        try:
            forward, key_value = parse_kernel_shapes(entry)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        variants[f"triton[{forward}/{key_value}]"] = (forward, key_value)
    return variants


def attention_flops(batch: int, heads: int, width: int, head_size: int) -> float:
    """Forward (QK^T, PV: 4) + backward (recomputed QK^T, dV, dP, dQ, dK: 10) x B x heads x T^2 x d."""
    return 14.0 * batch * heads * width * width * head_size


def layout_inputs(preset: str, seq_length: int, micro_batch: int, device: torch.device, dtype: torch.dtype,
                  seed: int = 1):
    """(config, dense bias [B, heads, T, T] as the model builds it, flex mask, table, the [B, T, T]
    relative-distance buckets behind the bias, the context width N) of a real micro batch."""
    from megatron_pmlm.models.layout import ORIGINAL, PSEUDO, pmlm_attention_allowed
    from megatron_pmlm.models.model import RelativePositionBias, attention_inputs
    from megatron_pmlm.models.relative_bias import relative_buckets
    from tools.bench_train import make_examples, pmlm_batch

    config = model_config_from_preset(preset, hidden_dropout=0.0, attention_dropout=0.0,
                                      max_position_embeddings=max(seq_length, 128))
    batch = pmlm_batch(make_examples(micro_batch, seq_length, config.vocab_size, seed=seed)).to(device)
    rel_pos_bias = RelativePositionBias(config.num_attention_heads, config.rel_pos_bins, config.max_rel_pos).to(device)
    torch.nn.init.normal_(rel_pos_bias.weight, std=0.02)
    with torch.no_grad():
        dense = attention_inputs("sdpa", rel_pos_bias, pmlm_attention_allowed, batch.position_ids, batch.roles,
                                 batch.steps, dtype)
    flex = attention_inputs("flex", rel_pos_bias, pmlm_attention_allowed, batch.position_ids, batch.roles,
                            batch.steps, dtype)
    buckets = relative_buckets(batch.position_ids, batch.position_ids, config.rel_pos_bins, config.max_rel_pos)
    appended = ((batch.roles == ORIGINAL) | (batch.roles == PSEUDO)).any(0)
    context_width = int(appended.float().argmax()) if bool(appended.any()) else batch.roles.shape[1]
    return config, dense, flex, rel_pos_bias, buckets, context_width


def run_variant(name: str, query, key, value, bias, flex, grad_out, kernel_inputs=None,
                keep: bool = True) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
    """One forward + backward; (output, gradients: q, k, v[, bias or table]) when `keep` (the timed
    runs keep nothing: no copy of a gradient inside the time). `bias`: the dense bias leaf the variant
    reads; `kernel_inputs`: the triton backend's (codes, table leaf)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron_pmlm.models import bucket_attention
    from megatron_pmlm.models import flex_attention as flex_module

    parts = (bias.context_part, bias.appended_part) if isinstance(bias, SplitBias) else (bias,)
    table = kernel_inputs.table if kernel_inputs is not None else None
    for tensor in (query, key, value, *parts, flex.distance_bias) + ((table,) if table is not None else ()):
        tensor.grad = None
    if name.startswith("triton"):  # triton, triton-dropout, triton[shapes] (launched by the caller)
        if not bucket_attention.runs_on(query.device):
            raise NotImplementedError(bucket_attention.device_problem(query.device))
        out = bucket_attention.bucket_attention(query, key, value, kernel_inputs,
                                                RECIPE_ATTENTION_DROPOUT if "dropout" in name else 0.0)
        bias = kernel_inputs.table
    elif name in ("sdpa", "sdpa-contiguous-bias"):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias)
    elif name == "sdpa-dropout":
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=RECIPE_ATTENTION_DROPOUT)
    elif name in ("sdpa-split", "sdpa-split-dropout"):
        if bias.context >= query.shape[2]:
            raise NotImplementedError("the layout has no appended rows to split off")
        out = split_attention(query, key, value, bias, RECIPE_ATTENTION_DROPOUT if name.endswith("dropout") else 0.0)
    elif name == "sdpa-cudnn":
        if query.device.type != "cuda":
            raise NotImplementedError("cuDNN's attention runs on CUDA only")
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias)
    elif name == "sdpa-bias-frozen":
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=bias.detach())
    elif name == "flash-no-bias":
        out = F.scaled_dot_product_attention(query, key, value)
    elif name == "flex-table":
        out = flex_module.flex_attention_forward(query, key, value, flex)
    elif name == "flex-dense-bias":
        def add_bias(score, b, h, q_idx, kv_idx):
            return score + bias[b, h, q_idx, kv_idx].to(score.dtype)
        if query.device.type == "cuda":
            out = flex_module._compiled_flex_attention()(query, key, value, score_mod=add_bias,
                                                         block_mask=flex.block_mask)
        else:
            with flex_module._reference_backward_allowed():
                out = flex_module.flex_attention(query, key, value, score_mod=add_bias, block_mask=flex.block_mask)
    else:
        raise ValueError(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    out.backward(grad_out)
    if not keep:
        return None
    grads = [query.grad, key.grad, value.grad]
    if isinstance(bias, SplitBias):
        grads.append(bias.whole_gradient())
    elif bias is not None and bias.grad is not None and name != "sdpa-bias-frozen":
        grads.append(bias.grad)
    return out.detach(), [g.detach().clone() for g in grads]


class SplitBias(NamedTuple):
    """The bias of `sdpa-split`: the context rows' part [B, heads, N, N] and the appended rows' part
    [B, heads, T - N, T], leaves of their own."""

    context: int
    context_part: torch.Tensor
    appended_part: torch.Tensor

    def whole_gradient(self) -> torch.Tensor:
        """The two parts' gradients as one [B, heads, T, T] (0 where the context rows meet the
        appended keys: pairs no rule allows), to compare with sdpa's."""
        appended = self.appended_part.grad
        whole = appended.new_zeros(appended.shape[0], appended.shape[1], self.context + appended.shape[2],
                                   appended.shape[3])
        whole[:, :, :self.context, :self.context] = self.context_part.grad
        whole[:, :, self.context:] = appended
        return whole


def split_attention(query, key, value, bias: SplitBias, dropout_p: float) -> torch.Tensor:
    """sdpa as two calls: the context rows against the context keys (they see no other key: the
    pseudo-masked layout's rule), the appended rows against all keys."""
    n = bias.context
    context = F.scaled_dot_product_attention(query[:, :, :n], key[:, :, :n], value[:, :, :n],
                                             attn_mask=bias.context_part, dropout_p=dropout_p)
    appended = F.scaled_dot_product_attention(query[:, :, n:], key, value, attn_mask=bias.appended_part,
                                              dropout_p=dropout_p)
    return torch.cat([context, appended], dim=2)


def relative_difference(got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected|| / ||expected|| in fp64, over the finite entries of the reference."""
    got, expected = got.double(), expected.double()
    finite = torch.isfinite(expected)
    if not torch.isfinite(got[finite]).all():
        return math.inf
    scale = float(expected[finite].norm())
    return float((got[finite] - expected[finite]).norm()) / max(scale, 1e-30)


def measure(shape: tuple[int, int], preset: str, variants: list[str], device: torch.device, dtype: torch.dtype,
            iterations: int, warmup: int, triton_shapes: dict | None = None) -> dict:
    """Every variant's figures at one shape; `triton_shapes`: the `--triton-shapes` variants (their
    names are in `variants`) -> (forward shape, key/value shape)."""
    from megatron_pmlm.models import bucket_attention, launch_tuning

    triton_shapes = triton_shapes or {}
    seq_length, micro_batch = shape
    config, dense_built, flex, rel_pos_bias, buckets, context = layout_inputs(preset, seq_length, micro_batch, device,
                                                                               dtype)
    batch, heads, width, _ = dense_built.shape
    head_size = config.hidden_size // config.num_attention_heads
    generator = torch.Generator(device=device).manual_seed(0)

    def leaf(*size):
        return torch.randn(*size, generator=generator, device=device, dtype=torch.float32).to(dtype).requires_grad_()
    query, key, value = (leaf(batch, heads, width, head_size) for _ in range(3))
    grad_out = torch.randn(batch, heads, width, head_size, generator=generator, device=device).to(dtype)
    dense = dense_built.detach().requires_grad_()  # the model's aligned layout (a view of a padded buffer)
    biases = {"sdpa-contiguous-bias": dense_built.detach().contiguous().requires_grad_()}  # else `dense`
    # the split's two parts, each a leaf viewing the model's buffer (its strides stay SDPA-aligned)
    split = SplitBias(context, dense_built.detach()[:, :, :context, :context].requires_grad_(),
                      dense_built.detach()[:, :, context:, :].requires_grad_())
    biases["sdpa-split"] = biases["sdpa-split-dropout"] = split
    flex = flex.with_distance_bias(flex.distance_bias.detach().requires_grad_())  # a leaf, as dense is
    flops = attention_flops(batch, heads, width, head_size)
    rows, reference = [], None
    for name in [REFERENCE] + [v for v in variants if v != REFERENCE]:
        row = {"variant": name}
        launched = (bucket_attention.kernel_shapes(*triton_shapes[name]) if name in triton_shapes
                    else bucket_attention.dq_from_scores(False) if name == "triton-dq-kernel"
                    else bucket_attention.dq_over_tiles(True) if name.endswith("-dq-tiles")
                    else bucket_attention.key_value_tiles(False) if name.endswith("-kv-rows")
                    else bucket_attention.dense_bias(True) if name in ("triton-dense-bias", "triton-dropout-dense-bias")
                    else bucket_attention.dropout_bits_apart(False) if name == "triton-dropout-in-forward"
                    else contextlib.nullcontext())
        chosen_before = set(launch_tuning.chosen_launches())
        try:
            with launched:
                kernel_inputs = _kernel_inputs(dense_built, buckets, rel_pos_bias,  # tile lists in its tiles
                                               every_pair=name == "triton-no-bias")
                for _ in range(max(warmup, 1)):
                    out, grads = run_variant(name, query, key, value, biases.get(name, dense), flex, grad_out,
                                             kernel_inputs)
                seconds = _time(lambda: run_variant(name, query, key, value, biases.get(name, dense), flex, grad_out,
                                                    kernel_inputs, keep=False),
                                iterations, device)
                # how the triton kernels were launched (forward and dQ / dK, dV, dS; `tuned` where the tuner chose)
                tuned = launch_tuning.tunes(device, bucket_attention.INTERPRETED, bucket_attention.SHAPES_PINNED)
                launch = (launch_tuning.TUNED_LAUNCH if tuned
                          else f"{bucket_attention.FORWARD_SHAPE}/{bucket_attention.KEY_VALUE_SHAPE}")
        except Exception as error:  # a kernel that cannot run this shape: recorded, the others still run
            reason = f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"
            # not on this device; or a launch that does not fit this GPU (Triton's OutOfResources)
            unavailable = (name in PROBES or isinstance(error, NotImplementedError)
                           or (name in triton_shapes and "OutOfResources" in
                               (type(error).__name__, type(error.__cause__).__name__)))
            row["unavailable" if unavailable else "error"] = reason
            rows.append(row)
            continue
        row.update(ms=seconds * 1e3, tflops=flops / seconds / 1e12)
        if name.startswith("triton"):
            row["launch"] = launch
            if launch == launch_tuning.TUNED_LAUNCH:  # the choices this row's warm-up made
                row["tuned_launches"] = {key[0]: str(choice.shape) for key, choice
                                         in launch_tuning.chosen_launches().items() if key not in chosen_before}
        if name == REFERENCE:
            reference = (out, grads)
        elif reference is not None and name not in TIMED_ONLY:
            names = ("output", "grad_query", "grad_key", "grad_value", "grad_bias")
            expected = [reference[0], *reference[1]]
            if name.startswith("triton"):  # the table's gradient: sdpa's bias gradient reduced per bucket, in float64
                names = names[:4] + ("grad_table",)
                expected[4] = _reduced_per_bucket(reference[1][3], buckets, config.rel_pos_bins)
            row["relative_difference"] = {what: relative_difference(got, want) for what, got, want in
                                          zip(names, [out, *grads], expected)}
            row["same_attention"] = max(row["relative_difference"].values()) <= TOLERANCE[dtype]
        rows.append(row)
    if reference is None:
        return {"seq_length": seq_length, "micro_batch": micro_batch, "width": width, "rows": rows}
    return {"seq_length": seq_length, "micro_batch": micro_batch, "width": width, "heads": heads,
            "head_size": head_size, "dtype": str(dtype).replace("torch.", ""), "flops": flops,
            "allowed_fraction": float(torch.isfinite(dense_built).float().mean()), "context_width": context,
            "split_pairs_fraction": (context * context + (width - context) * width) / (width * width), "rows": rows,
            "table_gradient": table_gradient_timings(reference[1][3], buckets, config.rel_pos_bins, config.num_layers,
                                                     iterations, device)}


def _kernel_inputs(dense: torch.Tensor, buckets: torch.Tensor, rel_pos_bias, every_pair: bool = False):
    """The triton backend's inputs for the same attention: each pair's code (its bucket, or BLOCKED
    where the dense bias is -inf) and the table the dense bias was built from, as a leaf; with
    `every_pair`, no pair blocked and no table (`triton-no-bias`: flash-no-bias's work). Under
    `bucket_attention.dense_bias`, the table's dense form in the dense bias's dtype (the inputs')."""
    from megatron_pmlm.models.bucket_attention import attention_codes, kernel_inputs

    if every_pair:
        return kernel_inputs(attention_codes(None, torch.ones_like(dense[:, 0], dtype=torch.bool)), None)
    allowed = torch.isfinite(dense[:, 0])
    table = rel_pos_bias.weight.detach().float().requires_grad_()
    return kernel_inputs(attention_codes(buckets, allowed), table, dense.dtype)  # dense under DENSE_BIAS


def _reduced_per_bucket(bias_grad: torch.Tensor, buckets: torch.Tensor, bins: int) -> torch.Tensor:
    from megatron_pmlm.models.relative_bias import table_gradient

    return table_gradient(bias_grad.double(), buckets, bins, torch.float64)


def table_gradient_timings(bias_grad: torch.Tensor, buckets: torch.Tensor, bins: int, layers: int, iterations: int,
                           device: torch.device) -> dict:
    """The relative-bias table's gradient from sdpa's bias gradient: one reduction by the one-hot
    GEMMs and by the Triton kernel (`models/bucket_sums.py`, CUDA); then what a step of `layers`
    layers does, each layer's bias gradient being this one: summed by autograd (layers - 1 adds)
    and reduced once by the GEMMs (the former path), against the kernel run on each layer's
    gradient and the small tables summed (`relative_bias.LayerBiasUse`, the GPU's path now).
    Each: ms, and the relative difference from a float64 sum (x layers for the step's)."""
    from megatron_pmlm.models import bucket_sums
    from megatron_pmlm.models.relative_bias import table_gradient

    exact = table_gradient(bias_grad.double(), buckets, bins, torch.float64)

    def summed_then_reduced():
        total = bias_grad + bias_grad  # autograd's InputBuffer: the first sum out of place, then in place
        for _ in range(layers - 2):
            total += bias_grad
        return table_gradient(total, buckets, bins, torch.float32)

    def each_layer_reduced():
        return sum(torch.ops.megatron_pmlm.bucket_sums(bias_grad, buckets, bins) for _ in range(layers))

    variants = {"gemm": (False, lambda: table_gradient(bias_grad, buckets, bins, torch.float32), 1),
                "kernel": (True, lambda: table_gradient(bias_grad, buckets, bins, torch.float32), 1),
                f"{layers} layers: summed, gemm": (False, summed_then_reduced, layers),
                f"{layers} layers: each, kernel": (True, each_layer_reduced, layers)}
    enabled, result = bucket_sums.KERNEL_ENABLED, {}
    try:
        for name, (use_kernel, function, scale) in variants.items():
            if use_kernel and (device.type != "cuda" or not enabled):
                result[name] = {"unavailable": "needs CUDA" if device.type != "cuda" else
                                "Triton is not importable (or PMLM_TABLE_GRADIENT=gemm)"}
                continue
            bucket_sums.KERNEL_ENABLED = use_kernel
            table = function()
            seconds = _time(function, iterations, device)
            result[name] = {"ms": seconds * 1e3, "relative_difference": relative_difference(table, exact * scale)}
    finally:
        bucket_sums.KERNEL_ENABLED = enabled
    return result


def _time(step, iterations: int, device: torch.device) -> float:
    """Mean seconds of `step` over `iterations` (between device events on CUDA)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(iterations):
            step()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iterations
    started = time.perf_counter()
    for _ in range(iterations):
        step()
    return (time.perf_counter() - started) / iterations


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/bench_attention_kernels.py", formatter_class=HelpFormatter,
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base", help="tiny, base or large")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("128x256,512x64"),
                        help="SEQxBATCH[,SEQxBATCH...]")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, from: " + ", ".join(VARIANTS))
    parser.add_argument("--triton-shapes", type=parse_triton_shapes, default={},
                        help="FORWARD/KEY_VALUE[,...]: a triton[...] variant per entry, launched so, each shape "
                             "QUERIESxKEYSwWARPSsSTAGES (tiles of 32, 64, 128), e.g. 128x64w8s3/64x64w4s3")
    parser.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                        help="default: bf16 on CUDA, fp32 on the CPU")
    parser.add_argument("--iterations", type=positive_int, default=10)
    parser.add_argument("--warmup", type=positive_int, default=2, help="untimed runs first (compilation)")
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants {args.variants}: unknown {', '.join(unknown) or '(none given)'}; choose from "
                     f"{', '.join(VARIANTS)}")
    variants += [name for name in args.triton_shapes if name not in variants]
    try:
        model_config_from_preset(args.preset)
    except Exception as error:
        parser.error(f"--preset {args.preset}: {error}")
    if args.json:
        try:
            check_output(args.json, "--json")
        except OutputError as error:
            parser.error(str(error))
    from megatron_pmlm.models import launch_tuning

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    results = {"device": torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({os.cpu_count()} cores)",
               "torch": torch.__version__, "preset": args.preset, "iterations": args.iterations, "shapes": []}
    for shape in args.shapes:
        figures = measure(shape, args.preset, variants, device, dtype, args.iterations, args.warmup,
                          args.triton_shapes)
        results["shapes"].append(figures)
        print(f"{results['device']} | {args.preset}, seq {figures['seq_length']} (layout width {figures['width']}), "
              f"micro batch {figures['micro_batch']}, {figures.get('dtype', '?')}; pairs the rule allows "
              f"{figures.get('allowed_fraction', 0):.1%}; context width {figures.get('context_width', '?')} (the "
              f"split's pairs {figures.get('split_pairs_fraction', 0):.1%} of T x T)")
        for row in figures["rows"]:
            if "error" in row or "unavailable" in row:
                print(f"  {row['variant']:<20} " + (f"failed: {row['error']}" if "error" in row
                                                     else f"not available: {row['unavailable']}"))
                continue
            check = ""
            if "relative_difference" in row:
                worst = max(row["relative_difference"].items(), key=lambda item: item[1])
                check = (f" | {'same attention' if row['same_attention'] else 'DIFFERS'} as sdpa "
                         f"(largest relative difference {worst[1]:.1e}, {worst[0]})")
            variant = row["variant"] + launch_tuning.choices_text(row.get("tuned_launches"))
            print(f"  {variant:<20} {row['ms']:9.3f} ms forward + backward | {row['tflops']:7.1f} TFLOP/s{check}")
        for name, timing in figures.get("table_gradient", {}).items():
            print(f"  table gradient, {name:<26} " + (f"not available: {timing['unavailable']}" if "unavailable" in timing
                                                   else f"{timing['ms']:9.3f} ms | relative difference from a float64 "
                                                        f"sum {timing['relative_difference']:.1e}"))
    if args.json:
        write_json_atomically(args.json, results)
    failed = [row["variant"] for figures in results["shapes"] for row in figures["rows"]
              if row["variant"] not in PROBES and ("error" in row or row.get("same_attention") is False)]
    if failed:
        print(f"failed or different from sdpa: {', '.join(sorted(set(failed)))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
