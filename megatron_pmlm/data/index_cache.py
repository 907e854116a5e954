"""The training sampler's epoch order, built once per epoch into a file every rank memory-maps.

Drawing an epoch's permutation of all samples (and, with length bucketing, reading every sample's
length) in every rank costs >= 1.3 GB of private memory per rank at 80M samples, rebuilt at each
epoch start. As megatron-core's dataset index cache does, one process writes the epoch's order to
`DIR/<key>-epoch<E>.npy` (tmp file + rename, so a reader never sees half a file) and every rank
`np.load(mmap_mode="r")`s it: its pages are shared, file-backed, and each rank's private memory
stays O(1). The key holds everything the order depends on (samples, seed, shuffling, bucket size),
so runs with other settings never read a wrong file; when epoch E is written, the files of that
key older than epoch E - 1 are deleted (E - 1 is kept for a rank that still reads its end).

One writer: an exclusive `flock` on `DIR/<key>.lock` serialises the writers of one key, so on one
node (or a shared file system with working locks) the first rank builds and the others find the
file. Where the file system has no locks every rank may build: the files are identical and the
rename atomic, so the order is still right, only built more than once.
"""

from __future__ import annotations

import fcntl
import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import ConfigError
from ..files import open_output
from .samples import SamplesError

INDEX_CACHE_FOLDER = "index-cache"
"""The cache's default place: this folder inside the samples folder (`--index-cache` elsewhere)."""

SORT_CHUNK_SAMPLES = 1 << 22
"""Samples length-sorted per step when an epoch is built: bounds the writer's temporaries."""


def order_dtype(num_samples: int) -> np.dtype:
    """int32 while sample indices fit (half the file and page cache of int64), int64 beyond."""
    return np.dtype(np.int32 if num_samples <= np.iinfo(np.int32).max else np.int64)


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool = True, bucket_size: int = 0,
                lengths: np.ndarray | None = None) -> np.ndarray:
    """Epoch `epoch`'s samples in the order PretrainingSampler deals them out.

    The permutation seeded by (seed, epoch) (or 0..N-1 without shuffling), whole; with `lengths`,
    cut to whole buckets of `bucket_size` samples (one global batch each), and each bucket ordered
    longest first, ties in permutation order (a stable sort), as the sampler always did.
    """
    dtype = order_dtype(num_samples)
    order = (np.random.default_rng([seed, epoch]).permutation(num_samples) if shuffle
             else np.arange(num_samples))
    if lengths is None:
        return order.astype(dtype, copy=False)
    if len(lengths) != num_samples:
        raise ConfigError(f"{len(lengths)} sample lengths for {num_samples} samples")
    usable = num_samples - num_samples % bucket_size
    result = np.empty(usable, dtype=dtype)
    # A stable sort has one result whatever the algorithm; numpy's on 16-bit keys is a radix sort,
    # 4x faster than on int64 (80M samples: about 4 s instead of 16 s).
    key_dtype = np.int16 if num_samples == 0 or int(lengths.max()) < 2 ** 15 else np.int64
    span = max(1, SORT_CHUNK_SAMPLES // bucket_size) * bucket_size
    for first in range(0, usable, span):  # a few chunks of whole buckets, each sorted row-wise at once
        members = order[first:min(first + span, usable)].reshape(-1, bucket_size)
        longest_first = np.argsort(-lengths[members].astype(key_dtype), axis=1, kind="stable")
        result[first:first + span] = np.take_along_axis(members, longest_first, axis=1).ravel()
    return result


@dataclass(frozen=True)
class EpochOrderKey:
    """What an epoch order depends on; its `stem` names the cache files."""

    num_samples: int
    seed: int
    shuffle: bool
    bucket_size: int
    """Samples per length-sorted bucket (the global batch); 0: no bucketing, the whole permutation."""
    data: str
    """The samples' identity digest (and split): caches of different samples never mix."""

    @property
    def stem(self) -> str:
        data = re.sub(r"[^A-Za-z0-9_.-]", "_", self.data)
        return (f"order-{data}-n{self.num_samples}-seed{self.seed}-{'shuffled' if self.shuffle else 'sequential'}"
                f"-bucket{self.bucket_size}")

    def path(self, directory: Path, epoch: int) -> Path:
        return directory / f"{self.stem}-epoch{epoch}.npy"


def writable_cache_folder(directory: str | os.PathLike, default: bool) -> Path:
    """`directory`, created if needed and checked writable by writing a probe file there, or a
    SamplesError saying what to do (`default`: the folder inside the samples folder)."""
    directory = Path(directory)
    remedy = ("the samples folder is read-only? pass --index-cache DIR (a writable folder, shared by the "
              "ranks of a node or job)" if default else "pass a writable folder to --index-cache")
    probe = directory / f".probe-{socket.gethostname()}-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        probe.unlink()
    except OSError as error:
        raise SamplesError(f"cannot write the loader's index cache in {directory} ({error.strerror}); "
                           f"{remedy}") from None
    return directory


def index_cache_folder(data_path: str | os.PathLike, index_cache: str | os.PathLike | None = None) -> Path:
    """The checked, writable cache folder of a samples folder: `index_cache`, else DATA_PATH/index-cache."""
    if index_cache is None:
        return writable_cache_folder(Path(data_path) / INDEX_CACHE_FOLDER, default=True)
    return writable_cache_folder(index_cache, default=False)


class EpochOrderCache:
    """`order(epoch)`: the epoch's order memory-mapped from `directory`, built there first by one
    process if no file exists yet (`build(epoch)` gives the array)."""

    def __init__(self, directory: Path, key: EpochOrderKey, expected_length: int,
                 build: Callable[[int], np.ndarray]):
        self.directory, self.key, self.expected_length, self.build = Path(directory), key, expected_length, build
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dtype = order_dtype(key.num_samples)

    def order(self, epoch: int) -> np.ndarray:
        path = self.key.path(self.directory, epoch)
        if not path.is_file():
            with self._lock():
                if not path.is_file():  # another process may have written it while we waited
                    self._write(path, self.build(epoch))
                    self._delete_before(epoch - 1)
        return self._open(path)

    def _open(self, path: Path) -> np.ndarray:
        try:
            order = np.load(path, mmap_mode="r")
        except (OSError, ValueError) as error:
            raise SamplesError(f"{path}: not a readable index cache file ({error}); delete it to rebuild") from None
        if order.shape != (self.expected_length,) or order.dtype != self.dtype:
            raise SamplesError(f"{path}: holds {order.shape} {order.dtype}, expected ({self.expected_length},) "
                               f"{self.dtype}; delete it to rebuild")
        return order

    def _write(self, path: Path, order: np.ndarray) -> None:
        """Atomically: a private tmp file (created with the umask's permissions), then a rename."""
        order = np.ascontiguousarray(order, dtype=self.dtype)
        if order.shape != (self.expected_length,):
            raise RuntimeError(f"epoch order of {order.shape} built for {self.expected_length} samples")
        with open_output(path, binary=True) as handle:  # a fresh hidden tmp file, fsynced, renamed
            np.save(handle, order)

    def _delete_before(self, epoch: int) -> None:
        """This key's files of epochs before `epoch`, and tmp files a killed writer left of them
        (other keys' files belong to other runs)."""
        pattern = re.compile(r"\.?" + re.escape(self.key.stem) + r"-epoch(\d+)\.npy(\..+\.tmp)?")
        for path in self.directory.glob(f"*{self.key.stem}-epoch*.npy*"):
            match = pattern.fullmatch(path.name)
            if match and int(match.group(1)) < epoch:
                path.unlink(missing_ok=True)

    def _lock(self) -> "_FileLock":
        return _FileLock(self.directory / f"{self.key.stem}.lock")


class _FileLock:
    """An exclusive flock held for a `with` block; a no-op where the file system has no locks."""

    def __init__(self, path: Path):
        self.path, self.fd = path, None

    def __enter__(self) -> "_FileLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        except OSError:  # no locks here (some network file systems): identical files, atomic renames
            pass
        return self

    def __exit__(self, *exc) -> None:
        os.close(self.fd)  # releases the lock
