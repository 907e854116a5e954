"""The global gradient norm at ZeRO-1/2 measured on the flat partitions AdamW steps
(training/gradient_norm.py) instead of DeepSpeed's per-tensor loop: when it is used, and that it is
DeepSpeed's number (real DeepSpeed on its CPU accelerator, two data-parallel processes)."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_pmlm.config import ConfigError
from megatron_pmlm.training.gradient_norm import PartitionGradientNorm
from megatron_pmlm.training.training_config import (TrainingConfig, build_deepspeed_config,
                                                    partition_norm_measured_here)
from pmlm_testing import run_module


def deepspeed_config(zero_stage=1, precision="bf16", clip_grad=0.0, base=None, model_parallel=False) -> dict:
    config = TrainingConfig(micro_batch_size=2, global_batch_size=2, zero_stage=zero_stage, precision=precision,
                            clip_grad=clip_grad)
    return build_deepspeed_config(config, 1, base, model_parallel=model_parallel)


def test_deepspeed_s_norm_is_off_only_where_nothing_of_deepspeed_s_reads_it():
    def ours(**kwargs) -> bool:
        ds_config = deepspeed_config(**kwargs)
        config = TrainingConfig(zero_stage=kwargs.get("zero_stage", 1), precision=kwargs.get("precision", "bf16"),
                                clip_grad=kwargs.get("clip_grad", 0.0))
        return partition_norm_measured_here(config, ds_config)

    assert ours(zero_stage=1) and ours(zero_stage=2)
    assert not ours(zero_stage=0) and not ours(zero_stage=3)
    # fp16 and fp32: DeepSpeed skips a step whose norm is not finite (bf16: the Trainer's watch stops the run).
    assert not ours(precision="fp16") and not ours(precision="fp32")
    assert not ours(clip_grad=1.0)  # DeepSpeed clips with its norm
    assert not ours(model_parallel=True)  # replicated and split parameters share a flat partition
    # DeepSpeed's scan turned back on: its skipped steps are reported through its own norm.
    assert not ours(base={"bf16": {"check_grad_overflow": True}})
    assert not ours(base={"zero_optimization": {"compute_grad_norm": True}})  # a user's file wins
    # bf16 ZeRO-1 accumulating in float32: DeepSpeed's BF16_Optimizer, which refuses the setting.
    assert not ours(base={"data_types": {"grad_accum_dtype": "fp32"}})
    assert ours(zero_stage=2, base={"data_types": {"grad_accum_dtype": "fp32"}})


def test_a_user_file_that_turns_the_norm_off_where_it_is_needed_is_refused():
    off = {"zero_optimization": {"compute_grad_norm": False}}
    with pytest.raises(ConfigError, match=r"compute_grad_norm.*--clip-grad 1.0"):
        deepspeed_config(clip_grad=1.0, base=off)
    with pytest.raises(ConfigError, match="tensor or pipeline parallelism"):
        deepspeed_config(base=off, model_parallel=True)


def test_the_norm_covers_every_group_whatever_order_they_are_stepped_in():
    """DeepSpeed steps one group per call (param_groups swapped for a one-group list): the norm is
    made once every group was seen, over all of them."""
    weights = [torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(3))]
    optimizer = torch.optim.AdamW([{"params": [weights[0]]}, {"params": [weights[1]]}], lr=0.0)
    weights[0].grad, weights[1].grad = torch.tensor([3.0, 0, 0, 0]), torch.tensor([0, 4.0, 0])
    norm = PartitionGradientNorm(optimizer)
    groups = optimizer.param_groups
    for order in ([1, 0], [0, 1]):
        norm.norm = None
        for index in order:
            optimizer.param_groups = [groups[index]]
            optimizer.step()
            assert (norm.norm is None) == (index == order[0])
        optimizer.param_groups = groups
        assert norm.norm.item() == pytest.approx(5.0)
    weights[1].grad[0] = float("nan")
    optimizer.step()
    assert norm.norm.item() == float("inf")  # as DeepSpeed reports a non-finite gradient
    # A checkpoint load replaces the group dicts (torch's load_state_dict): still every group.
    weights[1].grad[0] = 0.0
    optimizer.load_state_dict(optimizer.state_dict())
    for group in list(optimizer.param_groups):
        optimizer.param_groups = [group]
        optimizer.step()
    assert norm.norm.item() == pytest.approx(5.0)


def test_ours_is_deepspeed_s_norm_at_zero_2_over_two_data_parallel_ranks(pretraining_samples, tmp_path):
    """bf16, ZeRO-2, two processes each holding half of every flat partition, two accumulation
    steps: the same losses and the same logged norm (float32 sums in another order) as DeepSpeed's
    own per-tensor norm, turned back on by a user's file."""
    def run(name: str, *extra: str) -> list[dict]:
        history = tmp_path / f"{name}.json"
        result = run_module("megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), "--preset", "tiny",
                            "--bf16", "--zero-stage", "2", "--micro-batch-size", "4", "--global-batch-size", "16",
                            "--train-iters", "4", "--lr", "2e-3", "--lr-warmup-iters", "2", "--log-interval", "1",
                            "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0",
                            "--history-json", str(history), *extra, nproc=2)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        return [record for record in json.loads(history.read_text()) if "loss" in record]

    deepspeed_file = tmp_path / "ds.json"
    deepspeed_file.write_text(json.dumps({"zero_optimization": {"compute_grad_norm": True}}))
    ours, deepspeed_s = run("ours"), run("deepspeed", "--deepspeed-config", str(deepspeed_file))
    assert [record["iteration"] for record in ours] == [1, 2, 3, 4]
    assert [record["loss"] for record in ours] == [record["loss"] for record in deepspeed_s]
    for mine, theirs in zip(ours, deepspeed_s):
        assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-5), (ours, deepspeed_s)
    assert all(record["grad_norm"] > 0 for record in ours)
