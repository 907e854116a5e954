"""Pre-train a PMLM on DeepSpeed: `python -m megatron_pmlm.pretrain --data-path SAMPLES_DIR ...`.

Launch with torchrun, `deepspeed`, or `srun` (ranks from SLURM_PROCID/SLURM_NTASKS or MPI). The
data is a `python -m data_prep.build_samples` output directory. Megatron-style arguments; the
defaults of the `base` preset are the paper's recipe (UniLMv2 Table 7). Gradient accumulation is global
batch / (micro batch x data-parallel size).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import replace
from typing import Sequence

from .config import (ATTENTION_BACKENDS, PRESETS, ConfigError, HelpFormatter, ModelConfig, UniLMMaskingConfig,
                     add_dataclass_arguments, dataclass_overrides, model_config_from_preset)
from .models.objectives import DEFAULT_OBJECTIVE, OBJECTIVES, Objective, get_objective, objective_metrics
from .training.preflight import check_run_paths
from .models.unilm import TYPE_VOCAB_SIZE as UNILM_TYPE_VOCAB_SIZE
from .parallel.distributed import DEFAULT_TIMEOUT_MINUTES, ends_process_groups, quiet_other_ranks
from .training.recipe import (PretrainingRun, flops_per_token, padded_vocab_size, run_pretraining,
                              training_config_from_args)
from .training.trainer import ExitSignal
from .training.checkpoint_files import CheckpointError
from .training.training_config import (LR_DECAY_STYLES, PRESET_TRAINING_DEFAULTS, TrainingConfig,
                                       check_precision_supported, check_zero_with_pipeline)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_pmlm.pretrain", description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter)
    defaults = TrainingConfig()
    model = parser.add_argument_group("model (defaults: the preset's)")
    model.add_argument("--preset", default="base", help=f"one of {', '.join(PRESETS)}")
    for name in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
                 "max_position_embeddings"):
        model.add_argument("--" + name.replace("_", "-"), type=int, help="default: the preset's")
    model.add_argument("--hidden-dropout", type=float, help=f"default: {ModelConfig.hidden_dropout}")
    model.add_argument("--attention-dropout", type=float, help=f"default: {ModelConfig.attention_dropout}")
    model.add_argument("--no-rel-pos", action="store_true", help="plain BERT: no relative position bias")
    model.add_argument("--attention-backend", default="sdpa", choices=ATTENTION_BACKENDS,
                       help="sdpa: a dense additive mask + relative bias per batch; flex: torch FlexAttention "
                            "(block mask from roles/steps, relative bias as a score_mod; needs --attention-dropout 0)")
    model.add_argument("--objective", default=DEFAULT_OBJECTIVE, help=f"one of {', '.join(OBJECTIVES)}")
    model.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                       help="pad the vocabulary (x tensor parallel size) for efficient, splittable matmuls")

    data = parser.add_argument_group("data")
    data.add_argument("--data-path", required=True, nargs="+",
                      help="a `python -m data_prep.build_samples` output directory (corpora are blended, "
                           "with Megatron-style weights, when the samples are built)")
    data.add_argument("--seq-length", type=int, default=None,
                      help="must match the samples' build (default: taken from it)")
    data.add_argument("--no-length-bucketing", action="store_true",
                      help="deal each global batch out as micro batches in shuffled order; by default its samples "
                           "are ordered longest first so micro batches carry less padding (same samples per step)")

    train = parser.add_argument_group("training")
    train.add_argument("--micro-batch-size", type=int, default=None,
                       help=f"per GPU (default: the DeepSpeed config's, else {defaults.micro_batch_size})")
    train.add_argument("--global-batch-size", type=int, default=None,
                       help=f"sequences per step (default: the DeepSpeed config's, else {defaults.global_batch_size})")
    integer_help = {
        "train_iters": "optimizer steps", "seed": "weights, dropout, sample order",
        "log_interval": "iterations between log lines", "eval_interval": "iterations between validations",
        "eval_iters": "validation micro batches per rank (0: no validation)",
        "save_interval": "iterations between checkpoints (0: only at the end and on exit)",
        "exit_interval": "save and stop after this iteration (0: off)",
        "keep_last_checkpoints": "keep only the newest N complete checkpoints (0: all)",
        "keep_checkpoint_every": "never delete checkpoints of iterations that are multiples of M (0: none)",
        "lr_decay_iters": "the decay ends (at --min-lr) at this iteration (0: --train-iters)"}
    for name, text in integer_help.items():
        train.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name), help=text)
    tiny = PRESET_TRAINING_DEFAULTS["tiny"]
    train.add_argument("--lr", type=float, default=None,
                       help=f"peak learning rate (default: {defaults.lr}; tiny preset: {tiny['lr']})")
    train.add_argument("--lr-warmup-iters", type=int, default=None,
                       help=f"linear warmup steps (default: {defaults.lr_warmup_iters}; tiny preset: "
                            f"{tiny['lr_warmup_iters']})")
    train.add_argument("--lr-decay-style", default=defaults.lr_decay_style, choices=LR_DECAY_STYLES,
                       help="after warmup (Megatron's flag); the paper decays linearly")
    for name, text in (("min_lr", "the decay's floor"), ("weight_decay", "AdamW, matrices only"),
                       ("adam_beta1", "Adam beta1"), ("adam_beta2", "Adam beta2"), ("adam_eps", "Adam epsilon")):
        train.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name), help=text)
    train.add_argument("--clip-grad", type=float, default=None,
                       help="max gradient norm, 0 = none (default: the DeepSpeed config's, else 0 as in the paper)")
    precision = train.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="fp16 with dynamic loss scaling (V100)")
    precision.add_argument("--bf16", action="store_true", help="bf16 (A100/H100)")
    train.add_argument("--checkpoint-activations", action="store_true",
                       help="recompute each layer in the backward pass (less memory, ~30%% more compute)")

    parallel = parser.add_argument_group("parallelism")
    parallel.add_argument("--tensor-model-parallel-size", type=int, default=1,
                          help="split attention heads, FFN and vocabulary over this many GPUs (megatron-core)")
    parallel.add_argument("--pipeline-model-parallel-size", type=int, default=1,
                          help="split the layers into this many stages (DeepSpeed pipeline)")
    parallel.add_argument("--zero-stage", type=int, default=None,
                          help="0-3 (default: the DeepSpeed config's, else 0)")
    parallel.add_argument("--deepspeed-config", help="a DeepSpeed JSON file (ds_configs/); arguments override it")
    parallel.add_argument("--distributed-timeout-minutes", type=float, default=DEFAULT_TIMEOUT_MINUTES,
                          help="a collective that waits longer fails the run (so a hung job ends and can requeue)")
    parallel.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)

    output = parser.add_argument_group("checkpoints and logs")
    output.add_argument("--save", help="checkpoint directory")
    output.add_argument("--load", help="resume from this directory's newest complete checkpoint; a directory "
                                           "holding none is refused unless it is --save (a first start)")
    output.add_argument("--universal-checkpoint", action="store_true",
                        help="with --load: resume on another data-parallel size (e.g. fewer nodes), keeping iteration, "
                             "optimizer, schedule and sample order; the ZeRO checkpoint is converted to DeepSpeed's "
                             "universal format next to it (DIR/iter_N_universal) the first time")
    output.add_argument("--finetune", action="store_true",
                        help="with --load: take the weights only; iteration, optimizer and schedule start afresh")
    output.add_argument("--tensorboard-dir", help="TensorBoard event files go here")
    output.add_argument("--history-json", help="also write the logged metrics to this JSON file (rewritten at "
                                               "every log interval, so a crash loses nothing logged)")
    add_dataclass_arguments(parser, UniLMMaskingConfig, prefix="unilm-")  # --objective unilm*: masking and NSP
    from .training.palm_recipe import add_palm_arguments  # --model palm and its options

    add_palm_arguments(parser)
    return parser


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    return model_config_from_preset(
        args.preset, vocab_size=vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        max_position_embeddings=args.max_position_embeddings, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, rel_pos=False if args.no_rel_pos else None,
        attention_backend=args.attention_backend,
        # UniLM v1's segment ids 0-5 also tell the LM type (unilm.py).
        type_vocab_size=UNILM_TYPE_VOCAB_SIZE if get_objective(args.objective).is_unilm else None)


@ends_process_groups
def main(argv: Sequence[str] | None = None) -> int:
    # First of all, so a SLURM signal during start-up is remembered rather than fatal.
    ExitSignal.install()
    quiet_other_ranks()
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    # --load, --save and the other outputs first: a refused run has written nothing (PALM too).
    check_run_paths(args.save, args.load, args.finetune, args.tensorboard_dir, args.history_json)
    unilm_overrides = dataclass_overrides(args, UniLMMaskingConfig, "unilm-")
    if unilm_overrides and (args.model != "pmlm" or not get_objective(args.objective).is_unilm):
        raise ConfigError(f"--unilm-{next(iter(unilm_overrides)).replace('_', '-')} sets UniLM v1's masking and NSP; "
                          f"it needs --objective unilm (or unilm-bi, ...), not --model {args.model} --objective "
                          f"{args.objective}")
    unilm_masking = UniLMMaskingConfig(**unilm_overrides)
    if args.model == "palm":
        from .training.palm_recipe import run_palm

        return run_palm(args)
    # Everything that can be refused is checked before processes start talking to each other.
    objective = get_objective(args.objective)
    if len(args.data_path) != 1:
        raise ConfigError(
            f"--data-path takes one samples directory, got {' '.join(args.data_path)}; blend corpora "
            "when building the samples: python -m data_prep.build_samples --data-path W1 PREFIX1 W2 PREFIX2 "
            "... --output DIR, then --data-path DIR")
    args.data_path = args.data_path[0]
    from .data import build_pretraining_loaders, read_metadata

    metadata = read_metadata(args.data_path)
    if metadata.get("layout") not in (None, "pmlm"):
        raise ConfigError(f"{args.data_path} holds {metadata['layout']} samples (build_samples --layout "
                          f"{metadata['layout']}); train them with --model {metadata['layout']}, or build PMLM samples")
    seq_length = int(metadata["seq_length"])
    if args.seq_length is not None and args.seq_length != seq_length:
        raise ConfigError(f"--seq-length {args.seq_length} differs from the samples in {args.data_path} "
                          f"(built with --seq-length {seq_length}); rebuild them or drop --seq-length")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    vocab_size = int(metadata["vocab_size"])
    model_config = model_config_from_args(args, vocab_size)
    model_config = replace(model_config, padded_vocab_size=padded_vocab_size(
        vocab_size, args.make_vocab_size_divisible_by, tp))
    if seq_length > model_config.max_position_embeddings:
        raise ConfigError(f"the samples are {seq_length} tokens long, more than the model's maximum sequence "
                          f"length {model_config.max_position_embeddings} (preset {args.preset!r}); rebuild with "
                          f"a shorter --seq-length or raise --max-position-embeddings")
    from .training.training_config import read_deepspeed_config

    ds_config_base = read_deepspeed_config(args.deepspeed_config)
    if args.finetune and not args.load:
        raise ConfigError("--finetune needs --load (the checkpoint whose weights to start from)")
    training = training_config_from_args(args, seq_length, ds_config_base)
    check_zero_with_pipeline(training.zero_stage, pp > 1)
    check_precision_supported(training.precision)
    if model_config.num_attention_heads % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide the {model_config.num_attention_heads} "
                          "attention heads")
    if pp > model_config.num_layers:
        raise ConfigError(f"--pipeline-model-parallel-size {pp} exceeds the {model_config.num_layers} layers")
    from .models.accelerated import training_device_type
    from .models.model import check_attention_backend

    check_attention_backend(model_config, training_device_type())

    if args.universal_checkpoint and not args.load:
        raise ConfigError("--universal-checkpoint needs --load (the checkpoint directory to resume from)")

    def build_loaders(processes, consumed_samples):
        return build_pretraining_loaders(
            args.data_path, training.micro_batch_size, processes.data_parallel_rank,
            processes.layout.data_parallel_size, consumed_samples=consumed_samples, objective=objective,
            seed=training.seed, max_length=model_config.max_position_embeddings, vocab_size=vocab_size,
            global_batch_size=None if args.no_length_bucketing else training.global_batch_size,
            unilm_masking=unilm_masking)

    return run_pretraining(args, PretrainingRun(
        model_config=model_config, training=training, ds_config=ds_config_base, tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        build_model=lambda layout: build_model(model_config, objective, layout, args.checkpoint_activations,
                                               training.seed),
        describe_model=f"model: preset {args.preset} ({model_config.num_layers} layers, hidden "
                       f"{model_config.hidden_size}, {model_config.num_attention_heads} heads, vocabulary {vocab_size} "
                       f"padded to {model_config.embedding_rows}), objective {objective.name}, relative position bias "
                       f"{'on' if model_config.rel_pos else 'off'}",
        flops_per_token=flops_per_token(model_config, seq_length), metrics=objective_metrics(objective),
        build_loaders=build_loaders,
        describe_data=lambda loaders: (
            f"data: {len(loaders.train_samples):,} training samples"
            + (f", {len(loaders.valid_samples):,} validation samples" if loaders.valid_samples else "")
            + f" from {args.data_path}")))


def build_model(config: ModelConfig, objective: Objective, layout, checkpoint_activations: bool, seed: int):
    """One model definition for every layout: plain, tensor-parallel, pipelined, or both."""
    from .models.model import PMLMForPreTraining
    from .parallel.layers import LocalLayers, MegatronCoreLayers

    layers = MegatronCoreLayers(config.init_std) if layout.tensor_parallel_size > 1 else LocalLayers()
    if layout.pipeline_parallel_size > 1:
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        from .models.pipeline import build_pipeline_model

        topology = PipeModelDataParallelTopology(num_pp=layout.pipeline_parallel_size,
                                                 num_mp=layout.tensor_parallel_size,
                                                 num_dp=layout.data_parallel_size)
        import torch.distributed as dist

        rank = dist.get_rank()
        coordinates = topology.get_coord(rank)
        if (coordinates.model, coordinates.data, coordinates.pipe) != layout.coordinates(rank):
            raise RuntimeError(f"DeepSpeed's topology places rank {rank} at {coordinates}, megatron-core at "
                               f"{layout.coordinates(rank)} (tp, dp, pp)")
        return build_pipeline_model(config, objective, layers, layout.pipeline_parallel_size, topology,
                                    checkpoint_activations, init_seed=seed)
    model = PMLMForPreTraining(config, objective, layers, init_seed=seed)
    model.bert.encoder.checkpoint_activations = checkpoint_activations
    return model


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not __import__("torch").cuda.is_available() else "cuda")
    sys.exit(main())
