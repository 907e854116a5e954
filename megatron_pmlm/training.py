"""The training loop on DeepSpeed: the paper's optimizer and schedule, checkpoints that resume
exactly, preemption by signal, and metrics to the console and TensorBoard.

DeepSpeed owns ZeRO, mixed precision, gradient accumulation, pipeline scheduling and the checkpoint
files; this module builds the optimizer and learning-rate schedule (UniLMv2 Table 7) and the
DeepSpeed config, and runs iterations of `gradient_accumulation_steps` micro batches.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from .config import ConfigError
from .layout import PMLMBatch
from .metrics import PMLM_METRICS, MetricSpec, MetricSums  # noqa: F401 (re-exported)

LATEST_FILE = "latest"
RUN_STATE_FILE = "run_state.json"


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
    """Linear warmup to `lr`, then linear decay to `min_lr` at `train_iters` (as a multiplier of lr)."""
    floor = config.min_lr / config.lr

    def multiplier(iteration: int) -> float:
        if iteration < config.lr_warmup_iters:
            return (iteration + 1) / config.lr_warmup_iters
        decay_iters = max(1, config.train_iters - config.lr_warmup_iters)
        progress = min(1.0, (iteration - config.lr_warmup_iters) / decay_iters)
        return floor + (1.0 - floor) * (1.0 - progress)

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
    a pipeline's tied copy of the word embedding once.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.norm_group = None  # set once the process groups exist; None: no norm
        self.tensor_parallel_rank = 0
        self.last_grad_norm: float | None = None
        self.max_grad_norm = 0.0
        """Clip to this norm (0: off) after measuring it, so the logged norm is the unclipped one."""

    @torch.no_grad()
    def step(self, closure=None):
        if self.norm_group is not None:
            squares = torch.zeros((), dtype=torch.float32)
            for group in self.param_groups:
                for param in group["params"]:
                    if param.grad is None or getattr(param, "ds_pipe_replicated", False):
                        continue
                    if self.tensor_parallel_rank == 0 or getattr(param, "tensor_model_parallel", False):
                        squares = squares + param.grad.detach().float().pow(2).sum().cpu()
            if dist.get_world_size(self.norm_group) > 1:
                squares = squares.to(_collective_device())
                dist.all_reduce(squares, group=self.norm_group)
            self.last_grad_norm = float(squares.sqrt())
            if self.max_grad_norm > 0:
                # torch.nn.utils.clip_grad_norm_'s rule, on the norm measured above.
                coefficient = min(1.0, self.max_grad_norm / (self.last_grad_norm + 1e-6))
                if coefficient < 1.0:
                    for group in self.param_groups:
                        for param in group["params"]:
                            if param.grad is not None:
                                param.grad.mul_(coefficient)
        return super().step(closure)


def read_deepspeed_config(path: str | None) -> dict[str, Any] | None:
    """The user's --deepspeed-config file (None without one); a missing or invalid file is named."""
    if not path:
        return None
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config not found: {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from None


def build_deepspeed_config(config: TrainingConfig, data_parallel_size: int,
                           base: dict[str, Any] | None = None) -> dict[str, Any]:
    """A user's DeepSpeed file (if any) with the command-line values written over it."""
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
    ds_config.setdefault("zero_optimization", {})["stage"] = config.zero_stage
    fp16 = ds_config.setdefault("fp16", {})
    bf16 = ds_config.setdefault("bf16", {})
    fp16["enabled"] = config.precision == "fp16"
    bf16["enabled"] = config.precision == "bf16"
    if fp16["enabled"]:
        fp16.setdefault("loss_scale", 0)  # 0 = dynamic
        fp16.setdefault("initial_scale_power", 16)
        fp16.setdefault("loss_scale_window", 1000)
        fp16.setdefault("hysteresis", 2)
        fp16.setdefault("min_loss_scale", 1)
    return ds_config


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class ExitSignal:
    """SIGTERM / SIGUSR1 (SLURM preemption, `scancel --signal`) ask the run to save and stop.

    One per process, installed as early as possible (`ExitSignal.install()` first thing in the
    entry point): a signal that arrives while the run is still starting is remembered, not fatal.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
    _instance: "ExitSignal | None" = None

    def __init__(self) -> None:
        self.received: int | None = None
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    @classmethod
    def install(cls) -> "ExitSignal":
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    def _handle(self, signum, frame) -> None:  # noqa: ARG002
        self.received = signum

    def any_rank_received(self) -> bool:
        """All ranks agree (one tiny all-reduce per iteration) so they save together."""
        flag = torch.tensor([1.0 if self.received is not None else 0.0])
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = flag.to(_collective_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())


def _collective_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def check_precision_supported(precision: str) -> None:
    """Refuse fp16/bf16 up front where DeepSpeed's accelerator says the device lacks it (the same
    question DeepSpeed asks later, deep inside engine start-up), naming the flag and the way out."""
    if precision == "fp32":
        return
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


class CheckpointError(RuntimeError):
    """A checkpoint to load is missing, incomplete or incompatible; the message says how to proceed."""


class Trainer:
    """Iterations of a PMLM model (plain or pipelined) under a DeepSpeed engine.

    `model` is a PMLMForPreTraining, or a deepspeed PipelineModule (then `pipeline=True`).
    """

    def __init__(self, model: nn.Module, config: TrainingConfig, data_parallel_size: int,
                 ds_config_base: dict[str, Any] | None = None, mpu: Any = None,
                 pipeline: bool = False, flops_per_token: float = 0.0,
                 tensorboard_dir: str | None = None, log: Callable[[str], None] | None = None,
                 run_args: dict[str, Any] | None = None, metrics: MetricSpec = PMLM_METRICS):
        import deepspeed

        self.config = config
        self.pipeline = pipeline
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.is_logging_rank = self.rank == self.world_size - 1  # holds the loss under pipelining
        self._log = log or print
        self.run_args = run_args or {}
        self.metrics = metrics
        self.flops_per_token = flops_per_token
        self.data_parallel_size = data_parallel_size
        self.tensor_parallel_size = mpu.get_model_parallel_world_size() if mpu else 1
        check_zero_with_pipeline(config.zero_stage, pipeline)
        self.ds_config = build_deepspeed_config(config, data_parallel_size, ds_config_base)
        if pipeline:
            # DeepSpeed can split stage-to-stage activations over the tensor-parallel group only when
            # the hidden state is the sole tensor needing a gradient; ours also sends the attention
            # bias (it carries the relative-position table's gradient), so send both whole.
            self.ds_config.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
        if config.zero_stage == 3 and hasattr(model, "cls"):
            # The tied softmax reads the embedding's weight outside the embedding module.
            deepspeed.zero.register_external_parameter(model.cls.predictions,
                                                       model.bert.embeddings.word_embeddings.weight)
        # DeepSpeed reports the gradient norm from its ZeRO, fp16 and bf16 optimizers (which
        # accept only the stock AdamW); in plain fp32 our AdamW measures it.
        tracks_norm = config.zero_stage == 0 and config.precision == "fp32"
        if tracks_norm:
            # DeepSpeed would clip before our optimizer sees the gradients (and not report the norm).
            self.ds_config["gradient_clipping"] = 0.0
        optimizer = (AdamW if tracks_norm else torch.optim.AdamW)(
            parameter_groups(model, config.weight_decay), lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
            mpu=None if pipeline else mpu)
        self._base_optimizer = optimizer
        if tracks_norm:
            # Squared gradients are summed over this model replica's ranks: its tensor-parallel
            # group, and under pipelining every stage of it.
            optimizer.norm_group = (self.engine.grid.get_model_parallel_group() if pipeline
                                    else mpu.get_model_parallel_group() if mpu else dist.group.WORLD)
            optimizer.tensor_parallel_rank = mpu.get_model_parallel_rank() if mpu else 0
            optimizer.max_grad_norm = config.clip_grad
        self.iteration = 0
        self.consumed_samples = 0
        self.history: list[dict[str, float]] = []
        self.exit_signal = ExitSignal.install()
        self.tensorboard = None
        if tensorboard_dir and self.is_logging_rank:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(log_dir=tensorboard_dir)

    # ---------------------------------------------------------------- steps
    @property
    def device(self) -> torch.device:
        return self.engine.device

    def log(self, message: str) -> None:
        if self.is_logging_rank:
            self._log(message)

    def train_step(self, batches: Iterator[PMLMBatch]) -> tuple[MetricSums, int]:
        """One optimizer step; returns the metric sums and the number of processed tokens."""
        self.engine.train()
        sums, tokens = MetricSums(self.metrics), 0
        if self.pipeline:
            counted = _CountingIterator(batches, self.device)
            self.engine.train_batch(data_iter=counted)
            for metrics in self.engine.module.pop_metrics():
                sums.add_tensor(metrics)
            tokens = counted.tokens
        else:
            for _ in range(self.engine.gradient_accumulation_steps()):
                batch = next(batches)
                tokens += batch.num_tokens()
                out = self.engine(*batch.to(self.device).as_tuple())
                self.engine.backward(out.loss)
                self.engine.step()
                sums.add_tensor(out.metrics())
        self.iteration += 1
        self.consumed_samples += self.config.global_batch_size
        return sums, tokens

    @torch.no_grad()
    def evaluate(self, batches: Iterator[PMLMBatch], num_batches: int) -> dict[str, float]:
        self.engine.eval()
        sums = MetricSums(self.metrics)
        if self.pipeline:
            for _ in range(max(1, num_batches // self.engine.gradient_accumulation_steps())):
                self.engine.eval_batch(data_iter=_CountingIterator(batches, self.device))
                for metrics in self.engine.module.pop_metrics():
                    sums.add_tensor(metrics)
        else:
            for _ in range(num_batches):
                out = self.engine(*next(batches).to(self.device).as_tuple())
                sums.add_tensor(out.metrics())
        return self._data_parallel_average(sums).averages()

    def _data_parallel_average(self, sums: MetricSums) -> MetricSums:
        """Sum the metric sums over all ranks holding losses, so logs describe the global batch."""
        if self.world_size == 1:
            return sums
        values = sums.values.float().to(_collective_device())
        dist.all_reduce(values)
        reduced = MetricSums(self.metrics)
        reduced.values = values.double().cpu()
        return reduced

    # ---------------------------------------------------------------- loop
    def train(self, train_batches: Iterator[PMLMBatch],
              valid_batches: Callable[[], Iterator[PMLMBatch]] | None = None,
              save_dir: str | None = None) -> list[dict[str, float]]:
        """Train to `train_iters` (or `exit_interval`, or a signal), logging, evaluating and saving."""
        config = self.config
        interval, interval_tokens = MetricSums(self.metrics), 0
        interval_start, interval_first = time.time(), self.iteration
        stop_reason = None
        if self.exit_signal.any_rank_received():
            # Signalled while starting: nothing new to save (the last checkpoint, if any, is current).
            self.log(f"received signal {self.exit_signal.received or 'on another rank'} before the first "
                     f"iteration: exiting at iteration {self.iteration} without training")
            return self.history
        while self.iteration < config.train_iters and stop_reason is None:
            sums, tokens = self.train_step(train_batches)
            interval.merge(sums)
            interval_tokens += tokens
            if self.iteration % config.log_interval == 0 or self.iteration == config.train_iters:
                self._log_interval(interval, interval_tokens, time.time() - interval_start,
                                   self.iteration - interval_first)
                interval, interval_tokens = MetricSums(self.metrics), 0
                interval_start, interval_first = time.time(), self.iteration
            if valid_batches is not None and config.eval_iters > 0 and (
                    self.iteration % config.eval_interval == 0 or self.iteration == config.train_iters):
                self._validate(valid_batches)
            if self.exit_signal.any_rank_received():
                stop_reason = "signal"
            elif config.exit_interval and self.iteration >= config.exit_interval:
                stop_reason = "exit-interval"
            if save_dir and (stop_reason or self.iteration == config.train_iters or (
                    config.save_interval and self.iteration % config.save_interval == 0)):
                self.save_checkpoint(save_dir)
        if stop_reason == "signal":
            self.log(f"received signal {self.exit_signal.received or 'on another rank'}: saved at "
                     f"iteration {self.iteration}, exiting")
        elif stop_reason == "exit-interval":
            self.log(f"--exit-interval {config.exit_interval} reached: saved at iteration {self.iteration}, exiting")
        if self.tensorboard:
            self.tensorboard.flush()
        return self.history

    def _log_interval(self, interval: MetricSums, tokens: int, elapsed: float, iterations: int) -> None:
        config = self.config
        averages = self._data_parallel_average(interval).averages()
        token_tensor = torch.tensor([float(tokens)])
        if self.world_size > 1:
            token_tensor = token_tensor.to(_collective_device())
            dist.all_reduce(token_tensor)
        # Every tensor-parallel rank counts the same batch, and under pipelining so do the first
        # and the last stage.
        replicas = self.tensor_parallel_size * (2 if self.pipeline and self.engine.num_stages > 1 else 1)
        tokens_total = float(token_tensor.item()) / replicas
        elapsed = max(elapsed, 1e-9)
        grad_norm = self.engine.get_global_grad_norm()
        if grad_norm is None:
            grad_norm = getattr(self._base_optimizer, "last_grad_norm", None)
        loss_scale = float(getattr(self.optimizer, "cur_scale", getattr(self.optimizer, "loss_scale", 1.0)) or 1.0)
        losses = averages  # the spec's losses, then its ratios (accuracies, per-kind losses)
        record = {
            "iteration": self.iteration,
            "consumed_samples": self.consumed_samples,
            "lr": self.scheduler.get_last_lr()[0],
            **losses,
            "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
            "loss_scale": loss_scale if config.precision == "fp16" else 1.0,
            "samples_per_sec": iterations * config.global_batch_size / elapsed,
            "tokens_per_sec": tokens_total / elapsed,
            "tflops_per_gpu": tokens_total * self.flops_per_token / elapsed / self.world_size / 1e12,
        }
        self.history.append(record)
        remaining = (config.train_iters - self.iteration) * elapsed / max(1, iterations)
        self.log(f"iteration {self.iteration:>8}/{config.train_iters} | consumed samples {self.consumed_samples} | "
                 f"lr {record['lr']:.3e} | " + "".join(f"{name} {value:.4f} | " for name, value in losses.items())
                 + f"grad norm {record['grad_norm']:.3f} | "
                 + (f"loss scale {record['loss_scale']:.0f} | " if config.precision == "fp16" else "")
                 + f"samples/s {record['samples_per_sec']:.1f} | tokens/s {record['tokens_per_sec']:.0f} | "
                 f"TFLOP/s/GPU {record['tflops_per_gpu']:.2f} | ETA {_format_seconds(remaining)}")
        if self.tensorboard:
            for key in (*losses, "lr", "grad_norm", "loss_scale", "samples_per_sec", "tokens_per_sec",
                        "tflops_per_gpu"):
                if math.isfinite(record[key]):
                    self.tensorboard.add_scalar(f"train/{key}", record[key], self.iteration)

    def _validate(self, valid_batches: Callable[[], Iterator[PMLMBatch]]) -> None:
        valid = self.evaluate(valid_batches(), self.config.eval_iters)
        self.history.append({"iteration": self.iteration, **{f"valid_{k}": v for k, v in valid.items()}})
        self.log(f"validation at iteration {self.iteration} | "
                 + " | ".join(f"{name} {value:.4f}" for name, value in valid.items()))
        if self.tensorboard:
            for key, value in valid.items():
                self.tensorboard.add_scalar(f"valid/{key}", value, self.iteration)

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir: str | os.PathLike) -> str:
        """DeepSpeed checkpoint + every rank's RNG state; 'latest' written only when all are done."""
        save_dir = Path(save_dir)
        tag = f"iter_{self.iteration:07d}"
        client_state = {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                        "training_config": asdict(self.config), "args": self.run_args,
                        "world_size": self.world_size, "data_parallel_size": self.data_parallel_size}
        self.engine.save_checkpoint(str(save_dir), tag=tag, client_state=client_state, save_latest=False)
        torch.save(rng_state(), save_dir / tag / f"rng_state_rank{self.rank:05d}.pt")
        if self.rank == 0:
            (save_dir / tag / RUN_STATE_FILE).write_text(json.dumps(client_state, indent=1, default=str))
        dist.barrier()
        if self.rank == 0:
            tmp = save_dir / f".{LATEST_FILE}.tmp"
            tmp.write_text(tag)
            os.replace(tmp, save_dir / LATEST_FILE)
        if self.rank == 0:
            self._delete_old_checkpoints(save_dir, tag)
        dist.barrier()
        self.log(f"saved checkpoint {save_dir / tag}")
        return tag

    def _delete_old_checkpoints(self, save_dir: Path, latest_tag: str) -> None:
        """Retention, run once `latest` names the new complete checkpoint: the newest
        `keep_last_checkpoints` stay, so do multiples of `keep_checkpoint_every`, never `latest`'s."""
        keep_last, keep_every = self.config.keep_last_checkpoints, self.config.keep_checkpoint_every
        if not keep_last:
            return
        import re
        import shutil

        complete = sorted((int(m.group(1)), p) for p in save_dir.iterdir()
                          if (m := re.fullmatch(r"iter_(\d+)", p.name)) and (p / RUN_STATE_FILE).is_file())
        for iteration, path in complete[:-keep_last]:
            if path.name == latest_tag or (keep_every and iteration % keep_every == 0):
                continue
            shutil.rmtree(path, ignore_errors=True)
            self.log(f"deleted old checkpoint {path} (--keep-last-checkpoints {keep_last})")

    def load_checkpoint(self, load_dir: str | os.PathLike,
                        expected_model_config: dict[str, Any] | None = None, finetune: bool = False) -> bool:
        """Resume from `load_dir`'s latest checkpoint; False if there is none yet (a fresh start).

        With `finetune` only the weights are taken: iteration, consumed samples, optimizer and
        schedule start afresh (a run starting from a converted BERT checkpoint, for instance).
        """
        load_dir = Path(load_dir)
        latest = load_dir / LATEST_FILE
        if not latest.is_file():
            # 'latest' is written once a save has completed on every rank: without it there is no
            # complete checkpoint (a first save cut short, e.g. by SIGKILL), so start from scratch.
            incomplete = sorted(p.name for p in load_dir.glob("iter_*")) if load_dir.is_dir() else []
            self.log(f"no complete checkpoint in {load_dir} yet: starting from scratch"
                     + (f" (ignoring incomplete {', '.join(incomplete)})" if incomplete else ""))
            return False
        tag = latest.read_text().strip()
        tag_dir = load_dir / tag
        run_state_file = tag_dir / RUN_STATE_FILE
        if not run_state_file.is_file():
            raise CheckpointError(f"{latest} names {tag!r} but {run_state_file} does not exist "
                                  "(an incomplete or foreign checkpoint)")
        saved = json.loads(run_state_file.read_text())
        saved_model = saved.get("args", {}).get("model_config")
        if expected_model_config and saved_model:
            # How attention is computed is not part of the model: a run may switch backends.
            differences = ", ".join(f"{k}: saved {saved_model.get(k)!r}, now {v!r}"
                                    for k, v in expected_model_config.items()
                                    if k != "attention_backend" and saved_model.get(k) != v)
            if differences:
                raise CheckpointError(f"{tag_dir} holds a different model ({differences})")
        if saved.get("args", {}).get("converted_from") and not finetune:
            raise CheckpointError(f"{tag_dir} was converted from {saved['args']['converted_from']} and holds "
                                  "weights only (no optimizer or schedule): load it with --finetune")
        if finetune:
            path, _ = self.engine.load_checkpoint(str(load_dir), tag=tag, load_module_only=True,
                                                  load_optimizer_states=False, load_lr_scheduler_states=False)
            if path is None:
                raise CheckpointError(f"DeepSpeed could not load {tag_dir}")
            self.log(f"loaded the weights of {tag_dir} (--finetune: iteration, optimizer and schedule start afresh)")
            return True
        if saved.get("data_parallel_size") != self.data_parallel_size and self.config.zero_stage > 0:
            raise CheckpointError(
                f"{tag_dir} was written with data-parallel size {saved.get('data_parallel_size')}, this run "
                f"has {self.data_parallel_size}; ZeRO-{self.config.zero_stage} optimizer partitions do not "
                f"reshape. Convert it with DeepSpeed's universal checkpoint tool (python -m "
                f"deepspeed.checkpoint.ds_to_universal --input_folder {tag_dir} --output_folder "
                f"{load_dir / (tag + '_universal')}) and load that with \"checkpoint\": "
                "{\"load_universal\": true} in the DeepSpeed config, or keep the data-parallel size")
        path, client_state = self.engine.load_checkpoint(str(load_dir), tag=tag)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load {tag_dir}")
        self.iteration = int(saved["iteration"])
        self.consumed_samples = int(saved["consumed_samples"])
        rng_file = tag_dir / f"rng_state_rank{self.rank:05d}.pt"
        if rng_file.is_file() and saved.get("world_size") == self.world_size:
            set_rng_state(torch.load(rng_file, weights_only=False))
        else:
            self.log(f"warning: no RNG state for rank {self.rank} in {tag_dir} (world size changed?): "
                     "dropout will not replay the uninterrupted run")
        self.log(f"resumed from {tag_dir}: iteration {self.iteration}, consumed samples {self.consumed_samples}")
        return True


class _CountingIterator:
    """Feeds a pipeline engine ((inputs...), label) tuples and counts the tokens it hands out."""

    def __init__(self, batches: Iterator[PMLMBatch], device: torch.device):
        self.batches, self.device, self.tokens = batches, device, 0

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.batches)
        self.tokens += batch.num_tokens()
        batch = batch.to(self.device)
        return batch.as_tuple(), batch.labels


def _format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
