"""Installing what some tests need from outside the venv, the way CI gets it: Debian packages with
apt-get (root only) and Python packages into the running interpreter with pip.

Two test processes (pytest runs of several checkouts on one machine, say) may want the same
packages at once: every install holds one machine-wide lock file, and apt-get also waits for the
dpkg lock of any other apt run instead of failing. Installs are quiet and non-interactive, and
each command has a time limit.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = Path("/tmp/pmlm-test-installs.lock")
APT_TIMEOUT_S = 900   # apt-get update, then the install (downloads included)
PIP_TIMEOUT_S = 900   # a source build (mpi4py compiles against mpicc in a minute or two)


@contextmanager
def install_lock(timeout: float = APT_TIMEOUT_S + PIP_TIMEOUT_S):
    """Hold the machine-wide install lock (waits for another test's install to finish)."""
    with open(LOCK_FILE, "a") as handle:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another install held {LOCK_FILE} for more than {timeout:.0f} s")
                time.sleep(1)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _run(command: list[str], timeout: float, env: dict[str, str] | None = None) -> None:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env,
                                stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as error:
        raise RuntimeError(f"{' '.join(command)} did not finish in {timeout:.0f} s") from error
    if result.returncode:
        raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}):\n{result.stdout[-2000:]}"
                           f"\n{result.stderr[-2000:]}")


def apt_install(packages: list[str] | tuple[str, ...], recommends: bool = True) -> None:
    """`apt-get update` and `apt-get install` of `packages` (the caller checks that we are root and
    holds install_lock); RuntimeError when either fails or runs out of time."""
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wait_for_dpkg = ["-o", "DPkg::Lock::Timeout=300"]  # another apt run: wait, do not fail
    _run(["apt-get", "-qq", *wait_for_dpkg, "update"], APT_TIMEOUT_S, env)
    _run(["apt-get", "install", "-y", "-qq", *wait_for_dpkg, "-o", "Dpkg::Options::=--force-confdef",
          "-o", "Dpkg::Options::=--force-confold", *([] if recommends else ["--no-install-recommends"]),
          *packages], APT_TIMEOUT_S, env)


def pip_install(requirements: list[str], *options: str) -> None:
    """pip install into the running interpreter's environment (the venv the tests run in)."""
    _run([sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", *options,
          *requirements], PIP_TIMEOUT_S)
