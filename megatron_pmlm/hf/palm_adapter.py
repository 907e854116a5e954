"""The PALM model's adapter to Hugging Face: the converter's driver (hf/convert.py) calls it when
the checkpoint's run was `pretrain --model palm`, and `pretrained.load_model` when a `--model` path
holds PALM (`load_palm`).

    python tools/convert_checkpoint.py --load SAVE_DIR [--tag iter_N] --output HF_DIR [--verify]

The full fp32 state dict is rebuilt from any layout PALM trains with (ZeRO 0-3, tensor parallel)
by training/checkpoint_reader.py's readers, the vocabulary padding is cut off, and the folder is
written: config.json (BertConfig fields + num_decoder_layers, copy_attention_size, auto_map),
pytorch_model.bin or model.safetensors in our names, the tokenizer files, and the remote code
`configuration_palm.py` / `modeling_palm.py`. `--verify` runs our model and the Hugging Face one on held-out pairs and fails
above a difference of 1e-4 in the decoder's vocabulary logits, the final distribution P, the
encoder's MLM logits or the continuation NLL. Importing a PALM folder back is not supported.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import ConfigError
from ..models.palm import PalmConfig, PalmForPreTraining
from ..training.checkpoint_files import LATEST_FILE, RUN_STATE_FILE
from ..training.checkpoint_reader import ConversionError, read_module_states, read_zero_states, run_state_of, warn
from .family import PALM, checkpoint_family
from .folder import (VERIFY_TOLERANCE, Verification, copy_remote_code, find_vocab_file, held_out_samples, pad_token_id, read_vocab,
                     write_hf_tokenizer, write_weights)
from .pmlm_adapter import export_config_values, read_hf_weights

PALM_CODE_FILES = ("configuration_palm.py", "modeling_palm.py")
PALM_AUTO_MAP = {"AutoConfig": "configuration_palm.PalmConfig",
                 "AutoModel": "modeling_palm.PalmForConditionalGeneration"}
PALM_PADDED_VOCAB_KEYS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias")
NOUN = "pairs"
"""What --verify compares on."""
LAYOUT = "palm"
"""The samples' layout --verify needs: build_samples --layout palm."""


def palm_config_of(run_state: dict[str, Any], source: str) -> PalmConfig:
    saved = run_state.get("args", {}).get("model_config")
    if not isinstance(saved, dict):
        raise ConversionError(f"{source} has no args.model_config: not a megatron-pmlm checkpoint")
    unknown = sorted(set(saved) - {f.name for f in dataclasses.fields(PalmConfig)})
    if unknown:
        raise ConversionError(f"{source}: args.model_config has fields this version does not know: {', '.join(unknown)}")
    try:
        return PalmConfig(**saved)
    except (ConfigError, TypeError) as error:
        raise ConversionError(f"{source}: invalid args.model_config ({error})") from None


@dataclasses.dataclass
class PalmCheckpoint:
    tag_dir: Path
    run_state: dict[str, Any]
    model_config: PalmConfig
    state_dict: dict[str, torch.Tensor]
    """Full (TP=1), padded vocabulary, fp32."""
    layout: str


def load_checkpoint(load_dir: str | os.PathLike, tag: str | None = None, checksums: bool | None = True,
                    log: Callable[[str], None] = warn) -> PalmCheckpoint:
    """The full fp32 state dict of a PALM pre-training checkpoint (ZeRO 0-3, any tensor-parallel
    size); which one and its verification: checkpoint_reader.resolve_tag."""
    from ..parallel.layers import merge_state_dicts

    directory, tag, run_state = run_state_of(load_dir, tag, checksums, log)
    tag_dir = directory / tag
    config = palm_config_of(run_state, str(tag_dir / RUN_STATE_FILE))
    tp = int(run_state.get("args", {}).get("tensor_model_parallel_size") or 1)
    training = run_state.get("training_config", {})
    zero_stage, precision = int(training.get("zero_stage") or 0), training.get("precision", "fp32")
    if zero_stage == 3 or (zero_stage > 0 and precision != "fp32"):
        shards, source = read_zero_states(tag_dir, tp), "ZeRO fp32 partitions (DeepSpeed zero_to_fp32)"
    else:
        shards, source = read_module_states(tag_dir, tp), "mp_rank model states"
    try:
        state = merge_state_dicts(shards)
    except RuntimeError as error:
        raise ConversionError(f"{tag_dir}: tensor-parallel shards do not fit together ({error})") from None
    state = {k: v.detach().float().contiguous() for k, v in state.items()}
    expected = {k: tuple(v.shape) for k, v in PalmForPreTraining(config).state_dict().items()}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    wrong = [k for k in expected if k in state and tuple(state[k].shape) != expected[k]]
    if missing or unexpected or wrong:
        raise ConversionError(f"{tag_dir} does not hold the PALM model its run_state.json describes (missing "
                              f"{missing[:3]}, unexpected {unexpected[:3]}, wrong shapes {wrong[:3]})")
    layout = (f"ZeRO-{zero_stage}, {precision}, data parallel {run_state.get('data_parallel_size', '?')}, "
              f"tensor parallel {tp}; read from the {source}")
    return PalmCheckpoint(tag_dir, run_state, config, state, layout)


def describe(checkpoint: PalmCheckpoint) -> str:
    config = checkpoint.model_config
    return (f"read {checkpoint.tag_dir} ({checkpoint.layout}): PALM, {config.num_layers} encoder + "
            f"{config.num_decoder_layers} decoder layers, hidden {config.hidden_size}, vocabulary {config.vocab_size} "
            f"(padded to {config.embedding_rows})")


def wrote(output: Path, state: dict[str, torch.Tensor], config: PalmConfig) -> str:
    return (f"wrote {output} (PalmForConditionalGeneration, remote code: trust_remote_code=True, "
            f"{sum(t.numel() for t in state.values()):,} parameters)")


def unpadded(state: dict[str, torch.Tensor], config: PalmConfig) -> dict[str, torch.Tensor]:
    return {k: (v[:config.vocab_size] if k in PALM_PADDED_VOCAB_KEYS else v).clone() for k, v in state.items()}


def hf_palm_config_dict(config: PalmConfig, pad_token_id: int) -> dict[str, Any]:
    from .configuration_palm import PalmConfig as HFPalmConfig

    values = HFPalmConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_decoder_layers=config.num_decoder_layers, num_attention_heads=config.num_attention_heads,
        intermediate_size=config.ffn_hidden_size, hidden_act="gelu", hidden_dropout_prob=config.hidden_dropout,
        attention_probs_dropout_prob=config.attention_dropout, max_position_embeddings=config.max_position_embeddings,
        type_vocab_size=config.type_vocab_size, initializer_range=config.init_std,
        layer_norm_eps=config.layernorm_epsilon, pad_token_id=pad_token_id,
        copy_attention_size=config.copy_attention_size).to_dict()
    values.update(architectures=["PalmForConditionalGeneration"], auto_map=dict(PALM_AUTO_MAP))
    return export_config_values(values)


def palm_config_from_hf(hf: dict[str, Any], source: str) -> PalmConfig:
    try:
        return PalmConfig(
            vocab_size=int(hf["vocab_size"]), hidden_size=int(hf["hidden_size"]), num_layers=int(hf["num_hidden_layers"]),
            num_decoder_layers=int(hf["num_decoder_layers"]), num_attention_heads=int(hf["num_attention_heads"]),
            ffn_hidden_size=int(hf["intermediate_size"]), max_position_embeddings=int(hf["max_position_embeddings"]),
            type_vocab_size=int(hf.get("type_vocab_size", 2)), hidden_dropout=float(hf["hidden_dropout_prob"]),
            attention_dropout=float(hf["attention_probs_dropout_prob"]), layernorm_epsilon=float(hf["layer_norm_eps"]),
            init_std=float(hf.get("initializer_range", 0.02)), copy_attention_size=int(hf.get("copy_attention_size", 0)))
    except (KeyError, ValueError, TypeError, ConfigError) as error:
        raise ConversionError(f"{source}: not a PALM config.json ({type(error).__name__}: {error})") from None


export_state = unpadded


def write_folder(folder: Path, state: dict[str, torch.Tensor], config: PalmConfig, vocab_file: Path,
                 do_lower_case: bool, weights_format: str) -> None:
    vocab = read_vocab(vocab_file)
    (folder / "config.json").write_text(json.dumps(hf_palm_config_dict(config, pad_token_id(vocab)), indent=2) + "\n")
    write_weights(folder, state, weights_format)
    write_hf_tokenizer(folder, vocab_file, vocab, do_lower_case, config.max_position_embeddings)
    copy_remote_code(folder, PALM_CODE_FILES)


def load_hf_palm(folder: Path):
    import transformers

    with contextlib.redirect_stderr(io.StringIO()):
        model = transformers.AutoModel.from_pretrained(str(folder), trust_remote_code=True)
    return model.float().eval()


@dataclasses.dataclass
class PalmVerification(Verification):
    max_vocab_logit_difference: float = 0.0
    max_probability_difference: float = 0.0
    max_mlm_logit_difference: float = 0.0

    def differences(self) -> list[float]:
        return [self.max_vocab_logit_difference, self.max_probability_difference, self.max_mlm_logit_difference]

    def line(self) -> str:
        kind = self.kind
        return (f"verify: {self.samples} {kind} pairs ({self.split} split, {self.tokens} continuation tokens): max "
                f"|difference| vocabulary logits {self.max_vocab_logit_difference:.3e}, P {self.max_probability_difference:.3e}, "
                f"encoder MLM logits {self.max_mlm_logit_difference:.3e} (tolerance {VERIFY_TOLERANCE:.0e}); continuation "
                f"NLL ours {self.loss_ours:.6f}, Hugging Face {self.loss_hf:.6f} -> {self.verdict}")


def verify(folder: Path, state: dict[str, torch.Tensor], config: PalmConfig, data_path,
                num_samples: int = 64, batch_size: int = 16) -> PalmVerification:
    """Our model (TP=1, eval) and the Hugging Face model of `folder` on held-out pairs."""
    import numpy as np

    from ..models.layout import IGNORE_INDEX, PAD
    from ..models.palm import continuation_losses, final_distribution
    from ..data.palm_data import PalmBatchBuilder

    samples, _ = held_out_samples(data_path, NOUN, LAYOUT)
    if samples.vocab_size != config.vocab_size:
        raise ConversionError(f"--verify: the pairs in {data_path} use a vocabulary of {samples.vocab_size} entries, "
                              f"the model {config.vocab_size}")
    ours = PalmForPreTraining(config).eval()
    ours.load_state_dict(state, strict=True)
    hf = load_hf_palm(folder)
    builder = PalmBatchBuilder(samples, stage=2)
    count = min(num_samples, len(samples))
    vocab = config.vocab_size
    max_vocab, max_p, max_mlm, tokens, nll_ours, nll_hf = 0.0, 0.0, 0.0, 0, 0.0, 0.0
    with torch.no_grad():
        for start in range(0, count, batch_size):
            batch = builder(np.arange(start, min(count, start + batch_size)), 0)
            real = batch.encoder_roles != PAD
            valid = batch.labels != IGNORE_INDEX
            mixture = ours.mixture(ours.encode(batch.encoder_ids, batch.encoder_roles), batch.encoder_roles,
                                   batch.decoder_ids)
            p_ours = final_distribution(mixture, batch.context_ids)[..., :vocab]
            n = int(valid.sum())
            nll_ours += float(continuation_losses(mixture, batch.context_ids, batch.labels, ours.layers).loss) * n
            out = hf(input_ids=batch.encoder_ids, attention_mask=real.long(), decoder_input_ids=batch.decoder_ids,
                     labels=batch.labels)
            max_vocab = max(max_vocab, float((mixture.vocab_logits[..., :vocab] - out.vocab_logits)[valid].abs().max()))
            max_p = max(max_p, float((p_ours - out.probabilities)[valid].abs().max()))
            nll_hf += float(out.loss) * n
            mlm_ours = ours.cls.predictions(ours.encode(batch.encoder_ids, batch.encoder_roles),
                                            ours.word_embeddings.weight)[..., :vocab]
            mlm_hf = hf.mlm_logits(batch.encoder_ids, real.long())
            max_mlm = max(max_mlm, float((mlm_ours - mlm_hf)[real].abs().max()))
            tokens += n
    return PalmVerification(count, tokens, nll_ours / max(tokens, 1), nll_hf / max(tokens, 1), samples.split,
                            max_vocab_logit_difference=max_vocab, max_probability_difference=max_p,
                            max_mlm_logit_difference=max_mlm)


@dataclasses.dataclass
class LoadedPalm:
    config: PalmConfig
    """Unpadded vocabulary."""
    state_dict: dict[str, torch.Tensor]
    vocab_file: Path
    do_lower_case: bool
    source: str
    family: str = PALM
    settings: dict[str, Any] = dataclasses.field(default_factory=dict)
    """None recorded (PMLM models record their seq2seq settings here)."""


def load_palm(path: str | os.PathLike, checksums: bool = True, log: Callable[[str], None] = warn) -> LoadedPalm:
    """A PALM model from a pre-training checkpoint directory (verified unless `checksums` is
    False) or a converted Hugging Face folder."""
    path = Path(path)
    if (path / "config.json").is_file():
        hf = json.loads((path / "config.json").read_text())
        if hf.get("model_type") != "palm":
            raise ConversionError(f"{path} holds a {hf.get('model_type')!r} model, not PALM")
        config = palm_config_from_hf(hf, str(path / "config.json"))
        state = read_hf_weights(path)
        tokenizer_config = path / "tokenizer_config.json"
        lower = json.loads(tokenizer_config.read_text()).get("do_lower_case", True) if tokenizer_config.is_file() else True
        return LoadedPalm(config, state, path / "vocab.txt", bool(lower), f"Hugging Face folder {path}")
    if (path / LATEST_FILE).is_file():
        if checkpoint_family(path) != PALM:
            raise ConversionError(f"{path} holds a PMLM checkpoint, not PALM (decode it with megatron_pmlm.decode_s2s)")
        checkpoint = load_checkpoint(path, checksums=checksums, log=log)
        config = dataclasses.replace(checkpoint.model_config, padded_vocab_size=0)
        return LoadedPalm(config, unpadded(checkpoint.state_dict, checkpoint.model_config),
                          find_vocab_file(checkpoint, None), bool(checkpoint.run_state.get("args", {}).get(
                              "do_lower_case", True)), f"checkpoint {checkpoint.tag_dir} ({checkpoint.layout})")
    raise ConversionError(f"--model {path} is neither a Hugging Face folder (no config.json) nor a checkpoint "
                          f"directory (no '{LATEST_FILE}' file)")
