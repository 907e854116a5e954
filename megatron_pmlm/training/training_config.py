"""The training settings (`TrainingConfig`) and what is built from them before the engine starts:
the learning-rate schedule and AdamW of UniLMv2 Table 7, the DeepSpeed config, and the checks
that refuse a precision or ZeRO stage the machine or layout cannot run."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from ..config import ConfigError
from ..files import file_problem, read_json
from ..parallel.deepspeed_import import import_deepspeed
from ..parallel.distributed import collective_device
from .gradient_norm import norm_from_squares


LR_DECAY_STYLES = ("linear", "cosine", "constant")

PRESET_TRAINING_DEFAULTS: dict[str, dict[str, Any]] = {
    # The paper's schedule (lr 6e-4 after 24k warmup steps) never warms up in a CPU run of a few
    # hundred steps; the tiny preset (tests, the demo) gets values under which such a run learns.
    "tiny": dict(lr=1e-3, lr_warmup_iters=10),
}


@dataclass
class TrainingConfig:
    """Optimisation and run settings; defaults are the paper's BASE recipe (SPEC §6)."""

    seq_length: int = 512
    micro_batch_size: int = 20
    """20 x 6 accumulation steps x 64 GPUs = 7,680 (fits a 32 GB V100 at length 512 in fp16)."""
    global_batch_size: int = 7680
    train_iters: int = 500_000
    lr: float = 6e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 24_000
    lr_decay_style: str = "linear"
    """After warmup: linear (the paper's), cosine (to min_lr), or constant."""
    lr_decay_iters: int = 0
    """Decay ends (at min_lr) at this iteration (0: train_iters), as Megatron's --lr-decay-iters."""
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_eps: float = 1e-6
    clip_grad: float = 0.0
    """0 disables clipping (the paper uses none)."""
    zero_stage: int = 0
    precision: str = "fp32"
    """fp32, fp16 (dynamic loss scaling, V100) or bf16."""
    seed: int = 1234
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 10
    save_interval: int = 0
    """Save every N iterations (0: only at the end and on exit)."""
    exit_interval: int = 0
    """Save and stop after iteration N (the schedule still follows train_iters); 0: off."""
    keep_last_checkpoints: int = 0
    """Keep only the newest N complete checkpoints (0: keep all)."""
    keep_checkpoint_every: int = 0
    """Never delete checkpoints whose iteration is a multiple of M (0: none kept forever)."""

    def __post_init__(self) -> None:
        for name in ("seq_length", "micro_batch_size", "global_batch_size", "train_iters",
                     "log_interval", "eval_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"training config: {name} must be positive, got {getattr(self, name)}")
        for name in ("eval_iters", "save_interval", "exit_interval", "lr_warmup_iters", "keep_last_checkpoints",
                     "keep_checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(f"training config: {name} must be >= 0, got {getattr(self, name)}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(f"training config: lr_decay_style must be one of {', '.join(LR_DECAY_STYLES)}, "
                              f"got {self.lr_decay_style!r}")
        if self.lr_decay_iters < 0:
            raise ConfigError(f"training config: lr_decay_iters must be >= 0, got {self.lr_decay_iters}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"training config: need 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"training config: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")
        if self.precision not in ("fp32", "fp16", "bf16"):
            raise ConfigError(f"training config: precision must be fp32, fp16 or bf16, got {self.precision!r}")

    def gradient_accumulation_steps(self, data_parallel_size: int) -> int:
        per_step = self.micro_batch_size * data_parallel_size
        if self.global_batch_size % per_step:
            raise ConfigError(
                f"global batch size {self.global_batch_size} is not divisible by micro batch size "
                f"{self.micro_batch_size} x data-parallel size {data_parallel_size}")
        return self.global_batch_size // per_step


def lr_lambda(config: TrainingConfig) -> Callable[[int], float]:
    """Linear warmup to `lr`, then decay (linear, cosine or none) to `min_lr` at `lr_decay_iters`
    (default `train_iters`), as a multiplier of lr."""
    floor = config.min_lr / config.lr
    decay_end = config.lr_decay_iters or config.train_iters

    def multiplier(iteration: int) -> float:
        if iteration < config.lr_warmup_iters:
            return (iteration + 1) / config.lr_warmup_iters
        if config.lr_decay_style == "constant":
            return 1.0
        decay_iters = max(1, decay_end - config.lr_warmup_iters)
        progress = min(1.0, (iteration - config.lr_warmup_iters) / decay_iters)
        remaining = 1.0 - progress if config.lr_decay_style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return floor + (1.0 - floor) * remaining

    return multiplier


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only: biases, LayerNorm and the relative-position bias table are exempt."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        if param.dim() >= 2 and not name.endswith("rel_pos_bias.weight"):
            decay.append(param)
        else:
            no_decay.append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


class AdamW(torch.optim.AdamW):
    """torch's AdamW that also records the global gradient norm before each step.

    DeepSpeed reports a norm only from its ZeRO/fp16/bf16 optimizers; in fp32 without ZeRO this
    fills the gap (one extra pass over the gradients, in that case only). Each gradient counts
    once: tensor-parallel slices on every rank, replicated parameters on tensor rank 0 only, and
    a pipeline's tied copy of the word embedding once. The norm (and the clipping coefficient)
    stay on the device; `last_grad_norm` reads the norm when it is logged.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm_group = None  # set once the process groups exist; None: no norm
        self.tensor_parallel_rank = 0
        self.last_grad_norm_tensor: torch.Tensor | None = None
        """The norm of the last step, a float32 scalar on the gradients' device."""
        self.max_grad_norm = 0.0
        """Clip to this norm (0: off) after measuring it, so the logged norm is the unclipped one."""

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's norm as a number (a read from the device: call it at log time)."""
        return None if self.last_grad_norm_tensor is None else float(self.last_grad_norm_tensor)

    @torch.no_grad()
    def step(self, closure=None):
        if self.norm_group is not None:
            grads = [param.grad for group in self.param_groups for param in group["params"]
                     if param.grad is not None and not getattr(param, "ds_pipe_replicated", False)
                     and (self.tensor_parallel_rank == 0 or getattr(param, "tensor_model_parallel", False))]
            device = grads[0].device if grads else collective_device()
            squares = torch.zeros((), dtype=torch.float32, device=device)
            for grad in grads:  # summed in parameter order, as before (same float32 result)
                squares = squares + grad.detach().float().pow(2).sum()
            self.last_grad_norm_tensor = norm_from_squares(squares, self.norm_group)
            if self.max_grad_norm > 0:
                # torch.nn.utils.clip_grad_norm_'s rule, on the norm measured above, without a host
                # read: the coefficient is computed in float64 as the Python number was, and a
                # coefficient of 1 leaves the gradients as they are.
                norm = self.last_grad_norm_tensor.double()
                limit = torch.full((), self.max_grad_norm, dtype=torch.float64, device=norm.device)
                ratio = torch.div(limit, norm + 1e-6)
                coefficient = torch.where(ratio < 1.0, ratio, 1.0)  # as min(1.0, ratio): a NaN norm clips nothing
                for group in self.param_groups:
                    for param in group["params"]:
                        if param.grad is not None:
                            param.grad.mul_(coefficient)
        return super().step(closure)


def adamw_options(device_type: str) -> dict[str, Any]:
    """torch's fused AdamW (one kernel over all parameters instead of a few per tensor) where torch
    has it for training: CUDA. Elsewhere torch's default implementation: nothing changes on CPU."""
    return {"fused": True} if device_type == "cuda" else {}


def read_deepspeed_config(path: str | None) -> dict[str, Any] | None:
    """The user's --deepspeed-config file (None without one); a missing or invalid file is named."""
    if not path:
        return None
    path = Path(path)
    problem = file_problem(path)
    if problem:
        raise FileNotFoundError(f"DeepSpeed config {path} {problem}")
    return read_json(path, ConfigError)


FLAT_PARTITION_ZERO_STAGES = (1, 2)
"""The ZeRO stages whose DeepSpeed optimizer (stage_1_and_2.py) steps AdamW over flat fp32
partitions, and loops over every gradient tensor before each step twice: a scan for NaN/inf when
`"bf16": {"check_grad_overflow": true}` (its default) and the global norm (`"zero_optimization":
{"compute_grad_norm": true}`). `build_deepspeed_config` turns both off where it can."""


def gradient_scan_off(config: TrainingConfig, ds_config: dict[str, Any]) -> bool:
    """Whether this run is bf16 at ZeRO-1/2 with DeepSpeed's gradient scan off, so that the Trainer
    watches the gradient norm instead (training/nonfinite.py)."""
    return (config.precision == "bf16" and config.zero_stage in FLAT_PARTITION_ZERO_STAGES
            and not ds_config.get("bf16", {}).get("check_grad_overflow", True))


def partition_norm_measured_here(config: TrainingConfig, ds_config: dict[str, Any]) -> bool:
    """Whether DeepSpeed's ZeRO-1/2 optimizer leaves the gradient norm to us
    (`"zero_optimization": {"compute_grad_norm": false}`): the Trainer then measures it on the flat
    fp32 gradient partitions its AdamW steps (training/gradient_norm.py)."""
    return (config.zero_stage in FLAT_PARTITION_ZERO_STAGES
            and ds_config.get("zero_optimization", {}).get("compute_grad_norm", True) is False)


def _deepspeed_reads_its_norm(config: TrainingConfig, ds_config: dict[str, Any], model_parallel: bool) -> bool:
    """Whether DeepSpeed's ZeRO-1/2 optimizer needs its own per-tensor gradient norm: to clip (before
    the step); to skip a step whose gradients are not finite (fp32 and fp16 always do, from the
    norm; bf16 where its scan is turned back on, reporting the skip through it), where bf16 with the
    scan off has the Trainer's watch instead (training/nonfinite.py); under model parallelism (a flat
    partition cannot tell a replicated parameter from a split one); or in bf16 at ZeRO-1
    accumulating in float32 (DeepSpeed's BF16_Optimizer runs then, and refuses to go without it)."""
    bf16 = ds_config["bf16"]
    return (config.clip_grad > 0 or not bf16["enabled"] or model_parallel
            or bf16.get("check_grad_overflow", True)
            or (config.zero_stage == 1 and ds_config.get("data_types", {}).get("grad_accum_dtype") == "fp32"))


def build_deepspeed_config(config: TrainingConfig, data_parallel_size: int,
                           base: dict[str, Any] | None = None, model_parallel: bool = False) -> dict[str, Any]:
    """A user's DeepSpeed file (if any) with the command-line values written over it.
    `model_parallel`: tensor or pipeline parallelism (some parameters are then replicated)."""
    ds_config = json.loads(json.dumps(base or {}))
    for key in ("optimizer", "scheduler"):
        if key in ds_config:
            raise ConfigError(f"the DeepSpeed config sets {key!r}; the optimizer and schedule come from "
                              f"the command line (--lr, --adam-*, --lr-warmup-iters), remove it")
    ds_config.update({
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps(data_parallel_size),
        "train_batch_size": config.global_batch_size,
        "gradient_clipping": config.clip_grad,
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
    })
    # DeepSpeed's throughput timer (on by default) waits for the whole device at every micro batch's
    # forward and again in its step(), so the host cannot queue the next kernels while the GPU works:
    # two `get_accelerator().synchronize()` a micro batch once two steps have run. It only feeds
    # DeepSpeed's own samples/s line, which steps_per_print above silences; the Trainer times its
    # log intervals itself. A user's file may turn it back on.
    ds_config.setdefault("timers", {}).setdefault("throughput", {}).setdefault("enabled", False)
    zero = ds_config.setdefault("zero_optimization", {})
    zero["stage"] = config.zero_stage
    fp16 = ds_config.setdefault("fp16", {})
    bf16 = ds_config.setdefault("bf16", {})
    fp16["enabled"] = config.precision == "fp16"
    bf16["enabled"] = config.precision == "bf16"
    if bf16["enabled"] and config.zero_stage in FLAT_PARTITION_ZERO_STAGES:
        # DeepSpeed's ZeRO-1/2 scan for a non-finite gradient before each step launches 13 kernels
        # per gradient tensor and waits for the device twice (2,600 launches a step at base: on one
        # H200, pretrain's step took 3.3x the bare model's). bf16 needs no loss scaling, so the scan
        # only guards against NaN/inf; the Trainer watches the global gradient norm on the device
        # instead (training/nonfinite.py). A user's file may turn it back on.
        bf16.setdefault("check_grad_overflow", False)
    if config.zero_stage in FLAT_PARTITION_ZERO_STAGES and not _deepspeed_reads_its_norm(config, ds_config,
                                                                                      model_parallel):
        # DeepSpeed's ZeRO-1/2 norm is a cast and a norm per gradient tensor (406 launches a step at
        # base) and a Python loop over them; on the flat fp32 partitions AdamW steps it is one sum
        # of squares per parameter group (training/gradient_norm.py).
        zero.setdefault("compute_grad_norm", False)
    if zero.get("compute_grad_norm", True) is False and config.zero_stage in FLAT_PARTITION_ZERO_STAGES:
        if config.clip_grad > 0:
            raise ConfigError(f"the DeepSpeed config sets \"zero_optimization\": {{\"compute_grad_norm\": false}}, "
                              f"but --clip-grad {config.clip_grad} needs DeepSpeed's norm: remove one of them")
        if model_parallel:
            raise ConfigError("the DeepSpeed config sets \"zero_optimization\": {\"compute_grad_norm\": false}, "
                              "which leaves no gradient norm under tensor or pipeline parallelism: remove it")
    if config.zero_stage == 1:
        # ZeRO-1 reduces every gradient after the backward anyway; "contiguous_gradients" first copies
        # each one into a bucket buffer of reduce_bucket_size elements (1 GB in bf16 by default) and,
        # after the all-reduce, back into the partition: one more copy and Python pass per gradient
        # tensor (203 launches a step at base). Without it the bucket is flattened once. On one
        # H100, DeepSpeed's work after the backward was a third of pretrain's step (docs/gpu.md).
        # ZeRO-2 keeps DeepSpeed's default: there it bounds the fragmentation of partitioned gradients.
        zero.setdefault("contiguous_gradients", False)
    if fp16["enabled"]:
        fp16.setdefault("loss_scale", 0)  # 0 = dynamic
        fp16.setdefault("initial_scale_power", 16)
        fp16.setdefault("loss_scale_window", 1000)
        fp16.setdefault("hysteresis", 2)
        fp16.setdefault("min_loss_scale", 1)
    return ds_config


def zero0_mixed_precision_note(config: TrainingConfig) -> str | None:
    """A one-line note for fp16/bf16 at ZeRO-0, or None. DeepSpeed trains mixed precision at ZeRO-0
    with its unfused optimizer, a loop over every parameter tensor (base, bf16, seq 128: 7,307
    kernel launches a step against 2,017 at ZeRO-1, counted on the CPU), where ZeRO-1/2 work on
    flat partitions; the note says so rather than changing the stage a run (and its resume) has."""
    if config.precision == "fp32" or config.zero_stage != 0:
        return None
    return (f"note: --{config.precision} at ZeRO-0 runs DeepSpeed's per-parameter (unfused) optimizer, ~3.6x the "
            "kernel launches of ZeRO-1 per step at base (docs/gpu.md); --zero-stage 1 (or --deepspeed-config "
            f"ds_configs/{'bf16' if config.precision == 'bf16' else 'pretrain_base_v100'}.json) avoids it at "
            "any data-parallel size")


def check_precision_supported(precision: str) -> None:
    """Refuse fp16/bf16 up front where DeepSpeed's accelerator says the device lacks it (the same
    question DeepSpeed asks later, deep inside engine start-up), naming the flag and the way out."""
    if precision == "fp32":
        return
    import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = accelerator.is_fp16_supported() if precision == "fp16" else accelerator.is_bf16_supported()
    if not supported:
        other = "--bf16 or fp32" if precision == "fp16" else "--fp16 or fp32"
        raise ConfigError(f"--{precision}: DeepSpeed's {accelerator.device_name()} accelerator reports no {precision} "
                          f"support on this machine; use {other}")


def check_zero_with_pipeline(zero_stage: int, pipeline: bool) -> None:
    if pipeline and zero_stage > 1:
        raise ConfigError(
            f"ZeRO stage {zero_stage} cannot be combined with pipeline parallelism (DeepSpeed does not "
            "support it); use --zero-stage 0 or 1 with --pipeline-model-parallel-size > 1")
