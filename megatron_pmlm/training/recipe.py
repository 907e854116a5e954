"""What every training command shares: the padded vocabulary, the TrainingConfig from the
command line and the DeepSpeed file, the model FLOPs per token, whether a resume needs DeepSpeed's
universal checkpoint, and the run itself (`start_processes`; `run_pretraining` for PMLM, UniLM and
PALM pre-training, which hand it a `PretrainingRun`)."""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError, ModelConfig
from .training_config import PRESET_TRAINING_DEFAULTS, TrainingConfig, zero0_mixed_precision_note


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


def needs_universal_checkpoint(args: argparse.Namespace, zero_stage: int, data_parallel_size: int, log,
                               tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1) -> bool:
    """Whether --universal-checkpoint has work to do: the newest complete checkpoint was written
    with another tensor/pipeline layout (re-sharded by relayout.py; checked before the model is
    built by `relayout.check_resume_layout`), or its ZeRO partitions for another data-parallel
    size. The flag can then stay in a job's arguments across restarts: once the run saves in its
    new layout, checkpoints load as they are."""
    if not args.universal_checkpoint or args.finetune:
        return False
    from .checkpoint_files import newest_run_state
    from .relayout import saved_layout

    saved = newest_run_state(Path(args.load))
    if saved is None:
        return False
    if saved_layout(saved) != (tensor_parallel_size, pipeline_parallel_size):
        return True
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


# ------------------------------------------------------------------------------------------------
# The run: processes, model, Trainer, checkpoint, data, iterations
# ------------------------------------------------------------------------------------------------

@dataclass
class Processes:
    """This process's place in the run, once the process groups exist."""

    layout: Any
    """parallel.distributed.ParallelLayout"""
    rank: int
    data_parallel_rank: int
    pipeline_rank: int
    log: Callable[[str], None]
    """print on the last rank (the one that logs the loss), silent elsewhere."""


def start_processes(training: TrainingConfig, tensor_parallel_size: int, pipeline_parallel_size: int,
                    timeout_minutes: float | None = None) -> Processes:
    """Process groups (megatron-core's), this rank's coordinates, the batch checked on every rank."""
    import torch.distributed as dist

    from ..parallel.distributed import initialize_model_parallel

    timeout = {} if timeout_minutes is None else {"timeout_minutes": timeout_minutes}
    layout = initialize_model_parallel(tensor_parallel_size, pipeline_parallel_size, **timeout)
    rank = dist.get_rank()
    _, dp_rank, pp_rank = layout.coordinates(rank)
    training.gradient_accumulation_steps(layout.data_parallel_size)  # refuse a bad batch on every rank
    log = print if rank == dist.get_world_size() - 1 else (lambda message: None)
    return Processes(layout, rank, dp_rank, pp_rank, log)


def parallelism_line(training: TrainingConfig, layout, pipeline: bool = True) -> str:
    """The 'parallelism: ...' log line."""
    tp, pp = layout.tensor_parallel_size, layout.pipeline_parallel_size
    sizes = f"data {layout.data_parallel_size} x tensor {tp}" + (f" x pipeline {pp}" if pipeline else "")
    return (f"parallelism: world {layout.world_size} = {sizes}; "
            f"ZeRO-{training.zero_stage}, {training.precision}, micro batch {training.micro_batch_size}, "
            f"global batch {training.global_batch_size} "
            f"({training.gradient_accumulation_steps(layout.data_parallel_size)} accumulation steps)")


@dataclass
class PretrainingRun:
    """What a model family (PMLM/UniLM, PALM) hands the one pre-training recipe, `run_pretraining`."""

    model_config: Any
    """The model's config dataclass (saved with every checkpoint, checked at resume)."""
    training: TrainingConfig
    ds_config: dict | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    build_model: Callable[[Any], Any]
    """layout -> the model (seeded already)."""
    describe_model: str
    flops_per_token: float
    metrics: Any
    build_loaders: Callable[[Processes, int], Any]
    """(processes, consumed samples) -> data.PretrainingLoaders."""
    describe_data: Callable[[Any], str]
    show_pipeline: bool = True
    """Whether the parallelism line names the pipeline size (PALM has none)."""


def run_pretraining(args: argparse.Namespace, plan: PretrainingRun) -> int:
    """The recipe every pre-training shares, once the arguments are checked: process groups, seed,
    model, the universal-checkpoint decision, Trainer, resume, data, iterations. The exit status."""
    import torch.distributed as dist

    from . import heartbeat

    trainer, loaders = start_pretraining(args, plan)
    trainer.train(loaders.train, loaders.valid, save_dir=args.save)
    dist.barrier()
    heartbeat.beat(heartbeat.DONE_PHASE, trainer.iteration)
    return trainer.exit_status


def start_pretraining(args: argparse.Namespace, plan: PretrainingRun) -> tuple[Any, Any]:
    """Everything of `run_pretraining` before the iterations: (Trainer, data.PretrainingLoaders)."""
    from ..parallel.distributed import model_parallel_unit
    from . import heartbeat
    from .trainer import Trainer, seed_everything
    from .tracking import TrackingConfig

    training = plan.training
    heartbeat.beat("start-up: distributed init")
    processes = start_processes(training, plan.tensor_parallel_size, plan.pipeline_parallel_size,
                                args.distributed_timeout_minutes)
    layout, log = processes.layout, processes.log
    # The same seed on every tensor- and data-parallel rank keeps replicated dropout in step.
    seed_everything(training.seed + 100 * processes.pipeline_rank)
    heartbeat.beat("start-up: building model")
    model = plan.build_model(layout)
    universal = needs_universal_checkpoint(args, training.zero_stage, layout.data_parallel_size, log,
                                           plan.tensor_parallel_size, plan.pipeline_parallel_size)
    log(plan.describe_model)
    log(parallelism_line(training, layout, plan.show_pipeline))
    if note := zero0_mixed_precision_note(training):
        log(note)
    heartbeat.beat("start-up: building the engine")
    trainer = Trainer(model, training, layout.data_parallel_size, plan.ds_config, mpu=model_parallel_unit(),
                      pipeline=plan.pipeline_parallel_size > 1, flops_per_token=plan.flops_per_token,
                      tensorboard_dir=args.tensorboard_dir, log=print, metrics=plan.metrics,
                      universal_checkpoint=universal, history_path=args.history_json,
                      run_args={**vars(args), "model_config": asdict(plan.model_config)},
                      tracking=TrackingConfig.from_args(args))
    if args.load:
        heartbeat.beat("start-up: loading checkpoint")
        trainer.load_checkpoint(args.load, expected_model_config=asdict(plan.model_config), finetune=args.finetune)
    heartbeat.beat("start-up: loading data")
    loaders = plan.build_loaders(processes, trainer.consumed_samples)
    log(plan.describe_data(loaders))
    return trainer, loaders
