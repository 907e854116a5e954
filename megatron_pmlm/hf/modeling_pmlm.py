"""Hugging Face model of a PMLM (UniLMv2) checkpoint: BERT plus one shared relative position bias.

Written into every converted folder (remote code, config.json's `auto_map`): with
`trust_remote_code=True`, `AutoModel` gives `PMLMBertModel`, `AutoModelForMaskedLM` `PMLMForMaskedLM`,
and the fine-tuning heads `AutoModelFor{PreTraining, SequenceClassification, QuestionAnswering,
TokenClassification, MultipleChoice}` give `PMLMFor...`: transformers' own `BertFor...` classes (same
module names: `bert`, `bert.pooler`, `dropout`, `classifier`, `qa_outputs`, `cls`; same forward,
losses and outputs) over `PMLMBertModel`, so the bias is applied in every layer. A plain `Bert*`
class reading such a folder drops `bert.rel_pos_bias.weight` (reported as unexpected). The weights
keep BERT's names plus `bert.rel_pos_bias.weight` [heads, bins] (a bias-free Linear from one-hot
distance buckets to heads, as in the released UniLMv2 s2s-ft code). The bias is computed once per
forward from the position ids (relative distance = position[key] - position[query], T5
bidirectional buckets) and added to the attention scores of every layer, with the padding mask.
Written against transformers 5.x (eager and sdpa attention).
"""

import math

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions
from transformers.models.bert.modeling_bert import (BertEmbeddings, BertEncoder, BertForMaskedLM,
                                                    BertForMultipleChoice, BertForPreTraining,
                                                    BertForQuestionAnswering, BertForSequenceClassification,
                                                    BertForTokenClassification, BertModel, BertOnlyMLMHead,
                                                    BertPooler, BertPreTrainedModel, BertPreTrainingHeads)

from .configuration_pmlm import PMLMConfig

try:  # transformers 5.x: records hidden_states / attentions with hooks, handles return_dict
    from transformers.utils.output_capturing import capture_outputs
except ImportError:  # pragma: no cover - other transformers versions
    def capture_outputs(func):
        def wrapper(self, *args, **kwargs):
            for key in ("return_dict", "output_attentions", "output_hidden_states"):
                kwargs.pop(key, None)
            return func(self, *args, **kwargs)
        return wrapper


def relative_position_bucket(relative_position, num_buckets=32, max_distance=128):
    """T5's bidirectional bucketing of key - query distances, exactly as megatron_pmlm.models.relative_bias's.

    Half the buckets per direction (keys after the query are offset by num_buckets/2); within a
    direction distances below num_buckets/4 are exact, larger ones log-spaced up to max_distance.
    """
    half = num_buckets // 2
    bucket = (relative_position > 0).long() * half
    distance = relative_position.abs()
    max_exact = half // 2
    log_ratio = torch.log(distance.float().clamp(min=1) / max_exact) / math.log(max_distance / max_exact)
    large = max_exact + (log_ratio * (half - max_exact)).long()
    large = large.clamp(max=half - 1)
    return bucket + torch.where(distance < max_exact, distance, large)


# A converted folder holds the pre-training heads (MLM, and next-sentence where the checkpoint had
# one); the encoder alone and the fine-tuning heads do not use them: not worth a load report line.
PRETRAINING_HEAD_KEYS = [r"^cls\."]
NEXT_SENTENCE_KEYS = [r"^cls\.seq_relationship\.", r"^bert\.pooler\."]


class PMLMBertModel(BertModel):
    """BertModel whose attention scores get the relative position bias (shared by all layers)."""

    config_class = PMLMConfig
    _keys_to_ignore_on_load_unexpected = PRETRAINING_HEAD_KEYS
    _supports_flash_attn = False  # the bias is a dense additive [B, heads, T, T] tensor
    _supports_flex_attn = False
    # The heads average their loss themselves: Trainer must not rescale it by the item count.
    accepts_loss_kwargs = False

    def __init__(self, config, add_pooling_layer=True):
        BertPreTrainedModel.__init__(self, config)
        self.config = config
        self.gradient_checkpointing = False
        self.embeddings = BertEmbeddings(config)
        self.rel_pos_bias = nn.Linear(config.rel_pos_bins, config.num_attention_heads, bias=False)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config) if add_pooling_layer else None
        self.post_init()

    def relative_position_bias(self, position_ids):
        """[B, heads, T, T] from position ids [B or 1, T]."""
        relative = position_ids[:, None, :] - position_ids[:, :, None]  # key - query
        buckets = relative_position_bucket(relative, self.config.rel_pos_bins, self.config.max_rel_pos)
        return nn.functional.embedding(buckets, self.rel_pos_bias.weight.t()).permute(0, 3, 1, 2)

    @capture_outputs
    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None,
                inputs_embeds=None, **kwargs):
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        for unsupported in ("encoder_hidden_states", "past_key_values"):
            if kwargs.pop(unsupported, None) is not None:
                raise ValueError(f"PMLMBertModel is a bidirectional encoder: {unsupported} is not supported")
        kwargs.pop("encoder_attention_mask", None)
        kwargs.pop("use_cache", None)
        embedding_output = self.embeddings(input_ids=input_ids, position_ids=position_ids,
                                           token_type_ids=token_type_ids, inputs_embeds=inputs_embeds)
        batch, length = embedding_output.shape[:2]
        if position_ids is None:
            position_ids = torch.arange(length, device=embedding_output.device)[None]
        dtype = embedding_output.dtype
        bias = self.relative_position_bias(position_ids).to(dtype).expand(batch, -1, -1, -1)
        if attention_mask is not None:
            if attention_mask.dim() == 2:
                keep = attention_mask[:, None, None, :]
            elif attention_mask.dim() == 3:
                keep = attention_mask[:, None, :, :]
            else:
                keep = attention_mask
            if keep.dtype == torch.bool or not keep.is_floating_point() or keep.dim() < 4:
                bias = bias.masked_fill(keep == 0, torch.finfo(dtype).min)
            else:  # an additive 4-D mask
                bias = bias + keep.to(dtype)
        encoder_outputs = self.encoder(embedding_output, attention_mask=bias.contiguous(), **kwargs)
        sequence_output = encoder_outputs.last_hidden_state
        pooled_output = self.pooler(sequence_output) if self.pooler is not None else None
        return BaseModelOutputWithPoolingAndCrossAttentions(last_hidden_state=sequence_output,
                                                            pooler_output=pooled_output)


class PMLMForMaskedLM(BertForMaskedLM):
    """BertForMaskedLM (tied decoder + output bias) over PMLMBertModel."""

    config_class = PMLMConfig
    _keys_to_ignore_on_load_unexpected = NEXT_SENTENCE_KEYS  # the MLM head alone is used
    _supports_flash_attn = False
    _supports_flex_attn = False
    # The heads average their loss themselves: Trainer must not rescale it by the item count.
    accepts_loss_kwargs = False

    def __init__(self, config):
        BertPreTrainedModel.__init__(self, config)
        self.bert = PMLMBertModel(config, add_pooling_layer=False)
        self.cls = BertOnlyMLMHead(config)
        self.post_init()




def _classifier_dropout(config):
    return config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob


class PMLMForPreTraining(BertForPreTraining):
    """BertForPreTraining (MLM + next-sentence heads) over PMLMBertModel.

    PMLM has no next-sentence objective: a converted checkpoint has no `cls.seq_relationship` nor
    `bert.pooler`, which start newly initialised (reported as missing when loading).
    """

    config_class = PMLMConfig
    _supports_flash_attn = False
    _supports_flex_attn = False
    # The heads average their loss themselves: Trainer must not rescale it by the item count.
    accepts_loss_kwargs = False

    def __init__(self, config):
        BertPreTrainedModel.__init__(self, config)
        self.bert = PMLMBertModel(config)
        self.cls = BertPreTrainingHeads(config)
        self.post_init()


class PMLMForSequenceClassification(BertForSequenceClassification):
    """BertForSequenceClassification (pooled [CLS] -> dropout -> classifier) over PMLMBertModel."""

    config_class = PMLMConfig
    _supports_flash_attn = False
    _supports_flex_attn = False
    # The heads average their loss themselves: Trainer must not rescale it by the item count.
    accepts_loss_kwargs = False
    _keys_to_ignore_on_load_unexpected = PRETRAINING_HEAD_KEYS

    def __init__(self, config):
        BertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.config = config
        self.bert = PMLMBertModel(config)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class PMLMForMultipleChoice(BertForMultipleChoice):
    """BertForMultipleChoice (pooled [CLS] of each choice -> dropout -> one score) over PMLMBertModel."""

    config_class = PMLMConfig
    _supports_flash_attn = False
    _supports_flex_attn = False
    # The heads average their loss themselves: Trainer must not rescale it by the item count.
    accepts_loss_kwargs = False
    _keys_to_ignore_on_load_unexpected = PRETRAINING_HEAD_KEYS

    def __init__(self, config):
        BertPreTrainedModel.__init__(self, config)
        self.bert = PMLMBertModel(config)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, 1)
        self.post_init()


class PMLMForTokenClassification(BertForTokenClassification):
    """BertForTokenClassification (every token -> dropout -> classifier) over PMLMBertModel."""

    config_class = PMLMConfig
    _supports_flash_attn = False
    _supports_flex_attn = False
    # The heads average their loss themselves: Trainer must not rescale it by the item count.
    accepts_loss_kwargs = False
    _keys_to_ignore_on_load_unexpected = PRETRAINING_HEAD_KEYS

    def __init__(self, config):
        BertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.bert = PMLMBertModel(config, add_pooling_layer=False)
        self.dropout = nn.Dropout(_classifier_dropout(config))
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()


class PMLMForQuestionAnswering(BertForQuestionAnswering):
    """BertForQuestionAnswering (start/end logits per token, `qa_outputs`) over PMLMBertModel."""

    config_class = PMLMConfig
    _supports_flash_attn = False
    _supports_flex_attn = False
    # The heads average their loss themselves: Trainer must not rescale it by the item count.
    accepts_loss_kwargs = False
    _keys_to_ignore_on_load_unexpected = PRETRAINING_HEAD_KEYS

    def __init__(self, config):
        BertPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.bert = PMLMBertModel(config, add_pooling_layer=False)
        self.qa_outputs = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()
