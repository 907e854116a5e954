"""The PMLM (BERT-shaped) model's adapter to and from Hugging Face: our state dict <-> Hugging
Face's names (SPEC §10: ours already are, with the vocabulary padding cut off and the decoder tied),
the config.json fields, and reading a folder's weight files (safetensors or PyTorch, sharded or
not). The converter (convert.py) and `pretrained.load_model` use it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, ModelConfig
from ..training.checkpoint_reader import ConversionError, expected_shapes

AUTO_MAP = {"AutoConfig": "configuration_pmlm.PMLMConfig",
            "AutoModel": "modeling_pmlm.PMLMBertModel",
            "AutoModelForMaskedLM": "modeling_pmlm.PMLMForMaskedLM",
            "AutoModelForPreTraining": "modeling_pmlm.PMLMForPreTraining",
            "AutoModelForSequenceClassification": "modeling_pmlm.PMLMForSequenceClassification",
            "AutoModelForQuestionAnswering": "modeling_pmlm.PMLMForQuestionAnswering",
            "AutoModelForTokenClassification": "modeling_pmlm.PMLMForTokenClassification",
            "AutoModelForMultipleChoice": "modeling_pmlm.PMLMForMultipleChoice"}

PADDED_VOCAB_KEYS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias")


def to_hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """SPEC §10 names (ours already are) with the vocabulary padding cut off; decoder tied, not stored."""
    out = {}
    for name, tensor in state.items():
        if name in PADDED_VOCAB_KEYS:
            tensor = tensor[:config.vocab_size]
        out[name] = tensor.detach().float().contiguous().clone()
    return out


def hf_config_dict(config: ModelConfig, pad_token_id: int = 0, nsp_head: bool = False) -> dict[str, Any]:
    """config.json: BertConfig's fields (+ rel_pos_bins, max_rel_pos and auto_map with the bias);
    architectures names the pre-training heads (MLM + NSP) when the checkpoint has the NSP head."""
    from transformers import BertConfig

    from .configuration_pmlm import PMLMConfig

    fields = dict(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                  num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
                  intermediate_size=config.ffn_hidden_size, hidden_act="gelu",
                  hidden_dropout_prob=config.hidden_dropout, attention_probs_dropout_prob=config.attention_dropout,
                  max_position_embeddings=config.max_position_embeddings, type_vocab_size=config.type_vocab_size,
                  initializer_range=config.init_std, layer_norm_eps=config.layernorm_epsilon,
                  pad_token_id=pad_token_id, tie_word_embeddings=True)
    if config.rel_pos:
        values = PMLMConfig(rel_pos_bins=config.rel_pos_bins, max_rel_pos=config.max_rel_pos, **fields).to_dict()
        values["architectures"] = ["PMLMForPreTraining" if nsp_head else "PMLMForMaskedLM"]
        values["auto_map"] = dict(AUTO_MAP)
    else:
        values = BertConfig(**fields).to_dict()
        values["architectures"] = ["BertForPreTraining" if nsp_head else "BertForMaskedLM"]
    return export_config_values(values)


NOT_EXPORTED_CONFIG_KEYS = ("_name_or_path", "id2label", "label2id")
"""PretrainedConfig.to_dict writes a 2-label id2label/label2id (and the path it was read from); a
pre-trained export has no labels, and a fixed map makes `from_pretrained(..., num_labels=3)` warn."""


def export_config_values(values: dict[str, Any]) -> dict[str, Any]:
    """A config dict as an export writes it: sorted, without NOT_EXPORTED_CONFIG_KEYS."""
    return dict(sorted((k, v) for k, v in values.items() if k not in NOT_EXPORTED_CONFIG_KEYS))


def model_config_from_hf(hf: dict[str, Any], source: str, padded_vocab_size: int,
                         add_rel_pos: bool = False) -> ModelConfig:
    """The ModelConfig of a Hugging Face BERT/PMLM config.json."""
    model_type = hf.get("model_type", "bert")
    if model_type not in ("bert", "pmlm", "unilm"):
        raise ConversionError(f"{source}: model_type {model_type!r} is not a BERT-architecture model this tool can "
                              "import (bert, pmlm, unilm)")
    if hf.get("hidden_act", "gelu") != "gelu":
        raise ConversionError(f"{source}: hidden_act {hf.get('hidden_act')!r}; our model uses exact GELU ('gelu')")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise ConversionError(f"{source}: position_embedding_type {hf.get('position_embedding_type')!r} is not "
                              "supported (absolute positions + relative position bias only)")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    missing = [k for k in required if k not in hf]
    if missing:
        raise ConversionError(f"{source}: lacks {', '.join(missing)} (not a BERT config.json)")
    rel_pos_bins = int(hf.get("rel_pos_bins") or 0)
    rel_pos = rel_pos_bins > 0 or add_rel_pos
    try:
        return ModelConfig(
            vocab_size=int(hf["vocab_size"]), padded_vocab_size=padded_vocab_size,
            hidden_size=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=int(hf["num_attention_heads"]), ffn_hidden_size=int(hf["intermediate_size"]),
            max_position_embeddings=int(hf.get("max_position_embeddings", 512)),
            type_vocab_size=int(hf.get("type_vocab_size", 2)),
            hidden_dropout=float(hf.get("hidden_dropout_prob", 0.1)),
            attention_dropout=float(hf.get("attention_probs_dropout_prob", 0.1)),
            layernorm_epsilon=float(hf.get("layer_norm_eps", 1e-12)),
            init_std=float(hf.get("initializer_range", 0.02)), rel_pos=rel_pos,
            rel_pos_bins=rel_pos_bins or 32, max_rel_pos=int(hf.get("max_rel_pos") or 128))
    except ConfigError as error:
        raise ConversionError(f"{source}: {error}") from None


def from_hf_state_dict(hf_state: dict[str, torch.Tensor], config: ModelConfig, source: str,
                       add_rel_pos: bool = False, nsp_head: bool = False) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Our (padded) state dict from a Hugging Face BERT state dict; also the names dropped.

    `nsp_head` (a UniLM v1 run starts from it): the pooler and next-sentence head are kept (drawn
    fresh, BERT's init, where the folder has none), and a 2-row segment embedding grows to
    `config.type_vocab_size` rows as the released UniLM v1 code grows it (rows 2, 3, 4 = row 0,
    row 5 = row 1: left-to-right, right-to-left and the seq2seq source start from segment A, the
    seq2seq target from segment B)."""
    state, dropped = {}, []
    for name, tensor in hf_state.items():
        new = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        if not new.startswith(("bert.", "cls.", "crit_mask_lm_smoothed.")):
            new = "bert." + new  # a BertModel checkpoint (no prefix)
        if nsp_head and new.startswith(("bert.pooler.", "cls.seq_relationship.")):
            state[new] = tensor
            continue
        if new in ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias") or \
                new.startswith(("bert.pooler.", "cls.seq_relationship.", "crit_mask_lm_smoothed.")) or \
                new.endswith("position_ids"):
            dropped.append(name)
            continue
        state[new] = tensor
    decoder = hf_state.get("cls.predictions.decoder.weight")
    embedding = state.get("bert.embeddings.word_embeddings.weight")
    if decoder is not None and embedding is not None and decoder.shape == embedding.shape and \
            not torch.equal(decoder, embedding):
        raise ConversionError(f"{source}: cls.predictions.decoder.weight differs from the word embeddings; our model "
                              "ties them (an untied checkpoint cannot be imported exactly)")
    if add_rel_pos and "bert.rel_pos_bias.weight" not in state:
        # Zero bias: the model computes exactly the BERT it was given, and learns the bias from there.
        state["bert.rel_pos_bias.weight"] = torch.zeros(config.num_attention_heads, config.rel_pos_bins)
    for name in PADDED_VOCAB_KEYS:
        if name in state and state[name].shape[0] == config.vocab_size < config.embedding_rows:
            tensor = state[name]
            padding = torch.zeros((config.embedding_rows - config.vocab_size,) + tuple(tensor.shape[1:]),
                                  dtype=tensor.dtype)
            state[name] = torch.cat([tensor, padding])
    _grow_segment_embeddings(state, config.type_vocab_size, source)
    if nsp_head:
        _add_missing_nsp_head(state, config)
    state = {k: v.detach().float().contiguous().clone() for k, v in state.items()}
    expected = expected_shapes(config, nsp_head)
    missing = [k for k in expected if k not in state]
    unexpected = [k for k in state if k not in expected]
    if missing or unexpected:
        raise ConversionError(f"{source}: weights do not match a BERT with an MLM head as config.json describes: "
                              + (f"missing {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}" if missing else "")
                              + ("; " if missing and unexpected else "")
                              + (f"unexpected {', '.join(unexpected[:5])}" if unexpected else ""))
    wrong = [f"{k} {tuple(state[k].shape)} (config.json implies {v})" for k, v in expected.items()
             if tuple(state[k].shape) != v]
    if wrong:
        raise ConversionError(f"{source}: {', '.join(wrong[:4])}")
    return state, dropped


UNILM_SEGMENT_ROWS_FROM = (0, 1, 0, 0, 0, 1)
"""Row k of UniLM v1's 6-row segment embedding starts as row UNILM_SEGMENT_ROWS_FROM[k] of BERT's."""


def _grow_segment_embeddings(state: dict[str, torch.Tensor], rows: int, source: str) -> None:
    name = "bert.embeddings.token_type_embeddings.weight"
    table = state.get(name)
    if table is None or table.shape[0] == rows:
        return
    if table.shape[0] != 2 or rows != len(UNILM_SEGMENT_ROWS_FROM):
        raise ConversionError(f"{source}: a segment embedding of {table.shape[0]} rows cannot become UniLM v1's "
                              f"{rows} (only BERT's 2 rows grow to 6)")
    state[name] = table[list(UNILM_SEGMENT_ROWS_FROM)].clone()


def _add_missing_nsp_head(state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """BERT's init (N(0, init_std) matrices, zero biases) for a pooler / next-sentence head the
    folder lacks (a BertForMaskedLM save), from a fixed generator so every TP rank agrees."""
    generator = torch.Generator().manual_seed(0)
    h = config.hidden_size
    for name, shape in (("bert.pooler.dense", (h, h)), ("cls.seq_relationship", (2, h))):
        if f"{name}.weight" not in state:
            state[f"{name}.weight"] = torch.empty(shape).normal_(0.0, config.init_std, generator=generator)
            state[f"{name}.bias"] = torch.zeros(shape[0])


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    """model.safetensors / pytorch_model.bin, or their sharded index."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if (hf_dir / single).is_file():
            return _read_weight_file(hf_dir / single)
        if (hf_dir / index_name).is_file():
            try:
                weight_map = json.loads((hf_dir / index_name).read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as error:
                raise ConversionError(f"{hf_dir / index_name}: not a weight index ({error})") from None
            state = {}
            for shard in sorted(set(weight_map.values())):
                if not (hf_dir / shard).is_file():
                    raise ConversionError(f"{hf_dir / index_name} names {shard}, which is missing")
                state.update(_read_weight_file(hf_dir / shard))
            return state
    raise ConversionError(f"{hf_dir}: no model.safetensors or pytorch_model.bin (nor a sharded index)")


def _read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as error:  # noqa: BLE001
            raise ConversionError(f"{path} cannot be read ({error})") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001
        raise ConversionError(f"{path} cannot be read ({type(error).__name__}: {error})") from None
    if not isinstance(state, dict):
        raise ConversionError(f"{path} does not hold a state dict")
    return state
