"""One run per --save directory (training/save_lock.py): a second run given the same --save is
refused in one line naming the holder while the first goes on; the kernel releases the lock when
the first is killed (kill -9), so the next run takes it; --no-lock warns; a holder from the same
SLURM job (a requeue, an in-job restart) is waited for."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pmlm_testing import REPO_ROOT, run_module

from megatron_pmlm.training import save_lock
from megatron_pmlm.training.checkpoint_files import LATEST_FILE, checkpoint_problem

TINY = ["--preset", "tiny", "--micro-batch-size", "4", "--global-batch-size", "4", "--eval-iters", "0",
        "--log-interval", "1"]


def wait_for(condition, seconds: float, what: str, process: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if process is not None and process.poll() is not None:
            raise AssertionError(f"the first run ended before {what}: {process.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_a_second_run_is_refused_and_a_killed_runs_lock_is_free(pretraining_samples, tmp_path):
    save = tmp_path / "ckpt"
    first = subprocess.Popen(
        [sys.executable, "-m", "megatron_pmlm.pretrain", *TINY, "--data-path", str(pretraining_samples),
         "--train-iters", "100000", "--save-interval", "2", "--save", str(save)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, cwd=REPO_ROOT)
    try:
        wait_for(lambda: (save / LATEST_FILE).is_file(), 240, "its first checkpoint", first)
        holder = save_lock.read_holder(save)
        assert holder["pid"] == first.pid and holder["host"] == socket.gethostname()
        second = run_module("megatron_pmlm.pretrain", *TINY, "--data-path", str(pretraining_samples),
                            "--train-iters", "4", "--save", str(save), "--load", str(save), timeout=120)
        assert second.returncode == 2, second.stdout[-2000:] + second.stderr[-2000:]
        assert second.stderr.strip() == (
            f"error: --save {save} is in use by another run (host {holder['host']}, pid {first.pid}, started "
            f"{holder['started']}; lock {save / save_lock.LOCK_FILE}): one run per --save directory")
        assert second.stdout == ""
        assert first.poll() is None  # the first goes on
        tag = (save / LATEST_FILE).read_text().strip()
        assert checkpoint_problem(save / tag, contents=True) is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
        first.stderr.close()
    # The kernel released the lock with the process: nothing to clean, the next run takes it.
    assert (save / save_lock.LOCK_FILE).is_file()
    iteration = int(json.loads((save / tag / "run_state.json").read_text())["iteration"])
    third = run_module("megatron_pmlm.pretrain", *TINY, "--data-path", str(pretraining_samples), "--train-iters",
                       str(iteration + 1), "--save", str(save), "--load", str(save), timeout=240)
    assert third.returncode == 0, third.stdout[-2000:] + third.stderr[-2000:]
    assert save_lock.read_holder(save)["pid"] != first.pid


def test_no_lock_warns_and_takes_no_lock(pretraining_samples, tmp_path):
    save = tmp_path / "ckpt"
    result = run_module("megatron_pmlm.pretrain", *TINY, "--data-path", str(pretraining_samples), "--train-iters",
                        "1", "--save", str(save), "--no-lock", timeout=240)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"warning: --no-lock: {save} is not locked; nothing stops a second run from writing there too" in \
        result.stderr.splitlines()
    assert not (save / save_lock.LOCK_FILE).exists() and (save / LATEST_FILE).is_file()


HOLD = """
import sys, time
from megatron_pmlm.training import save_lock
save_lock.lock_save_dir(sys.argv[1])
print("held", flush=True)
time.sleep(float(sys.argv[2]))
"""


def hold(directory: Path, seconds: float, job: str) -> subprocess.Popen:
    """Another process (of SLURM job `job`) holding `directory`'s lock for `seconds`."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), str(seconds)], stdout=subprocess.PIPE,
                              text=True, cwd=REPO_ROOT, env={**os.environ, "SLURM_JOB_ID": job})
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_the_same_slurm_job_waits_for_its_earlier_step_another_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    said = []
    other = hold(tmp_path, 30, job="999")
    try:
        with pytest.raises(save_lock.SaveDirInUse, match=r"in use by another run \(.*SLURM job 999"):
            save_lock.lock_save_dir(tmp_path, log=said.append, wait_for_same_job=20)
        assert said == []  # another job: refused at once
    finally:
        other.kill()
        other.wait()
    earlier_step = hold(tmp_path, 2, job="4242")
    try:
        save_lock.lock_save_dir(tmp_path, log=said.append, wait_for_same_job=60)
        assert said and "locked by an earlier step of this SLURM job" in said[0], said
        assert earlier_step.poll() is not None  # taken once the earlier step had ended
        assert save_lock.read_holder(tmp_path)["pid"] == os.getpid()
    finally:
        save_lock.release_save_dir(tmp_path)
        earlier_step.kill()
        earlier_step.wait()
    still_held = hold(tmp_path, 30, job="4242")
    try:
        with pytest.raises(save_lock.SaveDirInUse, match="still locked by an earlier step of this SLURM job"):
            save_lock.lock_save_dir(tmp_path, log=said.append, wait_for_same_job=1)
    finally:
        still_held.kill()
        still_held.wait()
