"""Distributed pre-training on the CPU (gloo, DS_ACCELERATOR=cpu): every parallel layout computes the
same losses, resume equals an uninterrupted run, signals save and exit, bad combinations are refused."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_pmlm.config import model_config_from_preset
from pmlm_testing import REPO_ROOT, run_module, torchrun

TINY = ["--preset", "tiny", "--micro-batch-size", "4", "--global-batch-size", "16", "--lr", "2e-3",
        "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-interval", "1000", "--eval-iters", "0"]
NO_DROPOUT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def pretrain(samples: Path, out: Path, *args: str, nproc: int = 1, iters: int = 4, env: dict | None = None):
    history = out / "history.json"
    result = run_module("megatron_pmlm.pretrain", "--data-path", str(samples), *TINY, "--train-iters", str(iters),
                        "--history-json", str(history), *args, nproc=nproc, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    records = [r for r in json.loads(history.read_text()) if "loss" in r]
    return records, result


def losses(records, key="loss"):
    return [round(r[key], 5) for r in records]


@pytest.fixture(scope="module")
def baseline_run(pretraining_samples, tmp_path_factory):
    """One process, ZeRO-0, TP=1, PP=1, no dropout: the reference losses and the saved weights."""
    out = tmp_path_factory.mktemp("baseline")
    records, _ = pretrain(pretraining_samples, out, *NO_DROPOUT, "--save", str(out / "checkpoint"))
    return records, out / "checkpoint"


def trained_table(checkpoint: Path) -> torch.Tensor:
    """The relative-bias table a run saved, in the plain model's names whatever its layout."""
    from megatron_pmlm.pretrained import load_model

    return load_model(checkpoint).state_dict["bert.rel_pos_bias.weight"].float()


@pytest.mark.parametrize("layout", [
    ["--zero-stage", "0"],
    ["--tensor-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2"],
    ["--zero-stage", "1"],
    ["--zero-stage", "2"],
    ["--zero-stage", "3"],
    ["--zero-stage", "2", "--checkpoint-activations"],
    ["--pipeline-model-parallel-size", "2", "--checkpoint-activations"],
    ["--pipeline-model-parallel-size", "2", "--attention-backend", "flex", "--checkpoint-activations"],
], ids=["zero0-dp2", "tp2", "pp2", "zero1-dp2", "zero2-dp2", "zero3-dp2", "zero2-dp2-activation-checkpointing",
        "pp2-activation-checkpointing", "pp2-flex-activation-checkpointing"])
def test_every_layout_reproduces_the_single_process_run(layout, baseline_run, pretraining_samples, tmp_path):
    """Data parallel only (tensor and pipeline size 1) runs without megatron-core (its groups made by
    parallel.distributed.DataParallelMPU; zero0-dp2: our AdamW sums the gradient norm over its
    one-rank model-parallel group, not over the replicas); the model-parallel layouts with it. The
    losses, and the relative-bias table as saved (whose gradient crosses the pipeline stages)."""
    baseline, baseline_checkpoint = baseline_run
    records, result = pretrain(pretraining_samples, tmp_path, *NO_DROPOUT, *layout, "--save", str(tmp_path / "checkpoint"),
                               nproc=2, env={"PYTHONPROFILEIMPORTTIME": "1"})
    imports_megatron = "| megatron.core\n" in result.stderr
    model_parallel = "--tensor-model-parallel-size" in layout or "--pipeline-model-parallel-size" in layout
    assert imports_megatron == model_parallel, layout
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    # Third-party notices that ask nothing of a CPU run are filtered (files.quiet_libraries): torch's
    # deprecation of the collectives ZeRO calls, megatron-core's CUDA_DEVICE_MAX_CONNECTIONS request.
    # Pipelines: the tied embedding's broadcast runs without grad, so autograd has no warning hook to
    # fire at the first backward ("may lead to silently incorrect behavior").
    for notice in ("is deprecated. Please use `torch.distributed", "CUDA_DEVICE_MAX_CONNECTIONS",
                   "c10d::broadcast_: an autograd kernel was not registered"):
        assert notice not in result.stdout + result.stderr, (notice, result.stderr[-3000:])
    for key in ("loss", "loss_ae", "loss_par"):
        for ours, reference in zip(losses(records, key), losses(baseline, key)):
            assert ours == pytest.approx(reference, rel=2e-4, abs=2e-4), (key, losses(records, key), losses(baseline, key))
    # The gradient norm is measured over the whole model whatever the layout (DeepSpeed's ZeRO
    # optimizers report it, our AdamW does in plain fp32).
    for ours, reference in zip(losses(records, "grad_norm"), losses(baseline, "grad_norm")):
        assert ours == pytest.approx(reference, rel=2e-3), (losses(records, "grad_norm"), losses(baseline, "grad_norm"))
    # The losses move: the comparison is not between four copies of the initial loss.
    assert baseline[-1]["loss"] < baseline[0]["loss"] - 0.05
    # Trained 4 steps at lr 2e-3 the table moves by ~6e-3; one without its gradient stays where it began.
    table, reference = trained_table(tmp_path / "checkpoint"), trained_table(baseline_checkpoint)
    assert float((table - reference).abs().max()) <= 1e-5, (table - reference).abs().max()


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed (pyproject's test "
                    "extra installs it on x86_64 Linux)")
@pytest.mark.parametrize("layout", [["--zero-stage", "3"],
                                    ["--pipeline-model-parallel-size", "2", "--checkpoint-activations", "--compile"]],
                         ids=["zero3", "pp2-activation-checkpointing-compile"])
def test_the_triton_backend_reproduces_the_single_process_run(layout, baseline_run, pretraining_samples, tmp_path):
    """The triton attention backend (its kernels in Triton's interpreter) on 2 ranks. ZeRO-3: the
    table it reads is copied inside the bias module's forward, where ZeRO-3 has gathered it, and its
    gradient reaches the partitioned parameter. Two pipeline stages: the first sends the fp32 table
    (its gradient comes back), each stage builds the codes and tile lists once per micro batch and
    hands them to its layers, compiled here (the kernels' custom op is opaque to inductor: the stage
    runs the eager stage's code around it; test_bucket_attention.py checks an eager stage against
    the model's layers). The losses and the trained relative-bias table are one process's sdpa ones."""
    baseline, baseline_checkpoint = baseline_run
    records, _ = pretrain(pretraining_samples, tmp_path, *NO_DROPOUT, *layout, "--attention-backend",
                          "triton", "--save", str(tmp_path / "checkpoint"), nproc=2, env={"TRITON_INTERPRET": "1"})
    table, reference = trained_table(tmp_path / "checkpoint"), trained_table(baseline_checkpoint)
    # Trained 4 steps at lr 2e-3 the table moves by ~6e-3; one without its gradient stays where it began.
    assert float((table - reference).abs().max()) <= 1e-5, (table - reference).abs().max()
    for key in ("loss", "loss_ae", "loss_par"):
        for ours, reference in zip(losses(records, key), losses(baseline, key)):
            assert ours == pytest.approx(reference, rel=2e-4, abs=2e-4), (key, losses(records, key), losses(baseline, key))
    for ours, reference in zip(losses(records, "grad_norm"), losses(baseline, "grad_norm")):
        assert ours == pytest.approx(reference, rel=2e-3), (losses(records, "grad_norm"), losses(baseline, "grad_norm"))
    assert baseline[-1]["loss"] < baseline[0]["loss"] - 0.05


def test_pipeline_without_the_relative_bias_reproduces_one_process_with_either_backend(pretraining_samples, tmp_path):
    """Without the bias the stages pass the boolean mask (sdpa) or an integer placeholder (flex,
    triton): DeepSpeed's pipeline wants a gradient for every floating-point activation it sends."""
    reference, _ = pretrain(pretraining_samples, tmp_path / "one", *NO_DROPOUT, "--no-rel-pos", iters=2)
    for backend in ("sdpa", "flex") + (("triton",) if importlib.util.find_spec("triton") else ()):
        records, _ = pretrain(pretraining_samples, tmp_path / backend, *NO_DROPOUT, "--no-rel-pos",
                              "--pipeline-model-parallel-size", "2", "--attention-backend", backend, nproc=2, iters=2,
                              env={"TRITON_INTERPRET": "1"} if backend == "triton" else None)
        assert losses(records) == pytest.approx(losses(reference), rel=2e-4), (backend, records, reference)


def test_pipeline_stages_send_the_hidden_states_and_no_attention_bias(pretraining_samples, tmp_path):
    """tools/bench_pipeline_traffic.py over two sdpa stages: the largest tensors crossing are the
    hidden states [B, T, hidden]; no [B, heads, T, T] bias goes forward or comes back as a gradient
    (the first stage sent both before the stages passed the table)."""
    report_path = tmp_path / "traffic.json"
    result = subprocess.run([sys.executable, str(REPO_ROOT / "tools" / "bench_pipeline_traffic.py"), "--nproc", "2",
                             "--json", str(report_path), "--", "--data-path", str(pretraining_samples), *TINY,
                             *NO_DROPOUT, "--train-iters", "1", "--pipeline-model-parallel-size", "2"],
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_path.read_text())
    assert report["micro_batches_per_rank"] == 4 and len(report["ranks"]) == 2, report
    hidden_size = model_config_from_preset("tiny").hidden_size
    for rank in report["ranks"]:
        assert rank["bytes_per_micro_batch"] > 0, rank
        largest = rank["largest"][0]
        assert len(largest["shape"]) == 3 and largest["shape"][-1] == hidden_size, rank
        assert all(len(entry["shape"]) <= 3 for entry in rank["largest"]), rank
    assert "| rank | bytes sent |" in result.stdout


@pytest.mark.parametrize("layout", [["--zero-stage", "2"], ["--tensor-model-parallel-size", "2"]],
                         ids=["zero2", "tp2"])
def test_resume_equals_the_uninterrupted_run(layout, pretraining_samples, tmp_path):
    """With dropout on: the RNG states, the sample order and the optimizer all come back."""
    full, _ = pretrain(pretraining_samples, tmp_path / "full", *layout, "--save", str(tmp_path / "full_ckpt"),
                       nproc=2, iters=6)
    first, result = pretrain(pretraining_samples, tmp_path / "first", *layout, "--save", str(tmp_path / "ckpt"),
                             "--exit-interval", "3", nproc=2, iters=6)
    assert [r["iteration"] for r in first] == [1, 2, 3]
    assert "--exit-interval 3 reached" in result.stdout
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000003"
    second, result = pretrain(pretraining_samples, tmp_path / "second", *layout, "--save", str(tmp_path / "ckpt"),
                              "--load", str(tmp_path / "ckpt"), nproc=2, iters=6)
    assert "resumed from" in result.stdout and "iteration 3, consumed samples 48" in result.stdout
    assert [r["iteration"] for r in second] == [4, 5, 6]
    assert losses(first) + losses(second) == pytest.approx(losses(full), rel=1e-5)
    assert [r["consumed_samples"] for r in second] == [64, 80, 96]


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1], ids=["SIGTERM", "SIGUSR1"])
def test_a_signal_saves_a_loadable_checkpoint_and_exits_cleanly(signum, pretraining_samples, tmp_path):
    """Like SLURM before a time limit or preemption, the signal reaches the training processes
    (here only one of the two: the ranks agree and both save)."""
    ckpt = tmp_path / "ckpt"
    command = [*torchrun(2), "-m", "megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), *TINY,
               "--train-iters", "100000", "--zero-stage", "2", "--save", str(ckpt)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    lines = []
    deadline = time.time() + 240
    while time.time() < deadline:
        line = process.stdout.readline()
        lines.append(line)
        if line.startswith("iteration") and "/100000" in line and int(line.split()[1].split("/")[0]) >= 2:
            break
    workers = _children(process.pid)
    assert len(workers) == 2, workers
    os.kill(workers[0], signum)
    output, _ = process.communicate(timeout=240)
    lines.append(output)
    text = "".join(lines)
    assert process.returncode == 0, text[-4000:]
    assert "received signal" in text
    tag = (ckpt / "latest").read_text()
    stopped_at = int(tag.split("_")[1])
    assert stopped_at >= 2 and (ckpt / tag / "run_state.json").is_file()
    resumed, result = pretrain(pretraining_samples, tmp_path / "resumed", "--zero-stage", "2", "--load", str(ckpt),
                               nproc=2, iters=stopped_at + 1)
    assert f"iteration {stopped_at}, consumed samples {16 * stopped_at}" in result.stdout
    assert [r["iteration"] for r in resumed] == [stopped_at + 1]


def _start_until_iteration(command: list[str], iteration: int, **popen) -> tuple[subprocess.Popen, list[str]]:
    """Start a training command and read its output until it logs `iteration` (of 100000)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, **popen)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("iteration") and "/100000" in line and int(line.split()[1].split("/")[0]) >= iteration:
            return process, lines
    process.wait()
    raise AssertionError(f"exited with {process.returncode} before iteration {iteration}:\n" + "".join(lines)[-4000:])


def _saved_on_ctrl_c(text: str, ckpt: Path, seen: int) -> int:
    """The one line, and a complete checkpoint at the iteration it names (no earlier than `seen`)."""
    from megatron_pmlm.training.checkpoint_files import checkpoint_problem

    lines = [line for line in text.splitlines() if "received signal" in line]
    assert len(lines) == 1, text[-4000:]
    iteration = int(lines[0].split("saved at iteration ")[1].split(",")[0])
    assert lines[0] == f"received signal 2 (SIGINT, Ctrl-C): saved at iteration {iteration}, exiting with status 130"
    assert iteration >= seen
    tag = f"iter_{iteration:07d}"
    assert (ckpt / "latest").read_text() == tag
    assert checkpoint_problem(ckpt / tag) is None
    assert json.loads((ckpt / tag / "run_state.json").read_text())["iteration"] == iteration
    assert "KeyboardInterrupt" not in text
    return iteration


def test_ctrl_c_saves_at_the_current_iteration_and_exits_130(pretraining_samples, tmp_path):
    """SIGINT as SIGTERM: save at the end of the iteration, one line, exit 130; no traceback."""
    ckpt = tmp_path / "ckpt"
    process, lines = _start_until_iteration(
        [sys.executable, "-m", "megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), *TINY,
         "--train-iters", "100000", "--save", str(ckpt)], iteration=2)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=240)
    text = "".join(lines) + output
    assert process.returncode == 130, text[-4000:]
    assert "Traceback" not in text
    _saved_on_ctrl_c(text, ckpt, seen=2)


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler installed for `signum` (the SigCgt mask of /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError(f"no SigCgt line in /proc/{pid}/status")


def _fill(pipe_write_end: int) -> None:
    """Write into a pipe until it holds not one more byte (pages first, then single bytes).

    Through a second open of the pipe: O_NONBLOCK belongs to an open file description, and the one
    behind `pipe_write_end` is the child's stdout too, whose writes must block, not fail."""
    own = os.open(f"/proc/self/fd/{pipe_write_end}", os.O_WRONLY | os.O_NONBLOCK)
    try:
        for chunk in (b"." * 4096, b"."):
            try:
                while True:
                    os.write(own, chunk)
            except BlockingIOError:
                pass
    finally:
        os.close(own)


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="needs /proc (Linux) to see signal handlers")
def test_a_second_ctrl_c_exits_at_once(pretraining_samples, tmp_path):
    """The second Ctrl-C ends a run that has not got to its save yet, here one held at its next log line.

    Deterministic, no sleeps to guess: the test keeps the write end of the run's output pipe and fills
    it, so the run cannot get past its next log line (the signal check and the save come after it).
    The first SIGINT runs the handler, which puts the default action back (/proc shows the handler
    gone); the second SIGINT then ends the process by that default action, with nothing saved."""
    ckpt = tmp_path / "ckpt"
    read_end, write_end = os.pipe()
    process = subprocess.Popen(
        [sys.executable, "-m", "megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), *TINY,
         "--train-iters", "100000", "--save", str(ckpt)], stdout=write_end, stderr=write_end,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    reader = os.fdopen(read_end, "r")
    lines = []
    try:
        for line in reader:
            lines.append(line)
            if line.startswith("iteration") and "/100000" in line:
                break
        else:
            raise AssertionError("the run ended before its first iteration:\n" + "".join(lines)[-4000:])
        _fill(write_end)
        assert _catches(process.pid, signal.SIGINT)
        process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 60
        while _catches(process.pid, signal.SIGINT):
            assert process.poll() is None, "the run ended on the first SIGINT while held at its log line"
            assert time.monotonic() < deadline, "the SIGINT handler is still installed 60 s after the first SIGINT"
            time.sleep(0.01)
        assert process.poll() is None, "the run went on past a full pipe"
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=120) == -signal.SIGINT  # the default action: ended by the signal
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        os.close(write_end)
        text = "".join(lines) + reader.read().replace(".", "")
        reader.close()
    assert "received signal" not in text and "Traceback" not in text and "KeyboardInterrupt" not in text, text[-4000:]
    assert not (ckpt / "latest").exists()


def test_ctrl_c_under_torchrun_saves_before_the_agent_s_grace_period_ends(pretraining_samples, tmp_path):
    """Ctrl-C in a terminal signals the foreground process group. torchrun starts its workers in
    sessions of their own and relays SIGINT to them, then waits --shutdown-timeout (30 s) before
    SIGKILL: the workers save within it and exit 130. (torchrun itself then exits 1 with its own
    SignalException traceback, which names no frame of ours.)"""
    ckpt = tmp_path / "ckpt"
    process, lines = _start_until_iteration(
        [*torchrun(2), "-m", "megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), *TINY,
         "--train-iters", "100000", "--zero-stage", "2", "--save", str(ckpt)], iteration=2, start_new_session=True)
    os.killpg(process.pid, signal.SIGINT)  # what the terminal does
    output, _ = process.communicate(timeout=240)
    text = "".join(lines) + output
    iteration = _saved_on_ctrl_c(text, ckpt, seen=2)
    assert {p.name for p in (ckpt / f"iter_{iteration:07d}").glob("rng_state_rank*.pt")} == \
        {"rng_state_rank00000.pt", "rng_state_rank00001.pt"}
    assert "Unable to shutdown process" not in text  # no worker needed the SIGKILL
    assert "megatron_pmlm" not in "".join(text.split("Traceback")[1:]), text[-4000:]


def test_refused_combinations_say_why(pretraining_samples, tmp_path):
    result = run_module("megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), *TINY,
                        "--pipeline-model-parallel-size", "2", "--zero-stage", "2")
    assert result.returncode == 2
    assert "ZeRO stage 2 cannot be combined with pipeline parallelism" in result.stderr
    assert "Traceback" not in result.stderr
    result = run_module("megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), *TINY,
                        "--tensor-model-parallel-size", "3")
    assert result.returncode == 2 and "does not divide the 4 attention heads" in result.stderr


def test_universal_checkpoint_resumes_on_another_data_parallel_size(pretraining_samples, tmp_path):
    """Losing a node: a 2-process ZeRO-2 run's checkpoint at 10 resumes on 1 process (same global
    batch) with iteration, optimizer, schedule and sample order intact. The 2-process run goes on
    to 20 uninterrupted (the reference), its checkpoint at 10 copied to a folder of its own as the
    one the lost node left (test_resume_equals_the_uninterrupted_run covers --exit-interval)."""
    common = ["--zero-stage", "2", *NO_DROPOUT]
    full_ckpt, ckpt = tmp_path / "full_ckpt", tmp_path / "ckpt"
    full, first_run = pretrain(pretraining_samples, tmp_path / "full", *common, "--save", str(full_ckpt),
                               "--save-interval", "10", nproc=2, iters=20)
    shutil.copytree(full_ckpt / "iter_0000010", ckpt / "iter_0000010")
    (ckpt / "latest").write_text("iter_0000010")
    first = full[:10]
    # Start-up warnings come from rank 0 only, not once per process.
    for line in set(first_run.stderr.splitlines()):
        if "Warning:" in line:
            assert first_run.stderr.count(line) == 1, line
    # ... and megatron-core's TE/Apex warning and DeepSpeed's accelerator line not at all.
    assert "Transformer Engine and Apex" not in first_run.stderr, first_run.stderr[-3000:]
    assert "Setting accelerator" not in first_run.stderr + first_run.stdout
    # Without the flag another data-parallel size is refused, naming the way.
    refused = run_module("megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), *TINY, *common,
                         "--train-iters", "20", "--load", str(ckpt))
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "data-parallel size 2, this run has 1" in refused.stderr and "add --universal-checkpoint" in refused.stderr
    second, result = pretrain(pretraining_samples, tmp_path / "second", *common, "--save", str(ckpt), "--load",
                              str(ckpt), "--universal-checkpoint", nproc=1, iters=20)
    assert f"resumed from {ckpt / 'iter_0000010'}: iteration 10, consumed samples 160 (through " \
           f"{ckpt / 'iter_0000010_universal'}, data-parallel size 2 -> 1)" in result.stdout
    assert ("note: the RNG states are not restored because the data-parallel size changed (2 then, 1 now)"
            in result.stdout), result.stdout[-3000:]
    assert [r["iteration"] for r in second] == list(range(11, 21))
    assert [r["consumed_samples"] for r in second] == [16 * i for i in range(11, 21)]
    assert losses(first) + losses(second) == pytest.approx(losses(full), abs=1e-4)
    assert [r["lr"] for r in second] == pytest.approx([r["lr"] for r in full[10:]])
    assert (ckpt / "latest_universal").read_text() == "iter_0000010_universal"
    # The flag may stay in a job's arguments: a checkpoint of this size loads as it is.
    third, result = pretrain(pretraining_samples, tmp_path / "third", *common, "--load", str(ckpt),
                             "--universal-checkpoint", nproc=1, iters=21)
    assert "loads as it is on data-parallel size 1" in result.stdout
    assert f"resumed from {ckpt / 'iter_0000020'}: iteration 20, consumed samples 320\n" in result.stdout
    assert [r["iteration"] for r in third] == [21]


def test_tensor_parallel_gradients_equal_tensor_parallel_size_1():
    """megatron-core layers at TP=2: each rank's initial weights are its slice of the TP=1 model's,
    and the loss and every merged gradient equal TP=1's."""
    script = Path(__file__).parent / "distributed" / "tp_equivalence.py"
    result = subprocess.run(
        [*torchrun(2), str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "TP=2 matches TP=1" in result.stdout


def test_each_task_takes_the_gpu_its_local_rank_maps_to():
    """Every GPU visible (index = local rank) or one bound per task (index 0): local rank modulo."""
    from megatron_pmlm.parallel.distributed import local_device_index

    assert [local_device_index(rank, 8) for rank in range(8)] == list(range(8))
    assert [local_device_index(rank, 1) for rank in range(8)] == [0] * 8
    with pytest.raises(RuntimeError, match="no GPU is visible"):
        local_device_index(0, 0)
