"""slurm/prepare_data.sh and slurm/pretrain_base.sh on a real one-node SLURM cluster started by the
test itself (tests/slurm_cluster.py: munged, slurmctld, slurmd from Debian's packages, installed
here when missing and we are root; skipped otherwise): data preparation, then a tiny CPU
pre-training that is interrupted three times (`scontrol requeue`; SIGUSR1 to the tasks as
`--signal=USR1@...` sends it before a time limit; SIGUSR1 to the batch shell) and resumes each time
from its checkpoint without repeating or skipping a sample."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_cluster import SlurmCluster, SlurmUnavailable

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "slurm" / "pretrain_base.sh"
GLOBAL_BATCH = 16
TRAIN_ITERS = 40  # 3 interruptions of >= 3 iterations each, and a loss that falls by far more than 1.0
HANG_TIMEOUT_SECONDS = 45
"""The in-job restart test's hang timeout: above the longest quiet start-up phase of a step (the imports,
~15 s at load 7 on 2 cores) so that a slow start is not taken for a hang, and no longer than that."""
CRASH_TRAIN_ITERS = 24
"""The in-job restart job's length: its third step is killed at iteration >= 11 (3 steps of >= 3
iterations each after the first checkpoint), with room left so that it cannot finish first; the
requeued start trains the rest."""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SLURM tests need Linux")


# ---------------------------------------------------------------------------- the script itself
def _sbatch_headers(path: Path) -> dict[str, str]:
    headers = {}
    for line in path.read_text().splitlines():
        match = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if match:
            headers[match.group(1)] = match.group(2) or ""
    return headers


def test_pretrain_script_requests_the_papers_run():
    """8 nodes x 8 GPUs, requeueable, a signal before the time limit, appended logs; the batch
    arithmetic matches the DeepSpeed config: 20 x 6 x 64 = 7,680."""
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    headers = _sbatch_headers(SCRIPT)
    assert headers["nodes"] == "8" and headers["gres"] == "gpu:8"
    assert "requeue" in headers and headers["open-mode"] == "append"
    assert "no-kill" in headers  # a failed node leaves the job instead of ending it (in-job restarts)
    assert re.fullmatch(r"(B:)?USR1@\d+", headers["signal"]), headers["signal"]
    text = SCRIPT.read_text()
    defaults = dict(re.findall(r"^(\w+)=\$\{\1:-([^}]*)\}", text, re.M))
    assert defaults["PRESET"] == "base" and defaults["GPUS_PER_NODE"] == "8"
    assert defaults["GLOBAL_BATCH"] == "7680" and defaults["TRAIN_ITERS"] == "500000"
    assert "--load \"$SAVE_DIR\"" in text and "--save \"$SAVE_DIR\"" in text
    ds_config = json.loads((REPO / "ds_configs" / "pretrain_base_v100.json").read_text())
    micro = int(defaults["MICRO_BATCH"])
    assert micro == ds_config["train_micro_batch_size_per_gpu"]
    assert micro * ds_config["gradient_accumulation_steps"] * 8 * 8 == 7680 == ds_config["train_batch_size"]
    assert ds_config["fp16"]["enabled"] and "PRECISION=${PRECISION:-fp16}" in text
    # Job logs in logs/ (tracked, so it exists where sbatch is run: sbatch does not create it), the
    # job renamed after the preset at start unless sbatch -J named it.
    for script in ("pretrain_base.sh", "pretrain_large.sh", "prepare_data.sh"):
        assert _sbatch_headers(REPO / "slurm" / script)["output"] == "logs/%x-%j.out", script
    assert (REPO / "logs" / ".gitkeep").is_file()
    assert 'scontrol update JobId="$JOB_ID" JobName="pmlm-$PRESET"' in text


def test_large_script_runs_the_base_script_with_a_micro_batch_that_fits():
    large = REPO / "slurm" / "pretrain_large.sh"
    result = subprocess.run(["bash", "-n", str(large)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    headers = _sbatch_headers(large)
    assert headers["nodes"] == "8" and headers["gres"] == "gpu:8" and "requeue" in headers and "no-kill" in headers
    text = large.read_text()
    assert "PRESET=${PRESET:-large}" in text and 'exec bash "$REPO/slurm/pretrain_base.sh"' in text
    micro = int(re.search(r"MICRO_BATCH=\$\{MICRO_BATCH:-(\d+)\}", text)[1])
    assert 7680 % (micro * 64) == 0 and f"micro batch {micro} x {7680 // (micro * 64)} accumulation" in text


def test_pretrain_script_outside_slurm_says_so(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=30)
    assert result.returncode != 0 and "run this script with sbatch" in result.stderr


@pytest.mark.parametrize("knob, value, message", [
    ("IN_JOB_RESTARTS", "three", "IN_JOB_RESTARTS must be a whole number >= 0, got 'three'"),
    ("SPARE_NODES", "-1", "SPARE_NODES must be a whole number >= 0, got '-1'"),
    ("HANG_TIMEOUT_SECONDS", "1.5", "HANG_TIMEOUT_SECONDS must be a whole number >= 0, got '1.5'"),
    ("SHRINK_ON_FAILURE", "yes", "SHRINK_ON_FAILURE must be 0 or 1, got 'yes'"),
    ("SPARE_NODES", "2", "NNODES must be at least 1 (the job's 2 nodes less SPARE_NODES=2), got '0'"),
])
def test_pretrain_script_refuses_bad_restart_settings_in_one_line(tmp_path, knob, value, message):
    """The restart knobs are checked before anything runs or is written: one line naming the culprit, exit 2."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(SLURM_JOB_ID="7", SLURM_JOB_NUM_NODES="2", REPO=str(REPO), SAVE_DIR=str(tmp_path / "never"), **{knob: value})
    result = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=30)
    assert result.returncode == 2 and result.stderr.strip() == message and not result.stdout, result
    assert not (tmp_path / "never").exists()


def test_without_slurm_and_without_root_the_cluster_tests_skip_saying_why(monkeypatch):
    import slurm_cluster

    monkeypatch.setattr(slurm_cluster, "missing_programs", lambda: ["slurmctld", "munged"])
    monkeypatch.setattr(slurm_cluster.os, "geteuid", lambda: 1000)
    with pytest.raises(SlurmUnavailable, match=r"missing \(slurmctld, munged\).*not root.*apt-get install "
                                               r"slurmctld slurmd slurm-client munge"):
        slurm_cluster.ensure_installed()


# ---------------------------------------------------------------------------- on a real cluster
@pytest.fixture(scope="module")
def cluster():
    if (os.cpu_count() or 1) < 2:
        pytest.skip("the SLURM pre-training test runs 2 tasks and needs 2 CPUs")
    try:
        started = SlurmCluster.start(kill_wait=120)
    except SlurmUnavailable as reason:
        pytest.skip(str(reason))
    yield started
    started.stop()


# Two tasks under slurm/task_status.sh's wrapper: task 1 fails (exit 2, then killed by SIGKILL) while
# task 0 is still running, so srun terminates task 0 (SIGTERM: 143) and reports 143 itself; then a
# step that succeeds.
TASK_STATUS_JOB = r"""#!/usr/bin/env bash
set -euo pipefail
. "$REPO/slurm/task_status.sh"
step() {  # COMMAND...: srun it on 2 tasks, print srun's status and the root cause
  rm -rf "$STATUS_DIR" && mkdir -p "$STATUS_DIR"
  local rc=0
  srun --ntasks=2 --kill-on-bad-exit=1 bash -c "$TASK_STATUS_WRAPPER" task "$STATUS_DIR" "$@" || rc=$?
  task_root_cause "$STATUS_DIR" "$rc"
  echo "srun $rc | root $ROOT_STATUS | $ROOT_CAUSE"
}
step bash -c 'if [ "$SLURM_PROCID" = 1 ]; then sleep 1; exit 2; fi; exec sleep 60'
step bash -c 'if [ "$SLURM_PROCID" = 1 ]; then sleep 1; kill -9 $$; fi; exec sleep 60'
step true
"""


def test_task_status_gives_the_failed_tasks_status_not_the_sigterm_srun_sent_the_other(cluster, tmp_path):
    script = tmp_path / "steps.sh"
    script.write_text(TASK_STATUS_JOB)
    env = cluster.env(REPO=str(REPO), STATUS_DIR=str(tmp_path / "status"))
    job = cluster.sbatch(["--ntasks=2", "--cpus-per-task=1", f"--output={tmp_path}/steps.out", str(script)],
                         env=env, cwd=tmp_path)
    info = cluster.wait_until_done(job, timeout=120)
    log = (tmp_path / "steps.out").read_text(errors="replace")
    assert info["JobState"] == "COMPLETED", log + str(info)
    results = re.findall(r"^srun (\d+) \| root (\d+) \| (.*)$", log, re.M)
    node = cluster.node
    assert results == [("143", "2", f"exit status 2 of task 1 on host {node}"),
                       ("143", "137", f"signal 9 (SIGKILL) of task 1 on host {node}"),
                       ("0", "0", "srun's exit status 0 (no task recorded a failure)")], log


@pytest.fixture(scope="module")
def prepared(cluster, tmp_path_factory, wikitext, bert_vocab):
    """slurm/prepare_data.sh with 2 tasks (each tokenizes its shards, then the merge and
    build_samples) on a slice of wikitext: returns the samples directory."""
    work = tmp_path_factory.mktemp("slurm_data")
    lines = wikitext.read_text(encoding="utf-8")[:150_000].splitlines(keepends=True)
    last_blank = max(i for i, line in enumerate(lines) if not line.strip())  # whole documents only
    corpus = work / "wiki.txt"
    corpus.write_text("".join(lines[:last_blank + 1]), encoding="utf-8")
    env = cluster.env(VOCAB=str(bert_vocab), PYTHON=sys.executable, SEQ_LENGTH="64", MASK_EPOCHS="2",
                      SPLIT="95,5,0", SEED="7", SHARD_SIZE_MB="0.05")
    job = cluster.sbatch(["--ntasks=2", "--cpus-per-task=1", f"--output={work}/prepare-%j.out",
                          str(REPO / "slurm" / "prepare_data.sh"), str(work / "wiki"), str(corpus)],
                         env=env, cwd=REPO)
    info = cluster.wait_until_done(job, timeout=300)
    log = (work / f"prepare-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-4000:] + cluster.daemon_logs()
    return work / "wiki-samples", log, corpus, work / "wiki"


def test_prepare_data_job_tokenizes_on_two_ranks_and_builds_samples(prepared, bert_vocab, tmp_path):
    samples, log, corpus, prefix = prepared
    assert "rank 0/2" in log and "rank 1/2" in log and "done: train with" in log
    from data_prep.preprocess import PreprocessConfig, run
    from megatron_pmlm.data import PretrainingSamples

    assert len(PretrainingSamples(samples, "train")) > 100
    # Two ranks with their shards, then the merge: byte for byte what one process writes.
    single = tmp_path / "single"
    run(PreprocessConfig(inputs=[str(corpus)], output_prefix=str(single), vocab_file=str(bert_vocab),
                         shard_size_mb=0.05, progress=False))
    for extension in (".bin", ".idx"):
        assert Path(f"{prefix}{extension}").read_bytes() == Path(f"{single}{extension}").read_bytes(), extension


def test_prepare_data_job_reports_the_failing_rank(cluster, tmp_path, wikitext, bert_vocab):
    """Rank 1's shard (b.jsonl) has a malformed line: it exits with 2 while rank 0 is still tokenizing
    its larger shard, which srun then terminates; the job ends with rank 1's status and names it."""
    text = wikitext.read_text(encoding="utf-8")[:400_000]
    documents = [line for line in text.splitlines() if line.strip()]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in documents * 3))
    (tmp_path / "b.jsonl").write_text('{"text": "fine."}\n{"text": "broken\n')
    env = cluster.env(VOCAB=str(bert_vocab), PYTHON=sys.executable)
    job = cluster.sbatch(["--ntasks=2", "--cpus-per-task=1", f"--output={tmp_path}/prepare-%j.out",
                          str(REPO / "slurm" / "prepare_data.sh"), str(tmp_path / "out"),
                          f"{tmp_path}/a.jsonl {tmp_path}/b.jsonl"], env=env, cwd=REPO)
    info = cluster.wait_until_done(job, timeout=300)
    log = (tmp_path / f"prepare-{job}.out").read_text(errors="replace")
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "2:0", log + str(info)
    assert "b.jsonl, line 2: malformed JSON" in log, log
    assert f"tokenizing failed: exit status 2 of task 1 on host {cluster.node} (rerun to resume" in log, log
    assert not (tmp_path / "out.task-status").exists()


ITERATION = re.compile(r"^iteration\s+(\d+)/(\d+) \| consumed samples (\d+) \| lr \S+ \| loss ([\d.]+)", re.M)
START = re.compile(r"job (\d+) restart (\d+): \d+ node\(s\) x (\d+) task\(s\)")


def _attempts(log: str) -> list[str]:
    """The job log split at each start of the batch script (one part per restart)."""
    starts = [m.start() for m in START.finditer(log)]
    return [log[a:b] for a, b in zip(starts, starts[1:] + [len(log)])]


def _iterations(text: str) -> list[tuple[int, int, float]]:
    return [(int(m[1]), int(m[3]), float(m[4])) for m in ITERATION.finditer(text)]


def _wait_for_iteration(cluster, job: int, log_path: Path, attempt: int, at_least: int, timeout: float) -> int:
    """Poll the job log (bounded) until attempt `attempt` has logged iteration >= at_least."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        parts = _attempts(text)
        if len(parts) > attempt:
            done = [i for i, _, _ in _iterations(parts[attempt])]
            if done and done[-1] >= at_least:
                return done[-1]
        state = cluster.job_state(job)
        assert state not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), f"job ended early ({state}):\n{text[-5000:]}"
        time.sleep(0.3)
    raise AssertionError(f"attempt {attempt} did not reach iteration {at_least}:\n"
                         f"{log_path.read_text(errors='replace')[-5000:] if log_path.exists() else ''}"
                         + cluster.daemon_logs())


# How each start of the job is interrupted: (command, what the processes receive). The last
# start runs to the end.
INTERRUPTIONS = [
    # preemption-like: SLURM sends SIGTERM to every process of the job and requeues it
    (["scontrol", "requeue"], "received signal 15"),
    # what --signal=USR1@600 does before a time limit: SIGUSR1 to the training tasks; the script
    # requeues its own job after their checkpoint
    (["scancel", "--signal=USR1"], "received signal 10"),
    # --signal=B:USR1@... / `scancel --batch`: only the batch shell gets it and relays it
    (["scancel", "--batch", "--signal=USR1"], "received SIGUSR1: relaying it to the training tasks"),
]


def test_pretrain_job_resumes_after_requeue_and_usr1_without_repeating_samples(cluster, prepared, tmp_path):
    samples = prepared[0]
    save_dir = tmp_path / "checkpoints"
    env = cluster.env(PRESET="tiny", DEVICE="cpu", GPUS_PER_NODE="2", MICRO_BATCH="4",
                      GLOBAL_BATCH=str(GLOBAL_BATCH), TRAIN_ITERS=str(TRAIN_ITERS), LOG_INTERVAL="1",
                      SAVE_INTERVAL="0", EVAL_ITERS="0", DATA_PATH=str(samples), SAVE_DIR=str(save_dir),
                      TB_DIR=str(tmp_path / "tensorboard"), PYTHON=sys.executable,
                      EXTRA_ARGS="--lr 2e-3 --lr-warmup-iters 2", MASTER_ADDR=cluster.node_address,
                      OMP_NUM_THREADS="1")
    if cluster.node_address == cluster.node:
        env.pop("MASTER_ADDR")  # the script's own choice: the first host of the allocation
    log_path = tmp_path / "pretrain.out"
    # The documented CPU-only way: the script's #SBATCH asks for 8 nodes with 8 GPUs each.
    job = cluster.sbatch(["--nodes=1", "--gres=none", f"--output={log_path}", str(SCRIPT)], env=env, cwd=REPO)

    seen = [0]
    for attempt, (command, _) in enumerate(INTERRUPTIONS):
        # Interrupt once this start has done 3 iterations of its own.
        seen.append(_wait_for_iteration(cluster, job, log_path, attempt, at_least=seen[-1] + 3, timeout=240))
        cluster.run([*command, str(job)])
    info = cluster.wait_until_done(job, timeout=300)
    log = log_path.read_text(errors="replace")
    context = f"\n{log[-6000:]}\n{info}"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", context
    assert info["Restarts"] == str(len(INTERRUPTIONS)), context

    attempts = _attempts(log)
    assert [int(START.search(a)[2]) for a in attempts] == list(range(len(INTERRUPTIONS) + 1)), context
    runs = [_iterations(a) for a in attempts]
    assert all(runs), context
    stops = [run[-1][0] for run in runs]
    assert stops[-1] == TRAIN_ITERS and "training complete" in attempts[-1], (stops, context)
    assert "no complete checkpoint in" in attempts[0] and "starting from scratch" in attempts[0], context

    for attempt, (_, received) in enumerate(INTERRUPTIONS):
        stop = stops[attempt]
        # It stopped after the iteration the test saw and before the next start's.
        assert seen[attempt + 1] <= stop < seen[attempt + 2] if attempt + 2 < len(seen) else stop >= seen[-1]
        assert received in attempts[attempt], (attempt, context)
        assert f"saved checkpoint {save_dir}/iter_{stop:07d}" in attempts[attempt], (attempt, context)
        if "USR1" in " ".join(INTERRUPTIONS[attempt][0]):  # the script requeued the job itself
            assert f"requeueing job {job}" in attempts[attempt], (attempt, context)
        state = json.loads((save_dir / f"iter_{stop:07d}" / "run_state.json").read_text())
        assert state["iteration"] == stop and state["consumed_samples"] == stop * GLOBAL_BATCH
        # The next start resumes from that checkpoint and goes on with the next iteration and samples.
        assert (f"resumed from {save_dir}/iter_{stop:07d}: iteration {stop}, "
                f"consumed samples {stop * GLOBAL_BATCH}") in attempts[attempt + 1], (attempt, context)
        assert runs[attempt + 1][0][:2] == (stop + 1, (stop + 1) * GLOBAL_BATCH), (attempt, context)

    # Over all starts every iteration ran exactly once and each consumed the next GLOBAL_BATCH
    # samples: none repeated, none skipped.
    everything = [step for run in runs for step in run]
    assert [i for i, _, _ in everything] == list(range(1, TRAIN_ITERS + 1)), context
    assert all(consumed == i * GLOBAL_BATCH for i, consumed, _ in everything), context
    # The metrics files of the starts agree with the log.
    histories = [save_dir / "history" / f"job{job}-restart{r}.json" for r in range(len(attempts))]
    logged = [[(r["iteration"], r["consumed_samples"]) for r in json.loads(p.read_text()) if "loss" in r]
              for p in histories]
    assert logged == [[(i, c) for i, c, _ in run] for run in runs]

    # Training works: the loss falls (averages of the first and last 10 iterations).
    losses = [loss for _, _, loss in everything]
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 1.0, (first, last, context)
    final = json.loads((save_dir / f"iter_{TRAIN_ITERS:07d}" / "run_state.json").read_text())
    assert final["iteration"] == TRAIN_ITERS and final["consumed_samples"] == TRAIN_ITERS * GLOBAL_BATCH
    assert (save_dir / "latest").read_text().strip() == f"iter_{TRAIN_ITERS:07d}"
    assert any((tmp_path / "tensorboard").iterdir())


def _training_pids(marker: str) -> list[int]:
    """PIDs of the pretrain processes whose command line contains `marker` (the job's save dir)."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return [int(line.split(None, 1)[0]) for line in out.splitlines()
            if "megatron_pmlm.pretrain" in line and marker in line and line.split(None, 2)[1] == sys.executable]


def _task_rank(pid: int) -> int:
    """SLURM_PROCID of a task's process (from its environment)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"SLURM_PROCID=")).split(b"=", 1)[1])


STEP = re.compile(r"job (\d+) restart (\d+)(?: step (\d+))?: \d+ node\(s\) x \d+ task\(s\)")
TIME_LOST = re.compile(r"step (\d+): time lost: ([\d.]+) s from the failure to the first iteration of step \1 ")


def _steps(log: str) -> list[str]:
    """The job log split at each training step (in-job restarts and requeued starts alike)."""
    starts = [m.start() for m in STEP.finditer(log)]
    return [log[a:b] for a, b in zip(starts, starts[1:] + [len(log)])]


def _wait_for_step_iteration(cluster, job: int, log_path: Path, step: int, at_least: int, timeout: float) -> int:
    """Poll the job log (bounded) until training step `step` (counted over the whole log) has logged
    iteration >= at_least."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        steps = _steps(log_path.read_text(errors="replace") if log_path.exists() else "")
        if len(steps) > step:
            done = [i for i, _, _ in _iterations(steps[step])]
            if done and done[-1] >= at_least:
                return done[-1]
        assert cluster.job_state(job) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), _log_tail(log_path)
        time.sleep(0.3)
    raise AssertionError(f"step {step} did not reach iteration {at_least}:\n{_log_tail(log_path)}" + cluster.daemon_logs())


def _log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-6000:] if path.exists() else ""


def test_pretrain_job_restarts_in_place_after_a_crash_and_a_hang_then_requeues_and_gives_up_after_repeated_start_failures(
        cluster, prepared, tmp_path):
    """One job, IN_JOB_RESTARTS=2: kill -9 of one training process mid-run (what a GPU Xid or the OOM
    killer does) -> a second srun step in the same job resumes from the newest checkpoint; SIGSTOP of
    one rank (a hang no collective timeout sees soon) -> the heartbeat check names the stalled ranks and
    their phases, the step is SIGKILLed and a third step resumes; a second kill -9 -> no in-job restart
    left: the job requeues as before (Restarts=1) and finishes. Each in-job restart prints its time lost.
    A job that cannot start (here: its data is missing) is requeued until MAX_FAILED_RESTARTS (3)
    failures in a row, then stops with the error."""
    save_dir = tmp_path / "crash-checkpoints"
    env = cluster.env(PRESET="tiny", DEVICE="cpu", GPUS_PER_NODE="2", MICRO_BATCH="4",
                      GLOBAL_BATCH=str(GLOBAL_BATCH), TRAIN_ITERS=str(CRASH_TRAIN_ITERS), LOG_INTERVAL="1", SAVE_INTERVAL="2",
                      EVAL_ITERS="0", DATA_PATH=str(prepared[0]), SAVE_DIR=str(save_dir),
                      TB_DIR=str(tmp_path / "tensorboard"), PYTHON=sys.executable,
                      EXTRA_ARGS="--lr 2e-3 --lr-warmup-iters 2", OMP_NUM_THREADS="1",
                      IN_JOB_RESTARTS="2", HANG_TIMEOUT_SECONDS=str(HANG_TIMEOUT_SECONDS), POLL_SECONDS="1")
    log_path = tmp_path / "crash.out"
    job = cluster.sbatch(["--nodes=1", "--gres=none", f"--output={log_path}", str(SCRIPT)], env=env, cwd=REPO)
    seen = _wait_for_step_iteration(cluster, job, log_path, 0, at_least=5, timeout=240)
    victims = _training_pids(str(save_dir))
    assert len(victims) == 2, victims
    task = _task_rank(victims[1])
    os.kill(victims[1], 9)
    seen = _wait_for_step_iteration(cluster, job, log_path, 1, at_least=seen + 3, timeout=240)
    victims = _training_pids(str(save_dir))
    assert len(victims) == 2, victims
    os.kill(victims[0], 19)  # SIGSTOP: the other rank waits in its next collective
    seen = _wait_for_step_iteration(cluster, job, log_path, 2, at_least=seen + 3, timeout=240)
    victims = _training_pids(str(save_dir))
    assert len(victims) == 2, victims
    os.kill(victims[1], 9)
    info = cluster.wait_until_done(job, timeout=300)
    log = log_path.read_text(errors="replace")
    context = f"\n{log[-8000:]}\n{info}"
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", context
    steps = _steps(log)
    assert [STEP.search(s).group(2, 3) for s in steps] == [("0", None), ("0", "1"), ("0", "2"), ("1", None)], context
    assert not re.search(r"restart 0 step 3:", log), context
    # Step 0: the killed task's SIGKILL is the cause (not the SIGTERM srun then sent the other one),
    # mid-run, with progress: an in-job restart.
    first = steps[0]
    assert re.search(r"training crashed mid-run \(last iteration logged by this attempt: ([5-9]|\d\d+);.*\): "
                     rf"signal 9 \(SIGKILL\) of task {task} on host {cluster.node}\n", first), context
    assert "in-job restart 1 of 2 after a crash after progress" in first and "requeueing" not in first, context
    # Step 1: the hang, named rank by rank with its phase, ended with SIGKILL.
    second = steps[1]
    assert f"hang: no rank progressed for the timeout (HANG_TIMEOUT_SECONDS={HANG_TIMEOUT_SECONDS}); stalled:" in second, \
        context
    named = re.findall(r"  rank (\d) \(host \S+, pid \d+\) stalled in phase '([^']+)' for (\d+) s", second)
    assert sorted(rank for rank, _, _ in named) == ["0", "1"], context
    # Where each stopped: in a training step or a checkpoint save (SAVE_INTERVAL=2), for the timeout.
    assert all(re.fullmatch(r"step \d+|saving iter_\d+.*", phase) and int(age) >= HANG_TIMEOUT_SECONDS
               for _, phase, age in named), \
        context
    assert re.search(rf"sending SIGKILL to step {job}\.1\n", second), context
    assert "in-job restart 2 of 2 after a crash after progress" in second and "a hang" in second, context
    # Step 2: the second kill -9: no in-job restart left, requeued as before.
    third = steps[2]
    assert "no in-job restart left (IN_JOB_RESTARTS=2 used)" in third and f"requeueing job {job}" in third, context
    # Every step resumed from the newest complete checkpoint and went on from there.
    for before, after in zip(steps, steps[1:]):
        crashed_at = int(re.search(r"checkpoint at iteration (\d+), \d+ at the start\)", before)[1])
        assert crashed_at >= 4 and f"resumed from {save_dir}/iter_{crashed_at:07d}: iteration {crashed_at}" in after, context
        assert [i for i, _, _ in _iterations(after)][:1] == [crashed_at + 1], context
    assert [i for i, _, _ in _iterations(steps[-1])][-1] == CRASH_TRAIN_ITERS and "training complete" in steps[-1], \
        context
    # The time lost (failure -> first iteration of the next step) is printed for both in-job restarts.
    lost = [(int(s), float(seconds)) for s, seconds in TIME_LOST.findall(log)]
    assert [s for s, _ in lost] == [1, 2] and all(0 < seconds < 120 for _, seconds in lost), (lost, context)
    # Per-step history files; the status directories are cleaned up.
    assert all((save_dir / "history" / f"job{job}-{name}.json").is_file()
               for name in ("restart0", "restart0-step1", "restart0-step2", "restart1")), context
    assert not list((save_dir / ".task_status").iterdir()), context
    assert (save_dir / ".failed_restarts").read_text().strip() == "0"
    print(f"in-job restart time lost (single node, 2 tasks): {lost}")

    env.update(DATA_PATH=str(tmp_path / "no-such-samples"), SAVE_DIR=str(tmp_path / "never"))
    log_path = tmp_path / "broken.out"
    job = cluster.sbatch(["--nodes=1", "--gres=none", f"--output={log_path}", str(SCRIPT)], env=env, cwd=REPO)
    info = cluster.wait_until_done(job, timeout=300)
    log = log_path.read_text(errors="replace")
    context = f"\n{log[-6000:]}\n{info}"
    # Both tasks fail with status 2, and srun ends whichever is still running with SIGTERM: the job
    # still reports the 2 of the task that failed first.
    assert info["JobState"] == "FAILED" and info["Restarts"] == "2" and info["ExitCode"] == "2:0", context
    attempts = _attempts(log)
    assert len(attempts) == 3 and all("no-such-samples" in a for a in attempts), context
    cause = re.compile(r"training crashed at start-up \(no iteration logged and no checkpoint saved by this "
                       rf"attempt; LOG_INTERVAL=1\): exit status 2 of task [01] on host {cluster.node}\n")
    assert all(cause.search(a) and "training failed with status 2" in a for a in attempts), context
    assert "a signal stopped" not in log and "mid-run" not in log, context
    assert "1 failure(s) in a row without progress" in attempts[0] and "requeueing" in attempts[0], context
    assert "3 time(s) in a row without progress" in attempts[2] and "MAX_FAILED_RESTARTS=3 reached" in attempts[2]
