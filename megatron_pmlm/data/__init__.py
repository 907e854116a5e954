"""Memory-mapped pre-training data: Megatron .bin/.idx corpora, built samples with precomputed
masks, and the resumable distributed loader the trainer reads (see docs/data_prep.md).

Names are imported lazily, so the offline tools (which need only `indexed` and `samples`) start
without importing torch.
"""

from importlib import import_module

_EXPORTS = {
    "IndexedDatasetError": "indexed", "IndexedDatasetReader": "indexed", "IndexedDatasetWriter": "indexed",
    "merge_indexed_datasets": "indexed", "token_dtype_for_vocab": "indexed",
    "PretrainingSamples": "samples", "SamplesError": "samples", "get_sample": "samples",
    "read_metadata": "samples",
    "PMLMBatchBuilder": "loader", "PMLMBatchLoader": "loader", "PretrainingLoaders": "loader",
    "PretrainingSampler": "loader", "build_pretraining_loaders": "loader", "DevicePrefetcher": "loader",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
