"""Checks a training run makes before it builds anything, and the settings a resume may change.

`check_run_paths` (called first in the entry points' `run()`, before any process group or model
exists, so a refused run writes nothing): `--load` must hold a checkpoint unless it is the
`--save` directory (the auto-resume idiom `--load DIR --save DIR`: the first start finds nothing
and starts from scratch), `--finetune` always needs one; `--save`, `--tensorboard-dir` and
`--history-json` must be writable or creatable. Every refusal is one line naming the flag.

`check_resumed_settings` (called by `Trainer.load_checkpoint` on the checkpoint it loads): what
the checkpoint means (its objective, s2s mode, kind of run, parallel layout unless
--universal-checkpoint re-shards it) may not change on resume; the changes a resume may
legitimately make (learning rate, schedule, batch size, intervals, ...) are listed in one line.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable

from .checkpoint_files import LATEST_FILE, CheckpointError, newest_complete_checkpoint
from ..config import ConfigError
from ..files import check_output_folder
from .tracking import TRACKING_ARGS


def same_directory(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether two paths name the same directory (symlinks and `..` resolved; either may not exist)."""
    return os.path.realpath(a) == os.path.realpath(b)


def check_load(load: str | None, save: str | None, finetune: bool = False,
               weights_hint: str = "convert it with tools/convert_checkpoint.py --from-hf DIR --save CKPT, then "
                                   "--load CKPT --finetune") -> None:
    """`--load` names a directory holding a complete checkpoint, or is the `--save` directory
    (then nothing there yet means a first start). With `--finetune` there must be a checkpoint.
    `weights_hint` says what to do with a Hugging Face folder given as --load."""
    if not load:
        if finetune:
            raise ConfigError("--finetune needs --load (the checkpoint whose weights to start from)")
        return
    if not finetune and save and same_directory(load, save):
        return  # resume if there is something, start from scratch otherwise (load_checkpoint decides)
    load_dir = Path(load)
    purpose = ("--finetune needs a checkpoint to take the weights from" if finetune else
               "to start from scratch leave --load out; `--load DIR --save DIR` resumes from DIR when it "
               "holds a checkpoint and starts from scratch when it does not")
    if not load_dir.exists():
        raise ConfigError(f"--load {load} does not exist ({purpose})")
    if not load_dir.is_dir():
        raise ConfigError(f"--load {load} is a file, not a checkpoint directory ({purpose})")
    tag, skipped = newest_complete_checkpoint(load_dir)
    if tag is not None:
        return
    if (load_dir / "config.json").is_file():
        raise ConfigError(f"--load {load} is a Hugging Face folder, not a checkpoint directory: {weights_hint}")
    found = f"; newest: {skipped[0]}" if skipped else \
        f" ({LATEST_FILE} names a checkpoint that is not there)" if (load_dir / LATEST_FILE).is_file() else ""
    raise ConfigError(f"--load {load} holds no complete checkpoint{found} ({purpose})")


def _nearest_existing(path: Path) -> Path:
    path = Path(os.path.abspath(path))
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _writable_problem(directory: Path) -> str | None:
    """Why nothing can be written into the existing directory `directory` (None: it can):
    permissions, a read-only file system, no free space or inodes (a full disk's obvious cases), or
    a folder that cannot be made there. File systems that report no sizes at all (/proc, some FUSE
    mounts) are not judged full."""
    try:
        stats = os.statvfs(directory)
    except OSError as error:
        return f"{directory} cannot be inspected ({error.strerror})"
    if stats.f_flag & os.ST_RDONLY:
        return f"{directory} is on a read-only file system"
    if not os.access(directory, os.W_OK | os.X_OK):
        return f"{directory} is not writable"
    if stats.f_blocks and not stats.f_bavail:
        return f"the file system of {directory} is full (0 bytes free)"
    if stats.f_files and not stats.f_favail:
        return f"the file system of {directory} has no free inodes"
    try:  # what the permission bits do not tell (root, ACLs, /proc): a folder made and removed at once
        os.rmdir(tempfile.mkdtemp(prefix=".write-check-", dir=directory))
    except OSError as error:
        return f"nothing can be created in {directory} ({error.strerror})"
    return None


def check_output_dir(path: str | None, flag: str) -> None:
    """`path` is a writable directory or can be created as one."""
    if not path:
        return
    check_output_folder(path, flag, error=ConfigError)  # `-`, a device, FIFO or socket, whatever the flags
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{flag} {path} is a file, not a directory")
    existing = _nearest_existing(target)
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path} cannot be created: {existing} is a file, not a directory")
    problem = _writable_problem(existing)
    if problem:
        raise ConfigError(f"{flag} {path} cannot be written: {problem}")


def check_output_file(path: str | None, flag: str) -> None:
    """`path` is not a directory and its folder is writable or can be created."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {path} is a directory, not a file")
    existing = _nearest_existing(target.absolute().parent)
    if not existing.is_dir():
        raise ConfigError(f"{flag} {path} cannot be created: {existing} is a file, not a directory")
    problem = _writable_problem(existing)
    if problem:
        raise ConfigError(f"{flag} {path} cannot be written: {problem}")


POSITIVE_SIZES = {"micro_batch_size": "samples per GPU in one forward-backward",
                  "global_batch_size": "samples per optimizer step", "train_iters": "iterations",
                  "log_interval": "iterations between log lines", "eval_interval": "iterations between validations",
                  "tensor_model_parallel_size": "GPUs one layer is split over",
                  "pipeline_model_parallel_size": "pipeline stages"}
NON_NEGATIVE_SIZES = ("eval_iters", "save_interval", "exit_interval", "lr_warmup_iters", "lr_decay_iters",
                      "keep_last_checkpoints", "keep_checkpoint_every")


def check_sizes(args: Any) -> None:
    """Zero or negative sizes get their own message (a zero micro batch otherwise reads as "not
    divisible by micro batch size", or silently takes the default)."""
    for name, meaning in POSITIVE_SIZES.items():
        value = getattr(args, name, None)
        if value is not None and value <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be a positive number ({meaning}), got {value}")
    for name in NON_NEGATIVE_SIZES:
        value = getattr(args, name, None)
        if value is not None and value < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more, got {value}")


def check_run_paths(save: str | None, load: str | None, finetune: bool = False, tensorboard_dir: str | None = None,
                    history_json: str | None = None, lock: bool = True, heartbeat_dir: str | None = None,
                    **load_options: Any) -> None:
    """A training run's --load, --save, --tensorboard-dir, --history-json and --heartbeat-dir, before anything
    is built;
    then global rank 0 takes --save's lock (save_lock.py: one run per directory; `lock` False:
    --no-lock, warned). The other ranks write nothing before the process group exists, which
    needs rank 0, so rank 0 holds the lock by then."""
    from ..parallel.distributed import launcher_rank
    from .save_lock import SaveDirInUse, lock_save_dir

    check_load(load, save, finetune, **load_options)
    check_output_dir(save, "--save")
    check_output_dir(tensorboard_dir, "--tensorboard-dir")
    check_output_file(history_json, "--history-json")
    check_output_dir(heartbeat_dir, "--heartbeat-dir")
    # Last: a run refused for another path leaves no --save folder made for the lock behind.
    if save and launcher_rank() == 0:
        try:
            lock_save_dir(save, lock)
        except SaveDirInUse as error:
            raise ConfigError(str(error)) from None


# ------------------------------------------------------------------------------------------------
# Resuming with other settings
# ------------------------------------------------------------------------------------------------

MEANING_ARGS = {"objective": "--objective", "palm_stage": "--palm-stage", "s2s_mode": "--mode",
                "source_type_id": "--source-type-id", "target_type_id": "--target-type-id",
                "do_lower_case": "the vocabulary's casing (do_lower_case)"}
"""Saved arguments that say what the checkpoint was trained for: a resume may not change them
(--finetune, which takes the weights only, may)."""

LAYOUT_ARGS = {"tensor_model_parallel_size": "--tensor-model-parallel-size",
               "pipeline_model_parallel_size": "--pipeline-model-parallel-size"}
"""How the weights are split into files: DeepSpeed reads them back only into the same layout;
--universal-checkpoint re-shards them for another one (relayout.py), --finetune does not."""

NOT_SETTINGS = {"load", "save", "tensorboard_dir", "history_json", "heartbeat_dir", "local_rank", "finetune", "universal_checkpoint",
                "lock", "checksums", "data_identity", "allow_data_change",
                "distributed_timeout_minutes", "deepspeed_config", "model_config", "epochs", "fp16", "bf16",
                "converted_from", "vocab_file", "s2s_max_source_length", "s2s_max_target_length",
                *TRACKING_ARGS}
"""Arguments that are where the run reads and writes, how it is launched, or are stored resolved
elsewhere (training_config, model_config): not compared."""


def _run_kind(args: dict[str, Any]) -> str:
    return "finetune_s2s" if "s2s_mode" in args else f"pretrain --model {args.get('model') or 'pmlm'}"


def _plain(value: Any) -> Any:
    """As the value reads back from run_state.json."""
    return json.loads(json.dumps(value, default=str))


def _show(value: Any) -> str:
    return "(none)" if value is None else str(value)


def resumed_setting_changes(saved: dict[str, Any], run_args: dict[str, Any], training_config: dict[str, Any],
                            finetune: bool = False) -> tuple[list[str], list[str], list[str]]:
    """(layout, meaning, changed): what differs between a checkpoint's run state and this run, each
    as "NAME SAVED -> NOW". Layout (always refused): the tensor/pipeline split. Meaning (refused
    unless `finetune`): the kind of run, the objective or s2s mode, the segment ids and casing.
    Changed: every other setting (training config, dropout and attention backend, data, other
    arguments); not compared with `finetune`, which starts the schedule afresh."""
    saved_args, now_args = saved.get("args", {}) or {}, _plain(run_args)
    layout = [f"{flag} {_show(saved_args[name])} -> {_show(now_args[name])}" for name, flag in LAYOUT_ARGS.items()
              if name in saved_args and name in now_args and saved_args[name] != now_args[name]]
    if finetune:
        return layout, [], []
    meaning = []
    if _run_kind(saved_args) != _run_kind(now_args):
        meaning.append(f"the kind of run: {_run_kind(saved_args)} -> {_run_kind(now_args)}")
    else:
        meaning += [f"{flag} {_show(saved_args[name])} -> {_show(now_args[name])}"
                    for name, flag in MEANING_ARGS.items()
                    if saved_args.get(name) is not None and name in now_args and saved_args[name] != now_args[name]]
    changed = []
    saved_training, now_training = saved.get("training_config", {}) or {}, _plain(training_config)
    for name, value in now_training.items():
        if name in saved_training and saved_training[name] != value:
            changed.append(f"{name} {_show(saved_training[name])} -> {_show(value)}")
    saved_model, now_model = saved_args.get("model_config") or {}, now_args.get("model_config") or {}
    for name, value in now_model.items():
        if name in saved_model and saved_model[name] != value:  # the rest is refused as another model
            changed.append(f"{name} {_show(saved_model[name])} -> {_show(value)}")
    skip = NOT_SETTINGS | set(MEANING_ARGS) | set(LAYOUT_ARGS) | set(now_training) | set(now_model)
    for name in sorted((set(saved_args) | set(now_args)) - skip):
        if name not in saved_args and now_args.get(name) in (None, False):
            continue  # a flag newer than the checkpoint (e.g. --compile), left off: the saved run's behaviour
        if saved_args.get(name) != now_args.get(name):
            changed.append(f"{name} {_show(saved_args.get(name))} -> {_show(now_args.get(name))}")
    return layout, meaning, changed


def check_resumed_settings(tag_dir: Path, saved: dict[str, Any], run_args: dict[str, Any],
                           training_config: dict[str, Any], finetune: bool, log: Callable[[str], None],
                           relayout: bool = False) -> None:
    """Refuse (CheckpointError, naming the fields) or list the changed settings in one line.
    `relayout`: the checkpoint is re-sharded for this run's layout (--universal-checkpoint), so a
    tensor/pipeline change and the vocabulary padding that follows the TP size are expected."""
    layout, meaning, changed = resumed_setting_changes(saved, run_args, training_config, finetune)
    if layout and not relayout:
        raise CheckpointError(f"{tag_dir} was saved split another way: {', '.join(layout)}; add "
                              "--universal-checkpoint to re-shard it for this layout, or keep the saved sizes")
    if relayout:
        changed = [change for change in changed if not change.startswith("padded_vocab_size ")]
    if meaning:
        way = ("start a new --save directory with it as --model (its weights, a fresh schedule)"
               if "s2s_mode" in run_args else "add --finetune to take its weights only")
        raise CheckpointError(f"{tag_dir} was trained for something else: {', '.join(meaning)}; resume it with the "
                              f"saved settings, or {way}")
    if not finetune:
        changed = _check_resumed_data(tag_dir, saved.get("args", {}) or {}, _plain(run_args), changed, log)
    if changed:
        log(f"resuming with changed settings: {', '.join(changed)}")
    backends = [(config or {}).get("attention_backend")
                for config in ((saved.get("args") or {}).get("model_config"), run_args.get("model_config"))]
    if not finetune and None not in backends and backends[0] != backends[1]:
        log(f"note: the {backends[1]} attention backend computes the same model as {backends[0]} did, with other "
            f"attention-dropout masks: this run continues the saved one but does not repeat it bit for bit "
            f"(--attention-backend {backends[0]} would)")


def _check_resumed_data(tag_dir: Path, saved_args: dict[str, Any], now_args: dict[str, Any], changed: list[str],
                        log: Callable[[str], None]) -> list[str]:
    """The samples' identity (data.samples.data_identity) saved with the checkpoint against this run's:
    another vocabulary is refused; other samples of the same vocabulary (a corpus change) are refused
    unless --allow-data-change, then listed; the same samples at another path are not a change (the
    path is where the data is, not what it is). A checkpoint saved before identities were recorded
    resumes with a warning. `changed` with data_path replaced by what differs."""
    saved_identity, now_identity = saved_args.get("data_identity"), now_args.get("data_identity")
    if not now_identity:  # a run without built samples (finetune_s2s)
        return changed
    if not saved_identity:
        log(f"warning: {tag_dir} records no identity of its samples (saved before it was recorded): "
            f"resuming on {now_args.get('data_path')} without checking it is the same data")
        return changed
    from ..data.samples import identity_changes

    others = [change for change in changed if not change.startswith("data_path ")]
    if saved_identity.get("vocab_sha256") != now_identity.get("vocab_sha256"):
        raise CheckpointError(
            f"{tag_dir} was trained on samples of another vocabulary: vocab sha256 {saved_identity.get('vocab_sha256')} "
            f"({saved_args.get('data_path')}) -> {now_identity.get('vocab_sha256')} ({now_args.get('data_path')}); "
            "resume on samples built with the checkpoint's vocabulary")
    if saved_identity.get("digest") == now_identity.get("digest"):
        return others
    where = (f"data_path {_show(saved_args.get('data_path'))} -> {_show(now_args.get('data_path'))}"
             if saved_args.get("data_path") != now_args.get("data_path") else f"data_path {now_args.get('data_path')}")
    data = f"other samples ({where}: {', '.join(identity_changes(saved_identity, now_identity))})"
    if not now_args.get("allow_data_change"):
        raise CheckpointError(f"{tag_dir} was trained on {data}; add --allow-data-change to resume on them (a "
                              "corpus change), or give --data-path the checkpoint's samples")
    return others + [f"{data} allowed by --allow-data-change"]
