"""The PMLM model as a DeepSpeed PipelineModule: the same layers as `model.py`, cut into stages.

Layer specs, in order (index: what):
    0        WordEmbeddingPipe (tied "word_embeddings"): token embedding lookup  -- first stage
    1        EmbeddingPipe: position/segment embeddings, LayerNorm, dropout, the relative-bias table
    2..L+1   LayerPipe: the transformer layers
    L+2      HeadTransformPipe: gathers the predicted slots (the batch's `predicted_index`, made
             on the CPU with it: no host-device sync), dense + GELU + LayerNorm
             (UniLM v1: every labelled slot, and the pooler on [SOS] for NSP)
    L+3      WordEmbeddingPipe again (tied): the softmax tied to the embedding -- last stage
    L+4      LossPipe: output bias, cross entropy, accuracy counts (model.pmlm_losses_from_logits;
             UniLM v1: per-LM sums and the next-sentence head, through unilm.unilm_losses_from_logits)
Only the word embedding is shared between the first and the last stage; DeepSpeed all-reduces its
gradient across the two. Activations between stages are tuples of tensors whose shapes vary per
batch (`dynamic_shape`): the hidden states, the relative-bias table (sdpa and triton: per bucket,
[heads, bins] in fp32; flex: per distance, [heads, 2 x max_distance + 1]; its gradient flows back to
the first stage, which holds the parameter), and the layout (position ids, steps, segment ids,
roles, labels, predicted index). The first layer of a stage builds what its attention reads from
the attention rule (sdpa: the dense bias without a gradient, each layer then reducing its own bias
gradient into the table as `BertModel` does on a GPU; flex: the block mask; triton: each pair's
bucket code and the tile lists) and the stage's other layers reuse it (`StageCache`): no
[B, heads, T, T] tensor crosses a stage, where the sdpa bias and its gradient did (1.4 GB a micro
batch at base, seq 512 x 64, in bf16, against 66 MB of hidden states).
"""

from __future__ import annotations

import re
from typing import Callable, TypeVar

import torch
from torch import nn

from ..config import ModelConfig
from . import bucket_attention
from .layout import (MASKED, PSEUDO, AttentionRule, gather_slots, pad_layout_inputs, pmlm_attention_allowed,
                     pmlm_predicted_index, widen_flat_index)
from .flex_attention import build_block_mask, build_flex_attention_mask, default_layout_quantum
from .hidden_dropout import HiddenDropout
from .model import (BertLayer, BertPredictionHeadTransform, RelativePositionBias, initialize_weights,
                    mask_vocabulary_padding, pmlm_losses_from_logits, triton_attention_inputs, vocabulary_padding)
from .objectives import Objective
from .relative_bias import LayerBiasUse, blocked_bias, query_dtype, relative_attention_bias
from ..parallel.layers import ParallelLayers
from ..parallel.deepspeed_import import import_deepspeed

TIED_KEY = "word_embeddings"
Built = TypeVar("Built")


class StageCache:
    """What the layers of one pipeline stage build from the micro batch's layout tensors (flex: the
    block mask; triton: the bucket codes and tile lists), built by the first and reused by the rest.

    `BertModel` builds it once per micro batch before its layers; a pipeline stage cannot receive it
    (stages exchange tensors only), so each of its layers would rebuild it from the roles, steps and
    positions that travel with the hidden states. They are the same tensors (or detached views of
    them, under activation checkpointing) for every layer of the stage: recognised by storage, shape,
    strides and version counter while this cache holds them alive.
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._held: tuple[torch.Tensor, ...] = ()
        self._built = None
        self.builds = 0
        """Values built so far (a test reads it)."""

    @staticmethod
    def _identity(tensor: torch.Tensor) -> tuple:
        return (tensor.device, tensor.data_ptr(), tuple(tensor.shape), tensor.stride(), tensor._version)

    def get(self, build: Callable[[], Built], recipe: tuple, *tensors: torch.Tensor) -> Built:
        """`build()`'s value, built again only when the `recipe` (what is built, how: hashable) or a
        tensor it is built from is not the last call's."""
        key = recipe + tuple(self._identity(tensor) for tensor in tensors)
        if key != self._key:
            self._built = build()
            self._key, self._held = key, tensors
            self.builds += 1
        return self._built

    def clear(self) -> None:
        """Let go of the last micro batch's tensors and what was built from them (the sdpa bias:
        0.7 GB at base, seq 512 x 64), so they do not outlive the batch (`PMLMPipeline.end_batch`)."""
        self._key, self._held, self._built = None, (), None


class WordEmbeddingPipe(nn.Module):
    def __init__(self, config: ModelConfig, layers: ParallelLayers, objective: Objective | None = None):
        super().__init__()
        self.word_embeddings = layers.vocab_embedding(config.embedding_rows, config.hidden_size)
        self.attention_backend = config.attention_backend
        self.objective = objective
        self.layout_quantum: int | None = None
        """As `BertModel.layout_quantum`: None, `flex_attention.default_layout_quantum`; --compile
        sets the compiled layers' quantum (`compiled.compile_transformer_layers`)."""

    def forward(self, inputs):
        """The first stage: `PMLMBatch.as_tuple()` in, (word embeddings, positions, segments, roles,
        steps, labels, predicted index) out. It pads the layout width as `BertModel.forward` does
        (flex on CUDA: `flex_attention.default_layout_quantum`), labels included, and moves the
        predicted slots' flat index to the padded width, so every stage sees the padded width. A
        batch without its index (built by hand) gets one here, with a host-device sync."""
        layout, index = tuple(inputs[:6]), (inputs[6] if len(inputs) > 6 else None)
        if index is None:
            index = objective_predicted_index(self.objective, layout[3], layout[5])
        quantum = self.layout_quantum or default_layout_quantum(self.attention_backend, layout[0].device)
        padded = pad_layout_inputs(quantum, *layout)
        index = widen_flat_index(index, layout[0].shape[1], padded[0].shape[1])
        return (self.word_embeddings(padded[0]),) + tuple(padded[1:]) + (index,)


def objective_predicted_index(objective: Objective, roles: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """What the objective's batch builder puts in `PMLMBatch.predicted_index` (a host-device sync)."""
    if objective.is_unilm:
        from .unilm import unilm_predicted_index

        return unilm_predicted_index(labels)
    return pmlm_predicted_index(roles, labels, objective.autoencoding, objective.pseudo_masked)


def tied_logits_forward(layers: ParallelLayers):
    def forward(module: WordEmbeddingPipe, activations):
        return (layers.tied_logits(activations[0], module.word_embeddings.weight),) + tuple(activations[1:])
    return forward


class EmbeddingPipe(nn.Module):
    def __init__(self, config: ModelConfig, layers: ParallelLayers):
        super().__init__()
        self.attention_backend = config.attention_backend
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.dropout = HiddenDropout(config.hidden_dropout)
        self.rel_pos_bias = (RelativePositionBias(config.num_attention_heads // layers.tensor_parallel_size,
                                                  config.rel_pos_bins, config.max_rel_pos)
                             if config.rel_pos else None)

    def forward(self, activations):
        """(hidden, bias table, position ids, steps, segment ids, roles, labels, index); the last four
        for HeadTransformPipe (the segment ids tell UniLM v1's LM type)."""
        word, position_ids, token_type_ids, roles, steps, labels, index = activations
        hidden = self.dropout(self.LayerNorm(
            word + self.position_embeddings(position_ids) + self.token_type_embeddings(token_type_ids)))
        if self.rel_pos_bias is None:
            # An integer placeholder: DeepSpeed sends no empty tensors and expects a gradient for every
            # floating-point activation.
            table = position_ids.new_zeros(1)
        elif self.attention_backend == "flex":
            table = self.rel_pos_bias()
        else:  # a differentiable fp32 copy (RelativePositionBias.forward's kernel_inputs makes the same)
            table = self.rel_pos_bias.weight.to(torch.float32, copy=True)
        return hidden, table, position_ids, steps, token_type_ids, roles, labels, index


class LayerPipe(BertLayer):
    def __init__(self, config: ModelConfig, layers: ParallelLayers,
                 attention_rule: AttentionRule = pmlm_attention_allowed, stage_cache: StageCache | None = None):
        super().__init__(config, layers)
        self.attention_rule = attention_rule
        self.attention_backend = config.attention_backend
        self.num_buckets = config.rel_pos_bins
        self.max_distance = config.max_rel_pos
        self.stage_cache = stage_cache if stage_cache is not None else StageCache()
        """Shared by the layers of this stage: what attention reads is built once per micro batch."""
        self.layer_forward: Callable = BertLayer.forward
        """The transformer layer's computation, called as `layer_forward(self, hidden, attention)`:
        `BertLayer.forward`, or under --compile one compiled region every layer shares
        (`compiled.compile_transformer_layers`; the stage cache's bookkeeping stays outside it)."""

    def forward(self, activations):
        hidden, table, position_ids, steps, _, roles, _, _ = activations
        table = table if table.is_floating_point() else None
        attention = self._attention_inputs(hidden, table, position_ids, roles, steps)
        return (self.layer_forward(self, hidden, attention),) + tuple(activations[1:])

    def _attention_inputs(self, hidden, table, position_ids, roles, steps):
        """What this layer's attention takes (`model.attention_inputs`), from what the stage built
        for the micro batch."""
        rule, cache = self.attention_rule, self.stage_cache
        if self.attention_backend == "flex":
            block_mask = cache.get(lambda: build_block_mask(rule, roles, steps), ("block mask", rule), roles, steps)
            return build_flex_attention_mask(rule, roles, steps, table, position_ids, self.max_distance,
                                             block_mask=block_mask)
        if self.attention_backend == "triton":
            inputs = cache.get(
                lambda: triton_attention_inputs(rule(roles, steps), table, position_ids, None, self.num_buckets,
                                                self.max_distance),
                ("codes", rule, table is not None, bucket_attention.FORWARD_SHAPE, bucket_attention.KEY_VALUE_SHAPE),
                roles, steps, position_ids)
            return inputs._replace(table=table)  # this layer's table tensor (checkpointing passes a view)
        dtype = query_dtype(hidden)
        if table is None:
            return cache.get(lambda: blocked_bias(rule(roles, steps), dtype), ("mask", rule, dtype), roles, steps)
        bias, buckets = cache.get(
            lambda: relative_attention_bias(table.detach(), position_ids, position_ids, self.num_buckets,
                                            self.max_distance, rule(roles, steps), dtype, per_layer_gradient=True),
            ("bias", rule, dtype), roles, steps, position_ids, table)
        return LayerBiasUse.apply(table, bias, buckets)


class HeadTransformPipe(nn.Module):
    """Gathers the predicted slots - the labelled [M] (if AE is on) and [P] (if PAR/AR is on) - by
    their flat index, then the MLM transform; out: (transformed, targets, roles of the slots).
    UniLM v1: every labelled slot and its LM type, and the pooled [SOS] with the NSP targets."""

    def __init__(self, config: ModelConfig, objective: Objective):
        super().__init__()
        self.objective = objective
        self.transform = BertPredictionHeadTransform(config)
        if objective.next_sentence_prediction:
            from .unilm import BertPooler

            self.pooler = BertPooler(config.hidden_size)

    def forward(self, activations):
        hidden = activations[0]
        token_type_ids, roles, labels, index = activations[-4:]
        if self.objective.is_unilm:
            from .unilm import unilm_slots

            index, slot_lm, nsp_targets = unilm_slots(token_type_ids, labels, index)
            out = (self.transform(gather_slots(hidden, index)), gather_slots(labels, index), slot_lm)
            return out + ((self.pooler(hidden), nsp_targets) if self.objective.next_sentence_prediction else ())
        return self.transform(gather_slots(hidden, index)), gather_slots(labels, index), gather_slots(roles, index)


class LossPipe(nn.Module):
    def __init__(self, config: ModelConfig, layers: ParallelLayers, objective: Objective):
        super().__init__()
        self.layers = layers
        self.objective = objective
        self.bias = nn.Parameter(torch.zeros(config.embedding_rows // layers.tensor_parallel_size))
        self.register_buffer("vocab_padding", vocabulary_padding(config, layers), persistent=False)
        if objective.next_sentence_prediction:
            self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, activations):
        """The objective's metrics vector (metrics.PMLM_METRICS / UNILM_METRICS); only `loss`
        carries gradient. The output bias is added inside the cross entropy, chunk by chunk, so the
        logits stay in the compute dtype (`ParallelLayers.biased_cross_entropy`)."""
        bias = mask_vocabulary_padding(self.bias, self.vocab_padding)
        if self.objective.is_unilm:
            from .unilm import unilm_losses_from_logits

            logits, targets, slot_lm = activations[:3]
            nsp = (self.seq_relationship(activations[3]), activations[4]) if len(activations) == 5 else (None, None)
            return unilm_losses_from_logits(logits, targets, slot_lm, self.layers, *nsp, bias).metrics_with_grad()
        logits, targets, slot_roles = activations
        return pmlm_losses_from_logits(logits, bias, targets, (slot_roles == MASKED) & self.objective.autoencoding,
                                       (slot_roles == PSEUDO) & self.objective.pseudo_masked,
                                       self.layers).metrics_with_grad()


def canonical_parameter_name(pipe_name: str, num_layers: int) -> str:
    """Pipeline parameter name -> the plain model's (HF-style) name."""
    if pipe_name.startswith(f"tied_modules.{TIED_KEY}."):
        return "bert.embeddings." + pipe_name[len(f"tied_modules.{TIED_KEY}."):]
    match = re.match(r"(\d+)\.(.*)", pipe_name)
    if not match:
        raise ValueError(f"unexpected pipeline parameter {pipe_name!r}")
    index, rest = int(match.group(1)), match.group(2)
    if index == 1:
        return ("bert." + rest) if rest.startswith("rel_pos_bias") else "bert.embeddings." + rest
    if 2 <= index <= num_layers + 1:
        return f"bert.encoder.layer.{index - 2}.{rest}"
    if index == num_layers + 2:
        return ("bert." + rest) if rest.startswith("pooler.") else "cls.predictions." + rest
    if index == num_layers + 4:
        return ("cls." + rest) if rest.startswith("seq_relationship.") else "cls.predictions." + rest
    raise ValueError(f"unexpected pipeline parameter {pipe_name!r}")


def build_pipeline_model(config: ModelConfig, objective: Objective, layers: ParallelLayers,
                         num_stages: int, topology, checkpoint_activations: bool = False,
                         init_seed: int = 0, compiled_layers: bool = False):
    """A PipelineModule whose weights equal `PMLMForPreTraining`'s for the same `init_seed`
    (parameter for parameter, see `canonical_parameter_name`). `compiled_layers` (--compile, the
    caller then compiles them): checkpointed layers are recomputed with DeepSpeed's non-reentrant
    checkpoint, whose forward runs with grad, so the recomputation runs the graph the forward ran:
    one compilation per width (the reentrant checkpoint runs the forward without grad: a second
    graph to compile for every width)."""
    deepspeed = import_deepspeed()
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec

    stage_cache = StageCache()  # the layers of one process are one stage

    class PMLMPipeline(PipelineModule):
        """Collects each micro batch's metrics on the last stage for logging; `end_batch` hands them over."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._metrics: list[torch.Tensor] = []

        def end_batch(self) -> list[torch.Tensor]:
            """After `train_batch`/`eval_batch`, on every stage: the metrics of its micro batches (the
            last stage's; empty elsewhere), and the stage's layers let go of what they built."""
            stage_cache.clear()
            metrics, self._metrics = self._metrics, []
            return metrics

    holder: list = []

    def loss_fn(outputs: torch.Tensor, _labels) -> torch.Tensor:
        holder[0]._metrics.append(outputs.detach())
        return outputs[0]

    recompute = (dict(activation_checkpoint_func=deepspeed.checkpointing.non_reentrant_checkpoint)
                 if compiled_layers else {})
    tied = dict(tied_weight_attr=["word_embeddings.weight"])
    specs = [TiedLayerSpec(TIED_KEY, WordEmbeddingPipe, config, layers, objective, **tied),
             LayerSpec(EmbeddingPipe, config, layers)]
    specs += [LayerSpec(LayerPipe, config, layers, stage_cache=stage_cache) for _ in range(config.num_layers)]
    specs += [LayerSpec(HeadTransformPipe, config, objective),
              TiedLayerSpec(TIED_KEY, WordEmbeddingPipe, config, layers, objective,
                            forward_fn=tied_logits_forward(layers), **tied),
              LayerSpec(LossPipe, config, layers, objective)]
    # Built without grad: DeepSpeed broadcasts the tied word embedding from the first stage in place, and
    # that collective, run on a parameter under grad mode, leaves autograd's "not implemented" hook on it
    # (a warning at the first backward that the backprop may be incorrect; it is not: nothing is
    # differentiated through the broadcast).
    with torch.no_grad():
        model = PMLMPipeline(layers=specs, loss_fn=loss_fn, num_stages=num_stages, topology=topology,
                             partition_method="type:LayerPipe", dynamic_shape=True,
                             activation_checkpoint_interval=1 if checkpoint_activations else 0,
                             checkpointable_layers=["LayerPipe"], **recompute)
    holder.append(model)
    initialize_weights(model, config, init_seed, getattr(layers, "tensor_parallel_rank", 0),
                       layers.tensor_parallel_size,
                       canonical_name=lambda name: canonical_parameter_name(name, config.num_layers))
    return model

