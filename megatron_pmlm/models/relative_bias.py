"""The sdpa backend's dense attention bias, built once per micro batch in the shape SDPA wants.

Every layer's `F.scaled_dot_product_attention` takes the same additive [B, heads or 1, T, T] bias
(relative positions plus -inf where the rule forbids attention). What each layer would otherwise do
to it (issue 33, SPEC §14), and what this module does instead:

- dtype: SDPA wants `attn_mask.dtype == query.dtype`. Under autocast the LayerNorm output is fp32
  but the queries are in the autocast dtype, so an fp32 bias is cast in every layer, and its
  gradient cast back and summed in every layer. `query_dtype` names the dtype the queries will
  have; the bias is built in it once.
- alignment: SDPA's memory-efficient kernel (GPU) pads the bias in every call unless its strides
  (all but the last) are multiples of 8. `aligned_bias_buffer` allocates [..., T, ceil8(T)] and
  hands out the [..., :T] view, which the kernel takes as it is.
- the table gradient: `F.embedding`'s backward over the B x T x T bucket indices sorts them on a
  GPU; `RelativeBiasGather` keeps uint8 buckets and reduces the bias gradient into the
  [heads, bins] table by a chunked one-hot contraction (GEMMs, deterministic, <= 64 MB chunks);
  on a GPU by `bucket_sums.bucket_sums`, a Triton kernel that reads the gradient once. There, in
  training, each layer reduces its own bias gradient (`LayerBiasUse`): autograd then sums small
  tables, not the layers' bias-sized gradients.
  docs/benchmarks.md "Attention bias (issue 33 item 2)" has the measurements behind the choice.

`bias_bytes_per_step` is the CPU proxy for what the bias costs a training step.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

try:
    from . import bucket_sums
except ImportError:  # tools/bench_before_after.py loads this file alone, for bias_bytes_per_step only
    bucket_sums = None

SDPA_MASK_ALIGNMENT = 8
"""SDPA (aten `preprocess_mask`) pads an attn_mask whose strides but the last are not multiples of this."""


def relative_position_bucket(relative_position: torch.Tensor, num_buckets: int = 32,
                             max_distance: int = 128) -> torch.Tensor:
    """T5's bidirectional bucketing of key - query distances (SPEC §5).

    Half the buckets per direction (keys after the query are offset by num_buckets/2); within a
    direction distances below num_buckets/4 are exact, larger ones log-spaced up to max_distance.
    """
    half = num_buckets // 2
    bucket = (relative_position > 0).long() * half
    distance = relative_position.abs()
    max_exact = half // 2
    # clamp(min=1) only keeps log() finite for the small distances that take the exact branch.
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (half - max_exact)).long()
    large = large.clamp(max=half - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


def bucket_index_dtype(num_buckets: int) -> torch.dtype:
    """uint8 when the buckets fit (32 by default): the [B, T, T] index kept for the backward is
    1 byte a pair instead of 8."""
    return torch.uint8 if num_buckets <= 256 else torch.int64


def relative_buckets(position_ids: torch.Tensor, key_position_ids: torch.Tensor, num_buckets: int,
                     max_distance: int) -> torch.Tensor:
    """[B, queries, keys] bucket of key - query distance, as `relative_position_bucket` gives it.

    Buckets are constant beyond +-max_distance, so the distance is clamped and looked up in the
    2 x max_distance + 1 buckets computed once: one pass over [B, T, T] instead of the log's five.
    """
    distances = torch.arange(-max_distance, max_distance + 1, device=position_ids.device)
    lookup = relative_position_bucket(distances, num_buckets, max_distance).to(bucket_index_dtype(num_buckets))
    relative = key_position_ids[:, None, :] - position_ids[:, :, None]  # key - query
    return lookup[relative.clamp_(-max_distance, max_distance).add_(max_distance)]


def query_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the attention queries computed from `hidden` will have: autocast's where autocast
    is on for its device (the projections run in it even though LayerNorm hands out fp32), else
    `hidden`'s own (fp32, or bf16 under DeepSpeed's bf16, which casts the weights)."""
    device_type = hidden.device.type
    if hidden.is_floating_point() and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return hidden.dtype


def aligned_bias_buffer(batch: int, heads: int, queries: int, keys: int, dtype: torch.dtype,
                        device: torch.device) -> torch.Tensor:
    """An uninitialised [batch, heads, queries, keys] view of a [..., ceil8(keys)] buffer: every
    stride but the last a multiple of 8, so SDPA uses it without padding a copy per layer."""
    padded_keys = -(-keys // SDPA_MASK_ALIGNMENT) * SDPA_MASK_ALIGNMENT
    return torch.empty(batch, heads, queries, padded_keys, dtype=dtype, device=device)[..., :keys]


def is_sdpa_aligned(mask: torch.Tensor) -> bool:
    """True when SDPA's memory-efficient path takes `mask` without padding a copy (its strides but the
    last multiples of 8, the last 1: aten's `aligned_tensor<8>` in `preprocess_mask`)."""
    return mask.stride(-1) == 1 and all(stride % SDPA_MASK_ALIGNMENT == 0 for stride in mask.stride()[:-1])


def blocked_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive [B, 1, queries, keys] mask alone (no relative positions): 0 where allowed, -inf
    elsewhere, in an aligned buffer."""
    batch, queries, keys = allowed.shape
    bias = aligned_bias_buffer(batch, 1, queries, keys, dtype, allowed.device)
    return bias.zero_().masked_fill_(~allowed[:, None], float("-inf"))


class RelativeBiasGather(torch.autograd.Function):
    """bias[b, h, i, j] = table[h, buckets[b, i, j]], or -inf where `allowed` is False, written once
    into an aligned buffer in `dtype`; the backward reduces the bias gradient (summed over every
    layer by autograd) into the table's gradient with `table_gradient`."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, buckets: torch.Tensor, allowed: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
        batch, queries, keys = buckets.shape
        heads, bins = table.shape
        bias = aligned_bias_buffer(batch, heads, queries, keys, dtype, table.device)
        index = buckets.long()[:, None].expand(batch, heads, queries, keys)
        source = table.detach().to(dtype)[None, :, None, :].expand(batch, heads, queries, bins)
        torch.gather(source, 3, index, out=bias)
        if allowed is not None:
            bias.masked_fill_(~allowed[:, None], float("-inf"))
        ctx.save_for_backward(buckets)
        ctx.table_dtype = table.dtype
        ctx.bins = bins
        return bias

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (buckets,) = ctx.saved_tensors
        return table_gradient(grad, buckets, ctx.bins, ctx.table_dtype), None, None, None


def table_gradient(grad: torch.Tensor, buckets: torch.Tensor, bins: int, dtype: torch.dtype) -> torch.Tensor:
    """[heads, bins] gradient of the table: grad[b, h, i, j] summed over the pairs of each bucket,
    in `dtype`. On a GPU (where Triton is installed) one pass of `bucket_sums.bucket_sums`'s kernel
    over the gradient; elsewhere `bucket_sums.one_hot_bucket_sums`'s one-hot GEMMs. Both accumulate
    in fp32 (bf16 bias gradients included), deterministic, no sort of the B x T x T indices (which
    F.embedding's backward did on a GPU)."""
    if bucket_sums.runs_on(grad.device, grad.dtype):
        return torch.ops.megatron_pmlm.bucket_sums(grad, buckets, bins).to(dtype)
    return bucket_sums.one_hot_bucket_sums(grad, buckets, bins, dtype)


class LayerBiasUse(torch.autograd.Function):
    """One layer's use of the shared bias when each layer reduces its own bias gradient
    (`BertModel.table_gradient_per_layer`, and pipeline stages): the forward hands the bias, built
    once without a gradient, on as it is (a view); the backward reduces this layer's bias gradient
    into the table's at once (`table_gradient`: on a GPU `bucket_sums`, one read of it). Autograd
    then sums one small [heads, bins] table per layer instead of the layers' bias-sized gradients
    (11 reads of two and writes of one bias-sized tensor at 12 layers), and no bias-sized gradient
    outlives its layer's backward. `table` is given in fp32 (the model casts it once), so the
    layers' tables are summed in fp32."""

    @staticmethod
    def forward(ctx, table: torch.Tensor, bias: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(buckets)
        ctx.bins = table.shape[1]
        return bias.view_as(bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (buckets,) = ctx.saved_tensors
        return table_gradient(grad, buckets, ctx.bins, torch.float32), None, None


class PerLayerBias(NamedTuple):
    """The sdpa bias when each layer reduces its own bias gradient (`LayerBiasUse`)."""

    bias: torch.Tensor
    """[B, heads, queries, keys], built without a gradient."""
    buckets: torch.Tensor
    """[B, queries, keys]: each pair's distance bucket, for the table's gradient."""


def relative_attention_bias(table: torch.Tensor, position_ids: torch.Tensor, key_position_ids: torch.Tensor,
                            num_buckets: int, max_distance: int, allowed: torch.Tensor | None,
                            dtype: torch.dtype, per_layer_gradient: bool = False
                            ) -> torch.Tensor | PerLayerBias:
    """The [B, heads, queries, keys] relative-position bias (-inf where `allowed` is False) in `dtype`,
    an aligned view, differentiable in `table`; with `per_layer_gradient`, a `PerLayerBias` (the bias
    without a gradient, its [B, queries, keys] buckets) for `LayerBiasUse` to hand to each layer."""
    buckets = relative_buckets(position_ids, key_position_ids, num_buckets, max_distance)
    if per_layer_gradient:
        return PerLayerBias(RelativeBiasGather.apply(table.detach(), buckets, allowed, dtype), buckets)
    return RelativeBiasGather.apply(table, buckets, allowed, dtype)


# ------------------------------------------------------------------------------ measuring

UNWRITTEN_ALLOCATIONS = (torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
                         torch.ops.aten.new_empty, torch.ops.aten.new_empty_strided)
"""Ops that allocate without writing: not counted as bytes written."""
MASK_HANDLING_NODES = ("ToCopyBackward0", "ConstantPadNdBackward0", "SliceBackward0", "CloneBackward0")


class _SdpaGraphs(TorchFunctionMode):
    """Marks the time inside F.scaled_dot_product_attention and collects the autograd nodes it
    creates, so their backward ops can be told apart from the bias's own."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.nodes: set = set()
        self.mask_nodes: set = set()
        """SDPA's own nodes that cast or pad the mask (autocast's cast, the GPU kernel's pad)."""
        self.calls: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if isinstance(mask, torch.Tensor):
            self.calls.append(mask)
        inputs = {id(t.grad_fn) for t in (*args[:3], mask) if isinstance(t, torch.Tensor) and t.grad_fn is not None}
        self.inside = True
        try:
            out = func(*args, **kwargs)
        finally:
            self.inside = False
        pending = [out.grad_fn]
        while pending:
            node = pending.pop()
            if node is None or id(node) in inputs or node in self.nodes:
                continue
            if type(node).__name__ == "AccumulateGrad":
                continue
            self.nodes.add(node)
            if (mask is not None and mask.grad_fn is not None and type(node).__name__ in MASK_HANDLING_NODES
                    and any(next_node is mask.grad_fn for next_node, _ in node.next_functions)):
                self.mask_nodes.add(node)
            pending.extend(next_node for next_node, _ in node.next_functions)
        return out


class _BiasShapedWrites(TorchDispatchMode):
    """Sums the bytes ops write into bias-shaped tensors ([B, heads or 1, T, >= T], dims in any
    order) that are the bias's own work: outside SDPA, plus what SDPA does to the mask itself
    (autocast's cast, the GPU kernel's pad) and the engine's summing of its gradient over layers
    (an `add` run under SDPA's backward nodes); SDPA's scores and their gradients are left out."""

    def __init__(self, graphs: _SdpaGraphs, batch: int, heads: int, width: int) -> None:
        super().__init__()
        self.graphs, self.batch, self.heads, self.width = graphs, batch, heads, width
        self.bytes = 0
        self.ops: Counter = Counter()
        self.kernel_backwards = _bucket_attention_backwards()

    def _bias_shaped(self, tensor) -> bool:
        if not isinstance(tensor, torch.Tensor) or tensor.dim() != 4:
            return False
        return any(batch == self.batch and heads in (1, self.heads) and queries == self.width and keys >= self.width
                   for batch, heads, queries, keys in itertools.permutations(tensor.shape))

    def _counted(self, func, args) -> bool:
        if func.overloadpacket in UNWRITTEN_ALLOCATIONS:
            return False  # the op that fills it is counted
        if self.graphs.inside:
            return bool(args) and any(args[0] is mask for mask in self.graphs.calls[-1:])
        node = torch._C._current_autograd_node()
        if node in self.graphs.nodes:
            return node in self.graphs.mask_nodes or func is torch.ops.aten.add.Tensor
        return True

    supports_higher_order_operators = True
    """flex_attention (a higher-order operator) passes through: the flex backend has no dense bias."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.kernel_backwards:
            # The triton backend's score gradient (the bias's gradient), written inside its backward
            # op, which this mode does not see into: the buffer `bucket_attention_backward` allocates.
            from .bucket_attention import score_grad_buffer, unpacked

            named = dict(zip((argument.name for argument in func._schema.arguments), args))
            if named["table_gradient"] and named["table"] is not None:
                query, key = ((named["query"], named["key"]) if "query" in named
                              else unpacked(named["qkv"], named["heads"])[:2])
                self.bytes += score_grad_buffer(*query.shape[:3], key.shape[2], query.dtype,
                                                torch.device("meta")).untyped_storage().nbytes()
                self.ops["bucket_attention_backward (dS)"] += 1
            return out
        if isinstance(func, torch._ops.HigherOrderOperator) or not self._counted(func, args):
            return out
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        for tensor, returned in zip(outputs, func._schema.returns):
            aliases = returned.alias_info is not None and not returned.alias_info.is_write
            if not aliases and self._bias_shaped(tensor):
                self.bytes += tensor.numel() * tensor.element_size()
                self.ops[func.__name__] += 1
        return out


def _bucket_attention_backwards() -> tuple:
    """The triton backend's backward ops where they are registered (models/bucket_attention.py
    imported): q, k, v apart and packed."""
    namespace = getattr(torch.ops, "megatron_pmlm", None)
    return tuple(getattr(namespace, name).default for name in ("bucket_attention_backward",
                                                               "bucket_attention_packed_backward")
                 if namespace is not None and hasattr(namespace, name))


def bias_bytes_per_step(model: torch.nn.Module, batch, autocast_dtype: torch.dtype | None = None,
                        width: int | None = None) -> dict:
    """What the dense attention bias costs one forward + backward of `model` on `batch` (a PMLMBatch),
    measured on any device: the bytes ops write into [B, heads or 1, T, >= T] tensors outside SDPA
    (building, casting, copying the bias and its gradient; SDPA's own scores are left out, a GPU's
    fused kernels never write them; the triton backend's score gradient, which its backward writes
    for the table's gradient), which ops those were, and the bytes SDPA's memory-efficient
    kernel would pad per call (each mask not `is_sdpa_aligned`; computed, as a CPU never pads).
    """
    heads = model.config.num_attention_heads
    batch_size = batch.input_ids.shape[0]
    if width is None:
        from .flex_attention import default_layout_quantum
        from .layout import padded_width

        # The width the layers see: the model pads the layout to its quantum (--compile, flex on CUDA).
        quantum = model.bert.layout_quantum or default_layout_quantum(model.config.attention_backend,
                                                                      batch.input_ids.device)
        width = padded_width(batch.input_ids.shape[1], quantum)
    graphs = _SdpaGraphs()
    writes = _BiasShapedWrites(graphs, batch_size, heads, width)
    model.zero_grad(set_to_none=True)
    # Compiled regions run eagerly inside and compiled after (see host_syncs.HostSyncCounter).
    with torch.compiler.set_stance("force_eager"):
        with torch.autocast(batch.input_ids.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            with graphs, writes:
                loss = model.forward_batch(batch).loss
        with writes:
            loss.backward()
    model.zero_grad(set_to_none=True)  # measured, not trained: no gradient left for the next step
    pad_bytes = 0
    for mask in graphs.calls:
        if not is_sdpa_aligned(mask):  # under autocast the kernel pads the cast copy
            padded = -(-mask.shape[-1] // SDPA_MASK_ALIGNMENT) * SDPA_MASK_ALIGNMENT
            element_size = torch.finfo(autocast_dtype).bits // 8 if autocast_dtype else mask.element_size()
            pad_bytes += math.prod(mask.shape[:-1]) * padded * element_size
    return {"bias_bytes": writes.bytes, "ops": dict(writes.ops), "sdpa_calls": len(graphs.calls),
            "sdpa_pad_bytes": pad_bytes, "mask_dtypes": sorted({str(m.dtype) for m in graphs.calls})}
