"""Checksum throughput on checkpoint-sized files in the page cache: which hash the manifest uses.

    python tools/bench_checksum.py                      # 0.44, 1.3, 1.4 and 4.0 GB files in /tmp
    python tools/bench_checksum.py --sizes 1.4 --algorithms sha256,xxh3_128 --dir /scratch

Each file (random bytes) is written, read once so that it sits in the page cache, then hashed
with each algorithm in 8 MiB chunks, the loop `megatron_pmlm.training.checkpoint_files.file_checksum` runs
("file_checksum" is that function itself, with the algorithm the manifest uses); "read only" is
the same loop without a hash (the memory-copy floor); "write" is writing the file once (into the
page cache, no fsync, as torch.save writes; a shared file system is slower). The best of
`--repeats` runs is reported in GB/s (10^9 bytes), then the projected cost of hashing a base
(110M parameters: fp32 model states 0.44 GB + ZeRO optimizer states 1.3 GB) and a large (340M:
1.4 GB + 4 GB) checkpoint, on one process (the sum) and spread over the ranks (about the largest
file, the model states). blake3 is measured only where it is installed (`pip install blake3`);
it is not a dependency.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_pmlm.config import positive_int  # noqa: E402
from megatron_pmlm.training.checkpoint_files import _CHUNK_BYTES, CHECKSUM_ALGORITHM, file_checksum  # noqa: E402

CHECKPOINTS = {"base": (0.44, 1.3), "large": (1.4, 4.0)}  # GB: (model states, optimizer states)


def factories() -> dict[str, object]:
    import xxhash

    found = {"read only": None, "sha256": hashlib.sha256, "blake2b": hashlib.blake2b, "xxh64": xxhash.xxh64,
             "xxh3_128": xxhash.xxh3_128}
    try:
        import blake3

        found["blake3"] = blake3.blake3
    except ImportError:
        pass
    return found


def hash_file(path: Path, factory) -> None:
    hasher = factory() if factory else None
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        while read := handle.readinto(buffer):
            if hasher:
                hasher.update(view[:read])
    if hasher:
        hasher.hexdigest()


def write_file(path: Path, size: int) -> float:
    """Seconds the writes took (into the page cache, no fsync: as torch.save writes)."""
    block = os.urandom(64 << 20)
    start = time.perf_counter()
    with open(path, "wb") as handle:
        for offset in range(0, size, len(block)):
            handle.write(memoryview(block)[:min(len(block), size - offset)])
    seconds = time.perf_counter() - start
    hash_file(path, None)  # into the page cache (it should be already)
    return seconds


def best_seconds(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--sizes", default="0.44,1.3,1.4,4.0", help="file sizes in GB (10^9 bytes)")
    parser.add_argument("--algorithms", default="read only,sha256,blake2b,xxh64,xxh3_128,blake3,file_checksum",
                        help="comma-separated; blake3 only where installed")
    parser.add_argument("--repeats", type=positive_int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temporary folder)")
    args = parser.parse_args(argv)
    available = factories()
    algorithms = [a for a in args.algorithms.split(",") if a in available or a == "file_checksum"]
    for missing in sorted(set(args.algorithms.split(",")) - set(algorithms)):
        print(f"{missing}: not installed, skipped")
    throughput: dict[str, list[float]] = {a: [] for a in ["write", *algorithms]}
    print(f"{'size GB':>8} | " + " | ".join(f"{a:>13}" for a in throughput) + "   (GB/s; hashes best of "
          f"{args.repeats})")
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        for size_gb in (float(s) for s in args.sizes.split(",")):
            path = Path(folder) / "checkpoint_file.pt"
            throughput["write"].append(size_gb / write_file(path, int(size_gb * 1e9)))
            row = [f"{throughput['write'][-1]:13.2f}"]
            for algorithm in algorithms:
                run = (lambda: file_checksum(path)) if algorithm == "file_checksum" else \
                    (lambda factory=available[algorithm]: hash_file(path, factory))
                rate = size_gb / best_seconds(run, args.repeats)
                throughput[algorithm].append(rate)
                row.append(f"{rate:13.2f}")
            print(f"{size_gb:8.2f} | " + " | ".join(row), flush=True)
            path.unlink()
    print(f"\nprojected time at save (file_checksum = {CHECKSUM_ALGORITHM}; write: writing the files), at each "
          "mean rate:")
    for algorithm in throughput:
        rate = sum(throughput[algorithm]) / len(throughput[algorithm])
        print(f"  {algorithm:>13}: " + ", ".join(
            f"{name} {model + optimizer:.2f} GB: {(model + optimizer) / rate:.2f} s on one process, "
            f"{model / rate:.2f} s spread" for name, (model, optimizer) in CHECKPOINTS.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
