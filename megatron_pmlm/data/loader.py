"""Training-side reading: a resumable distributed sampler and PMLM batches from the memory maps.

Per batch the work is a few vectorized gathers (tokens, stored masks) and `layout.build_batch`;
nothing loops over tokens in Python. The sampler is a pure function of (seed, epoch,
consumed_samples), so a restart from a checkpoint's `consumed_samples` continues exactly where
the interrupted run would have gone: no sample seen twice, none skipped. The trainer reads the
batches through a `DevicePrefetcher`: the next micro batch is built in a background thread and
copied to the device (from pinned memory, without blocking) while the current one trains.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..config import ConfigError
from ..models.layout import PMLMBatch
from ..models.objectives import Objective, get_objective
from .batches import build_batch
from .index_cache import SORT_CHUNK_SAMPLES, EpochOrderCache, EpochOrderKey, epoch_order, index_cache_folder
from .masking import ExampleMasks, splitmix64 as _splitmix64
from .samples import PretrainingSamples, SamplesError, data_identity, open_corpora, read_metadata



def single_token_step_keys(seed: int, sample_indices: np.ndarray, epoch: int,
                           mask_counts: np.ndarray) -> np.ndarray:
    """Random sort keys for every masked slot of a batch, a function of (seed, sample, epoch, slot)
    only: the AR step order of a sample does not depend on what else is in its batch."""
    with np.errstate(over="ignore"):
        per_sample = _splitmix64(_splitmix64(np.uint64(seed) * np.uint64(1_000_003) + np.uint64(epoch))
                                 ^ np.asarray(sample_indices, dtype=np.uint64))
        slots = np.arange(int(mask_counts.sum())) - np.repeat(np.cumsum(mask_counts) - mask_counts, mask_counts)
        return _splitmix64(np.repeat(per_sample, mask_counts) ^ slots.astype(np.uint64))


def to_single_token_steps(masks: list[ExampleMasks], sample_indices: np.ndarray, epoch: int,
                          seed: int) -> list[ExampleMasks]:
    """AR objective: each stored masked position becomes its own step, in a random order drawn
    from (seed, sample index, epoch) - deterministic, vectorized over the whole batch."""
    counts = np.array([len(m.masked_positions) for m in masks], dtype=np.int64)
    if counts.sum() == 0:
        return masks
    rows = np.repeat(np.arange(len(masks)), counts)
    keys = single_token_step_keys(seed, sample_indices, epoch, counts)
    order = np.lexsort((keys, rows))
    positions = np.concatenate([m.masked_positions for m in masks])[order]
    corrupted = np.concatenate([m.corrupted_ids for m in masks])[order]
    steps = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts) + 1
    cuts = np.cumsum(counts)[:-1]
    return [ExampleMasks(p, s, c) for p, s, c in
            zip(np.split(positions, cuts), np.split(steps, cuts), np.split(corrupted, cuts))]


class PMLMBatchBuilder:
    """Sample indices (+ training epoch) -> PMLMBatch through `layout.build_batch`."""

    def __init__(self, samples: PretrainingSamples, objective: Objective, seed: int,
                 max_length: int | None = None):
        self.samples, self.objective, self.seed, self.max_length = samples, objective, seed, max_length

    def __call__(self, indices: np.ndarray, epoch: int) -> PMLMBatch:
        indices = np.asarray(indices, dtype=np.int64)
        input_ids, segment_ids = self.samples.tokens(indices)
        masks = self.samples.masks(indices, epoch)
        if self.objective.single_token_steps:
            masks = to_single_token_steps(masks, indices, epoch, self.seed)
        special = self.samples.special
        return build_batch(input_ids, segment_ids, masks, special.pseudo, special.pad,
                           append_pseudo=self.objective.pseudo_masked, max_length=self.max_length,
                           predict_masked=self.objective.autoencoding)


def batch_builder(samples: PretrainingSamples, objective: Objective, seed: int, max_length: int | None,
                  unilm_masking=None):
    """The objective's batch builder: PMLM (stored block masks) or UniLM v1 (masks drawn here, with
    `unilm_masking`, a config.UniLMMaskingConfig; None: the paper's values)."""
    if objective.is_unilm:
        from ..config import UniLMMaskingConfig
        from .unilm_batches import UniLMBatchBuilder

        return UniLMBatchBuilder(samples, objective, seed, max_length, unilm_masking or UniLMMaskingConfig())
    return PMLMBatchBuilder(samples, objective, seed, max_length)


class PretrainingSampler:
    """Which samples data-parallel rank r reads next, Megatron-style, resumable from consumed_samples.

    Each global step takes micro_batch_size x data_parallel_size samples from epoch e's permutation
    of the split (seeded by (seed, e); the tail that does not fill a global step is dropped and
    reshuffled into the next epoch). `consumed_samples` counts samples over all ranks, as Megatron's
    checkpoints do. Yields (indices of this rank's micro batch, epoch).

    Length bucketing (`sample_lengths` and `global_batch_size` given): the samples of each global
    batch (one optimizer step: micro batch x data-parallel size x accumulation steps) are ordered
    longest first before they are dealt out as micro batches, so a micro batch holds samples of
    similar lengths and its layout (longest sequence + 2 x most masked tokens) carries less padding.
    Which samples make up each optimizer step does not change, and the micro batches are the same
    for every data-parallel size with the same global batch. Epochs then hold whole global batches.
    `sample_lengths` may be a function returning them, called only where an epoch order is built.

    `index_cache` (a folder): each epoch's order (index_cache.epoch_order) is built once, by one
    process, into a file there that every rank memory-maps, so a rank's private memory stays O(1)
    (`cache_data` names the samples in the file names). Without it the order is held in memory.
    """

    def __init__(self, num_samples: int, consumed_samples: int, micro_batch_size: int,
                 data_parallel_rank: int = 0, data_parallel_size: int = 1, seed: int = 1234,
                 shuffle: bool = True, global_batch_size: int | None = None,
                 sample_lengths: np.ndarray | Callable[[], np.ndarray] | None = None,
                 index_cache: str | os.PathLike | None = None, cache_data: str = "samples"):
        if micro_batch_size < 1 or data_parallel_size < 1:
            raise ConfigError("micro_batch_size and data_parallel_size must be >= 1")
        if not 0 <= data_parallel_rank < data_parallel_size:
            raise ConfigError(f"data_parallel_rank {data_parallel_rank} outside data_parallel_size "
                              f"{data_parallel_size}")
        self.global_batch = micro_batch_size * data_parallel_size
        if num_samples < self.global_batch:
            raise ConfigError(f"{num_samples} samples cannot fill one step of micro batch "
                              f"{micro_batch_size} x {data_parallel_size} data-parallel ranks")
        if consumed_samples < 0 or consumed_samples % self.global_batch:
            raise ConfigError(f"consumed_samples {consumed_samples} is not a multiple of micro batch x "
                              f"data-parallel size ({self.global_batch})")
        self.num_samples, self.consumed_samples = num_samples, consumed_samples
        self.micro_batch_size, self.rank, self.seed, self.shuffle = micro_batch_size, data_parallel_rank, seed, shuffle
        self.sample_lengths = None
        self.bucket_size = self.global_batch
        if sample_lengths is not None and global_batch_size is not None:
            if global_batch_size % self.global_batch:
                raise ConfigError(f"global batch size {global_batch_size} is not a multiple of micro batch x "
                                  f"data-parallel size ({self.global_batch})")
            if not callable(sample_lengths) and len(sample_lengths) != num_samples:
                raise ConfigError(f"{len(sample_lengths)} sample lengths for {num_samples} samples")
            if num_samples < global_batch_size:
                raise ConfigError(f"{num_samples} samples cannot fill one global batch of {global_batch_size}")
            self.sample_lengths = sample_lengths
            self.bucket_size = global_batch_size
        self.samples_per_epoch = num_samples - num_samples % self.bucket_size
        self._epoch, self._order = -1, None
        self.cache = None
        if index_cache is not None:
            bucketed = self.sample_lengths is not None
            key = EpochOrderKey(num_samples, seed, shuffle, self.bucket_size if bucketed else 0, cache_data)
            self.cache = EpochOrderCache(Path(index_cache), key, self.samples_per_epoch if bucketed else num_samples,
                                         self.build_order)

    def build_order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order, computed here (the lengths read only now)."""
        lengths = self.sample_lengths() if callable(self.sample_lengths) else self.sample_lengths
        return epoch_order(self.num_samples, self.seed, epoch, self.shuffle, self.bucket_size,
                           None if lengths is None else np.asarray(lengths))

    def order(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s samples in dealing order (each global batch longest first with bucketing):
        the cache file's memory map, or an array held here without a cache."""
        if epoch != self._epoch:
            self._order = None  # the previous epoch's map or array goes first
            self._order = self.cache.order(epoch) if self.cache is not None else self.build_order(epoch)
            self._epoch = epoch
        return self._order

    def __iter__(self) -> Iterator[tuple[np.ndarray, int]]:
        return self

    def __next__(self) -> tuple[np.ndarray, int]:
        epoch, offset = divmod(self.consumed_samples, self.samples_per_epoch)
        start = offset + self.rank * self.micro_batch_size
        indices = np.array(self.order(epoch)[start:start + self.micro_batch_size], dtype=np.int64)
        self.consumed_samples += self.global_batch
        return indices, epoch


class PMLMBatchLoader:
    """Endless iterator of PMLMBatch for one data-parallel rank; `consumed_samples` goes in the
    checkpoint and comes back as `build_pretraining_loaders(consumed_samples=...)`."""

    def __init__(self, sampler: PretrainingSampler, builder: PMLMBatchBuilder):
        self.sampler, self.builder = sampler, builder

    @property
    def consumed_samples(self) -> int:
        return self.sampler.consumed_samples

    def __iter__(self) -> "PMLMBatchLoader":
        return self

    def __next__(self) -> PMLMBatch:
        indices, epoch = next(self.sampler)
        return self.builder(indices, epoch)


class DevicePrefetcher:
    """Micro batches on the device, the next ones built and copied while the current one trains.

    Wraps any iterator of batch dataclasses (PMLMBatch, PalmBatch: tensor fields and
    `num_tokens()`). A background thread takes batches from it in order, counts their tokens on
    the host, and on CUDA pins them and copies them on a side stream with `non_blocking=True`;
    `next` makes the compute stream wait for that copy (an event, not a host wait), so reading a
    batch never stalls the host. On the CPU the batches pass as they are.

    Order and content are the source's: the thread reads at most `depth` + 1 batches ahead, and
    what it read but nobody took is dropped at `close`, which is harmless because a resumed run
    rebuilds its loader from the checkpoint's `consumed_samples` (the Trainer's count of the
    batches trained, not the sampler's, which runs ahead). The batch builders draw no global
    random numbers, so building in another thread changes no result.

    `tokens`: the tokens of the batches handed out so far (what throughput is counted in).
    An error in the source is raised by `next`, with its traceback; `close` (or leaving the `with`
    block) stops the thread on every way out, a signal's included.
    """

    _END = object()
    JOIN_SECONDS = 60.0
    """How long `close` waits for a batch being built; the thread is a daemon past that."""

    def __init__(self, batches: Iterator[Any], device: torch.device | str, depth: int = 1,
                 background: bool = True):
        self.source = iter(batches)
        self.device = torch.device(device)
        self.tokens = 0
        self._cuda = self.device.type == "cuda"
        if self._cuda and self.device.index is None:  # the thread sets its device by index
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._finished = False
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._fill, name="batch-prefetch", daemon=True)
            self._thread.start()

    # ---------------------------------------------------------------- the background thread
    def _prepare(self, batch: Any) -> tuple[Any, int, Any]:
        """(the batch on the device, its tokens, the copy's CUDA event or None)."""
        tokens = batch.num_tokens()
        if not self._cuda:
            return _map_tensors(batch, lambda tensor: tensor.to(self.device)), tokens, None
        with torch.cuda.stream(self._stream):
            moved = _map_tensors(batch, lambda tensor: tensor.pin_memory().to(self.device, non_blocking=True))
            copied = torch.cuda.Event()
            copied.record(self._stream)
        return moved, tokens, copied

    def _fill(self) -> None:
        if self._cuda:
            torch.cuda.set_device(self.device)
        while not self._stop.is_set():
            try:
                item = self._prepare(next(self.source))
            except StopIteration:
                item = self._END
            except BaseException as error:  # noqa: BLE001 (handed to the consumer, raised there)
                item = error
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not isinstance(item, tuple):
                return

    # ---------------------------------------------------------------- the consumer
    def __iter__(self) -> "DevicePrefetcher":
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        if self._thread is None:
            try:
                item = self._prepare(next(self.source))
            except StopIteration:
                item = self._END
        else:
            item = self._queue.get()
        if not isinstance(item, tuple):
            self._finished = True
            if item is self._END:
                raise StopIteration
            raise item
        batch, tokens, copied = item
        if copied is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(copied)
            # Memory made on the copy stream is used on the compute stream: the allocator must
            # not reuse it before the compute stream is done with it.
            for field in dataclasses.fields(batch):
                if isinstance(getattr(batch, field.name), torch.Tensor):
                    getattr(batch, field.name).record_stream(compute)
        self.tokens += tokens
        return batch

    def close(self) -> None:
        """Stop the thread (it finishes the batch in hand) and drop what it prefetched."""
        self._stop.set()
        self._finished = True
        if self._thread is not None:
            while True:
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join(self.JOIN_SECONDS)

    def __enter__(self) -> "DevicePrefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _map_tensors(batch: Any, function: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """The batch dataclass with `function` applied to each tensor field (others kept)."""
    return dataclasses.replace(batch, **{field.name: function(getattr(batch, field.name))
                                         for field in dataclasses.fields(batch)
                                         if isinstance(getattr(batch, field.name), torch.Tensor)})


def validation_batches(samples: PretrainingSamples, builder: PMLMBatchBuilder, micro_batch_size: int,
                       data_parallel_rank: int, data_parallel_size: int) -> Iterator[PMLMBatch]:
    """The split in order with mask epoch 0, so validation losses compare over time; endless."""
    step = micro_batch_size * data_parallel_size
    order = np.arange(len(samples))
    if len(order) < step:  # a tiny split wraps around so every rank still gets a full batch
        order = np.resize(order, step)
    usable = len(order) - len(order) % step
    while True:
        for start in range(0, usable, step):
            first = start + data_parallel_rank * micro_batch_size
            yield builder(order[first:first + micro_batch_size], 0)


@dataclass
class PretrainingLoaders:
    train: PMLMBatchLoader
    valid: Callable[[], Iterator[PMLMBatch]] | None
    """A fresh validation iterator per call (the Trainer's `valid_batches`), None without samples."""
    train_samples: PretrainingSamples
    valid_samples: PretrainingSamples | None
    metadata: dict


def build_pretraining_loaders(data_path: str | os.PathLike, micro_batch_size: int,
                              data_parallel_rank: int = 0, data_parallel_size: int = 1,
                              consumed_samples: int = 0, objective: str | Objective = "ae+par",
                              seed: int | None = None, max_length: int | None = None,
                              split: str | None = None, vocab_size: int | None = None,
                              global_batch_size: int | None = None, unilm_masking=None,
                              index_cache: str | os.PathLike | None = None) -> PretrainingLoaders:
    """Train/valid PMLMBatch iterators over a `data_prep.build_samples` output directory.

    `seed` (default: the build's seed) drives the epoch shuffles and the AR step orders;
    `split` and `vocab_size`, when given, must match the build (a clear error otherwise);
    `global_batch_size` turns on the sampler's length bucketing within each global batch;
    `unilm_masking` (config.UniLMMaskingConfig) sets UniLM v1 objectives' masking and NSP;
    `index_cache`: the folder of the epoch-order cache (default: `index-cache` in `data_path`).
    """
    metadata = read_metadata(data_path)
    if split is not None and split != metadata["split"]:
        raise SamplesError(f"{data_path} was built with --split {metadata['split']}, not {split}; "
                           f"rebuild or drop the split argument")
    if vocab_size is not None and vocab_size != metadata["vocab_size"]:
        raise SamplesError(f"{data_path} was built with a vocabulary of {metadata['vocab_size']} entries, "
                           f"the model has {vocab_size}")
    if max_length is not None and metadata["seq_length"] > max_length:
        raise ConfigError(f"{data_path} holds samples of up to {metadata['seq_length']} tokens, more than "
                          f"the model's {max_length} positions")
    objective = get_objective(objective) if isinstance(objective, str) else objective
    seed = metadata["seed"] if seed is None else seed
    return samples_loaders(data_path, metadata, lambda samples: batch_builder(samples, objective, seed, max_length,
                                                                             unilm_masking),
                           micro_batch_size, data_parallel_rank, data_parallel_size, consumed_samples, seed,
                           global_batch_size, index_cache)


def compact_lengths(samples: PretrainingSamples) -> np.ndarray:
    """Every sample's length as int32, read in chunks of rows: what the epoch-order writer sorts by,
    at 4 bytes a sample (80M samples: 320 MB) without int64 temporaries of the whole split."""
    lengths = np.empty(len(samples), dtype=np.int32)
    for first in range(0, len(samples), SORT_CHUNK_SAMPLES):
        lengths[first:first + SORT_CHUNK_SAMPLES] = samples.lengths(first, first + SORT_CHUNK_SAMPLES)
    return lengths


def samples_loaders(data_path: str | os.PathLike, metadata: dict, make_builder: Callable[[PretrainingSamples], Any],
                    micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int, consumed_samples: int,
                    seed: int, global_batch_size: int | None,
                    index_cache: str | os.PathLike | None = None) -> PretrainingLoaders:
    """Train/valid loaders over a checked samples directory, whatever its batches (PMLM, UniLM v1,
    PALM): the resumable sampler over the training samples (length bucketing within each global
    batch when `global_batch_size` is given; its epoch orders cached in `index_cache`, default
    DATA_PATH/index-cache, which must be writable), `make_builder(samples)` for each split's
    batches, and the validation samples in order."""
    cache_folder = index_cache_folder(data_path, index_cache)
    corpora = open_corpora(metadata, Path(data_path))
    train_samples = PretrainingSamples(data_path, "train", corpora)
    sampler = PretrainingSampler(len(train_samples), consumed_samples, micro_batch_size,
                                 data_parallel_rank, data_parallel_size, seed, global_batch_size=global_batch_size,
                                 sample_lengths=(lambda: compact_lengths(train_samples)) if global_batch_size else None,
                                 index_cache=cache_folder, cache_data=f"{data_identity(metadata)['digest']}-train")
    train = PMLMBatchLoader(sampler, make_builder(train_samples))
    valid_samples, valid = None, None
    if metadata["splits"].get("valid", {}).get("num_samples", 0) > 0:
        valid_samples = PretrainingSamples(data_path, "valid", corpora)
        valid_builder = make_builder(valid_samples)

        def valid_batches() -> Iterator[PMLMBatch]:
            return validation_batches(valid_samples, valid_builder, micro_batch_size,
                                      data_parallel_rank, data_parallel_size)
        valid = valid_batches
    return PretrainingLoaders(train, valid, train_samples, valid_samples, metadata)
