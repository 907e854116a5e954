"""Every multi-process run ends cleanly, every time, on a busy machine: exit status 0 and no abort at
interpreter teardown ("terminate called without an active exception", SIGABRT), which once failed
finished runs because nothing ended the process groups (megatron_pmlm.parallel.distributed.end_distributed).

Each job runs REPEATS times (PMLM_CLEAN_EXIT_REPEATS overrides it) while a CPU-burning process
competes for the cores, which is what made the abort appear."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pmlm_testing import REPO_ROOT, run_module

REPEATS = int(os.environ.get("PMLM_CLEAN_EXIT_REPEATS", "3"))
ABORT = "terminate called"


@pytest.fixture(scope="module")
def cpu_hog():
    """A busy loop on one core for as long as the module's tests run, then killed."""
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    yield hog
    hog.kill()
    hog.wait()


def _assert_clean(result: subprocess.CompletedProcess, attempt: int) -> None:
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"attempt {attempt}: exit {result.returncode}\n{output[-4000:]}"
    assert ABORT not in output, f"attempt {attempt}: aborted at exit\n{output[-4000:]}"
    assert "Traceback" not in output, f"attempt {attempt}\n{output[-4000:]}"


def test_two_process_palm_tensor_parallel_check_exits_cleanly(cpu_hog):
    script = REPO_ROOT / "tests" / "distributed" / "palm_tp_equivalence.py"
    for attempt in range(1, REPEATS + 1):
        result = run_module("torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
                            env={"PYTHONPATH": str(REPO_ROOT)})
        _assert_clean(result, attempt)
        assert "stage 2: TP=2 matches TP=1" in result.stdout


def test_two_process_zero2_pretraining_exits_cleanly(cpu_hog, pretraining_samples, tmp_path):
    for attempt in range(1, REPEATS + 1):
        save = tmp_path / f"ckpt{attempt}"
        result = run_module("megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), "--preset", "tiny",
                            "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "2",
                            "--log-interval", "1", "--eval-iters", "0", "--zero-stage", "2", "--save", str(save),
                            "--tensorboard-dir", str(tmp_path / f"tb{attempt}"), nproc=2)
        _assert_clean(result, attempt)
        assert (save / "latest").read_text().strip() == "iter_0000002"


def test_two_process_finetuning_exits_cleanly(cpu_hog, tiny_hf_model, qg_pairs, tmp_path):
    for attempt in range(1, REPEATS + 1):
        save = tmp_path / f"ft{attempt}"
        result = run_module("megatron_pmlm.finetune_s2s", "--model", str(tiny_hf_model), "--train-src",
                            str(qg_pairs[0]), "--train-tgt", str(qg_pairs[1]), "--max-source-length", "48",
                            "--max-target-length", "16", "--micro-batch-size", "4", "--global-batch-size", "16",
                            "--train-iters", "2", "--log-interval", "1", "--zero-stage", "2", "--save", str(save),
                            nproc=2)
        _assert_clean(result, attempt)
        assert (save / "latest").is_file()
