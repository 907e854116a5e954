"""Preemption by signal: SIGTERM / SIGUSR1 (SLURM, `scancel --signal`) and SIGINT (Ctrl-C) ask the
run to save at the current iteration and stop; every rank agrees on it before it acts.

The agreement runs every iteration (SLURM's KillWait between SIGTERM and SIGKILL is short), so it
must not stall the device: it is an all-reduce of a host tensor over a CPU (gloo) group, read
through numpy, never a device tensor read back with `.item()`.
"""

from __future__ import annotations

import signal

import numpy as np
import torch
import torch.distributed as dist


class ExitSignal:
    """SIGTERM / SIGUSR1 (SLURM preemption, `scancel --signal`) and SIGINT (Ctrl-C) ask the run to
    save and stop.

    One per process, installed as early as possible (`ExitSignal.install()` first thing in the
    entry point): a signal that arrives while the run is still starting is remembered, not fatal.
    After a first SIGINT the default action is back, so a second Ctrl-C ends the process at once
    (without saving).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
    _instance: "ExitSignal | None" = None

    def __init__(self) -> None:
        self.received: int | None = None
        self.agreed: int | None = None
        """The signal all ranks act on (the highest number received on any rank), once they agreed."""
        self._group = None
        self._group_of: object = None
        """The default process group `_group` was made under (a new one after re-initialisation)."""
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    @classmethod
    def install(cls) -> "ExitSignal":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.received = signum
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)

    def any_rank_received(self) -> bool:
        """All ranks agree (one tiny all-reduce per iteration, over `agreement_group`) so they save
        together. Nothing is read from the device."""
        flag = np.array([self.received or 0], dtype=np.int64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            # The tensor shares the numpy array's memory: the result is read without a torch op.
            dist.all_reduce(torch.from_numpy(flag), op=dist.ReduceOp.MAX, group=self.agreement_group())
        self.agreed = int(flag[0]) or None
        return self.agreed is not None

    def agreement_group(self):
        """The process group the agreement runs over: the default one when it is gloo already,
        else a gloo group of all ranks, made once (a collective call: every rank makes it at the
        same point, the first agreement or `Trainer.__init__`)."""
        default = dist.group.WORLD
        if self._group_of is not default:
            self._group = None if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
            self._group_of = default
        return self._group


def signal_text(signum: int | None) -> str:
    """"15", or "2 (SIGINT, Ctrl-C)"; "on another rank" for a rank that did not receive it."""
    if signum is None:
        return "on another rank"
    return f"{signum} (SIGINT, Ctrl-C)" if signum == signal.SIGINT else str(signum)
