"""One run per `--save` directory: the first process of a run (global rank 0) takes an advisory
lock on `SAVE_DIR/.pmlm-run.lock` before anything is written there, and holds it for the run.

Two runs given the same `--save` (a double `sbatch`, a second tmux pane) would otherwise delete
each other's in-progress saves and leave a directory mixing two runs' checkpoints. The lock is
`flock` on a file in the directory: the kernel releases it when the process ends, however it ends
(a `kill -9` leaves nothing to clean; the file stays, unlocked). The file holds the holder record
(JSON: host, pid, start time, SLURM job/step/restart count, command), so a second run is refused
in one line naming the holder.

Shared file systems: NFS v4 implements `flock` with byte-range locks on the server, so the lock
holds across nodes; a node that dies keeps it until the server's lease expires (90 s by default).
A SLURM requeue or an in-job restart of the same job then finds the lock taken by its own job's
previous step: when the holder record names this process's SLURM_JOB_ID (on another host, or
another pid), the lock is retried for up to `SAME_JOB_WAIT_SECONDS` before the run is refused.
Lustre: mount with `flock` (cluster-wide); `localflock` locks per node only (two nodes would both
get the lock), `noflock` makes `flock` fail. Where locks are unsupported the run is refused naming
the error; `--no-lock` runs without the lock, with a warning.

The lock file is not a checkpoint (a dot file, not `iter_N`): retention, `latest` and
tools/verify_checkpoint.py never see it.
"""

from __future__ import annotations

import argparse
import atexit
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

LOCK_FILE = ".pmlm-run.lock"
SAME_JOB_WAIT_SECONDS = 300.0
"""How long a run waits for a lock held by its own SLURM job (a requeue, an in-job restart): above
NFS v4's default 90 s lease and Lustre's lock timeouts, so a dead node's lock has expired by then."""
RETRY_SECONDS = 5.0

_held: dict[str, tuple[int, Path, bool]] = {}
"""Locks this process holds: resolved directory -> (file descriptor, directory, whether this
process created the directory)."""


class SaveDirInUse(RuntimeError):
    """Another run holds the lock of a `--save` directory, or it cannot be locked."""


def add_no_lock_argument(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """The one definition of `--no-lock` (pretrain, finetune_s2s)."""
    parser.add_argument("--no-lock", dest="lock", action="store_false",
                        help=f"do not lock --save ({LOCK_FILE}, one run per directory) - for file systems "
                             "without locks (Lustre mounted without 'flock'); nothing then stops a second run "
                             "from writing there too")


def holder_record() -> dict[str, Any]:
    """Who this process is, for the one refused next: written into the lock file once it is held."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
            "slurm_restart_count": os.environ.get("SLURM_RESTART_COUNT"), "command": " ".join(sys.argv)}


def read_holder(directory: Path) -> dict[str, Any]:
    """The holder record in `directory`'s lock file ({} when unreadable: a holder still writing it)."""
    try:
        record = json.loads((Path(directory) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def describe_holder(record: dict[str, Any]) -> str:
    if not record:
        return "a holder that has not written its record yet"
    parts = [f"host {record.get('host', '?')}", f"pid {record.get('pid', '?')}", f"started {record.get('started', '?')}"]
    if record.get("slurm_job_id"):
        parts.append(f"SLURM job {record['slurm_job_id']}"
                     + (f" step {record['slurm_step_id']}" if record.get("slurm_step_id") else ""))
    return ", ".join(parts)


def _same_job(record: dict[str, Any]) -> bool:
    """The holder is an earlier step of this very SLURM job (a requeue or an in-job restart)."""
    job = os.environ.get("SLURM_JOB_ID")
    return bool(job) and record.get("slurm_job_id") == job and \
        (record.get("host"), record.get("pid")) != (socket.gethostname(), os.getpid())


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as error:
        if error.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def warn(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def lock_save_dir(save: str | os.PathLike, enabled: bool = True, log: Callable[[str], None] = warn,
                  wait_for_same_job: float | None = None) -> None:
    """Take `save`'s lock for the rest of this process (created if need be), or raise SaveDirInUse
    naming the holder. A directory this call created that holds nothing else when the process
    exits (a run refused later) is removed again."""
    directory = Path(save)
    if not enabled:
        log(f"warning: --no-lock: {directory} is not locked; nothing stops a second run from writing there too")
        return
    key = os.path.realpath(directory)
    if key in _held:
        return
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    wait = SAME_JOB_WAIT_SECONDS if wait_for_same_job is None else wait_for_same_job
    deadline = None
    try:
        while not _try_lock(fd):
            record = read_holder(directory)
            if not _same_job(record):
                raise SaveDirInUse(f"--save {directory} is in use by another run ({describe_holder(record)}; "
                                   f"lock {path}): one run per --save directory")
            if deadline is None:
                deadline = time.monotonic() + wait
                log(f"--save {directory} is locked by an earlier step of this SLURM job ({describe_holder(record)}): "
                    f"waiting up to {wait:g} s for its lock to expire")
            if time.monotonic() >= deadline:
                raise SaveDirInUse(f"--save {directory} is still locked by an earlier step of this SLURM job "
                                   f"({describe_holder(record)}; lock {path}) after {wait:g} s: is it still running?")
            time.sleep(min(RETRY_SECONDS, max(0.0, deadline - time.monotonic())))
    except SaveDirInUse:
        os.close(fd)
        _remove_if_only_lock(directory, created)
        raise
    except OSError as error:
        os.close(fd)
        _remove_if_only_lock(directory, created)
        raise SaveDirInUse(f"--save {directory} cannot be locked ({error.strerror or error}: the file system does "
                           "not support flock, e.g. Lustre without the 'flock' mount option); pass --no-lock to run "
                           "without the lock") from None
    record = json.dumps(holder_record(), indent=1).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    os.fsync(fd)
    if not _held:
        atexit.register(release_save_dirs)
    _held[key] = (fd, directory, created)


def release_save_dir(save: str | os.PathLike) -> None:
    """Give the lock back (the kernel does it when the process ends otherwise); a directory the
    lock created and nothing else used goes too (a run refused after taking it)."""
    held = _held.pop(os.path.realpath(save), None)
    if held is not None:
        fd, directory, created = held
        _remove_if_only_lock(directory, created)
        os.close(fd)


def release_save_dirs() -> None:
    """Every lock this process holds: at the end of a command's main (and at exit)."""
    for key in list(_held):
        release_save_dir(key)


def _remove_if_only_lock(directory: Path, created: bool) -> None:
    """Leave nothing behind for a run refused after it took the lock (bad input found later)."""
    if not created:
        return
    try:
        if [p.name for p in directory.iterdir()] == [LOCK_FILE]:
            (directory / LOCK_FILE).unlink()
            directory.rmdir()
    except OSError:
        pass
