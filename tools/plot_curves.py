"""Training curves: `python tools/plot_curves.py RUN... -o curves.png`.

A RUN is a TensorBoard folder (`--tensorboard-dir`; event files searched recursively) or a
`--history-json` file, of any run: PMLM (loss_ae, loss_par, mlm_acc, par_acc), UniLM v1 (loss_mlm,
mlm_acc, loss_nsp, nsp_acc, loss_unilm_*), PALM (mlm_acc; token_acc) or s2s fine-tuning (acc).
One panel per logged loss or accuracy, its training line solid and its validation points dashed,
one colour per run (named by --labels, else by its path), a legend on every panel; several runs
plot side by side on the same panels. `--tags TAG...` plots exactly those tags (`train/loss_ae`,
`valid/loss`, ...), one panel each. The image's format follows the output's suffix (PNG otherwise,
and for `-o -`: standard output).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_pmlm.config import positive_int  # noqa: E402
from megatron_pmlm.files import exit_quietly_on_closed_pipe, logs_to_stderr, open_output  # noqa: E402

Series = list[tuple[int, float]]
SPLITS = ("train", "valid")


def read_tensorboard(run_dir: Path) -> dict[str, Series]:
    """tag -> [(step, value)] over every event file under `run_dir` (or that one event file)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    event_files = [run_dir] if run_dir.is_file() else sorted(run_dir.rglob("events.out.tfevents.*"))
    if not event_files:
        raise FileNotFoundError(f"no TensorBoard event files under {run_dir} (a --history-json file plots too)")
    scalars: dict[str, dict[int, float]] = {}
    for event_file in event_files:
        accumulator = EventAccumulator(str(event_file), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            series = scalars.setdefault(tag, {})
            for event in accumulator.Scalars(tag):
                series[event.step] = event.value  # a resumed run rewrites steps: keep the latest
    return {tag: sorted(series.items()) for tag, series in scalars.items()}


def read_history(path: Path) -> dict[str, Series]:
    """A --history-json file: training records (`loss`, `mlm_acc`, ...) become `train/NAME`, validation
    records (`valid_loss`, ...) `valid/NAME`, as in TensorBoard."""
    try:
        records = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a --history-json file: {error}") from None
    if not isinstance(records, list):
        raise ValueError(f"{path} is not a --history-json file (a list of records)")
    scalars: dict[str, dict[int, float]] = {}
    for record in records:
        if not isinstance(record, dict) or not isinstance(record.get("iteration"), int):
            continue
        for key, value in record.items():
            if key == "iteration" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            tag = f"valid/{key[len('valid_'):]}" if key.startswith("valid_") else f"train/{key}"
            scalars.setdefault(tag, {})[record["iteration"]] = float(value)
    return {tag: sorted(series.items()) for tag, series in scalars.items()}


def read_run(path: Path) -> dict[str, Series]:
    if not path.exists():
        raise FileNotFoundError(f"{path} not found")
    if path.is_file() and not path.name.startswith("events.out.tfevents."):
        return read_history(path)
    return read_tensorboard(path)


def is_curve(name: str) -> bool:
    """The metrics worth a panel: the losses and accuracies the models log (models/metrics.py)."""
    return (name.startswith("loss") and name != "loss_scale") or name == "acc" or name.endswith("_acc")


def _metric_order(name: str) -> tuple[int, str]:
    return (0 if name == "loss" else 1 if name.startswith("loss") else 2, name)


def panels_for(data: dict[str, dict[str, Series]], tags: list[str] | None) -> list[tuple[str, list[str]]]:
    """(title, tags on it): each given tag alone, else one panel per logged metric with its splits."""
    logged = {tag for scalars in data.values() for tag in scalars}
    if tags:
        available = [tag for tag in tags if tag in logged]
        if not available:
            raise ValueError(f"none of the tags {', '.join(tags)} was logged; found: {', '.join(sorted(logged)) or 'none'}")
        return [(tag, [tag]) for tag in available]
    metrics = sorted({tag.split("/", 1)[1] for tag in logged
                      if tag.split("/", 1)[0] in SPLITS and "/" in tag and is_curve(tag.split("/", 1)[1])},
                     key=_metric_order)
    if not metrics:
        raise ValueError(f"no loss or accuracy was logged; found: {', '.join(sorted(logged)) or 'none'}")
    return [(metric, [f"{split}/{metric}" for split in SPLITS if f"{split}/{metric}" in logged]) for metric in metrics]


def plot(runs: list[Path], tags: list[str] | None, output: Path, labels: list[str] | None = None,
         columns: int = 3):
    """Draws and writes the figure; returns it (one axes per panel)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = labels or [str(run) for run in runs]
    if len(labels) != len(runs):
        raise ValueError(f"{len(labels)} --labels for {len(runs)} runs")
    data = {label: read_run(run) for label, run in zip(labels, runs)}
    panels = panels_for(data, tags)
    columns = max(1, min(columns, len(panels)))
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(5 * columns, 4 * rows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for index, (title, panel_tags) in enumerate(panels):
        axis = axes[index // columns][index % columns]
        for number, (label, scalars) in enumerate(data.items()):
            for tag in panel_tags:
                if tag not in scalars:
                    continue
                steps, values = zip(*scalars[tag])
                split = tag.split("/", 1)[0]
                valid = split == "valid"
                name = label if tags else f"{label} {split}" if len(data) > 1 else split
                axis.plot(steps, values, label=name, color=colours[number % len(colours)],
                          linestyle="--" if valid else "-", marker="o" if valid or len(steps) == 1 else None,
                          markersize=4)
        axis.set_title(title)
        axis.set_xlabel("iteration")
        axis.grid(alpha=0.3)
        axis.legend(fontsize="small")
    for index in range(len(panels), rows * columns):
        figure.delaxes(axes[index // columns][index % columns])
    figure.tight_layout()
    image_format = output.suffix.lstrip(".").lower()
    if image_format not in figure.canvas.get_supported_filetypes():
        image_format = "png"
    with open_output(output, binary=True) as handle:
        figure.savefig(handle, format=image_format, dpi=100)
    plt.close(figure)
    return figure


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path,
                        help="TensorBoard folders (--tensorboard-dir) or --history-json files, one per run")
    parser.add_argument("-o", "--output", type=Path, default=Path("curves.png"), help="the image (default: curves.png); '-': standard output")
    parser.add_argument("--tags", nargs="+", default=None,
                        help="exactly these tags, one panel each (default: every logged loss and accuracy)")
    parser.add_argument("--labels", nargs="+", default=None, help="a name per run (default: its path)")
    parser.add_argument("--columns", type=positive_int, default=3, help="panels per row (default: 3)")
    args = parser.parse_args(argv)
    try:
        with logs_to_stderr(args.output):
            plot(args.runs, args.tags, args.output, args.labels, args.columns)
            print(f"wrote {args.output}")
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(exit_quietly_on_closed_pipe(main))
