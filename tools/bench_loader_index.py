"""The loader's memory per rank at the paper's scale, with and without the index cache:
`python tools/bench_loader_index.py [--samples 80000000] [--ranks 1 8] [--code /work/main] [--work DIR]`.

Builds a SPARSE synthetic samples folder of `--samples` training samples (issue 36): one small
corpus, a samples table of zeros but for each sample's length (random, 32..510 tokens: what the
length bucketing sorts), an all-zero mask offset table left as a sparse file (no stored masks),
and the metadata `build_pretraining_loaders` checks. Then, for each rank count, starts that many
processes at once, each the data-parallel rank of a DP group that builds the training loader
(`--code`: the checkout whose `megatron_pmlm` they import; default this one) and draws its first
`--batches` micro batches (real PMLM batches from the synthetic rows), and reports per rank:
private memory (RssAnon, polled every 20 ms for its peak; USS at the end via psutil, which also
counts file-backed pages only this process maps), the wall and CPU time to build the loader and
to draw the batches, and for the cached code the cache's files and size.

With this checkout the ranks run three times: a fresh cache (one rank builds, the others wait on
its lock), then again with the cache in place (a restart). `--concurrency` bounds how many ranks
run at once (main's ranks hold >= 1.3 GB each; 8 at once may not fit a shared machine: they do
not talk to each other, so running them in turn measures the same per-rank figures).
Figures go to docs/benchmarks.md; nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
CORPUS_TOKENS = 1024
SEQ_LENGTH = 512
ROW_CHUNK = 1 << 22


def proc_status_kib(pid: int | str, field: str) -> int:
    """A `kB` field of /proc/PID/status (RssAnon: private anonymous memory, what a rank really costs)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def make_sparse_samples(folder: Path, num_samples: int, seed: int = 0) -> None:
    """The synthetic samples folder described in the module docstring (written once, then reused)."""
    import numpy as np

    sys.path.insert(0, str(REPO_ROOT))
    from megatron_pmlm.data.indexed import IndexedDatasetWriter, bin_path, idx_path
    from megatron_pmlm.data.samples import METADATA_FILE, SAMPLE_COLUMNS, SAMPLES_FORMAT_VERSION, samples_identity

    if (folder / METADATA_FILE).is_file():
        metadata = json.loads((folder / METADATA_FILE).read_text())
        if metadata["splits"]["train"]["num_samples"] == num_samples:
            return
    shutil.rmtree(folder, ignore_errors=True)
    train = folder / "train"
    train.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    writer = IndexedDatasetWriter(folder / "corpus", np.uint16)
    writer.add_documents(rng.integers(1000, 30000, CORPUS_TOKENS), [CORPUS_TOKENS], [1])
    writer.finalize()
    columns = len(SAMPLE_COLUMNS)
    with open(train / "samples.bin", "wb") as rows_file:  # corpus 0, document 0, a_start 0, a_len L, no B
        for first in range(0, num_samples, ROW_CHUNK):
            rows = np.zeros((min(ROW_CHUNK, num_samples - first), columns), dtype=np.int64)
            rows[:, 3] = rng.integers(32, SEQ_LENGTH - 1, len(rows))
            rows_file.write(rows.tobytes())
    with open(train / "mask_offsets.bin", "wb") as offsets:  # all zero: sparse, no disk blocks
        offsets.truncate((num_samples + 1) * 8)
    for name in ("mask_positions", "mask_steps", "mask_corrupted"):
        (train / f"{name}.bin").touch()
    metadata = {
        "format_version": SAMPLES_FORMAT_VERSION, "seed": 1234, "seq_length": SEQ_LENGTH, "mask_epochs": 1,
        "split": "100,0,0", "vocab_size": 30522, "vocab_sha256": "synthetic",
        "special_ids": {"pad": 0, "unk": 100, "cls": 101, "sep": 102, "mask": 103, "pseudo": 103},
        "dtypes": {"mask_positions": "<u2", "mask_steps": "|u1", "mask_corrupted": "<u2", "samples": "<i8",
                   "mask_offsets": "<i8"},
        "sample_columns": list(SAMPLE_COLUMNS),
        "blend": [{"prefix": "corpus", "weight": None, "num_documents": 1, "num_tokens": CORPUS_TOKENS,
                   "bin_bytes": bin_path(folder / "corpus").stat().st_size,
                   "idx_bytes": idx_path(folder / "corpus").stat().st_size}],
        "splits": {"train": {"num_samples": num_samples, "num_mask_entries": 0},
                   "valid": {"num_samples": 0, "num_mask_entries": 0},
                   "test": {"num_samples": 0, "num_mask_entries": 0}}}
    metadata["identity"] = samples_identity(metadata)
    (folder / METADATA_FILE).write_text(json.dumps(metadata, indent=1))


def worker(args: argparse.Namespace) -> None:
    """One data-parallel rank: build the loader, draw the first micro batches, report as JSON."""
    import inspect

    import psutil

    from megatron_pmlm.data import build_pretraining_loaders

    before = proc_status_kib("self", "RssAnon")
    started, started_cpu = time.perf_counter(), time.process_time()
    cached = "index_cache" in inspect.signature(build_pretraining_loaders).parameters
    loaders = build_pretraining_loaders(args.samples_dir, args.micro_batch_size, args.rank, args.world,
                                        objective="ae+par", global_batch_size=args.global_batch_size)
    built, built_cpu = time.perf_counter(), time.process_time()
    for _ in range(args.batches):
        batch = next(loaders.train)
    drawn, drawn_cpu = time.perf_counter(), time.process_time()
    print(json.dumps({
        "rank": args.rank, "cached": cached, "rss_anon_mib_after_imports": before / 1024,
        "rss_anon_mib": proc_status_kib("self", "RssAnon") / 1024,
        "rss_file_mib": proc_status_kib("self", "RssFile") / 1024,
        "uss_mib": psutil.Process().memory_full_info().uss / 2**20,
        "loader_seconds": built - started, "first_batches_seconds": drawn - built,
        "loader_cpu_seconds": built_cpu - started_cpu, "first_batches_cpu_seconds": drawn_cpu - built_cpu,
        "batch_shape": list(batch.input_ids.shape)}))


def run_ranks(code: Path, samples_dir: Path, world: int, args: argparse.Namespace) -> list[dict]:
    """`world` ranks, `--concurrency` at a time, their private memory polled for its peak."""
    env = {**os.environ, "PYTHONPATH": str(code), "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    pending, running, results = list(range(world)), {}, []
    try:
        poll_ranks(samples_dir, world, args, env, pending, running, results)
    finally:  # a failed rank or an interrupt: the others are stopped, not left behind
        for process, _ in running.values():
            process.kill()
            process.communicate()
    return sorted(results, key=lambda result: result["rank"])


def poll_ranks(samples_dir, world, args, env, pending, running, results) -> None:
    """Start ranks from `pending` as places free up; every 20 ms note each one's RssAnon; collect
    each finished rank's report into `results` (`running`: rank -> (process, peak RssAnon kB))."""
    while pending or running:
        while pending and len(running) < args.concurrency:
            rank = pending.pop(0)
            command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--samples-dir", str(samples_dir),
                       "--rank", str(rank), "--world", str(world), "--micro-batch-size", str(args.micro_batch_size),
                       "--global-batch-size", str(args.global_batch_size), "--batches", str(args.batches)]
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                       cwd=tempfile.gettempdir())
            running[rank] = (process, 0)
        time.sleep(0.02)
        for rank, (process, peak) in list(running.items()):
            try:
                peak = max(peak, proc_status_kib(process.pid, "RssAnon"))
            except (FileNotFoundError, ProcessLookupError):
                pass
            running[rank] = (process, peak)
            if process.poll() is not None:
                out, err = process.communicate()
                del running[rank]
                if process.returncode:
                    raise SystemExit(f"error: rank {rank} failed ({process.returncode}): {err.strip()[-2000:]}")
                results.append({**json.loads(out.strip().splitlines()[-1]), "peak_rss_anon_mib": peak / 1024})


def summary(label: str, results: list[dict], cache_dir: Path | None) -> dict:
    def mib(values):
        return [round(value) for value in values]

    line = {"run": label, "ranks": len(results),
            "rss_anon_mib": mib(r["rss_anon_mib"] for r in results),
            "rss_anon_growth_mib (after loader - after imports)":
                mib(r["rss_anon_mib"] - r["rss_anon_mib_after_imports"] for r in results),
            "peak_rss_anon_mib": mib(r["peak_rss_anon_mib"] for r in results),
            "uss_mib": mib(r["uss_mib"] for r in results),
            "sum_rss_anon_mib": round(sum(r["rss_anon_mib"] for r in results)),
            "loader_seconds": [round(r["loader_seconds"], 2) for r in results],
            "first_batches_seconds": [round(r["first_batches_seconds"], 2) for r in results],
            "loader_cpu_seconds": [round(r["loader_cpu_seconds"], 2) for r in results],
            "first_batches_cpu_seconds": [round(r["first_batches_cpu_seconds"], 2) for r in results]}
    if cache_dir is not None and cache_dir.is_dir():
        files = sorted(cache_dir.glob("*.npy"))
        line["cache_files"] = [f"{path.name} ({path.stat().st_size / 2**20:.0f} MiB)" for path in files]
    return line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--samples", type=int, default=80_000_000, help="training samples in the synthetic folder")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 8], help="data-parallel sizes to run")
    parser.add_argument("--code", type=Path, default=None,
                        help="also run the ranks with this checkout's megatron_pmlm (e.g. /work/main: the loader "
                             "before the index cache); it is only read")
    parser.add_argument("--work", type=Path, default=None,
                        help="where the synthetic samples folder goes (kept and reused; default: a temporary "
                             "folder, deleted at the end)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--global-batch-size", type=int, default=7680, help="the paper's; length bucketing on")
    parser.add_argument("--batches", type=int, default=3, help="micro batches each rank draws")
    parser.add_argument("--concurrency", type=int, default=8, help="ranks running at once")
    parser.add_argument("--code-concurrency", type=int, default=2, help="ranks of --code running at once")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--samples-dir", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if args.code is not None and not (args.code / "megatron_pmlm").is_dir():
        parser.error(f"--code {args.code}: no megatron_pmlm package there")
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-loader-index-"))
    try:
        samples_dir = work / "samples"
        started = time.perf_counter()
        make_sparse_samples(samples_dir, args.samples)
        disk = sum(p.stat().st_blocks * 512 for p in samples_dir.rglob("*") if p.is_file())
        print(json.dumps({"synthetic_samples": args.samples, "made_seconds": round(time.perf_counter() - started, 1),
                          "disk_mib": round(disk / 2**20)}), flush=True)
        cache_dir = samples_dir / "index-cache"
        for world in args.ranks:
            if args.code is not None:
                saved = args.concurrency
                args.concurrency = args.code_concurrency
                print(json.dumps(summary(f"{args.code} (no cache)", run_ranks(args.code, samples_dir, world, args),
                                         None)), flush=True)
                args.concurrency = saved
            shutil.rmtree(cache_dir, ignore_errors=True)
            print(json.dumps(summary("this checkout, fresh cache", run_ranks(REPO_ROOT, samples_dir, world, args),
                                     cache_dir)), flush=True)
            print(json.dumps(summary("this checkout, cache in place", run_ranks(REPO_ROOT, samples_dir, world, args),
                                     cache_dir)), flush=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
