"""Hang detection: every rank records where it is (its phase) and when it last made real progress in
a small file per rank, and `python -m megatron_pmlm.training.heartbeat check DIR ...` tells a batch
script whether the run stalled (no rank progressed for the timeout), naming each rank's phase.

What the NCCL/gloo timeouts miss is covered: a stuck data read, a deadlock outside a collective, a
hang during start-up, a universal conversion or a save. A beat marks real progress only: long
phases beat at their own sub-step boundaries (each validation batch, each checkpoint file, each
universal-conversion unit); no background thread beats on its own, so a hung save stays visible.

A beat costs a clock read; the file (a few hundred bytes, renamed over the old one, no fsync) is
rewritten at most once per `MIN_WRITE_INTERVAL_SECONDS` while the phase only changes its numbers
("step 56" -> "step 57"), at once when it changes its kind ("step 57" -> "saving"). So in a hang the
step a file names is at most that interval behind the one that hung. Nothing here reads the device.

Files: DIR/rank-RRRRR.json with rank, world_size, host, pid, phase, iteration, progress_time (the
time.time() of the last real progress), write_time, slowest_iteration_seconds (the longest "step N"
phase so far, host clock), started. Checking compares these times with the checker's clock: hosts
are expected to agree to within seconds (NTP).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

MIN_WRITE_INTERVAL_SECONDS = 1.0
"""A beat whose phase differs from the written one only in its numbers waits this long for its write."""

DEFAULT_MIN_TIMEOUT_SECONDS = 600.0
"""The automatic timeout's floor (issue 35: at least 600 s)."""

DEFAULT_ITERATION_FACTOR = 3.0
"""The automatic timeout: this many times the slowest iteration any rank reported."""

STEP_PHASE = re.compile(r"step \d+$")
DONE_PHASE = "done"
"""What a rank records once its training returned: never counted as stalled."""


def heartbeat_file(folder: str | os.PathLike, rank: int) -> Path:
    return Path(folder) / f"rank-{rank:05d}.json"


def phase_kind(phase: str) -> str:
    """The phase less its numbers: a change of kind is written at once, a change of numbers is rate-limited."""
    return re.sub(r"\d+", "N", phase)


class Heartbeat:
    """This rank's heartbeat file in `folder` (created if missing)."""

    def __init__(self, folder: str | os.PathLike, rank: int, world_size: int):
        self.folder = Path(folder)
        self.rank = rank
        self.world_size = world_size
        self.path = heartbeat_file(folder, rank)
        self.host = socket.gethostname()
        self.pid = os.getpid()
        self.started = time.time()
        self.phase = "start-up"
        self.iteration: int | None = None
        self.progress_time = self.started
        self.phase_start = self.started
        self.slowest_iteration_seconds = 0.0
        self.written_kind: str | None = None
        self.write_time = 0.0
        self.write_failed = False
        self.folder.mkdir(parents=True, exist_ok=True)
        self.write()

    def beat(self, phase: str, iteration: int | None = None) -> None:
        """Real progress, now in `phase` (e.g. "step 57", "saving iter_0000056: checksums", "validation");
        `iteration` None keeps the last one given."""
        now = time.time()
        if phase != self.phase:
            if STEP_PHASE.match(self.phase):
                self.slowest_iteration_seconds = max(self.slowest_iteration_seconds, now - self.phase_start)
            self.phase, self.phase_start = phase, now
        if iteration is not None:
            self.iteration = iteration
        self.progress_time = now
        if phase_kind(phase) != self.written_kind or now - self.write_time >= MIN_WRITE_INTERVAL_SECONDS:
            self.write(now)

    def record(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "host": self.host, "pid": self.pid,
                "phase": self.phase, "iteration": self.iteration, "progress_time": self.progress_time,
                "write_time": self.write_time, "slowest_iteration_seconds": self.slowest_iteration_seconds,
                "started": self.started}

    def write(self, now: float | None = None) -> None:
        """The file, replaced atomically (a temporary file beside it, created with the umask's mode, then
        renamed). A failed write is reported once and training goes on: the checker then sees no progress
        from this rank, which is what a rank that cannot write its files amounts to."""
        self.write_time = time.time() if now is None else now
        self.written_kind = phase_kind(self.phase)
        temporary = self.path.with_name(f".{self.path.name}.{self.pid}.tmp")
        try:
            with open(temporary, "w", encoding="utf-8") as handle:
                handle.write(json.dumps(self.record()))
            os.replace(temporary, self.path)
        except OSError as error:
            if not self.write_failed:
                print(f"warning: rank {self.rank} cannot write its heartbeat {self.path}: {error}", file=sys.stderr)
            self.write_failed = True


# -------------------------------------------------------------------------------------------------
# This process's heartbeat: started by the entry point, beaten from wherever progress happens
# -------------------------------------------------------------------------------------------------

_current: Heartbeat | None = None


def start(folder: str | os.PathLike | None, rank: int | None = None, world_size: int | None = None) -> Heartbeat | None:
    """This process's heartbeat in `folder` (None: off); rank and world size default to the launcher's.
    A folder that cannot be created raises ConfigError naming it."""
    global _current
    if folder is None:
        _current = None
        return None
    from ..config import ConfigError
    from ..parallel.distributed import launcher_rank, launcher_world_size

    rank = launcher_rank() if rank is None else rank
    world_size = launcher_world_size() if world_size is None else world_size
    try:
        _current = Heartbeat(folder, rank, world_size)
    except OSError as error:
        raise ConfigError(f"--heartbeat-dir {folder}: cannot create its heartbeat file ({error.strerror or error})") \
            from None
    return _current


def beat(phase: str, iteration: int | None = None) -> None:
    """`Heartbeat.beat` on this process's heartbeat; nothing when there is none (no --heartbeat-dir)."""
    if _current is not None:
        _current.beat(phase, iteration)


def progress() -> None:
    """Real progress inside the current phase (one more file hashed, one more unit converted)."""
    if _current is not None:
        _current.beat(_current.phase, _current.iteration)


def compiling() -> None:
    """A new compiled shape (models/compiled.py calls it): the compilation, until the next beat."""
    beat("compiling")


def current() -> Heartbeat | None:
    return _current


@contextlib.contextmanager
def beat_after_each_call(owner: Any, method: str, phase: str) -> Iterator[None]:
    """Within the block, every call of `owner.method` (an instance's, e.g. DeepSpeed's checkpoint engine's
    `save`, called once per file) is followed by a beat in `phase`; the block begins with one."""
    beat(phase)
    original = getattr(owner, method, None)
    if _current is None or original is None:
        yield
        return

    def beating(*args, **kwargs):
        result = original(*args, **kwargs)
        beat(phase)
        return result

    own = vars(owner).get(method)  # an attribute of the instance itself (else the class's method)
    setattr(owner, method, beating)
    try:
        yield
    finally:
        if own is None:
            delattr(owner, method)
        else:
            setattr(owner, method, own)


def add_heartbeat_argument(group: argparse._ArgumentGroup) -> None:
    """--heartbeat-dir, for every command that trains through the Trainer."""
    group.add_argument("--heartbeat-dir", default=None,
                       help="each rank records its phase and last progress in DIR/rank-RRRRR.json (created), for "
                            "`python -m megatron_pmlm.training.heartbeat check` to detect a hung run (default: off)")


# -------------------------------------------------------------------------------------------------
# Checking
# -------------------------------------------------------------------------------------------------

@dataclass
class RankReport:
    rank: int
    record: dict[str, Any] | None
    """The rank's file as written since `since`; None: it never reported (missing, stale or unreadable)."""


def read_reports(folder: Path, ranks: int, since: float) -> list[RankReport]:
    reports = []
    for rank in range(ranks):
        record = None
        try:
            record = json.loads(heartbeat_file(folder, rank).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            pass  # missing, or unreadable: as good as never reported
        if not isinstance(record, dict) or not _is_number(record.get("write_time")) or \
                not _is_number(record.get("progress_time")) or record["write_time"] < since:
            record = None
        reports.append(RankReport(rank, record))
    return reports


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def effective_timeout(reports: list[RankReport], timeout: float, min_timeout: float, iteration_factor: float) -> float:
    """`timeout` if > 0, else max(`min_timeout`, `iteration_factor` x the slowest iteration any rank reported)."""
    if timeout > 0:
        return timeout
    slowest = max([float(r.record.get("slowest_iteration_seconds") or 0.0) for r in reports if r.record]
                  + [0.0])
    return max(min_timeout, iteration_factor * slowest)


def stalled_lines(reports: list[RankReport], now: float, since: float, timeout: float) -> list[str]:
    """One line per unfinished rank when no unfinished rank progressed within `timeout` (oldest progress
    first, so the rank that stopped first leads); [] when the run is healthy."""
    waiting = [r for r in reports if not (r.record and r.record.get("phase") == DONE_PHASE)]
    if not waiting:
        return []
    last_progress = {r.rank: r.record["progress_time"] if r.record else since for r in waiting}
    if now - max(last_progress.values()) < timeout:
        return []
    lines = []
    for report in sorted(waiting, key=lambda r: (last_progress[r.rank], r.rank)):
        age = now - last_progress[report.rank]
        if report.record is None:
            lines.append(f"rank {report.rank} never reported (start-up) for {age:.0f} s")
        else:
            record = report.record
            lines.append(f"rank {report.rank} (host {record.get('host', '?')}, pid {record.get('pid', '?')}) stalled "
                         f"in phase '{record.get('phase', '?')}' for {age:.0f} s")
    return lines


def status_lines(reports: list[RankReport], now: float) -> list[str]:
    lines = []
    for report in reports:
        record = report.record
        if record is None:
            lines.append(f"rank {report.rank}: never reported")
        else:
            lines.append(f"rank {report.rank} (host {record.get('host', '?')}, pid {record.get('pid', '?')}): phase "
                         f"'{record.get('phase', '?')}', last progress {now - record['progress_time']:.0f} s ago, "
                         f"slowest iteration {float(record.get('slowest_iteration_seconds') or 0.0):.1f} s")
    return lines


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2 (argparse would add its usage)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="python -m megatron_pmlm.training.heartbeat", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    check = commands.add_parser("check", help="exit 0 (silent) while healthy; exit 1 naming each stalled rank")
    status = commands.add_parser("status", help="print every rank's phase and the age of its last progress")
    for sub in (check, status):
        sub.add_argument("folder", metavar="DIR", help="the run's --heartbeat-dir")
        sub.add_argument("--ranks", type=int, required=True, help="the world size: ranks 0..N-1 are expected")
        sub.add_argument("--since", type=float, required=sub is check, default=0.0,
                         help="this step's start (epoch seconds, e.g. `date +%%s`): files written before it are "
                              "stale, and a rank without a file has not reported since then"
                              + ("" if sub is check else " (default: 0)"))
    check.add_argument("--timeout", type=float, default=0.0,
                       help="seconds without progress on every rank that make a hang; 0: automatic, max(--min-timeout, "
                            "--iteration-factor x the slowest iteration reported) (default: 0)")
    check.add_argument("--min-timeout", type=float, default=DEFAULT_MIN_TIMEOUT_SECONDS,
                       help=f"the automatic timeout's floor (default: {DEFAULT_MIN_TIMEOUT_SECONDS:g})")
    check.add_argument("--iteration-factor", type=float, default=DEFAULT_ITERATION_FACTOR,
                       help=f"the automatic timeout's multiple of the slowest iteration (default: "
                            f"{DEFAULT_ITERATION_FACTOR:g})")
    return parser


def input_problem(args: argparse.Namespace, now: float) -> str | None:
    if args.ranks <= 0:
        return f"--ranks must be positive, got {args.ranks}"
    if not (args.since >= 0) or args.since > now + 60:
        return f"--since {args.since:g} is not a past time in epoch seconds (now {now:.0f})"
    if args.command == "check":
        if not (args.timeout >= 0):
            return f"--timeout must be >= 0 (0: automatic), got {args.timeout:g}"
        if not (args.min_timeout > 0):
            return f"--min-timeout must be positive, got {args.min_timeout:g}"
        if not (args.iteration_factor > 0):
            return f"--iteration-factor must be positive, got {args.iteration_factor:g}"
    folder = Path(args.folder)
    if folder.exists() and not folder.is_dir():
        return f"{folder} is not a folder"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """0: healthy (check prints nothing); 1: stalled (one line per rank); 2: bad input (one line).
    A folder that does not exist yet is a run whose ranks have not reported."""
    args = build_parser().parse_args(argv)
    now = time.time()
    problem = input_problem(args, now)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    reports = read_reports(Path(args.folder), args.ranks, args.since)
    if args.command == "status":
        print("\n".join(status_lines(reports, now)))
        return 0
    timeout = effective_timeout(reports, args.timeout, args.min_timeout, args.iteration_factor)
    lines = stalled_lines(reports, now, args.since, timeout)
    if lines:
        print("\n".join(lines))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
