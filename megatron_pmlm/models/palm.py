"""PALM (papers/palm, SPEC §9): our BERT encoder, a Transformer decoder, and the paper's
pointer-generator output (Eqs. 2-8).

One model serves both pre-training stages and every tensor-parallel layout:
- `bert` is model.py's BertModel (embeddings + encoder, tensor-parallel through `layers`); its
  attention mask comes from the one roles/steps rule (context and [M] visible, padding not);
- `decoder` layers are post-LayerNorm like the encoder's: causal self-attention (model.py's
  BertAttention under a causal mask), cross-attention to the final encoder states, FFN. The names
  follow Hugging Face's BERT decoder (`attention`, `crossattention`, `intermediate`, `output`), so
  the tensor-parallel split table and the per-name initialisation apply unchanged;
- `cls` is BERT's MLM head (stage 1), tied to the shared word embedding;
- `pointer_generator` mixes P^v = softmax(W^e(W^v s + b^v)) (W^e: the shared embedding) with the
  copy distribution of a separate additive attention over the encoder states, by a learned gate.

Stage 1 trains `bert` + `cls` as a masked LM on the context; stage 2 trains encoder, decoder and
pointer-generator on the continuation's negative log-likelihood. The parts a stage does not use
are frozen (`freeze_for_stage`), so both stages hold the same parameters and a stage-1 checkpoint
loads into stage 2 as it is (`--load DIR --finetune`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ModelConfig
from .layout import IGNORE_INDEX, PAD, pmlm_attention_allowed
from .hidden_dropout import HiddenDropout
from .metrics import MetricSpec
from .model import (BertAttention, BertIntermediate, BertModel, BertOnlyMLMHead, BertSelfAttention, BertSelfOutput,
                    LayerKeyValues, PMLMLosses, initialize_weights, mask_vocabulary_padding, pmlm_losses,
                    vocabulary_padding)
from .objectives import get_objective
from ..parallel import layers as parallel_layers
from ..parallel.layers import LocalLayers, ParallelLayers, chunked_biased_cross_entropy

PALM_STAGES = (1, 2)

COPY_PROBABILITY_FLOOR = 1e-30
"""log P^c(y) of a target absent from the context is log(0); the floor keeps its gradient finite
(zero) without changing any probability that matters next to P^v."""


@dataclass
class PalmConfig(ModelConfig):
    """The encoder's BERT fields (ModelConfig) plus the decoder and the pointer-generator.

    Defaults are PALM BASE (§3.1): 12 + 12 layers, hidden 768, 12 heads, FFN 3072, absolute
    positions (RoBERTa-style, no relative bias)."""

    rel_pos: bool = False
    num_decoder_layers: int = 12
    copy_attention_size: int = 0
    """Width of the copy attention's tanh layer (W^m, W^s, w^c); the paper does not give it
    (0: the hidden size)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_decoder_layers <= 0:
            raise ConfigError(f"model config: num_decoder_layers must be positive, got {self.num_decoder_layers}")
        if self.copy_attention_size < 0:
            raise ConfigError(f"model config: copy_attention_size must be >= 0, got {self.copy_attention_size}")

    @property
    def copy_width(self) -> int:
        return self.copy_attention_size or self.hidden_size


PALM_PRESETS: dict[str, dict] = {
    # PALM BASE (§3.1).
    "palm-base": dict(num_layers=12, num_decoder_layers=12, hidden_size=768, num_attention_heads=12,
                      ffn_hidden_size=3072),
    # For tests and CPU runs.
    "palm-tiny": dict(num_layers=2, num_decoder_layers=2, hidden_size=64, num_attention_heads=4,
                      ffn_hidden_size=256, max_position_embeddings=512),
}


def palm_config_from_preset(preset: str, **overrides) -> PalmConfig:
    """The preset's PalmConfig with `overrides` (None values ignored) applied."""
    if preset not in PALM_PRESETS:
        raise ConfigError(f"unknown PALM preset {preset!r}; choose one of: {', '.join(PALM_PRESETS)}")
    values = {**PALM_PRESETS[preset], **{k: v for k, v in overrides.items() if v is not None}}
    unknown = set(values) - {f.name for f in fields(PalmConfig)}
    if unknown:
        raise ConfigError(f"unknown model config field(s): {', '.join(sorted(unknown))}")
    return PalmConfig(**values)


PALM_MLM_METRICS = MetricSpec(("loss", "mlm_correct", "mlm_count"), (("mlm_acc", "mlm_correct", "mlm_count"),))
PALM_METRICS = MetricSpec(("loss", "token_correct", "token_count", "gate_sum", "copy_sum"),
                          (("token_acc", "token_correct", "token_count"),
                           ("generate_gate", "gate_sum", "token_count"),
                           ("target_copy_prob", "copy_sum", "token_count")))
"""Stage 2: NLL per continuation token, accuracy of argmax P, the mean gate λ (share of the
vocabulary distribution) and the mean copy probability of the gold token."""


def metrics_for_stage(stage: int) -> MetricSpec:
    return PALM_MLM_METRICS if stage == 1 else PALM_METRICS


# ------------------------------------------------------------------------------------- batches

@dataclass
class PalmBatch:
    """One batch: the context for the encoder, the continuation for the decoder; [B, S] / [B, D]."""

    encoder_ids: torch.Tensor
    """[CLS] context [SEP] (stage 1: with its MLM corruption), right-padded."""
    encoder_roles: torch.Tensor
    """CONTEXT, MASKED (stage 1 corrupted slots) or PAD."""
    context_ids: torch.Tensor
    """The uncorrupted context: what the copy distribution scatters onto."""
    mlm_labels: torch.Tensor
    """Original token at MASKED slots, IGNORE_INDEX elsewhere (stage 1)."""
    decoder_ids: torch.Tensor
    """[CLS] continuation, right-padded; [B, 0] in stage 1."""
    labels: torch.Tensor
    """continuation [SEP], IGNORE_INDEX at padding; [B, 0] in stage 1."""
    mlm_index: torch.Tensor | None = None
    """Stage 1: flat indices into [B * S] of the labelled [M] slots (`layout.pmlm_predicted_index`),
    made on the CPU with the batch so the loss gathers them without waiting for the device; None:
    the model derives them (a host-device sync), or stage 2."""

    def to(self, device, non_blocking: bool = False) -> "PalmBatch":
        return PalmBatch(**{f.name: None if getattr(self, f.name) is None else
                            getattr(self, f.name).to(device, non_blocking=non_blocking) for f in fields(self)})

    def as_tuple(self) -> tuple[torch.Tensor, ...]:
        """The model's positional inputs: the six tensors, then `mlm_index` if set."""
        return tuple(getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None)

    def num_tokens(self) -> int:
        """Tokens the model processes (padding excluded)."""
        return int((self.encoder_roles != PAD).sum()) + int((self.labels != IGNORE_INDEX).sum())


# ------------------------------------------------------------------------------------- decoder

def causal_bias(length: int, dtype: torch.dtype, device, offset: int = 0) -> torch.Tensor:
    """[1, 1, length, offset + length]: query i (at absolute position offset + i) sees keys <= it."""
    query = torch.arange(length, device=device)[:, None] + offset
    key = torch.arange(offset + length, device=device)[None, :]
    return torch.zeros(length, offset + length, dtype=dtype, device=device).masked_fill(
        key > query, float("-inf"))[None, None]


def key_padding_bias(key_valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, 1, keys]: 0 where a key may be attended, -inf at padding."""
    return torch.zeros(key_valid.shape, dtype=dtype, device=key_valid.device).masked_fill(
        ~key_valid, float("-inf"))[:, None, None]


class CrossSelfAttention(BertSelfAttention):
    """Queries from the decoder, keys and values from the encoder states; heads split under TP
    (BertSelfAttention's projections and head split, another forward; key and value as one GEMM)."""

    def encoder_keys_values(self, encoder_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Computed once per sequence when decoding."""
        return self._project(encoder_hidden, self.key, self.value)

    def forward(self, hidden, encoder_hidden, encoder_bias, keys_values=None) -> torch.Tensor:
        key, value = keys_values if keys_values is not None else self.encoder_keys_values(encoder_hidden)
        context = F.scaled_dot_product_attention(
            self._split_heads(self.query(hidden)), key, value, attn_mask=encoder_bias,
            dropout_p=self.dropout_p if self.training else 0.0)
        batch, _, length, _ = context.shape
        return context.transpose(1, 2).reshape(batch, length, -1)


class CrossAttention(nn.Module):
    def __init__(self, config: PalmConfig, layers: ParallelLayers):
        super().__init__()
        self.self = CrossSelfAttention(config, layers)
        self.output = BertSelfOutput(config, layers, config.hidden_size)

    def forward(self, hidden, encoder_hidden, encoder_bias, keys_values=None):
        return self.output(self.self(hidden, encoder_hidden, encoder_bias, keys_values), hidden)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention to the final encoder states, FFN (post-LayerNorm)."""

    def __init__(self, config: PalmConfig, layers: ParallelLayers):
        super().__init__()
        self.attention = BertAttention(config, layers)
        self.crossattention = CrossAttention(config, layers)
        self.intermediate = BertIntermediate(config, layers)
        self.output = BertSelfOutput(config, layers, config.ffn_hidden_size)

    def forward(self, hidden, self_bias, encoder_hidden, encoder_bias, cache=None, encoder_keys_values=None):
        attended = self.attention(hidden, self_bias, cache)
        attended = self.crossattention(attended, encoder_hidden, encoder_bias, encoder_keys_values)
        return self.output(self.intermediate(attended), attended)


def shared_embedding_lookup(weight: torch.Tensor, input_ids: torch.Tensor, layers: ParallelLayers) -> torch.Tensor:
    """Rows of the (vocabulary-split) word embedding, as megatron-core's VocabParallelEmbedding
    computes them, but from its weight: calling the encoder's embedding module a second time per
    forward would confuse ZeRO-3's parameter hooks."""
    if layers.tensor_parallel_size == 1:
        return F.embedding(input_ids, weight)
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    local = input_ids - layers.tensor_parallel_rank * weight.shape[0]
    inside = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(torch.where(inside, local, 0), weight) * inside[..., None]
    return reduce_from_tensor_model_parallel_region(rows)


class DecoderEmbeddings(nn.Module):
    """The shared word embedding (its weight passed in) plus the decoder's own positions and LayerNorm."""

    def __init__(self, config: PalmConfig, layers: ParallelLayers):
        super().__init__()
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layernorm_epsilon)
        self.dropout = HiddenDropout(config.hidden_dropout)
        self.layers = layers

    def forward(self, word_embedding_weight: torch.Tensor, input_ids, position_ids):
        words = shared_embedding_lookup(word_embedding_weight, input_ids, self.layers)
        return self.dropout(self.LayerNorm(words + self.position_embeddings(position_ids)))


class PalmDecoder(nn.Module):
    def __init__(self, config: PalmConfig, layers: ParallelLayers):
        super().__init__()
        self.embeddings = DecoderEmbeddings(config, layers)
        self.layer = nn.ModuleList(DecoderLayer(config, layers) for _ in range(config.num_decoder_layers))
        self.checkpoint_activations = False

    def embed(self, word_embedding_weight, input_ids, context_valid) -> tuple[torch.Tensor, ...]:
        """The continuation's embeddings, its causal self-attention bias and the cross-attention's
        key padding bias over the context (in the embeddings' dtype, which is the encoder's)."""
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device)[None].expand_as(input_ids)
        hidden = self.embeddings(word_embedding_weight, input_ids, positions)
        return hidden, causal_bias(length, hidden.dtype, hidden.device), key_padding_bias(context_valid, hidden.dtype)

    def forward(self, word_embedding_weight, input_ids, encoder_hidden, context_valid) -> torch.Tensor:
        """`context_valid`: [B, S], False at the context's padding (unseen by the cross-attention)."""
        hidden, bias, encoder_bias = self.embed(word_embedding_weight, input_ids, context_valid)
        for layer in self.layer:
            if self.checkpoint_activations and self.training:
                hidden = torch.utils.checkpoint.checkpoint(layer, hidden, bias, encoder_hidden, encoder_bias,
                                                           use_reentrant=False)
            else:
                hidden = layer(hidden, bias, encoder_hidden, encoder_bias)
        return hidden


# ------------------------------------------------------------------------------ pointer-generator

@dataclass
class CopyMixture:
    """The pieces of P(w) = λ P^v(w) + (1 - λ) P^c(w) at every decoder position."""

    vocab_logits: torch.Tensor
    """[B, D, V / tp]: W^e(W^v s + b^v) (this rank's vocabulary slice), padding rows at -inf."""
    copy_attention: torch.Tensor
    """[B, D, S]: α, the copy attention over the context (0 at padding)."""
    log_gate: torch.Tensor
    """[B, D]: log λ (logsigmoid of the gate logit); log(1 - λ) = log_gate_complement."""
    log_gate_complement: torch.Tensor


class PointerGenerator(nn.Module):
    """PALM Eqs. 2-8 (SPEC §9). Replicated across tensor-parallel ranks except the vocabulary
    projection W^e, which is the (split) shared word embedding."""

    def __init__(self, config: PalmConfig, layers: ParallelLayers):
        super().__init__()
        hidden, width = config.hidden_size, config.copy_width
        self.vocab_projection = nn.Linear(hidden, hidden)  # W^v, b^v
        self.copy_memory = nn.Linear(hidden, width, bias=False)  # W^m
        self.copy_query = nn.Linear(hidden, width)  # W^s, b^c
        self.copy_score = nn.Linear(width, 1, bias=False)  # w^c
        self.gate = nn.Linear(2 * hidden, 1)  # [w^z; w^s], b^m
        self.register_buffer("vocab_padding", vocabulary_padding(config, layers), persistent=False)
        self.layers = layers

    def memory(self, encoder_hidden: torch.Tensor) -> torch.Tensor:
        """W^m h_l, once per context (decoding reuses it every step)."""
        return self.copy_memory(encoder_hidden)

    def forward(self, decoder_hidden, encoder_hidden, context_valid, word_embedding_weight,
                memory: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """CopyMixture's fields as a tuple (ZeRO-3 hooks the backward of tensors and tuples, not of
        dataclasses)."""
        memory = self.memory(encoder_hidden) if memory is None else memory
        vocab_logits = self.layers.tied_logits(self.vocab_projection(decoder_hidden), word_embedding_weight)
        vocab_logits = mask_vocabulary_padding(vocab_logits, self.vocab_padding)  # stays in the compute dtype
        # e_tl = w^c . tanh(W^m h_l + W^s s_t + b^c): [B, D, S].
        scores = self.copy_score(torch.tanh(memory[:, None] + self.copy_query(decoder_hidden)[:, :, None]))[..., 0]
        scores = scores.masked_fill(~context_valid[:, None], float("-inf"))
        attention = torch.softmax(scores.float(), dim=-1).to(decoder_hidden.dtype)
        attended = attention @ encoder_hidden  # z_t
        gate_logit = self.gate(torch.cat([attended, decoder_hidden], -1))[..., 0].float()
        return vocab_logits, attention, F.logsigmoid(gate_logit), F.logsigmoid(-gate_logit)


def copy_probability(attention: torch.Tensor, context_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """P^c(y_t) = Σ_{l: x_l = y_t} α_tl, [B, D]."""
    return (attention.float() * (context_ids[:, None, :] == targets[:, :, None])).sum(-1)


def scatter_copy(attention: torch.Tensor, context_ids: torch.Tensor, vocab_size: int,
                 first_id: int = 0) -> torch.Tensor:
    """P^c over token ids [first_id, first_id + vocab_size): α scattered onto the context's ids."""
    local = context_ids - first_id
    inside = (local >= 0) & (local < vocab_size)
    index = torch.where(inside, local, 0)[:, None, :].expand_as(attention)
    source = attention.float() * inside[:, None, :]
    out = torch.zeros(*attention.shape[:2], vocab_size, dtype=torch.float32, device=attention.device)
    return out.scatter_add_(-1, index, source)


def vocab_log_probability(logits: torch.Tensor, targets: torch.Tensor, layers: ParallelLayers) -> torch.Tensor:
    """log P^v(y) for targets over a vocabulary split across tensor-parallel ranks (fp32).

    The max is agreed on (no gradient), the partition function and the target's exp are summed
    over ranks by megatron's reduce_from_tensor_model_parallel_region (backward: identity), so each
    rank's slice gets exactly its part of the gradient, as in vocab_parallel_cross_entropy.
    Tensor parallel size 1: minus the chunked cross entropy, the logits in the compute dtype and no
    fp32 [tokens, vocab] tensor kept for the backward."""
    if layers.tensor_parallel_size == 1:
        token_losses, _ = chunked_biased_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                       None)
        return -token_losses.view(targets.shape)
    logits = logits.float()
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    group = parallel_state.get_tensor_model_parallel_group()
    maximum = logits.detach().max(-1).values
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    shifted = logits - maximum[..., None]
    per_rank = logits.shape[-1]
    local = targets - layers.tensor_parallel_rank * per_rank
    inside = (local >= 0) & (local < per_rank)
    target_logit = shifted.gather(-1, torch.where(inside, local, 0)[..., None])[..., 0]
    target_exp = torch.where(inside, target_logit.exp(), torch.zeros_like(target_logit))
    partition = reduce_from_tensor_model_parallel_region(shifted.exp().sum(-1))
    return torch.log(reduce_from_tensor_model_parallel_region(target_exp)) - torch.log(partition)


# ------------------------------------------------------------------------------------- the model

@dataclass
class PalmLosses:
    """Stage 2's loss and counters (metrics.PALM_METRICS order)."""

    loss: torch.Tensor
    token_correct: torch.Tensor
    token_count: torch.Tensor
    gate_sum: torch.Tensor
    copy_sum: torch.Tensor

    def metrics(self) -> torch.Tensor:
        return torch.stack([self.loss.detach().float(), self.token_correct.float(), self.token_count.float(),
                            self.gate_sum.detach().float(), self.copy_sum.detach().float()])


@dataclass
class PalmMLMLosses:
    """Stage 1's masked-LM loss and accuracy counters (metrics.PALM_MLM_METRICS order)."""

    loss: torch.Tensor
    mlm_correct: torch.Tensor
    mlm_count: torch.Tensor

    @classmethod
    def from_pmlm(cls, losses: PMLMLosses) -> "PalmMLMLosses":
        return cls(losses.loss_ae, losses.ae_correct, losses.ae_count)

    def metrics(self) -> torch.Tensor:
        return torch.stack([self.loss.detach().float(), self.mlm_correct.float(), self.mlm_count.float()])


class PalmForPreTraining(nn.Module):
    """PALM's encoder-decoder with the pointer-generator; `forward(*PalmBatch.as_tuple())` returns
    the loss of `stage` (1: masked LM on the context, 2: continuation NLL under P)."""

    def __init__(self, config: PalmConfig, layers: ParallelLayers | None = None, stage: int = 2,
                 init_seed: int = 0):
        super().__init__()
        if stage not in PALM_STAGES:
            raise ConfigError(f"--palm-stage must be 1 or 2, got {stage}")
        self.layers = layers or LocalLayers()
        self.config = config
        self.stage = stage
        self.bert = BertModel(config, self.layers, pmlm_attention_allowed)
        self.cls = BertOnlyMLMHead(config, self.layers)
        self.decoder = PalmDecoder(config, self.layers)
        self.pointer_generator = PointerGenerator(config, self.layers)
        initialize_weights(self, config, init_seed, self.layers.tensor_parallel_rank,
                           self.layers.tensor_parallel_size)
        self.freeze_for_stage(stage)

    def freeze_for_stage(self, stage: int) -> None:
        """Only the parts a stage trains take gradients (and the optimizer's weight decay): stage 1
        the encoder and MLM head, stage 2 the encoder, decoder and pointer-generator."""
        frozen = (self.decoder, self.pointer_generator) if stage == 1 else (self.cls,)
        for module in (self.bert, self.cls, self.decoder, self.pointer_generator):
            for param in module.parameters():
                param.requires_grad_(module not in frozen)
        self.stage = stage

    @property
    def word_embeddings(self) -> nn.Module:
        return self.bert.embeddings.word_embeddings

    def zero3_external_parameters(self) -> list[tuple[nn.Module, nn.Parameter]]:
        """(module, parameter) pairs ZeRO-3 must be told of, a module reading a parameter another
        module owns: the tied MLM softmax, the decoder's input and W^e of the vocabulary
        distribution read the word embedding's weight."""
        weight = self.word_embeddings.weight
        return [(self.cls.predictions, weight), (self.decoder.embeddings, weight), (self.pointer_generator, weight)]

    def encode(self, encoder_ids, encoder_roles, padded: bool = False) -> torch.Tensor:
        """Final encoder states [B, S]; context and [M] slots see each other, padding is unseen.
        `padded`: at the encoder's padded width instead (`BertModel.padded_forward`: a multiple of
        the layout quantum, 16 under --compile), the extra slots PAD like the context's own padding."""
        # Contiguous positions: a compiled embed region is guarded on strides, and the padded ones are.
        positions = torch.arange(encoder_ids.shape[1], device=encoder_ids.device).repeat(encoder_ids.shape[0], 1)
        inputs = (encoder_ids, positions, torch.zeros_like(encoder_ids), encoder_roles, torch.zeros_like(encoder_ids))
        return self.bert.padded_forward(*inputs) if padded else self.bert(*inputs)

    def mixture(self, encoder_hidden, encoder_roles, decoder_ids) -> CopyMixture:
        context_valid = encoder_roles != PAD
        decoder_hidden = self.decoder(self.word_embeddings.weight, decoder_ids, encoder_hidden, context_valid)
        return CopyMixture(*self.pointer_generator(decoder_hidden, encoder_hidden, context_valid,
                                                   self.word_embeddings.weight))

    def forward(self, encoder_ids, encoder_roles, context_ids, mlm_labels, decoder_ids, labels, mlm_index=None):
        """`mlm_index`: `PalmBatch.mlm_index` (stage 1; None: derived here, a host-device sync)."""
        if self.stage == 1:
            encoder_hidden = self.encode(encoder_ids, encoder_roles)
            mlm_head = lambda hidden: self.cls.predictions.logits_and_bias(hidden, self.word_embeddings.weight)  # noqa: E731
            return PalmMLMLosses.from_pmlm(pmlm_losses(encoder_hidden, encoder_roles, mlm_labels,
                                                       get_objective("ae"), mlm_head, self.layers, mlm_index))
        # Stage 2 reads the encoder at its padded width (no cut: under --compile the decoder layers and
        # the pointer-generator then always get a contiguous context), its extra slots PAD.
        encoder_hidden = self.encode(encoder_ids, encoder_roles, padded=True)
        extra = encoder_hidden.shape[1] - encoder_ids.shape[1]
        if extra:
            encoder_roles = F.pad(encoder_roles, (0, extra), value=PAD)
            context_ids = F.pad(context_ids, (0, extra), value=0)
        return self.losses(self.mixture(encoder_hidden, encoder_roles, decoder_ids), context_ids, labels)

    def losses(self, mixture: CopyMixture, context_ids, labels) -> PalmLosses:
        """Stage 2's loss and metrics from the mixture (`continuation_losses`; one region under --compile)."""
        return continuation_losses(mixture, context_ids, labels, self.layers)

    def distribution(self, encoder_ids, encoder_roles, context_ids, decoder_ids) -> torch.Tensor:
        """The final P(w) over the vocabulary at every decoder position, [B, D, vocab_size]
        (tensor parallel size 1: inspection, tests and decoding)."""
        if self.layers.tensor_parallel_size != 1:
            raise ConfigError("PalmForPreTraining.distribution needs the whole vocabulary (tensor parallel size 1)")
        mixture = self.mixture(self.encode(encoder_ids, encoder_roles), encoder_roles, decoder_ids)
        return final_distribution(mixture, context_ids)[..., :self.config.vocab_size]


def vocab_probabilities(logits: torch.Tensor, layers: ParallelLayers) -> torch.Tensor:
    """P^v over this rank's vocabulary slice, normalised over the whole vocabulary (fp32; no
    gradient through the cross-rank reductions: for metrics and decoding)."""
    logits = logits.float()
    if layers.tensor_parallel_size == 1:
        return torch.softmax(logits, -1)
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_tensor_model_parallel_group()
    maximum = logits.detach().max(-1).values
    dist.all_reduce(maximum, op=dist.ReduceOp.MAX, group=group)
    exp = (logits - maximum[..., None]).exp()
    partition = exp.sum(-1).detach()
    dist.all_reduce(partition, group=group)
    return exp / partition[..., None]


def final_distribution(mixture: CopyMixture, context_ids: torch.Tensor,
                       layers: ParallelLayers | None = None) -> torch.Tensor:
    """P = λ P^v + (1 - λ) P^c over this rank's vocabulary slice, [B, D, V / tp] (fp32). Without
    autograd (metrics, decoding) the products and the sum are made in place, in P^v's and P^c's
    tensors: the same values, two fp32 [B, D, V] tensors instead of five."""
    layers = layers or LocalLayers()
    per_rank = mixture.vocab_logits.shape[-1]
    vocab = vocab_probabilities(mixture.vocab_logits, layers)
    copy = scatter_copy(mixture.copy_attention, context_ids, per_rank, layers.tensor_parallel_rank * per_rank)
    gate, complement = mixture.log_gate.exp()[..., None], mixture.log_gate_complement.exp()[..., None]
    if torch.is_grad_enabled() and (vocab.requires_grad or copy.requires_grad or gate.requires_grad):
        return gate * vocab + complement * copy
    return vocab.mul_(gate).add_(copy.mul_(complement))


def predicted_ids(mixture: CopyMixture, context_ids: torch.Tensor, layers: ParallelLayers,
                  chunk_rows: int | None = None) -> torch.Tensor:
    """argmax_w P(w) over the whole (possibly split) vocabulary, [B, D]. Tensor parallel size 1:
    `chunk_rows` (None: CROSS_ENTROPY_CHUNK_ROWS) decoder positions at a time, so P's fp32
    [positions, vocab] tensors are one chunk's, as in the loss."""
    if layers.tensor_parallel_size != 1:
        return layers.predicted_ids(final_distribution(mixture, context_ids, layers))
    batch, steps = mixture.log_gate.shape
    rows = batch * steps
    chunk_rows = chunk_rows or parallel_layers.CROSS_ENTROPY_CHUNK_ROWS
    flat = [field.reshape(rows, 1, *field.shape[2:]) for field in
            (mixture.vocab_logits, mixture.copy_attention, mixture.log_gate, mixture.log_gate_complement)]
    predicted = torch.empty(rows, dtype=torch.long, device=context_ids.device)
    positions = torch.arange(rows, device=context_ids.device)
    for part in parallel_layers.row_chunks(rows, chunk_rows):  # positions as a batch of one-step sequences
        chunk = CopyMixture(*(field[part] for field in flat))
        predicted[part] = layers.predicted_ids(final_distribution(chunk, context_ids[positions[part] // steps],
                                                                  layers))[:, 0]
    return predicted.view(batch, steps)


def continuation_losses(mixture: CopyMixture, context_ids, labels, layers: ParallelLayers) -> PalmLosses:
    """L = -Σ_t log P(y_t | y_<t, x) averaged over the continuation's tokens, with
    log P = logaddexp(log λ + log P^v(y), log(1 - λ) + log P^c(y))."""
    valid = labels != IGNORE_INDEX
    targets = torch.where(valid, labels, 0)
    log_vocab = vocab_log_probability(mixture.vocab_logits, targets, layers)
    copy = copy_probability(mixture.copy_attention, context_ids, targets)
    log_p = torch.logaddexp(mixture.log_gate + log_vocab,
                            mixture.log_gate_complement + torch.log(copy.clamp_min(COPY_PROBABILITY_FLOOR)))
    count = valid.sum()
    loss = -(log_p * valid).sum() / count.clamp(min=1)
    with torch.no_grad():
        predicted = predicted_ids(mixture, context_ids, layers)
        correct = ((predicted == targets) & valid).sum()
        gate_sum = (mixture.log_gate.exp() * valid).sum()
        copy_sum = (copy * valid).sum()
    return PalmLosses(loss, correct, count, gate_sum, copy_sum)


# ------------------------------------------------------------------------------------- decoding

@dataclass
class PalmDecodingState:
    """What incremental decoding keeps per row (hypothesis): the encoder's outputs, each decoder
    layer's cross-attention keys/values (computed once) and self-attention keys/values so far."""

    encoder_hidden: torch.Tensor
    context_ids: torch.Tensor
    context_valid: torch.Tensor
    encoder_bias: torch.Tensor
    memory: torch.Tensor
    """W^m h_l of the copy attention."""
    cross_keys_values: list[tuple[torch.Tensor, torch.Tensor]]
    self_caches: list[LayerKeyValues]
    length: int = 0
    """Decoder tokens fed so far (the next one's position)."""

    def reorder(self, index: torch.Tensor) -> None:
        """Rows become rows `index` (beam replication and back-pointers)."""
        pick = lambda t: t.index_select(0, index)  # noqa: E731
        self.encoder_hidden, self.context_ids, self.context_valid, self.encoder_bias, self.memory = (
            pick(t) for t in (self.encoder_hidden, self.context_ids, self.context_valid, self.encoder_bias,
                              self.memory))
        self.cross_keys_values = [(pick(k), pick(v)) for k, v in self.cross_keys_values]
        for cache in self.self_caches:
            cache.key, cache.value = pick(cache.key), pick(cache.value)


@torch.no_grad()
def start_decoding(model: PalmForPreTraining, encoder_ids, encoder_roles, context_ids) -> PalmDecodingState:
    """Run the encoder once; the state `next_log_probs` extends one token at a time."""
    encoder_hidden = model.encode(encoder_ids, encoder_roles)
    context_valid = encoder_roles != PAD
    cross = [layer.crossattention.self.encoder_keys_values(encoder_hidden) for layer in model.decoder.layer]
    return PalmDecodingState(encoder_hidden, context_ids, context_valid,
                             key_padding_bias(context_valid, encoder_hidden.dtype),
                             model.pointer_generator.memory(encoder_hidden), cross,
                             [LayerKeyValues() for _ in model.decoder.layer])


@torch.no_grad()
def next_log_probs(model: PalmForPreTraining, state: PalmDecodingState, input_ids: torch.Tensor) -> torch.Tensor:
    """log P(w) [rows, vocab_size] of the token after `input_ids` [rows] (the last one fed), under
    the copy mixture; equal to the full forward's last position (tensor parallel size 1)."""
    positions = torch.full_like(input_ids[:, None], state.length)
    hidden = model.decoder.embeddings(model.word_embeddings.weight, input_ids[:, None], positions)
    for layer, cache, keys_values in zip(model.decoder.layer, state.self_caches, state.cross_keys_values):
        # One new query sees every cached key and itself: no mask needed.
        hidden = layer(hidden, None, state.encoder_hidden, state.encoder_bias, cache, keys_values)
        cache.key = cache.new_key if cache.key is None else torch.cat([cache.key, cache.new_key], 2)
        cache.value = cache.new_value if cache.value is None else torch.cat([cache.value, cache.new_value], 2)
        cache.new_key = cache.new_value = None
    state.length += 1
    mixture = CopyMixture(*model.pointer_generator(hidden, state.encoder_hidden, state.context_valid,
                                                   model.word_embeddings.weight, memory=state.memory))
    probabilities = final_distribution(mixture, state.context_ids)[:, 0, :model.config.vocab_size]
    return torch.log(probabilities.clamp_min(COPY_PROBABILITY_FLOOR))
