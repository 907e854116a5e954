"""The training loop on DeepSpeed: optimizer and schedule of the paper, one engine step per iteration.

DeepSpeed owns the distributed set-up, ZeRO, mixed precision, gradient accumulation and
checkpoints; this module builds the optimizer and learning-rate schedule (UniLMv2 Table 7), the
DeepSpeed config, and runs iterations of `gradient_accumulation_steps` micro batches.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .config import ConfigError
from .layout import PMLMBatch
from .model import PMLMLosses

logger = logging.getLogger(__name__)


@dataclass
class TrainingConfig:
    """Optimisation settings; defaults are the paper's BASE recipe (SPEC §6)."""

    seq_length: int = 512
    micro_batch_size: int = 16
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
    seed: int = 1234
    log_interval: int = 100
    eval_interval: int = 1000
    eval_iters: int = 10

    def __post_init__(self) -> None:
        for name in ("seq_length", "micro_batch_size", "global_batch_size", "train_iters",
                     "log_interval", "eval_interval"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"training config: {name} must be positive, got {getattr(self, name)}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ConfigError(f"training config: need 0 <= min_lr <= lr and lr > 0, got lr={self.lr} min_lr={self.min_lr}")
        if self.lr_warmup_iters < 0:
            raise ConfigError(f"training config: lr_warmup_iters must be >= 0, got {self.lr_warmup_iters}")
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"training config: zero_stage must be 0, 1, 2 or 3, got {self.zero_stage}")

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


def build_deepspeed_config(config: TrainingConfig, data_parallel_size: int,
                           base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config: a user's file (if any) with the command-line values written over it."""
    ds_config = json.loads(json.dumps(base or {}))
    ds_config.update({
        "train_micro_batch_size_per_gpu": config.micro_batch_size,
        "gradient_accumulation_steps": config.gradient_accumulation_steps(data_parallel_size),
        "train_batch_size": config.global_batch_size,
        "gradient_clipping": config.clip_grad,
        "steps_per_print": 10**9,  # we log ourselves
        "wall_clock_breakdown": False,
    })
    ds_config.setdefault("zero_optimization", {})["stage"] = config.zero_stage
    return ds_config


def init_distributed(backend: str | None = None) -> None:
    """Initialise torch.distributed through DeepSpeed, filling the env of a lone process if needed."""
    import deepspeed

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return
    if "RANK" not in os.environ and "SLURM_PROCID" not in os.environ and "OMPI_COMM_WORLD_RANK" not in os.environ:
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    deepspeed.init_distributed(dist_backend=backend, verbose=False)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MetricSums:
    """Running sums of per-micro-batch losses and accuracy counts, averaged at log time."""

    def __init__(self) -> None:
        self.loss = self.loss_ae = self.loss_par = 0.0
        self.ae_correct = self.ae_count = 0
        self.micro_batches = 0

    def add(self, out: PMLMLosses) -> None:
        # One host sync per micro batch for logging; cheap next to the step itself.
        values = torch.stack([out.loss.detach().float(), out.loss_ae.detach().float(),
                              out.loss_par.detach().float(), out.ae_correct.float(),
                              out.ae_count.float()]).tolist()
        self.loss += values[0]
        self.loss_ae += values[1]
        self.loss_par += values[2]
        self.ae_correct += int(values[3])
        self.ae_count += int(values[4])
        self.micro_batches += 1

    def merge(self, other: "MetricSums") -> None:
        for key, value in vars(other).items():
            setattr(self, key, getattr(self, key) + value)

    def averages(self) -> dict[str, float]:
        n = max(1, self.micro_batches)
        return {"loss": self.loss / n, "loss_ae": self.loss_ae / n, "loss_par": self.loss_par / n,
                "mlm_acc": self.ae_correct / max(1, self.ae_count)}


class Trainer:
    """Runs `train_iters` iterations of a PMLM model under a DeepSpeed engine."""

    def __init__(self, model: nn.Module, config: TrainingConfig,
                 ds_config_base: dict[str, Any] | None = None,
                 log: Callable[[str], None] = print):
        import deepspeed

        init_distributed()
        self.config = config
        self.log = log
        world_size = torch.distributed.get_world_size()
        self.ds_config = build_deepspeed_config(config, world_size, ds_config_base)
        optimizer = torch.optim.AdamW(
            parameter_groups(model, config.weight_decay), lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config)
        self.iteration = 0
        self.history: list[dict[str, float]] = []

    @property
    def device(self) -> torch.device:
        return self.engine.device

    def train_step(self, batches: Iterator[PMLMBatch]) -> MetricSums:
        """One optimizer step over `gradient_accumulation_steps` micro batches."""
        self.engine.train()
        totals = MetricSums()
        for _ in range(self.engine.gradient_accumulation_steps()):
            batch = next(batches).to(self.device)
            out = self.engine(*batch.as_tuple())
            self.engine.backward(out.loss)
            self.engine.step()
            totals.add(out)
        self.iteration += 1
        return totals

    @torch.no_grad()
    def evaluate(self, batches: Iterator[PMLMBatch], num_batches: int) -> dict[str, float]:
        self.engine.eval()
        totals = MetricSums()
        for _ in range(num_batches):
            totals.add(self.engine(*next(batches).to(self.device).as_tuple()))
        return totals.averages()

    def train(self, train_batches: Iterator[PMLMBatch],
              valid_batches: Callable[[], Iterator[PMLMBatch]] | None = None) -> list[dict[str, float]]:
        """Train to `train_iters`, logging every `log_interval` and evaluating every `eval_interval`."""
        config = self.config
        interval = MetricSums()
        interval_start, interval_first_iteration = time.time(), self.iteration
        while self.iteration < config.train_iters:
            interval.merge(self.train_step(train_batches))
            if self.iteration % config.log_interval == 0 or self.iteration == config.train_iters:
                elapsed = time.time() - interval_start
                iterations = self.iteration - interval_first_iteration
                averages = interval.averages()
                record = {"iteration": self.iteration, "lr": self.scheduler.get_last_lr()[0],
                          "loss": averages["loss"], "loss_ae": averages["loss_ae"],
                          "loss_par": averages["loss_par"],
                          "mlm_acc": averages["mlm_acc"],
                          "samples_per_sec": iterations * config.global_batch_size / max(elapsed, 1e-9)}
                self.history.append(record)
                remaining = (config.train_iters - self.iteration) * elapsed / max(1, iterations)
                self.log(f"iteration {self.iteration:>7}/{config.train_iters} | lr {record['lr']:.3e} | "
                         f"loss {record['loss']:.4f} | loss_ae {record['loss_ae']:.4f} | "
                         f"loss_par {record['loss_par']:.4f} | samples/s {record['samples_per_sec']:.1f} | "
                         f"ETA {_format_seconds(remaining)}")
                interval = MetricSums()
                interval_start, interval_first_iteration = time.time(), self.iteration
            if valid_batches is not None and (self.iteration % config.eval_interval == 0
                                              or self.iteration == config.train_iters):
                valid = self.evaluate(valid_batches(), config.eval_iters)
                self.history.append({"iteration": self.iteration,
                                     **{f"valid_{k}": v for k, v in valid.items()}})
                self.log(f"validation at iteration {self.iteration} | loss {valid['loss']:.4f} | "
                         f"loss_ae {valid['loss_ae']:.4f} | loss_par {valid['loss_par']:.4f} | "
                         f"mlm_acc {valid['mlm_acc']:.4f}")
        return self.history

    def save_checkpoint(self, save_dir: str | Path, client_state: dict[str, Any] | None = None) -> None:
        state = {"iteration": self.iteration, "training_config": asdict(self.config)}
        state.update(client_state or {})
        self.engine.save_checkpoint(str(save_dir), tag=f"iter_{self.iteration:07d}", client_state=state)


def _format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
