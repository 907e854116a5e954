"""Checkpoint directories on disk: which are complete, which is newest, and a CLI to check them.

Kept free of torch and DeepSpeed so that a batch script can ask cheaply (`python -m
megatron_pmlm.checkpoint_files state DIR`) and `tools/verify_checkpoint.py` can check a checkpoint
without loading a model. A checkpoint `DIR/iter_N` is complete when its run_state.json (written by
rank 0 after every rank has saved) exists and every file of its manifest has the size it was saved
with; `latest` names the newest one written, but loading trusts completeness, not `latest`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Sequence

LATEST_FILE = "latest"
RUN_STATE_FILE = "run_state.json"
UNIVERSAL_SUFFIX = "_universal"


def checkpoint_dirs(directory: Path) -> list[tuple[int, Path]]:
    """(iteration, path) of every `iter_N` directory (universal conversions excluded)."""
    if not directory.is_dir():
        return []
    return [(int(m.group(1)), path) for path in directory.iterdir()
            if path.is_dir() and (m := re.fullmatch(r"iter_(\d+)", path.name))]


def checkpoint_problem(tag_dir: Path) -> str | None:
    """Why `tag_dir` cannot be resumed from (None: it is complete): no run state (the save never
    finished), or a file of its manifest missing or of another size than when it was saved."""
    run_state = tag_dir / RUN_STATE_FILE
    if not run_state.is_file():
        return f"{RUN_STATE_FILE} is missing (the save did not finish)"
    try:
        saved = json.loads(run_state.read_text())
        int(saved["iteration"]), int(saved["consumed_samples"])
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return f"{RUN_STATE_FILE} is unreadable ({type(error).__name__}: {error})"
    for name, size in saved.get("files", {}).items():
        path = tag_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size:,} bytes, {size:,} when saved (truncated?)"
    return None


def newest_complete_checkpoint(directory: Path) -> tuple[str | None, list[str]]:
    """The tag of the newest complete checkpoint in `directory` (None if none), and a note for
    every newer one passed over ("DIR/iter_N: why")."""
    skipped = []
    for _, path in sorted(checkpoint_dirs(directory), reverse=True):
        problem = checkpoint_problem(path)
        if problem is None:
            return path.name, skipped
        skipped.append(f"{path}: {problem}")
    return None, skipped


def newest_run_state(directory: Path) -> dict | None:
    """The run state of the newest complete checkpoint in `directory` (None if there is none)."""
    tag, _ = newest_complete_checkpoint(directory)
    return None if tag is None else json.loads((directory / tag / RUN_STATE_FILE).read_text())


def verify(tag_dir: Path, deep: bool = False) -> str | None:
    """`checkpoint_problem`, and with `deep` every file also has to load with torch.load."""
    problem = checkpoint_problem(tag_dir)
    if problem or not deep:
        return problem
    import torch

    for path in sorted(p for p in tag_dir.rglob("*.pt") if p.is_file()):
        try:
            torch.load(path, map_location="cpu", weights_only=False)
        except Exception as error:  # noqa: BLE001 (any unreadable file is the answer)
            return f"{path.relative_to(tag_dir)} does not load ({type(error).__name__}: {error})"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.checkpoint_files",
                                     description="Inspect a pre-training checkpoint directory.")
    commands = parser.add_subparsers(dest="command", required=True)
    state = commands.add_parser("state", help="print 'ITERATION TRAIN_ITERS EXIT_INTERVAL' of the newest "
                                              "complete checkpoint ('0 0 0' if none); for batch scripts")
    state.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    saved = newest_run_state(args.directory)
    if saved is None:
        print(0, 0, 0)
        return 0
    config = saved.get("training_config", {})
    print(int(saved["iteration"]), int(config.get("train_iters", 0)), int(config.get("exit_interval", 0)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
