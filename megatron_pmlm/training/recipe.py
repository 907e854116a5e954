"""What every training command shares: the padded vocabulary, the TrainingConfig from the
command line and the DeepSpeed file, the model FLOPs per token, and whether a resume needs
DeepSpeed's universal checkpoint."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from ..config import ConfigError, ModelConfig
from .training_config import PRESET_TRAINING_DEFAULTS, TrainingConfig


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    multiple = max(1, divisible_by) * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def training_config_from_args(args: argparse.Namespace, seq_length: int,
                              ds_config: dict | None = None) -> TrainingConfig:
    """Command-line values win; precision, ZeRO stage and clipping fall back to the DeepSpeed file."""
    ds_config = ds_config or {}
    values = {f.name: getattr(args, f.name) for f in fields(TrainingConfig)
              if f.name not in ("seq_length", "precision", "zero_stage", "clip_grad", "micro_batch_size",
                                "global_batch_size") and getattr(args, f.name, None) is not None}
    for name, value in PRESET_TRAINING_DEFAULTS.get(getattr(args, "preset", ""), {}).items():
        values.setdefault(name, value)
    defaults = TrainingConfig()
    micro_batch_size = args.micro_batch_size or ds_config.get("train_micro_batch_size_per_gpu") or \
        defaults.micro_batch_size
    global_batch_size = args.global_batch_size or ds_config.get("train_batch_size") or defaults.global_batch_size
    if args.fp16 or args.bf16:
        precision = "fp16" if args.fp16 else "bf16"
    else:
        precision = ("fp16" if ds_config.get("fp16", {}).get("enabled") else
                     "bf16" if ds_config.get("bf16", {}).get("enabled") else "fp32")
    zero_stage = args.zero_stage if args.zero_stage is not None else \
        int(ds_config.get("zero_optimization", {}).get("stage", 0))
    clip_grad = args.clip_grad if args.clip_grad is not None else float(ds_config.get("gradient_clipping", 0.0))
    return TrainingConfig(seq_length=seq_length, precision=precision, zero_stage=zero_stage,
                          clip_grad=clip_grad, micro_batch_size=int(micro_batch_size),
                          global_batch_size=int(global_batch_size), **values)


def flops_per_token(config: ModelConfig, seq_length: int, mask_prob: float = 0.15) -> float:
    """Model FLOPs per processed token of the pseudo-masked layout (forward + backward, 3 x forward).

    Per token: 6 x the layers' matmul parameters, plus attention (QK^T and AV over the whole
    layout, ~(1 + 2 x mask_prob) x seq_length keys: 12 x layers x hidden x keys); the MLM head
    (transform + tied softmax) runs only at the predicted slots, the [M] and [P] tokens, which are
    2p / (1 + 2p) of the layout (with mask_prob 0, no appended tokens: at every token)."""
    h, layers = config.hidden_size, config.num_layers
    layout = 1 + 2 * mask_prob
    predicted_share = 2 * mask_prob / layout if mask_prob > 0 else 1.0
    layer_parameters = layers * (12 * h * h + 13 * h)
    head_parameters = h * h + config.embedding_rows * h
    return 6.0 * (layer_parameters + predicted_share * head_parameters) + 12.0 * layers * h * seq_length * layout


def needs_universal_checkpoint(args: argparse.Namespace, zero_stage: int, data_parallel_size: int, log) -> bool:
    """Whether --universal-checkpoint has work to do: the newest complete checkpoint's ZeRO
    partitions were written for another data-parallel size. The flag can then stay in a job's
    arguments across restarts: once the run saves at its new size, checkpoints load as they are."""
    if not args.universal_checkpoint or args.finetune:
        return False
    from .checkpoint_files import newest_run_state

    saved = newest_run_state(Path(args.load))
    if saved is None:
        return False
    saved_size = saved.get("data_parallel_size")
    saved_stage = int(saved.get("training_config", {}).get("zero_stage", 0))
    if saved_size == data_parallel_size or saved_stage == 0:
        log(f"--universal-checkpoint: the newest checkpoint in {args.load} (ZeRO-{saved_stage}, data-parallel size "
            f"{saved_size}) loads as it is on data-parallel size {data_parallel_size}")
        return False
    if zero_stage == 0:
        raise ConfigError("--universal-checkpoint restores into ZeRO's partitioned optimizer: use --zero-stage 1, 2 "
                          "or 3")
    return True
