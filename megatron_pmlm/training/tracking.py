"""Experiment tracking beside TensorBoard: Weights & Biases and MLflow, behind one narrow interface.

The Trainer's logging rank hands `Tracking.log` the scalars TensorBoard gets ("train/loss",
"valid/mlm_acc", ...) against the iteration; every backend receives the same. Three rules:

- Tracking never stops training: an exception from a backend is reported once, in one line naming
  the backend and the error, and that backend is switched off for the rest of the run.
- A resumed run continues the same W&B / MLflow run: the run ids are written to the save folder
  (`tracking_runs.json`) when they start and into every checkpoint's run state; a resume takes
  them from the checkpoint (else from the save folder: a crash before the first checkpoint).
- Iterations re-run after the checkpoint give no duplicate points. W&B: the run is continued with
  `resume_from="ID?_step=N"` (W&B's rewind: the points past iteration N are replaced, as
  `history_*.json` does). MLflow cannot delete metric points: the points already logged for the
  re-run iterations stay (under an exact resume the losses are equal) and the re-run ones are
  skipped up to the last logged iteration; the run's tag `pmlm.resumed_at` lists the resumes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import ConfigError

INSTALL_HINT = "pip install -e '.[tracking]'"
RUNS_FILE = "tracking_runs.json"
"""In the save folder: the W&B / MLflow run ids, written when the runs start."""
WANDB_MODES = ("online", "offline")
DEFAULT_MLFLOW_EXPERIMENT = "megatron-pmlm"
TRACKING_ARGS = ("wandb_project", "wandb_run_name", "wandb_dir", "wandb_mode", "mlflow_tracking_uri",
                 "mlflow_experiment")
"""Where a run reports to: not a setting of the training (a resume may change them)."""


@dataclass
class TrackingConfig:
    """Where the logging rank reports, besides the console, TensorBoard and --history-json."""

    wandb_project: str | None = None
    """W&B project; None: no W&B."""
    wandb_run_name: str | None = None
    """The run's display name (W&B's default: a generated one)."""
    wandb_dir: str | None = None
    """Where W&B writes its run files (W&B's default: $WANDB_DIR or ./wandb)."""
    wandb_mode: str = "online"
    """online: stream to the W&B server; offline: files only, `wandb sync` uploads them later."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI: a database (sqlite:///runs.db) or a server; None: no MLflow."""
    mlflow_experiment: str = DEFAULT_MLFLOW_EXPERIMENT
    """MLflow experiment (created when missing)."""

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TrackingConfig":
        return cls(**{name: getattr(args, name) for name in TRACKING_ARGS if getattr(args, name, None) is not None})

    @property
    def enabled(self) -> bool:
        return bool(self.wandb_project or self.mlflow_tracking_uri)


def add_tracking_arguments(parser: argparse.ArgumentParser) -> None:
    """The --wandb-* and --mlflow-* options (pretrain, finetune_s2s, finetune_glue/squad)."""
    group = parser.add_argument_group(f"experiment tracking (needs {INSTALL_HINT})")
    group.add_argument("--wandb-project", metavar="P", default=None,
                       help="log the metrics, against the iteration, to this Weights & Biases project "
                            "(default: not set, no W&B)")
    group.add_argument("--wandb-run-name", metavar="N", default=None, help="the W&B run's name (default: one W&B picks)")
    group.add_argument("--wandb-dir", metavar="D", default=None,
                       help="folder for W&B's run files (default: $WANDB_DIR, else the current folder)")
    group.add_argument("--wandb-mode", choices=WANDB_MODES, default="online",
                       help="offline: run files only, uploaded later by `wandb sync` (clusters without internet)")
    group.add_argument("--mlflow-tracking-uri", metavar="URI", default=None,
                       help="log to MLflow: a tracking server (http://host:5000) or a database (sqlite:///runs.db) "
                            "(default: not set, no MLflow)")
    group.add_argument("--mlflow-experiment", metavar="E", default=DEFAULT_MLFLOW_EXPERIMENT,
                       help="MLflow experiment, created when missing")


def check_tracking_arguments(args: argparse.Namespace) -> TrackingConfig:
    """The TrackingConfig of the command line, or ConfigError in one line: a W&B/MLflow option
    without its main flag, or a backend whose package is not installed."""
    config = TrackingConfig.from_args(args)
    if not config.wandb_project:
        for name in ("wandb_run_name", "wandb_dir"):
            if getattr(args, name, None):
                raise ConfigError(f"--{name.replace('_', '-')} needs --wandb-project")
    if config.mlflow_experiment != DEFAULT_MLFLOW_EXPERIMENT and not config.mlflow_tracking_uri:
        raise ConfigError("--mlflow-experiment needs --mlflow-tracking-uri")
    for flag, module, wanted in (("--wandb-project", "wandb", config.wandb_project),
                                 ("--mlflow-tracking-uri", "mlflow", config.mlflow_tracking_uri)):
        if wanted and importlib.util.find_spec(module) is None:
            raise ConfigError(f"{flag} needs the {module} package, which is not installed: {INSTALL_HINT}")
    return config


def hf_report_to(args: argparse.Namespace, report_to: str) -> list[str] | str:
    """The HF Trainer's `report_to` with our --wandb-*/--mlflow-* added, the environment variables
    its W&B and MLflow integrations read set from them (finetune_glue, finetune_squad)."""
    config = check_tracking_arguments(args)
    chosen = [] if report_to in ("none", "") else [name.strip() for name in report_to.split(",") if name.strip()]
    if config.wandb_project:
        os.environ["WANDB_PROJECT"] = config.wandb_project
        os.environ["WANDB_MODE"] = config.wandb_mode
        if config.wandb_dir:
            os.environ["WANDB_DIR"] = config.wandb_dir
        if config.wandb_run_name:
            os.environ["WANDB_NAME"] = config.wandb_run_name
        chosen.append("wandb")
    if config.mlflow_tracking_uri:
        os.environ["MLFLOW_TRACKING_URI"] = config.mlflow_tracking_uri
        os.environ["MLFLOW_EXPERIMENT_NAME"] = config.mlflow_experiment
        chosen.append("mlflow")
    chosen = list(dict.fromkeys(chosen))
    return chosen if chosen else "none"


def read_run_ids(save_dir: str | os.PathLike | None) -> dict[str, Any]:
    """The run ids stored in a save folder ({} when none)."""
    if not save_dir:
        return {}
    try:
        stored = json.loads((Path(save_dir) / RUNS_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return stored if isinstance(stored, dict) else {}


# ------------------------------------------------------------------------------------------------
# Backends: log(scalars, iteration), close(succeeded); run_id for the resumable ones
# ------------------------------------------------------------------------------------------------

class TensorBoardBackend:
    name = "tensorboard"
    run_id = None

    def __init__(self, log_dir: str):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=log_dir)

    def log(self, scalars: dict[str, float], iteration: int) -> None:
        for key, value in scalars.items():
            self.writer.add_scalar(key, value, iteration)

    def close(self, succeeded: bool) -> None:
        # Closed, not just flushed: its writer thread is then gone before the process ends.
        self.writer.close()


class WandbBackend:
    """A W&B run; the metrics against "iteration" (define_metric), W&B's step equal to it."""

    name = "wandb"

    def __init__(self, config: TrackingConfig, identity: dict[str, Any], resume_id: str | None, iteration: int,
                 log: Callable[[str], None]):
        import wandb

        self._wandb = wandb
        options = dict(project=config.wandb_project, name=config.wandb_run_name, dir=config.wandb_dir,
                       mode=config.wandb_mode, config=identity,
                       settings=wandb.Settings(silent=True, console="off"))
        if resume_id:
            try:
                # Rewind: the run continues from the checkpoint's iteration, later points replaced.
                self.run = wandb.init(resume_from=f"{resume_id}?_step={iteration}", **options)
            except Exception as error:  # noqa: BLE001 (e.g. a server without rewind): W&B's plain resume
                log(f"note: W&B could not rewind run {resume_id} to iteration {iteration} "
                    f"({type(error).__name__}: {error}); resuming it without rewind (W&B then ignores the "
                    "re-run iterations' points)")
                self.run = wandb.init(id=resume_id, resume="allow", **options)
        else:
            self.run = wandb.init(**options)
        self.run_id = self.run.id
        self.run.define_metric("iteration")
        self.run.define_metric("*", step_metric="iteration")

    def log(self, scalars: dict[str, float], iteration: int) -> None:
        self.run.log({"iteration": iteration, **scalars}, step=iteration)

    def close(self, succeeded: bool) -> None:
        self.run.finish(exit_code=0 if succeeded else 1)


class MlflowBackend:
    """An MLflow run through MlflowClient (no global active run): params = the run identity,
    metrics against the iteration (MLflow's step)."""

    name = "mlflow"
    PARAM_LENGTH = 6000  # MLflow's limit on a parameter's value
    PARAM_BATCH = 100  # and on parameters per log_batch

    def __init__(self, config: TrackingConfig, identity: dict[str, Any], resume_id: str | None, iteration: int,
                 log: Callable[[str], None]):
        import logging

        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        for name in ("mlflow", "alembic"):  # their INFO lines (database creation, migrations) are not ours
            logging.getLogger(name).setLevel(logging.WARNING)
        self.client = MlflowClient(tracking_uri=config.mlflow_tracking_uri)
        self.last_logged: dict[str, int] = {}
        """Per metric, the last iteration already in the run (a resumed run skips up to it)."""
        run = None
        if resume_id:
            try:
                run = self.client.get_run(resume_id)
            except Exception as error:  # noqa: BLE001 (another store, or the run was deleted)
                log(f"note: MLflow run {resume_id} is not in {config.mlflow_tracking_uri} "
                    f"({type(error).__name__}): starting a new run")
        if run is not None:
            self.run_id = run.info.run_id
            for key in run.data.metrics:
                steps = [m.step for m in self.client.get_metric_history(self.run_id, key)]
                self.last_logged[key] = max(steps, default=-1)
            resumes = run.data.tags.get("pmlm.resumed_at")
            self.client.set_tag(self.run_id, "pmlm.resumed_at",
                                f"{resumes},{iteration}" if resumes else str(iteration))
            self.client.update_run(self.run_id, status="RUNNING")
            return
        experiment = self.client.get_experiment_by_name(config.mlflow_experiment)
        experiment_id = experiment.experiment_id if experiment else \
            self.client.create_experiment(config.mlflow_experiment)
        self.run_id = self.client.create_run(experiment_id).info.run_id
        params = [Param(key, value[:self.PARAM_LENGTH]) for key, value in flatten(identity).items()]
        for start in range(0, len(params), self.PARAM_BATCH):
            self.client.log_batch(self.run_id, params=params[start:start + self.PARAM_BATCH])

    def log(self, scalars: dict[str, float], iteration: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, value, now, iteration) for key, value in scalars.items()
                   if iteration > self.last_logged.get(key, -1)]
        if metrics:
            self.client.log_batch(self.run_id, metrics=metrics)

    def close(self, succeeded: bool) -> None:
        self.client.set_terminated(self.run_id, status="FINISHED" if succeeded else "FAILED")


def flatten(values: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested dicts as "a.b.c" -> text (MLflow parameters are flat strings)."""
    flat = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value if isinstance(value, str) else json.dumps(value, default=str)
    return flat


# ------------------------------------------------------------------------------------------------
# The interface the Trainer uses
# ------------------------------------------------------------------------------------------------

class Tracking:
    """Every backend of the logging rank, each switched off at its first exception."""

    def __init__(self, log: Callable[[str], None]):
        self._log = log
        self.backends: list[Any] = []

    def add_tensorboard(self, log_dir: str) -> None:
        self.backends.append(TensorBoardBackend(log_dir))  # as before: a failure to create it is an error

    def start_runs(self, config: TrackingConfig, identity: dict[str, Any], resume_ids: dict[str, Any],
                   iteration: int, save_dir: str | os.PathLike | None) -> dict[str, str]:
        """Start (or continue, with `resume_ids`) the W&B and MLflow runs; their ids, also written
        to the save folder's RUNS_FILE."""
        for wanted, backend in ((config.wandb_project, WandbBackend), (config.mlflow_tracking_uri, MlflowBackend)):
            if not wanted:
                continue
            try:
                self.backends.append(backend(config, identity, resume_ids.get(backend.name), iteration, self._log))
            except Exception as error:  # noqa: BLE001 (tracking never stops training)
                self._switched_off(backend.name, "could not start", error)
        ids = self.run_ids()
        if ids and save_dir:
            from ..files import write_json_atomically

            try:
                write_json_atomically(Path(save_dir) / RUNS_FILE, {**read_run_ids(save_dir), **ids})
            except OSError as error:
                self._log(f"warning: could not record the tracking run ids in {Path(save_dir) / RUNS_FILE}: {error}")
        return ids

    def run_ids(self) -> dict[str, str]:
        return {backend.name: backend.run_id for backend in self.backends if getattr(backend, "run_id", None)}

    def log(self, scalars: dict[str, float], iteration: int) -> None:
        """The finite ones of `scalars` to every backend still on."""
        scalars = {key: float(value) for key, value in scalars.items() if math.isfinite(value)}
        for backend in list(self.backends):
            try:
                backend.log(scalars, iteration)
            except Exception as error:  # noqa: BLE001 (tracking never stops training)
                self._switched_off(backend.name, "failed", error)

    def close(self, succeeded: bool = True) -> None:
        """Close every run (W&B: finished with exit code 1, MLflow: FAILED, when not `succeeded`)."""
        backends, self.backends = self.backends, []
        for backend in backends:
            try:
                backend.close(succeeded)
            except Exception as error:  # noqa: BLE001
                self._log(f"warning: closing tracking backend {backend.name} failed "
                          f"({type(error).__name__}: {_first_line(error)})")

    def _switched_off(self, name: str, what: str, error: BaseException) -> None:
        self._log(f"warning: tracking backend {name} {what} ({type(error).__name__}: {_first_line(error)}); "
                  "it is switched off for the rest of the run, training goes on")
        for backend in [b for b in self.backends if b.name == name]:
            self.backends.remove(backend)
            try:
                backend.close(False)
            except Exception:  # noqa: BLE001 (already reported as failed)
                pass


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else "no message"
