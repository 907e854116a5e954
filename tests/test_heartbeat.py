"""Hang detection (issue 35 item 3): the phases real tiny runs (pretrain, finetune_s2s) write, with the
sub-step beats of saves, validation, universal conversions and compilation; a training process stopped
by SIGSTOP (one rank, or one of two) reported by `heartbeat check` with its phase; the file's writes;
the timeout rule, stale files and bad input."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_pmlm.training import heartbeat
from megatron_pmlm.training.heartbeat import Heartbeat, heartbeat_file
from pmlm_testing import REPO_ROOT, run_module, torchrun

TINY = ["--preset", "tiny", "--micro-batch-size", "4", "--global-batch-size", "4", "--eval-iters", "0",
        "--log-interval", "1"]

TRACE = """
import sys
from megatron_pmlm.training import heartbeat
beat, write = heartbeat.Heartbeat.beat, heartbeat.Heartbeat.write
def traced(method, kind):
    def call(self, *args):
        method(self, *args)
        with open(sys.argv[1], "a") as trace:
            trace.write(f"{kind} {self.phase}\\n")
    return call
heartbeat.Heartbeat.beat, heartbeat.Heartbeat.write = traced(beat, "beat"), traced(write, "write")
import importlib
sys.exit(importlib.import_module(sys.argv[2]).main(sys.argv[3:]))
"""
"""`python -c TRACE TRACE_FILE MODULE ARGS...`: the training command MODULE with each heartbeat beat and write
also appended to TRACE_FILE ("beat PHASE", "write PHASE")."""


def traced_run(trace: Path, module: str, *args: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", TRACE, str(trace), module, *args], capture_output=True, text=True,
                            timeout=300, cwd=REPO_ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return trace.read_text().splitlines()


def in_order(expected: list[str], phases: list[str]) -> bool:
    remaining = iter(phases)
    return all(phase in remaining for phase in expected)


def check(folder: Path, *args: str, capsys) -> tuple[int, str, str]:
    code = heartbeat.main(["check", str(folder), *args])
    out, err = capsys.readouterr()
    return code, out, err


def write_record(folder: Path, rank: int, **fields) -> None:
    now = time.time()
    record = {"rank": rank, "world_size": 2, "host": "node-a", "pid": 1000 + rank, "phase": "step 57",
              "iteration": 57, "progress_time": now, "write_time": now, "slowest_iteration_seconds": 0.0,
              "started": now - 100, **fields}
    folder.mkdir(parents=True, exist_ok=True)
    heartbeat_file(folder, rank).write_text(json.dumps(record))


# ------------------------------------------------------------------------------------------------- real runs

def test_a_tiny_pretrain_reports_start_up_steps_saving_and_done(pretraining_samples, tmp_path):
    beats, trace = tmp_path / "beats", tmp_path / "trace.txt"
    lines = traced_run(trace, "megatron_pmlm.pretrain", *TINY, "--data-path", str(pretraining_samples),
                       "--train-iters", "4", "--save-interval", "2", "--save", str(tmp_path / "ckpt"),
                       "--heartbeat-dir", str(beats))
    written = [line.removeprefix("write ") for line in lines if line.startswith("write ")]
    assert in_order(["start-up", "start-up: distributed init", "start-up: building model",
                     "start-up: building the engine", "start-up: loading data", "step 1", "saving iter_0000002",
                     "saving iter_0000002: DeepSpeed files", "saving iter_0000002: checksums",
                     "saving iter_0000002: manifest", "step 3", "saving iter_0000004", "done"], written), written
    # Long phases beat at their own sub-steps: each file DeepSpeed writes (here one, the model states),
    # each file hashed (it and the RNG state).
    assert lines.count("beat saving iter_0000002: DeepSpeed files") == 2, lines
    assert lines.count("beat saving iter_0000002: checksums") == 3, lines
    record = json.loads(heartbeat_file(beats, 0).read_text())
    assert record["phase"] == "done" and record["rank"] == 0 and record["world_size"] == 1
    assert record["pid"] != os.getpid() and record["host"] and record["iteration"] == 4
    assert record["started"] <= record["progress_time"] <= record["write_time"] <= time.time()
    assert 0 < record["slowest_iteration_seconds"] < record["write_time"] - record["started"]
    assert [p.name for p in beats.iterdir()] == ["rank-00000.json"]  # no temporary file left
    code = heartbeat.main(["check", str(beats), "--ranks", "1", "--since", str(record["started"] - 1),
                           "--timeout", "0.001"])
    assert code == 0  # a finished rank is never stalled


def test_finetune_s2s_reports_validation_saving_exporting_and_done(tiny_hf_model, qg_pairs, tmp_path):
    beats = tmp_path / "beats"
    src, tgt = map(str, qg_pairs)
    lines = traced_run(tmp_path / "trace.txt", "megatron_pmlm.finetune_s2s", "--model", str(tiny_hf_model),
                       "--train-src", src, "--train-tgt", tgt, "--valid-src", src, "--valid-tgt", tgt,
                       "--eval-iters", "2", "--eval-interval", "2", "--max-source-length", "48",
                       "--max-target-length", "16", "--micro-batch-size", "8", "--global-batch-size", "8",
                       "--train-iters", "2", "--log-interval", "1", "--save", str(tmp_path / "c"),
                       "--heartbeat-dir", str(beats))
    written = [line.removeprefix("write ") for line in lines if line.startswith("write ")]
    assert in_order(["start-up", "start-up: distributed init", "step 1", "validation", "saving iter_0000002",
                     "exporting", "done"], written), written
    assert lines.count("beat validation") == 2, lines  # one per validation batch
    assert json.loads(heartbeat_file(beats, 0).read_text())["phase"] == "done"


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_stopped_training_process_is_reported_with_its_phase_a_running_one_is_not(nproc, pretraining_samples,
                                                                                   tmp_path):
    """One process stopped (SIGSTOP, as a hung rank): `check` names it and its phase once the timeout has
    passed, not before; with two data-parallel ranks the other one, blocked in the step's all-reduce,
    stops progressing too and both are named."""
    beats = tmp_path / "beats"
    since = time.time()
    launcher = [sys.executable, "-m"] if nproc == 1 else [*torchrun(nproc), "-m"]
    process = subprocess.Popen(
        [*launcher, "megatron_pmlm.pretrain", *TINY, "--data-path", str(pretraining_samples), "--global-batch-size",
         str(4 * nproc), "--train-iters", "100000", "--log-interval", "1000", "--heartbeat-dir", str(beats)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    pids = {process.pid}

    def records() -> list[dict | None]:
        found = []
        for rank in range(nproc):
            try:
                found.append(json.loads(heartbeat_file(beats, rank).read_text()))
            except (OSError, ValueError):
                found.append(None)
        return found

    def run_check(timeout: float) -> subprocess.CompletedProcess:
        return run_module("megatron_pmlm.training.heartbeat", "check", str(beats), "--ranks", str(nproc),
                          "--since", str(since), "--timeout", str(timeout), timeout=60)

    try:
        deadline = time.time() + 240
        while time.time() < deadline and process.poll() is None:
            running = records()
            pids.update(record["pid"] for record in running if record)
            if all(record and record["phase"].startswith("step ") and record["iteration"] >= 3 for record in running):
                break
            time.sleep(0.2)
        assert process.poll() is None, process.stderr.read()[-3000:]
        assert all(record and record["phase"].startswith("step ") for record in running), running
        healthy = run_check(5)
        assert (healthy.returncode, healthy.stdout, healthy.stderr) == (0, "", "")
        hung = running[-1]["pid"]  # the last rank: the one that logs
        os.kill(hung, signal.SIGSTOP)
        stopped_at = time.time()
        time.sleep(0.3)
        assert run_check(5).returncode == 0  # stopped for less than the timeout: not yet a hang
        time.sleep(max(0.0, max(record["progress_time"] for record in records()) + 5.5 - time.time()))
        final = records()
        stalled = run_check(5)
        reported_after = time.time() - stopped_at
        assert stalled.returncode == 1, stalled.stdout + stalled.stderr
        lines = stalled.stdout.splitlines()
        assert len(lines) == nproc, lines
        for record in final:
            line = next(line for line in lines if line.startswith(f"rank {record['rank']} "))
            assert line.startswith(f"rank {record['rank']} (host {record['host']}, pid {record['pid']}) stalled in "
                                   f"phase '{record['phase']}' for "), line
            assert record["phase"].startswith("step ")
            assert 5 <= int(line.rsplit(" ", 2)[1]) <= time.time() - record["progress_time"] + 1, line
        assert final[-1]["pid"] == hung
        assert reported_after < 5 + 1 + 10  # the timeout, the write interval, a loaded machine's check
    finally:
        for pid in sorted(pids - {process.pid}) + [process.pid]:
            try:  # the workers first (torchrun starts each in its own session), then the launcher; SIGKILL
                os.kill(pid, signal.SIGKILL)  # reaches a stopped process, as the batch script's would
            except ProcessLookupError:
                pass
        process.wait(timeout=60)
        process.stderr.close()


def test_a_folder_that_cannot_be_created_is_refused_before_anything_is_written(pretraining_samples, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = run_module("megatron_pmlm.pretrain", *TINY, "--data-path", str(pretraining_samples), "--train-iters", "1",
                        "--save", str(tmp_path / "ckpt"), "--heartbeat-dir", str(blocker / "beats"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == \
        f"error: --heartbeat-dir {blocker / 'beats'} cannot be created: {blocker} is a file, not a directory"
    assert not (tmp_path / "ckpt").exists()


def test_universal_conversions_beat_per_unit(pretraining_samples, tmp_path):
    import torch

    from megatron_pmlm.training.checkpoint_files import RUN_STATE_FILE
    from megatron_pmlm.training.relayout import relayout_to_universal
    from megatron_pmlm.training.universal_checkpoint import convert_to_universal

    result = run_module("megatron_pmlm.pretrain", *TINY, "--data-path", str(pretraining_samples), "--train-iters", "1",
                        "--zero-stage", "1", "--save", str(tmp_path / "ckpt"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    tag_dir = tmp_path / "ckpt" / "iter_0000001"
    saved = json.loads((tag_dir / RUN_STATE_FILE).read_text())
    shapes = torch.load(tag_dir / "mp_rank_00_model_states.pt", weights_only=False)["param_shapes"]
    parameters = sum(len(group) for group in shapes)
    from deepspeed.checkpoint import ds_to_universal

    save_file = ds_to_universal._save_checkpoint
    phases = []
    current = heartbeat.start(tmp_path / "beats", rank=0, world_size=1)
    beat = current.beat
    current.beat = lambda phase, iteration=None: (phases.append(phase), beat(phase, iteration))
    try:
        convert_to_universal(tag_dir, log=lambda message: None)
        relayout_to_universal(tag_dir, saved, 2, 1, int(saved["args"]["model_config"]["padded_vocab_size"]),
                              log=lambda message: None)
    finally:
        heartbeat.start(None)
    assert ds_to_universal._save_checkpoint is save_file  # the converter is left as it was
    # DeepSpeed's converter: every file it writes (3 optimizer states x each parameter's fragment, merged).
    assert phases.count("start-up: universal conversion of iter_0000001") > 3 * parameters, phases
    assert phases.count("start-up: universal conversion of iter_0000001, reading model-parallel rank 0") == 2
    assert phases.count("start-up: universal conversion of iter_0000001, writing parameters") == 1 + parameters
    assert json.loads(heartbeat_file(tmp_path / "beats", 0).read_text())["phase"].startswith(
        "start-up: universal conversion of iter_0000001")


def test_a_new_compiled_shape_beats_compiling(tmp_path):
    import torch

    from megatron_pmlm.models import compiled

    current = heartbeat.start(tmp_path, rank=0, world_size=1)
    announce = functools.partial(compiled._announce_new_shape, on_new_shape=heartbeat.compiling)  # as the recipes hook it
    try:
        current.beat("step 7", 7)
        announce(torch.nn.Identity(), (torch.zeros(1, 7919, 3),))
        assert json.loads(heartbeat_file(tmp_path, 0).read_text())["phase"] == "compiling"
        current.beat("step 8", 8)
        announce(torch.nn.Identity(), (torch.zeros(1, 7919, 3),))  # known: no compilation
        assert current.phase == "step 8"
    finally:
        heartbeat.start(None)


# ------------------------------------------------------------------------------------------------- the file

def test_beats_are_written_atomically_with_the_umask_and_rate_limited_within_a_kind(tmp_path):
    old_umask = os.umask(0o027)
    try:
        beat = Heartbeat(tmp_path / "beats", rank=3, world_size=8)
    finally:
        os.umask(old_umask)
    path = heartbeat_file(tmp_path / "beats", 3)
    assert path.name == "rank-00003.json" and path.stat().st_mode & 0o777 == 0o640
    first = json.loads(path.read_text())
    assert set(first) == {"rank", "world_size", "host", "pid", "phase", "iteration", "progress_time", "write_time",
                          "slowest_iteration_seconds", "started"}
    assert (first["rank"], first["world_size"], first["phase"], first["pid"]) == (3, 8, "start-up", os.getpid())
    beat.beat("step 1", 1)
    assert json.loads(path.read_text())["phase"] == "step 1"  # another kind of phase: written at once
    time.sleep(0.05)
    beat.beat("step 2", 2)  # same kind within the write interval: in memory only
    on_disk = json.loads(path.read_text())
    assert on_disk["phase"] == "step 1" and beat.phase == "step 2" and beat.progress_time > on_disk["progress_time"]
    beat.beat("validation")  # no iteration given: the last one stays
    on_disk = json.loads(path.read_text())
    assert on_disk["phase"] == "validation" and on_disk["iteration"] == 2
    assert 0.04 < on_disk["slowest_iteration_seconds"] < 1  # the longest "step N" phase
    beat.write_time -= heartbeat.MIN_WRITE_INTERVAL_SECONDS  # as if a second had passed since the last write
    beat.beat("step 3", 3)
    beat.write_time -= heartbeat.MIN_WRITE_INTERVAL_SECONDS
    beat.beat("step 4", 4)
    assert json.loads(path.read_text())["phase"] == "step 4"
    assert sorted(p.name for p in (tmp_path / "beats").iterdir()) == ["rank-00003.json"]


# ------------------------------------------------------------------------------------------------- checking

def test_healthy_while_any_rank_progresses_stalled_lines_oldest_first(tmp_path, capsys):
    now = time.time()
    write_record(tmp_path, 0, progress_time=now - 700, phase="step 57")
    write_record(tmp_path, 1, progress_time=now - 10, phase="saving iter_0000056")
    assert check(tmp_path, "--ranks", "2", "--since", str(now - 1000), capsys=capsys) == (0, "", "")
    write_record(tmp_path, 1, progress_time=now - 650, phase="saving iter_0000056")
    code, out, err = check(tmp_path, "--ranks", "2", "--since", str(now - 1000), capsys=capsys)
    assert (code, err) == (1, "")
    assert out.splitlines() == ["rank 0 (host node-a, pid 1000) stalled in phase 'step 57' for 700 s",
                                "rank 1 (host node-a, pid 1001) stalled in phase 'saving iter_0000056' for 650 s"]


def test_the_timeout_rule(tmp_path, capsys):
    now = time.time()
    since = str(now - 5000)
    write_record(tmp_path, 0, progress_time=now - 650, slowest_iteration_seconds=100.0)
    write_record(tmp_path, 1, progress_time=now - 650, slowest_iteration_seconds=250.0)
    # Automatic: max(600, 3 x the slowest iteration of any rank) = 750 s.
    assert check(tmp_path, "--ranks", "2", "--since", since, capsys=capsys)[0] == 0
    assert check(tmp_path, "--ranks", "2", "--since", since, "--iteration-factor", "2", capsys=capsys)[0] == 1
    write_record(tmp_path, 1, progress_time=now - 650, slowest_iteration_seconds=1.0)
    assert check(tmp_path, "--ranks", "2", "--since", since, capsys=capsys)[0] == 1  # the 600 s floor
    assert check(tmp_path, "--ranks", "2", "--since", since, "--min-timeout", "700", capsys=capsys)[0] == 0
    # A given timeout wins over both.
    assert check(tmp_path, "--ranks", "2", "--since", since, "--timeout", "651", capsys=capsys)[0] == 0
    assert check(tmp_path, "--ranks", "2", "--since", since, "--timeout", "649", "--min-timeout", "5000",
                 capsys=capsys)[0] == 1


def test_stale_and_missing_files_count_as_never_reported(tmp_path, capsys):
    now = time.time()
    write_record(tmp_path, 0, progress_time=now - 3000, write_time=now - 3000, phase="step 99")  # an earlier step's
    write_record(tmp_path, 1, progress_time=now - 100, phase="start-up: loading checkpoint")
    (tmp_path / "rank-00002.json").write_text("{not json")
    code, out, _ = check(tmp_path, "--ranks", "4", "--since", str(now - 700), "--timeout", "60", capsys=capsys)
    assert code == 1
    assert out.splitlines() == ["rank 0 never reported (start-up) for 700 s",
                                "rank 2 never reported (start-up) for 700 s",
                                "rank 3 never reported (start-up) for 700 s",
                                "rank 1 (host node-a, pid 1001) stalled in phase 'start-up: loading checkpoint' for "
                                "100 s"]
    # Within the timeout of the step's start, ranks that have not reported yet are not a hang.
    assert check(tmp_path, "--ranks", "4", "--since", str(now - 30), "--timeout", "60", capsys=capsys)[0] == 0
    assert check(tmp_path / "not-made-yet", "--ranks", "2", "--since", str(now - 30), "--timeout", "60",
                 capsys=capsys)[0] == 0
    code, out, _ = check(tmp_path / "not-made-yet", "--ranks", "1", "--since", str(now - 90), "--timeout", "60",
                         capsys=capsys)
    assert (code, out) == (1, "rank 0 never reported (start-up) for 90 s\n")


def test_status_lists_every_rank(tmp_path, capsys):
    now = time.time()
    write_record(tmp_path, 0, progress_time=now - 42, slowest_iteration_seconds=1.25, phase="validation")
    assert heartbeat.main(["status", str(tmp_path), "--ranks", "2"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "rank 0 (host node-a, pid 1000): phase 'validation', last progress 42 s ago, slowest iteration 1.2 s",
        "rank 1: never reported"]


@pytest.mark.parametrize("args, message", [
    (["--ranks", "0", "--since", "1"], "error: --ranks must be positive, got 0"),
    (["--ranks", "2", "--since", "-5"], "error: --since -5 is not a past time in epoch seconds"),
    (["--ranks", "2", "--since", str(time.time() + 3600)], "is not a past time in epoch seconds"),
    (["--ranks", "2", "--since", "1", "--timeout", "-1"], "error: --timeout must be >= 0 (0: automatic), got -1"),
    (["--ranks", "2", "--since", "1", "--min-timeout", "0"], "error: --min-timeout must be positive, got 0"),
    (["--ranks", "2", "--since", "1", "--iteration-factor", "nan"], "error: --iteration-factor must be positive"),
    (["--ranks", "2"], "error: the following arguments are required: --since"),
    (["--ranks", "two", "--since", "1"], "error: argument --ranks: invalid int value: 'two'"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, args, message):
    try:
        code = heartbeat.main(["check", str(tmp_path), *args])
    except SystemExit as exiting:  # argparse's own refusals
        code = exiting.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err, err


def test_a_file_as_the_folder_is_bad_input(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert check(tmp_path / "f", "--ranks", "1", "--since", "1", capsys=capsys) == \
        (2, "", f"error: {tmp_path / 'f'} is not a folder\n")
