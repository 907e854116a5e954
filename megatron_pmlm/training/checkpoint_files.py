"""Checkpoint directories on disk: which are complete, which is newest, and a CLI to check them.

Kept free of torch and DeepSpeed so that a batch script can ask cheaply (`python -m
megatron_pmlm.training.checkpoint_files state DIR`) and `tools/verify_checkpoint.py` can check a checkpoint
without loading a model. A checkpoint `DIR/iter_N` is complete when its run_state.json (written by
rank 0 after every rank has saved) exists and every file of its manifest has the size it was saved
with; checked with `contents`, every file also has the checksum it was saved with (resume checks
contents; checkpoints saved before checksums existed are checked by size). `latest` names the
newest one written, but loading trusts completeness, not `latest`.

The manifest, in run_state.json: "files" {name: size} and "checksums" {name: "xxh3_128:HEX"}.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Iterable, Sequence

from . import heartbeat

LATEST_FILE = "latest"
RUN_STATE_FILE = "run_state.json"
UNIVERSAL_SUFFIX = "_universal"
CHECKSUM_ALGORITHM = "xxh3_128"
"""Not cryptographic, and need not be (it catches changed bytes, not an attacker): about 8x
sha256's speed, so hashing a checkpoint costs a fraction of writing it (docs/benchmarks.md)."""
_CHUNK_BYTES = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint to load is missing, incomplete or incompatible; the message says how to proceed."""


def _hasher(algorithm: str):
    if algorithm in ("xxh3_128", "xxh3_64", "xxh64"):
        import xxhash

        return getattr(xxhash, algorithm)()
    if algorithm in hashlib.algorithms_available:
        return hashlib.new(algorithm)
    raise ValueError(f"unknown checksum algorithm {algorithm!r}")


def file_checksum(path: Path, algorithm: str = CHECKSUM_ALGORITHM) -> tuple[int, str]:
    """(bytes read, "ALGORITHM:HEXDIGEST") of the file at `path`, read in chunks."""
    hasher = _hasher(algorithm)
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    size = 0
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            hasher.update(view[:read])
            size += read
    return size, f"{algorithm}:{hasher.hexdigest()}"


def checkpoint_listing(tag_dir: Path) -> dict[str, int]:
    """{relative name: size} of every file in `tag_dir` but the run state: what its manifest covers."""
    return {str(path.relative_to(tag_dir)): path.stat().st_size
            for path in sorted(tag_dir.rglob("*")) if path.is_file() and path.name != RUN_STATE_FILE}


def checksum_share(sizes: dict[str, int], rank: int, world_size: int) -> list[str]:
    """The files rank `rank` of `world_size` hashes at save: every file once, the largest first to
    the least loaded rank, so that the save waits for about the largest file, not the sum. The
    same on every rank given the same `sizes`."""
    loads = [0] * world_size
    mine = []
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        least = loads.index(min(loads))
        loads[least] += sizes[name]
        if least == rank:
            mine.append(name)
    return mine


def file_checksums(tag_dir: Path, names: Iterable[str]) -> dict[str, tuple[int, str]]:
    """{name: (size, checksum)} of the named files of `tag_dir`; each file hashed is progress for the heartbeat."""
    checksums = {}
    for name in names:
        checksums[name] = file_checksum(tag_dir / name)
        heartbeat.progress()
    return checksums


def manifest(checksums: dict[str, tuple[int, str]]) -> dict[str, dict]:
    """The run state's manifest from every file's (size, checksum): "files" keeps the
    {name: size} form that versions before checksums read."""
    names = sorted(checksums)
    return {"files": {name: checksums[name][0] for name in names},
            "checksums": {name: checksums[name][1] for name in names}}


def checkpoint_dirs(directory: Path) -> list[tuple[int, Path]]:
    """(iteration, path) of every `iter_N` directory (universal conversions excluded)."""
    if not directory.is_dir():
        return []
    return [(int(m.group(1)), path) for path in directory.iterdir()
            if path.is_dir() and (m := re.fullmatch(r"iter_(\d+)", path.name))]


def _read_run_state(tag_dir: Path) -> tuple[dict | None, str | None]:
    """(run state, None), or (None, why it cannot be used)."""
    run_state = tag_dir / RUN_STATE_FILE
    if not run_state.is_file():
        return None, f"{RUN_STATE_FILE} is missing (the save did not finish)"
    try:
        saved = json.loads(run_state.read_text())
        int(saved["iteration"]), int(saved["consumed_samples"])
    except (OSError, ValueError, KeyError, TypeError, UnicodeDecodeError) as error:
        return None, f"{RUN_STATE_FILE} is unreadable ({type(error).__name__}: {error})"
    return saved, None


def checkpoint_problem(tag_dir: Path, contents: bool = False) -> str | None:
    """Why `tag_dir` cannot be resumed from (None: it is complete): no run state (the save never
    finished), or a file of its manifest missing or of another size than when it was saved; with
    `contents`, also a file whose bytes no longer have the checksum they were saved with (a
    manifest without checksums, from an older version, is checked by size: see `checksum_note`)."""
    saved, problem = _read_run_state(tag_dir)
    if problem:
        return problem
    sizes = saved.get("files", {})
    for name, size in sizes.items():
        path = tag_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} is {path.stat().st_size:,} bytes, {size:,} when saved (truncated?)"
    if not contents:
        return None
    checksums = saved.get("checksums") or {}
    for name in sorted(checksums):
        algorithm = str(checksums[name]).split(":")[0]
        try:
            _, checksum = file_checksum(tag_dir / name, algorithm)
        except ValueError as error:
            return f"{name}: {error} in the manifest (saved by a newer version?)"
        except OSError as error:
            return f"{name} cannot be read ({type(error).__name__}: {error})"
        if checksum != checksums[name]:
            return f"{name} checksum mismatch (file changed after save)"
    return None


def checksum_note(tag_dir: Path) -> str | None:
    """What a contents check of `tag_dir` could not check: its manifest has no checksums."""
    saved, _ = _read_run_state(tag_dir)
    if saved is None or saved.get("checksums"):
        return None
    if "files" not in saved:
        return f"{tag_dir} has no file manifest (saved by an older version): checked its run state only"
    return f"{tag_dir} has no checksums (saved by an older version): checked sizes only"


def newest_complete_checkpoint(directory: Path, contents: bool = False,
                               first: str | None = None) -> tuple[str | None, list[str]]:
    """The tag of the newest complete checkpoint in `directory` (None if none), and a note for
    every newer one passed over ("DIR/iter_N: why"); with `contents`, checksums are checked too
    (reads every file of each checkpoint it checks). `first`: a tag tried before the others (the
    one `latest` names, for the readers of checkpoint_reader.py)."""
    skipped = []
    candidates = [directory / first] if first else []
    candidates += [path for _, path in sorted(checkpoint_dirs(directory), reverse=True) if path.name != first]
    for path in candidates:
        problem = checkpoint_problem(path, contents)
        if problem is None:
            return path.name, skipped
        skipped.append(f"{path}: {problem}")
    return None, skipped


def newest_verified_checkpoint(directory: Path, first: str | None = None) -> tuple[str | None, list[str], str | None]:
    """What a resume and every reader of a checkpoint load: `newest_complete_checkpoint` with
    checksums, plus what could not be checked of the one chosen (`checksum_note`, None if all)."""
    tag, skipped = newest_complete_checkpoint(directory, contents=True, first=first)
    return tag, skipped, checksum_note(directory / tag) if tag else None


NO_CHECKSUMS_HELP = ("read the checkpoint without checking its files' checksums (they are checked by default: a "
                     "damaged newest checkpoint is passed over for the newest one that verifies)")


def add_no_checksums_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The one definition of `--no-checksums` for every command that reads a checkpoint."""
    parser.add_argument("--no-checksums", dest="checksums", action="store_false", help=NO_CHECKSUMS_HELP)


def newest_run_state(directory: Path) -> dict | None:
    """The run state of the newest complete checkpoint in `directory` (None if there is none),
    checked by size only: cheap enough for a batch script or a settings check before a run."""
    tag, _ = newest_complete_checkpoint(directory)
    return None if tag is None else json.loads((directory / tag / RUN_STATE_FILE).read_text())


def verify(tag_dir: Path, contents: bool = True, deep: bool = False) -> str | None:
    """`checkpoint_problem`, and with `deep` every file also has to load with torch.load."""
    problem = checkpoint_problem(tag_dir, contents)
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
    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.training.checkpoint_files",
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
