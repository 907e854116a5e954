"""PALM pre-training through the one entry point: `python -m megatron_pmlm.pretrain --model palm
--palm-stage {1,2} --data-path PALM_SAMPLES ...` (SPEC §9).

Stage 1 trains the encoder alone as a masked LM on the context; stage 2 (the default) trains
encoder, decoder and pointer-generator on the continuation's NLL, from scratch or from a stage-1
checkpoint (`--load STAGE1 --finetune`). Everything else is pretrain's: its arguments, the one
Trainer (ZeRO 0-3, exact resume, TensorBoard, history), tensor parallelism through megatron-core.
Pipeline parallelism is refused: DeepSpeed's pipeline passes one activation through a sequential
stack, and every decoder layer and the copy attention need the encoder's final states.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..config import ConfigError
from ..models.objectives import DEFAULT_OBJECTIVE
from ..models.palm import PALM_PRESETS, PALM_STAGES, PalmConfig, PalmForPreTraining, metrics_for_stage, \
    palm_config_from_preset

PALM_TRAINING_DEFAULTS = {
    # PALM §3.1: lr 1e-5, linear warmup 10k steps then linear decay, batch 64.
    "palm-base": dict(lr=1e-5, lr_warmup_iters=10_000, global_batch_size=64, micro_batch_size=8),
    # Like the PMLM tiny preset: values under which a CPU run of a few hundred steps learns.
    "palm-tiny": dict(lr=1e-3, lr_warmup_iters=10, global_batch_size=16, micro_batch_size=4),
}


def add_palm_arguments(parser: argparse.ArgumentParser) -> None:
    """pretrain's PALM options (its parser calls this)."""
    group = parser.add_argument_group("PALM (--model palm)")
    group.add_argument("--model", default="pmlm", choices=("pmlm", "palm"),
                       help="pmlm: the BERT-shaped unified LM (UniLMv2 PMLM objectives); palm: PALM's encoder-decoder "
                            "with the pointer-generator (--preset palm-base/palm-tiny, or base/tiny for those)")
    group.add_argument("--palm-stage", type=int, default=2, choices=PALM_STAGES,
                       help="1: the encoder alone as a masked LM on the context; 2: encoder and decoder on the "
                            "continuation (start from stage 1 with --load DIR --finetune)")
    group.add_argument("--num-decoder-layers", type=int, default=None, help="default: the preset's")
    group.add_argument("--copy-attention-size", type=int, default=None,
                       help=f"width of the copy attention's tanh layer (default: {PalmConfig.copy_attention_size} = "
                            "the hidden size; the paper does not give it)")


def palm_preset_name(preset: str) -> str:
    """`palm-base`/`palm-tiny`, also reached as `base`/`tiny` (pretrain's default preset is base)."""
    if preset in PALM_PRESETS:
        return preset
    if f"palm-{preset}" in PALM_PRESETS:
        return f"palm-{preset}"
    raise ConfigError(f"--model palm takes --preset {' or '.join(PALM_PRESETS)}, got {preset!r}")


def palm_config_from_args(args: argparse.Namespace, vocab_size: int, padded_vocab_size: int) -> PalmConfig:
    return palm_config_from_preset(
        palm_preset_name(args.preset), vocab_size=vocab_size, padded_vocab_size=padded_vocab_size,
        num_layers=args.num_layers, num_decoder_layers=args.num_decoder_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        max_position_embeddings=args.max_position_embeddings, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, copy_attention_size=args.copy_attention_size)


def palm_flops_per_token(config: PalmConfig, context_length: int, continuation_length: int, stage: int,
                         mask_prob: float = 0.15) -> float:
    """Model FLOPs (forward + backward = 3 x forward) per processed token at full lengths.

    Per sample, forward: the encoder's matmuls and attention; in stage 1 the MLM head at the
    masked slots; in stage 2 the decoder (self-attention, cross-attention with keys/values over the
    context, FFN), the vocabulary projection and the additive copy attention over the context."""
    h, v, w = config.hidden_size, config.embedding_rows, config.copy_width
    s, d = context_length, continuation_length
    encoder = config.num_layers * (2 * s * 12 * h * h + 4 * s * s * h)
    if stage == 1:
        return 3.0 * (encoder + 2 * mask_prob * s * (h * h + v * h)) / s
    decoder = config.num_decoder_layers * (2 * d * 14 * h * h + 2 * s * 2 * h * h + 4 * d * d * h + 4 * d * s * h)
    pointer = 2 * d * (h * h + v * h) + 2 * s * h * w + 2 * d * h * w + 4 * d * s * w + 2 * d * s * h
    return 3.0 * (encoder + decoder + pointer) / (s + d)


def check_stage_of_checkpoint(args: argparse.Namespace) -> None:
    """Resuming (no --finetune) continues the same stage: the optimizers of the two stages hold
    different parameters."""
    if not args.load or args.finetune:
        return
    from .checkpoint_files import newest_run_state

    saved = newest_run_state(Path(args.load))
    if saved is None:
        return
    saved_args = saved.get("args", {})  # a PMLM checkpoint is refused before (pretrain.check_load_family)
    saved_stage = int(saved_args.get("palm_stage", 2))
    if saved_stage != args.palm_stage:
        raise ConfigError(f"{args.load} was trained in --palm-stage {saved_stage}; to start stage {args.palm_stage} "
                          f"from it add --finetune (weights only), or resume it with --palm-stage {saved_stage}")


def run_palm(args: argparse.Namespace) -> int:
    """pretrain's `run` for --model palm (the same arguments)."""
    from ..data.index_cache import index_cache_folder
    from ..data.samples import data_identity, read_metadata
    from ..data.palm_data import check_palm_metadata
    from .recipe import PretrainingRun, padded_vocab_size, run_pretraining, training_config_from_args
    from .relayout import check_resume_layout
    from .training_config import check_precision_supported, read_deepspeed_config

    stage = args.palm_stage
    if len(args.data_path) != 1:
        raise ConfigError(f"--data-path takes one samples directory, got {' '.join(args.data_path)}")
    args.data_path = args.data_path[0]
    metadata = read_metadata(args.data_path)
    check_palm_metadata(metadata, args.data_path)
    args.data_identity = data_identity(metadata)  # recorded with each checkpoint, compared on resume
    index_cache_folder(args.data_path, args.index_cache)  # a read-only samples folder is refused here
    context_length, continuation_length = int(metadata["seq_length"]), int(metadata["continuation_length"])
    if args.seq_length is not None and args.seq_length != context_length:
        raise ConfigError(f"--seq-length {args.seq_length} differs from the contexts in {args.data_path} (built with "
                          f"--context-length {context_length}); rebuild them or drop --seq-length")
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    if pp > 1:
        raise ConfigError("--model palm does not run with --pipeline-model-parallel-size > 1: DeepSpeed's pipeline "
                          "passes one activation through a sequential stack, and every decoder layer needs the "
                          "encoder's final states; use tensor and data parallelism")
    if args.no_rel_pos:
        raise ConfigError("--no-rel-pos is for --model pmlm: PALM has absolute positions only")
    if args.attention_backend not in ("sdpa", "auto"):  # auto: sdpa, PALM's only backend
        raise ConfigError(f"--attention-backend {args.attention_backend} is for --model pmlm: PALM's attention "
                          "runs on sdpa")
    if args.objective != DEFAULT_OBJECTIVE:
        raise ConfigError("--objective is for --model pmlm: PALM's objective is chosen by --palm-stage")
    vocab_size = int(metadata["vocab_size"])
    config = palm_config_from_args(args, vocab_size, padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by, tp))
    if max(context_length, continuation_length) > config.max_position_embeddings:
        raise ConfigError(f"the samples' contexts ({context_length}) or continuations ({continuation_length} tokens) "
                          f"are longer than the model's {config.max_position_embeddings} positions; raise "
                          "--max-position-embeddings or rebuild shorter")
    if config.num_attention_heads % tp:
        raise ConfigError(f"--tensor-model-parallel-size {tp} does not divide the {config.num_attention_heads} "
                          "attention heads")
    if args.finetune and not args.load:
        raise ConfigError("--finetune needs --load (the checkpoint whose weights to start from)")
    if args.universal_checkpoint and not args.load:
        raise ConfigError("--universal-checkpoint needs --load (the checkpoint directory to resume from)")
    check_stage_of_checkpoint(args)
    preset = palm_preset_name(args.preset)
    for name, value in PALM_TRAINING_DEFAULTS[preset].items():
        # A DeepSpeed config's batch sizes win over the preset's, as in pretrain.
        if getattr(args, name) is None and not (args.deepspeed_config and name.endswith("batch_size")):
            setattr(args, name, value)
    ds_config_base = read_deepspeed_config(args.deepspeed_config)
    training = training_config_from_args(args, context_length, ds_config_base)
    check_precision_supported(training.precision)
    if args.compile:
        from ..models.compiled import check_compile

        check_compile(training.zero_stage, tp)
    check_resume_layout(args, tp, 1, training.zero_stage)

    from ..data.palm_data import build_palm_loaders
    from ..parallel.layers import LocalLayers, MegatronCoreLayers

    def build_model(layout):
        layers = MegatronCoreLayers(config.init_std) if tp > 1 else LocalLayers()
        model = PalmForPreTraining(config, layers, stage=stage, init_seed=training.seed)
        model.bert.encoder.checkpoint_activations = model.decoder.checkpoint_activations = args.checkpoint_activations
        if args.compile:
            from ..models.compiled import compile_step_regions
            from . import heartbeat

            compile_step_regions(model, on_new_shape=heartbeat.compiling)
        return model  # its ZeRO-3 external parameters: PalmForPreTraining.zero3_external_parameters

    def build_loaders(processes, consumed_samples):
        return build_palm_loaders(args.data_path, training.micro_batch_size, stage, processes.data_parallel_rank,
                                  processes.layout.data_parallel_size, consumed_samples=consumed_samples,
                                  seed=training.seed, max_length=config.max_position_embeddings, vocab_size=vocab_size,
                                  global_batch_size=None if args.no_length_bucketing else training.global_batch_size,
                                  index_cache=args.index_cache)

    return run_pretraining(args, PretrainingRun(
        model_config=config, training=training, ds_config=ds_config_base, tensor_parallel_size=tp,
        pipeline_parallel_size=1, build_model=build_model,
        describe_model=f"model: PALM {preset} ({config.num_layers} encoder + {config.num_decoder_layers} decoder "
                       f"layers, hidden {config.hidden_size}, {config.num_attention_heads} heads, copy attention "
                       f"{config.copy_width}, vocabulary {vocab_size} padded to {config.embedding_rows}), stage {stage}: "
                       + ("masked LM on the context" if stage == 1 else "continuation NLL under the copy mixture"),
        flops_per_token=palm_flops_per_token(config, context_length, continuation_length, stage),
        metrics=metrics_for_stage(stage), build_loaders=build_loaders,
        describe_data=lambda loaders: (
            f"data: {len(loaders.train_samples):,} training pairs"
            + (f", {len(loaders.valid_samples):,} validation pairs" if loaders.valid_samples else "")
            + f" from {args.data_path} (contexts <= {context_length}, continuations <= {continuation_length} tokens)"),
        show_pipeline=False))
