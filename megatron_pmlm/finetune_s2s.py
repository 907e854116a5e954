"""Fine-tune for generation as s2s-ft does: `python -m megatron_pmlm.finetune_s2s --model M --train-file F.jsonl ...`.

`--model` is a Hugging Face folder (ours, a plain BERT, a released UniLMv2 / s2s-ft folder) or a
checkpoint directory of ours. Modes: pseudo-masked (s2s-ft v2, the default), masked (v1), causal
(v0, decoded with the position shift). Training runs on the pre-training trainer (DeepSpeed: ZeRO
0-3, fp16/bf16, exact resume with --save/--load, TensorBoard); launch with torchrun/srun for many
GPUs. At the end the --save directory also holds a Hugging Face folder (`hf/`) that
`python -m megatron_pmlm.decode_s2s --model SAVE_DIR` reads.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Sequence

from .config import ATTENTION_BACKEND_CHOICES, ConfigError, HelpFormatter, positive_float
from .files import quiet_libraries
from .parallel.distributed import ends_process_groups
from .training.checkpoint_files import LATEST_FILE, add_no_checksums_argument
from .training.preflight import check_run_paths
from .training.save_lock import add_no_lock_argument, release_save_dirs
from .training.tracking import add_tracking_arguments, check_tracking_arguments
from .models.seq2seq import MODES, Seq2SeqConfig
from .training.exit_signal import ExitSignal
from .training import heartbeat
from .training.heartbeat import add_heartbeat_argument
from .training.checkpoint_files import CheckpointError
from .training.nonfinite import NonFiniteGradients
from .training.training_config import TrainingConfig, check_precision_supported, zero0_mixed_precision_note

TRAINING_DEFAULTS = dict(
    # s2s-ft: code defaults (run_seq2seq.py) and the paper's Appendix A where the code has none.
    lr=5e-5, min_lr=0.0, lr_warmup_iters=1000, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.999,
    adam_eps=1e-6, clip_grad=1.0, micro_batch_size=8, global_batch_size=64, log_interval=50,
    eval_interval=500, save_interval=0, exit_interval=0, seed=42, keep_last_checkpoints=0, keep_checkpoint_every=0,
)
DEFAULT_EPOCHS = 10
SHORT_RUN_WARMUP_FRACTION = 0.1
"""A run no longer than the default warmup warms up over this share of its iterations instead."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.finetune_s2s", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a Hugging Face folder or a checkpoint directory (pre-training or fine-tuning --save)")
    add_no_checksums_argument(parser)
    data = parser.add_argument_group("data (s2s-ft's JSONL with src/tgt fields, or aligned text files)")
    for what in ("train", "valid"):
        data.add_argument(f"--{what}-file", help=f"{what} examples, JSONL with 'src' and 'tgt'")
        data.add_argument(f"--{what}-src", help=f"{what} sources, one per line")
        data.add_argument(f"--{what}-tgt", help=f"{what} targets, one per line")

    s2s_defaults = Seq2SeqConfig()
    s2s = parser.add_argument_group("sequence to sequence (SPEC §7.1)")
    s2s.add_argument("--mode", default=s2s_defaults.mode, choices=list(MODES),
                     help="pseudo-masked = s2s-ft v2, masked = v1, causal = v0 (position shift)")
    for name in ("max_source_length", "max_target_length", "max_masked_targets"):
        s2s.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(s2s_defaults, name))
    for name in ("target_mask_prob", "target_keep_prob", "target_random_prob", "label_smoothing"):
        s2s.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(s2s_defaults, name))
    s2s.add_argument("--source-type-id", type=int, default=None, help="default: the model's config, else 0")
    s2s.add_argument("--target-type-id", type=int, default=None, help="default: the model's config, else 1")

    train = parser.add_argument_group("training (pre-training's names)")
    train.add_argument("--train-iters", type=int, default=None, help=f"default: --epochs {DEFAULT_EPOCHS} worth")
    train.add_argument("--epochs", type=positive_float, default=None,
                       help=f"passes over the training set (default: {DEFAULT_EPOCHS}, when no --train-iters)")
    train.add_argument("--lr-warmup-iters", type=int, default=None,
                       help=f"linear warmup to --lr (default: {TRAINING_DEFAULTS['lr_warmup_iters']}, s2s-ft's; a run "
                            f"with no more iterations than that warms up over "
                            f"{SHORT_RUN_WARMUP_FRACTION * 100:.0f}%% of them, and says so)")
    for name in ("micro_batch_size", "global_batch_size", "seed", "log_interval",
                 "eval_interval", "save_interval", "exit_interval", "keep_last_checkpoints",
                 "keep_checkpoint_every"):
        train.add_argument("--" + name.replace("_", "-"), type=int, default=TRAINING_DEFAULTS[name])
    for name in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
        train.add_argument("--" + name.replace("_", "-"), type=float, default=TRAINING_DEFAULTS[name])
    train.add_argument("--eval-iters", type=int, default=None,
                       help="validation micro-batches per evaluation (default: the whole validation set)")
    train.add_argument("--hidden-dropout", type=float, default=None, help="default: the model's")
    train.add_argument("--attention-dropout", type=float, default=None, help="default: the model's")
    train.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_CHOICES,
                       help="as pretrain's: auto (triton where it runs, else sdpa; the default), sdpa (a dense "
                            "bias per batch), flex (needs --attention-dropout 0) or "
                            "triton (our flash attention reading the relative bias per tile; CUDA, SM 8.0+; "
                            "docs/gpu.md); how the model is trained, not what it is: the weights are the same")
    precision = train.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true")
    precision.add_argument("--bf16", action="store_true")
    train.add_argument("--checkpoint-activations", action="store_true")
    train.add_argument("--compile", action="store_true",
                       help="torch.compile the step region by region (layers, embeddings + attention bias, heads + "
                            "loss), as pretrain --compile (ZeRO 0-2)")
    train.add_argument("--zero-stage", type=int, default=0)
    train.add_argument("--deepspeed-config", help="a DeepSpeed JSON file; arguments override it")
    train.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)

    output = parser.add_argument_group("checkpoints and logs")
    output.add_argument("--save", help="checkpoint directory (and, at the end, its Hugging Face export in hf/)")
    add_no_lock_argument(output)
    output.add_argument("--load", help="resume from this directory's newest complete checkpoint; a directory "
                                           "holding none is refused unless it is --save (a first start)")
    output.add_argument("--tensorboard-dir")
    output.add_argument("--history-json", help="also write the logged metrics to this JSON file (rewritten at "
                                               "every log interval)")
    add_heartbeat_argument(output)
    add_tracking_arguments(parser)
    return parser


def warmup_for_run(requested: int | None, train_iters: int, lr: float) -> tuple[int, str | None]:
    """(warmup iterations, a line to log or None). The default warmup (s2s-ft's, for runs of
    thousands of iterations) never ends in a short run, whose learning rate then stays far below
    --lr: such a run warms up over SHORT_RUN_WARMUP_FRACTION of its iterations instead. An explicit
    warmup is kept, with a warning when the run ends before it does."""
    if requested is None:
        default = TRAINING_DEFAULTS["lr_warmup_iters"]
        if default < train_iters:
            return default, None
        warmup = math.ceil(SHORT_RUN_WARMUP_FRACTION * train_iters)
        return warmup, (f"note: the run has {train_iters} iterations, no more than the default warmup of {default}: "
                        f"warming up over {warmup} ({SHORT_RUN_WARMUP_FRACTION:.0%} of the run; --lr-warmup-iters "
                        "sets it)")
    if requested >= train_iters:
        return requested, (f"warning: --lr-warmup-iters {requested} is not shorter than the run's {train_iters} "
                           f"iterations: the learning rate peaks at {lr * train_iters / requested:.3g}, not --lr {lr:g}")
    return requested, None


def seq2seq_config_from_args(args, settings: dict) -> Seq2SeqConfig:
    source_type_id = args.source_type_id if args.source_type_id is not None else int(settings.get("source_type_id", 0))
    target_type_id = args.target_type_id if args.target_type_id is not None else int(settings.get("target_type_id", 1))
    return Seq2SeqConfig(**{f.name: getattr(args, f.name) for f in fields(Seq2SeqConfig)
                            if f.name not in ("source_type_id", "target_type_id")},
                         source_type_id=source_type_id, target_type_id=target_type_id)


@ends_process_groups
def main(argv: Sequence[str] | None = None) -> int:
    ExitSignal.install()
    quiet_libraries()
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ConfigError, CheckpointError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except NonFiniteGradients as error:  # the run diverged: said in one line, not a traceback
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        release_save_dirs()  # --save's lock (held from check_run_paths on)


def run(args: argparse.Namespace) -> int:
    from .hf.family import check_family
    from .pretrained import load_model, resize_position_embeddings
    from .models.seq2seq import SEQ2SEQ_METRICS, PMLMForSeq2Seq, SpecialIds, build_examples, read_pairs, seq2seq_batches
    from .tokenizer import WordPieceTokenizer

    # Everything that can be refused is checked before processes start talking to each other;
    # --load and the outputs first, so a refused run has written nothing.
    tracking = check_tracking_arguments(args)
    check_run_paths(args.save, args.load, tensorboard_dir=args.tensorboard_dir, history_json=args.history_json,
                    lock=args.lock, heartbeat_dir=args.heartbeat_dir,
                    weights_hint="a model to fine-tune goes to --model")
    heartbeat.start(args.heartbeat_dir)  # from here on, every rank records its phase (start-up first)
    if args.train_iters is not None and args.epochs is not None:
        raise ConfigError("give --train-iters or --epochs, not both")
    train_sources, train_targets = read_pairs(args.train_file, args.train_src, args.train_tgt, "train")
    has_valid = bool(args.valid_file or args.valid_src or args.valid_tgt)
    valid_pairs = read_pairs(args.valid_file, args.valid_src, args.valid_tgt, "valid") if has_valid else None
    check_family("--model", args.model, "finetune_s2s")
    loaded = load_model(args.model, args.checksums)
    s2s = seq2seq_config_from_args(args, loaded.settings)
    for name, value in (("--source-type-id", s2s.source_type_id), ("--target-type-id", s2s.target_type_id)):
        if not 0 <= value < loaded.config.type_vocab_size:
            raise ConfigError(f"{name} {value} is outside the model's {loaded.config.type_vocab_size} segment types")
    tokenizer = WordPieceTokenizer(loaded.vocabulary)
    special = SpecialIds(cls=tokenizer.special.cls, sep=tokenizer.special.sep, mask=tokenizer.special.mask,
                         pad=tokenizer.special.pad)
    train_examples = build_examples(tokenizer.encode_batch(train_sources), tokenizer.encode_batch(train_targets),
                                    s2s, special)
    valid_examples = (build_examples(tokenizer.encode_batch(valid_pairs[0]), tokenizer.encode_batch(valid_pairs[1]),
                                     s2s, special) if valid_pairs else None)

    dropout = {k: v for k, v in (("hidden_dropout", args.hidden_dropout), ("attention_dropout", args.attention_dropout))
               if v is not None}
    try:
        config = replace(loaded.config, padded_vocab_size=0,
                         max_position_embeddings=max(loaded.config.max_position_embeddings, s2s.max_length), **dropout)
    except ConfigError as error:
        raise ConfigError(f"model config: {error}") from None
    from .models.accelerated import training_device_type
    from .models.model import check_attention_backend, resolve_attention_backend

    config = replace(config, attention_backend=resolve_attention_backend(args.attention_backend, config,
                                                                         training_device_type()))

    check_attention_backend(config, training_device_type())
    from .training.training_config import read_deepspeed_config

    ds_config_base = read_deepspeed_config(args.deepspeed_config)
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    training_values = {name: getattr(args, name) for name in TRAINING_DEFAULTS}
    training_values.update(seq_length=s2s.max_length, precision=precision, zero_stage=args.zero_stage,
                           eval_iters=args.eval_iters or 0)
    epochs = args.epochs if args.epochs is not None else DEFAULT_EPOCHS
    training_values["train_iters"] = args.train_iters or max(
        1, math.ceil(epochs * len(train_examples) / args.global_batch_size))
    training_values["lr_warmup_iters"], warmup_line = warmup_for_run(args.lr_warmup_iters,
                                                                     training_values["train_iters"], args.lr)
    training = TrainingConfig(**training_values)
    check_precision_supported(training.precision)
    if args.compile:
        from .models.compiled import check_compile

        check_compile(training.zero_stage, attention_backend=config.attention_backend)

    import torch.distributed as dist

    from .parallel.distributed import model_parallel_unit
    from .training.recipe import flops_per_token, start_processes
    from .training.trainer import Trainer, seed_everything

    heartbeat.beat("start-up: distributed init")
    processes = start_processes(training, 1, 1)
    heartbeat.beat("start-up: building model")
    layout, rank, dp_rank, log = processes.layout, processes.rank, processes.data_parallel_rank, processes.log
    data_parallel_size = layout.data_parallel_size
    if valid_examples is not None and not args.eval_iters:
        training = replace(training, eval_iters=max(1, math.ceil(len(valid_examples) / (
            training.micro_batch_size * data_parallel_size))))
    seed_everything(training.seed)
    model = PMLMForSeq2Seq(config, s2s, pad_token_id=special.pad, init_seed=training.seed)
    state = resize_position_embeddings(loaded.state_dict, config.max_position_embeddings)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{loaded.source}: weights do not fit the model (missing {missing[:4]}, unexpected "
                          f"{unexpected[:4]})")
    model.bert.encoder.checkpoint_activations = args.checkpoint_activations
    if args.compile:
        from .models.compiled import compile_step_regions

        compile_step_regions(model, on_new_shape=heartbeat.compiling)
    if warmup_line:
        log(warmup_line)
    log(f"model: {loaded.source}; {config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_attention_heads} heads, vocabulary {config.vocab_size}, relative position bias "
        f"{'on' if config.rel_pos else 'off'}, positions {config.max_position_embeddings}")
    log(f"data: {len(train_examples):,} training pairs ({train_examples.truncated_sources:,} sources and "
        f"{train_examples.truncated_targets:,} targets truncated to {s2s.max_source_length}/{s2s.max_target_length} "
        "tokens)" + (f", {len(valid_examples):,} validation pairs ({valid_examples.truncated_targets:,} targets "
                     "truncated)" if valid_examples else ""))
    log(f"mode {s2s.mode} (s2s-ft {MODES[s2s.mode]}), label smoothing {s2s.label_smoothing}, target mask prob "
        f"{s2s.target_mask_prob}; {training.train_iters} iterations of {training.global_batch_size} "
        f"(~{training.train_iters * training.global_batch_size / len(train_examples):.2f} epochs), data parallel "
        f"{data_parallel_size}, ZeRO-{training.zero_stage}, {training.precision}, micro batch {training.micro_batch_size}")
    if note := zero0_mixed_precision_note(training):
        log(note)
    vocab_file = recorded_vocab_file(loaded.vocabulary, args.save, rank)
    run_args = {**vars(args), "model_config": asdict(config), "tensor_model_parallel_size": 1,
                "pipeline_model_parallel_size": 1, "vocab_file": vocab_file,
                "do_lower_case": loaded.do_lower_case, "s2s_mode": s2s.mode,
                "s2s_max_source_length": s2s.max_source_length, "s2s_max_target_length": s2s.max_target_length,
                "source_type_id": s2s.source_type_id, "target_type_id": s2s.target_type_id}
    heartbeat.beat("start-up: building the engine")
    trainer = Trainer(model, training, data_parallel_size, ds_config_base, mpu=model_parallel_unit(),
                      flops_per_token=flops_per_token(config, s2s.max_length, mask_prob=0.5 if s2s.pseudo_masked else 0),
                      tensorboard_dir=args.tensorboard_dir, log=print, run_args=run_args, metrics=SEQ2SEQ_METRICS,
                      history_path=args.history_json, tracking=tracking)
    if args.load:
        heartbeat.beat("start-up: loading checkpoint")
        trainer.load_checkpoint(args.load, expected_model_config=asdict(config))
    heartbeat.beat("start-up: loading data")
    vocab_size = config.vocab_size
    train_batches = seq2seq_batches(train_examples, s2s, special, vocab_size, training.micro_batch_size, dp_rank,
                                    data_parallel_size, training.seed, trainer.consumed_samples)

    def valid_batches():
        """The whole validation set in file order, corrupted as in training but from its own seed."""
        return seq2seq_batches(valid_examples, s2s, special, vocab_size, training.micro_batch_size, dp_rank,
                               data_parallel_size, training.seed + 1, 0, shuffle=False)

    trainer.train(train_batches, valid_batches if valid_examples is not None else None, save_dir=args.save)
    dist.barrier()
    if args.save and rank == 0 and (Path(args.save) / LATEST_FILE).is_file():  # none: stopped before a first save
        heartbeat.beat("exporting", trainer.iteration)
        export_fine_tuned(args.save, s2s, run_args["vocab_file"], log=print)
    dist.barrier()
    heartbeat.beat(heartbeat.DONE_PHASE, trainer.iteration)
    return trainer.exit_status


def recorded_vocab_file(vocabulary, save_dir: str | None, rank: int) -> str | None:
    """The vocab.txt the run records (its export and a later load of the checkpoint read it): the
    model's own, else, for a folder that has only a tokenizer.json, a copy rank 0 writes into --save
    (never into the model's folder); None without --save, where nothing reads it."""
    from .tokenizer import VOCAB_FILE

    if vocabulary.file is not None:
        return str(vocabulary.file.resolve())
    if not save_dir:
        return None
    path = Path(save_dir).resolve() / VOCAB_FILE
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        vocabulary.write(path)
    return str(path)


def export_fine_tuned(save_dir: str, s2s: Seq2SeqConfig, vocab_file: str, log=print) -> Path:
    """SAVE/hf: the latest checkpoint as a Hugging Face folder, with the seq2seq settings decoding
    needs (s2s_mode, source/target type ids, the source/target lengths trained with) and the tag it
    came from in config.json."""
    from .files import write_json_atomically
    from .hf.convert import export_to_hf
    from .pretrained import HF_EXPORT_DIR

    save_dir = Path(save_dir)
    output = save_dir / HF_EXPORT_DIR
    export_to_hf(save_dir, output, vocab_file=vocab_file, overwrite=True, log=lambda message: None)
    config_file = output / "config.json"
    values = json.loads(config_file.read_text())
    values.update(s2s_mode=s2s.mode, source_type_id=s2s.source_type_id, target_type_id=s2s.target_type_id,
                  s2s_max_source_length=s2s.max_source_length, s2s_max_target_length=s2s.max_target_length,
                  checkpoint_tag=(save_dir / LATEST_FILE).read_text().strip())
    write_json_atomically(config_file, dict(sorted(values.items())))
    log(f"wrote the Hugging Face folder {output} (decode with: python -m megatron_pmlm.decode_s2s --model {save_dir} ...)")
    return output


if __name__ == "__main__":
    sys.exit(main())
