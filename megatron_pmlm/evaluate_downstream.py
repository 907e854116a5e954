"""Evaluate a checkpoint on downstream tasks: fine-tune per task and seed, one table of the dev scores.

    python -m megatron_pmlm.evaluate_downstream --model ckpt/pmlm-base --tasks mrpc,rte,qg \\
        --output eval/iter_0100000.md [--seeds 1,2,3] [--max-steps N]

What to run after each checkpoint. `--model` is a Hugging Face folder or a checkpoint directory of
ours (a pre-training `--save`: its latest checkpoint is converted once into WORK_DIR/model). GLUE
tasks (mrpc, rte, cola, sst2, stsb, qqp, mnli, qnli; data from --data-dir, GLUE's TSV files) run
finetune_glue in this process (under torchrun with --nproc-per-node > 1) with its defaults (UniLMv2
Table 9) unless overridden; `qg` (question generation, SQuAD split of Du & Cardie) runs finetune_s2s,
decode_s2s and eval_s2s with UniLMv2 Table 10's QG settings on --qg-data-dir's src-dev.txt /
tgt-dev.txt, split into the first 9,570 pairs for training and the last 1,000 for evaluation.
Every task runs once per seed; the table gives per task and metric the mean, standard deviation,
minimum and maximum over the seeds (GLUE scores x100; QG's BLEU-4, METEOR and ROUGE-L as
`eval_s2s --benchmark qg` reports them: the QG benchmark's scoring, Du et al.'s references, questions
grouped by source sentence; METEOR is empty where no Java runtime is found). The markdown goes to --output, the same as JSON next to it (results.md -> results.json,
with every run's metrics), both written atomically when all runs are done; each run's own files
stay in --work-dir. `--output -` (or a FIFO, a device) writes the markdown there and the JSON to
WORK_DIR/results.json (--work-dir is then required); the progress lines go to standard error.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import math
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from .parallel.distributed import ends_process_groups
from .files import (OutputError, check_output, check_output_folder, logs_to_stderr, quiet_libraries,
                    write_json_atomically, write_text_atomically, written_through)
from .tasks import glue as glue_tasks, hf_trainer
from .tasks.glue import SHARED_DATA, get_task
from .tasks.hf_trainer import InputError
from .training.checkpoint_files import add_no_checksums_argument

QG = "qg"
QG_TRAIN, QG_DEV = 9570, 1000
QG_METRICS = ("bleu4", "meteor", "rougeL")  # eval_s2s --benchmark qg, the paper's order
QG_FINETUNE = ("--max-source-length", "464", "--max-target-length", "48", "--lr", "2e-5", "--global-batch-size", "48",
               "--weight-decay", "0.01", "--label-smoothing", "0.1")
"""UniLMv2 Table 10, QG column (epochs 16 and warmup ratio 0.1 are turned into iterations here)."""
QG_EPOCHS, QG_BATCH, QG_WARMUP = 16, 48, 0.1
QG_DECODE = ("--beam-size", "8", "--length-penalty", "1.3", "--max-target-length", "48", "--min-length", "5",
             "--no-repeat-ngram-size", "3", "--ngram-ignore-tokens", ".")
"""Table 10's decoding (beam 8, length penalty 1.3) with s2s-ft's QG options (docs/finetuning_generation.md)."""


@dataclass
class Row:
    task: str
    metric: str
    values: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)

    def stats(self) -> dict[str, float | None]:
        values = [v for v in self.values if v is not None and math.isfinite(v)]
        if not values:
            return {"mean": None, "std": None, "min": None, "max": None}
        return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
                "min": min(values), "max": max(values)}


def parse_tasks(text: str) -> list[str]:
    tasks = []
    for name in (t.strip() for t in text.split(",")):
        if not name:
            continue
        if name.lower() == QG:
            key = QG
        else:
            try:
                key = get_task(name).name
            except InputError:
                raise InputError(f"unknown task {name!r} (choose from {', '.join(glue_tasks.TASKS)}, {QG})") from None
        if key not in tasks:
            tasks.append(key)
    if not tasks:
        raise InputError("--tasks is empty")
    return tasks


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise InputError(f"--seeds {text!r} is not a comma-separated list of integers") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise InputError(f"--seeds {text!r}: give distinct integers, e.g. 1,2,3")
    return seeds


def check_passthrough(module_name: str, option: str, extra: list[str], required: list[str]) -> None:
    """`extra` must be arguments the module's own parser accepts (checked before any run starts)."""
    module = importlib.import_module(module_name)
    build = getattr(module, "build_parser", None)
    if build is None:
        return
    parser = build()
    parser.exit_on_error = False
    try:
        _, unknown = parser.parse_known_args([*required, *extra])
    except argparse.ArgumentError as error:
        raise InputError(f"{option}: {error}") from None
    if unknown:
        raise InputError(f"{option}: {module_name.rsplit('.', 1)[-1]} does not accept {' '.join(unknown)}")


def read_qg(folder: Path, train_limit: int | None, dev_limit: int | None) -> dict[str, tuple[list[str], list[str]]]:
    """{'train': (sources, targets), 'dev': ...}: the first 9,570 pairs and the last 1,000."""
    pairs = []
    for name in ("src-dev.txt", "tgt-dev.txt"):
        path = folder / name
        if not path.is_file():
            raise InputError(f"qg: {path} does not exist (--qg-data-dir holds src-dev.txt and tgt-dev.txt)")
        lines = path.read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        pairs.append(lines)
    sources, targets = pairs
    if len(sources) != len(targets):
        raise InputError(f"qg: {folder}/src-dev.txt has {len(sources)} lines but tgt-dev.txt {len(targets)}")
    if len(sources) <= QG_DEV:
        raise InputError(f"qg: {folder}/src-dev.txt has {len(sources)} lines; the split needs more than {QG_DEV}")
    for number, (source, target) in enumerate(zip(sources, targets), start=1):
        if not source.strip() or not target.strip():
            raise InputError(f"qg: {folder}/{'src' if not source.strip() else 'tgt'}-dev.txt:{number} is empty")
    dev_start = len(sources) - QG_DEV
    train_end = min(QG_TRAIN, dev_start)
    train = (sources[:train_end][:train_limit], targets[:train_end][:train_limit])
    dev = (sources[dev_start:][:dev_limit], targets[dev_start:][:dev_limit])
    return {"train": train, "dev": dev}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.evaluate_downstream",
                                     description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--model", required=True, help="a Hugging Face folder or a checkpoint directory of ours")
    add_no_checksums_argument(parser)
    parser.add_argument("--tasks", default="mrpc,rte",
                        help=f"comma-separated: {', '.join(glue_tasks.TASKS)}, {QG}")
    parser.add_argument("--output", required=True, type=Path,
                        help="the markdown table (the JSON goes next to it, with the suffix .json; '-': standard "
                        "output, the JSON then goes to WORK_DIR/results.json)")
    parser.add_argument("--seeds", default="1,2,3", help="one run per task and seed (the paper averages five)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="each run's files, the converted model (default: OUTPUT's name + '-runs', beside it)")
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="> 1: run each fine-tuning under torchrun with this many processes")
    glue = parser.add_argument_group("GLUE (finetune_glue; its defaults otherwise)")
    glue.add_argument("--data-dir", type=Path, default=SHARED_DATA / "glue",
                      help="GLUE's folder (MRPC/, RTE/, ... with train.tsv and dev.tsv)")
    glue.add_argument("--max-steps", type=int, default=None,
                      help="optimizer steps per run instead of the epochs (GLUE and QG), for quick checks")
    glue.add_argument("--num-train-epochs", type=float, default=None)
    glue.add_argument("--learning-rate", type=float, default=None)
    glue.add_argument("--per-device-train-batch-size", type=int, default=None)
    glue.add_argument("--max-seq-length", type=int, default=None)
    glue.add_argument("--max-train-samples", type=int, default=None)
    glue.add_argument("--max-eval-samples", type=int, default=None)
    precision = glue.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="also passed to finetune_s2s")
    precision.add_argument("--bf16", action="store_true", help="also passed to finetune_s2s and decode_s2s")
    glue.add_argument("--glue-args", default="", help="more finetune_glue options, e.g. \"--warmup-ratio 0.2\"")
    qg = parser.add_argument_group("question generation (finetune_s2s, decode_s2s, eval_s2s; UniLMv2 Table 10)")
    qg.add_argument("--qg-data-dir", type=Path, default=SHARED_DATA / "qg", help="src-dev.txt and tgt-dev.txt")
    qg.add_argument("--qg-train-limit", type=int, default=None, help="train on the first N of the 9,570 pairs")
    qg.add_argument("--qg-dev-limit", type=int, default=None, help="evaluate on the first N of the 1,000 dev pairs")
    qg.add_argument("--qg-finetune-args", default="", help="more finetune_s2s options (they override the defaults)")
    qg.add_argument("--qg-decode-args", default="", help="more decode_s2s options (they override the defaults)")
    return parser


class RunFailed(RuntimeError):
    """A fine-tuning, decoding or scoring subprocess failed (exit status 1, its log's tail shown)."""


class Evaluation:
    def __init__(self, args: argparse.Namespace, log: Callable[[str], None] = print):
        self.args, self.log = args, log
        self.tasks = parse_tasks(args.tasks)
        self.seeds = parse_seeds(args.seeds)
        for name in ("max_steps", "max_train_samples", "max_eval_samples", "qg_train_limit", "qg_dev_limit",
                     "nproc_per_node", "per_device_train_batch_size", "max_seq_length"):
            value = getattr(args, name)
            if value is not None and value <= 0:
                raise InputError(f"--{name.replace('_', '-')} must be positive")
        self.output = Path(args.output)
        try:
            check_output(self.output, create_folders=True)
        except OutputError as error:
            raise InputError(str(error)) from None
        if written_through(self.output):  # '-', a FIFO, a device: nothing to put the JSON beside
            if not args.work_dir:
                raise InputError(f"--output {self.output} is not a regular file: give --work-dir (the runs and "
                                 "results.json go there)")
            self.json_output = Path(args.work_dir) / "results.json"
        else:
            self.json_output = self.output.with_suffix(".json")
        if self.json_output == self.output:
            raise InputError(f"--output {self.output} ends in .json; give the markdown file (e.g. results.md)")
        self.work_dir = Path(args.work_dir) if args.work_dir else self.output.parent / f"{self.output.stem}-runs"
        check_output_folder(self.work_dir, "--work-dir", error=InputError)  # `-`, a file, a device, FIFO, socket
        self.glue_extra = shlex.split(args.glue_args)
        self.qg_finetune_extra = shlex.split(args.qg_finetune_args)
        self.qg_decode_extra = shlex.split(args.qg_decode_args)
        # Everything a run reads is checked now, before the first run starts.
        for task in self.tasks:
            if task != QG:
                glue_tasks.read_glue_folder(args.data_dir, get_task(task))
        if any(t != QG for t in self.tasks):
            check_passthrough("megatron_pmlm.finetune_glue", "--glue-args", self.glue_extra, self.glue_argv("mrpc", 1))
        self.qg = None
        if QG in self.tasks:
            self.qg = read_qg(args.qg_data_dir, args.qg_train_limit, args.qg_dev_limit)
            check_passthrough("megatron_pmlm.finetune_s2s", "--qg-finetune-args", self.qg_finetune_extra,
                              ["--model", "M"])
            check_passthrough("megatron_pmlm.decode_s2s", "--qg-decode-args", self.qg_decode_extra,
                              ["--model", "M", "--input", "I", "--output", "O"])
        hf_trainer.check_model_path(args.model, "evaluate_downstream")
        self.rows: dict[tuple[str, str], Row] = {}
        self.runs: dict[str, dict[str, dict]] = {}

    # -------------------------------------------------------------------------------------------
    def glue_argv(self, task: str, seed: int, model: str = "M", output_dir: str = "O") -> list[str]:
        args = self.args
        argv = ["--model", model, "--task", task, "--data-dir", str(args.data_dir), "--output-dir", output_dir,
                "--seed", str(seed), "--no-save-model", "--disable-tqdm"]
        for name in ("max_steps", "num_train_epochs", "learning_rate", "per_device_train_batch_size",
                     "max_seq_length", "max_train_samples", "max_eval_samples"):
            if getattr(args, name) is not None:
                argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
        argv += ["--fp16"] if args.fp16 else ["--bf16"] if args.bf16 else []
        return argv + self.glue_extra

    def module_command(self, module: str, argv: list[str], nproc: int = 1) -> list[str]:
        if nproc > 1:
            return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                    "-m", module, *argv]
        return [sys.executable, "-m", module, *argv]

    def run_logged(self, command: list[str], log_file: Path, what: str) -> None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "w", encoding="utf-8") as handle:
            handle.write(shlex.join(command) + "\n")
            handle.flush()
            result = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT)
        if result.returncode != 0:
            tail = log_file.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-15:]
            raise RunFailed(f"{what} failed (exit {result.returncode}; log {log_file}):\n" + "\n".join(tail))

    def record(self, task: str, seed: int, metrics: dict, names: Sequence[str], scale: float) -> None:
        self.runs.setdefault(task, {})[str(seed)] = metrics
        for name in names:
            value = metrics.get(name)
            row = self.rows.setdefault((task, name.removeprefix("eval_")), Row(task, name.removeprefix("eval_")))
            row.values.append(None if value is None else float(value) * scale)
            row.seeds.append(seed)

    # -------------------------------------------------------------------------------------------
    def run_glue(self, task_name: str, seed: int, model: Path) -> None:
        task = get_task(task_name)
        output_dir = self.work_dir / task.name / f"seed-{seed}"
        argv = self.glue_argv(task.name, seed, str(model), str(output_dir))
        if self.args.nproc_per_node > 1:
            self.run_logged(self.module_command("megatron_pmlm.finetune_glue", argv, self.args.nproc_per_node),
                            output_dir.parent / f"seed-{seed}.log", f"{task.name} seed {seed}")
            metrics = json.loads((output_dir / "all_results.json").read_text())
        else:
            metrics = glue_tasks.run(glue_tasks.build_parser().parse_args(argv), log=self.log)
        names = [f"eval_{m}" for m in task.metrics]
        if "eval_accuracy_mm" in metrics:
            names.append("eval_accuracy_mm")
        self.record(task.name, seed, metrics, names, 100.0)

    def run_qg(self, seed: int, model: Path) -> None:
        args = self.args
        folder = self.work_dir / QG
        data = folder / "data"
        files = {}
        for split, (sources, targets) in self.qg.items():
            for kind, lines in (("src", sources), ("tgt", targets)):
                files[split, kind] = data / f"{split}.{kind}"
                write_text_atomically(files[split, kind], "\n".join(lines) + "\n")
        run_dir = folder / f"seed-{seed}"
        shutil.rmtree(run_dir / "ckpt", ignore_errors=True)  # a fresh fine-tuning, not a resume
        train_count = len(self.qg["train"][0])
        iters = args.max_steps or math.ceil(QG_EPOCHS * train_count / QG_BATCH)
        finetune = ["--model", str(model), "--train-src", str(files["train", "src"]), "--train-tgt",
                    str(files["train", "tgt"]), "--save", str(run_dir / "ckpt"), "--seed", str(seed), *QG_FINETUNE,
                    "--train-iters", str(iters), "--lr-warmup-iters", str(math.ceil(QG_WARMUP * iters))]
        finetune += ["--fp16"] if args.fp16 else ["--bf16"] if args.bf16 else []
        self.run_logged(self.module_command("megatron_pmlm.finetune_s2s", finetune + self.qg_finetune_extra,
                                            args.nproc_per_node), run_dir / "finetune.log", f"qg seed {seed}: finetune_s2s")
        prediction = run_dir / "dev.pred"
        decode = ["--model", str(run_dir / "ckpt"), "--input", str(files["dev", "src"]), "--output", str(prediction),
                  *QG_DECODE, "--no-progress", *(["--bf16"] if args.bf16 else [])]
        self.run_logged(self.module_command("megatron_pmlm.decode_s2s", decode + self.qg_decode_extra),
                        run_dir / "decode.log", f"qg seed {seed}: decode_s2s")
        scores = run_dir / "scores.json"
        self.run_logged(self.module_command("megatron_pmlm.eval_s2s", [
            "--benchmark", "qg", "--src", str(files["dev", "src"]), "--pred", str(prediction), "--ref",
            str(files["dev", "tgt"]), "--output", str(scores)]), run_dir / "eval.log", f"qg seed {seed}: eval_s2s")
        metrics = json.loads(scores.read_text())
        meteor = "n/a" if metrics["meteor"] is None else f"{metrics['meteor']:.2f}"
        self.log(f"qg seed {seed}: BLEU-4 {metrics['bleu4']:.2f}, METEOR {meteor}, ROUGE-L {metrics['rougeL']:.2f} "
                 f"({train_count} training pairs, {iters} iterations, {metrics['examples']} dev pairs"
                 f"{'; METEOR: ' + metrics['meteor_unavailable'] if metrics['meteor'] is None else ''})")
        self.record(QG, seed, metrics, QG_METRICS, 1.0)

    # -------------------------------------------------------------------------------------------
    def run(self) -> dict:
        started = time.time()
        new_folders = [p for p in (self.work_dir, *self.work_dir.parents) if not p.exists()]
        self.work_dir.mkdir(parents=True, exist_ok=True)
        try:
            model = hf_trainer.resolve_model(self.args.model, self.work_dir / "model", log=self.log,
                                                 checksums=self.args.checksums)
        except InputError:  # a checkpoint directory that does not convert: leave nothing behind
            for folder in new_folders:
                hf_trainer.remove_if_created_empty(folder, existed=False)
            raise
        timings = {}
        for task in self.tasks:
            for seed in self.seeds:
                begin = time.time()
                self.log(f"== {task} seed {seed}")
                self.run_qg(seed, model) if task == QG else self.run_glue(task, seed, model)
                timings[f"{task}/seed-{seed}"] = round(time.time() - begin, 1)
        results = self.results(model, timings, time.time() - started)
        write_json_atomically(self.json_output, results)
        write_text_atomically(self.output, self.markdown(results))
        self.log(self.markdown_table(results))
        self.log(f"wrote {self.output} and {self.json_output}")
        return results

    def results(self, model: Path, timings: dict, seconds: float) -> dict:
        args = self.args
        settings = {name: getattr(args, name) for name in (
            "max_steps", "num_train_epochs", "learning_rate", "per_device_train_batch_size", "max_seq_length",
            "max_train_samples", "max_eval_samples", "fp16", "bf16", "glue_args", "qg_train_limit", "qg_dev_limit",
            "qg_finetune_args", "qg_decode_args", "nproc_per_node")}
        settings.update(data_dir=str(args.data_dir), qg_data_dir=str(args.qg_data_dir))
        rows = [{"task": row.task, "metric": row.metric, **row.stats(), "values": row.values, "seeds": row.seeds}
                for row in self.rows.values()]
        return {"model": str(args.model), "hf_folder": str(model),
                "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
                "tasks": self.tasks, "seeds": self.seeds, "scale": "GLUE metrics x100; qg as eval_s2s reports them",
                "settings": settings, "rows": rows, "runs": self.runs, "seconds": timings,
                "total_seconds": round(seconds, 1)}

    @staticmethod
    def markdown_table(results: dict) -> str:
        def number(value):
            return "n/a" if value is None else f"{value:.2f}"

        lines = ["| task | metric | mean | std | min | max | seeds |", "|---|---|---:|---:|---:|---:|---|"]
        for row in results["rows"]:
            lines.append(f"| {row['task']} | {row['metric']} | {number(row['mean'])} | {number(row['std'])} | "
                         f"{number(row['min'])} | {number(row['max'])} | {','.join(map(str, row['seeds']))} |")
        return "\n".join(lines)

    def markdown(self, results: dict) -> str:
        changed = {k: v for k, v in results["settings"].items() if v not in (None, False, "")}
        return "\n".join([
            f"# Downstream evaluation: {results['model']}", "",
            f"{results['created']}; dev sets; one fine-tuning per task and seed ({len(results['seeds'])} seeds); "
            "std is the sample standard deviation over the seeds. GLUE scores x100 (finetune_glue, UniLMv2 Table 9 "
            "defaults); qg: BLEU-4, METEOR and ROUGE-L as the QG benchmark scores them (finetune_s2s / decode_s2s / "
            "eval_s2s --benchmark qg, Table 10 settings; an empty METEOR: no Java runtime).", "",
            self.markdown_table(results), "",
            "Settings: " + ", ".join(f"{k} {v}" for k, v in changed.items()) + f"; {results['total_seconds']:.0f} s "
            "in all.", ""])


@ends_process_groups
def main(argv: Sequence[str] | None = None) -> int:
    quiet_libraries()
    args = build_parser().parse_args(argv)
    try:
        with logs_to_stderr(args.output):
            Evaluation(args).run()
    except InputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except RunFailed as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
