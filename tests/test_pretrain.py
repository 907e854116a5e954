"""Pre-training end to end on DeepSpeed (one process, CPU): the losses fall on real text, metrics reach
TensorBoard under the documented tags, and bad arguments stop with a clear message."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess

import pytest

from pmlm_testing import REPO_ROOT, plotted_panels, run_module, run_tool
from megatron_pmlm.config import ConfigError
from megatron_pmlm.training.training_config import TrainingConfig, adamw_options, build_deepspeed_config, lr_lambda

TRAIN_TAGS = {"train/loss", "train/loss_ae", "train/loss_par", "train/mlm_acc", "train/par_acc", "train/lr",
              "train/grad_norm",
              "train/loss_scale", "train/samples_per_sec", "train/tokens_per_sec", "train/tflops_per_gpu",
              "train/consumed_tokens", "train/skipped_iterations"}
VALID_TAGS = {"valid/loss", "valid/loss_ae", "valid/loss_par", "valid/mlm_acc", "valid/par_acc"}


def test_tiny_model_losses_fall_on_real_text_and_reach_tensorboard(tmp_path, pretraining_samples):
    history = tmp_path / "history.json"
    result = run_module(
        "megatron_pmlm.pretrain", "--preset", "tiny", "--data-path", str(pretraining_samples),
        "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", "60", "--lr", "2e-3",
        "--lr-warmup-iters", "6", "--log-interval", "10", "--eval-interval", "30", "--eval-iters", "2",
        "--history-json", str(history), "--tensorboard-dir", str(tmp_path / "tb"), "--save", str(tmp_path / "ckpt"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [r for r in json.loads(history.read_text()) if "loss" in r]
    first, last = records[0], records[-1]
    assert last["iteration"] == 60
    # From ~log(30522) = 10.3 towards unigram entropy: both objectives learn.
    assert first["loss_ae"] > 8.5 and first["loss_par"] > 8.5
    assert last["loss_ae"] < first["loss_ae"] - 1.5, records
    assert last["loss_par"] < first["loss_par"] - 1.5, records
    assert "validation at iteration 60" in result.stdout
    assert "ETA" in result.stdout and "TFLOP/s/GPU" in result.stdout
    assert "Transformer Engine and Apex" not in result.stderr, result.stderr[-3000:]  # quiet start-up
    assert (tmp_path / "ckpt" / "latest").read_text() == "iter_0000060"

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(next((tmp_path / "tb").glob("events.out.tfevents.*"))))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    assert TRAIN_TAGS | VALID_TAGS <= tags, (TRAIN_TAGS | VALID_TAGS) - tags
    assert [e.step for e in accumulator.Scalars("train/loss_ae")] == [10, 20, 30, 40, 50, 60]
    assert [e.step for e in accumulator.Scalars("valid/mlm_acc")] == [30, 60]

    plot = run_tool("plot_curves.py", str(tmp_path / "tb"), "-o", str(tmp_path / "curves.png"))
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Every loss and accuracy the run logged, train and valid, a legend on each panel; the TensorBoard
    # folder and the history JSON of the same run side by side.
    panels = plotted_panels([tmp_path / "tb", history], tmp_path / "both.png", ["tb", "json"])
    assert list(panels) == ["loss", "loss_ae", "loss_par", "mlm_acc", "par_acc"], panels
    assert all(entries == ["tb train", "tb valid", "json train", "json valid"] for entries in panels.values()), panels


def _bad(pretraining_samples, *args):
    return run_module("megatron_pmlm.pretrain", "--data-path", str(pretraining_samples), *args, timeout=120)


@pytest.mark.parametrize("args,message", [
    (["--objective", "mlm"], "unknown objective 'mlm'"),
    (["--unilm-ngram-prob", "0.3"], "--unilm-ngram-prob sets UniLM v1's masking and NSP; it needs --objective unilm"),
    (["--objective", "unilm", "--unilm-min-ngram", "4"], "need 1 <= min_ngram <= max_ngram, got 4..3"),
    (["--preset", "huge"], "unknown preset 'huge'"),
    (["--preset", "tiny", "--max-position-embeddings", "32"],
     "the samples are 64 tokens long, more than the model's maximum sequence length 32"),
    (["--preset", "tiny", "--seq-length", "128"], "--seq-length 128 differs from the samples"),
    (["--preset", "tiny", "--micro-batch-size", "3", "--global-batch-size", "16"],
     "not divisible by micro batch size 3"),
    (["--preset", "tiny", "--micro-batch-size", "0"],
     "--micro-batch-size must be a positive number (samples per GPU in one forward-backward), got 0"),
    (["--preset", "tiny", "--global-batch-size", "-16"],
     "--global-batch-size must be a positive number (samples per optimizer step), got -16"),
    (["--preset", "tiny", "--tensor-model-parallel-size", "0"], "--tensor-model-parallel-size must be a positive"),
    (["--preset", "tiny", "--eval-iters", "-1"], "--eval-iters must be 0 or more, got -1"),
    (["--preset", "tiny", "--deepspeed-config", "nope.json"], "DeepSpeed config nope.json does not exist"),
    (["--preset", "tiny", "--data-path", "0.3", "a", "0.7", "b"], "blend corpora when building the samples"),
])
def test_bad_arguments_give_a_clear_error(pretraining_samples, args, message):
    result = _bad(pretraining_samples, *args)
    assert result.returncode == 2, result.stderr[-2000:]
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_missing_data_is_named(tmp_path):
    result = run_module("megatron_pmlm.pretrain", "--preset", "tiny", "--data-path", str(tmp_path / "nope"))
    assert result.returncode == 2 and "nope" in result.stderr and "Traceback" not in result.stderr


def test_learning_rate_schedule_is_linear_warmup_then_linear_decay():
    config = TrainingConfig(lr=6e-4, min_lr=0.0, lr_warmup_iters=24_000, train_iters=500_000)
    multiplier = lr_lambda(config)
    assert multiplier(0) == pytest.approx(1 / 24_000)
    assert multiplier(23_999) == pytest.approx(1.0)
    assert multiplier(24_000) == pytest.approx(1.0)
    assert multiplier(262_000) == pytest.approx(0.5)
    assert multiplier(500_000) == pytest.approx(0.0)
    paper = TrainingConfig()
    assert (paper.adam_beta1, paper.adam_beta2, paper.adam_eps, paper.weight_decay) == (0.9, 0.98, 1e-6, 0.01)
    assert (paper.global_batch_size, paper.train_iters, paper.clip_grad, paper.lr) == (7680, 500_000, 0.0, 6e-4)


def test_megatron_decay_styles_and_the_tiny_presets_schedule():
    cosine = lr_lambda(TrainingConfig(lr=1e-3, min_lr=1e-4, lr_warmup_iters=10, train_iters=1000,
                                      lr_decay_style="cosine", lr_decay_iters=510))
    assert cosine(260) == pytest.approx(0.1 + 0.9 * 0.5) and cosine(510) == pytest.approx(0.1)
    assert cosine(900) == pytest.approx(0.1)  # after --lr-decay-iters: the floor
    constant = lr_lambda(TrainingConfig(lr_warmup_iters=10, train_iters=100, lr_decay_style="constant"))
    assert constant(4) == pytest.approx(0.5) and constant(99) == 1.0
    with pytest.raises(ConfigError, match="lr_decay_style must be one of linear, cosine, constant"):
        TrainingConfig(lr_decay_style="exponential")
    from megatron_pmlm.pretrain import build_parser
    from megatron_pmlm.training.recipe import training_config_from_args

    def resolved(*args):
        return training_config_from_args(build_parser().parse_args(["--data-path", "x", *args]), 64)

    tiny, base = resolved("--preset", "tiny"), resolved()
    assert (tiny.lr, tiny.lr_warmup_iters) == (1e-3, 10) and (base.lr, base.lr_warmup_iters) == (6e-4, 24_000)
    assert resolved("--preset", "tiny", "--lr", "5e-4").lr == 5e-4
    assert resolved("--lr-decay-style", "cosine", "--lr-decay-iters", "7").lr_decay_iters == 7


def test_every_command_line_option_shows_its_default():
    """pretrain, preprocess, inspect: argparse shows defaults only for options with help text."""
    import argparse

    from data_prep.build_samples import build_parser as build_samples_parser
    from data_prep.preprocess import build_parser as preprocess_parser
    from megatron_pmlm.hf.convert import build_parser as convert_parser
    from megatron_pmlm.pretrain import build_parser as pretrain_parser

    for parser in (pretrain_parser(), preprocess_parser(), build_samples_parser(), convert_parser()):
        text = parser.format_help()
        assert "SPEC" not in text and "§" not in text
        for action in parser._actions:
            if action.option_strings and action.help is not argparse.SUPPRESS and not action.required \
                    and not isinstance(action, argparse._HelpAction):
                shown = parser._get_formatter()._get_help_string(action)
                assert "default" in shown, (parser.prog, action.option_strings, shown)


def test_deepspeed_config_files_and_overrides():
    for path in sorted((REPO_ROOT / "ds_configs").glob("*.json")):
        json.loads(path.read_text())  # every shipped file parses
    base = json.loads((REPO_ROOT / "ds_configs" / "pretrain_base_v100.json").read_text())
    assert base["fp16"]["enabled"] and base["fp16"]["loss_scale"] == 0 and base["zero_optimization"]["stage"] == 1
    assert base["train_micro_batch_size_per_gpu"] * base["gradient_accumulation_steps"] * 64 == base["train_batch_size"] == 7680
    config = TrainingConfig(micro_batch_size=20, global_batch_size=7680, zero_stage=2, precision="bf16")
    ds = build_deepspeed_config(config, 64, base)
    assert ds["gradient_accumulation_steps"] == 6 and ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"]["enabled"] and not ds["fp16"]["enabled"]
    assert ds["zero_optimization"]["overlap_comm"]  # the file's other settings survive
    assert ds["zero_optimization"]["contiguous_gradients"]  # the file's, and ZeRO-2 keeps DeepSpeed's default
    # ZeRO-1: no copy of each gradient into a bucket buffer and back (DeepSpeed's default), unless a file asks
    stage_one = TrainingConfig(micro_batch_size=20, global_batch_size=7680, zero_stage=1, precision="bf16")
    assert build_deepspeed_config(stage_one, 64)["zero_optimization"]["contiguous_gradients"] is False
    assert build_deepspeed_config(stage_one, 64, base)["zero_optimization"]["contiguous_gradients"] is True
    stage_two = TrainingConfig(micro_batch_size=20, global_batch_size=7680, zero_stage=2, precision="bf16")
    assert "contiguous_gradients" not in build_deepspeed_config(stage_two, 64)["zero_optimization"]
    # DeepSpeed's throughput timer (a device synchronize at each micro batch's forward and step) is off
    # at every stage unless a file turns it on; a file's other timer settings are kept.
    for training in (config, stage_one, stage_two):
        assert build_deepspeed_config(training, 64)["timers"] == {"throughput": {"enabled": False}}
    timed = {"timers": {"throughput": {"enabled": True, "synchronized": False}}}
    assert build_deepspeed_config(stage_one, 64, timed)["timers"] == timed["timers"]


def _precision_supported(precision: str) -> bool:
    """The question DeepSpeed itself asks (on CPU: does oneDNN have fp16 kernels for this processor)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    return accelerator.is_fp16_supported() if precision == "--fp16" else accelerator.is_bf16_supported()


@pytest.mark.parametrize("precision", ["--fp16", "--bf16"])
def test_mixed_precision_runs_and_reports_the_loss_scale(precision, pretraining_samples, tmp_path):
    if not _precision_supported(precision):
        pytest.skip(f"DeepSpeed's accelerator reports no {precision[2:]} support on this machine's CPU "
                    "(test_unsupported_precision_is_refused_clearly covers it)")
    history = tmp_path / "history.json"
    result = run_module("megatron_pmlm.pretrain", "--preset", "tiny", "--data-path", str(pretraining_samples),
                        "--micro-batch-size", "8", "--global-batch-size", "8", "--train-iters", "3",
                        "--log-interval", "1", "--eval-iters", "0", precision, "--history-json", str(history))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = json.loads(history.read_text())
    assert all(9.0 < r["loss_ae"] < 11.5 for r in records)
    if precision == "--fp16":
        assert "loss scale" in result.stdout and records[0]["loss_scale"] >= 1.0
    assert f"{precision[2:]}, micro batch 8" in result.stdout
    # Default ZeRO-0: DeepSpeed's per-parameter optimizer; the run says what is faster.
    assert f"note: {precision} at ZeRO-0 runs DeepSpeed's per-parameter (unfused) optimizer" in result.stdout


@pytest.mark.parametrize("precision", ["--fp16", "--bf16"])
def test_unsupported_precision_is_refused_clearly(precision, pretraining_samples):
    if _precision_supported(precision):
        pytest.skip(f"this machine supports {precision[2:]} (test_mixed_precision_runs_and_reports_the_loss_scale "
                    "covers it)")
    result = _bad(pretraining_samples, "--preset", "tiny", precision)
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"{precision}: DeepSpeed's cpu accelerator reports no {precision[2:]} support" in result.stderr
    assert "Traceback" not in result.stderr


def test_checkpoint_retention_keeps_the_newest_and_the_permanent_ones(pretraining_samples, tmp_path):
    result = run_module("megatron_pmlm.pretrain", "--preset", "tiny", "--data-path", str(pretraining_samples),
                        "--micro-batch-size", "4", "--global-batch-size", "4", "--train-iters", "20",
                        "--eval-iters", "0", "--log-interval", "10", "--save-interval", "4",
                        "--keep-last-checkpoints", "2", "--keep-checkpoint-every", "8", "--save", str(tmp_path / "c"))
    assert result.returncode == 0, result.stderr[-3000:]
    kept = sorted(p.name for p in (tmp_path / "c").glob("iter_*"))
    # newest two (16, 20) plus the multiples of 8 kept forever (8; 16 is both)
    assert kept == ["iter_0000008", "iter_0000016", "iter_0000020"]
    assert (tmp_path / "c" / "latest").read_text() == "iter_0000020"
    deleted = [line for line in result.stdout.splitlines() if line.startswith("deleted old checkpoint")]
    assert deleted == [f"deleted old checkpoint {tmp_path / 'c' / f'iter_{i:07d}'} (--keep-last-checkpoints 2, "
                       "--keep-checkpoint-every 8)" for i in (4, 12)], result.stdout


def test_a_truncated_newest_checkpoint_falls_back_to_the_newest_complete_one(pretraining_samples, tmp_path):
    """A save cut short (node lost mid-write): loading names what is wrong and uses the one before;
    tools/verify_checkpoint.py says the same without loading a model."""
    ckpt = tmp_path / "c"
    common = ["--preset", "tiny", "--data-path", str(pretraining_samples), "--micro-batch-size", "4",
              "--global-batch-size", "4", "--eval-iters", "0", "--log-interval", "1", "--save", str(ckpt),
              "--save-interval", "2"]
    result = run_module("megatron_pmlm.pretrain", *common, "--train-iters", "4")
    assert result.returncode == 0, result.stderr[-3000:]
    weights = ckpt / "iter_0000004" / "mp_rank_00_model_states.pt"
    size = weights.stat().st_size
    with open(weights, "r+b") as handle:
        handle.truncate(size // 2)
    verified = run_tool("verify_checkpoint.py", str(ckpt))
    assert verified.returncode == 1, verified.stdout + verified.stderr
    assert f"iter_0000004 (latest): UNUSABLE: mp_rank_00_model_states.pt is {size // 2:,} bytes" in verified.stdout
    assert f"resuming would use {ckpt / 'iter_0000002'}" in verified.stdout
    history = tmp_path / "history.json"
    result = run_module("megatron_pmlm.pretrain", *common, "--train-iters", "5", "--load", str(ckpt),
                        "--history-json", str(history))
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"warning: skipping {ckpt / 'iter_0000004'}: mp_rank_00_model_states.pt is" in result.stdout
    assert f"resumed from {ckpt / 'iter_0000002'}: iteration 2, consumed samples 8" in result.stdout
    assert [r["iteration"] for r in json.loads(history.read_text())] == [3, 4, 5]
    # The broken save was replaced by a complete one.
    verified = run_tool("verify_checkpoint.py", str(ckpt / "iter_0000004"), "--deep")
    assert verified.returncode == 0 and "complete" in verified.stdout, verified.stdout + verified.stderr
    # Nothing complete but `latest` says there was: refuse to start over rather than lose 20 days.
    for tag in ("iter_0000002", "iter_0000004", "iter_0000005"):
        (ckpt / tag / "run_state.json").unlink()
    result = run_module("megatron_pmlm.pretrain", *common, "--train-iters", "6", "--load", str(ckpt))
    assert result.returncode == 2 and "no checkpoint in" in result.stderr and "refusing to start from scratch" \
        in result.stderr, result.stderr[-2000:]


def test_fused_adamw_on_cuda_only_and_the_same_update():
    """The fused kernel is chosen on CUDA; its update equals the default implementation's (checked
    on CUDA where present, else only the choice)."""
    import torch

    assert adamw_options("cpu") == {} and adamw_options("cuda") == {"fused": True}
    if not torch.cuda.is_available():
        return
    weights = [torch.randn(64, 64, device="cuda", requires_grad=True) for _ in range(2)]
    copies = [w.detach().clone().requires_grad_() for w in weights]
    for params, options in ((weights, adamw_options("cuda")), (copies, {})):
        optimizer = torch.optim.AdamW(params, lr=1e-2, **options)
        for step in range(3):
            for p in params:
                p.grad = torch.full_like(p, 0.1 * (step + 1))
            optimizer.step()
    for fused, plain in zip(weights, copies):
        torch.testing.assert_close(fused, plain)


# ------------------------------------------------------------------------------------------------
# --load and --save checked before anything is built (issue 22)
# ------------------------------------------------------------------------------------------------

def _prepare_paths(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("not a directory\n")
    hf = tmp_path / "hf_folder"
    hf.mkdir()
    (hf / "config.json").write_text("{}\n")
    broken = tmp_path / "broken"
    (broken / "iter_0000004").mkdir(parents=True)
    (broken / "latest").write_text("iter_0000004")


@pytest.mark.parametrize("args,message", [
    # the start-from-BERT flow with a typo: would have trained from random weights and exited 0
    (["--load", "{t}/typo", "--finetune", "--save", "{t}/out"],
     "--load {t}/typo does not exist (--finetune needs a checkpoint to take the weights from)"),
    (["--load", "{t}/typo", "--save", "{t}/out"], "--load {t}/typo does not exist (to start from scratch leave --load"),
    (["--load", "{t}/empty", "--save", "{t}/out"], "--load {t}/empty holds no complete checkpoint (to start"),
    (["--load", "{t}/broken", "--save", "{t}/out"],
     "--load {t}/broken holds no complete checkpoint; newest: {t}/broken/iter_0000004: run_state.json is missing"),
    (["--load", "{t}/hf_folder", "--finetune", "--save", "{t}/out"],
     "--load {t}/hf_folder is a Hugging Face folder, not a checkpoint directory: convert it with"),
    (["--load", "{t}/a_file", "--save", "{t}/out"], "--load {t}/a_file is a file, not a checkpoint directory"),
    # the auto-resume idiom is for resuming; --finetune with nothing to load is always an error
    (["--load", "{t}/out", "--save", "{t}/out", "--finetune"], "--load {t}/out does not exist (--finetune needs"),
    (["--finetune", "--save", "{t}/out"], "--finetune needs --load"),
    (["--save", "{t}/a_file"], "--save {t}/a_file is a file, not a directory"),
    (["--save", "{t}/a_file/run"], "--save {t}/a_file/run cannot be created: {t}/a_file is a file, not a directory"),
    (["--save", "/proc/pmlm-run"], "--save /proc/pmlm-run cannot be written: nothing can be created in /proc"),
    (["--save", "{t}/out", "--tensorboard-dir", "{t}/a_file/tb"], "--tensorboard-dir {t}/a_file/tb cannot be created"),
    (["--save", "{t}/out", "--history-json", "{t}/empty"], "--history-json {t}/empty is a directory, not a file"),
    (["--model", "palm", "--load", "{t}/typo", "--save", "{t}/out"], "--load {t}/typo does not exist"),
], ids=["load-typo-finetune", "load-typo", "load-empty", "load-incomplete", "load-hf-folder", "load-file",
        "finetune-auto-resume-empty", "finetune-without-load", "save-is-file", "save-under-file", "save-in-proc",
        "tensorboard-under-file", "history-is-dir", "palm-load-typo"])
def test_load_and_save_are_refused_before_anything_is_built(args, message, pretraining_samples, tmp_path):
    _prepare_paths(tmp_path)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    args = [a.replace("{t}", str(tmp_path)) for a in args]
    result = run_module("megatron_pmlm.pretrain", "--preset", "tiny", "--data-path", str(pretraining_samples),
                        "--tensorboard-dir", str(tmp_path / "tb"), *args, timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert result.stderr.strip().splitlines() == [result.stderr.strip()], result.stderr  # one line
    assert result.stderr.startswith("error: " + message.replace("{t}", str(tmp_path))), result.stderr
    assert result.stdout == ""  # no model, no process group: nothing said, nothing written
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


@contextlib.contextmanager
def _tmpfs(path, options: str):
    """A small tmpfs at `path` (root with CAP_SYS_ADMIN; the case is skipped elsewhere)."""
    path.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.parametrize("case", ["read-only", "full"])
def test_save_on_a_read_only_or_full_file_system_is_refused(case, pretraining_samples, tmp_path):
    place = tmp_path / case
    with contextlib.ExitStack() as stack:
        if case == "read-only" and os.geteuid() != 0:
            place.mkdir(mode=0o555)  # permission bits stop a user (not root: a read-only mount then)
            expected = f"{place} is not writable"
        elif case == "read-only":
            stack.enter_context(_tmpfs(place, "ro,size=64k"))
            expected = f"{place} is on a read-only file system"
        else:
            stack.enter_context(_tmpfs(place, "size=64k"))
            with open(place / "filler", "wb", buffering=0) as filler:  # full: statvfs reports 0 bytes free
                with contextlib.suppress(OSError):
                    while True:
                        filler.write(b"\0" * 4096)
            expected = f"the file system of {place} is full (0 bytes free)"
        result = run_module("megatron_pmlm.pretrain", "--preset", "tiny", "--data-path", str(pretraining_samples),
                            "--save", str(place / "run"), timeout=120)
        assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
        assert result.stderr.strip() == f"error: --save {place / 'run'} cannot be written: {expected}"
        assert not (place / "run").exists()


# ------------------------------------------------------------------------------------------------
# Resuming with other settings (issue 22)
# ------------------------------------------------------------------------------------------------

def test_resume_refuses_another_objective_and_lists_changed_settings(pretraining_samples, tmp_path):
    ckpt = tmp_path / "c"
    common = ["--preset", "tiny", "--data-path", str(pretraining_samples), "--micro-batch-size", "4",
              "--global-batch-size", "4", "--log-interval", "1", "--eval-iters", "0"]
    result = run_module("megatron_pmlm.pretrain", *common, "--objective", "ae", "--train-iters", "2", "--save",
                        str(ckpt))
    assert result.returncode == 0, result.stderr[-3000:]
    # The objective is what the checkpoint was trained for: refused, naming it.
    result = run_module("megatron_pmlm.pretrain", *common, "--objective", "ae+par", "--train-iters", "4", "--save",
                        str(ckpt), "--load", str(ckpt))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"error: {ckpt / 'iter_0000002'} was trained for something else: --objective ae -> ae+par; resume it " \
           "with the saved settings, or add --finetune to take its weights only" in result.stderr
    assert "Traceback" not in result.stderr and not (ckpt / "iter_0000004").exists()
    # Learning rate, schedule length, dropout: legitimate, listed in one line.
    result = run_module("megatron_pmlm.pretrain", *common, "--objective", "ae", "--train-iters", "3", "--lr", "5e-4",
                        "--hidden-dropout", "0", "--save", str(ckpt), "--load", str(ckpt))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "resuming with changed settings: train_iters 2 -> 3, lr 0.001 -> 0.0005, hidden_dropout 0.1 -> 0.0\n" \
        in result.stdout
    assert f"resumed from {ckpt / 'iter_0000002'}: iteration 2" in result.stdout
    # --finetune takes the weights for another objective (what it is for), but not for another shape.
    result = run_module("megatron_pmlm.pretrain", *common, "--objective", "ae+par", "--train-iters", "1", "--load",
                        str(ckpt), "--finetune", "--save", str(tmp_path / "f"))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert f"loaded the weights of {ckpt / 'iter_0000003'}" in result.stdout
    assert "resuming with changed settings" not in result.stdout
    result = run_module("megatron_pmlm.pretrain", *common, "--num-layers", "3", "--train-iters", "1", "--load",
                        str(ckpt), "--finetune", "--save", str(tmp_path / "g"))
    assert result.returncode == 2 and "holds a different model (num_layers: saved 2, now 3)" in result.stderr, \
        result.stderr[-2000:]


def test_a_resume_on_another_attention_backend_says_it_will_not_repeat_the_saved_run(tmp_path):
    """--attention-backend auto picks by the GPU: a run requeued onto other GPUs may resume on another
    backend. It continues the same model, listed among the changed settings, with a note that the
    dropout masks differ (so the run is not repeated bit for bit) and how to keep the saved one."""
    from megatron_pmlm.training.preflight import check_resumed_settings

    def state(backend, flag):
        return {"args": {"attention_backend": flag, "model_config": {"hidden_size": 768, "attention_backend": backend}},
                "training_config": {"lr": 1e-4}}

    lines = []
    check_resumed_settings(tmp_path, state("sdpa", "auto"), state("triton", "auto")["args"], {"lr": 1e-4}, False,
                           lines.append)
    assert lines == ["resuming with changed settings: attention_backend sdpa -> triton",
                     "note: the triton attention backend computes the same model as sdpa did, with other "
                     "attention-dropout masks: this run continues the saved one but does not repeat it bit for bit "
                     "(--attention-backend sdpa would)"], lines
    for same in (state("sdpa", "sdpa"), state("sdpa", "auto")):  # the flag alone changed: the same kernels
        lines = []
        check_resumed_settings(tmp_path, state("sdpa", "auto"), same["args"], {"lr": 1e-4}, False, lines.append)
        assert not any(line.startswith("note:") for line in lines), lines
