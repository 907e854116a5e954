"""bf16 under ZeRO-1/2 without DeepSpeed's per-step gradient scan (training/nonfinite.py).

DeepSpeed's check for a NaN/inf gradient before each step scans every gradient tensor (13 kernel
launches each, two waits for the device): off for bf16 at ZeRO-1/2. A real run (tiny preset, bf16,
DeepSpeed ZeRO-1 on the CPU accelerator) whose loss turns NaN at one iteration stops at the next
log line or checkpoint, naming that iteration, with no checkpoint saved from the damaged weights;
a user's DeepSpeed file can turn DeepSpeed's check back on (the step is then skipped and counted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from pmlm_testing import run_tool
from megatron_pmlm.training.nonfinite import GradientNormWatch, NonFiniteGradients
from megatron_pmlm.training.training_config import TrainingConfig, build_deepspeed_config


def watch_after(norms) -> GradientNormWatch:
    watch = GradientNormWatch(torch.device("cpu"))
    for iteration, norm in enumerate(norms, start=1):
        watch.record(norm, iteration)
    return watch


def test_finite_norms_pass_and_the_first_bad_iteration_is_named():
    watch_after([torch.tensor(1.5), 2.0, None, torch.tensor(0.0)]).check(4, "the log line")
    for norms in ([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(float("inf")), torch.tensor(float("nan"))],
                  [1.0, 2.0, float("inf"), torch.tensor(float("nan"))]):
        with pytest.raises(NonFiniteGradients, match=r"at iteration 3 \(2 iteration\(s\) in all up to 4\).*"
                                                     r"the log line stops the run"):
            watch_after(norms).check(4, "the log line")


def deepspeed_bf16(zero_stage: int, precision: str = "bf16", base: dict | None = None) -> dict:
    config = TrainingConfig(micro_batch_size=2, global_batch_size=2, zero_stage=zero_stage, precision=precision)
    return build_deepspeed_config(config, 1, base)


def test_deepspeed_s_scan_is_off_for_bf16_at_zero_1_and_2_only_and_a_user_file_wins():
    for stage in (1, 2):
        assert deepspeed_bf16(stage)["bf16"]["check_grad_overflow"] is False
    for stage in (0, 3):
        assert "check_grad_overflow" not in deepspeed_bf16(stage)["bf16"]
    assert "check_grad_overflow" not in deepspeed_bf16(1, "fp16")["bf16"]
    assert deepspeed_bf16(1, base={"bf16": {"check_grad_overflow": True}})["bf16"]["check_grad_overflow"] is True


RUN_WITH_A_NAN_LOSS = textwrap.dedent("""
    import sys
    from megatron_pmlm import pretrain
    from megatron_pmlm.models import model

    forward, calls, nan_at = model.PMLMForPreTraining.forward, [0], int(sys.argv[1])

    def nan_once(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training:
            calls[0] += 1
            if calls[0] == nan_at:
                out.loss = out.loss * float("nan")
        return out

    model.PMLMForPreTraining.forward = nan_once
    sys.exit(pretrain.main(sys.argv[2:]))
""")


def run_with_a_nan_loss(samples, tmp_path, nan_at: int, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", RUN_WITH_A_NAN_LOSS, str(nan_at), "--data-path", str(samples), "--preset",
               "tiny", "--bf16", "--zero-stage", "1", "--micro-batch-size", "4", "--global-batch-size", "4",
               "--train-iters", "6", "--lr-warmup-iters", "1", "--eval-iters", "0",
               "--history-json", str(tmp_path / "history.json"), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})


def saved_iterations(save) -> list[str]:
    return sorted(path.name for path in save.glob("iter_*"))


def test_a_nan_gradient_stops_the_run_before_any_checkpoint_of_damaged_weights(pretraining_samples, tmp_path):
    save = tmp_path / "save"
    result = run_with_a_nan_loss(pretraining_samples, tmp_path, 3, "--save", str(save), "--save-interval", "1",
                                 "--log-interval", "100")
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "at iteration 3 (1 iteration(s) in all up to 3)" in errors[0], result.stderr[-3000:]
    assert "saving a checkpoint stops the run" in errors[0] and "check_grad_overflow" in errors[0]
    assert "Traceback" not in result.stderr
    assert saved_iterations(save) == ["iter_0000001", "iter_0000002"]
    assert "at ZeRO-0" not in result.stdout  # the ZeRO-0 note is for ZeRO-0 runs only
    assert (save / "latest").read_text().strip() == "iter_0000002"


def test_without_a_save_the_next_log_line_stops_it(pretraining_samples, tmp_path):
    result = run_with_a_nan_loss(pretraining_samples, tmp_path, 3, "--log-interval", "2")
    assert result.returncode == 1, result.stderr[-3000:]
    # Iteration 2's log line passed; iteration 4's names 3 (and 4: its weights were NaN already).
    assert "at iteration 3 (2 iteration(s) in all up to 4)" in result.stderr and "the log line stops" in result.stderr
    assert [record["iteration"] for record in json.loads((tmp_path / "history.json").read_text())] == [2]


def test_deepspeed_s_own_check_when_a_user_asks_for_it_skips_the_step(pretraining_samples, tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"bf16": {"check_grad_overflow": True}}))
    result = run_with_a_nan_loss(pretraining_samples, tmp_path, 3, "--log-interval", "6", "--deepspeed-config",
                                 str(config))
    assert result.returncode == 0, result.stderr[-3000:]
    record = json.loads((tmp_path / "history.json").read_text())[-1]
    assert record["iteration"] == 6 and record["skipped_iterations"] == 1, record


def test_nothing_waits_for_the_device_in_a_bf16_zero_1_step_deepspeed_included(pretraining_samples):
    """DeepSpeed's scan read its verdict back (`.item()`) and so did its norm check, twice a step:
    with the scan off and the norm watched on the device, nothing between two log lines of a real
    bf16 ZeRO-1 run waits for the device (tools/count_host_syncs.py), DeepSpeed's code included."""
    result = run_tool("count_host_syncs.py", "--data-path", str(pretraining_samples), "--zero-stage", "1",
                      "--precision", "bf16", "--json", "-")
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = json.loads(result.stdout)["runs"]
    assert run["micro_batches"] == 4 and run["events"] == [], run["report"]
