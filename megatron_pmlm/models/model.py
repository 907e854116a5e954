"""The PMLM model: BERT (post-LayerNorm) + UniLMv2's shared relative position bias + tied MLM head.

One definition for every tensor-parallel layout: layers come from a `ParallelLayers` provider and
attention heads are counted per partition. Module names follow Hugging Face's BertForMaskedLM
(`bert.embeddings.word_embeddings`, `bert.encoder.layer.N.attention.self.query`, `cls.predictions`)
plus `bert.rel_pos_bias.weight` [heads, bins], so checkpoints map to HF one to one.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .accelerated import layer_norm
from ..config import ConfigError, ModelConfig
from .flex_attention import (FlexAttentionMask, build_flex_attention_mask, default_layout_quantum,
                             flex_attention_forward, flex_capability_problem)
from .layout import (MASKED, PSEUDO, AttentionRule, PMLMBatch, gather_slots, pad_layout_inputs,
                     pmlm_attention_allowed, pmlm_predicted_index)
from .objectives import Objective, get_objective
from . import bucket_attention, bucket_sums, ffn_activation, hidden_dropout, launch_tuning
from .hidden_dropout import UNPACKING_OPS, HiddenDropout
from .bucket_attention import BucketAttentionInputs
from .relative_bias import (LayerBiasUse, PerLayerBias, blocked_bias, query_dtype, relative_attention_bias,
                            relative_buckets, relative_position_bucket)
from ..parallel.layers import LocalLayers, ParallelLayers, fused_column_linear, fused_column_output

if TYPE_CHECKING:
    from .unilm import UniLMLosses


class RelativePositionBias(nn.Module):
    """A learned bias per (head, distance bucket), computed once per forward and shared by all layers.

    `weight` is [heads, bins] like the released UniLMv2 code's bias-free Linear; under tensor
    parallelism each rank holds its heads' rows.
    """

    def __init__(self, num_heads: int, num_buckets: int, max_distance: int):
        super().__init__()
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.weight = nn.Parameter(torch.empty(num_heads, num_buckets))

    def forward(self, position_ids: torch.Tensor | None = None, key_position_ids: torch.Tensor | None = None,
                allowed: torch.Tensor | None = None, dtype: torch.dtype | None = None,
                per_layer_gradient: bool = False, kernel_inputs: bool = False
                ) -> torch.Tensor | PerLayerBias | BucketAttentionInputs:
        """[B, heads, queries, keys] from position ids, so appended tokens get their twins' distances
        (keys default to the queries; decoding passes cached + new slots as keys), -inf where the
        boolean [B, queries, keys] `allowed` is False, in `dtype` (default: the table's): built
        once per batch as `relative_bias.RelativeBiasGather` does, an SDPA-aligned view. With
        `per_layer_gradient`: (that bias without a gradient, its buckets), for the layers to reduce
        their own bias gradients (`relative_bias.LayerBiasUse`).

        Without position ids: the bias of every key - query distance clamped to +-max_distance,
        [heads, 2 x max_distance + 1], which the flex backend's score_mod looks up. It is computed
        here, in forward, so that ZeRO-3 gathers the table and gradients reach it.

        With `kernel_inputs` (the triton backend): no bias, but `BucketAttentionInputs`, each pair's
        bucket (or BLOCKED), the tiles the kernels compute, and an fp32 copy of the table, made here
        for the same reason.
        """
        if kernel_inputs:
            return triton_attention_inputs(allowed, self.weight.to(torch.float32, copy=True), position_ids,
                                           key_position_ids, self.num_buckets, self.max_distance, dtype)
        if position_ids is None:
            distances = torch.arange(-self.max_distance, self.max_distance + 1, device=self.weight.device)
            return self.weight[:, relative_position_bucket(distances, self.num_buckets, self.max_distance)]
        key_position_ids = position_ids if key_position_ids is None else key_position_ids
        return relative_attention_bias(self.weight, position_ids, key_position_ids, self.num_buckets,
                                       self.max_distance, allowed, dtype or self.weight.dtype, per_layer_gradient)


class BertEmbeddings(nn.Module):
    def __init__(self, config: ModelConfig, layers: ParallelLayers):
        super().__init__()
        self.word_embeddings = layers.vocab_embedding(config.embedding_rows, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = layer_norm(config.hidden_size, config.layernorm_epsilon)
        self.dropout = HiddenDropout(config.hidden_dropout)

    def forward(self, input_ids, position_ids, token_type_ids):
        embeddings = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
                      + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layers: ParallelLayers):
        super().__init__()
        self.heads_per_partition = config.num_attention_heads // layers.tensor_parallel_size
        self.head_dim = config.head_dim
        self.query = layers.column_linear(config.hidden_size, config.hidden_size)
        self.key = layers.column_linear(config.hidden_size, config.hidden_size)
        self.value = layers.column_linear(config.hidden_size, config.hidden_size)
        self.dropout_p = config.attention_dropout
        self.fuse_projections = True
        """Compute projections that share an input (query, key and value here) as one GEMM over
        their stacked weights (`fused_column_linear`); the parameters stay three modules, so
        checkpoints and Hugging Face exports are unchanged. False: one GEMM each (same values)."""

    def _project(self, hidden: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
        """The linears' outputs for `hidden`, split into heads."""
        if self.fuse_projections and len(linears) > 1:
            outputs = fused_column_linear(hidden, linears)
        else:
            outputs = tuple(linear(hidden) for linear in linears)
        return tuple(self._split_heads(output) for output in outputs)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.heads_per_partition, self.head_dim).transpose(1, 2)

    def forward(self, hidden: torch.Tensor, attention: "torch.Tensor | FlexAttentionMask",
                cache: "LayerKeyValues | None" = None) -> torch.Tensor:
        """`attention`: the dense additive bias (sdpa), a FlexAttentionMask (flex) or the
        BucketAttentionInputs (triton), see `attention_inputs`."""
        dropout_p = self.dropout_p if self.training else 0.0
        packed = projection_bias = None
        if isinstance(attention, BucketAttentionInputs) and cache is None and self.fuse_projections:
            linears = (self.query, self.key, self.value)
            # the bias added detached where the kernels sum its gradient (bucket_attention.PROJECTION_BIAS_SUMS)
            projection_bias = bucket_attention.summed_bias(linears)
            packed = fused_column_output(hidden, linears,
                                         None if projection_bias is None else projection_bias.detach())
        if packed is not None:  # triton reads q, k, v from the one GEMM's output, writes their gradient as one
            context = bucket_attention.bucket_attention_packed(packed, self.heads_per_partition, attention, dropout_p,
                                                               projection_bias=projection_bias)
        else:
            query, key, value = self._project(hidden, self.query, self.key, self.value)
            if cache is not None:
                key, value = cache.extend(key, value)
            if isinstance(attention, FlexAttentionMask):
                context = flex_attention_forward(query, key, value, attention)
            elif isinstance(attention, BucketAttentionInputs):
                context = bucket_attention.bucket_attention(query, key, value, attention, dropout_p)
            else:
                context = F.scaled_dot_product_attention(query, key, value, attn_mask=attention, dropout_p=dropout_p)
        batch, _, length, _ = context.shape
        return context.transpose(1, 2).reshape(batch, length, -1)


RESIDUAL_SUMS_SAVED = True
"""Under `--compile`, each BertSelfOutput's residual sum (its LayerNorm's input) is one AOT autograd's
partitioner must save for the backward (selective activation checkpointing's MUST_SAVE; every other
op PREFER_SAVE, so nothing is recomputed but the hidden dropout's unpacking of its bits, cheaper
recomputed than saved a byte a position: `hidden_dropout.UNPACKING_OPS`): with dropout it otherwise
recomputed the attention block's sum from the saved GEMM output, mask and residual, in a backward
kernel of its own that wrote it in fp32 for the LayerNorm's backward (tools/bench_layer_graph.py: 4.5
activations of memory traffic a layer at base; the memory held is the same, the sum in place of the
GEMM output). Eager runs are never wrapped."""


def _save_residual_sums(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    if op is torch.ops.aten.add.Tensor:
        return CheckpointPolicy.MUST_SAVE
    # the dropout's kept positions recomputed from its bits (`hidden_dropout`), not saved a byte each
    return CheckpointPolicy.PREFER_RECOMPUTE if op in UNPACKING_OPS else CheckpointPolicy.PREFER_SAVE


def _residual_sums_saved():
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_save_residual_sums)


class BertSelfOutput(nn.Module):
    """Projection + dropout + residual + post-LayerNorm (used after attention and after the FFN)."""

    def __init__(self, config: ModelConfig, layers: ParallelLayers, in_features: int):
        super().__init__()
        self.dense = layers.row_linear(in_features, config.hidden_size)
        self.LayerNorm = layer_norm(config.hidden_size, config.layernorm_epsilon)
        self.dropout = HiddenDropout(config.hidden_dropout)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        if RESIDUAL_SUMS_SAVED and torch.compiler.is_compiling() and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(self._normed_sum, hidden, residual, use_reentrant=False,
                                                     context_fn=_residual_sums_saved)
        return self._normed_sum(hidden, residual)

    def _normed_sum(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: ModelConfig, layers: ParallelLayers):
        super().__init__()
        self.self = BertSelfAttention(config, layers)
        self.output = BertSelfOutput(config, layers, config.hidden_size)

    def forward(self, hidden, attention_bias, cache=None):
        return self.output(self.self(hidden, attention_bias, cache), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: ModelConfig, layers: ParallelLayers):
        super().__init__()
        self.dense = layers.column_linear(config.hidden_size, config.ffn_hidden_size)

    def forward(self, hidden):
        if ffn_activation.applies(self.dense, hidden):  # the bias gradient summed by GELU's backward kernel
            return ffn_activation.ffn_gelu(self.dense, hidden)
        return F.gelu(self.dense(hidden))


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig, layers: ParallelLayers):
        super().__init__()
        self.attention = BertAttention(config, layers)
        self.intermediate = BertIntermediate(config, layers)
        self.output = BertSelfOutput(config, layers, config.ffn_hidden_size)

    def forward(self, hidden, attention_bias, cache=None):
        attended = self.attention(hidden, attention_bias, cache)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: ModelConfig, layers: ParallelLayers):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, layers) for _ in range(config.num_layers))
        self.checkpoint_activations = False
        """Recompute each layer in the backward pass instead of storing its activations."""

    def forward(self, hidden, attention_bias, table=None):
        """`attention_bias`: what every layer's attention takes (`attention_inputs`), or, with the
        relative-bias `table`, the `PerLayerBias` of `BertModel.table_gradient_per_layer`: each
        layer then gets the bias through `LayerBiasUse`, which reduces that layer's bias gradient."""
        if table is not None:
            bias, buckets = attention_bias  # the PerLayerBias of table_gradient_per_layer
            table = table.float()  # the layers' tables are summed in fp32, then cast back once
        for layer in self.layer:
            attention = attention_bias if table is None else LayerBiasUse.apply(table, bias, buckets)
            if self.checkpoint_activations and self.training:
                hidden = checkpointed_layer(layer, hidden, attention)
            else:
                hidden = layer(hidden, attention)
        return hidden


def checkpointed_layer(layer: nn.Module, hidden: torch.Tensor, attention) -> torch.Tensor:
    """The layer recomputed in the backward pass instead of storing its activations.

    With the flex backend the relative-bias table goes in as an explicit input of a reentrant
    checkpoint: torch 2.13's non-reentrant recomputation of FlexAttention gives the table its
    score_mod captures a wrong gradient (values of 1e25 where sdpa gives O(1), measured on CPU),
    the reentrant one with the table as an input gives sdpa's.
    """
    if isinstance(attention, FlexAttentionMask) and attention.distance_bias is not None:
        return torch.utils.checkpoint.checkpoint(
            lambda h, table: layer(h, attention.with_distance_bias(table)), hidden, attention.distance_bias,
            use_reentrant=True)
    return torch.utils.checkpoint.checkpoint(layer, hidden, attention, use_reentrant=False)


class BertModel(nn.Module):
    """Embeddings, the shared relative position bias, and the encoder stack."""

    def __init__(self, config: ModelConfig, layers: ParallelLayers | None = None,
                 attention_rule: AttentionRule = pmlm_attention_allowed):
        super().__init__()
        layers = layers or LocalLayers()
        if config.num_attention_heads % layers.tensor_parallel_size:
            raise ConfigError(
                f"num_attention_heads {config.num_attention_heads} is not divisible by the tensor "
                f"parallel size {layers.tensor_parallel_size}")
        check_attention_backend(config)
        self.config = config
        self.attention_rule = attention_rule
        self.embeddings = BertEmbeddings(config, layers)
        self.rel_pos_bias = (RelativePositionBias(
            config.num_attention_heads // layers.tensor_parallel_size, config.rel_pos_bins,
            config.max_rel_pos) if config.rel_pos else None)
        self.encoder = BertEncoder(config, layers)
        self.layout_quantum: int | None = None
        """Pad the layout width to a multiple of this (1: never) before the encoder and cut the
        outputs back; None: `flex_attention.default_layout_quantum` (16 for flex on CUDA, so its
        compiled kernel sees few shapes; else 1). Padding slots are PAD: seen by nobody."""

    def table_gradient_per_layer(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether each layer reduces its own gradient of the sdpa bias (on `device`, in `dtype`)
        into the relative-bias table (`relative_bias.LayerBiasUse`) instead of autograd summing the
        layers' bias-sized gradients first: where that reduction is the one-pass Triton kernel
        (`bucket_sums.runs_on`: a GPU), while training. Not under ZeRO-3, whose partitioned table is
        only whole inside the bias module's own forward (the shared bias then takes the table's
        gradient as before)."""
        table = self.rel_pos_bias.weight if self.rel_pos_bias is not None else None
        return (self.config.attention_backend == "sdpa" and table is not None and table.requires_grad
                and torch.is_grad_enabled() and not hasattr(table, "ds_id") and bucket_sums.runs_on(device, dtype))

    def embed(self, input_ids, position_ids, token_type_ids, roles, steps):
        """Embeddings and the attention bias every layer shares (in the queries' dtype: autocast's
        if on, so no layer casts it); under `table_gradient_per_layer`, a `PerLayerBias` instead."""
        hidden = self.embeddings(input_ids, position_ids, token_type_ids)
        return hidden, attention_inputs(self.config.attention_backend, self.rel_pos_bias, self.attention_rule,
                                        position_ids, roles, steps, query_dtype(hidden),
                                        per_layer_gradient=self.table_gradient_per_layer(hidden.device,
                                                                                         query_dtype(hidden)))

    def pad_layout(self, input_ids, position_ids, token_type_ids, roles, steps) -> tuple[torch.Tensor, ...]:
        """The [B, T] inputs widened to a multiple of the layout quantum (`layout.pad_layout_inputs`)."""
        quantum = self.layout_quantum or default_layout_quantum(self.config.attention_backend, input_ids.device)
        return pad_layout_inputs(quantum, input_ids, position_ids, token_type_ids, roles, steps)

    def padded_forward(self, input_ids, position_ids, token_type_ids, roles, steps) -> torch.Tensor:
        """The final hidden states at the padded width (`pad_layout`): the models' losses read the
        real slots from it (`layout.gather_slots` with the layout width), so no cut is made."""
        hidden, attention = self.embed(*self.pad_layout(input_ids, position_ids, token_type_ids, roles, steps))
        return self.encoder(hidden, attention,
                            self.rel_pos_bias.weight if isinstance(attention, PerLayerBias) else None)

    def forward(self, input_ids, position_ids, token_type_ids, roles, steps) -> torch.Tensor:
        width = input_ids.shape[1]
        hidden = self.padded_forward(input_ids, position_ids, token_type_ids, roles, steps)
        return hidden if hidden.shape[1] == width else hidden[:, :width]

    def forward_incremental(self, input_ids, position_ids, token_type_ids, roles, steps,
                            cache: "KeyValueCache") -> torch.Tensor:
        """Final hidden states of new slots only, attending to the cached slots and to each other.

        The attention rule and the relative bias are those of a full forward over [cached; new]
        (the same roles/steps rule), restricted to the new slots' rows; `cache.commit` then keeps
        the slots later ones may see. Equivalent to the full forward, at a fraction of the cost.
        Decoding always uses the sdpa kernel (a few new rows per step: nothing for flex to skip).
        """
        hidden = self.embeddings(input_ids, position_ids, token_type_ids)
        key_positions, key_roles, key_steps = cache.keys_with(position_ids, roles, steps)
        bias = attention_bias(self.rel_pos_bias, self.attention_rule, position_ids, roles, steps,
                              query_dtype(hidden), key_positions, key_roles, key_steps)
        for layer, layer_cache in zip(self.encoder.layer, cache.layers):
            hidden = layer(hidden, bias, layer_cache)
        cache.stage(position_ids, roles, steps)
        return hidden


class LayerKeyValues:
    """One layer's keys and values of the committed slots, and those of the slots just run."""

    def __init__(self) -> None:
        self.key: torch.Tensor | None = None  # [B, heads, committed, head_dim]
        self.value: torch.Tensor | None = None
        self.new_key: torch.Tensor | None = None
        self.new_value: torch.Tensor | None = None

    def extend(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.new_key, self.new_value = key, value
        if self.key is None:
            return key, value
        return torch.cat([self.key, key], dim=2), torch.cat([self.value, value], dim=2)


class KeyValueCache:
    """Per-layer keys/values of committed slots plus their positions, roles and steps (for the rule
    and the relative bias): what incremental decoding keeps between steps."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerKeyValues() for _ in range(num_layers)]
        self.positions = self.roles = self.steps = None
        self._new: tuple[torch.Tensor, ...] | None = None

    def keys_with(self, positions, roles, steps) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.positions is None:
            return positions, roles, steps
        return (torch.cat([self.positions, positions], 1), torch.cat([self.roles, roles], 1),
                torch.cat([self.steps, steps], 1))

    def stage(self, positions, roles, steps) -> None:
        self._new = (positions, roles, steps)

    def commit(self, count: int) -> None:
        """Keep the first `count` slots of the last call (later slots, e.g. the [MASK], are dropped)."""
        def keep(old, new, dim):
            new = new.narrow(dim, 0, count)
            return new if old is None else torch.cat([old, new], dim)

        for layer in self.layers:
            layer.key, layer.value = keep(layer.key, layer.new_key, 2), keep(layer.value, layer.new_value, 2)
            layer.new_key = layer.new_value = None
        positions, roles, steps = self._new
        self.positions, self.roles, self.steps = (keep(self.positions, positions, 1), keep(self.roles, roles, 1),
                                                  keep(self.steps, steps, 1))
        self._new = None

    def reorder(self, index: torch.Tensor) -> None:
        """Rows of the batch become rows `index` (beam search: replication and back-pointers)."""
        for layer in self.layers:
            layer.key, layer.value = layer.key.index_select(0, index), layer.value.index_select(0, index)
        self.positions, self.roles, self.steps = (t.index_select(0, index) for t in (self.positions, self.roles, self.steps))


def resolve_attention_backend(requested: str, config: ModelConfig, device_type: str) -> str:
    """The backend `--attention-backend requested` means for `config` on `device_type`: `auto` is
    triton on a CUDA GPU of compute capability 8.0 or more with Triton installed and a head size its
    kernels take (faster than sdpa in pretrain's compiled step on one H100: 1.10x at seq 512 x 64,
    1.02x at seq 128 x 256, the recipe's dropout included; docs/benchmarks.md, sixth run), else sdpa;
    any other value is returned as it is (`check_attention_backend` refuses what cannot run)."""
    if requested != "auto":
        return requested
    if (device_type == "cuda" and not bucket_attention.head_dim_problem(config.head_dim)
            and not bucket_attention.device_problem(torch.device("cuda"))):
        return "triton"
    return "sdpa"


def check_attention_backend(config: ModelConfig, device_type: str | None = None) -> None:
    """Refuse what a backend cannot compute: FlexAttention has no attention dropout, and does not run
    on CUDA devices below compute capability 8.0 (`flex_attention.flex_capability_problem`); the
    triton backend takes head sizes 16-128 (powers of two) and runs on CUDA SM 8.0+ (or in Triton's
    interpreter); pass the `device_type` the model will run on (None: not known yet, only the
    configuration is checked). Also refuses a malformed PMLM_FFN_BIAS_GRADIENT (`ffn_activation`) or
    PMLM_HIDDEN_DROPOUT (`hidden_dropout`)."""
    for problem in (ffn_activation.ENVIRONMENT_PROBLEM, hidden_dropout.ENVIRONMENT_PROBLEM):
        if problem:
            raise ConfigError(problem)
    if config.attention_backend == "flex" and config.attention_dropout > 0:
        raise ConfigError(f"attention backend flex has no attention dropout: set --attention-dropout 0 "
                          f"(now {config.attention_dropout}) or use --attention-backend sdpa")
    problem = None
    if config.attention_backend == "flex" and device_type:
        problem = flex_capability_problem(device_type)
    elif config.attention_backend == "triton":
        problem = (bucket_attention.head_dim_problem(config.head_dim) or bucket_attention.LAUNCH_PROBLEM
                   or bucket_attention.DQ_PROBLEM or bucket_attention.BIAS_PROBLEM or bucket_attention.QKV_BIAS_PROBLEM
                   or bucket_attention.DROPOUT_BITS_PROBLEM
                   or bucket_attention.KEY_VALUE_PROBLEM or launch_tuning.TUNING_PROBLEM
                   or (bucket_attention.device_problem(torch.device(device_type)) if device_type else None))
    if problem:
        raise ConfigError(problem)


def attention_inputs(backend: str, rel_pos_bias: RelativePositionBias | None, attention_rule: AttentionRule,
                     position_ids, roles, steps, dtype, per_layer_gradient: bool = False
                     ) -> "torch.Tensor | FlexAttentionMask | PerLayerBias | BucketAttentionInputs":
    """What every layer's attention takes for one batch: the dense additive bias (sdpa), the block
    mask and relative-bias score_mod (flex), or each pair's bucket code and the table (triton), all
    from the same rule and bias table; with
    `per_layer_gradient` (sdpa, `BertModel.table_gradient_per_layer`), a `PerLayerBias`."""
    if backend == "triton":
        allowed = attention_rule(roles, steps)
        if rel_pos_bias is None:
            return triton_attention_inputs(allowed, None)
        return rel_pos_bias(position_ids, None, allowed, dtype, kernel_inputs=True)
    if backend == "flex":
        return build_flex_attention_mask(
            attention_rule, roles, steps, None if rel_pos_bias is None else rel_pos_bias(),
            position_ids, rel_pos_bias.max_distance if rel_pos_bias is not None else 0)
    return attention_bias(rel_pos_bias, attention_rule, position_ids, roles, steps, dtype,
                          per_layer_gradient=per_layer_gradient)


def triton_attention_inputs(allowed: torch.Tensor, table: torch.Tensor | None, position_ids=None,
                            key_position_ids=None, num_buckets: int = 0, max_distance: int = 0,
                            dtype: torch.dtype | None = None) -> BucketAttentionInputs:
    """The triton backend's inputs: each pair's code (its relative-distance bucket, from the position
    ids when there is a `table`; BLOCKED where `allowed` is False), the codes' tile lists, the table
    (its dense form in `dtype`, the layers' compute dtype, under `bucket_attention.DENSE_BIAS`)."""
    buckets = None
    if table is not None:
        key_position_ids = position_ids if key_position_ids is None else key_position_ids
        buckets = relative_buckets(position_ids, key_position_ids, num_buckets, max_distance)
    return bucket_attention.kernel_inputs(bucket_attention.attention_codes(buckets, allowed), table, dtype)


def attention_bias(rel_pos_bias: RelativePositionBias | None, attention_rule: AttentionRule,
                   position_ids, roles, steps, dtype, key_position_ids=None, key_roles=None,
                   key_steps=None, per_layer_gradient: bool = False) -> torch.Tensor | PerLayerBias:
    """Additive [B, heads or 1, queries, keys] bias: relative positions plus -inf where attention is
    not allowed, in `dtype` (the queries'). Keys default to the queries (a full forward). With
    `per_layer_gradient` (a relative bias is there): (that bias without a gradient, its buckets).

    Built once per batch and shared by every layer as it is: a view of a buffer whose rows are
    padded to a multiple of 8 (`relative_bias.aligned_bias_buffer`), so SDPA neither casts nor pads
    it per layer; it is not contiguous (pipeline stages that send it make a contiguous copy).
    """
    allowed = (attention_rule(roles, steps) if key_roles is None else
               attention_rule(roles, steps, key_roles, key_steps))
    if rel_pos_bias is None:
        return blocked_bias(allowed, dtype)
    return rel_pos_bias(position_ids, key_position_ids, allowed, dtype, per_layer_gradient)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)

    def forward(self, hidden):
        return self.LayerNorm(F.gelu(self.dense(hidden)))


class BertLMPredictionHead(nn.Module):
    """dense + GELU + LayerNorm, then the decoder tied to the word embeddings, plus an output bias."""

    def __init__(self, config: ModelConfig, layers: ParallelLayers):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.bias = nn.Parameter(torch.zeros(config.embedding_rows // layers.tensor_parallel_size))
        self.register_buffer("vocab_padding", vocabulary_padding(config, layers), persistent=False)
        self.layers = layers

    def forward(self, hidden, word_embedding_weight):
        """The logits with the bias added (promoted to the bias's dtype, as ever): for inspection,
        conversion checks and decoding. The losses use `logits_and_bias`."""
        logits, bias = self.logits_and_bias(hidden, word_embedding_weight)
        return logits + bias

    def logits_and_bias(self, hidden, word_embedding_weight) -> tuple[torch.Tensor, torch.Tensor]:
        """(tied logits in the compute dtype, the output bias with -inf at vocabulary padding).

        Kept apart so that the loss (`ParallelLayers.biased_cross_entropy`) adds the bias chunk by
        chunk: under autocast `logits + bias` would be a [slots, vocab] tensor in the bias's fp32."""
        logits = self.layers.tied_logits(self.transform(hidden), word_embedding_weight)
        return logits, mask_vocabulary_padding(self.bias, self.vocab_padding)


def vocabulary_padding(config: ModelConfig, layers: ParallelLayers) -> torch.Tensor | None:
    """Boolean over this rank's slice of the vocabulary: True at padding entries (ids >= vocab_size),
    None when the vocabulary is not padded."""
    per_rank = config.embedding_rows // layers.tensor_parallel_size
    if config.embedding_rows == config.vocab_size:
        return None
    token_ids = torch.arange(per_rank) + getattr(layers, "tensor_parallel_rank", 0) * per_rank
    return token_ids >= config.vocab_size


def mask_vocabulary_padding(scores: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
    """`scores` (a bias [V / tp] or logits [..., V / tp]) with -inf at the vocabulary padding, in
    their own dtype: what adding an fp32 buffer of 0 / -inf did, without promoting bf16 logits to
    fp32. The gradient at padding entries is 0, as it was (their softmax is 0)."""
    return scores if padding is None else scores.masked_fill(padding, float("-inf"))


class BertOnlyMLMHead(nn.Module):
    def __init__(self, config: ModelConfig, layers: ParallelLayers):
        super().__init__()
        self.predictions = BertLMPredictionHead(config, layers)


@dataclass
class PMLMLosses:
    """The scalar losses of one batch and the counts needed to aggregate accuracy."""

    loss: torch.Tensor
    loss_ae: torch.Tensor
    loss_par: torch.Tensor
    ae_correct: torch.Tensor
    ae_count: torch.Tensor
    par_correct: torch.Tensor
    par_count: torch.Tensor

    def metrics(self) -> torch.Tensor:
        """metrics.PMLM_METRICS's vector, detached, for logging."""
        return self.metrics_with_grad().detach()

    def metrics_with_grad(self) -> torch.Tensor:
        """The metrics vector with the total loss first, still differentiable (the pipeline's last
        stage returns this and backpropagates its first entry)."""
        return torch.stack([self.loss.float(), self.loss_ae.detach().float(),
                            self.loss_par.detach().float(), self.ae_correct.float(), self.ae_count.float(),
                            self.par_correct.float(), self.par_count.float()])


class PMLMForPreTraining(nn.Module):
    """BERT + tied MLM head; forward returns L = L_AE + L_PAR for the chosen objective."""

    def __init__(self, config: ModelConfig, objective: Objective | str = "ae+par",
                 layers: ParallelLayers | None = None,
                 attention_rule: AttentionRule = pmlm_attention_allowed, init_seed: int = 0):
        super().__init__()
        self.layers = layers or LocalLayers()
        self.config = config
        self.objective = get_objective(objective) if isinstance(objective, str) else objective
        self.bert = BertModel(config, self.layers, attention_rule)
        self.cls = BertOnlyMLMHead(config, self.layers)
        if self.objective.is_unilm:
            from .unilm import TYPE_VOCAB_SIZE, BertPooler

            if config.type_vocab_size < TYPE_VOCAB_SIZE:
                raise ConfigError(f"objective {self.objective.name} uses UniLM v1's segment ids 0-5 (they tell the LM "
                                  f"type): type_vocab_size must be >= {TYPE_VOCAB_SIZE}, got {config.type_vocab_size}")
            if self.objective.next_sentence_prediction:
                # Hugging Face BertForPreTraining's names: bert.pooler.dense, cls.seq_relationship.
                self.bert.pooler = BertPooler(config.hidden_size)
                self.cls.seq_relationship = nn.Linear(config.hidden_size, 2)
        initialize_weights(self, config, init_seed, getattr(self.layers, "tensor_parallel_rank", 0),
                           self.layers.tensor_parallel_size)

    def zero3_external_parameters(self) -> list[tuple[nn.Module, nn.Parameter]]:
        """(module, parameter) pairs ZeRO-3 must be told of, a module reading a parameter another
        module owns: the tied softmax reads the embedding's weight."""
        return [(self.cls.predictions, self.bert.embeddings.word_embeddings.weight)]

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.cls.predictions(hidden, self.bert.embeddings.word_embeddings.weight)

    def mlm_logits_and_bias(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MLM head for the losses: (logits in the compute dtype, output bias), see
        `BertLMPredictionHead.logits_and_bias`."""
        return self.cls.predictions.logits_and_bias(hidden, self.bert.embeddings.word_embeddings.weight)

    def nsp_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, 2] next-sentence logits from the pooled [SOS] (UniLM v1 objectives with NSP)."""
        return self.cls.seq_relationship(self.bert.pooler(hidden))

    def forward(self, input_ids, position_ids, token_type_ids, roles, steps, labels,
                predicted_index: torch.Tensor | None = None) -> "PMLMLosses | UniLMLosses":
        """The objective's losses. `predicted_index`: `PMLMBatch.predicted_index` (flat indices of the
        slots the loss is taken at, made with the batch); None: derived here, a host-device sync."""
        hidden = self.bert.padded_forward(input_ids, position_ids, token_type_ids, roles, steps)
        return self.losses(hidden, token_type_ids, roles, labels, predicted_index)

    def losses(self, hidden: torch.Tensor, token_type_ids: torch.Tensor, roles: torch.Tensor, labels: torch.Tensor,
               predicted_index: torch.Tensor | None = None) -> "PMLMLosses | UniLMLosses":
        """The objective's losses from the encoder's output (at the layout's width or padded wider,
        `BertModel.padded_forward`): the heads on the predicted slots and the cross entropy (one
        region under --compile, models/compiled.py)."""
        if self.objective.is_unilm:
            from .unilm import unilm_losses

            return unilm_losses(hidden, token_type_ids, labels, self.mlm_logits_and_bias, self.layers,
                                self.nsp_logits if self.objective.next_sentence_prediction else None,
                                predicted_index)
        return pmlm_losses(hidden, roles, labels, self.objective, self.mlm_logits_and_bias, self.layers,
                           predicted_index)

    def forward_batch(self, batch: PMLMBatch) -> PMLMLosses:
        return self(*batch.as_tuple())


def pmlm_losses(hidden: torch.Tensor, roles: torch.Tensor, labels: torch.Tensor, objective: Objective,
                mlm_head, layers: ParallelLayers, predicted_index: torch.Tensor | None = None) -> PMLMLosses:
    """L = L_AE (at [M] slots) + L_PAR (at [P] slots), each a mean over its predicted tokens.

    Only the predicted slots go through the head (the vocabulary projection is the largest matmul
    of the model and most positions carry no label), the [M] and [P] slots together: one gather,
    one head, one cross entropy. `hidden` may be padded wider than `roles` (`BertModel.padded_forward`).
    `mlm_head(hidden) -> (logits, bias)`. `predicted_index`:
    `layout.pmlm_predicted_index` of the batch (made on the CPU with it); None: computed here, which
    waits for the device. Which loss a slot belongs to is read from its role on the device, so
    nothing in here makes the host wait."""
    if predicted_index is None:
        predicted_index = pmlm_predicted_index(roles, labels, objective.autoencoding, objective.pseudo_masked)
    logits, bias = mlm_head(gather_slots(hidden, predicted_index, roles.shape[1]))
    slot_roles = gather_slots(roles, predicted_index)
    return pmlm_losses_from_logits(logits, bias, gather_slots(labels, predicted_index),
                                   (slot_roles == MASKED) & objective.autoencoding,
                                   (slot_roles == PSEUDO) & objective.pseudo_masked, layers)


def pmlm_losses_from_logits(logits: torch.Tensor, bias: torch.Tensor, targets: torch.Tensor, is_ae: torch.Tensor,
                            is_par: torch.Tensor, layers: ParallelLayers) -> PMLMLosses:
    """The PMLM losses of the predicted slots' logits (the model's and the pipeline's last stage's):
    `is_ae` / `is_par` mark the slots of each loss (slots in neither are ignored)."""
    token_losses, predicted = layers.biased_cross_entropy(logits, targets, bias)
    correct = predicted == targets
    losses = {}
    for name, selected in (("ae", is_ae), ("par", is_par)):
        count = selected.sum()
        losses[f"loss_{name}"] = torch.where(selected, token_losses, 0.0).sum() / count.clamp(min=1)
        losses[f"{name}_correct"] = (correct & selected).sum()
        losses[f"{name}_count"] = count
    return PMLMLosses(loss=losses["loss_ae"] + losses["loss_par"], **losses)


def count_parameters(model: nn.Module) -> int:
    """Trainable parameters, counting tied weights once."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def initialize_weights(model: nn.Module, config: ModelConfig, seed: int, tensor_parallel_rank: int = 0,
                       tensor_parallel_size: int = 1, canonical_name=lambda name: name) -> None:
    """BERT's initialisation (N(0, init_std) matrices, zero biases, unit LayerNorm), identical for
    every parallel layout: each full tensor is drawn from a generator keyed by (seed, parameter
    name) and this rank keeps its tensor-parallel slice. So TP=2 or a pipeline built with the same
    seed starts from exactly the TP=1 weights, and no two TP ranks draw correlated shards.
    Vocabulary padding rows start at zero whatever the padding.
    """
    from ..parallel.layers import tensor_parallel_split_dim

    with torch.no_grad():
        for name, param in model.named_parameters():
            canonical = canonical_name(name)
            if "LayerNorm" in canonical:
                param.fill_(1.0 if canonical.endswith("weight") else 0.0)
                continue
            if param.dim() < 2:  # biases (the relative-position table is [heads, bins], a matrix)
                param.zero_()
                continue
            dim = tensor_parallel_split_dim(canonical) if tensor_parallel_size > 1 else None
            shape = list(param.shape)
            if dim is not None:
                shape[dim] *= tensor_parallel_size
            generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(canonical.encode()))
            if canonical.endswith("word_embeddings.weight"):
                full = torch.zeros(shape)
                full[:config.vocab_size].normal_(0.0, config.init_std, generator=generator)
            else:
                full = torch.empty(shape).normal_(0.0, config.init_std, generator=generator)
            if dim is not None:
                full = full.chunk(tensor_parallel_size, dim=dim)[tensor_parallel_rank]
            param.copy_(full)
