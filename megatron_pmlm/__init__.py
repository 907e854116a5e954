"""megatron-pmlm: pre-training UniLMv2's pseudo-masked language model at scale."""

__version__ = "0.1.0"
