"""PALM checkpoints -> Hugging Face folders, verified (tools/convert_checkpoint.py routes here when
the checkpoint's run was `pretrain --model palm`).

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
import shutil
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..config import ConfigError
from ..files import quiet_libraries
from ..models.palm import PalmConfig, PalmForPreTraining
from ..training.checkpoint_files import LATEST_FILE, RUN_STATE_FILE
from ..training.checkpoint_reader import ConversionError, read_module_states, read_zero_states, run_state_of
from .convert import NO_HELD_OUT_NOTE, VERIFY_TOLERANCE, VerificationFailed, read_vocab, staged_output, write_hf_tokenizer
from .pmlm_adapter import export_config_values, read_hf_weights
from . import convert

PALM_CODE_FILES = ("configuration_palm.py", "modeling_palm.py")
PALM_AUTO_MAP = {"AutoConfig": "configuration_palm.PalmConfig",
                 "AutoModel": "modeling_palm.PalmForConditionalGeneration"}
PALM_PADDED_VOCAB_KEYS = ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias")


def is_palm_checkpoint(load_dir: str | os.PathLike, tag: str | None = None) -> bool:
    _, _, run_state = run_state_of(load_dir, tag)
    return run_state.get("args", {}).get("model") == "palm"


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
    config: PalmConfig
    state_dict: dict[str, torch.Tensor]
    """Full (TP=1), padded vocabulary, fp32."""
    layout: str


def load_palm_checkpoint(load_dir: str | os.PathLike, tag: str | None = None) -> PalmCheckpoint:
    """The full fp32 state dict of a PALM pre-training checkpoint (ZeRO 0-3, any tensor-parallel size)."""
    from ..parallel.layers import merge_state_dicts

    directory, tag, run_state = run_state_of(load_dir, tag)
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


def write_palm_folder(folder: Path, state: dict[str, torch.Tensor], config: PalmConfig, vocab_file: Path,
                      do_lower_case: bool, weights_format: str) -> None:
    vocab = read_vocab(vocab_file)
    pad_token_id = vocab.index("[PAD]") if "[PAD]" in vocab else 0
    (folder / "config.json").write_text(json.dumps(hf_palm_config_dict(config, pad_token_id), indent=2) + "\n")
    if weights_format == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, folder / "pytorch_model.bin")
    write_hf_tokenizer(folder, vocab_file, vocab, do_lower_case, config.max_position_embeddings)
    here = Path(__file__).resolve().parent
    for name in PALM_CODE_FILES:
        shutil.copyfile(here / name, folder / name)


def load_hf_palm(folder: Path):
    import transformers

    with contextlib.redirect_stderr(io.StringIO()):
        model = transformers.AutoModel.from_pretrained(str(folder), trust_remote_code=True)
    return model.float().eval()


@dataclasses.dataclass
class PalmVerification:
    samples: int
    tokens: int
    max_vocab_logit_difference: float
    max_probability_difference: float
    max_mlm_logit_difference: float
    loss_ours: float
    loss_hf: float
    split: str

    @property
    def passed(self) -> bool:
        return max(self.max_vocab_logit_difference, self.max_probability_difference, self.max_mlm_logit_difference,
                   abs(self.loss_ours - self.loss_hf)) <= VERIFY_TOLERANCE

    def line(self) -> str:
        kind = "training" if self.split == "train" else "held-out"
        return (f"verify: {self.samples} {kind} pairs ({self.split} split, {self.tokens} continuation tokens): max "
                f"|difference| vocabulary logits {self.max_vocab_logit_difference:.3e}, P {self.max_probability_difference:.3e}, "
                f"encoder MLM logits {self.max_mlm_logit_difference:.3e} (tolerance {VERIFY_TOLERANCE:.0e}); continuation "
                f"NLL ours {self.loss_ours:.6f}, Hugging Face {self.loss_hf:.6f} -> {'OK' if self.passed else 'FAILED'}")


def held_out_pairs(data_path):
    from ..data.samples import PretrainingSamples, SamplesError, read_metadata

    try:
        metadata = read_metadata(data_path)
        if metadata.get("layout") != "palm":
            raise ConversionError(f"--verify: {data_path} holds PMLM samples, not PALM pairs")
        for split in ("valid", "test", "train"):  # training pairs when no split is held out
            if metadata["splits"].get(split, {}).get("num_samples", 0) > 0:
                return PretrainingSamples(data_path, split)
    except SamplesError as error:
        raise ConversionError(f"--verify: {error}") from None
    raise ConversionError(f"--verify: {data_path} has no pairs at all (every split is empty)")


def verify_palm(folder: Path, state: dict[str, torch.Tensor], config: PalmConfig, data_path,
                num_samples: int = 64, batch_size: int = 16) -> PalmVerification:
    """Our model (TP=1, eval) and the Hugging Face model of `folder` on held-out pairs."""
    import numpy as np

    from ..models.layout import IGNORE_INDEX, PAD
    from ..models.palm import continuation_losses, final_distribution
    from ..data.palm_data import PalmBatchBuilder

    samples = held_out_pairs(data_path)
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
    return PalmVerification(count, tokens, max_vocab, max_p, max_mlm, nll_ours / max(tokens, 1),
                            nll_hf / max(tokens, 1), samples.split)


def palm_vocab_file(checkpoint: PalmCheckpoint, override: str | None) -> Path:
    args = checkpoint.run_state.get("args", {})
    if override:
        path = Path(override)
    else:
        metadata_file = Path(args.get("data_path") or "") / "metadata.json"
        if not metadata_file.is_file():
            raise ConversionError(f"the run's samples ({args.get('data_path')}) are gone, so its vocabulary is "
                                  "unknown: pass --vocab-file")
        path = Path(json.loads(metadata_file.read_text()).get("vocab_file") or "")
    if not path.is_file():
        raise ConversionError(f"vocabulary {path} does not exist: pass --vocab-file")
    if len(read_vocab(path)) != checkpoint.config.vocab_size:
        raise ConversionError(f"vocabulary {path} has {len(read_vocab(path))} entries, the model "
                              f"{checkpoint.config.vocab_size}: not this checkpoint's vocabulary")
    return path


def export_palm(load_dir, output, tag=None, vocab_file=None, run_verify=False, data_path=None, verify_samples=64,
                weights_format="bin", overwrite=False, log: Callable[[str], None] = print) -> PalmVerification | None:
    checkpoint = load_palm_checkpoint(load_dir, tag)
    config = checkpoint.config
    log(f"read {checkpoint.tag_dir} ({checkpoint.layout}): PALM, {config.num_layers} encoder + "
        f"{config.num_decoder_layers} decoder layers, hidden {config.hidden_size}, vocabulary {config.vocab_size} "
        f"(padded to {config.embedding_rows})")
    vocab = palm_vocab_file(checkpoint, vocab_file)
    args = checkpoint.run_state.get("args", {})
    verify_data = data_path or args.get("data_path")
    if run_verify:
        if not verify_data:
            raise ConversionError("--verify needs held-out pairs: the checkpoint names no data_path, pass --data-path")
        if held_out_pairs(verify_data).split == "train":  # refuse a bad data path before writing anything
            log(NO_HELD_OUT_NOTE.replace("samples", "pairs").format(data_path=verify_data))
    state = unpadded(checkpoint.state_dict, config)
    result = None
    with staged_output(Path(output), overwrite) as staging:
        write_palm_folder(staging, state, config, vocab, bool(args.get("do_lower_case", True)), weights_format)
        if run_verify:
            result = verify_palm(staging, checkpoint.state_dict, config, verify_data, verify_samples)
            log(result.line())
            if not result.passed:
                raise VerificationFailed(result)
    log(f"wrote {output} (PalmForConditionalGeneration, remote code: trust_remote_code=True, "
        f"{sum(t.numel() for t in state.values()):,} parameters)")
    return result


@dataclasses.dataclass
class LoadedPalm:
    config: PalmConfig
    """Unpadded vocabulary."""
    state_dict: dict[str, torch.Tensor]
    vocab_file: Path
    do_lower_case: bool
    source: str


def load_palm(path: str | os.PathLike) -> LoadedPalm:
    """A PALM model from a pre-training checkpoint directory or a converted Hugging Face folder."""
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
        if not is_palm_checkpoint(path):
            raise ConversionError(f"{path} holds a PMLM checkpoint, not PALM (decode it with megatron_pmlm.decode_s2s)")
        checkpoint = load_palm_checkpoint(path)
        config = dataclasses.replace(checkpoint.config, padded_vocab_size=0)
        return LoadedPalm(config, unpadded(checkpoint.state_dict, checkpoint.config),
                          palm_vocab_file(checkpoint, None), bool(checkpoint.run_state.get("args", {}).get(
                              "do_lower_case", True)), f"checkpoint {checkpoint.tag_dir} ({checkpoint.layout})")
    raise ConversionError(f"--model {path} is neither a Hugging Face folder (no config.json) nor a checkpoint "
                          f"directory (no '{LATEST_FILE}' file)")


def main(argv: Sequence[str] | None = None, log: Callable[[str], None] = print) -> int:
    """tools/convert_checkpoint.py: PALM checkpoints here, everything else to convert.main."""
    import sys

    quiet_libraries()
    args, _ = convert.build_parser().parse_known_args(argv)
    try:
        palm = bool(args.load) and Path(args.load).is_dir() and is_palm_checkpoint(args.load, args.tag)
    except ConversionError:
        palm = False  # convert.main reports the problem
    if not palm:
        return convert.main(argv, log)
    args = convert.build_parser().parse_args(argv)
    if not args.output:
        print("error: --load needs --output (the Hugging Face folder to write)", file=sys.stderr)
        return 2
    if args.output and not args.overwrite and Path(args.output).is_dir() and any(Path(args.output).iterdir()):
        print(f"error: --output {args.output} already exists and is not empty (pass --overwrite to replace it)",
              file=sys.stderr)
        return 2
    try:
        export_palm(args.load, args.output, args.tag, args.vocab_file, args.verify, args.data_path,
                    args.verify_samples, args.format, args.overwrite, log)
    except VerificationFailed as failure:
        print(f"error: verification failed, nothing written: {failure}", file=sys.stderr)
        return 1
    except (ConversionError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
