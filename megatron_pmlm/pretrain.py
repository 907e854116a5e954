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
from typing import Sequence

from .config import (ATTENTION_BACKEND_CHOICES, PRESETS, ConfigError, HelpFormatter, ModelConfig, UniLMMaskingConfig,
                     add_dataclass_arguments, dataclass_overrides, non_negative_int)
from .files import quiet_libraries
from .models.objectives import DEFAULT_OBJECTIVE, OBJECTIVES, get_objective
from .parallel.distributed import DEFAULT_TIMEOUT_MINUTES, ends_process_groups, quiet_other_ranks
from .training.checkpoint_files import CheckpointError
from .training.nonfinite import NonFiniteGradients
from .training.preflight import check_run_paths, check_sizes
from .training.save_lock import add_no_lock_argument, release_save_dirs
from .training.exit_signal import ExitSignal
from .training.heartbeat import add_heartbeat_argument
from .training.tracking import add_tracking_arguments, check_tracking_arguments
from .training.training_config import LR_DECAY_STYLES, PRESET_TRAINING_DEFAULTS, TrainingConfig


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
    model.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKEND_CHOICES,
                       help="auto: triton on CUDA GPUs of compute capability 8.0+ with Triton, else sdpa; "
                            "sdpa: a dense additive mask + relative bias per batch; flex: torch FlexAttention "
                            "(block mask from roles/steps, relative bias as a score_mod; needs --attention-dropout 0); "
                            "triton: our flash attention reading the relative bias per tile, dropout drawn in the "
                            "kernel (CUDA, SM 8.0+; docs/gpu.md)")
    model.add_argument("--objective", default=DEFAULT_OBJECTIVE, help=f"one of {', '.join(OBJECTIVES)}")
    model.add_argument("--make-vocab-size-divisible-by", type=non_negative_int, default=128,
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
    data.add_argument("--index-cache", metavar="DIR", default=None,
                      help="folder of the loader's epoch-order cache, built once per epoch and memory-mapped by "
                           "every rank (default: index-cache inside --data-path, which must then be writable)")

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
    train.add_argument("--compile", action="store_true",
                       help="torch.compile the step region by region: each transformer layer (identical layers share "
                            "one graph), the embeddings + attention bias, the heads + loss (the "
                            "layout width is padded to a multiple of 16 so few shapes compile, each announced); ZeRO "
                            "0-2, tensor-parallel size 1, sdpa or triton; pipeline stages compile the layers; "
                            "--model palm also its decoder layers and pointer-generator (docs/gpu.md says when it "
                            "pays)")

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
    add_no_lock_argument(output)
    output.add_argument("--load", help="resume from this directory's newest complete checkpoint; a directory "
                                           "holding none is refused unless it is --save (a first start)")
    output.add_argument("--universal-checkpoint", action="store_true",
                        help="with --load: resume on another data-parallel size (e.g. fewer nodes) or tensor/pipeline "
                             "layout, keeping iteration, optimizer, schedule and sample order; the ZeRO checkpoint "
                             "is converted to DeepSpeed's universal format next to it the first time "
                             "(DIR/iter_N_universal; another layout: DIR/iter_N_universal_tpT_ppP)")
    output.add_argument("--finetune", action="store_true",
                        help="with --load: take the weights only; iteration, optimizer and schedule start afresh")
    output.add_argument("--allow-data-change", action="store_true",
                        help="with --load: resume on other samples built with the same vocabulary (a corpus "
                             "change); without it a resume on samples other than the checkpoint's is refused")
    output.add_argument("--tensorboard-dir", help="TensorBoard event files go here")
    output.add_argument("--history-json", help="also write the logged metrics to this JSON file (rewritten at "
                                               "every log interval, so a crash loses nothing logged)")
    add_heartbeat_argument(output)
    add_tracking_arguments(parser)
    add_dataclass_arguments(parser, UniLMMaskingConfig, prefix="unilm-")  # --objective unilm*: masking and NSP
    from .training.palm_recipe import add_palm_arguments  # --model palm and its options

    add_palm_arguments(parser)
    return parser


@ends_process_groups
def main(argv: Sequence[str] | None = None) -> int:
    # First of all, so a SLURM signal during start-up is remembered rather than fatal.
    ExitSignal.install()
    quiet_libraries()
    quiet_other_ranks()
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


def check_load_family(args: argparse.Namespace) -> None:
    """A PALM checkpoint resumes or fine-tunes with --model palm only, a PMLM one without it."""
    from .hf.family import DESCRIPTION, PALM, checkpoint_family

    family = checkpoint_family(args.load) if args.load else None
    if family is None or family == args.model:
        return
    if family == PALM:
        raise ConfigError(f"--load {args.load} is {DESCRIPTION[family]}; pretrain --model {args.model} takes "
                          "PMLM/UniLM/BERT checkpoints; add --model palm to train PALM from it")
    raise ConfigError(f"--load {args.load} is {DESCRIPTION[family]}; pretrain --model palm takes PALM checkpoints "
                      "(PALM trains from scratch or from a PALM checkpoint); leave out --model palm to train it")


def run(args: argparse.Namespace) -> int:
    check_tracking_arguments(args)
    check_sizes(args)
    # --load, --save and the other outputs first: a refused run has written nothing (PALM too).
    check_run_paths(args.save, args.load, args.finetune, args.tensorboard_dir, args.history_json, lock=args.lock,
                    heartbeat_dir=args.heartbeat_dir)
    check_load_family(args)
    from .training import heartbeat

    heartbeat.start(args.heartbeat_dir)  # from here on, every rank records its phase (start-up first)
    unilm_overrides = dataclass_overrides(args, UniLMMaskingConfig, "unilm-")
    if unilm_overrides and (args.model != "pmlm" or not get_objective(args.objective).is_unilm):
        raise ConfigError(f"--unilm-{next(iter(unilm_overrides)).replace('_', '-')} sets UniLM v1's masking and NSP; "
                          f"it needs --objective unilm (or unilm-bi, ...), not --model {args.model} --objective "
                          f"{args.objective}")
    unilm_masking = UniLMMaskingConfig(**unilm_overrides)
    if args.model == "palm":
        from .training.palm_recipe import run_palm

        return run_palm(args)
    from .training.pmlm_recipe import run_pmlm

    return run_pmlm(args, unilm_masking)


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not __import__("torch").cuda.is_available() else "cuda")
    sys.exit(main())
