"""Helpers shared by the test modules (a plain module: conftest files are not importable by name
once several test folders have one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


def run_module(module: str, *args: str, timeout: int = 300, nproc: int = 1,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m module args` (or under torchrun with `nproc` processes), output captured; `env`
    values of None unset those variables."""
    command = [sys.executable, "-m", module, *args] if nproc == 1 else [*torchrun(nproc), "-m", module, *args]
    full_env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", **(env or {})}
    full_env = {key: value for key, value in full_env.items() if value is not None}
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=full_env)


def torchrun(nproc: int) -> list[str]:
    """The launcher for `nproc` local processes. --standalone: the agent binds its store on a port
    of its own choosing and the workers use it, so no port is picked here and then lost to another
    process before torchrun binds it (a race that fails runs on a busy machine)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def plotted_panels(runs: list[Path], output: Path, labels: list[str] | None = None) -> dict[str, list[str]]:
    """tools/plot_curves.py on real runs: the PNG it writes opens, every panel has a legend; returns
    panel title -> legend entries."""
    from matplotlib import image

    from tools import plot_curves

    figure = plot_curves.plot(runs, None, output, labels)
    assert image.imread(output).ndim == 3  # a PNG that opens
    panels = {}
    for axis in figure.axes:
        legend = axis.get_legend()
        assert legend is not None, f"panel {axis.get_title()} has no legend"
        panels[axis.get_title()] = [text.get_text() for text in legend.get_texts()]
    return panels
