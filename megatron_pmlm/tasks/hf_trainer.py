"""What the Hugging Face `Trainer` fine-tuning commands share (GLUE, SQuAD, evaluate_downstream):
the model given as a Hugging Face folder or a checkpoint directory of ours (converted on demand),
its tokenizer, the Trainer arguments and their checks, saving the fine-tuned model."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError, non_negative_int, positive_int
from ..files import InputError, write_json_atomically
from ..training.tracking import add_tracking_arguments, check_tracking_arguments, hf_report_to

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


# ------------------------------------------------------------------------------------------------
# Shared with finetune_squad / evaluate_downstream
# ------------------------------------------------------------------------------------------------

def check_model_path(path: str | os.PathLike, tool: str | None = None) -> str:
    """'hf' (a Hugging Face folder: config.json, weights, a WordPiece vocabulary: vocab.txt or the
    tokenizer.json `save_pretrained` writes) or 'checkpoint' (a directory with `latest`), else
    InputError. Nothing is read beyond file names, the vocabulary and, with `tool` (the command's
    name), the small file naming the model family: a PALM model is refused in one line."""
    from ..hf.family import check_family
    from ..tokenizer import VocabularyError, folder_vocabulary
    from ..training.checkpoint_files import LATEST_FILE

    path = Path(path)
    if not path.exists():
        raise InputError(f"--model {path} does not exist")
    if tool:
        check_family("--model", path, tool, error=InputError)
    if (path / "config.json").is_file():
        from ..pretrained import vocabulary_problem

        try:
            vocabulary = folder_vocabulary(path)
        except VocabularyError as error:
            raise InputError(f"--model {path}: {error}") from None
        try:
            vocab_size = int(json.loads((path / "config.json").read_text())["vocab_size"])
        except (OSError, ValueError, KeyError, TypeError):
            vocab_size = None  # the model's own loader names what is wrong with its config.json
        problem = vocab_size and vocabulary_problem(vocabulary, vocab_size, str(vocabulary.source))
        if problem:
            raise InputError(f"--model {path}: {problem}")
        if not any((path / name).is_file() for name in WEIGHT_FILES):
            raise InputError(f"--model {path} has no weights ({' or '.join(WEIGHT_FILES[:2])})")
        return "hf"
    if (path / LATEST_FILE).is_file():
        return "checkpoint"
    raise InputError(f"--model {path} is neither a Hugging Face folder (no config.json) nor a checkpoint directory "
                     f"(no '{LATEST_FILE}' file)")


def resolve_model(path: str | os.PathLike, convert_to: Path, log: Callable[[str], None] = print,
                  checksums: bool = True) -> Path:
    """A Hugging Face folder for `path`: itself; for a checkpoint directory its `hf/` export when that
    is of the latest checkpoint, else `convert_to` (reused when it already holds that checkpoint,
    else converted now from the checkpoint checkpoint_reader.resolve_tag chooses and verifies:
    a damaged latest one is passed over, saying so; `checksums` False skips the check)."""
    from ..config import ConfigError
    from ..hf.convert import export_to_hf
    from ..training.checkpoint_reader import ConversionError, resolve_tag
    from ..pretrained import HF_EXPORT_DIR
    from ..training.checkpoint_files import LATEST_FILE

    path = Path(path)
    if check_model_path(path) == "hf":
        return path
    latest = (path / LATEST_FILE).read_text().strip()
    marker = {"checkpoint_tag": latest, "converted_from": str(path.resolve())}
    for candidate, keys in ((path / HF_EXPORT_DIR, ("checkpoint_tag",)), (Path(convert_to), tuple(marker))):
        try:
            config = json.loads((candidate / "config.json").read_text())
        except (OSError, json.JSONDecodeError):
            continue
        if all(config.get(k) == marker[k] for k in keys) and (candidate / "vocab.txt").is_file():
            log(f"using {candidate} (the Hugging Face export of {path}/{latest})")
            return candidate
    convert_to = Path(convert_to)
    try:
        _, tag = resolve_tag(path, None, checksums, log)
        marker["checkpoint_tag"] = tag  # what the folder holds (an older one when `latest`'s is damaged)
        export_to_hf(path, convert_to, tag, overwrite=True, log=log, checksums=None)
    except (ConversionError, ConfigError) as error:
        raise InputError(f"--model {path}: {error}") from None
    config_file = convert_to / "config.json"
    config = json.loads(config_file.read_text())
    config.update(marker)
    write_json_atomically(config_file, config)
    return convert_to


def load_tokenizer(folder: Path):
    """The folder's fast tokenizer (AutoTokenizer; a plain BERT folder with only vocab.txt works too)."""
    from transformers import AutoTokenizer

    try:
        # trust_remote_code: the folder's config.json maps AutoConfig to its remote code, and
        # AutoTokenizer reads the config (without it, it asks on the terminal); the tokenizer itself
        # is transformers' BertTokenizer.
        tokenizer = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=True)
    except (OSError, ValueError) as error:
        raise InputError(f"--model {folder}: its tokenizer does not load ({str(error).splitlines()[0]})") from None
    if not tokenizer.is_fast:
        raise InputError(f"--model {folder}: no fast tokenizer (tokenizer.json, or vocab.txt for a BERT)")
    return tokenizer


def model_max_positions(folder: Path) -> int | None:
    try:
        return int(json.loads((folder / "config.json").read_text())["max_position_embeddings"])
    except (OSError, KeyError, ValueError, TypeError):
        return None


def add_trainer_arguments(parser: argparse.ArgumentParser, defaults: dict[str, Any], source: str) -> None:
    """Trainer's usual knobs, under TrainingArguments' names with dashes."""
    train = parser.add_argument_group("training (Trainer's names; defaults: " + source + ")")
    train.add_argument("--learning-rate", type=float, default=defaults["learning_rate"])
    train.add_argument("--num-train-epochs", type=float, default=defaults["num_train_epochs"])
    train.add_argument("--max-steps", type=int, default=-1, help="optimizer steps; overrides --num-train-epochs when > 0")
    train.add_argument("--per-device-train-batch-size", type=int, default=defaults["per_device_train_batch_size"],
                       help="per process: the total batch is this x processes x --gradient-accumulation-steps")
    train.add_argument("--per-device-eval-batch-size", type=int, default=64)
    train.add_argument("--gradient-accumulation-steps", type=int, default=1)
    train.add_argument("--warmup-ratio", type=float, default=defaults["warmup_ratio"],
                       help="linear warmup over this fraction of the steps, then linear decay")
    train.add_argument("--warmup-steps", type=non_negative_int, default=None, help="warmup steps instead of --warmup-ratio")
    train.add_argument("--weight-decay", type=float, default=defaults["weight_decay"])
    train.add_argument("--adam-epsilon", type=float, default=1e-8)
    train.add_argument("--max-grad-norm", type=float, default=1.0)
    train.add_argument("--seed", type=int, default=42, help="model head initialisation, data order, dropout")
    precision = train.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="mixed precision, float16 (GPU)")
    precision.add_argument("--bf16", action="store_true", help="mixed precision, bfloat16")
    train.add_argument("--gradient-checkpointing", action="store_true")
    train.add_argument("--logging-steps", type=float, default=50)
    train.add_argument("--eval-strategy", choices=("no", "steps", "epoch"), default="no",
                       help="also evaluate during training (the final evaluation always runs)")
    train.add_argument("--eval-steps", type=float, default=None, help="default: --logging-steps")
    train.add_argument("--save-strategy", choices=("no", "steps", "epoch"), default="no",
                       help="Trainer checkpoints during training (checkpoint-N/ in --output-dir)")
    train.add_argument("--save-steps", type=float, default=500)
    train.add_argument("--save-total-limit", type=positive_int, default=None,
                       help="Trainer checkpoints kept (default: all)")
    train.add_argument("--no-save-model", action="store_true", help="do not write the fine-tuned model at the end")
    train.add_argument("--dataloader-num-workers", type=non_negative_int, default=0)
    train.add_argument("--report-to", default="none",
                       help="Trainer's integrations: none, tensorboard, wandb, ... (--wandb-project and "
                            "--mlflow-tracking-uri add theirs)")
    train.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    train.add_argument("--use-cpu", action="store_true", help="train on the CPU even when a GPU is present")
    add_tracking_arguments(parser)


def check_trainer_arguments(args: argparse.Namespace) -> None:
    positive = ("learning_rate", "per_device_train_batch_size", "per_device_eval_batch_size",
                "gradient_accumulation_steps", "max_seq_length")
    for name in positive:
        if getattr(args, name, 1) is not None and getattr(args, name, 1) <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be positive")
    if args.max_steps <= 0 and args.num_train_epochs <= 0:
        raise InputError("give --num-train-epochs > 0 or --max-steps > 0")
    if not 0.0 <= args.warmup_ratio < 1.0:
        raise InputError("--warmup-ratio must be in [0, 1)")
    for name in ("max_train_samples", "max_eval_samples"):
        if getattr(args, name, None) is not None and getattr(args, name) <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be positive")


def no_accelerator() -> bool:
    import torch

    mps = getattr(torch.backends, "mps", None)
    return not torch.cuda.is_available() and not (mps is not None and mps.is_available())


def training_arguments(args: argparse.Namespace, output_dir: Path, has_eval: bool = True):
    """TrainingArguments from our options. Without a GPU, use_cpu is set: then (and only then)
    Trainer runs data parallel on CPU processes under torchrun (gloo) instead of one model each.
    --wandb-*/--mlflow-* go through the Trainer's own integrations (report_to and the environment
    variables they read)."""
    from transformers import TrainingArguments

    report_to = hf_report_to(args, args.report_to)

    return TrainingArguments(
        output_dir=str(output_dir), do_train=True, do_eval=has_eval,
        learning_rate=args.learning_rate, num_train_epochs=args.num_train_epochs, max_steps=args.max_steps,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        lr_scheduler_type="linear",
        warmup_steps=args.warmup_steps if args.warmup_steps is not None else args.warmup_ratio,
        weight_decay=args.weight_decay, adam_epsilon=args.adam_epsilon, max_grad_norm=args.max_grad_norm,
        seed=args.seed, fp16=args.fp16, bf16=args.bf16, activation_checkpointing=args.gradient_checkpointing,
        logging_steps=args.logging_steps, eval_strategy=args.eval_strategy if has_eval else "no",
        eval_steps=args.eval_steps, save_strategy=args.save_strategy, save_steps=args.save_steps,
        save_total_limit=args.save_total_limit, dataloader_num_workers=args.dataloader_num_workers,
        report_to=report_to, disable_tqdm=args.disable_tqdm or None,
        use_cpu=args.use_cpu or no_accelerator(),
    )


def declare_mean_loss(model) -> None:
    """The BERT heads' losses are means over their own batch and ignore `num_items_in_batch`; their
    forward takes **kwargs, from which Trainer (transformers 5) concludes otherwise and then scales
    the loss by the number of processes (and skips the division by the gradient-accumulation steps):
    under torchrun, gradients and the logged loss came out N times too large. Saying so restores
    the usual mean (DDP averages the processes' gradients)."""
    model.accepts_loss_kwargs = False


def save_fine_tuned(trainer, source: Path, output_dir: Path) -> None:
    """Trainer's save_model, plus a vocab.txt of the source folder's vocabulary: transformers 5
    writes only tokenizer.json for a fast tokenizer, which our loaders read too, but s2s-ft and
    older tools read vocab.txt."""
    from ..tokenizer import VOCAB_FILE, folder_vocabulary

    trainer.save_model()
    if trainer.is_world_process_zero() and not (output_dir / VOCAB_FILE).is_file():
        folder_vocabulary(source).write(output_dir / VOCAB_FILE)


def quiet_libraries() -> None:
    """files.quiet_libraries, and the Trainer's libraries: no dataset progress bars, warnings and up."""
    import datasets
    import transformers

    from ..files import quiet_libraries as quiet_third_parties

    quiet_third_parties()
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_warning()


def remove_if_created_empty(folder: Path, existed: bool) -> None:
    """Leave nothing behind for bad input: a folder this run created and left empty goes."""
    if not existed and folder.is_dir() and not any(folder.iterdir()):
        folder.rmdir()


def run_command(build_parser: Callable[[], argparse.ArgumentParser], run: Callable[[argparse.Namespace], Any],
                argv=None) -> int:
    """A fine-tuning command's main: parse, run; bad input is one `error:` line and exit status 2."""
    from ..files import quiet_libraries as quiet_third_parties

    quiet_third_parties()
    args = build_parser().parse_args(argv)
    try:
        check_tracking_arguments(args)  # before anything is read or written
        run(args)
    except (InputError, ConfigError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
