"""A private N-node SLURM cluster (2 unless asked) on this machine, for tests: each node is a network namespace
the test creates (with its own hostname, in a UTS namespace of its own for every process started
there), the nodes joined by veth pairs to a bridge that lives in a third test-created namespace.
Real munged, slurmctld and one slurmd per node (Debian's packages, as tests/slurm_cluster.py),
nothing mocked.

    bridge namespace  pmlm<PID>-<K>-br:     br0 <- port1, port2
    node namespace    pmlm<PID>-<K>-node1:  lo, pmlmnet 10.77.0.1/24   munged, slurmctld, slurmd, clients
    node namespace    pmlm<PID>-<K>-node2:  lo, pmlmnet 10.77.0.2/24   slurmd
    ...               (node N: 10.77.0.N, up to 200 nodes)

Every address lives inside those namespaces (the host's own network is never used), so the fixed
SLURM ports and the subnet cannot collide with the host or with another such cluster. The node
names (pmlm-node1, pmlm-node2) resolve through the node's hosts file, bind-mounted over /etc/hosts
in each process's private mount namespace, and `hostname` there says the node's name. As in
Debian's default /etc/hosts, a node's own name resolves to 127.0.1.1 there and the other node's to
its address: what makes gloo, left to itself, offer its peers a loopback address, and
GLOO_SOCKET_IFNAME necessary. The network interface of every node is called `pmlmnet` (what
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME select); `interface_bytes()` reads its counters. Clients
(`sbatch`, `scontrol`...) run on node 1, as on a login node that is also the first compute node.
The file system is shared by all nodes (the same machine), as a cluster's shared storage is.

    cluster = MultiNodeCluster.start()    # SlurmUnavailable (a skip) when it cannot be built here
    cluster = MultiNodeCluster.start(nodes=3, slurmd_timeout=5)   # 3 nodes, DOWN after 5 s of silence
    cluster.fail_node("pmlm-node2")       # link down + SIGKILL of everything in it: a dead node
    job = cluster.sbatch(["--nodes=2", "script.sh"], env=cluster.env(FOO="1"), cwd=repo)
    cluster.wait_until_done(job, timeout=300)
    cluster.stop()                        # also at exit; namespaces, links, daemons, directory

Teardown: `stop()` cancels the jobs, ends the daemons (by pid) and every process left from the
cluster's jobs, deletes the namespaces (which removes the veth pairs and the bridge) and the
directory; it is registered with atexit too. The daemons get SIGTERM when the test process dies
(PR_SET_PDEATHSIG); the namespaces, directory and job processes of a test process that was killed
before its teardown are removed at the next start (`remove_stale`).
"""

from __future__ import annotations

import atexit
import itertools
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from slurm_cluster import SlurmCluster, SlurmUnavailable, _detected_cpus, _find, _terminate_with_parent, _wait, \
    ensure_installed

PREFIX = "pmlm"                       # namespaces: pmlm<PID>-<K>-br, pmlm<PID>-<K>-node<N>
DIRECTORY_PREFIX = "pmlm-slurm2n-"    # the cluster's directory under /tmp
INTERFACE = "pmlmnet"                 # each node's interface to the bridge
SUBNET = "10.77.0"                    # node N: 10.77.0.N/24, inside the namespaces only
NODES = ("pmlm-node1", "pmlm-node2")  # the default two nodes; node_names(n) for more


def node_names(count: int) -> tuple[str, ...]:
    return tuple(f"pmlm-node{i}" for i in range(1, count + 1))
NAMESPACE_NAME = re.compile(rf"^{PREFIX}(\d+)-\d+-(br|node\d+)$")
_CLUSTERS = itertools.count(1)      # K: clusters started by this process

# In the node's network namespace: a private mount and UTS namespace where /etc/hosts names the
# nodes and `hostname` is the node's, then the command itself (exec: its pid is the Popen's).
_ENTER = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'


def _ip(*arguments: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([_find("ip") or "ip", *arguments], capture_output=True, text=True, timeout=30)
    if check and result.returncode:
        raise RuntimeError(f"ip {' '.join(arguments)} failed ({result.returncode}): {result.stderr.strip()}")
    return result


def _namespaces() -> list[str]:
    result = _ip("netns", "list", check=False)
    return [line.split()[0] for line in result.stdout.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_processes_of(conf: Path) -> None:
    """Processes whose environment names this slurm.conf (daemons and job steps of that cluster)."""
    marker = f"SLURM_CONF={conf}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    os.kill(int(entry.name), signal.SIGKILL)
            except OSError:
                pass


def remove_stale() -> None:
    """Namespaces, directories and left-over processes of earlier test processes that were killed
    before their teardown (the owning test process, named in the namespace, is gone)."""
    for directory in Path("/tmp").glob(f"{DIRECTORY_PREFIX}*"):
        owner = (directory / "owner.pid")
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            if time.time() - directory.stat().st_mtime > 60:
                shutil.rmtree(directory, ignore_errors=True)
            continue
        if not _pid_alive(pid):
            _kill_processes_of(directory / "slurm.conf")
            shutil.rmtree(directory, ignore_errors=True)
    for name in _namespaces():
        match = NAMESPACE_NAME.match(name)
        if match and not _pid_alive(int(match[1])):
            _ip("netns", "delete", name, check=False)


def check_possible() -> None:
    """SlurmUnavailable (a skip) with the reason when namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise SlurmUnavailable("the 2-node SLURM cluster needs root (network namespaces, veth pairs, mounts)")
    for program in ("ip", "nsenter", "unshare", "mount", "hostname"):
        if _find(program) is None:
            raise SlurmUnavailable(f"the 2-node SLURM cluster needs `{program}` (iproute2 / util-linux)")


class MultiNodeCluster(SlurmCluster):
    """N nodes (each with this machine's CPU count), one partition, root as SlurmUser."""

    def __init__(self, root: Path, cpus: int, nodes: tuple[str, ...] = NODES):
        super().__init__(root, nodes[0], cpus)
        self.nodes = nodes
        tag = f"{PREFIX}{os.getpid()}-{next(_CLUSTERS)}"
        self.bridge_namespace = f"{tag}-br"
        self.namespaces = {node: f"{tag}-{node.split('-')[-1]}" for node in nodes}
        self.addresses = {node: f"{SUBNET}.{i + 1}" for i, node in enumerate(nodes)}
        self.hosts = {node: root / f"hosts-{node}" for node in nodes}
        self.failed: set[str] = set()   # nodes taken down by fail_node()
        self.created: list[str] = []   # namespaces made by this object, deleted by stop()
        self.stopped = False

    # ------------------------------------------------------------------ start / stop
    @classmethod
    def start(cls, kill_wait: int = 120, nodes: int = 2, slurmd_timeout: int | None = None) -> "MultiNodeCluster":
        """`nodes` nodes; `slurmd_timeout`: SlurmdTimeout (seconds of silence before slurmctld marks a
        node DOWN; SLURM's default 300 when None)."""
        if not 2 <= nodes <= 200:
            raise ValueError(f"nodes must be 2..200, got {nodes}")
        check_possible()
        ensure_installed()
        remove_stale()
        root = Path(tempfile.mkdtemp(prefix=DIRECTORY_PREFIX, dir="/tmp"))
        root.chmod(0o755)  # munged: every directory above its socket searchable by all
        (root / "owner.pid").write_text(str(os.getpid()))
        cluster = cls(root, _detected_cpus(), node_names(nodes))
        atexit.register(cluster.stop)
        try:
            cluster._make_network()
            cluster._start_munge()
            cluster._write_config(kill_wait, slurmd_timeout)
            cluster._start_slurm()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _make_network(self) -> None:
        try:
            _ip("netns", "add", self.bridge_namespace)
        except RuntimeError as error:
            raise SlurmUnavailable(f"cannot create a network namespace here: {error}") from error
        self.created.append(self.bridge_namespace)
        _ip("-n", self.bridge_namespace, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_namespace, "link", "set", "br0", "up")
        for i, node in enumerate(self.nodes, start=1):
            namespace = self.namespaces[node]
            _ip("netns", "add", namespace)
            self.created.append(namespace)
            _ip("-n", namespace, "link", "set", "lo", "up")
            _ip("-n", namespace, "link", "add", INTERFACE, "type", "veth", "peer", "name", f"port{i}",
                "netns", self.bridge_namespace)
            _ip("-n", self.bridge_namespace, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{self.addresses[node]}/24", "dev", INTERFACE)
            _ip("-n", namespace, "link", "set", INTERFACE, "up")
        for node, hosts in self.hosts.items():
            hosts.write_text("127.0.0.1 localhost\n" + "".join(
                f"{'127.0.1.1' if n == node else self.addresses[n]} {n}\n" for n in self.nodes))
            hosts.chmod(0o644)

    def on(self, node: str) -> list[str]:
        """The command prefix that runs a program on `node`: its network namespace, its hostname,
        its /etc/hosts."""
        # nsenter rather than `ip netns exec`, which remounts /sys (slurmd wants /sys/fs/cgroup).
        return [_find("nsenter"), f"--net=/run/netns/{self.namespaces[node]}", _find("unshare"), "--uts", "--mount",
                "--propagation", "private", "sh", "-c", _ENTER, "sh", str(self.hosts[node]), node]

    def _start_munge(self) -> None:
        directory = self.root / "munge"
        directory.mkdir(mode=0o755)
        key = directory / "munge.key"
        key.write_bytes(os.urandom(128))
        key.chmod(0o400)
        self._spawn_on(self.nodes[0], "munged", [
            _find("munged"), "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
            f"--log-file={directory / 'munged.log'}", f"--pid-file={directory / 'munged.pid'}",
            f"--seed-file={directory / 'munged.seed'}"])
        _wait(lambda: self.munge_socket.exists() or self._died("munged"), 30, "munged's socket")
        self._check_alive("munged", directory / "munged.log")

    def _write_config(self, kill_wait: int, slurmd_timeout: int | None = None) -> None:
        for sub in ("state", "spool", "log", *(f"spool/{node}" for node in self.nodes)):
            (self.root / sub).mkdir()
        (self.root / "plugstack.conf").write_text("")
        controller = self.nodes[0]
        self.conf.write_text("\n".join([
            "ClusterName=pmlmtest2n",
            f"SlurmctldHost={controller}({self.addresses[controller]})",
            "SlurmctldPort=6817",   # the namespaces' own port space: nothing else listens there
            "SlurmdPort=6818",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            "SlurmUser=root",
            "SlurmdUser=root",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool' / '%n'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd-%n.log'}",
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
            f"KillWait={kill_wait}",
            *([f"SlurmdTimeout={slurmd_timeout}"] if slurmd_timeout else []),
            "MinJobAge=3600",
            *(f"NodeName={node} NodeAddr={self.addresses[node]} CPUs={self.cpus} State=UNKNOWN" for node in self.nodes),
            f"PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP",
        ]) + "\n")

    def _start_slurm(self) -> None:
        self._spawn_on(self.nodes[0], "slurmctld", [_find("slurmctld"), "-D", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn_on(node, f"slurmd-{node}", [_find("slurmd"), "-D", "-f", str(self.conf), "-N", node])

        def nodes_ready():
            for name in self.processes:
                self._check_alive(name, self.root / "log" / f"{name}.log")
            try:  # a controller still starting can keep sinfo waiting: ask again, within the deadline
                states = self.run(["sinfo", "-h", "-N", "-o", "%t"], check=False, timeout=10).stdout.split()
            except subprocess.TimeoutExpired:
                return False
            return len(states) == len(self.nodes) and all(s.rstrip("*~#") in ("idle", "mix", "alloc") for s in states)

        _wait(nodes_ready, 90 + 10 * len(self.nodes), "every node to be idle in the private cluster", interval=0.5)

    def _spawn_on(self, node: str, name: str, command: list) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self.processes[name] = subprocess.Popen([str(c) for c in self.on(node) + command], stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env(),
                                                start_new_session=True, preexec_fn=_terminate_with_parent)
        log.close()

    def stop(self) -> None:
        """Cancel the jobs, end the daemons (by pid) and what is left of the jobs, delete the
        namespaces (with them the veth pairs and the bridge) and the directory. Idempotent."""
        if self.stopped:
            return
        self.stopped = True
        try:
            if self.processes.get("slurmctld") and not self._died("slurmctld"):
                try:
                    self.run(["scancel", "--user", str(os.getuid())], check=False, timeout=20)
                    _wait(lambda: not self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=10).stdout.strip(),
                          60, "the jobs to end")
                except (TimeoutError, subprocess.SubprocessError, OSError):
                    pass
            for name in [n for n in self.processes if n.startswith("slurmd")] + ["slurmctld", "munged"]:
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
        finally:
            for namespace in reversed(self.created):
                _ip("netns", "delete", namespace, check=False)
            shutil.rmtree(self.root, ignore_errors=True)
            atexit.unregister(self.stop)

    @property
    def node_address(self) -> str:
        return self.nodes[0]

    def interface_bytes(self, node: str, interface: str = INTERFACE) -> tuple[int, int]:
        """(received, sent) bytes so far on `node`'s interface."""
        import json

        stats = json.loads(_ip("-n", self.namespaces[node], "-s", "-j", "link", "show", interface).stdout)[0]["stats64"]
        return stats["rx"]["bytes"], stats["tx"]["bytes"]

    def fail_node(self, node: str) -> list[int]:
        """What a node's sudden death looks like to the others: its link goes down (nothing it had
        sent arrives, nothing reaches it) and every process in its network namespace (its slurmd,
        slurmstepd and job tasks) gets SIGKILL. Returns the pids killed. Not the first node (the
        controller and the batch host live there)."""
        if node == self.nodes[0] or node not in self.nodes:
            raise ValueError(f"fail_node: {node} is not one of the other nodes {self.nodes[1:]}")
        _ip("-n", self.namespaces[node], "link", "set", INTERFACE, "down")
        target = os.stat(f"/run/netns/{self.namespaces[node]}").st_ino
        killed = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                if os.stat(entry / "ns" / "net").st_ino == target:
                    os.kill(int(entry.name), signal.SIGKILL)
                    killed.append(int(entry.name))
            except OSError:
                pass
        self.failed.add(node)
        return killed

    # ------------------------------------------------------------------ clients (on node 1)
    def run(self, command: list[str], check: bool = True, timeout: float = 60, node: str | None = None,
            **kwargs) -> subprocess.CompletedProcess:
        return super().run([*self.on(node or self.nodes[0]), *command], check=check, timeout=timeout, **kwargs)
