"""Pre-training checkpoints <-> Hugging Face folders (SPEC §10), verified.

    python tools/convert_checkpoint.py --load SAVE_DIR [--tag iter_N] --output HF_DIR [--verify]
    python tools/convert_checkpoint.py --from-hf HF_DIR --save SAVE_DIR

To Hugging Face: whatever the layout the checkpoint was written with (ZeRO 0-3, tensor and/or
pipeline parallel), the full fp32 state dict is rebuilt - ZeRO-3 partitions consolidated with
DeepSpeed's own `zero_to_fp32`, tensor-parallel shards merged along `TENSOR_PARALLEL_SPLITS`,
pipeline layer files renamed with `pipeline.canonical_parameter_name` (the tied word embedding
stored once) - then the vocabulary padding is cut off and the folder is written: config.json,
the weights (SPEC §10 names), vocab.txt + tokenizer_config.json and, with the relative position
bias, the remote code `configuration_pmlm.py` / `modeling_pmlm.py`. `--verify` runs our model and
the Hugging Face model on held-out samples (the AE view: the corrupted sequence) and fails above
a logit difference of 1e-4.

From Hugging Face: a BERT (or converted PMLM) folder becomes a DeepSpeed checkpoint that
`python -m megatron_pmlm.pretrain --load SAVE_DIR --finetune` starts from.

Every output is written to a temporary folder next to its destination and renamed into place only
when complete. Bad input raises `ConversionError`, whose message names the culprit (exit code 2).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..config import ConfigError, HelpFormatter, ModelConfig
from ..files import quiet_libraries, replacing_folder
from ..training.checkpoint_files import LATEST_FILE, RUN_STATE_FILE, checkpoint_listing, file_checksums, manifest
from ..training.checkpoint_reader import (ConversionError, PretrainingCheckpoint, has_nsp_head,
                                          load_pretraining_checkpoint)
from ..tokenizer import VOCAB_FILE
from .pmlm_adapter import from_hf_state_dict, hf_config_dict, model_config_from_hf, read_hf_weights, to_hf_state_dict

VERIFY_TOLERANCE = 1e-4
HF_CODE_FILES = ("configuration_pmlm.py", "modeling_pmlm.py")
IMPORT_TAG = "iter_0000000"


# ------------------------------------------------------------------------------------------------
# Vocabulary
# ------------------------------------------------------------------------------------------------

def read_vocab(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").rstrip("\n").split("\n")


def hf_vocabulary(hf_dir: Path):
    """The folder's vocabulary (tokenizer.folder_vocabulary: vocab.txt, else tokenizer.json), None
    when it has neither; an unusable one is a ConversionError."""
    from ..tokenizer import TOKENIZER_FILE, VocabularyError, folder_vocabulary

    if not (hf_dir / VOCAB_FILE).is_file() and not (hf_dir / TOKENIZER_FILE).is_file():
        return None
    try:
        return folder_vocabulary(hf_dir)
    except VocabularyError as error:
        raise ConversionError(str(error)) from None


def find_vocab_file(checkpoint: PretrainingCheckpoint, override: str | None) -> Path:
    """--vocab-file, else the checkpoint's own vocab.txt (imports), else the run's data's vocab_file."""
    args = checkpoint.run_state.get("args", {})
    if override:
        path = Path(override)
        if not path.is_file():
            raise ConversionError(f"--vocab-file {path} does not exist")
    elif (checkpoint.tag_dir / "vocab.txt").is_file():
        path = checkpoint.tag_dir / "vocab.txt"
    else:
        data_path = args.get("data_path")
        if not data_path:
            raise ConversionError(f"{checkpoint.tag_dir / RUN_STATE_FILE} names no data_path to find the vocabulary "
                                  "in: pass --vocab-file")
        metadata_file = Path(data_path) / "metadata.json"
        if not metadata_file.is_file():
            raise ConversionError(f"the run's samples {data_path} are gone ({metadata_file} is missing), so its "
                                  "vocabulary is unknown: pass --vocab-file")
        vocab = json.loads(metadata_file.read_text()).get("vocab_file")
        path = Path(vocab) if vocab else None
        if path is None or not path.is_file():
            raise ConversionError(f"the vocabulary {vocab} named by {metadata_file} does not exist: pass --vocab-file")
    size = len(read_vocab(path))
    if size != checkpoint.model_config.vocab_size:
        raise ConversionError(f"vocabulary {path} has {size} entries, the model {checkpoint.model_config.vocab_size}: "
                              "not the vocabulary this checkpoint was trained with")
    return path


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------

def staged_output(destination: Path, overwrite: bool):
    """A temporary folder next to `destination`, renamed to it when the block completes (its mode
    and its files' follow the umask: `files.replacing_folder`)."""
    destination = Path(destination)
    if destination.exists() and not overwrite and (not destination.is_dir() or any(destination.iterdir())):
        raise ConversionError(f"{destination} already exists and is not empty (pass --overwrite to replace it)")
    return replacing_folder(destination)


def write_hf_folder(folder: Path, hf_state: dict[str, torch.Tensor], config: ModelConfig, vocab_file: Path,
                    do_lower_case: bool = True, weights_format: str = "bin") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    vocab = read_vocab(vocab_file)
    pad_token_id = vocab.index("[PAD]") if "[PAD]" in vocab else 0
    (folder / "config.json").write_text(json.dumps(hf_config_dict(config, pad_token_id, has_nsp_head(hf_state)),
                                                   indent=2) + "\n")
    if weights_format == "safetensors":
        from safetensors.torch import save_file

        save_file(hf_state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(hf_state, folder / "pytorch_model.bin")
    write_hf_tokenizer(folder, vocab_file, vocab, do_lower_case, config.max_position_embeddings)
    if config.rel_pos:
        here = Path(__file__).resolve().parent
        for name in HF_CODE_FILES:
            shutil.copyfile(here / name, folder / name)


def write_hf_tokenizer(folder: Path, vocab_file: Path, vocab: list[str], do_lower_case: bool,
                       model_max_length: int) -> None:
    """vocab.txt (as trained; s2s-ft reads it), tokenizer.json (the fast tokenizer, so that
    `AutoTokenizer` needs no conversion), tokenizer_config.json and special_tokens_map.json.

    `[P]`, when the vocabulary has it, is an additional special token: never split, never
    lower-cased. The class stays `BertTokenizer` (transformers 5's is the fast one; older versions
    pick BertTokenizerFast from tokenizer.json, or the slow one from vocab.txt)."""
    from tokenizers import BertWordPieceTokenizer

    from ..tokenizer import PSEUDO

    shutil.copyfile(vocab_file, folder / "vocab.txt")
    extra = [PSEUDO] if PSEUDO in vocab else []
    special = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
               "mask_token": "[MASK]"}
    if extra:
        special["additional_special_tokens"] = extra
    fast = BertWordPieceTokenizer(str(vocab_file), lowercase=do_lower_case)  # adds the present BERT specials
    fast.add_special_tokens(extra)
    (folder / "tokenizer.json").write_text(fast.to_str(pretty=True) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": do_lower_case,
        "model_max_length": model_max_length, **special}, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


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


# ------------------------------------------------------------------------------------------------
# Verification
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Verification:
    samples: int
    tokens: int
    predicted: int
    max_logit_difference: float
    loss_ours: float
    loss_hf: float
    split: str
    max_nsp_logit_difference: float | None = None
    """The next-sentence head's logits (checkpoints with one), ours against BertForPreTraining's."""

    @property
    def passed(self) -> bool:
        return (self.max_logit_difference <= VERIFY_TOLERANCE and abs(self.loss_ours - self.loss_hf) <= VERIFY_TOLERANCE
                and (self.max_nsp_logit_difference is None or self.max_nsp_logit_difference <= VERIFY_TOLERANCE))

    def line(self) -> str:
        kind = "training" if self.split == "train" else "held-out"
        return (f"verify: {self.samples} {kind} samples ({self.split} split, {self.tokens} tokens, AE view: the "
                f"corrupted sequence): max |logit difference| {self.max_logit_difference:.3e} "
                f"(tolerance {VERIFY_TOLERANCE:.0e}); MLM loss over {self.predicted} masked tokens: ours "
                f"{self.loss_ours:.6f}, Hugging Face {self.loss_hf:.6f}"
                + ("" if self.max_nsp_logit_difference is None else
                   f"; next-sentence logits max |difference| {self.max_nsp_logit_difference:.3e}")
                + " -> "
                f"{'OK' if self.passed else 'FAILED'}")


def held_out_samples(data_path: str | os.PathLike):
    from ..data import PretrainingSamples, read_metadata
    from ..data.samples import SamplesError

    try:
        metadata = read_metadata(data_path)
        for split in ("valid", "test", "train"):  # training samples when no split is held out
            if metadata["splits"].get(split, {}).get("num_samples", 0) > 0:
                return PretrainingSamples(data_path, split), metadata
    except SamplesError as error:
        raise ConversionError(f"--verify: {error}") from None
    raise ConversionError(f"--verify: {data_path} has no samples at all (every split is empty)")


NO_HELD_OUT_NOTE = ("note: {data_path} has no held-out split (its valid and test splits are empty): --verify "
                    "compares on training samples, which checks the conversion just as well")


def verify(hf_folder: Path, state: dict[str, torch.Tensor], config: ModelConfig, data_path: str | os.PathLike,
           num_samples: int = 64, batch_size: int = 16) -> Verification:
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
    return Verification(count, tokens, predicted, max_diff, loss_ours_sum / max(predicted, 1),
                        loss_hf_sum / max(predicted, 1), samples.split, max_nsp_diff)


# ------------------------------------------------------------------------------------------------
# The two directions
# ------------------------------------------------------------------------------------------------

def export_to_hf(load_dir: str | os.PathLike, output: str | os.PathLike, tag: str | None = None,
                 vocab_file: str | None = None, run_verify: bool = False, data_path: str | None = None,
                 verify_samples: int = 64, weights_format: str = "bin", overwrite: bool = False,
                 log: Callable[[str], None] = print) -> Verification | None:
    checkpoint = load_pretraining_checkpoint(load_dir, tag)
    config = checkpoint.model_config
    log(f"read {checkpoint.tag_dir} ({checkpoint.layout}): {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads, vocabulary {config.vocab_size} (padded to {config.embedding_rows}), "
        f"relative position bias {'on' if config.rel_pos else 'off'}")
    vocab = find_vocab_file(checkpoint, vocab_file)
    args = checkpoint.run_state.get("args", {})
    verify_data = None
    if run_verify:
        verify_data = data_path or args.get("data_path")
        if not verify_data:
            raise ConversionError("--verify needs held-out samples: the checkpoint names no data_path, pass --data-path")
        samples, _ = held_out_samples(verify_data)  # refuse a bad data path before writing anything
        if samples.split == "train":
            log(NO_HELD_OUT_NOTE.format(data_path=verify_data))
    hf_state = to_hf_state_dict(checkpoint.state_dict, config)
    result = None
    output = Path(output)
    with staged_output(output, overwrite) as staging:
        write_hf_folder(staging, hf_state, config, vocab, bool(args.get("do_lower_case", True)), weights_format)
        if run_verify:
            result = verify(staging, checkpoint.state_dict, config, verify_data, verify_samples)
            log(result.line())
            if not result.passed:
                raise VerificationFailed(result)
    heads = "PreTraining (MLM + next-sentence heads)" if has_nsp_head(hf_state) else "MaskedLM"
    log(f"wrote {output} ({f'PMLMFor{heads}, remote code: trust_remote_code=True' if config.rel_pos else f'BertFor{heads}'}"
        f", {sum(t.numel() for t in hf_state.values()):,} parameters)")
    return result


class VerificationFailed(RuntimeError):
    def __init__(self, result: Verification):
        super().__init__(result.line())
        self.result = result


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
    if not config_file.is_file():
        raise ConversionError(f"{config_file} is missing: not a Hugging Face model folder")
    try:
        hf_config = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ConversionError(f"{config_file} is not valid JSON ({error})") from None
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
    import deepspeed

    save_dir = Path(save_dir)
    tp = tensor_parallel_size
    run_args = {"model_config": asdict(config), "objective": objective, "tensor_model_parallel_size": tp,
                "pipeline_model_parallel_size": 1, "converted_from": str(hf_dir.resolve()),
                "make_vocab_size_divisible_by": make_vocab_size_divisible_by, "do_lower_case": do_lower_case,
                "data_path": None}
    run_state = {"iteration": 0, "consumed_samples": 0, "training_config": {"zero_stage": 0, "precision": "fp32"},
                 "args": run_args, "world_size": tp, "data_parallel_size": 1}
    with staged_output(save_dir, overwrite) as staging:
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


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        formatter_class=HelpFormatter, prog="python tools/convert_checkpoint.py",
        description="Pre-training checkpoint -> Hugging Face folder (--load ... --output ...), verified with "
                    "--verify; or a Hugging Face BERT/PMLM folder -> a checkpoint pre-training can --load "
                    "--finetune (--from-hf ... --save ...).")
    to_hf = parser.add_argument_group("to Hugging Face")
    to_hf.add_argument("--load", help="a pre-training --save directory")
    to_hf.add_argument("--tag", help="the checkpoint to convert, e.g. iter_0000300 (default: the one 'latest' names)")
    to_hf.add_argument("--output", help="the Hugging Face folder to write")
    to_hf.add_argument("--vocab-file", help="vocab.txt (default: the one the run's samples were built with)")
    to_hf.add_argument("--verify", action="store_true",
                       help=f"compare our model and the Hugging Face model on held-out samples; exit 1 above "
                            f"{VERIFY_TOLERANCE:g}")
    to_hf.add_argument("--data-path", help="samples for --verify (default: the run's --data-path)")
    to_hf.add_argument("--verify-samples", type=int, default=64, help="held-out samples --verify runs")
    to_hf.add_argument("--format", choices=("bin", "safetensors"), default="bin",
                       help="pytorch_model.bin (what s2s-ft loads) or model.safetensors")
    from_hf = parser.add_argument_group("from Hugging Face")
    from_hf.add_argument("--from-hf", help="a Hugging Face BERT or PMLM folder (config.json + weights + vocab.txt or "
                                            "the tokenizer.json save_pretrained writes)")
    from_hf.add_argument("--save", help="the checkpoint directory to write")
    from_hf.add_argument("--tensor-model-parallel-size", type=int, default=1,
                         help="write tensor-parallel shards for a run of this size")
    from_hf.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                         help="vocabulary padding, as the run will use it")
    from_hf.add_argument("--objective", default="ae+par",
                         help="the objective the run will train: a UniLM v1 one (unilm, unilm-bi, ...) keeps BERT's "
                              "pooler and next-sentence head and grows its 2 segment embeddings to UniLM v1's 6")
    from_hf.add_argument("--add-rel-pos", action="store_true",
                         help="a BERT without relative position bias: add a zero one (outputs unchanged)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output folder")
    return parser


def main(argv: Sequence[str] | None = None, log: Callable[[str], None] = print) -> int:
    quiet_libraries()
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.load) == bool(args.from_hf):
        parser.error("give either --load SAVE_DIR --output HF_DIR, or --from-hf HF_DIR --save SAVE_DIR")
    for flag, destination in (("--output", args.output), ("--save", args.save)):
        # Before anything is read (a large checkpoint takes minutes): an occupied output is refused.
        if destination and not args.overwrite and Path(destination).is_dir() and any(Path(destination).iterdir()):
            print(f"error: {flag} {destination} already exists and is not empty (pass --overwrite to replace it)",
                  file=sys.stderr)
            return 2
    try:
        if args.load:
            if not args.output:
                parser.error("--load needs --output (the Hugging Face folder to write)")
            if args.verify_samples < 1:
                parser.error("--verify-samples must be >= 1")
            export_to_hf(args.load, args.output, args.tag, args.vocab_file, args.verify, args.data_path,
                         args.verify_samples, args.format, args.overwrite, log)
        else:
            if not args.save:
                parser.error("--from-hf needs --save (the checkpoint directory to write)")
            import_from_hf(args.from_hf, args.save, args.tensor_model_parallel_size,
                           args.make_vocab_size_divisible_by, args.add_rel_pos, objective=args.objective,
                           overwrite=args.overwrite, log=log)
    except VerificationFailed as failure:
        print(f"error: verification failed, nothing written: {failure}", file=sys.stderr)
        return 1
    except (ConversionError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    sys.exit(main())
