"""Where the model gets its tensor-parallel-aware building blocks.

The model is written once against the small `ParallelLayers` interface below; the layout decides
which implementation it receives. `LocalLayers` is tensor parallel size 1 (plain torch modules with
the same parameter shapes and names as their megatron-core counterparts), which serves single-GPU
training, conversion and the CPU tests. A megatron-core implementation (VocabParallelEmbedding,
Column/RowParallelLinear, vocab_parallel_cross_entropy) plugs in for tensor parallel sizes > 1
without touching the model.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn


class ParallelLayers(Protocol):
    tensor_parallel_size: int

    def vocab_embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Module:
        """Token embedding, split along the vocabulary; its `.weight` is also the tied softmax."""

    def column_linear(self, in_features: int, out_features: int) -> nn.Module:
        """y = xW^T + b with the output features split across ranks (input replicated)."""

    def row_linear(self, in_features: int, out_features: int) -> nn.Module:
        """y = xW^T + b with the input features split across ranks and the output all-reduced."""

    def tied_logits(self, hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        """hidden @ embedding_weight^T: this rank's slice of the vocabulary logits."""

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-row cross entropy in fp32 over the full (possibly split) vocabulary."""

    def predicted_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """Argmax over the full (possibly split) vocabulary."""


class LocalLayers:
    """Tensor parallel size 1: ordinary torch modules."""

    tensor_parallel_size = 1

    def vocab_embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Module:
        return nn.Embedding(num_embeddings, embedding_dim)

    def column_linear(self, in_features: int, out_features: int) -> nn.Module:
        return nn.Linear(in_features, out_features)

    def row_linear(self, in_features: int, out_features: int) -> nn.Module:
        return nn.Linear(in_features, out_features)

    def tied_logits(self, hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, embedding_weight)

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels, reduction="none")

    def predicted_ids(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)
