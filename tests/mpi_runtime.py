"""Open MPI and mpi4py for tests of the MPI paths (data_prep.preprocess under mpirun): Debian's
openmpi (`openmpi-bin libopenmpi-dev`, installed with apt-get when root and missing) and mpi4py
from PyPI into the running venv (its binary wheel, which loads that Open MPI's libmpi; or, where
there is no wheel, built against its mpicc), nothing mocked.

    ensure_mpi()                          # installs what is missing; MpiUnavailable (a skip) if it may not
    subprocess.run([*mpirun(2), sys.executable, "-m", ...], env=mpi_env(), timeout=...)

mpirun runs the ranks on this machine only, as root too, more ranks than cores allowed, with
settings that work in a container (shared memory between the ranks, no network transports, no
ssh needed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

from system_packages import apt_install, install_lock, pip_install

PACKAGES = ("openmpi-bin", "libopenmpi-dev")   # mpirun; mpicc and the headers mpi4py builds with
PROGRAMS = ("mpirun", "mpicc")
MPI4PY = "mpi4py>=3.1"                         # pyproject.toml's optional extra `mpi`


class MpiUnavailable(Exception):
    """MPI cannot be provided here (the message says why): tests skip."""


def missing_programs() -> list[str]:
    return [name for name in PROGRAMS if shutil.which(name) is None]


def has_mpi4py() -> bool:
    """mpi4py importable by the interpreter the tests run (checked in a child: no MPI initialised here)."""
    return subprocess.run([sys.executable, "-c", "import mpi4py"], capture_output=True, timeout=60).returncode == 0


def ensure_mpi() -> None:
    """Install Open MPI (root with apt-get) and mpi4py (pip) when missing; MpiUnavailable when the
    MPI programs are missing and cannot be installed, RuntimeError when an install fails."""
    if not missing_programs() and has_mpi4py():
        return
    with install_lock():
        missing = missing_programs()
        if missing:
            if os.geteuid() != 0 or not shutil.which("apt-get"):
                raise MpiUnavailable(
                    f"MPI programs missing ({', '.join(missing)}) and they cannot be installed here "
                    f"({'not root' if os.geteuid() else 'no apt-get'}): apt-get install {' '.join(PACKAGES)}, "
                    f"then `make mpi` (pip install -e '.[mpi]')")
            apt_install(PACKAGES, recommends=False)
            still = missing_programs()
            if still:
                raise RuntimeError(f"installed {' '.join(PACKAGES)} but still missing: {', '.join(still)}")
        if not has_mpi4py():
            # PyPI's binary wheel (seconds; it loads the system's libmpi, Open MPI's here), else a
            # build from source against mpicc (minutes).
            pip_install([MPI4PY])
            if not has_mpi4py():
                raise RuntimeError(f"pip installed {MPI4PY} but {sys.executable} cannot import it")


def mpirun(ranks: int) -> list[str]:
    """mpirun starting `ranks` processes on this machine."""
    command = [shutil.which("mpirun") or "mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        command.append("--allow-run-as-root")  # Open MPI refuses root without it
    return command


def mpi_env(**extra: str) -> dict[str, str]:
    """This environment without an outer SLURM job's or MPI launcher's variables (Open MPI would
    launch through srun, data_prep would take SLURM's ranks), with container-proof settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMIX_", "PMI_"))}
    env.update({
        "OMPI_MCA_btl": "self,vader",                          # one machine: shared memory only
        "OMPI_MCA_btl_vader_single_copy_mechanism": "none",    # CMA is often refused in containers
        "OMPI_MCA_pml": "ob1",                                 # not UCX (no fabric here)
        "OMPI_MCA_plm_rsh_agent": "",                          # no ssh: every rank is local
        "OMPI_MCA_rmaps_base_oversubscribe": "1",
    })
    env.update(extra)
    return env
