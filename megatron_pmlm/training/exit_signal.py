"""Preemption by signal: SIGTERM / SIGUSR1 (SLURM, `scancel --signal`) and SIGINT (Ctrl-C) ask the
run to save at the current iteration and stop; every rank agrees on it before it acts."""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist

from ..parallel.distributed import collective_device


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
        """All ranks agree (one tiny all-reduce per iteration) so they save together."""
        flag = torch.tensor([float(self.received or 0)])
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = flag.to(collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.agreed = int(flag.item()) or None
        return self.agreed is not None


def signal_text(signum: int | None) -> str:
    """"15", or "2 (SIGINT, Ctrl-C)"; "on another rank" for a rank that did not receive it."""
    if signum is None:
        return "on another rank"
    return f"{signum} (SIGINT, Ctrl-C)" if signum == signal.SIGINT else str(signum)
