"""The training loop on DeepSpeed: the paper's optimizer and schedule, checkpoints that resume
exactly, preemption by signal, and metrics to the console, TensorBoard, W&B and MLflow (tracking.py).

DeepSpeed owns ZeRO, mixed precision, gradient accumulation, pipeline scheduling and the checkpoint
files; the optimizer, learning-rate schedule (UniLMv2 Table 7) and DeepSpeed config are built from
training_config.py, and this module runs iterations of `gradient_accumulation_steps` micro batches.

Between two log lines nothing of ours waits for the device (tests/test_sync_free_step.py counts it):
batches arrive on the device through a `DevicePrefetcher` with their token counts taken on the
host, metric sums accumulate on the device and are read once per log line, and the per-iteration
signal agreement runs over a CPU group.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..config import ConfigError
from ..data.loader import DevicePrefetcher
from ..files import write_text_atomically
from ..models.layout import PMLMBatch
from ..models.metrics import PMLM_METRICS, MetricSpec, MetricSums
from ..parallel.distributed import collective_device
from ..parallel.deepspeed_import import import_deepspeed
from .checkpoint_files import (LATEST_FILE, RUN_STATE_FILE, UNIVERSAL_SUFFIX, CheckpointError, checkpoint_dirs,
                               checkpoint_listing, checksum_share, file_checksums, manifest,
                               newest_verified_checkpoint)
from . import heartbeat
from .exit_signal import ExitSignal, signal_text
from .preflight import check_resumed_settings
from .run_identity import IDENTITY_KEY, identity_lines, run_identity
from .tracking import Tracking, TrackingConfig, read_run_ids
from .relayout import RESHARDED_ZERO_STAGES, layout_name, relayout_tag, relayout_to_universal, saved_layout
from .nonfinite import GradientNormWatch
from .gradient_norm import PartitionGradientNorm
from .training_config import (TrainingConfig, AdamW, adamw_options, build_deepspeed_config, check_zero_with_pipeline,
                              gradient_scan_off, lr_lambda, parameter_groups, partition_norm_measured_here)
from .universal_checkpoint import convert_to_universal, universal_checkpoint_info


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


RUNTIME_MODEL_FIELDS = ("attention_backend", "hidden_dropout", "attention_dropout")
"""ModelConfig fields a resumed or fine-tuning run may change: they choose kernels and training
noise, not the weights' shapes or meaning."""


class Trainer:
    """Iterations of a PMLM model (plain or pipelined) under a DeepSpeed engine.

    `model` is a PMLMForPreTraining, or a deepspeed PipelineModule (then `pipeline=True`).
    """

    def __init__(self, model: nn.Module, config: TrainingConfig, data_parallel_size: int,
                 ds_config_base: dict[str, Any] | None = None, mpu: Any = None,
                 pipeline: bool = False, flops_per_token: float = 0.0,
                 tensorboard_dir: str | None = None, log: Callable[[str], None] | None = None,
                 run_args: dict[str, Any] | None = None, metrics: MetricSpec = PMLM_METRICS,
                 universal_checkpoint: bool = False, history_path: str | os.PathLike | None = None,
                 tracking: TrackingConfig | None = None):
        deepspeed = import_deepspeed()

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
        self.pipeline_parallel_size = mpu.get_pipeline_model_parallel_world_size() if mpu else 1
        self.universal_checkpoint = universal_checkpoint
        check_zero_with_pipeline(config.zero_stage, pipeline)
        self.ds_config = build_deepspeed_config(
            config, data_parallel_size, ds_config_base,
            model_parallel=self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1 or pipeline)
        if universal_checkpoint:
            if config.zero_stage == 0:
                raise ConfigError("--universal-checkpoint restores into ZeRO's partitioned optimizer: use "
                                  "--zero-stage 1, 2 or 3")
            self.ds_config.setdefault("checkpoint", {})["load_universal"] = True
        if pipeline:
            # DeepSpeed can split stage-to-stage activations over the tensor-parallel group only when
            # the hidden state is the sole tensor needing a gradient; ours also sends the attention
            # bias (it carries the relative-position table's gradient), so send both whole.
            self.ds_config.setdefault("pipeline", {}).update(pipe_partitioned=False, grad_partitioned=False)
        if config.zero_stage == 3:
            # Modules reading a parameter another module owns (tied weights), as the model lists them.
            for module, parameter in getattr(model, "zero3_external_parameters", list)():
                deepspeed.zero.register_external_parameter(module, parameter)
        # DeepSpeed reports the gradient norm from its ZeRO, fp16 and bf16 optimizers (which
        # accept only the stock AdamW); in plain fp32 our AdamW measures it.
        tracks_norm = config.zero_stage == 0 and config.precision == "fp32"
        if tracks_norm:
            # DeepSpeed would clip before our optimizer sees the gradients (and not report the norm).
            self.ds_config["gradient_clipping"] = 0.0
        from deepspeed.accelerator import get_accelerator

        device_type = get_accelerator().device_name()
        if device_type == "cuda":
            # A fused optimizer checks its parameters' device when it is built: move first (DeepSpeed
            # would move the model in initialize anyway).
            model.to(get_accelerator().current_device_name())
        optimizer = (AdamW if tracks_norm else torch.optim.AdamW)(
            parameter_groups(model, config.weight_decay), lr=config.lr,
            betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps, **adamw_options(device_type))
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
            mpu=None if pipeline else mpu)
        self._base_optimizer = optimizer
        # ZeRO-1/2 without DeepSpeed's per-tensor norm: measured on the flat partitions AdamW steps.
        self.partition_norm = (PartitionGradientNorm(optimizer, mpu.get_data_parallel_group() if mpu else None)
                               if partition_norm_measured_here(config, self.ds_config) else None)
        # bf16 under ZeRO-1/2 without DeepSpeed's per-step scan: its gradient norm watched instead.
        self.gradient_norm_watch = GradientNormWatch(self.device) if gradient_scan_off(config, self.ds_config) else None
        if tracks_norm:
            # Squared gradients are summed over this model replica's ranks: its tensor-parallel
            # group, and under pipelining every stage of it.
            optimizer.norm_group = (self.engine.grid.get_model_parallel_group() if pipeline
                                    else mpu.get_model_parallel_group() if mpu else dist.group.WORLD)
            optimizer.tensor_parallel_rank = mpu.get_model_parallel_rank() if mpu else 0
            optimizer.max_grad_norm = config.clip_grad
        self.iteration = 0
        self.consumed_samples = 0
        self.consumed_tokens = 0
        self.history: list[dict[str, float]] = []
        self.history_path = Path(history_path) if history_path else None
        self.exit_signal = ExitSignal.install()
        if self.world_size > 1:
            self.exit_signal.agreement_group()  # made here, on every rank at the same point
        self.stop_signal: int | None = None
        """The signal that stopped `train` (None: it ran to the end, or to --exit-interval)."""
        # What produced the run: into every checkpoint's run state (rank 0) and the logs, W&B, MLflow
        # (the logging rank).
        self.identity = run_identity(self.run_args, asdict(config), self.ds_config, self.world_size) \
            if self.rank == 0 or self.is_logging_rank else {}
        for line in identity_lines(self.identity) if self.is_logging_rank else ():
            self.log(line)
        self.tracking_config = tracking or TrackingConfig()
        self.tracking = Tracking(self._log)
        """TensorBoard (from here on), W&B and MLflow (from `train`, once a resume knows its iteration)."""
        self.tracking_run_ids: dict[str, str] = {}
        """The W&B / MLflow run ids (every rank), saved in the run state so a resume continues them."""
        self._resumed_tracking_ids: dict[str, str] = {}
        if tensorboard_dir and self.is_logging_rank:
            self.tracking.add_tensorboard(tensorboard_dir)

    @property
    def exit_status(self) -> int:
        """What the entry point exits with after `train`: 130 (128 + SIGINT, as a shell reports an
        interrupted command) when Ctrl-C stopped it; 0 otherwise, also after SIGTERM/SIGUSR1 (a
        saved stop that SLURM's requeue logic expects to succeed)."""
        return 128 + signal.SIGINT if self.stop_signal == signal.SIGINT else 0

    # ---------------------------------------------------------------- steps
    @property
    def device(self) -> torch.device:
        return self.engine.device

    def log(self, message: str) -> None:
        if self.is_logging_rank:
            self._log(message)

    def train_step(self, batches: Iterator[PMLMBatch]) -> tuple[MetricSums, int]:
        """One optimizer step; returns the metric sums (on the device) and the number of processed
        tokens. `batches`: a DevicePrefetcher (what `train` passes), or any iterator of batches."""
        if not isinstance(batches, DevicePrefetcher):
            batches = DevicePrefetcher(batches, self.device, background=False)
        self.engine.train()
        sums, tokens_before = MetricSums(self.metrics, self.device), batches.tokens
        if self.pipeline:
            self.engine.train_batch(data_iter=_PipelineInputs(batches))
            for metrics in self.engine.module.end_batch():
                sums.add_tensor(metrics)
        else:
            for _ in range(self.engine.gradient_accumulation_steps()):
                out = self.engine(*next(batches).as_tuple())
                self.engine.backward(out.loss)
                self.engine.step()
                sums.add_tensor(out.metrics())
        self.iteration += 1
        if self.gradient_norm_watch is not None:
            self.gradient_norm_watch.record(self.global_grad_norm(), self.iteration)
        self.consumed_samples += self.config.global_batch_size
        return sums, batches.tokens - tokens_before

    def global_grad_norm(self) -> torch.Tensor | float | None:
        """The last step's global gradient norm, from whoever measured it: DeepSpeed's ZeRO, fp16 and
        bf16 optimizers, else `partition_norm` (ZeRO-1/2 with DeepSpeed's off), else our AdamW (fp32
        at ZeRO-0). A device tensor or a number; None before the first step."""
        norm = self.engine.get_global_grad_norm()
        if norm is None and self.partition_norm is not None:
            norm = self.partition_norm.norm
        if norm is None:
            norm = getattr(self._base_optimizer, "last_grad_norm_tensor", None)
        return norm

    @torch.no_grad()
    def evaluate(self, batches: Iterator[PMLMBatch], num_batches: int) -> dict[str, float]:
        self.engine.eval()
        sums = MetricSums(self.metrics, self.device)
        with DevicePrefetcher(batches, self.device) as prefetched:
            if self.pipeline:
                for _ in range(max(1, num_batches // self.engine.gradient_accumulation_steps())):
                    heartbeat.beat("validation", self.iteration)
                    self.engine.eval_batch(data_iter=_PipelineInputs(prefetched))
                    for metrics in self.engine.module.end_batch():
                        sums.add_tensor(metrics)
            else:
                for _ in range(num_batches):
                    heartbeat.beat("validation", self.iteration)
                    out = self.engine(*next(prefetched).as_tuple())
                    sums.add_tensor(out.metrics())
        return self._data_parallel_average(sums).averages()

    def _data_parallel_average(self, sums: MetricSums) -> MetricSums:
        """Sum the metric sums over all ranks holding losses, so logs describe the global batch
        (in float32, as always); the result stays where the collective ran."""
        if self.world_size == 1:
            return sums
        values = sums.values.float().to(collective_device())
        dist.all_reduce(values)
        reduced = MetricSums(self.metrics, values.device)
        reduced.values = values.double()
        return reduced

    # ---------------------------------------------------------------- loop
    def train(self, train_batches: Iterator[PMLMBatch],
              valid_batches: Callable[[], Iterator[PMLMBatch]] | None = None,
              save_dir: str | None = None) -> list[dict[str, float]]:
        """Train to `train_iters` (or `exit_interval`, or a signal), logging, evaluating and saving."""
        config = self.config
        if self.exit_signal.any_rank_received():
            # Signalled while starting: nothing new to save (the last checkpoint, if any, is current).
            self.stop_signal = self.exit_signal.agreed
            self.log(f"received signal {signal_text(self.exit_signal.received)} before the first "
                     f"iteration: exiting at iteration {self.iteration} without training")
            self.tracking.close()
            return self.history
        finished = False
        try:
            self._start_tracking(save_dir)
            # The prefetch thread ends on every way out of the loop (an error, Ctrl-C twice included).
            with DevicePrefetcher(train_batches, self.device) as batches:
                stop_reason = self._iterations(batches, valid_batches, save_dir)
            finished = True
        finally:
            # Every run closed on every way out (W&B finished, MLflow terminated; FAILED after an error).
            self.tracking.close(succeeded=finished)
        if stop_reason == "signal":
            self.log(f"received signal {signal_text(self.exit_signal.received)}: "
                     + (f"saved at iteration {self.iteration}" if save_dir else
                        f"stopped at iteration {self.iteration} (no --save: nothing saved)")
                     + (f", exiting with status {self.exit_status}" if self.exit_status else ", exiting"))
        elif stop_reason == "exit-interval":
            self.log(f"--exit-interval {config.exit_interval} reached: saved at iteration {self.iteration}, exiting")
        return self.history

    def _iterations(self, batches: DevicePrefetcher, valid_batches: Callable[[], Iterator[PMLMBatch]] | None,
                    save_dir: str | None) -> str | None:
        """The loop of `train`; returns why it stopped early ("signal", "exit-interval") or None."""
        config = self.config
        interval, interval_tokens = MetricSums(self.metrics, self.device), 0
        interval_start, interval_first = time.time(), self.iteration
        stop_reason = None
        while self.iteration < config.train_iters and stop_reason is None:
            heartbeat.beat(f"step {self.iteration + 1}", self.iteration + 1)
            sums, tokens = self.train_step(batches)
            interval.merge(sums)
            interval_tokens += tokens
            if self.iteration % config.log_interval == 0 or self.iteration == config.train_iters:
                self._log_interval(interval, interval_tokens, time.time() - interval_start,
                                   self.iteration - interval_first)
                interval, interval_tokens = MetricSums(self.metrics, self.device), 0
                interval_start, interval_first = time.time(), self.iteration
            if valid_batches is not None and config.eval_iters > 0 and (
                    self.iteration % config.eval_interval == 0 or self.iteration == config.train_iters):
                self._validate(valid_batches)
            if self.exit_signal.any_rank_received():
                stop_reason = "signal"
                self.stop_signal = self.exit_signal.agreed
            elif config.exit_interval and self.iteration >= config.exit_interval:
                stop_reason = "exit-interval"
            if save_dir and (stop_reason or self.iteration == config.train_iters or (
                    config.save_interval and self.iteration % config.save_interval == 0)):
                self.save_checkpoint(save_dir)
        return stop_reason

    def _log_interval(self, interval: MetricSums, tokens: int, elapsed: float, iterations: int) -> None:
        config = self.config
        if self.gradient_norm_watch is not None:
            self.gradient_norm_watch.check(self.iteration, "the log line")
        averages = self._data_parallel_average(interval).averages()
        token_tensor = torch.tensor([float(tokens)])
        if self.world_size > 1:
            token_tensor = token_tensor.to(collective_device())
            dist.all_reduce(token_tensor)
        # Every tensor-parallel rank counts the same batch, and under pipelining so do the first
        # and the last stage.
        replicas = self.tensor_parallel_size * (2 if self.pipeline and self.engine.num_stages > 1 else 1)
        tokens_total = float(token_tensor.item()) / replicas
        self.consumed_tokens += int(tokens_total)
        elapsed = max(elapsed, 1e-9)
        grad_norm = self.global_grad_norm()
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
            "consumed_tokens": self.consumed_tokens,
            "skipped_iterations": int(getattr(self.engine, "skipped_steps", 0) or 0),
        }
        if torch.cuda.is_available():
            record["memory_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
            record["memory_reserved_gb"] = torch.cuda.max_memory_reserved() / 2**30
        self.history.append(record)
        remaining = (config.train_iters - self.iteration) * elapsed / max(1, iterations)
        self.log(f"iteration {self.iteration:>8}/{config.train_iters} | consumed samples {self.consumed_samples} | "
                 f"lr {record['lr']:.3e} | " + "".join(f"{name} {value:.4f} | " for name, value in losses.items())
                 + f"grad norm {record['grad_norm']:.3f} | "
                 + (f"loss scale {record['loss_scale']:.0f} | " if config.precision == "fp16" else "")
                 + f"samples/s {record['samples_per_sec']:.1f} | tokens/s {record['tokens_per_sec']:.0f} | "
                 f"TFLOP/s/GPU {record['tflops_per_gpu']:.2f} | ETA {_format_seconds(remaining)}")
        self._write_history()
        # TensorBoard, W&B and MLflow get the same scalars (the finite ones), after the history file:
        # a tracker is never ahead of it.
        self.tracking.log({f"train/{key}": record[key] for key in (
            *losses, "lr", "grad_norm", "loss_scale", "samples_per_sec", "tokens_per_sec", "tflops_per_gpu",
            "consumed_tokens", "skipped_iterations", "memory_allocated_gb", "memory_reserved_gb") if key in record},
            self.iteration)

    def _continue_history(self) -> None:
        """Resuming into the same --history-json: keep its records up to the checkpoint (later ones
        are about to be redone), so the file reads as one run."""
        if self.history_path is None or not self.history_path.is_file():
            return
        try:
            records = json.loads(self.history_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            self.log(f"warning: {self.history_path} is not valid JSON: starting it afresh")
            return
        self.history = [r for r in records if isinstance(r, dict) and r.get("iteration", 0) <= self.iteration]

    def _write_history(self) -> None:
        """The whole history so far, rewritten at every log interval: a crash loses nothing logged."""
        if self.history_path is not None and self.is_logging_rank:
            write_text_atomically(self.history_path, json.dumps(self.history, indent=1))

    def _validate(self, valid_batches: Callable[[], Iterator[PMLMBatch]]) -> None:
        valid = self.evaluate(valid_batches(), self.config.eval_iters)
        self.history.append({"iteration": self.iteration, **{f"valid_{k}": v for k, v in valid.items()}})
        self.log(f"validation at iteration {self.iteration} | "
                 + " | ".join(f"{name} {value:.4f}" for name, value in valid.items()))
        self._write_history()
        self.tracking.log({f"valid/{key}": value for key, value in valid.items()}, self.iteration)

    def _start_tracking(self, save_dir: str | None) -> None:
        """Start the W&B / MLflow runs on the logging rank, or continue those of the checkpoint
        resumed from (else of the save folder: a run that crashed before its first checkpoint);
        every rank learns their ids (rank 0 saves the run state)."""
        if not self.tracking_config.enabled:
            return
        ids: dict[str, str] = {}
        if self.is_logging_rank:
            resume_ids = self._resumed_tracking_ids or read_run_ids(save_dir)
            ids = self.tracking.start_runs(self.tracking_config, self.identity, resume_ids, self.iteration, save_dir)
        if self.world_size > 1:
            shared = [ids]
            dist.broadcast_object_list(shared, src=self.world_size - 1, device=collective_device())
            ids = shared[0]
        self.tracking_run_ids = ids

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir: str | os.PathLike) -> str:
        """DeepSpeed checkpoint + every rank's RNG state, then (rank 0, once every rank is done) the
        run state with a manifest of every file, its size and checksum, then `latest`: a checkpoint
        is complete exactly when its manifest matches the files (see `checkpoint_problem`)."""
        if self.gradient_norm_watch is not None:
            self.gradient_norm_watch.check(self.iteration, "saving a checkpoint")
        save_dir = Path(save_dir)
        tag = f"iter_{self.iteration:07d}"
        heartbeat.beat(f"saving {tag}", self.iteration)
        client_state = {"iteration": self.iteration, "consumed_samples": self.consumed_samples,
                        "consumed_tokens": self.consumed_tokens, "training_config": asdict(self.config), "args": self.run_args,
                        "world_size": self.world_size, "data_parallel_size": self.data_parallel_size,
                        "tracking": self.tracking_run_ids}
        model_config = self.run_args.get("model_config") or {}
        embedding_rows = model_config.get("padded_vocab_size") or model_config.get("vocab_size")
        parameter_names = [name for name, _ in self.engine.module.named_parameters()]
        extra_state = {"universal_checkpoint_info": universal_checkpoint_info(int(embedding_rows), parameter_names)} \
            if embedding_rows else {}
        if self.rank == 0:
            import shutil

            if (save_dir / tag).exists():
                # Left by a save that never completed (or a run that fell back past it): start clean.
                shutil.rmtree(save_dir / tag)
                self._log(f"deleted {save_dir / tag}, left by an earlier save of iteration {self.iteration} "
                          "that never completed, before saving it again")
            # Universal conversions of an earlier checkpoint of this iteration would pass for the new one's.
            for conversion in save_dir.glob(f"{tag}{UNIVERSAL_SUFFIX}*"):
                shutil.rmtree(conversion, ignore_errors=True)
        dist.barrier()
        # Each file DeepSpeed writes is progress (so is each file hashed, checkpoint_files.file_checksums).
        with heartbeat.beat_after_each_call(getattr(self.engine, "checkpoint_engine", None), "save",
                                            f"saving {tag}: DeepSpeed files"):
            self.engine.save_checkpoint(str(save_dir), tag=tag, client_state={**client_state, **extra_state},
                                        save_latest=False)
        torch.save(rng_state(), save_dir / tag / f"rng_state_rank{self.rank:05d}.pt")
        heartbeat.beat(f"saving {tag}: checksums")
        dist.barrier()
        files = self._checksum_files(save_dir / tag)
        heartbeat.beat(f"saving {tag}: manifest")
        if self.rank == 0:
            tag_dir = save_dir / tag
            write_text_atomically(tag_dir / RUN_STATE_FILE,
                                  json.dumps({**client_state, IDENTITY_KEY: self.identity, **manifest(files)},
                                             indent=1, default=str))
            write_text_atomically(save_dir / LATEST_FILE, tag)
            self._delete_old_checkpoints(save_dir, tag)
        dist.barrier()
        self.log(f"saved checkpoint {save_dir / tag}")
        return tag

    def _checksum_files(self, tag_dir: Path) -> dict[str, tuple[int, str]]:
        """{name: (size, checksum)} of every file of a saved checkpoint (for rank 0; {} elsewhere):
        each rank hashes a share (rank 0 lists the files for all), so the save waits about as
        long as hashing the largest file takes."""
        listing = [checkpoint_listing(tag_dir) if self.rank == 0 else None]
        if self.world_size == 1:
            return file_checksums(tag_dir, listing[0])
        dist.broadcast_object_list(listing, src=0, device=collective_device())
        shares: list[dict[str, tuple[int, str]] | None] = [None] * self.world_size
        mine = checksum_share(listing[0], self.rank, self.world_size)
        dist.all_gather_object(shares, file_checksums(tag_dir, mine))
        return {name: entry for share in shares for name, entry in share.items()} if self.rank == 0 else {}

    def _newest_verified_checkpoint(self, load_dir: Path) -> tuple[str | None, list[str]]:
        """`newest_verified_checkpoint` (what every reader of a checkpoint uses), run on rank 0 only
        (not once per rank over a shared file system); every rank gets its answer."""
        answer = [None]
        if self.rank == 0:
            answer = [newest_verified_checkpoint(load_dir)]
        if self.world_size > 1:
            dist.broadcast_object_list(answer, src=0, device=collective_device())
        tag, skipped, note = answer[0]
        if note:
            self.log(note)
        return tag, skipped

    def _delete_old_checkpoints(self, save_dir: Path, latest_tag: str) -> None:
        """Retention, run once `latest` names the new complete checkpoint: the newest
        `keep_last_checkpoints` stay, so do multiples of `keep_checkpoint_every`, never `latest`'s.
        A checkpoint's universal conversion goes with it."""
        keep_last, keep_every = self.config.keep_last_checkpoints, self.config.keep_checkpoint_every
        if not keep_last:
            return
        import shutil

        complete = [(iteration, path) for iteration, path in checkpoint_dirs(save_dir)
                    if (path / RUN_STATE_FILE).is_file()]
        for iteration, path in sorted(complete)[:-keep_last]:
            if path.name == latest_tag or (keep_every and iteration % keep_every == 0):
                continue
            conversions = sorted(path.parent.glob(f"{path.name}{UNIVERSAL_SUFFIX}*"))
            with_universal = f" and its universal conversion {', '.join(c.name for c in conversions)}" \
                if conversions else ""
            for conversion in conversions:
                shutil.rmtree(conversion, ignore_errors=True)
            shutil.rmtree(path, ignore_errors=True)
            # Rank 0 deletes, so rank 0 says so (self.log speaks from the last rank only).
            self._log(f"deleted old checkpoint {path}{with_universal} (--keep-last-checkpoints {keep_last}"
                      + (f", --keep-checkpoint-every {keep_every}" if keep_every else "") + ")")

    def load_checkpoint(self, load_dir: str | os.PathLike,
                        expected_model_config: dict[str, Any] | None = None, finetune: bool = False) -> bool:
        """Resume from `load_dir`'s newest complete checkpoint; False if there is none yet (a fresh start).

        With `finetune` only the weights are taken: iteration, consumed samples, optimizer and
        schedule start afresh (a run starting from a converted BERT checkpoint, for instance).
        With `universal_checkpoint` (set at construction) the checkpoint is converted to DeepSpeed's
        universal format (once, next to it) and loaded from there, on any data-parallel size.
        """
        load_dir = Path(load_dir)
        tag, skipped = self._newest_verified_checkpoint(load_dir)
        for note in skipped:
            self.log(f"warning: skipping {note}")
        if tag is None:
            if (load_dir / LATEST_FILE).is_file():
                raise CheckpointError(f"{load_dir / LATEST_FILE} exists but no checkpoint in {load_dir} is complete "
                                      f"({'; '.join(skipped) or 'none found'}); refusing to start from scratch over it")
            # Without `latest` no save ever completed (a first save cut short, e.g. by SIGKILL).
            self.log(f"no complete checkpoint in {load_dir} yet: starting from scratch"
                     + (f" (ignoring incomplete {', '.join(n.split(':')[0] for n in skipped)})" if skipped else ""))
            return False
        tag_dir = load_dir / tag
        saved = json.loads((tag_dir / RUN_STATE_FILE).read_text())
        saved_model = saved.get("args", {}).get("model_config")
        relayout = self.universal_checkpoint and not finetune and \
            saved_layout(saved) != (self.tensor_parallel_size, self.pipeline_parallel_size)
        if expected_model_config and saved_model:
            # The attention backend and dropout are how the model is trained, not what it is: a run
            # may switch them on resume (and checkpoints written before the backend existed do not name it).
            # The vocabulary padding follows the tensor-parallel size, which a re-sharding resume changes.
            runtime_fields = RUNTIME_MODEL_FIELDS + (("padded_vocab_size",) if relayout else ())
            differences = ", ".join(f"{k}: saved {saved_model.get(k)!r}, now {v!r}"
                                    for k, v in expected_model_config.items()
                                    if k not in runtime_fields and saved_model.get(k) != v)
            if differences:
                raise CheckpointError(f"{tag_dir} holds a different model ({differences})")
        if saved.get("args", {}).get("converted_from") and not finetune:
            raise CheckpointError(f"{tag_dir} was converted from {saved['args']['converted_from']} and holds "
                                  "weights only (no optimizer or schedule): load it with --finetune")
        check_resumed_settings(tag_dir, saved, self.run_args, asdict(self.config), finetune, self.log, relayout)
        if finetune:
            with torch.no_grad():  # see below
                path, _ = self.engine.load_checkpoint(str(load_dir), tag=tag, load_module_only=True,
                                                      load_optimizer_states=False, load_lr_scheduler_states=False)
            if path is None:
                raise CheckpointError(f"DeepSpeed could not load {tag_dir}")
            self.log(f"loaded the weights of {tag_dir} (--finetune: iteration, optimizer and schedule start afresh)")
            return True
        saved_zero_stage = int(saved.get("training_config", {}).get("zero_stage", 0))
        if self.universal_checkpoint:
            load_tag = self._universal_tag(tag_dir, saved, saved_zero_stage, relayout)
        else:
            load_tag = tag
            if saved.get("data_parallel_size") != self.data_parallel_size and saved_zero_stage > 0:
                raise CheckpointError(
                    f"{tag_dir} was written with data-parallel size {saved.get('data_parallel_size')}, this run "
                    f"has {self.data_parallel_size}; ZeRO-{saved_zero_stage} optimizer partitions do not reshape "
                    "as they are: add --universal-checkpoint (converts it to DeepSpeed's universal format next to "
                    "it, then loads that), or keep the data-parallel size")
        # Without grad: a pipeline re-broadcasts its tied word embedding after loading, and an in-place
        # collective on a parameter under grad mode leaves autograd's "not implemented" warning hook on it.
        with torch.no_grad():
            path, _ = self.engine.load_checkpoint(str(load_dir), tag=load_tag)
        if path is None:
            raise CheckpointError(f"DeepSpeed could not load {load_dir / load_tag}")
        self.iteration = int(saved["iteration"])
        self._resumed_tracking_ids = saved.get("tracking") or {}
        self.consumed_samples = int(saved["consumed_samples"])
        self.consumed_tokens = int(saved.get("consumed_tokens", 0))
        self._continue_history()
        rng_file = tag_dir / f"rng_state_rank{self.rank:05d}.pt"
        if rng_file.is_file() and saved.get("world_size") == self.world_size and not relayout:
            set_rng_state(torch.load(rng_file, weights_only=False))
        elif saved.get("world_size") != self.world_size or relayout:
            then_dp = saved.get("data_parallel_size")
            change = (f"the layout changed ({layout_name(*saved_layout(saved))} then, "
                      f"{layout_name(self.tensor_parallel_size, self.pipeline_parallel_size)} now)" if relayout else
                      f"the data-parallel size changed ({then_dp} then, {self.data_parallel_size} now)"
                      if then_dp is not None and then_dp != self.data_parallel_size else
                      f"the world size changed ({saved.get('world_size')} then, {self.world_size} now)")
            self.log(f"note: the RNG states are not restored because {change}: each rank's state belongs to "
                     "its old rank; dropout will not replay the uninterrupted run")
        else:
            self.log(f"warning: no RNG state for rank {self.rank} in {tag_dir} ({rng_file.name} is missing): "
                     "dropout will not replay the uninterrupted run")
        sizes = (f"{layout_name(*saved_layout(saved))} -> "
                 f"{layout_name(self.tensor_parallel_size, self.pipeline_parallel_size)}, " if relayout else "") + \
            f"data-parallel size {saved.get('data_parallel_size')} -> {self.data_parallel_size}"
        self.log(f"resumed from {tag_dir}: iteration {self.iteration}, consumed samples {self.consumed_samples}"
                 + (f" (through {load_dir / load_tag}, {sizes})" if load_tag != tag else ""))
        return True

    def _universal_tag(self, tag_dir: Path, saved: dict[str, Any], saved_zero_stage: int, relayout: bool) -> str:
        """Convert `tag_dir` to the universal format on rank 0 (if not done yet): DeepSpeed's
        converter for another data-parallel size, relayout.py's re-sharding for another
        tensor/pipeline layout. Every rank gets its tag or the same error."""
        if saved_zero_stage == 0 and not relayout:
            raise CheckpointError(f"{tag_dir} was written with ZeRO-0, whose optimizer state is not partitioned: it "
                                  "loads on any data-parallel size as it is; drop --universal-checkpoint")
        if relayout and saved_zero_stage not in RESHARDED_ZERO_STAGES:  # pretrain refuses it before building
            raise CheckpointError(f"{tag_dir} was written with ZeRO-{saved_zero_stage}: --universal-checkpoint "
                                  "re-shards ZeRO-1/2 optimizer partitions only; resume it on its saved layout")
        embedding_rows = int((self.run_args.get("model_config") or {}).get("padded_vocab_size")
                             or (self.run_args.get("model_config") or {}).get("vocab_size") or 0)
        error = ""
        if self.rank == 0:
            try:
                if relayout:  # rank 0 re-shards, so rank 0 says so (self.log speaks from the last rank only)
                    relayout_to_universal(tag_dir, saved, self.tensor_parallel_size, self.pipeline_parallel_size,
                                          embedding_rows, self._log)
                else:
                    convert_to_universal(tag_dir, self.log)
            except Exception as exception:  # noqa: BLE001 (reported on every rank below)
                error = f"{type(exception).__name__}: {exception}"
        failed = torch.tensor([1.0 if error else 0.0])
        if self.world_size > 1:
            failed = failed.to(collective_device())
            dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            raise CheckpointError(f"converting {tag_dir} to the universal format failed"
                                  + (f": {error}" if error else " (see rank 0's log)"))
        return relayout_tag(tag_dir.name, self.tensor_parallel_size, self.pipeline_parallel_size) if relayout else \
            tag_dir.name + UNIVERSAL_SUFFIX


class _PipelineInputs:
    """Feeds a pipeline engine the ((inputs...), label) tuples it expects, from device batches
    (the DevicePrefetcher counts their tokens)."""

    def __init__(self, batches: DevicePrefetcher):
        self.batches = batches

    def __iter__(self):
        return self

    def __next__(self):
        batch = next(self.batches)
        return batch.as_tuple(), batch.labels


def _format_seconds(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
