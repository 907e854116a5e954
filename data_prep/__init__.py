"""Offline data tools: corpora -> Megatron .bin/.idx (preprocess) -> samples with precomputed
block masks (build_samples) -> a look at one sample (inspect). See docs/data_prep.md."""
