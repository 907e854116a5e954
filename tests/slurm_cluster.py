"""A private one-node SLURM cluster on this machine, for tests: real munged, slurmctld and slurmd
(Debian's `munge slurmctld slurmd slurm-client`), nothing mocked.

Everything lives in a fresh directory under /tmp (munge key and socket, slurm.conf, state, spool,
logs) and the daemons listen on free ports, so the cluster neither touches nor depends on a
system-wide SLURM or munge, and two runs (or a run beside another cluster) do not collide. The
daemons run in the foreground as children of the test (their pids are known); `stop()` cancels
the jobs, ends those pids and any process still running from this cluster's jobs, and removes the
directory. Clients reach the cluster through `SLURM_CONF` in the environment `env()` returns.

    cluster = SlurmCluster.start()        # installs the packages first if root and missing
    job = cluster.sbatch(["--nodes=1", "script.sh"], env=cluster.env(FOO="1"), cwd=repo)
    cluster.wait_until_done(job, timeout=300)
    cluster.stop()
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from system_packages import apt_install, install_lock

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "scontrol", "squeue", "scancel", "sinfo")
PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
                "BOOT_FAIL", "DEADLINE"}


class SlurmUnavailable(Exception):
    """SLURM cannot be provided here (the message says why): tests skip."""


def _find(name: str) -> str | None:
    return shutil.which(name) or next((str(p) for p in (Path("/usr/sbin") / name, Path("/sbin") / name)
                                       if p.is_file() and os.access(p, os.X_OK)), None)


def missing_programs() -> list[str]:
    return [name for name in DAEMONS + CLIENTS if _find(name) is None]


def ensure_installed() -> None:
    """Install Debian's SLURM and munge packages when a program is missing and we are root with
    apt-get; raise SlurmUnavailable (a skip) when we may not, RuntimeError if installing fails."""
    missing = missing_programs()
    if not missing:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise SlurmUnavailable(
            f"SLURM/munge programs missing ({', '.join(missing)}) and they cannot be installed here "
            f"({'not root' if os.geteuid() else 'no apt-get'}): apt-get install {' '.join(PACKAGES)}")
    with install_lock():  # another test process may be installing them right now
        if missing_programs():
            apt_install(PACKAGES)
    still = missing_programs()
    if still:
        raise RuntimeError(f"installed {' '.join(PACKAGES)} but still missing: {', '.join(still)}")


def _detected_cpus() -> int:
    """The CPU count slurmd itself detects (`slurmd -C`), so the node registers without a mismatch."""
    try:
        output = subprocess.run([_find("slurmd"), "-C"], capture_output=True, text=True, timeout=30).stdout
        match = re.search(r"\bCPUs=(\d+)", output)
        if match:
            return int(match.group(1))
    except (OSError, subprocess.SubprocessError):
        pass
    return os.cpu_count() or 1


def _terminate_with_parent() -> None:
    """In the forked daemon: SIGTERM when the test process dies without tearing down (killed by a
    timeout, say), so no daemon outlives it (Linux prctl PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _alive(pid_file: Path) -> bool:
    try:
        pid = int(pid_file.read_text().split()[0])
        os.kill(pid, 0)
    except (OSError, ValueError, IndexError):
        return False
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split(") ")[-1][:1] != "Z"  # a zombie is dead


def remove_stale_directories() -> None:
    """Directories of earlier test clusters whose test process was killed before its teardown
    (their daemons died with it): none of their pid files names a live process."""
    for directory in Path("/tmp").glob("pmlm-slurm-*"):
        pid_files = [directory / "slurmctld.pid", directory / "slurmd.pid", directory / "munge" / "munged.pid"]
        if directory.is_dir() and not any(_alive(p) for p in pid_files) and \
                time.time() - directory.stat().st_mtime > 60:  # not one being set up right now
            shutil.rmtree(directory, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _wait(predicate, timeout: float, what: str, interval: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class SlurmCluster:
    """One node (this machine, all its CPUs), one partition, root as SlurmUser."""

    def __init__(self, root: Path, node: str, cpus: int):
        self.root, self.node, self.cpus = root, node, cpus
        self.conf = root / "slurm.conf"
        self.munge_socket = root / "munge" / "munge.sock"
        self.processes: dict[str, subprocess.Popen] = {}

    # ------------------------------------------------------------------ start / stop
    @classmethod
    def start(cls, kill_wait: int = 120) -> "SlurmCluster":
        ensure_installed()
        remove_stale_directories()
        root = Path(tempfile.mkdtemp(prefix="pmlm-slurm-", dir="/tmp"))
        # munged insists that every directory above its socket is searchable by all and that
        # none is writable by others.
        root.chmod(0o755)
        node = socket.gethostname().split(".")[0]
        cluster = cls(root, node, _detected_cpus())
        try:
            cluster._start_munge()
            cluster._write_config(kill_wait)
            cluster._start_slurm()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start_munge(self) -> None:
        directory = self.root / "munge"
        directory.mkdir(mode=0o755)
        key = directory / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self._spawn("munged", [_find("munged"), "--foreground", f"--socket={self.munge_socket}",
                               f"--key-file={key}", f"--log-file={directory / 'munged.log'}",
                               f"--pid-file={directory / 'munged.pid'}", f"--seed-file={directory / 'munged.seed'}"])
        _wait(lambda: self.munge_socket.exists() or self._died("munged"), 30, "munged's socket")
        self._check_alive("munged", directory / "munged.log")

    def _write_config(self, kill_wait: int) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir()
        (self.root / "plugstack.conf").write_text("")
        self.conf.write_text("\n".join([
            "ClusterName=pmlmtest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            # A private munge daemon; cred_expire also sets how long a requeued job waits before
            # it may start again (default 120 s).
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            f"PlugStackConfig={self.root / 'plugstack.conf'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "MpiDefault=none",
            "SwitchType=switch/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MailProg=/bin/true",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_interval=2,bf_interval=2",
            "ReturnToService=2",
            "JobRequeue=1",
            # Time between SIGTERM and SIGKILL when a job is requeued or cancelled: the training
            # processes save a checkpoint in between.
            f"KillWait={kill_wait}",
            "MinJobAge=3600",  # finished jobs stay visible to scontrol
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=test Nodes={self.node} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")

    def _start_slurm(self) -> None:
        self._spawn("slurmctld", [_find("slurmctld"), "-D", "-f", str(self.conf)])
        self._spawn("slurmd", [_find("slurmd"), "-D", "-f", str(self.conf), "-N", self.node])

        def node_ready():
            for name in ("slurmctld", "slurmd"):
                self._check_alive(name, self.root / "log" / f"{name}.log")
            try:  # a controller still starting can keep sinfo waiting: ask again, within the deadline
                states = self.run(["sinfo", "-h", "-N", "-o", "%t"], check=False, timeout=10).stdout.split()
            except subprocess.TimeoutExpired:
                return False
            return states and all(state.rstrip("*~#") in ("idle", "mix", "alloc") for state in states)

        _wait(node_ready, 60, f"node {self.node} to be idle in the private cluster", interval=0.5)

    def _spawn(self, name: str, command: list) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self.processes[name] = subprocess.Popen([str(c) for c in command], stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, env=self.env(), start_new_session=True,
                                                preexec_fn=_terminate_with_parent)
        log.close()

    def _died(self, name: str) -> bool:
        return self.processes[name].poll() is not None

    def _check_alive(self, name: str, log: Path) -> None:
        if self._died(name):
            text = (self.root / f"{name}.out").read_text(errors="replace")[-3000:]
            if log.exists():
                text += "\n" + log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} exited with status {self.processes[name].returncode}:\n{text}")

    def stop(self) -> None:
        """Cancel the jobs, end the daemons this object started (by pid) and any process left from
        this cluster's jobs, then remove the cluster's directory."""
        if self.processes.get("slurmctld") and not self._died("slurmctld"):
            try:  # the jobs save and exit on the SIGTERM
                self.run(["scancel", "--user", str(os.getuid())], check=False, timeout=20)
                _wait(lambda: not self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10).stdout.strip(),
                      60, "the jobs to end")
            except (TimeoutError, subprocess.SubprocessError):
                pass  # what is left is killed below
        for name in ("slurmd", "slurmctld", "munged"):
            process = self.processes.get(name)
            if process is None or process.poll() is not None:
                continue
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=20)
        for pid in self.leftover_pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def leftover_pids(self) -> list[int]:
        """Processes started for this cluster's jobs: their environment names this cluster's
        slurm.conf (sbatch exports it into the job), or their command line its directory."""
        marker_env = f"SLURM_CONF={self.conf}".encode()
        marker_cmd = str(self.root).encode()
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if marker_env in environ.split(b"\0") or marker_cmd in cmdline:
                pids.append(int(entry.name))
        return pids

    @property
    def node_address(self) -> str:
        """How the training processes reach the node: its name if it resolves, else 127.0.0.1."""
        try:
            socket.gethostbyname(self.node)
            return self.node
        except OSError:
            return "127.0.0.1"

    # ------------------------------------------------------------------ clients
    def env(self, **extra: str) -> dict[str, str]:
        """This environment without any outer SLURM job's or launcher's variables, pointed at the
        private cluster."""
        drop = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))
               and k not in drop}
        env["SLURM_CONF"] = str(self.conf)
        env.update(extra)
        return env

    def run(self, command: list[str], check: bool = True, timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("env", self.env())
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and result.returncode:
            raise RuntimeError(f"{' '.join(command)} failed ({result.returncode}): {result.stderr.strip()}")
        return result

    def sbatch(self, arguments: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None) -> int:
        result = self.run(["sbatch", "--parsable", *arguments], env=env or self.env(), cwd=cwd)
        return int(result.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, StdOut...)."""
        text = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def job_state(self, job_id: int) -> str:
        return self.job_info(job_id).get("JobState", "UNKNOWN")

    def wait_until_done(self, job_id: int, timeout: float) -> dict[str, str]:
        """Wait (bounded) for the job to reach a final state; returns its `scontrol show job` fields."""
        _wait(lambda: self.job_state(job_id) in FINAL_STATES, timeout, f"job {job_id} to finish", interval=1)
        return self.job_info(job_id)

    def daemon_logs(self, tail: int = 3000) -> str:
        parts = []
        for path in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)
