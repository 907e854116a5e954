#!/usr/bin/env python
"""Host-device synchronisation points of the training loop, counted on any machine (the CPU too).

    python tools/count_host_syncs.py --data-path SAMPLES_DIR                  # ZeRO-0 and ZeRO-1
    python tools/count_host_syncs.py --data-path SAMPLES_DIR --zero-stage 1 --json -
    python tools/count_host_syncs.py --data-path SAMPLES_DIR --zero-stage 1 --precision bf16
    python tools/count_host_syncs.py --data-path SAMPLES_DIR --zero-stage 1 --deepspeed-config ds.json

Trains a real Trainer in this process (the tiny preset, fp32 by default, DeepSpeed on this machine's
accelerator, world size 1; or under torchrun, each rank counting its own) for two log intervals,
and counts with training/host_syncs.py's HostSyncCounter what waits for the device over the micro
batches between the two log lines (the log line's own reads excluded: they happen once per
interval, by design): per owner (ours, DeepSpeed, megatron-core), per micro batch, and at each
place. tests/test_sync_free_step.py holds our share to zero; docs/gpu.md lists DeepSpeed's.

On a CUDA machine (DS_ACCELERATOR=cuda) the same window also runs under
`torch.cuda.set_sync_debug_mode("warn")` (host_syncs.CudaSyncWarnings): what CUDA itself reports as
waiting for the device, blocking host-to-device copies included, per owner, place and thread.

The optimizer is the one a CUDA run builds (`training_config.adamw_options("cuda")`: torch's fused
AdamW). torch's default CPU AdamW reads its step counters with `.item()`, CPU tensors on every
machine that never wait for a device; `--cpu-adamw` keeps it, to show them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

from megatron_pmlm.files import (OutputError, check_output, logs_to_stderr, quiet_libraries,  # noqa: E402
                                 write_json_atomically)

OWNERS = ("ours", "deepspeed", "megatron-core", "other")


def count_between_log_lines(data_path: str, zero_stage: int, log_interval: int = 2, micro_batch_size: int = 4,
                            global_batch_size: int = 8, objective: str = "ae+par",
                            cuda_optimizer: bool = True, precision: str = "fp32",
                            deepspeed_config: dict | None = None) -> dict:
    """Train 2 x `log_interval` iterations; the syncs counted between the two log lines, as
    {"micro_batches", "events": [[owner, what, place, count], ...], "per_micro_batch": {owner: n}}."""
    import torch.distributed as dist

    from megatron_pmlm.config import model_config_from_preset
    from megatron_pmlm.data import build_pretraining_loaders, read_metadata
    from megatron_pmlm.models.model import PMLMForPreTraining
    from megatron_pmlm.models.objectives import get_objective, objective_metrics
    from megatron_pmlm.parallel.distributed import model_parallel_unit
    from megatron_pmlm.training import trainer as trainer_module
    from megatron_pmlm.training.host_syncs import CudaSyncWarnings, HostSyncCounter
    from megatron_pmlm.training.recipe import padded_vocab_size, start_processes
    from megatron_pmlm.training.training_config import TrainingConfig, adamw_options, check_precision_supported

    objective = get_objective(objective)
    metadata = read_metadata(data_path)
    vocab_size = int(metadata["vocab_size"])
    training = TrainingConfig(seq_length=int(metadata["seq_length"]), micro_batch_size=micro_batch_size,
                              global_batch_size=global_batch_size, train_iters=2 * log_interval,
                              log_interval=log_interval, eval_iters=0, lr=1e-3, lr_warmup_iters=2,
                              zero_stage=zero_stage, precision=precision)
    check_precision_supported(precision)
    processes = start_processes(training, 1, 1)
    config = model_config_from_preset("tiny", vocab_size=vocab_size,
                                      padded_vocab_size=padded_vocab_size(vocab_size, 128, 1))
    trainer_module.seed_everything(training.seed)
    model = PMLMForPreTraining(config, objective, init_seed=training.seed)
    windows: list[tuple[HostSyncCounter, CudaSyncWarnings]] = []

    class CountingTrainer(trainer_module.Trainer):
        """Counts from the end of one log line to the start of the next."""

        def _log_interval(self, *args, **kwargs):
            if windows:
                for counter in reversed(windows[-1]):
                    counter.__exit__(None, None, None)
            super()._log_interval(*args, **kwargs)
            if len(windows) < 1:
                windows.append((HostSyncCounter().__enter__(), CudaSyncWarnings().__enter__()))

    default_options = trainer_module.adamw_options
    if cuda_optimizer:
        trainer_module.adamw_options = lambda _device_type: adamw_options("cuda")
    try:
        trainer = CountingTrainer(model, training, processes.layout.data_parallel_size, deepspeed_config,
                                  mpu=model_parallel_unit(), log=lambda message: None,
                                  metrics=objective_metrics(objective))
    finally:
        trainer_module.adamw_options = default_options
    loaders = build_pretraining_loaders(data_path, micro_batch_size, processes.data_parallel_rank,
                                        processes.layout.data_parallel_size, objective=objective,
                                        seed=training.seed, max_length=config.max_position_embeddings)
    trainer.train(loaders.train)
    dist.barrier()
    syncs, cuda_syncs = windows[0]
    micro_batches = log_interval * training.gradient_accumulation_steps(processes.layout.data_parallel_size)
    return {"zero_stage": zero_stage, "precision": precision, "micro_batches": micro_batches,
            "events": [[owner, what, place, n] for (owner, what, place), n in sorted(syncs.events.items())],
            "per_micro_batch": {owner: syncs.count(owner) / micro_batches for owner in OWNERS},
            "report": syncs.report(),
            # On CUDA, what torch.cuda.set_sync_debug_mode("warn") reported over the same window.
            "cuda_sync_debug": cuda_syncs.active,
            "cuda_sync_events": [[owner, place, thread, n]
                                 for (owner, place, thread), n in sorted(cuda_syncs.events.items())],
            "cuda_sync_main_thread": cuda_syncs.main_thread, "cuda_sync_report": cuda_syncs.report()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data-path", required=True, help="a `python -m data_prep.build_samples` output directory")
    parser.add_argument("--zero-stage", type=int, nargs="+", default=[0, 1], choices=(0, 1, 2, 3),
                        help="one run per stage, in this process (default: 0 1)")
    parser.add_argument("--log-interval", type=int, default=2, help="iterations between the two log lines")
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--objective", default="ae+par")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "fp16", "bf16"),
                        help="fp16: DeepSpeed's loss scaler and its overflow check (where the accelerator has fp16)")
    parser.add_argument("--cpu-adamw", action="store_true",
                        help="keep torch's default CPU AdamW (its .item() of CPU step counters is counted)")
    parser.add_argument("--deepspeed-config", help="a DeepSpeed config file under the command's values, as "
                        "pretrain's --deepspeed-config")
    parser.add_argument("--json", help="also write the counts to this file ('-': standard output)")
    args = parser.parse_args()
    quiet_libraries()
    if not (Path(args.data_path) / "metadata.json").is_file():
        print(f"error: --data-path {args.data_path}: not a build_samples output directory (no metadata.json)",
              file=sys.stderr)
        return 2
    if args.json:
        try:
            check_output(args.json, "--json")
        except OutputError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    from megatron_pmlm.config import ConfigError
    from megatron_pmlm.parallel.distributed import end_distributed
    from megatron_pmlm.training.training_config import read_deepspeed_config

    with logs_to_stderr(args.json):
        try:
            deepspeed_config = read_deepspeed_config(args.deepspeed_config)
            runs = [count_between_log_lines(args.data_path, stage, args.log_interval, args.micro_batch_size,
                                            args.global_batch_size, args.objective, not args.cpu_adamw,
                                            args.precision, deepspeed_config)
                    for stage in args.zero_stage]
        except FileNotFoundError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        finally:
            end_distributed()
        for run in runs:
            shares = ", ".join(f"{owner} {run['per_micro_batch'][owner]:g}" for owner in OWNERS)
            print(f"ZeRO-{run['zero_stage']}, {run['precision']}: syncs per micro batch over {run['micro_batches']} micro batches "
                  f"between two log lines: {shares}\n{run['report']}")
            if run["cuda_sync_debug"]:
                print(f"CUDA's own sync-debug warnings over the same micro batches (owner, thread, place):\n"
                      f"{run['cuda_sync_report']}")
    if args.json:
        write_json_atomically(args.json, {"runs": runs}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
