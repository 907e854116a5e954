"""Hugging Face model of a PALM checkpoint (papers/palm): a BERT encoder, a Transformer decoder and
the pointer-generator output (Eqs. 2-8).

Written into every converted PALM folder (remote code, config.json's `auto_map`): with
`trust_remote_code=True`, `AutoModel` gives `PalmForConditionalGeneration`. The weights keep
megatron_pmlm's names: `bert.*` (transformers' BertModel, absolute positions), `cls.predictions.*`
(the stage-1 MLM head, tied to the word embedding), `decoder.embeddings.{position_embeddings,
LayerNorm}` (the decoder reads the shared word embedding), `decoder.layer.N.{attention,
crossattention, intermediate, output}` (post-LayerNorm, causal self-attention, cross-attention to
the final encoder states) and `pointer_generator.*`:

    P^v = softmax(E (W^v s_t + b^v))                           vocab_projection, E = word embedding
    e_tl = w^c . tanh(W^m h_l + W^s s_t + b^c), α = softmax_l  copy_memory, copy_query, copy_score
    λ = sigmoid(w^z . z_t + w^s . s_t + b^m), z_t = Σ_l α_tl h_l   gate
    P(w) = λ P^v(w) + (1 - λ) Σ_{l: x_l = w} α_tl

`forward(input_ids, attention_mask, decoder_input_ids, labels=None)` returns the final distribution
`probabilities` [B, D, V] and its pieces; with `labels` (-100 ignored) the mean NLL as `loss`.
Written against transformers 5.x, plain torch below the encoder.
"""

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.bert.modeling_bert import BertModel, BertPreTrainedModel
from transformers.utils import ModelOutput

from .configuration_palm import PalmConfig

COPY_PROBABILITY_FLOOR = 1e-30


class PalmAttentionHeads(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = config.attention_probs_dropout_prob

    def _split(self, x):
        batch, length, hidden = x.shape
        return x.view(batch, length, self.num_heads, hidden // self.num_heads).transpose(1, 2)

    def forward(self, hidden, keys_from, bias):
        context = F.scaled_dot_product_attention(
            self._split(self.query(hidden)), self._split(self.key(keys_from)), self._split(self.value(keys_from)),
            attn_mask=bias, dropout_p=self.dropout if self.training else 0.0)
        batch, _, length, _ = context.shape
        return context.transpose(1, 2).reshape(batch, length, -1)


class PalmOutputBlock(nn.Module):
    """dense + dropout + residual + LayerNorm."""

    def __init__(self, config, in_features):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden, residual):
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class PalmAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = PalmAttentionHeads(config)
        self.output = PalmOutputBlock(config, config.hidden_size)

    def forward(self, hidden, keys_from, bias):
        return self.output(self.self(hidden, keys_from, bias), hidden)


class PalmIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, hidden):
        return F.gelu(self.dense(hidden))


class PalmDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = PalmAttention(config)
        self.crossattention = PalmAttention(config)
        self.intermediate = PalmIntermediate(config)
        self.output = PalmOutputBlock(config, config.intermediate_size)

    def forward(self, hidden, causal_bias, encoder_hidden, encoder_bias):
        attended = self.attention(hidden, hidden, causal_bias)
        attended = self.crossattention(attended, encoder_hidden, encoder_bias)
        return self.output(self.intermediate(attended), attended)


class PalmDecoderEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, word_embeddings, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        return self.dropout(self.LayerNorm(word_embeddings(input_ids) + self.position_embeddings(positions)))


class PalmDecoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embeddings = PalmDecoderEmbeddings(config)
        self.layer = nn.ModuleList(PalmDecoderLayer(config) for _ in range(config.num_decoder_layers))


class PalmPointerGenerator(nn.Module):
    def __init__(self, config):
        super().__init__()
        hidden, width = config.hidden_size, config.copy_attention_size or config.hidden_size
        self.vocab_projection = nn.Linear(hidden, hidden)
        self.copy_memory = nn.Linear(hidden, width, bias=False)
        self.copy_query = nn.Linear(hidden, width)
        self.copy_score = nn.Linear(width, 1, bias=False)
        self.gate = nn.Linear(2 * hidden, 1)


class PalmPredictionTransform(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class PalmMLMPredictions(nn.Module):
    """BERT's MLM head; its decoder is the word embedding (not stored)."""

    def __init__(self, config):
        super().__init__()
        self.transform = PalmPredictionTransform(config)
        self.bias = nn.Parameter(torch.zeros(config.vocab_size))


class PalmMLMHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.predictions = PalmMLMPredictions(config)


@dataclass
class PalmOutput(ModelOutput):
    loss: Optional[torch.Tensor] = None
    probabilities: Optional[torch.Tensor] = None
    """P(w) at every decoder position, [B, D, V]."""
    vocab_logits: Optional[torch.Tensor] = None
    copy_attention: Optional[torch.Tensor] = None
    gate: Optional[torch.Tensor] = None
    """λ, the weight of the vocabulary distribution, [B, D]."""
    encoder_hidden_state: Optional[torch.Tensor] = None


class PalmForConditionalGeneration(BertPreTrainedModel):
    config_class = PalmConfig

    def __init__(self, config):
        super().__init__(config)
        self.bert = BertModel(config, add_pooling_layer=False)
        self.cls = PalmMLMHead(config)
        self.decoder = PalmDecoder(config)
        self.pointer_generator = PalmPointerGenerator(config)
        self.post_init()

    def encode(self, input_ids, attention_mask=None):
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                         token_type_ids=torch.zeros_like(input_ids)).last_hidden_state

    def mlm_logits(self, input_ids, attention_mask=None):
        """Stage 1's masked-LM logits over the vocabulary, [B, S, V]."""
        predictions = self.cls.predictions
        transform = predictions.transform
        hidden = transform.LayerNorm(F.gelu(transform.dense(self.encode(input_ids, attention_mask))))
        return F.linear(hidden, self.bert.embeddings.word_embeddings.weight) + predictions.bias

    def forward(self, input_ids, attention_mask=None, decoder_input_ids=None, labels=None, **kwargs):
        attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        encoder_hidden = self.encode(input_ids, attention_mask)
        dtype = encoder_hidden.dtype
        context_valid = attention_mask.bool()
        encoder_bias = torch.zeros(context_valid.shape, dtype=dtype, device=input_ids.device).masked_fill(
            ~context_valid, float("-inf"))[:, None, None]
        length = decoder_input_ids.shape[1]
        causal = torch.ones(length, length, dtype=torch.bool, device=input_ids.device).tril()
        causal_bias = torch.zeros(length, length, dtype=dtype, device=input_ids.device).masked_fill(
            ~causal, float("-inf"))[None, None]
        word_embeddings = self.bert.embeddings.word_embeddings
        hidden = self.decoder.embeddings(word_embeddings, decoder_input_ids)
        for layer in self.decoder.layer:
            hidden = layer(hidden, causal_bias, encoder_hidden, encoder_bias)
        pg = self.pointer_generator
        vocab_logits = F.linear(pg.vocab_projection(hidden), word_embeddings.weight)
        scores = pg.copy_score(torch.tanh(pg.copy_memory(encoder_hidden)[:, None]
                                          + pg.copy_query(hidden)[:, :, None]))[..., 0]
        attention = torch.softmax(scores.masked_fill(~context_valid[:, None], float("-inf")).float(), -1).to(dtype)
        gate = torch.sigmoid(pg.gate(torch.cat([attention @ encoder_hidden, hidden], -1))[..., 0].float())
        copy = torch.zeros(*attention.shape[:2], vocab_logits.shape[-1], dtype=torch.float32, device=input_ids.device)
        copy.scatter_add_(-1, input_ids[:, None, :].expand_as(attention), attention.float())
        probabilities = gate[..., None] * torch.softmax(vocab_logits.float(), -1) + (1 - gate[..., None]) * copy
        loss = None
        if labels is not None:
            valid = labels != -100
            picked = probabilities.gather(-1, torch.where(valid, labels, 0)[..., None])[..., 0]
            loss = -(torch.log(picked.clamp_min(COPY_PROBABILITY_FLOOR)) * valid).sum() / valid.sum().clamp(min=1)
        return PalmOutput(loss=loss, probabilities=probabilities, vocab_logits=vocab_logits,
                          copy_attention=attention, gate=gate, encoder_hidden_state=encoder_hidden)
