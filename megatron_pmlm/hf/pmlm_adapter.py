"""The PMLM (BERT-shaped) model's adapter to and from Hugging Face: our state dict <-> Hugging
Face's names (SPEC §10: ours already are, with the vocabulary padding cut off and the decoder tied),
the config.json fields, and reading a folder's weight files (safetensors or PyTorch, sharded or
not), writing and verifying a folder, importing one back (`import_from_hf`), and the functions the
converter's driver (convert.py) calls for this family: `load_checkpoint`, `describe`, `export_state`,
`write_folder`, `verify`, `wrote`. `pretrained.load_model` uses it too."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ConfigError, ModelConfig
from ..files import read_json
from ..parallel.deepspeed_import import import_deepspeed
from ..training.checkpoint_files import LATEST_FILE, RUN_STATE_FILE, checkpoint_listing, file_checksums, manifest
from ..training.checkpoint_reader import (ConversionError, PretrainingCheckpoint, expected_shapes, has_nsp_head,
                                          load_pretraining_checkpoint, warn)
from ..tokenizer import VOCAB_FILE
from .folder import (VERIFY_TOLERANCE, Verification, copy_remote_code, held_out_samples, hf_vocabulary, pad_token_id,
                     read_vocab, staged_output, write_hf_tokenizer, write_weights)

AUTO_MAP = {"AutoConfig": "configuration_pmlm.PMLMConfig",
            "AutoModel": "modeling_pmlm.PMLMBertModel",
            "AutoModelForMaskedLM": "modeling_pmlm.PMLMForMaskedLM",
            "AutoModelForPreTraining": "modeling_pmlm.PMLMForPreTraining",
            "AutoModelForSequenceClassification": "modeling_pmlm.PMLMForSequenceClassification",
            "AutoModelForQuestionAnswering": "modeling_pmlm.PMLMForQuestionAnswering",
            "AutoModelForTokenClassification": "modeling_pmlm.PMLMForTokenClassification",
            "AutoModelForMultipleChoice": "modeling_pmlm.PMLMForMultipleChoice"}

PADDED_VOCAB_KEYS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias")
HF_CODE_FILES = ("configuration_pmlm.py", "modeling_pmlm.py")
IMPORT_TAG = "iter_0000000"
NOUN = "samples"
"""What --verify compares on."""
LAYOUT = None
"""The samples' layout --verify needs (any PMLM/UniLM one)."""


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


# ------------------------------------------------------------------------------------------------
# Writing and verifying a folder (the converter's driver, convert.py, calls these)
# ------------------------------------------------------------------------------------------------

def load_checkpoint(load_dir: str | os.PathLike, tag: str | None = None, checksums: bool | None = True,
                    log: Callable[[str], None] = warn) -> PretrainingCheckpoint:
    return load_pretraining_checkpoint(load_dir, tag, checksums, log)


def describe(checkpoint: PretrainingCheckpoint) -> str:
    config = checkpoint.model_config
    return (f"read {checkpoint.tag_dir} ({checkpoint.layout}): {config.num_layers} layers, hidden "
            f"{config.hidden_size}, {config.num_attention_heads} heads, vocabulary {config.vocab_size} (padded to "
            f"{config.embedding_rows}), relative position bias {'on' if config.rel_pos else 'off'}")


def export_state(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    return to_hf_state_dict(state, config)


def write_folder(folder: Path, hf_state: dict[str, torch.Tensor], config: ModelConfig, vocab_file: Path,
                 do_lower_case: bool, weights_format: str) -> None:
    write_hf_folder(folder, hf_state, config, vocab_file, do_lower_case, weights_format)


def wrote(output: Path, hf_state: dict[str, torch.Tensor], config: ModelConfig) -> str:
    heads = "PreTraining (MLM + next-sentence heads)" if has_nsp_head(hf_state) else "MaskedLM"
    return (f"wrote {output} ({f'PMLMFor{heads}, remote code: trust_remote_code=True' if config.rel_pos else f'BertFor{heads}'}"
            f", {sum(t.numel() for t in hf_state.values()):,} parameters)")


def write_hf_folder(folder: Path, hf_state: dict[str, torch.Tensor], config: ModelConfig, vocab_file: Path,
                    do_lower_case: bool = True, weights_format: str = "bin") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = read_vocab(vocab_file)
    (folder / "config.json").write_text(json.dumps(hf_config_dict(config, pad_token_id(vocab), has_nsp_head(hf_state)),
                                                   indent=2) + "\n")
    write_weights(folder, hf_state, weights_format)
    write_hf_tokenizer(folder, vocab_file, vocab, do_lower_case, config.max_position_embeddings)
    if config.rel_pos:
        copy_remote_code(folder, HF_CODE_FILES)


def load_hf_model(folder: Path, rel_pos: bool, pretraining_heads: bool = False):
    """The Hugging Face masked LM of a converted folder (remote code with the bias, plain BERT without);
    with `pretraining_heads` the MLM + next-sentence model (AutoModelForPreTraining / BertForPreTraining)."""
    import transformers

    with contextlib.redirect_stderr(io.StringIO()):
        if rel_pos:
            auto = transformers.AutoModelForPreTraining if pretraining_heads else transformers.AutoModelForMaskedLM
            model = auto.from_pretrained(str(folder), trust_remote_code=True)
        else:
            plain = transformers.BertForPreTraining if pretraining_heads else transformers.BertForMaskedLM
            model = plain.from_pretrained(str(folder))
    return model.float().eval()



@dataclasses.dataclass
class PmlmVerification(Verification):
    predicted: int = 0
    max_logit_difference: float = 0.0
    max_nsp_logit_difference: float | None = None
    """The next-sentence head's logits (checkpoints with one), ours against BertForPreTraining's."""

    def differences(self) -> list[float]:
        return [self.max_logit_difference] + ([] if self.max_nsp_logit_difference is None else
                                              [self.max_nsp_logit_difference])

    def line(self) -> str:
        kind = self.kind
        return (f"verify: {self.samples} {kind} samples ({self.split} split, {self.tokens} tokens, AE view: the "
                f"corrupted sequence): max |logit difference| {self.max_logit_difference:.3e} "
                f"(tolerance {VERIFY_TOLERANCE:.0e}); MLM loss over {self.predicted} masked tokens: ours "
                f"{self.loss_ours:.6f}, Hugging Face {self.loss_hf:.6f}"
                + ("" if self.max_nsp_logit_difference is None else
                   f"; next-sentence logits max |difference| {self.max_nsp_logit_difference:.3e}")
                + f" -> {self.verdict}")


def verify(hf_folder: Path, state: dict[str, torch.Tensor], config: ModelConfig, data_path: str | os.PathLike,
           num_samples: int = 64, batch_size: int = 16) -> PmlmVerification:
    """Our model and the Hugging Face model of `hf_folder` on held-out samples (fp32, eval mode)."""
    import numpy as np
    import torch.nn.functional as F

    from ..data.loader import PMLMBatchBuilder
    from ..models.layout import IGNORE_INDEX, MASKED, PAD
    from ..models.model import PMLMForPreTraining
    from ..models.objectives import get_objective

    samples, metadata = held_out_samples(data_path)
    if samples.vocab_size != config.vocab_size:
        raise ConversionError(f"--verify: the samples in {data_path} use a vocabulary of {samples.vocab_size} entries, "
                              f"the model {config.vocab_size}")
    nsp_head = has_nsp_head(state)
    ours = PMLMForPreTraining(config, "unilm-bi" if nsp_head else "ae").eval()  # the heads the state holds
    ours.load_state_dict(state, strict=True)
    hf = load_hf_model(hf_folder, config.rel_pos, pretraining_heads=nsp_head)
    builder = PMLMBatchBuilder(samples, get_objective("ae"), int(metadata.get("seed", 0)),
                               config.max_position_embeddings)
    count = min(num_samples, len(samples))
    max_diff, tokens, predicted, loss_ours_sum, loss_hf_sum = 0.0, 0, 0, 0.0, 0.0
    max_nsp_diff = 0.0 if nsp_head else None
    with torch.no_grad():
        for start in range(0, count, batch_size):
            batch = builder(np.arange(start, min(count, start + batch_size)), 0)
            real = batch.roles != PAD
            selected = (batch.roles == MASKED) & (batch.labels != IGNORE_INDEX)
            hidden = ours.bert(*batch.as_tuple()[:5])
            logits = ours.mlm_logits(hidden)[..., :config.vocab_size]
            mlm_labels = torch.where(selected, batch.labels, torch.full_like(batch.labels, IGNORE_INDEX))
            out = hf(input_ids=batch.input_ids, attention_mask=real.long(), token_type_ids=batch.token_type_ids,
                     **({} if nsp_head else {"labels": mlm_labels}))
            hf_logits = out.prediction_logits if nsp_head else out.logits
            max_diff = max(max_diff, float((logits - hf_logits)[real].abs().max()))
            n = int(selected.sum())
            loss_ours_sum += float(F.cross_entropy(logits[selected], batch.labels[selected], reduction="sum"))
            loss_hf_sum += float(F.cross_entropy(hf_logits[selected], batch.labels[selected], reduction="sum"))
            if nsp_head:
                max_nsp_diff = max(max_nsp_diff, float((ours.nsp_logits(hidden) - out.seq_relationship_logits)
                                                       .abs().max()))
            tokens += int(real.sum())
            predicted += n
    return PmlmVerification(count, tokens, loss_ours_sum / max(predicted, 1), loss_hf_sum / max(predicted, 1),
                            samples.split, predicted=predicted, max_logit_difference=max_diff,
                            max_nsp_logit_difference=max_nsp_diff)


# ------------------------------------------------------------------------------------------------
# From Hugging Face
# ------------------------------------------------------------------------------------------------

def import_from_hf(hf_dir: str | os.PathLike, save_dir: str | os.PathLike, tensor_parallel_size: int = 1,
                   make_vocab_size_divisible_by: int = 128, add_rel_pos: bool = False, objective: str = "ae+par",
                   overwrite: bool = False, log: Callable[[str], None] = print) -> Path:
    """A checkpoint `pretrain --load SAVE_DIR --finetune` starts from (weights only, iteration 0)."""
    from ..parallel.layers import shard_state_dict
    from ..training.recipe import padded_vocab_size

    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise ConversionError(f"--from-hf {hf_dir} does not exist")
    config_file = hf_dir / "config.json"
    hf_config = read_json(config_file, ConversionError, missing="not a Hugging Face model folder")
    if tensor_parallel_size < 1:
        raise ConversionError("--tensor-model-parallel-size must be >= 1")
    vocab_size = int(hf_config.get("vocab_size", 0))
    config = model_config_from_hf(hf_config, str(config_file),
                                  padded_vocab_size(vocab_size, make_vocab_size_divisible_by, tensor_parallel_size),
                                  add_rel_pos)
    if config.num_attention_heads % tensor_parallel_size:
        raise ConversionError(f"--tensor-model-parallel-size {tensor_parallel_size} does not divide the "
                              f"{config.num_attention_heads} attention heads")
    from ..models.objectives import get_objective

    unilm = get_objective(objective)
    if unilm.is_unilm:
        from ..models.unilm import TYPE_VOCAB_SIZE

        config = dataclasses.replace(config, type_vocab_size=TYPE_VOCAB_SIZE)
    state, dropped = from_hf_state_dict(read_hf_weights(hf_dir), config, str(hf_dir), add_rel_pos,
                                        nsp_head=unilm.next_sentence_prediction)
    vocabulary = hf_vocabulary(hf_dir)
    if vocabulary is not None and len(vocabulary.tokens) != config.vocab_size:
        raise ConversionError(f"{vocabulary.source} has {len(vocabulary.tokens)} entries, config.json's vocab_size is "
                              f"{config.vocab_size}")
    do_lower_case = vocabulary.do_lower_case if vocabulary is not None else True
    deepspeed = import_deepspeed()

    save_dir = Path(save_dir)
    tp = tensor_parallel_size
    run_args = {"model_config": asdict(config), "objective": objective, "tensor_model_parallel_size": tp,
                "pipeline_model_parallel_size": 1, "converted_from": str(hf_dir.resolve()),
                "make_vocab_size_divisible_by": make_vocab_size_divisible_by, "do_lower_case": do_lower_case,
                "data_path": None}
    run_state = {"iteration": 0, "consumed_samples": 0, "training_config": {"zero_stage": 0, "precision": "fp32"},
                 "args": run_args, "world_size": tp, "data_parallel_size": 1}
    with staged_output(save_dir, overwrite, "--save") as staging:
        tag_dir = staging / IMPORT_TAG
        tag_dir.mkdir()
        for rank in range(tp):
            shard = shard_state_dict(state, rank, tp)
            torch.save({
                # What DeepSpeed's engine.load_checkpoint(load_module_only=True) reads, as it writes it.
                "module": shard, "buffer_names": [], "optimizer": None,
                "param_shapes": [{k: v.shape for k, v in shard.items()}], "frozen_param_shapes": {},
                "shared_params": {}, "frozen_param_fragments": {}, "lr_scheduler": None, "data_sampler": None,
                "random_ltd": None, "sparse_tensor_module_names": set(), "skipped_steps": 0, "global_steps": 0,
                "global_samples": 0, "dp_world_size": 1, "mp_world_size": tp,
                "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": tp},
                "ds_version": deepspeed.__version__, **run_state,
            }, tag_dir / f"mp_rank_{rank:02d}_model_states.pt")
        if vocabulary is not None:  # the checkpoint's own vocab.txt (find_vocab_file reads it)
            vocabulary.write(tag_dir / VOCAB_FILE)
        files = manifest(file_checksums(tag_dir, checkpoint_listing(tag_dir)))  # as a pre-training save's
        (tag_dir / RUN_STATE_FILE).write_text(json.dumps({**run_state, **files}, indent=1))
        (staging / LATEST_FILE).write_text(IMPORT_TAG)
    log(f"read {hf_dir} ({config.num_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads, "
        f"vocabulary {config.vocab_size} padded to {config.embedding_rows}, relative position bias "
        f"{'on' if config.rel_pos else 'off'}{' (added, zero)' if add_rel_pos and not hf_config.get('rel_pos_bins') else ''})"
        + (f"; not imported: {', '.join(dropped)}" if dropped else ""))
    log(f"wrote {save_dir / IMPORT_TAG} (tensor parallel {tp}); start a run from it with: python -m "
        f"megatron_pmlm.pretrain --load {save_dir} --finetune --tensor-model-parallel-size {tp} "
        f"--make-vocab-size-divisible-by {make_vocab_size_divisible_by} ... (a model configuration equal to "
        f"{save_dir / IMPORT_TAG / RUN_STATE_FILE}'s args.model_config; ZeRO stage 0-2, no pipeline)")
    return save_dir
