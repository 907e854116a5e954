"""The data pipeline at growing corpus sizes: `python tools/bench_scale.py --sizes-mb 10 30 100 --json OUT`.

For each size, builds a corpus by repeating the documents of `--corpus` (../shared/data/corpus: wikitext
articles, the books cut into ~6 KB documents), each copy shuffled by its own seeded generator, into
one JSONL file; then runs, each as a subprocess whose whole process tree (pool workers included) is
sampled every `--interval` seconds:

- `data_prep.preprocess`, then `data_prep.build_samples` with each of `--mask-epochs` (1 and 10);
- the loader: `build_pretraining_loaders` and its first `--loader-batches` micro batches of epoch 0,
  for each of `--loader-ranks` (1 and 8): that many ranks of one DP group as concurrent processes.

Recorded per step: CPU seconds (the process and its reaped children, from wait4), wall seconds,
peak RSS, peak private memory (RssAnon: anonymous pages, what the kernel cannot drop; memory-mapped
corpus pages count in every process's RSS but not here) and peak USS (smaps_rollup's Private_*),
summed over the tree and per process; disk bytes of the outputs. Then a least-squares line
a + b x MB per figure, projected to 160 GB of corpus; and the paper's 0.5M steps x 7,680 samples
in mask epochs of the projected sample count.

`--code-root DIR` runs another checkout's code (e.g. /work/main, read-only: outputs go to `--work`)
for before/after figures. A benchmark, not a test: figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
PAPER_CORPUS_MB = 160_000.0
PAPER_TRAINING_SAMPLES = 500_000 * 7_680
DOCUMENT_BYTES = 6_000
"""Books are cut into documents of about this size (the issue's 300 MB held 52,506 documents)."""

LOADER_SCRIPT = r"""
import sys, time, numpy as np
from megatron_pmlm.data.loader import build_pretraining_loaders
path, rank, size, micro, batches = sys.argv[1], *map(int, sys.argv[2:6])
started = time.perf_counter()
loaders = build_pretraining_loaders(path, micro, data_parallel_rank=rank, data_parallel_size=size,
                                    global_batch_size=micro * size)
tokens = 0
for _ in range(batches):
    tokens += int(next(loaders.train).input_ids.numel())
print(f"rank {rank}: {batches} batches, {tokens} token slots, {time.perf_counter() - started:.2f} s")
"""


class BenchError(ValueError):
    """Bad arguments for the benchmark; the message names the culprit."""


# --------------------------------------------------------------------------------------------
# Corpus


def base_documents(corpus: Path) -> list[str]:
    """Wikitext as whole articles, other texts cut at blank lines into documents of ~DOCUMENT_BYTES."""
    documents = []
    files = sorted(corpus.glob("*.txt"))
    if not files:
        raise BenchError(f"--corpus {corpus}: no .txt files")
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if "wikitext" in path.name:
            documents += [part for part in re.split(r"\n(?= = [^=].* = \n)", text) if part.strip()]
            continue
        current: list[str] = []
        for paragraph in re.split(r"\n\s*\n", text):
            current.append(paragraph)
            if sum(map(len, current)) >= DOCUMENT_BYTES:
                documents.append("\n".join(current))
                current = []
        if current:
            documents.append("\n".join(current))
    return documents


def write_corpus(documents: list[str], megabytes: float, path: Path, seed: int) -> dict:
    """JSONL of whole shuffled copies of `documents` (copy c permuted by a generator seeded (seed, c)),
    the last copy cut where the size is reached."""
    target = int(megabytes * 1e6)
    written = count = copy = 0
    with open(path, "w", encoding="utf-8") as out:
        while written < target:
            for index in np.random.default_rng([seed, copy]).permutation(len(documents)).tolist():
                line = json.dumps({"text": documents[index]}) + "\n"
                out.write(line)
                written += len(line.encode("utf-8"))
                count += 1
                if written >= target:
                    break
            copy += 1
    return {"bytes": written, "documents": count}


# --------------------------------------------------------------------------------------------
# Measuring a process tree


def _proc_kib(pid: int, filename: str, keys: tuple[str, ...]) -> dict[str, int]:
    """Fields (kB) of /proc/PID/status or smaps_rollup; {} when the process is gone."""
    values = {}
    try:
        with open(f"/proc/{pid}/{filename}") as handle:
            for line in handle:
                name, _, rest = line.partition(":")
                if name in keys:
                    values[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return {}
    return values


class TreeSampler:
    """Peaks of RSS, RssAnon and USS per process and summed over the trees under `roots`, sampled
    from /proc every `interval` seconds on a thread."""

    def __init__(self, roots: list[int], interval: float):
        self.roots, self.interval = roots, interval
        self.per_process: dict[int, dict] = {}
        self.peak_sum = {"rss": 0, "rss_anon": 0, "uss": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "TreeSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def sample(self) -> None:
        pids = []
        for root in self.roots:
            try:
                process = psutil.Process(root)
                pids += [root] + [child.pid for child in process.children(recursive=True)]
            except psutil.Error:
                continue
        total = {"rss": 0, "rss_anon": 0, "uss": 0}
        for pid in pids:
            status = _proc_kib(pid, "status", ("VmRSS", "RssAnon"))
            rollup = _proc_kib(pid, "smaps_rollup", ("Private_Clean", "Private_Dirty"))
            if not status or not rollup:
                continue
            figures = {"rss": status.get("VmRSS", 0) * 1024, "rss_anon": status.get("RssAnon", 0) * 1024,
                       "uss": (rollup.get("Private_Clean", 0) + rollup.get("Private_Dirty", 0)) * 1024}
            peaks = self.per_process.setdefault(pid, {"role": "main" if pid in self.roots else "worker",
                                                      "rss": 0, "rss_anon": 0, "uss": 0})
            for key, value in figures.items():
                peaks[key] = max(peaks[key], value)
                total[key] += value
        for key, value in total.items():
            self.peak_sum[key] = max(self.peak_sum[key], value)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval)


def run_measured(commands: list[list[str]], cwd: Path, interval: float, log: Path) -> dict:
    """Run commands concurrently; CPU seconds (wait4: each process and its reaped children), wall
    seconds, and the memory peaks of their trees. A failing command ends the benchmark."""
    environment = dict(os.environ, TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1", OMP_NUM_THREADS="1",
                       DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    started = time.perf_counter()
    with open(log, "a") as log_file:
        processes = [subprocess.Popen(command, cwd=cwd, env=environment, stdout=log_file, stderr=log_file)
                     for command in commands]
        cpu = 0.0
        failed = []
        with TreeSampler([p.pid for p in processes], interval) as sampler:
            for process, command in zip(processes, commands):
                _, status, usage = os.wait4(process.pid, 0)
                process.returncode = os.waitstatus_to_exitcode(status)
                cpu += usage.ru_utime + usage.ru_stime
                if process.returncode:
                    failed.append(f"{' '.join(command)} exited with {process.returncode} (log: {log})")
    if failed:
        raise RuntimeError(failed[0])
    per_process = sorted(sampler.per_process.values(), key=lambda p: (p["role"] != "main", -p["rss_anon"]))
    return {"cpu_s": round(cpu, 2), "wall_s": round(time.perf_counter() - started, 2),
            "peak_sum_bytes": sampler.peak_sum,
            "peak_per_process_max_bytes": {key: max((p[key] for p in per_process), default=0)
                                           for key in ("rss", "rss_anon", "uss")},
            "per_process_peak_bytes": per_process}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size


# --------------------------------------------------------------------------------------------
# Fit and projection


def linear_fit(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x (a constant for a single point)."""
    if len(x) < 2:
        return float(y[0]), 0.0
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(intercept), float(slope)


def projections(points: list[dict]) -> dict:
    """Lines in corpus MB of every figure that all points share, evaluated at PAPER_CORPUS_MB."""
    sizes = [p["corpus_mb"] for p in points]
    figures: dict[str, list[float]] = {}
    for point in points:
        for name, value in flatten(point).items():
            figures.setdefault(name, []).append(value)
    result = {}
    for name, values in figures.items():
        if len(values) != len(points) or name == "corpus_mb":
            continue
        intercept, slope = linear_fit(sizes, values)
        result[name] = {"intercept": intercept, "per_mb": slope, "at_160GB": intercept + slope * PAPER_CORPUS_MB}
    samples = result.get("build.k1.train_samples")
    if samples:
        natural = samples["at_160GB"]
        result["paper"] = {"train_samples_at_160GB": natural,
                           "epochs_for_0.5M_x_7680": PAPER_TRAINING_SAMPLES / natural if natural > 0 else None}
    return result


def flatten(point: dict, prefix: str = "") -> dict[str, float]:
    """Numeric leaves as dotted names (the per-process lists left out)."""
    flat = {}
    for key, value in point.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, name + "."))
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            flat[name] = float(value)
    return flat


# --------------------------------------------------------------------------------------------


def measure_size(megabytes: float, args: argparse.Namespace, documents: list[str], work: Path) -> dict:
    python = str(args.python or (args.code_root / ".venv" / "bin" / "python"))
    folder = work / f"{megabytes:g}MB"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    log = folder / "log.txt"
    corpus = write_corpus(documents, megabytes, folder / "corpus.jsonl", args.seed)
    point: dict = {"corpus_mb": corpus["bytes"] / 1e6, "documents": corpus["documents"]}
    prefix = folder / "tokens"
    point["preprocess"] = run_measured(
        [[python, "-m", "data_prep.preprocess", "--input", str(folder / "corpus.jsonl"), "--output-prefix",
          str(prefix), "--vocab-file", str(args.vocab_file), "--workers", str(args.workers), "--no-progress"]],
        args.code_root, args.interval, log)
    point["preprocess"]["bin_idx_bytes"] = folder_bytes(Path(f"{prefix}.bin")) + folder_bytes(Path(f"{prefix}.idx"))
    (folder / "corpus.jsonl").unlink()
    for mask_epochs in args.mask_epochs:
        output = folder / f"samples-k{mask_epochs}"
        step = run_measured(
            [[python, "-m", "data_prep.build_samples", "--data-path", str(prefix), "--output", str(output),
              "--mask-epochs", str(mask_epochs), "--workers", str(args.workers), "--seq-length", "512",
              "--no-progress"]], args.code_root, args.interval, log)
        metadata = json.loads((output / "metadata.json").read_text())
        step["samples_bytes"] = folder_bytes(output)
        step["train_samples"] = metadata["splits"]["train"]["num_samples"]
        point[f"build.k{mask_epochs}"] = step
    samples = folder / f"samples-k{min(args.mask_epochs)}"
    for ranks in args.loader_ranks:
        point[f"loader.r{ranks}"] = run_measured(
            [[python, "-c", LOADER_SCRIPT, str(samples), str(rank), str(ranks), str(args.micro_batch),
              str(args.loader_batches)] for rank in range(ranks)], args.code_root, args.interval, log)
    if not args.keep:
        shutil.rmtree(folder, ignore_errors=True)
    return point


def print_table(points: list[dict], fits: dict) -> None:
    mib = 2 ** 20
    print(f"{'step':<16}{'MB':>9}{'CPU s':>9}{'wall s':>9}{'anon sum':>10}{'anon max':>10}{'USS sum':>10}"
          f"{'RSS sum':>10}  (memory in MiB, peaks)")
    for point in points:
        for name, step in point.items():
            if isinstance(step, dict):
                peak, most = step["peak_sum_bytes"], step["peak_per_process_max_bytes"]
                print(f"{name:<16}{point['corpus_mb']:>9.1f}{step['cpu_s']:>9.1f}{step['wall_s']:>9.1f}"
                      f"{peak['rss_anon'] / mib:>10.1f}{most['rss_anon'] / mib:>10.1f}{peak['uss'] / mib:>10.1f}"
                      f"{peak['rss'] / mib:>10.1f}")
    print(f"\nprojection to {PAPER_CORPUS_MB / 1e3:.0f} GB (least squares over {len(points)} sizes):")
    for name, fit in fits.items():
        if name == "paper":
            continue
        if name.endswith(("_bytes.rss_anon", "_bytes.uss")) or name.endswith(("cpu_s", "bytes", "samples")):
            unit, scale = ("MiB", mib) if "bytes" in name else ("", 1)
            print(f"  {name:<45} {fit['intercept'] / scale:>12.1f} + {fit['per_mb'] / scale:>10.4f} {unit}/MB "
                  f"-> {fit['at_160GB'] / scale:>14.1f} {unit}")
    if "paper" in fits:
        paper = fits["paper"]
        print(f"  paper: {paper['train_samples_at_160GB']:,.0f} training samples at 160 GB; 0.5M x 7,680 samples "
              f"= {paper['epochs_for_0.5M_x_7680']:.1f} epochs of them")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python tools/bench_scale.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[2.0, 6.0, 20.0],
                        help="corpus sizes in MB (default: 2 6 20)")
    parser.add_argument("--mask-epochs", type=int, nargs="+", default=[1, 10], help="build_samples runs (default: 1 10)")
    parser.add_argument("--loader-ranks", type=int, nargs="*", default=[1, 8],
                        help="DP group sizes for the loader (default: 1 8; none: skip)")
    parser.add_argument("--loader-batches", type=int, default=4, help="micro batches per rank (default: 4)")
    parser.add_argument("--micro-batch", type=int, default=8, help="loader micro batch (default: 8)")
    parser.add_argument("--workers", type=int, default=2, help="preprocess/build_samples --workers (default: 2)")
    parser.add_argument("--corpus", type=Path, default=SHARED_DATA / "corpus", help="folder of .txt files")
    parser.add_argument("--vocab-file", type=Path, default=SHARED_DATA / "vocab" / "bert-base-uncased-vocab.txt")
    parser.add_argument("--code-root", type=Path, default=REPO, help="checkout whose code runs (default: this one)")
    parser.add_argument("--python", type=Path, help="interpreter (default: CODE_ROOT/.venv/bin/python)")
    parser.add_argument("--work", type=Path, help="scratch folder (default: a temporary one, removed)")
    parser.add_argument("--keep", action="store_true", help="keep each size's corpus and samples")
    parser.add_argument("--seed", type=int, default=1, help="corpus shuffles (default: 1)")
    parser.add_argument("--interval", type=float, default=0.2, help="memory sampling period in s (default: 0.2)")
    parser.add_argument("--json", type=Path, help="write every figure and the fits here")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if any(size <= 0 for size in args.sizes_mb):
            raise BenchError(f"--sizes-mb must be positive, got {args.sizes_mb}")
        if not args.mask_epochs or any(k < 1 for k in args.mask_epochs):
            raise BenchError(f"--mask-epochs must be >= 1, got {args.mask_epochs}")
        if any(r < 1 for r in args.loader_ranks) or args.loader_batches < 1 or args.micro_batch < 1:
            raise BenchError("--loader-ranks, --loader-batches and --micro-batch must be >= 1")
        if args.workers < 1 or args.interval <= 0:
            raise BenchError("--workers must be >= 1 and --interval > 0")
        if not args.vocab_file.is_file():
            raise BenchError(f"--vocab-file {args.vocab_file}: not a file")
        if not (args.code_root / "data_prep" / "build_samples.py").is_file():
            raise BenchError(f"--code-root {args.code_root}: no data_prep/build_samples.py there")
        if args.json and args.json.exists() and not args.json.is_file():
            raise BenchError(f"--json {args.json}: exists and is not a file")
        documents = base_documents(args.corpus)
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    args.code_root = args.code_root.resolve()
    temporary = None if args.work else tempfile.mkdtemp(prefix="bench_scale-")
    work = args.work or Path(temporary)
    try:
        points = []
        for size in sorted(args.sizes_mb):
            points.append(measure_size(size, args, documents, work))
            print(f"{size:g} MB done", file=sys.stderr, flush=True)
        fits = projections(points)
        print_table(points, fits)
        if args.json:
            report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                  "memory_bytes": psutil.virtual_memory().total},
                      "command": " ".join(sys.argv), "code_root": str(args.code_root),
                      "points": points, "fits": fits}
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps(report, indent=1))
            os.replace(tmp, args.json)
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    finally:
        if temporary:
            shutil.rmtree(temporary, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
