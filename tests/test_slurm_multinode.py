"""slurm/prepare_data.sh and slurm/pretrain_base.sh, unchanged, on a real two-node SLURM cluster
simulated in network namespaces (tests/slurm_multinode.py: each node its own network namespace and
hostname, veth pairs to a bridge, munged + slurmctld + one slurmd per node; skipped with the
reason where namespaces cannot be made). What the multi-node half of the scripts does: node list
-> MASTER_ADDR, one task per node, gloo over the interface GLOO_SOCKET_IFNAME selects, the merge
after every rank's shards, a node's training process dying mid-run (requeue, resume from the
newest complete checkpoint, in the same job: a second srun step), resuming on one node with
--universal-checkpoint, and whole nodes failing (link down, processes killed): the next step on the
spare node, then, with no spare left, on the one node left (SHRINK_ON_FAILURE=1).

One 3-node cluster for the module (SlurmdTimeout 5 s); the pre-training tests chain on one set of
settings, so the losses of every run can be compared with a clean 2-process single-node run:
  reference: 2 processes on 1 node, 16 iterations;  2 nodes x 1 process, 16 iterations
  2 nodes with node 2's process killed mid-run, up to iteration 12 (--exit-interval): in-job restart
  that checkpoint resumed on 1 node x 1 process (--universal-checkpoint), iterations 13-16
  3 nodes (2 + 1 spare): node 2 dies -> nodes 1 + 3; node 3 dies -> node 1 alone (last: the failed
  nodes stay down)."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import SlurmUnavailable
from slurm_multinode import INTERFACE, MultiNodeCluster

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "pretrain_base.sh"
PREPARE = REPO / "slurm" / "prepare_data.sh"
GLOBAL_BATCH = 16
TRAIN_ITERS = 16
KILLED_RUN_EXIT = 12

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SLURM tests need Linux")


@pytest.fixture(scope="module")
def cluster():
    if (os.cpu_count() or 1) < 2:
        pytest.skip("the 2-node SLURM tests run 2 training processes and need 2 CPUs")
    try:
        started = MultiNodeCluster.start(kill_wait=60, nodes=3, slurmd_timeout=5)
    except SlurmUnavailable as reason:
        pytest.skip(str(reason))
    try:
        yield started
    finally:
        started.stop()


def _log(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _step_nodes(cluster, job: int, step: int) -> set[str]:
    """The nodes whose slurmd launched tasks of step JOB.STEP (from the slurmd logs)."""
    found = set()
    for node in cluster.nodes:
        text = _log(cluster.root / "log" / f"slurmd-{node}.log")
        if re.search(rf"launch task StepId={job}\.{step}\b", text):
            found.add(node)
    return found


# ---------------------------------------------------------------------------- 1. data preparation
@pytest.fixture(scope="module")
def prepared(cluster, tmp_path_factory, wikitext, bert_vocab):
    """slurm/prepare_data.sh on 2 nodes (one task each: as its header shows, and with the node count
    alone) and on 1 node (one task), same corpus."""
    work = tmp_path_factory.mktemp("slurm2n_data")
    lines = wikitext.read_text(encoding="utf-8")[:150_000].splitlines(keepends=True)
    last_blank = max(i for i, line in enumerate(lines) if not line.strip())  # whole documents only
    corpus = work / "wiki.txt"
    corpus.write_text("".join(lines[:last_blank + 1]), encoding="utf-8")
    env = cluster.env(VOCAB=str(bert_vocab), PYTHON=sys.executable, SEQ_LENGTH="64", MASK_EPOCHS="2",
                      SPLIT="95,5,0", SEED="7", SHARD_SIZE_MB="0.05", PYTHONPATH=str(REPO))
    runs = {}
    for name, layout in (("two", ["--nodes=2", "--ntasks-per-node=1"]), ("nodes", ["--nodes=2"]),
                         ("one", ["--nodes=1", "--ntasks=1"])):
        (work / name).mkdir()
        job = cluster.sbatch([*layout, "--cpus-per-task=1", f"--output={work}/{name}-%j.out", str(PREPARE),
                              str(work / name / "wiki"), str(corpus)], env=env, cwd=REPO)
        runs[name] = job
    results = {}
    for name, job in runs.items():
        info = cluster.wait_until_done(job, timeout=300)
        log = _log(work / f"{name}-{job}.out")
        assert info["JobState"] == "COMPLETED", log[-4000:] + cluster.daemon_logs()
        results[name] = (job, work / name / "wiki", log)
    return results


def _tree(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_prepare_data_on_two_nodes_equals_one_node(cluster, prepared):
    """Each node tokenizes its shards (one task per node), one task merges them once, then
    build_samples: the indexed dataset and the samples are byte for byte those of a 1-node run."""
    _, single, single_log = prepared["one"]
    assert "tokenizing on 1 task(s)" in single_log and "merging" not in single_log, single_log
    for name in ("two", "nodes"):
        job, prefix, log = prepared[name]
        assert "tokenizing on 2 task(s)" in log and "rank 0/2" in log and "rank 1/2" in log, (name, log)
        assert log.count("merging the shards into") == 1, (name, log)
        assert _step_nodes(cluster, job, 0) == set(cluster.nodes[:2]), cluster.daemon_logs()  # tokenizing: both nodes
        _same_output(prefix, single)


def _same_output(prefix: Path, single: Path) -> None:
    for extension in (".bin", ".idx"):
        assert Path(f"{prefix}{extension}").read_bytes() == Path(f"{single}{extension}").read_bytes(), extension
    two, one = _tree(Path(f"{prefix}-samples")), _tree(Path(f"{single}-samples"))
    assert two and sorted(two) == sorted(one) and "metadata.json" in two
    # The metadata differ only in the prefix they name and the build time.
    metadata = [json.loads(tree.pop("metadata.json").decode().replace(str(path), "PREFIX"))
                for tree, path in ((two, prefix), (one, single))]
    for entry in metadata:
        entry.pop("build_seconds")
    assert metadata[0] == metadata[1]
    assert [name for name in two if two[name] != one[name]] == []


# ---------------------------------------------------------------------------- pre-training
ITERATION = re.compile(r"^iteration\s+(\d+)/(\d+) \| consumed samples (\d+) \| lr \S+ \| loss ([\d.]+)", re.M)
START = re.compile(r"job (\d+) restart (\d+): (\d+) node\(s\) x (\d+) task\(s\) on ([^|]*)\| master (\S+):(\d+)")
STEP = re.compile(r"job (\d+) restart (\d+)(?: step (\d+))?: (\d+) node\(s\) x (\d+) task\(s\) on ([^|]*)\| master")
TIME_LOST = re.compile(r"step (\d+): time lost: ([\d.]+) s from the failure to the first iteration of step \1 ")


def _steps(log: str) -> list[str]:
    """The job log split at each training step (in-job restarts included)."""
    starts = [m.start() for m in STEP.finditer(log)]
    return [log[a:b] for a, b in zip(starts, starts[1:] + [len(log)])]


def _attempts(log: str) -> list[str]:
    starts = [m.start() for m in START.finditer(log)]
    return [log[a:b] for a, b in zip(starts, starts[1:] + [len(log)])]


def _iterations(text: str) -> list[int]:
    return [int(m[1]) for m in ITERATION.finditer(text)]


def _history(save_dir: Path, job: int, restart: int, step: int = 0) -> list[dict]:
    name = f"job{job}-restart{restart}" + (f"-step{step}" if step else "")
    return [r for r in json.loads((save_dir / "history" / f"{name}.json").read_text()) if "loss" in r]


def _train_env(cluster, samples: Path, save_dir: Path, tasks_per_node: int, extra: str = "", **more: str) -> dict:
    """The documented CPU-only multi-node settings: the network block's GLOO_SOCKET_IFNAME names the
    interface between the nodes (None: left to the script); dropout 0 so that runs of other layouts
    give the same losses."""
    settings = dict(
        PRESET="tiny", DEVICE="cpu", GPUS_PER_NODE=str(tasks_per_node), MICRO_BATCH="4",
        GLOBAL_BATCH=str(GLOBAL_BATCH), TRAIN_ITERS=str(TRAIN_ITERS), LOG_INTERVAL="1", SAVE_INTERVAL="0",
        EVAL_ITERS="0", DATA_PATH=str(samples), SAVE_DIR=str(save_dir), TB_DIR=str(save_dir / "tensorboard"),
        PYTHON=sys.executable, PYTHONPATH=str(REPO), GLOO_SOCKET_IFNAME=INTERFACE, OMP_NUM_THREADS="1",
        EXTRA_ARGS=f"--lr 2e-3 --lr-warmup-iters 2 --hidden-dropout 0 --attention-dropout 0 {extra}".strip())
    settings.update(more)
    return cluster.env(**{name: value for name, value in settings.items() if value is not None})


def _submit(cluster, nodes: int, env: dict, log_path: Path) -> int:
    # The script's #SBATCH asks for 8 nodes with 8 GPUs each: CPU-only, the node count and no GPUs.
    return cluster.sbatch([f"--nodes={nodes}", "--gres=none", f"--output={log_path}", str(SCRIPT)], env=env, cwd=REPO)


def _finished(cluster, job: int, log_path: Path, timeout: float = 300) -> tuple[dict, str, str]:
    info = cluster.wait_until_done(job, timeout=timeout)
    log = _log(log_path)
    return info, log, f"\n{log[-6000:]}\n{info}"


@pytest.fixture(scope="module")
def samples(prepared) -> Path:
    return Path(f"{prepared['two'][1]}-samples")


@pytest.fixture(scope="module")
def reference(cluster, samples, tmp_path_factory) -> list[dict]:
    """The same job as 2 processes on 1 node: its metrics per iteration."""
    work = tmp_path_factory.mktemp("slurm2n_reference")
    save_dir, log_path = work / "checkpoints", work / "reference.out"
    job = _submit(cluster, 1, _train_env(cluster, samples, save_dir, 2), log_path)
    info, log, context = _finished(cluster, job, log_path)
    assert info["JobState"] == "COMPLETED", context
    assert re.search(r"1 node\(s\) x 2 task\(s\) on pmlm-node\d ", log), context
    history = _history(save_dir, job, 0)
    assert [r["iteration"] for r in history] == list(range(1, TRAIN_ITERS + 1)), context
    return history


def _losses(history: list[dict]) -> list[float]:
    return [r["loss"] for r in history]


def test_pretrain_on_two_nodes_trains_one_data_parallel_group(cluster, samples, reference, tmp_path):
    """sbatch --nodes=2 with one task per node: MASTER_ADDR is the first node of the allocation, the
    ranks come from SLURM, gloo runs over the veth interface named by GLOO_SOCKET_IFNAME; the two
    nodes train as one data-parallel group: the losses equal the 2-process single-node run's."""
    save_dir, log_path = tmp_path / "checkpoints", tmp_path / "two-nodes.out"
    before = {node: cluster.interface_bytes(node) for node in cluster.nodes[:2]}
    job = _submit(cluster, 2, _train_env(cluster, samples, save_dir, 1), log_path)
    info, log, context = _finished(cluster, job, log_path)
    after = {node: cluster.interface_bytes(node) for node in cluster.nodes[:2]}
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "0", context
    start = START.search(log)
    assert start and start.group(3, 4, 5, 6) == ("2", "1", "pmlm-node1 pmlm-node2 ", "pmlm-node1"), context
    assert "GLOO_SOCKET_IFNAME unset" not in log, context  # the user's choice stands
    # The gradients crossed the veth link: each node sent at least half of the fp32 gradients
    # (~2.1 M parameters, 8.4 MB) per iteration through it (ZeRO-2's reduce-scatter alone).
    sent = {node: after[node][1] - before[node][1] for node in cluster.nodes[:2]}
    assert all(count > TRAIN_ITERS * 4_000_000 for count in sent.values()), sent
    assert _step_nodes(cluster, job, 0) == set(cluster.nodes[:2]), cluster.daemon_logs()
    assert "parallelism: world 2 = data 2 x tensor 1 x pipeline 1; ZeRO-2, fp32, micro batch 4, global batch 16 " \
           "(2 accumulation steps)" in log, context
    state = json.loads((save_dir / f"iter_{TRAIN_ITERS:07d}" / "run_state.json").read_text())
    assert state["data_parallel_size"] == 2, state
    history = _history(save_dir, job, 0)
    assert [(r["iteration"], r["consumed_samples"]) for r in history] == \
        [(i, i * GLOBAL_BATCH) for i in range(1, TRAIN_ITERS + 1)], context
    assert _losses(history) == pytest.approx(_losses(reference), abs=1e-5), context
    assert "training complete" in log, context


# ---------------------------------------------------------------------------- node failure
def _training_pids(marker: str, node: str) -> list[int]:
    """The pretrain processes of the job whose save directory is `marker`, on `node`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline[:1] == [sys.executable.encode()] and b"megatron_pmlm.pretrain" in cmdline and \
                marker.encode() in cmdline and f"SLURMD_NODENAME={node}".encode() in environ:
            pids.append(int(entry.name))
    return pids


def _wait_for_iteration(cluster, job: int, log_path: Path, at_least: int, timeout: float) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = _iterations(_log(log_path))
        if done and done[-1] >= at_least:
            return done[-1]
        state = cluster.job_state(job)
        assert state not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), f"ended early ({state}):\n{_log(log_path)[-5000:]}"
        time.sleep(0.3)
    raise AssertionError(f"no iteration {at_least} in time:\n{_log(log_path)[-5000:]}" + cluster.daemon_logs())


@pytest.fixture(scope="module")
def killed_run(cluster, samples, reference, tmp_path_factory):
    """2 nodes, checkpoints every 3 iterations, stopping at 12; node 2's training process is killed
    (SIGKILL: what an Xid, the OOM killer or a dying node does to it) after iteration 5."""
    work = tmp_path_factory.mktemp("slurm2n_killed")
    save_dir, log_path = work / "checkpoints", work / "killed.out"
    env = _train_env(cluster, samples, save_dir, 1, extra=f"--exit-interval {KILLED_RUN_EXIT}", SAVE_INTERVAL="3",
                     GLOO_SOCKET_IFNAME=None)  # the script's choice
    job = _submit(cluster, 2, env, log_path)
    _wait_for_iteration(cluster, job, log_path, at_least=5, timeout=240)
    victims = _training_pids(str(save_dir), cluster.nodes[1])
    assert len(victims) == 1, victims
    os.kill(victims[0], 9)
    info, log, context = _finished(cluster, job, log_path)
    return job, save_dir, info, log, context


def test_pretrain_on_two_nodes_survives_a_killed_process(cluster, killed_run, reference):
    """The same job restarts in place (a second srun step, Restarts=0) on both nodes from the newest
    complete checkpoint and finishes; over both steps every iteration consumed the next global batch
    exactly once: the losses are those of the uninterrupted reference run. The time lost is printed."""
    job, save_dir, info, log, context = killed_run
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", context
    first, second = _steps(log)
    assert STEP.search(second).group(2, 3) == ("0", "1"), context
    # GLOO_SOCKET_IFNAME unset: the script chose the interface to node 2 (each node's own name
    # resolves to 127.0.1.1 there, which gloo would otherwise offer the other node).
    assert "GLOO_SOCKET_IFNAME unset: using pmlmnet, this node's interface to pmlm-node2 (10.77.0.2)" in first
    assert re.search(r"training crashed mid-run .*: signal 9 \(SIGKILL\) of task 1 on host pmlm-node2\n", first), context
    crashed_at = int(re.search(r"checkpoint at iteration (\d+), 0 at the start\)", first)[1])
    assert crashed_at >= 3 and crashed_at % 3 == 0 and "in-job restart 1 of 3 after a crash after progress" in first
    assert "requeueing" not in log and "excluding" not in log, context
    assert STEP.search(second).group(4, 5, 6) == ("2", "1", "pmlm-node1 pmlm-node2 "), context
    assert f"resumed from {save_dir}/iter_{crashed_at:07d}: iteration {crashed_at}, " \
           f"consumed samples {crashed_at * GLOBAL_BATCH}" in second, context
    assert _iterations(second) == list(range(crashed_at + 1, KILLED_RUN_EXIT + 1)), context
    assert "training complete" in second, context
    lost = [(int(s), float(seconds)) for s, seconds in TIME_LOST.findall(log)]
    assert [s for s, _ in lost] == [1] and 0 < lost[0][1] < 120, (lost, context)
    print(f"time lost to a killed process, 2 nodes: {lost[0][1]} s")
    kept = _history(save_dir, job, 0)[:crashed_at] + _history(save_dir, job, 0, step=1)
    assert [(r["iteration"], r["consumed_samples"]) for r in kept] == \
        [(i, i * GLOBAL_BATCH) for i in range(1, KILLED_RUN_EXIT + 1)], context
    assert _losses(kept) == pytest.approx(_losses(reference[:KILLED_RUN_EXIT]), abs=1e-5), context
    assert (save_dir / "latest").read_text().strip() == f"iter_{KILLED_RUN_EXIT:07d}"


def test_pretrain_resumes_on_one_node_with_universal_checkpoint(cluster, samples, killed_run, reference, tmp_path):
    """The 2-node job's checkpoint (ZeRO-2, data-parallel size 2) continued on the one node left
    (1 task, --universal-checkpoint): the same global batch (twice the accumulation steps), the
    next samples, the reference's losses."""
    job, save_dir, _, _, _ = killed_run
    resumed = tmp_path / "checkpoints"
    shutil.copytree(save_dir, resumed, symlinks=True)
    log_path = tmp_path / "one-node.out"
    env = _train_env(cluster, samples, resumed, 1, extra="--universal-checkpoint")
    one = _submit(cluster, 1, env, log_path)
    info, log, context = _finished(cluster, one, log_path)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", context
    assert START.search(log).group(3, 4) == ("1", "1"), context
    assert "parallelism: world 1 = data 1 x tensor 1 x pipeline 1; ZeRO-2, fp32, micro batch 4, global batch 16 " \
           "(4 accumulation steps)" in log, context
    assert f"resumed from {resumed}/iter_{KILLED_RUN_EXIT:07d}: iteration {KILLED_RUN_EXIT}, consumed samples " \
           f"{KILLED_RUN_EXIT * GLOBAL_BATCH} (through {resumed}/iter_{KILLED_RUN_EXIT:07d}_universal, " \
           f"data-parallel size 2 -> 1)" in log, context
    history = _history(resumed, one, 0)
    assert [(r["iteration"], r["consumed_samples"]) for r in history] == \
        [(i, i * GLOBAL_BATCH) for i in range(KILLED_RUN_EXIT + 1, TRAIN_ITERS + 1)], context
    assert _losses(history) == pytest.approx(_losses(reference[KILLED_RUN_EXIT:]), abs=1e-4), context
    assert "training complete" in log, context


def _wait_for_step(cluster, job: int, log_path: Path, step: int, at_least: int, timeout: float) -> int:
    """Poll the log (bounded) until training step `step` has logged iteration >= at_least."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = _steps(_log(log_path))
        if len(steps) > step and _iterations(steps[step]) and _iterations(steps[step])[-1] >= at_least:
            return _iterations(steps[step])[-1]
        state = cluster.job_state(job)
        assert state not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), f"ended early ({state}):\n{_log(log_path)[-5000:]}"
        time.sleep(0.3)
    raise AssertionError(f"step {step}: no iteration {at_least} in time:\n{_log(log_path)[-5000:]}" + cluster.daemon_logs())


def test_failed_nodes_are_replaced_by_the_spare_then_the_job_shrinks(cluster, samples, reference, tmp_path):
    """3 nodes, SPARE_NODES=1, SHRINK_ON_FAILURE=1, checkpoints every 3 iterations. Node 2 dies (link
    down, every process in it SIGKILLed): the next step of the same job runs on nodes 1 + 3. Node 3
    dies: no spare left, so the job goes on on node 1 alone (the largest node count whose data-parallel
    size divides the global batch) through --universal-checkpoint, the global batch kept. Each failed
    host is excluded and named; the losses are the reference's all along; each time lost is printed.
    Runs last in the module: the failed nodes stay down."""
    save_dir, log_path = tmp_path / "checkpoints", tmp_path / "spare.out"
    env = _train_env(cluster, samples, save_dir, 1, SAVE_INTERVAL="3", SPARE_NODES="1", SHRINK_ON_FAILURE="1",
                     POLL_SECONDS="1")
    job = _submit(cluster, 3, env, log_path)
    seen = _wait_for_step(cluster, job, log_path, 0, at_least=4, timeout=240)
    assert cluster.fail_node(cluster.nodes[1])
    seen = _wait_for_step(cluster, job, log_path, 1, at_least=seen + 3, timeout=240)
    assert cluster.fail_node(cluster.nodes[2])
    info, log, context = _finished(cluster, job, log_path, timeout=400)
    context += "\n" + cluster.daemon_logs()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", context
    steps = _steps(log)
    assert [STEP.search(s).group(3, 4, 6) for s in steps] == [
        (None, "2", "pmlm-node1 pmlm-node2 "), ("1", "2", "pmlm-node1 pmlm-node3 "), ("2", "1", "pmlm-node1 ")], context
    assert "SPARE_NODES=1: the job's other node(s) wait as spares" in steps[0], context
    assert re.search(r"excluding host pmlm-node2 from the next steps: (srun reports that the node failed|"
                     r"scontrol show node says State=\S*(DOWN|NOT_RESPONDING|\*))", steps[0]), context
    assert "in-job restart 1 of 3 after" in steps[0], context
    assert re.search(r"excluding host pmlm-node3 from the next steps: ", steps[1]), context
    assert "SHRINK_ON_FAILURE=1: 1 usable node(s) left, 2 needed: continuing on 1 node(s) (data-parallel size 1, " \
           "global batch 16 kept) with --universal-checkpoint" in steps[1], context
    assert "--universal-checkpoint" in steps[2] and "data-parallel size 2 -> 1" in steps[2], context
    assert "parallelism: world 1 = data 1 x tensor 1 x pipeline 1; ZeRO-2, fp32, micro batch 4, global batch 16 " \
           "(4 accumulation steps)" in steps[2], context
    assert "training complete" in steps[2] and "requeueing" not in log, context
    # The steps ran where the log says (the slurmd logs: step 1 on nodes 1 and 3, step 2 on node 1).
    assert _step_nodes(cluster, job, 1) == {cluster.nodes[0], cluster.nodes[2]}, context
    assert _step_nodes(cluster, job, 2) == {cluster.nodes[0]}, context
    # Every iteration once, each on the next global batch, the reference's losses.
    checkpoints = [int(re.search(r"checkpoint at iteration (\d+), \d+ at the start\)", s)[1]) for s in steps[:2]]
    kept = _history(save_dir, job, 0)[:checkpoints[0]] + \
        _history(save_dir, job, 0, step=1)[:checkpoints[1] - checkpoints[0]] + _history(save_dir, job, 0, step=2)
    assert [(r["iteration"], r["consumed_samples"]) for r in kept] == \
        [(i, i * GLOBAL_BATCH) for i in range(1, TRAIN_ITERS + 1)], context
    assert _losses(kept) == pytest.approx(_losses(reference), abs=1e-4), context
    lost = [(int(s), float(seconds)) for s, seconds in TIME_LOST.findall(log)]
    assert [s for s, _ in lost] == [1, 2] and all(0 < seconds < 120 for _, seconds in lost), (lost, context)
    print(f"time lost to a node failure, 2 nodes + spare / shrink to 1: {lost}")


# ---------------------------------------------------------------------------- the paper's topology (opt-in)
@pytest.mark.skipif(os.environ.get("PMLM_SLURM_EIGHT_NODES") != "1",
                    reason="the 8-node run (9 namespaces, 16 training processes over its two jobs) is opt-in: "
                           "PMLM_SLURM_EIGHT_NODES=1")
def test_eight_nodes_and_a_spare_finish_on_the_spare_with_the_same_losses(samples, tmp_path):
    """The paper's topology: 8 nodes x 1 process (+ 1 spare), a few iterations; the losses equal an
    8-process single-node run's. Node 5 dies mid-run: the next step of the same job runs on nodes 1-4,
    6-9 from the newest checkpoint, with the same losses."""
    try:
        nine = MultiNodeCluster.start(kill_wait=60, nodes=9, slurmd_timeout=5)
    except SlurmUnavailable as reason:
        pytest.skip(str(reason))
    try:
        iterations, more = 8, dict(TRAIN_ITERS="8", MICRO_BATCH="2", SRUN_ARGS="--overcommit", SAVE_INTERVAL="2",
                                   POLL_SECONDS="1")
        single_dir, single_log = tmp_path / "single", tmp_path / "single.out"
        job = nine.sbatch(["--nodes=1", "--gres=none", f"--output={single_log}", str(SCRIPT)],
                          env=_train_env(nine, samples, single_dir, 8, **more), cwd=REPO)
        info, log, context = _finished(nine, job, single_log, timeout=900)
        assert info["JobState"] == "COMPLETED", context
        reference8 = _history(single_dir, job, 0)
        assert [r["iteration"] for r in reference8] == list(range(1, iterations + 1)), context

        save_dir, log_path = tmp_path / "eight", tmp_path / "eight.out"
        job = nine.sbatch(["--nodes=9", "--gres=none", f"--output={log_path}", str(SCRIPT)],
                          env=_train_env(nine, samples, save_dir, 1, SPARE_NODES="1", **more), cwd=REPO)
        seen = _wait_for_step(nine, job, log_path, 0, at_least=3, timeout=900)
        assert seen < iterations and nine.fail_node(nine.nodes[4])
        info, log, context = _finished(nine, job, log_path, timeout=900)
        assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", context
        first, second = _steps(log)
        assert STEP.search(first).group(4, 6) == ("8", " ".join(nine.nodes[:8]) + " "), context
        assert STEP.search(second).group(4, 6) == ("8", " ".join(nine.nodes[:4] + nine.nodes[5:]) + " "), context
        assert "excluding host pmlm-node5 from the next steps" in first, context
        checkpoint = int(re.search(r"checkpoint at iteration (\d+), 0 at the start\)", first)[1])
        kept = _history(save_dir, job, 0)[:checkpoint] + _history(save_dir, job, 0, step=1)
        assert [r["iteration"] for r in kept] == list(range(1, iterations + 1)), context
        assert _losses(kept) == pytest.approx(_losses(reference8), abs=1e-5), context
        assert len(TIME_LOST.findall(log)) == 1, context
        print(f"8 nodes + spare, time lost: {TIME_LOST.findall(log)}")
    finally:
        nine.stop()


# ---------------------------------------------------------------------------- the harness itself
def test_without_root_or_ip_or_namespaces_the_two_node_tests_skip_saying_why(monkeypatch):
    import slurm_multinode

    monkeypatch.setattr(slurm_multinode, "ensure_installed", lambda: None)
    monkeypatch.setattr(slurm_multinode.os, "geteuid", lambda: 1000)
    with pytest.raises(SlurmUnavailable, match=r"needs root \(network namespaces"):
        MultiNodeCluster.start()
    monkeypatch.setattr(slurm_multinode.os, "geteuid", lambda: 0)
    real_find = slurm_multinode._find
    monkeypatch.setattr(slurm_multinode, "_find", lambda name: None if name == "ip" else real_find(name))
    with pytest.raises(SlurmUnavailable, match=r"needs `ip` \(iproute2"):
        MultiNodeCluster.start()
    monkeypatch.setattr(slurm_multinode, "_find", real_find)
    real_ip, made = slurm_multinode._ip, []

    def no_namespaces(*arguments, check=True):
        if arguments[:2] == ("netns", "add"):
            made.append(arguments[2])
            raise RuntimeError("ip netns add failed (1): mount --make-shared /run/netns failed: Operation not permitted")
        return real_ip(*arguments, check=check)

    monkeypatch.setattr(slurm_multinode, "_ip", no_namespaces)
    before = set(Path("/tmp").glob(f"{slurm_multinode.DIRECTORY_PREFIX}*"))
    with pytest.raises(SlurmUnavailable, match="cannot create a network namespace here: ip netns add failed"):
        MultiNodeCluster.start()
    assert made and not set(Path("/tmp").glob(f"{slurm_multinode.DIRECTORY_PREFIX}*")) - before


def test_stop_removes_namespaces_links_daemons_and_running_jobs(tmp_path):
    """A cluster stopped while a 2-node job runs (what a failing test's teardown meets): no daemon,
    no job process, no namespace (with it no veth pair or bridge), no directory is left."""
    import subprocess

    from slurm_multinode import _namespaces

    try:
        second = MultiNodeCluster.start(kill_wait=5)
    except SlurmUnavailable as reason:
        pytest.skip(str(reason))
    try:
        job = second.sbatch(["--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/sleep.out", "--wrap",
                             "srun sleep 300"], cwd=tmp_path)
        deadline = time.monotonic() + 60
        while len([p for p in second.leftover_pids() if Path(f"/proc/{p}/comm").read_text().strip() == "sleep"]) < 2:
            assert time.monotonic() < deadline, _log(tmp_path / "sleep.out") + second.daemon_logs()
            time.sleep(0.3)
        daemons = [process.pid for process in second.processes.values()]
        assert len(daemons) == 4 and set(second.created) <= set(_namespaces())
    finally:
        second.stop()
    assert job and not second.leftover_pids()
    assert all(not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1]
               for pid in daemons)
    assert not set(second.created) & set(_namespaces()) and not second.root.exists()
    host_links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "pmlmnet" not in host_links and "port1" not in host_links


def test_a_killed_test_process_leaves_nothing_after_the_next_start():
    """kill -9 of the process that owns a cluster (no teardown runs): its daemons end with it, and
    the next start removes its namespaces and directory."""
    import signal
    import subprocess

    from slurm_multinode import _namespaces, remove_stale

    owner = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; sys.path.insert(0, sys.argv[1]); from slurm_multinode import MultiNodeCluster\n"
        "c = MultiNodeCluster.start(); print(c.root, *c.created, flush=True); time.sleep(600)"),
        str(Path(__file__).parent)], stdout=subprocess.PIPE, text=True)
    try:
        line = owner.stdout.readline().split()
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
    if not line:
        pytest.skip("the cluster could not start in a child process")
    root, namespaces = Path(line[0]), line[1:]
    assert len(namespaces) == 3 and set(namespaces) <= set(_namespaces()) and root.exists()
    remove_stale()
    assert not set(namespaces) & set(_namespaces()) and not root.exists()
    marker = f"SLURM_CONF={root}/slurm.conf".encode()
    deadline = time.monotonic() + 30  # the daemons get SIGKILL with their owner; their ends are not instant
    while alive := [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _environ_has(p, marker)]:
        assert time.monotonic() < deadline, f"daemons of the killed owner still alive 30 s on: {alive}"
        time.sleep(0.1)


def _environ_has(proc: Path, marker: bytes) -> bool:
    try:
        return marker in (proc / "environ").read_bytes().split(b"\0") and \
            (proc / "stat").read_text().split(") ")[-1][:1] != "Z"
    except OSError:
        return False
