"""Checks a training run makes before it builds anything.

`check_run_paths` (called first in the entry points' `run()`, before any process group or model
exists, so a refused run writes nothing): `--load` must hold a checkpoint unless it is the
`--save` directory (the auto-resume idiom `--load DIR --save DIR`: the first start finds nothing
and starts from scratch), `--finetune` always needs one; `--save`, `--tensorboard-dir` and
`--history-json` must be writable or creatable. Every refusal is one line naming the flag.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from .checkpoint_files import LATEST_FILE, newest_complete_checkpoint
from .config import ConfigError


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


def check_run_paths(save: str | None, load: str | None, finetune: bool = False, tensorboard_dir: str | None = None,
                    history_json: str | None = None, **load_options: Any) -> None:
    """A training run's --load, --save, --tensorboard-dir and --history-json, before anything is built."""
    check_load(load, save, finetune, **load_options)
    check_output_dir(save, "--save")
    check_output_dir(tensorboard_dir, "--tensorboard-dir")
    check_output_file(history_json, "--history-json")
