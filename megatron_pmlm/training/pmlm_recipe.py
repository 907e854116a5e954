"""PMLM and UniLM v1 pre-training (`python -m megatron_pmlm.pretrain`, --model pmlm): the model
configuration from the command line, the checks made before any process starts, the model for
every layout (plain, tensor-parallel, pipelined, or both), and the run through the shared recipe
(recipe.run_pretraining)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..config import ConfigError, ModelConfig, UniLMMaskingConfig, model_config_from_preset
from ..models.accelerated import training_device_type
from ..models.compiled import check_compile
from ..models.model import check_attention_backend, resolve_attention_backend
from ..models.objectives import Objective, get_objective, objective_metrics
from ..models.unilm import TYPE_VOCAB_SIZE as UNILM_TYPE_VOCAB_SIZE
from ..parallel.deepspeed_import import import_deepspeed
from .recipe import PretrainingRun, flops_per_token, padded_vocab_size, run_pretraining, training_config_from_args
from .relayout import check_resume_layout
from .training_config import check_precision_supported, check_zero_with_pipeline, read_deepspeed_config


def model_config_from_args(args: argparse.Namespace, vocab_size: int) -> ModelConfig:
    """The model --preset and the model flags describe; --attention-backend auto resolved for the device
    this run trains on (`resolve_attention_backend`)."""
    config = model_config_from_preset(
        args.preset, vocab_size=vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        max_position_embeddings=args.max_position_embeddings, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, rel_pos=False if args.no_rel_pos else None,
        # UniLM v1's segment ids 0-5 also tell the LM type (unilm.py).
        type_vocab_size=UNILM_TYPE_VOCAB_SIZE if get_objective(args.objective).is_unilm else None)
    return replace(config, attention_backend=resolve_attention_backend(args.attention_backend, config,
                                                                       training_device_type()))


def run_pmlm(args: argparse.Namespace, unilm_masking: UniLMMaskingConfig) -> int:
    """pretrain's `run` for --model pmlm (every --objective, UniLM v1's included)."""
    return run_pretraining(args, pmlm_pretraining_run(args, unilm_masking))


def pmlm_pretraining_run(args: argparse.Namespace, unilm_masking: UniLMMaskingConfig) -> PretrainingRun:
    """The checked plan of a --model pmlm run (also what tools/bench_train.py --deepspeed times)."""
    # Everything that can be refused is checked before processes start talking to each other.
    objective = get_objective(args.objective)
    if len(args.data_path) != 1:
        raise ConfigError(
            f"--data-path takes one samples directory, got {' '.join(args.data_path)}; blend corpora "
            "when building the samples: python -m data_prep.build_samples --data-path W1 PREFIX1 W2 PREFIX2 "
            "... --output DIR, then --data-path DIR")
    args.data_path = args.data_path[0]
    from ..data import build_pretraining_loaders, read_metadata
    from ..data.index_cache import index_cache_folder
    from ..data.samples import data_identity

    metadata = read_metadata(args.data_path)
    args.data_identity = data_identity(metadata)  # recorded with each checkpoint, compared on resume
    if metadata.get("layout") not in (None, "pmlm"):
        raise ConfigError(f"{args.data_path} holds {metadata['layout']} samples (build_samples --layout "
                          f"{metadata['layout']}); train them with --model {metadata['layout']}, or build PMLM samples")
    index_cache_folder(args.data_path, args.index_cache)  # a read-only samples folder is refused here
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

    check_attention_backend(model_config, training_device_type())
    if args.compile:
        check_compile(training.zero_stage, tp, model_config.attention_backend)

    if args.universal_checkpoint and not args.load:
        raise ConfigError("--universal-checkpoint needs --load (the checkpoint directory to resume from)")
    check_resume_layout(args, tp, pp, training.zero_stage)

    def build_loaders(processes, consumed_samples):
        return build_pretraining_loaders(
            args.data_path, training.micro_batch_size, processes.data_parallel_rank,
            processes.layout.data_parallel_size, consumed_samples=consumed_samples, objective=objective,
            seed=training.seed, max_length=model_config.max_position_embeddings, vocab_size=vocab_size,
            global_batch_size=None if args.no_length_bucketing else training.global_batch_size,
            unilm_masking=unilm_masking, index_cache=args.index_cache)

    return PretrainingRun(
        model_config=model_config, training=training, ds_config=ds_config_base, tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        build_model=lambda layout: build_model(model_config, objective, layout, args.checkpoint_activations,
                                               training.seed, args.compile),
        describe_model=f"model: preset {args.preset} ({model_config.num_layers} layers, hidden "
                       f"{model_config.hidden_size}, {model_config.num_attention_heads} heads, vocabulary {vocab_size} "
                       f"padded to {model_config.embedding_rows}), objective {objective.name}, relative position bias "
                       f"{'on' if model_config.rel_pos else 'off'}, attention backend {model_config.attention_backend}"
                       + (" (auto)" if args.attention_backend == "auto" else ""),
        flops_per_token=flops_per_token(model_config, seq_length), metrics=objective_metrics(objective),
        build_loaders=build_loaders,
        describe_data=lambda loaders: (
            f"data: {len(loaders.train_samples):,} training samples"
            + (f", {len(loaders.valid_samples):,} validation samples" if loaders.valid_samples else "")
            + f" from {args.data_path}"))


def build_model(config: ModelConfig, objective: Objective, layout, checkpoint_activations: bool, seed: int,
                compile_layers: bool = False):
    """One model definition for every layout: plain, tensor-parallel, pipelined, or both; with
    `compile_layers` (--compile, refused for TP earlier) its layers compiled."""
    from ..models.model import PMLMForPreTraining
    from ..parallel.layers import LocalLayers, MegatronCoreLayers

    layers = MegatronCoreLayers(config.init_std) if layout.tensor_parallel_size > 1 else LocalLayers()
    if layout.pipeline_parallel_size > 1:
        import_deepspeed()
        from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

        from ..models.pipeline import build_pipeline_model

        topology = PipeModelDataParallelTopology(num_pp=layout.pipeline_parallel_size,
                                                 num_mp=layout.tensor_parallel_size,
                                                 num_dp=layout.data_parallel_size)
        import torch.distributed as dist

        rank = dist.get_rank()
        coordinates = topology.get_coord(rank)
        if (coordinates.model, coordinates.data, coordinates.pipe) != layout.coordinates(rank):
            raise RuntimeError(f"DeepSpeed's topology places rank {rank} at {coordinates}, megatron-core at "
                               f"{layout.coordinates(rank)} (tp, dp, pp)")
        model = build_pipeline_model(config, objective, layers, layout.pipeline_parallel_size, topology,
                                     checkpoint_activations, init_seed=seed, compiled_layers=compile_layers)
    else:
        model = PMLMForPreTraining(config, objective, layers, init_seed=seed)
        model.bert.encoder.checkpoint_activations = checkpoint_activations
    if compile_layers:
        from ..models.compiled import compile_step_regions
        from . import heartbeat

        compile_step_regions(model, on_new_shape=heartbeat.compiling)
    return model
