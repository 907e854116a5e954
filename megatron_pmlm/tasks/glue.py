"""Fine-tune on a GLUE task with Hugging Face's `Trainer` (run_glue.py's recipe, thin).

    python -m megatron_pmlm.finetune_glue --model DIR --task mrpc --data-dir ../shared/data/glue \\
        --output-dir out/mrpc [--max-steps N] [--seed 1] [--bf16]

`--model` is a Hugging Face folder (ours from tools/convert_checkpoint.py, loaded with its remote
code, or a plain BERT) or a checkpoint directory of ours (a pre-training or fine-tuning `--save`),
which is converted first into OUTPUT_DIR/model (or its up-to-date `hf/` export is used).
Data: GLUE's original TSV files (`--data-dir`: the task's folder with train.tsv and dev.tsv, MNLI's
dev_matched.tsv [and dev_mismatched.tsv], or the GLUE folder holding it, e.g. MRPC/), or a
`datasets.DatasetDict` written with save_to_disk (`--dataset`: the Hub's `nyu-mll/glue` columns and
splits, train and validation[_matched]). The [CLS] (PMLM's [SOS]) vector feeds a new classifier
(regression for STS-B), as in UniLMv2 §4.3. Metrics as GLUE defines them, from scikit-learn/scipy,
named as Trainer writes them (eval_accuracy, eval_f1, eval_matthews_correlation, eval_pearson,
eval_spearmanr, and run_glue's eval_combined_score where a task has two). OUTPUT_DIR receives
eval_results.json and all_results.json (written atomically), trainer_state.json and, unless
--no-save-model, the fine-tuned model. Multi-GPU: torchrun --nproc-per-node N -m
megatron_pmlm.finetune_glue ... (Trainer's data parallelism; the batch size is per device).

Bad input (an unknown task, a missing file or column, a label outside the task's set, a model
folder without a vocabulary) stops with one `error:` line, exit status 2, before anything is written.
The command line is megatron_pmlm/finetune_glue.py; what finetune_squad and evaluate_downstream share
(model resolution, the Trainer arguments) is tasks/hf_trainer.py.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..files import check_output_folder, file_problem, write_json_atomically
from ..config import HelpFormatter
from ..training.checkpoint_files import add_no_checksums_argument
from .hf_trainer import (InputError, add_trainer_arguments, check_trainer_arguments, declare_mean_loss, load_tokenizer,
                         model_max_positions, quiet_libraries, remove_if_created_empty, resolve_model, save_fine_tuned,
                         training_arguments, check_model_path)

SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
"""The shared data folder beside the repository (GLUE under glue/, question generation under qg/)."""

TABLE9 = ("UniLMv2 (Bao et al., 2020) Appendix C, Table 9, GLUE column: a search grid, batch size {16, 32}, "
          "learning rate {5e-6, 1e-5, 1.5e-5, 2e-5, 3e-5}, linear schedule, warmup ratio {0.1, 0.2}, weight decay "
          "{0.01, 0.1}, epochs {10, 15}, chosen per task on the dev sets over five runs (the per-task choice is "
          "not published). The defaults are one point of that grid: batch 32, lr 2e-5 (also the paper's SQuAD "
          "value), warmup 0.1, weight decay 0.01, 10 epochs. --max-seq-length 128 is run_glue.py's default "
          "(the paper gives none).")
GLUE_DEFAULTS = dict(learning_rate=2e-5, per_device_train_batch_size=32, num_train_epochs=10.0, warmup_ratio=0.1,
                     weight_decay=0.01, max_seq_length=128)


# ------------------------------------------------------------------------------------------------
# Tasks
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GlueTask:
    name: str
    folder: str
    """GLUE's folder name (glue_data/MRPC)."""
    text_columns: tuple
    """The TSV columns of the one or two texts: header names, or field indices for headerless files."""
    label_column: str | int
    labels: tuple[str, ...] | None
    """The TSV label values, in label-id order (the Hub's `nyu-mll/glue` ClassLabel order); None = regression."""
    label_names: tuple[str, ...]
    """Human names of the label ids (config.json's id2label)."""
    dataset_columns: tuple[str, ...]
    """The text columns of the Hub's `nyu-mll/glue` (for --dataset)."""
    metrics: tuple[str, ...]
    """The task's GLUE metrics (names without Trainer's eval_ prefix); the first is the paper's."""
    dev_files: tuple[str, ...] = ("dev.tsv",)
    header: bool = True

    @property
    def is_regression(self) -> bool:
        return self.labels is None

    @property
    def num_labels(self) -> int:
        return 1 if self.labels is None else len(self.labels)


TASKS: dict[str, GlueTask] = {task.name: task for task in (
    GlueTask("cola", "CoLA", (3,), 1, ("0", "1"), ("unacceptable", "acceptable"), ("sentence",),
             ("matthews_correlation",), header=False),
    GlueTask("sst2", "SST-2", ("sentence",), "label", ("0", "1"), ("negative", "positive"), ("sentence",),
             ("accuracy",)),
    GlueTask("mrpc", "MRPC", ("#1 String", "#2 String"), "Quality", ("0", "1"), ("not_equivalent", "equivalent"),
             ("sentence1", "sentence2"), ("accuracy", "f1")),
    GlueTask("qqp", "QQP", ("question1", "question2"), "is_duplicate", ("0", "1"), ("not_duplicate", "duplicate"),
             ("question1", "question2"), ("accuracy", "f1")),
    GlueTask("stsb", "STS-B", ("sentence1", "sentence2"), "score", None, ("score",), ("sentence1", "sentence2"),
             ("pearson", "spearmanr")),
    GlueTask("mnli", "MNLI", ("sentence1", "sentence2"), "gold_label", ("entailment", "neutral", "contradiction"),
             ("entailment", "neutral", "contradiction"), ("premise", "hypothesis"), ("accuracy",),
             dev_files=("dev_matched.tsv", "dev_mismatched.tsv")),
    GlueTask("qnli", "QNLI", ("question", "sentence"), "label", ("entailment", "not_entailment"),
             ("entailment", "not_entailment"), ("question", "sentence"), ("accuracy",)),
    GlueTask("rte", "RTE", ("sentence1", "sentence2"), "label", ("entailment", "not_entailment"),
             ("entailment", "not_entailment"), ("sentence1", "sentence2"), ("accuracy",)),
)}
TASK_ALIASES = {"sst-2": "sst2", "sts-b": "stsb", "sts": "stsb"}


def get_task(name: str) -> GlueTask:
    key = TASK_ALIASES.get(name.lower(), name.lower())
    if key not in TASKS:
        raise InputError(f"unknown task {name!r} (choose from {', '.join(TASKS)})")
    return TASKS[key]


@dataclass
class Split:
    """One split of a task, in memory: the texts and the label ids (floats for STS-B)."""
    text_a: list[str]
    text_b: list[str] | None
    labels: list
    source: str

    def __len__(self) -> int:
        return len(self.labels)

    def head(self, count: int | None) -> "Split":
        if count is None or count >= len(self):
            return self
        return Split(self.text_a[:count], None if self.text_b is None else self.text_b[:count], self.labels[:count],
                     f"{self.source} (first {count})")


# ------------------------------------------------------------------------------------------------
# Reading GLUE's TSV files and saved DatasetDicts
# ------------------------------------------------------------------------------------------------

def parse_label(task: GlueTask, value: str, where: str):
    if task.is_regression:
        try:
            score = float(value)
        except ValueError:
            raise InputError(f"{where}: label {value!r} is not a number ({task.name} scores are 0-5)") from None
        if not (0.0 <= score <= 5.0):
            raise InputError(f"{where}: label {value!r} is outside {task.name}'s range 0-5")
        return score
    if value not in task.labels:
        raise InputError(f"{where}: label {value!r} is not one of {task.name}'s labels ({', '.join(task.labels)})")
    return task.labels.index(value)


def read_glue_tsv(path: Path, task: GlueTask) -> Split:
    """GLUE's original TSV (tab-separated, no quoting; a header line except CoLA's), checked: every
    needed column present on every line, every label in the task's set. Errors name file and line."""
    problem = file_problem(path)
    if problem:
        raise InputError(f"{task.name} file {path} {problem}")
    try:
        text = path.read_text(encoding="utf-8-sig")  # MRPC's header starts with a byte-order mark
    except UnicodeDecodeError as error:
        raise InputError(f"{path} is not UTF-8 text (byte {error.start})") from None
    lines = text.split("\n")
    first = 0
    if task.header:
        header = lines[0].rstrip("\r").split("\t")
        indices = []
        for column in (*task.text_columns, task.label_column):
            if column not in header:
                raise InputError(f"{path}:1: no column {column!r} in the header ({', '.join(header)}): not "
                                 f"{task.name}'s GLUE file")
            indices.append(header.index(column))
        first = 1
    else:
        indices = [*task.text_columns, task.label_column]
    names = [*task.text_columns, task.label_column]
    *text_indices, label_index = indices
    columns: list[list[str]] = [[] for _ in text_indices]
    labels = []
    needed = max(indices) + 1
    for number, line in enumerate(lines[first:], start=first + 1):
        line = line.rstrip("\r")
        if not line:
            continue
        fields = line.split("\t")
        where = f"{path}:{number}"
        if len(fields) < needed:
            missing = [repr(name) for name, index in zip(names, indices) if index >= len(fields)]
            raise InputError(f"{where}: {len(fields)} tab-separated field{'s' * (len(fields) != 1)}, no column "
                             f"{', '.join(missing)} ({task.name} needs {needed})")
        for column, index in zip(columns, text_indices):
            column.append(fields[index])
        labels.append(parse_label(task, fields[label_index].strip(), where))
    if not labels:
        raise InputError(f"{path} has no examples")
    return Split(columns[0], columns[1] if len(columns) > 1 else None, labels, str(path))


def task_folder(data_dir: Path, task: GlueTask) -> Path:
    """The task's own folder: `data_dir` itself when it holds train.tsv, else data_dir/MRPC etc."""
    if not data_dir.is_dir():
        raise InputError(f"--data-dir {data_dir} is not a folder")
    if (data_dir / "train.tsv").is_file():
        return data_dir
    for name in (task.folder, task.folder.lower(), task.name, task.name.upper()):
        if (data_dir / name / "train.tsv").is_file():
            return data_dir / name
    raise InputError(f"--data-dir {data_dir} holds neither train.tsv nor {task.folder}/train.tsv")


def read_glue_folder(data_dir: Path, task: GlueTask, need_train: bool = True) -> dict[str, Split]:
    """{'train', 'validation' [, 'validation_mismatched']} from GLUE's TSV files."""
    folder = task_folder(data_dir, task)
    splits = {"train": read_glue_tsv(folder / "train.tsv", task)} if need_train else {}
    splits["validation"] = read_glue_tsv(folder / task.dev_files[0], task)
    for extra in task.dev_files[1:]:  # MNLI's mismatched dev set, when present
        if (folder / extra).is_file():
            splits["validation_mismatched"] = read_glue_tsv(folder / extra, task)
    return splits


def read_saved_dataset(path: Path, task: GlueTask, need_train: bool = True) -> dict[str, Split]:
    """A DatasetDict written with save_to_disk, with the Hub's `nyu-mll/glue` columns and splits."""
    import datasets

    if not path.is_dir():
        raise InputError(f"--dataset {path} is not a folder (a DatasetDict written with save_to_disk)")
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as error:
        raise InputError(f"--dataset {path} is not a dataset written with save_to_disk ({error})") from None
    if not isinstance(loaded, datasets.DatasetDict):
        raise InputError(f"--dataset {path} is a single Dataset; give a DatasetDict with train and validation splits")
    wanted = {"train": ("train",), "validation": ("validation", "validation_matched"),
              "validation_mismatched": ("validation_mismatched",)}
    splits = {}
    for split, candidates in wanted.items():
        if split == "train" and not need_train:
            continue
        name = next((c for c in candidates if c in loaded), None)
        if name is None:
            if split == "validation_mismatched":
                continue
            raise InputError(f"--dataset {path} has no {' or '.join(candidates)} split (it has {', '.join(loaded)})")
        data = loaded[name]
        for column in (*task.dataset_columns, "label"):
            if column not in data.column_names:
                raise InputError(f"--dataset {path}: split {name} has no column {column!r} (it has "
                                 f"{', '.join(data.column_names)}); {task.name} needs {', '.join(task.dataset_columns)}"
                                 f" and label")
        labels = data["label"]
        for row, label in enumerate(labels):
            ok = (isinstance(label, (int, float)) and 0 <= label <= 5) if task.is_regression else \
                (isinstance(label, (int, np.integer)) and 0 <= label < task.num_labels)
            if not ok:
                raise InputError(f"--dataset {path}: split {name} row {row}: label {label!r} is not one of "
                                 f"{task.name}'s labels ({'a score 0-5' if task.is_regression else f'0-{task.num_labels - 1}'})")
        texts = [list(data[column]) for column in task.dataset_columns]
        splits[split] = Split(texts[0], texts[1] if len(texts) > 1 else None,
                              [float(x) for x in labels] if task.is_regression else [int(x) for x in labels],
                              f"{path}[{name}]")
    return splits


# ------------------------------------------------------------------------------------------------
# Metrics (GLUE's definitions, as Hugging Face's glue metric computes them)
# ------------------------------------------------------------------------------------------------

def glue_metrics(task: str | GlueTask, predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    """`predictions`: logits [n, labels] (or [n, 1] / [n] scores for STS-B). Accuracy; F1 of the
    positive class for MRPC/QQP; Matthews correlation for CoLA; Pearson and Spearman for STS-B; plus
    run_glue's combined_score (their mean) where there are two."""
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import f1_score, matthews_corrcoef

    task = get_task(task) if isinstance(task, str) else task
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if task.is_regression:
        scores = predictions.reshape(len(predictions), -1)[:, 0].astype(np.float64)
        result = {"pearson": float(pearsonr(scores, labels)[0]), "spearmanr": float(spearmanr(scores, labels)[0])}
    else:
        predicted = predictions.argmax(-1) if predictions.ndim > 1 else predictions
        if task.name == "cola":
            result = {"matthews_correlation": float(matthews_corrcoef(labels, predicted))}
        else:
            result = {"accuracy": float((predicted == labels).mean())}
            if task.name in ("mrpc", "qqp"):
                result["f1"] = float(f1_score(labels, predicted, zero_division=0.0))
    if len(result) > 1:
        result["combined_score"] = float(np.mean(list(result.values())))
    return result


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.finetune_glue", description=__doc__.split("\n\n")[0],
                                     epilog="Defaults: " + TABLE9, formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a Hugging Face folder or a checkpoint directory of ours (pre-training or fine-tuning "
                             "--save; converted first into OUTPUT_DIR/model)")
    parser.add_argument("--task", required=True, help=f"one of {', '.join(TASKS)}")
    add_no_checksums_argument(parser)
    data = parser.add_mutually_exclusive_group(required=True)
    data.add_argument("--data-dir", type=Path,
                      help="GLUE TSV files: the task's folder (train.tsv, dev.tsv; MNLI dev_matched.tsv) or the "
                           "GLUE folder holding it (e.g. ../shared/data/glue)")
    data.add_argument("--dataset", type=Path,
                      help="a datasets.DatasetDict saved with save_to_disk (the Hub's nyu-mll/glue columns)")
    parser.add_argument("--output-dir", required=True, type=Path, help="results JSON, trainer state, the model")
    parser.add_argument("--max-seq-length", type=int, default=GLUE_DEFAULTS["max_seq_length"],
                        help="tokens per example (pairs truncated longest-first); at most the model's positions")
    parser.add_argument("--max-train-samples", type=int, default=None, help="train on the first N examples only")
    parser.add_argument("--max-eval-samples", type=int, default=None, help="evaluate on the first N examples only")
    add_trainer_arguments(parser, GLUE_DEFAULTS, "UniLMv2 Table 9, see below")
    return parser


def load_splits(args: argparse.Namespace, task: GlueTask) -> dict[str, Split]:
    if args.data_dir is not None:
        splits = read_glue_folder(args.data_dir, task)
    else:
        splits = read_saved_dataset(args.dataset, task)
    splits["train"] = splits["train"].head(args.max_train_samples)
    for name in ("validation", "validation_mismatched"):
        if name in splits:
            splits[name] = splits[name].head(args.max_eval_samples)
    return splits


def tokenize_split(split: Split, tokenizer, max_length: int):
    import datasets

    columns = {"text_a": split.text_a, "label": split.labels}
    if split.text_b is not None:
        columns["text_b"] = split.text_b
    dataset = datasets.Dataset.from_dict(columns)

    def encode(batch):
        pair = (batch["text_a"], batch["text_b"]) if "text_b" in batch else (batch["text_a"],)
        return tokenizer(*pair, truncation=True, max_length=max_length)

    return dataset.map(encode, batched=True, remove_columns=[c for c in columns if c != "label"],
                       keep_in_memory=True, load_from_cache_file=False)


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, float]:
    """Fine-tune and evaluate; the metrics (Trainer's train_* and eval_* names). Raises InputError."""
    task = get_task(args.task)
    check_trainer_arguments(args)
    splits = load_splits(args, task)  # all data checked before anything is written
    check_model_path(args.model, "finetune_glue")
    output_dir = Path(args.output_dir)
    check_output_folder(output_dir, "--output-dir", error=InputError)  # `-`, a file, a device, FIFO, socket
    existed = output_dir.exists()
    try:
        return _train_and_evaluate(args, task, splits, output_dir, log)
    except InputError:
        remove_if_created_empty(output_dir, existed)
        raise


def _train_and_evaluate(args, task: GlueTask, splits: dict[str, Split], output_dir: Path, log) -> dict[str, float]:
    import transformers
    from transformers import AutoConfig, AutoModelForSequenceClassification, DataCollatorWithPadding, Trainer

    quiet_libraries()
    training_args = training_arguments(args, output_dir)
    with training_args.main_process_first(local=False, desc="model conversion"):
        folder = resolve_model(args.model, output_dir / "model", log=log, checksums=args.checksums)
    tokenizer = load_tokenizer(folder)
    max_length = args.max_seq_length
    positions = model_max_positions(folder)
    if positions is not None and max_length > positions:
        log(f"--max-seq-length {max_length} exceeds the model's {positions} positions: using {positions}")
        max_length = positions
    encoded = {name: tokenize_split(split, tokenizer, max_length) for name, split in splits.items()}
    log(f"{task.name}: {len(splits['train'])} training examples ({splits['train'].source}), "
        f"{len(splits['validation'])} dev examples ({splits['validation'].source}); model {folder}")

    transformers.set_seed(args.seed)  # the new classifier's initialisation
    label_kwargs = dict(num_labels=task.num_labels, finetuning_task=task.name,
                        id2label=dict(enumerate(task.label_names)),
                        label2id={name: i for i, name in enumerate(task.label_names)})
    if task.is_regression:
        label_kwargs["problem_type"] = "regression"
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=True, **label_kwargs)
    model = AutoModelForSequenceClassification.from_pretrained(str(folder), config=config, trust_remote_code=True)
    declare_mean_loss(model)

    def compute_metrics(prediction) -> dict[str, float]:
        logits = prediction.predictions[0] if isinstance(prediction.predictions, tuple) else prediction.predictions
        return glue_metrics(task, logits, prediction.label_ids)

    pad_multiple = 8 if (args.fp16 or args.bf16) else None
    trainer = Trainer(model=model, args=training_args, train_dataset=encoded["train"],
                      eval_dataset=encoded["validation"], processing_class=tokenizer,
                      data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_multiple),
                      compute_metrics=compute_metrics)
    train_result = trainer.train()
    metrics = dict(train_result.metrics)
    metrics["train_samples"] = len(encoded["train"])
    eval_metrics = trainer.evaluate()
    eval_metrics["eval_samples"] = len(encoded["validation"])
    if "validation_mismatched" in encoded:  # MNLI: run_glue's _mm suffix
        mismatched = trainer.evaluate(eval_dataset=encoded["validation_mismatched"])
        mismatched["eval_samples"] = len(encoded["validation_mismatched"])
        eval_metrics.update({f"{key}_mm": value for key, value in mismatched.items()})
    metrics.update(eval_metrics)
    if not args.no_save_model:
        save_fine_tuned(trainer, folder, output_dir)
    if trainer.is_world_process_zero():
        trainer.save_state()
        write_json_atomically(output_dir / "eval_results.json", eval_metrics)
        write_json_atomically(output_dir / "all_results.json", {"task": task.name, "model": str(args.model), **metrics})
        shown = ", ".join(f"{key} {eval_metrics[f'eval_{key}']:.4f}" for key in task.metrics
                          if eval_metrics.get(f"eval_{key}") is not None)
        log(f"{task.name} dev: {shown} (results in {output_dir / 'all_results.json'})")
    return metrics
