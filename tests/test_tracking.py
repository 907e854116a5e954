"""W&B and MLflow beside TensorBoard (training/tracking.py), with the real packages and no network:
W&B offline (its run files read back), MLflow on a local sqlite store (read back through
MlflowClient); a run killed and resumed continues the same runs without duplicate iterations; a
failing backend is switched off while training goes on; a missing package is refused up front;
every checkpoint records the run identity (training/run_identity.py)."""

from __future__ import annotations

import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pmlm_testing import run_module, run_tool

pytest.importorskip("wandb", reason="the tracking extra: pip install -e '.[tracking]'")
pytest.importorskip("mlflow", reason="the tracking extra: pip install -e '.[tracking]'")

THROUGHPUT = {"samples_per_sec", "tokens_per_sec", "tflops_per_gpu"}
"""Logged scalars that are timings: not replayed exactly by a resumed run."""


def pretrain_command(samples: Path, tmp_path: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "megatron_pmlm.pretrain", "--preset", "tiny", "--data-path", str(samples),
            "--micro-batch-size", "4", "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "1",
            "--save", str(tmp_path / "ckpt"), "--history-json", str(tmp_path / "history.json"), *args]


def tracking_env(tmp_path: Path) -> dict[str, str]:
    """No W&B account, key or network: offline runs only; W&B's own settings folder in tmp_path."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "HOME": str(tmp_path / "home"),
           "WANDB_CONFIG_DIR": str(tmp_path / "home"), "WANDB_CACHE_DIR": str(tmp_path / "home")}
    env.pop("WANDB_API_KEY", None)
    return env


def history_by_iteration(path: Path) -> dict[int, dict[str, float]]:
    """history.json as {iteration: {"train/KEY" or "valid/KEY": value}}, the scalars tracking gets."""
    rows: dict[int, dict[str, float]] = {}
    for record in json.loads(path.read_text()):
        row = rows.setdefault(record["iteration"], {})
        for key, value in record.items():
            if key.startswith("valid_"):
                row[f"valid/{key[len('valid_'):]}"] = value
            elif key not in ("iteration", "consumed_samples") and math.isfinite(value):
                row[f"train/{key}"] = value
    return rows


def wandb_records(run_file: Path):
    """The records of a W&B run file (`run-ID.wandb`), parsed with W&B's own protobuf schema. The
    file is a LevelDB-style log after a 7-byte ':W&B' header: 32 KiB blocks of chunks, each
    (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last). A killed run's file may end
    in a torn chunk: it is left out."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", run_file
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        if len(chunk) < length:
            break
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4) and pending:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def wandb_history(run_dir: Path) -> tuple[str, dict[int, dict[str, float]], tuple[str, float] | None]:
    """(run id, {iteration: scalars}, branch point (run, step) or None) of an offline run folder."""
    run_file = next(run_dir.glob("run-*.wandb"), None)
    if run_file is None:
        return None, {}, None
    run_id, rows, branch = None, {}, None
    for record in wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run_id = record.run.run_id
            if record.run.HasField("branch_point"):
                branch = (record.run.branch_point.run, record.run.branch_point.value)
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            rows[int(items["iteration"])] = {k: v for k, v in items.items() if "/" in k}
    return run_id, rows, branch


def assert_same_scalars(logged: dict[int, dict[str, float]], expected: dict[int, dict[str, float]],
                        where: str) -> None:
    assert sorted(logged) == sorted(expected), (where, sorted(logged), sorted(expected))
    for iteration, row in expected.items():
        assert set(logged[iteration]) == set(row), (where, iteration, set(logged[iteration]) ^ set(row))
        for key, value in row.items():
            assert logged[iteration][key] == pytest.approx(value, rel=1e-6), (where, iteration, key)


def mlflow_scalars(uri: str, run_id: str) -> dict[int, dict[str, float]]:
    """Every metric point of the run; a duplicate (key, step) fails."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    rows: dict[int, dict[str, float]] = {}
    for key in client.get_run(run_id).data.metrics:
        for point in client.get_metric_history(run_id, key):
            assert key not in rows.get(point.step, {}), f"duplicate point {key} at iteration {point.step}"
            rows.setdefault(point.step, {})[key] = point.value
    return rows


def test_wandb_and_mlflow_get_the_history_and_a_killed_run_continues_the_same_runs(tmp_path, pretraining_samples):
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    tracking = ["--wandb-project", "pmlm-test", "--wandb-mode", "offline", "--wandb-dir", str(tmp_path),
                "--wandb-run-name", "tiny", "--mlflow-tracking-uri", uri, "--mlflow-experiment", "tests"]
    common = pretrain_command(pretraining_samples, tmp_path, "--save-interval", "20", "--eval-interval", "10",
                              "--lr-warmup-iters", "2", "--lr-decay-iters", "400", *tracking)  # one schedule for both
    # First attempt: killed with SIGKILL once W&B's file holds points past the checkpoint. (W&B writes
    # its offline file in 32 KiB blocks: a kill loses the last few points logged, which lie past
    # the checkpoint when a run logs more often than it saves, and are re-logged by the resume.)
    first = subprocess.Popen([*common, "--train-iters", "400"], env=tracking_env(tmp_path),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    history, latest = tmp_path / "history.json", tmp_path / "ckpt" / "latest"
    deadline = time.time() + 300
    try:
        while time.time() < deadline and first.poll() is None:
            run_dirs = list((tmp_path / "wandb").glob("offline-run-*"))
            if latest.is_file() and run_dirs:
                written = wandb_history(run_dirs[0])[1]
                if written and max(written) > int(latest.read_text().split("_")[1]):
                    break
            time.sleep(0.05)
    finally:
        first.kill()
        output = first.communicate()[0]
    assert first.returncode == -signal.SIGKILL, output[-3000:]
    first_attempt = history_by_iteration(history)
    checkpoint = int(latest.read_text().split("_")[1])
    assert 20 <= checkpoint < max(first_attempt), (checkpoint, sorted(first_attempt))
    stored = json.loads((tmp_path / "ckpt" / "tracking_runs.json").read_text())
    assert set(stored) == {"wandb", "mlflow"}
    first_mlflow = mlflow_scalars(uri, stored["mlflow"])  # the history file is written first: never behind
    assert set(first_mlflow) <= set(first_attempt) and max(first_mlflow) > checkpoint
    assert_same_scalars(first_mlflow, {i: first_attempt[i] for i in first_mlflow}, "mlflow, first attempt")

    # Second attempt: resumed from the checkpoint, to the end.
    end = max(first_attempt) + 3
    result = subprocess.run([*common, "--train-iters", str(end), "--load", str(tmp_path / "ckpt")],
                            env=tracking_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"resumed from {tmp_path / 'ckpt'}/iter_{checkpoint:07d}" in result.stdout
    assert "tracking backend" not in result.stdout, result.stdout[-3000:]  # nothing switched off
    final = history_by_iteration(history)
    assert sorted(final) == list(range(1, end + 1))
    assert json.loads((tmp_path / "ckpt" / "tracking_runs.json").read_text()) == stored

    # W&B: two offline files of one run, the second rewinding it to the checkpoint; together
    # (the first up to the checkpoint, then the second) exactly the final history.
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"), key=lambda p: p.stat().st_mtime)
    assert len(runs) == 2, runs
    (first_id, first_rows, first_branch), (second_id, second_rows, branch) = map(wandb_history, runs)
    assert first_id == second_id == stored["wandb"] and first_branch is None
    assert branch == (stored["wandb"], checkpoint)
    assert sorted(first_rows) == sorted(first_attempt)[:len(first_rows)] and max(first_rows) > checkpoint
    assert_same_scalars(first_rows, {i: first_attempt[i] for i in first_rows}, "wandb, first attempt")
    rewound = {i: row for i, row in first_rows.items() if i <= checkpoint} | second_rows
    assert_same_scalars(rewound, final, "wandb")

    # MLflow: one run, no duplicate point; the first attempt's points up to its last logged
    # iteration (MLflow cannot delete points: re-run iterations are not logged again), the
    # second attempt's beyond.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("tests")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == stored["mlflow"] and run.info.status == "FINISHED"
    assert run.data.tags["pmlm.resumed_at"] == str(checkpoint)
    assert run.data.params["libraries.torch"].startswith("2.") and run.data.params["config.training.train_iters"]
    expected = {i: first_mlflow.get(i, row) for i, row in final.items()}
    assert_same_scalars(mlflow_scalars(uri, stored["mlflow"]), expected, "mlflow")
    # An exact resume replays the losses: what MLflow kept of the first attempt is the final history.
    for iteration in range(checkpoint + 1, max(first_mlflow) + 1):
        for key, value in final[iteration].items():
            if key.split("/")[1] not in THROUGHPUT:
                assert expected[iteration][key] == pytest.approx(value, rel=1e-5), (iteration, key)

    # The run identity in every checkpoint's run state, and --show prints it.
    state = json.loads((tmp_path / "ckpt" / f"iter_{end:07d}" / "run_state.json").read_text())
    assert state["tracking"] == stored
    identity = state["run_identity"]
    assert set(identity) == {"code", "config", "data", "libraries", "hardware"}
    assert "git_commit" in identity["code"] or "package_version" in identity["code"]
    assert identity["config"]["deepspeed"]["train_batch_size"] == 4 and identity["config"]["args"]["train_iters"] == end
    assert identity["data"]["digest"] and identity["libraries"]["deepspeed"] and identity["hardware"]["world_size"] == 1
    assert "run identity: code " in result.stdout and "run identity: config {" in result.stdout
    show = run_tool("verify_checkpoint.py", str(tmp_path / "ckpt" / f"iter_{end:07d}"), "--show")
    assert show.returncode == 0, show.stderr
    assert f"data samples digest {identity['data']['digest']}" in show.stdout
    assert f"deepspeed {identity['libraries']['deepspeed']}" in show.stdout


def test_a_failing_backend_is_switched_off_and_training_goes_on(tmp_path, pretraining_samples):
    """W&B fails at its start (online, no API key), MLflow in the middle (its run deleted from the
    store while training): each named once, TensorBoard and the history keep every iteration."""
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    command = pretrain_command(pretraining_samples, tmp_path, "--train-iters", "30", "--eval-interval", "1000",
                               "--tensorboard-dir", str(tmp_path / "tb"), "--wandb-project", "pmlm-test",
                               "--wandb-mode", "online", "--wandb-dir", str(tmp_path), "--mlflow-tracking-uri", uri)
    run = subprocess.Popen(command, env=tracking_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True)
    runs_file = tmp_path / "ckpt" / "tracking_runs.json"
    try:
        deadline = time.time() + 240
        while not runs_file.is_file() and run.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        from mlflow.tracking import MlflowClient

        MlflowClient(tracking_uri=uri).delete_run(json.loads(runs_file.read_text())["mlflow"])
        output = run.communicate(timeout=240)[0]
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 0, output[-3000:]
    failures = [line for line in output.splitlines() if "tracking backend" in line]
    assert len(failures) == 2, failures
    assert failures[0].startswith("warning: tracking backend wandb could not start (UsageError: ")
    assert failures[1].startswith("warning: tracking backend mlflow failed (MlflowException: ")
    assert all(line.endswith("it is switched off for the rest of the run, training goes on") for line in failures)
    assert sorted(history_by_iteration(tmp_path / "history.json")) == list(range(1, 31))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(next((tmp_path / "tb").glob("events.out.tfevents.*"))))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 31))


BLOCKED = "import runpy, sys; sys.modules[{module!r}] = None; sys.argv[0] = {command!r}; " \
          "runpy.run_module({command!r}, run_name='__main__', alter_sys=True)"
"""Python with a package made unimportable (sys.modules[name] = None is how the import system
says "not installed"), then a command."""


@pytest.mark.parametrize("command, flags, module", [
    ("megatron_pmlm.pretrain", ["--wandb-project", "p"], "wandb"),
    ("megatron_pmlm.pretrain", ["--mlflow-tracking-uri", "sqlite:///x.db"], "mlflow"),
    ("megatron_pmlm.finetune_s2s", ["--wandb-project", "p"], "wandb"),
    ("megatron_pmlm.finetune_glue", ["--mlflow-tracking-uri", "sqlite:///x.db"], "mlflow"),
])
def test_a_backend_without_its_package_is_refused_in_one_line(command, flags, module, tmp_path, pretraining_samples):
    required = {"megatron_pmlm.pretrain": ["--data-path", str(pretraining_samples), "--save", str(tmp_path / "ckpt")],
                "megatron_pmlm.finetune_s2s": ["--model", str(tmp_path), "--train-file", str(tmp_path / "t.jsonl"),
                                               "--save", str(tmp_path / "ckpt")],
                "megatron_pmlm.finetune_glue": ["--model", str(tmp_path), "--task", "sst2", "--data-dir", str(tmp_path), "--output-dir",
                                                str(tmp_path / "out")]}[command]
    result = subprocess.run([sys.executable, "-c", BLOCKED.format(module=module, command=command), *required, *flags],
                            capture_output=True, text=True, cwd=tmp_path, timeout=120,
                            env={**os.environ, "DS_ACCELERATOR": "cpu"})
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == f"error: {flags[0]} needs the {module} package, which is not installed: " \
                        "pip install -e '.[tracking]'", result.stderr[-2000:]
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / "out").exists()  # nothing written


def test_options_of_one_backend_need_its_main_flag(pretraining_samples, tmp_path):
    result = run_module("megatron_pmlm.pretrain", "--preset", "tiny", "--data-path", str(pretraining_samples),
                        "--wandb-run-name", "x", timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines()[-1] == \
        "error: --wandb-run-name needs --wandb-project", result.stderr[-2000:]


def test_hugging_face_fine_tuning_reports_through_the_trainers_own_integrations(tiny_hf_model, shared_data, tmp_path):
    """finetune_glue: our flags become the HF Trainer's report_to (beside --report-to) and the
    environment its W&B and MLflow integrations read; both get the losses trainer_state.json logs."""
    glue = shared_data / "glue"
    if not (glue / "MRPC" / "train.tsv").is_file():
        pytest.skip(f"{glue}/MRPC is absent")
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    result = run_module("megatron_pmlm.finetune_glue", "--model", str(tiny_hf_model), "--task", "mrpc", "--data-dir",
                        str(glue), "--output-dir", str(tmp_path / "out"), "--max-steps", "10", "--max-train-samples",
                        "160", "--max-eval-samples", "32", "--per-device-train-batch-size", "16", "--logging-steps", "5",
                        "--disable-tqdm", "--report-to", "tensorboard", "--mlflow-tracking-uri", uri,
                        "--mlflow-experiment", "glue", "--wandb-project", "glue-test", "--wandb-mode", "offline",
                        "--wandb-dir", str(tmp_path), timeout=300,
                        env={k: v for k, v in tracking_env(tmp_path).items() if k.startswith(("HOME", "WANDB_"))})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    state = json.loads((tmp_path / "out" / "trainer_state.json").read_text())
    losses = [(record["step"], record["loss"]) for record in state["log_history"] if "loss" in record]
    assert [step for step, _ in losses] == [5, 10]

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("glue").experiment_id])
    (trained,) = [run for run in runs if "loss" in run.data.metrics]
    history = client.get_metric_history(trained.info.run_id, "loss")
    assert [m.step for m in history] == [5, 10]
    assert [m.value for m in history] == pytest.approx([loss for _, loss in losses])
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    records = list(wandb_records(next(run_dir.glob("run-*.wandb"))))
    assert {r.run.project for r in records if r.WhichOneof("record_type") == "run"} == {"glue-test"}
    logged = [json.loads(item.value_json) for r in records if r.WhichOneof("record_type") == "history"
              for item in r.history.item if (item.key or "/".join(item.nested_key)) == "train/loss"]
    assert logged == pytest.approx([loss for _, loss in losses])
    assert any((tmp_path / "out").glob("runs/*/events.out.tfevents.*"))  # --report-to tensorboard kept


def test_runs_closed_after_an_error_are_marked_failed(tmp_path, monkeypatch):
    """Tracking.close(succeeded=False), what the Trainer's `finally` calls when training raised:
    MLflow's run FAILED, W&B's finished with exit code 1; both with the points logged before."""
    from mlflow.tracking import MlflowClient

    from megatron_pmlm.training.tracking import RUNS_FILE, Tracking, TrackingConfig

    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home"))
    uri = f"sqlite:///{tmp_path / 'runs.db'}"
    lines: list[str] = []
    tracking = Tracking(lines.append)
    config = TrackingConfig(wandb_project="p", wandb_mode="offline", wandb_dir=str(tmp_path), mlflow_tracking_uri=uri)
    ids = tracking.start_runs(config, {"config": {"lr": 0.1}}, {}, 0, tmp_path)
    assert json.loads((tmp_path / RUNS_FILE).read_text()) == ids and set(ids) == {"wandb", "mlflow"}
    tracking.log({"train/loss": 2.5, "train/grad_norm": float("nan")}, 1)
    tracking.close(succeeded=False)
    assert lines == [] and tracking.backends == []
    run = MlflowClient(tracking_uri=uri).get_run(ids["mlflow"])
    assert run.info.status == "FAILED" and run.data.metrics == {"train/loss": 2.5}  # NaN left out
    assert run.data.params["config.lr"] == "0.1"
    (run_dir,) = (tmp_path / "wandb").glob("offline-run-*")
    exits = [r.exit.exit_code for r in wandb_records(next(run_dir.glob("run-*.wandb")))
             if r.WhichOneof("record_type") == "exit"]
    assert exits == [1]
