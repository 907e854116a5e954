"""Loss curves from TensorBoard logs: `python tools/plot_curves.py RUN_DIR... -o curves.png`.

One panel per tag (train/loss_ae, train/loss_par, valid/loss by default), one line per run; a run
directory is any folder holding TensorBoard event files (searched recursively), named by its path.
The image's format follows the output's suffix (PNG otherwise, and for `-o -`: standard output).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_pmlm.files import logs_to_stderr, open_output  # noqa: E402

DEFAULT_TAGS = ("train/loss_ae", "train/loss_par", "valid/loss")


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file under `run_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files = sorted(run_dir.rglob("events.out.tfevents.*"))
    if not event_files:
        raise FileNotFoundError(f"no TensorBoard event files under {run_dir}")
    scalars: dict[str, dict[int, float]] = {}
    for event_file in event_files:
        accumulator = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            series = scalars.setdefault(tag, {})
            for event in accumulator.Scalars(tag):
                series[event.step] = event.value  # a resumed run rewrites steps: keep the latest
    return {tag: sorted(series.items()) for tag, series in scalars.items()}


def plot(runs: list[Path], tags: list[str], output: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {run: read_scalars(run) for run in runs}
    available = [tag for tag in tags if any(tag in scalars for scalars in data.values())]
    if not available:
        found = sorted({tag for scalars in data.values() for tag in scalars})
        raise ValueError(f"none of the tags {', '.join(tags)} was logged; found: {', '.join(found) or 'none'}")
    figure, axes = plt.subplots(1, len(available), figsize=(5 * len(available), 4), squeeze=False)
    for axis, tag in zip(axes[0], available):
        for run, scalars in data.items():
            if tag in scalars:
                steps, values = zip(*scalars[tag])
                axis.plot(steps, values, label=str(run))
        axis.set_title(tag)
        axis.set_xlabel("iteration")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    figure.tight_layout()
    image_format = output.suffix.lstrip(".").lower()
    if image_format not in figure.canvas.get_supported_filetypes():
        image_format = "png"
    with open_output(output, binary=True) as handle:
        figure.savefig(handle, format=image_format, dpi=100)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="TensorBoard log directories (--tensorboard-dir)")
    parser.add_argument("-o", "--output", type=Path, default=Path("curves.png"), help="'-': standard output")
    parser.add_argument("--tags", nargs="+", default=list(DEFAULT_TAGS))
    args = parser.parse_args(argv)
    try:
        with logs_to_stderr(args.output):
            plot(args.runs, args.tags, args.output)
            print(f"wrote {args.output}")
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
