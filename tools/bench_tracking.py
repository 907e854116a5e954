"""What W&B and MLflow cost the logging rank: start, one `Tracking.log` call, close.

    python tools/bench_tracking.py                  # W&B offline and MLflow on a sqlite file in a temp folder
    python tools/bench_tracking.py --calls 1000 --scalars 20

Each backend is started as the Trainer starts it (training/tracking.py), then logs `--calls`
iterations of `--scalars` scalars (the tiny preset's training line has 15) and is closed; the
figures are wall-clock per call, the work the logging rank does between two iterations when
it logs. Needs the tracking extra (pip install -e '.[tracking]'); no network (W&B offline).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_pmlm.config import positive_int  # noqa: E402
from megatron_pmlm.training.tracking import Tracking, TrackingConfig  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--calls", type=positive_int, default=200, help="log calls per backend")
    parser.add_argument("--scalars", type=positive_int, default=15, help="scalars per call")
    args = parser.parse_args(argv)
    scalars = {f"train/metric_{i}": float(i) for i in range(args.scalars)}
    with tempfile.TemporaryDirectory() as folder:
        os.environ.setdefault("WANDB_CONFIG_DIR", folder)  # no account, no settings written elsewhere
        for name, config in (("wandb offline", TrackingConfig(wandb_project="bench", wandb_mode="offline",
                                                              wandb_dir=folder)),
                             ("mlflow sqlite", TrackingConfig(mlflow_tracking_uri=f"sqlite:///{folder}/runs.db"))):
            tracking = Tracking(print)
            start = time.perf_counter()
            tracking.start_runs(config, {"config": {"bench": True}}, {}, 0, None)
            started = time.perf_counter()
            for iteration in range(1, args.calls + 1):
                tracking.log(scalars, iteration)
            logged = time.perf_counter()
            tracking.close()
            closed = time.perf_counter()
            print(f"{name}: start {started - start:.2f} s, log {1000 * (logged - started) / args.calls:.2f} ms per call "
                  f"({args.scalars} scalars), close {closed - logged:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
