"""`import deepspeed` without the MLflow import it does not need.

DeepSpeed's package import reaches its autotuner (deepspeed/autotuning/autotuner.py), which runs
`import mlflow` at module level wherever MLflow is installed, to report autotuning experiments from
`deepspeed --autotuning`'s launcher. A training process never runs the autotuner, yet paid 1.5-2 s
of MLflow's import (SQLAlchemy, pandas, ...) at every start: ~20% of a tiny pretrain process, and
again at every restart of a job. Every place that imports DeepSpeed calls `import_deepspeed()`
first; MLflow is hidden for the duration of DeepSpeed's import only, so `--tracking mlflow`
(training/tracking.py) imports the real package afterwards.
"""

from __future__ import annotations

import sys
from types import ModuleType

HIDDEN_FROM_DEEPSPEED = ("mlflow",)
"""Packages DeepSpeed imports at module level for features a training process does not use."""


def import_deepspeed() -> ModuleType:
    """The `deepspeed` module, imported the first time with HIDDEN_FROM_DEEPSPEED made unimportable
    (a None entry in sys.modules: DeepSpeed's `try: import mlflow` then takes its fallback) unless
    the process imported them already."""
    module = sys.modules.get("deepspeed")
    if module is not None:
        return module
    hidden = [name for name in HIDDEN_FROM_DEEPSPEED if name not in sys.modules]
    for name in hidden:
        sys.modules[name] = None  # type: ignore[assignment]  # import raises ModuleNotFoundError
    try:
        import deepspeed
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
    return deepspeed
