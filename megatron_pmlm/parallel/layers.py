"""Where the model gets its tensor-parallel-aware building blocks.

The model is written once against the small `ParallelLayers` interface below; the layout decides
which implementation it receives. `LocalLayers` is tensor parallel size 1 (plain torch modules with
the same parameter shapes and names as their megatron-core counterparts), which serves single-GPU
training, conversion and the CPU tests. A megatron-core implementation (VocabParallelEmbedding,
Column/RowParallelLinear, vocab_parallel_cross_entropy) plugs in for tensor parallel sizes > 1
without touching the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import nn


class ParallelLayers(Protocol):
    tensor_parallel_size: int
    tensor_parallel_rank: int

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

    def biased_cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor,
                             label_smoothing: "LabelSmoothing | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(per-row cross entropy in fp32, argmax ids) of `logits + bias`: the MLM losses, where the
        head hands over its logits in the compute dtype and its output bias apart (`bias`: this
        rank's slice, -inf at vocabulary padding); with `label_smoothing`, s2s fine-tuning's KL."""


CROSS_ENTROPY_CHUNK_ROWS = 4096
"""Rows of logits `chunked_biased_cross_entropy` turns into fp32 at a time: at a padded BERT
vocabulary (30,592) a chunk is 0.5 GB of fp32, whatever the number of predicted slots."""


@dataclass(frozen=True)
class LabelSmoothing:
    """The optional label-smoothing term of `chunked_biased_cross_entropy`: s2s-ft's
    LabelSmoothingLoss (SPEC §7.1 A.5), the per-row KL(q || p) with q(label) = 1 - epsilon,
    q(pad_id) = 0 and epsilon / (vocab_size - 2) on every other id below `vocab_size`; ids from
    `vocab_size` up (the vocabulary padding) are outside both distributions."""

    epsilon: float
    """The smoothing mass (s2s-ft --label_smoothing, 0.1), in (0, 1)."""
    vocab_size: int
    """The real vocabulary: the columns q spreads over, the padding columns after them excluded."""
    pad_id: int
    """The id q gives nothing (s2s-ft's ignore_index, [PAD])."""

    def __post_init__(self) -> None:
        if not 0.0 < self.epsilon < 1.0:
            raise ValueError(f"label smoothing must be in (0, 1), got {self.epsilon}")
        if self.vocab_size < 3 or not 0 <= self.pad_id < self.vocab_size:
            raise ValueError(f"label smoothing needs a vocabulary of >= 3 ids holding pad id {self.pad_id}, "
                             f"got {self.vocab_size}")

    @property
    def spread(self) -> float:
        """q of every id other than the label and pad."""
        return self.epsilon / (self.vocab_size - 2)

    def entropy(self) -> torch.Tensor:
        """sum_v q log q, the KL's constant: a 0-dim fp32 CPU tensor computed as the former closed form
        did (a CPU scalar in the loss's arithmetic, not a value the host waits for)."""
        spread = self.spread
        return ((1.0 - self.epsilon) * torch.log(torch.tensor(1.0 - self.epsilon))
                + (self.vocab_size - 2) * spread * torch.log(torch.tensor(spread)))


class _ChunkedBiasedCrossEntropy(torch.autograd.Function):
    """Cross entropy of `logits + bias` over row chunks, without an fp32 [rows, vocab] tensor.

    Per chunk: the biased logits in fp32 (`(chunk + bias).float()`: the same values, dtype
    promotion included, as adding the bias first and calling F.cross_entropy on `.float()`), their
    logsumexp, the target's logit and the argmax; with label smoothing the chunk's fused
    log-softmax instead (the former loss's log-probabilities, bit for bit), its sums over the real
    vocabulary and the logsumexp read off it. Saved for the backward: the logits as they
    came (compute dtype), the bias and the fp32 logsumexp per row; the backward recomputes each
    chunk's softmax and subtracts the target distribution (one-hot, or the smoothed q), so the only
    [rows, vocab] tensors are the logits and their gradient, both in the compute dtype.
    F.cross_entropy or log_softmax on `.float()` logits instead keeps an fp32 [rows, vocab]
    log-softmax alive from the forward to the backward.
    """

    @staticmethod
    def forward(ctx, logits, labels, bias, chunk_rows, smoothing):
        rows = logits.shape[0]
        losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
        log_partition = torch.empty_like(losses)
        predicted = torch.empty(rows, dtype=torch.long, device=logits.device)
        with torch.autocast(logits.device.type, enabled=False):  # fp32 by construction, whatever the context
            _chunked_forward(logits, labels, bias, chunk_rows, smoothing, losses, log_partition, predicted)
        ctx.save_for_backward(logits, labels, bias, log_partition)
        ctx.chunk_rows, ctx.smoothing = chunk_rows, smoothing
        ctx.mark_non_differentiable(predicted)
        return losses, predicted

    @staticmethod
    def backward(ctx, grad_losses, _grad_predicted):
        logits, labels, bias, log_partition = ctx.saved_tensors
        with torch.autocast(logits.device.type, enabled=False):
            grad_logits, grad_bias = _chunked_backward(logits, labels, bias, log_partition, grad_losses,
                                                       ctx.chunk_rows, ctx.smoothing)
        return grad_logits, None, grad_bias, None, None


def row_chunks(rows, chunk_rows: int) -> list[slice]:
    """The row slices of the chunks: one slice of every row when they fit in one chunk, and always
    inside a compiled region (--compile), which keeps the number of rows symbolic: a loop over it
    (or a test against `chunk_rows`) makes each count a compilation of its own, which on one H100
    at micro batch 256 (~9,800 slots, over 4,096) recompiled the losses at every step. Compiled, the
    fp32 cast is fused into the kernels that read it (the forward's reductions, the backward's
    pointwise chain: `_minus_target`), so no fp32 chunk is written and none needs bounding."""
    if torch.compiler.is_compiling() or rows <= chunk_rows:
        return [slice(None)]
    return [slice(start, min(rows, start + chunk_rows)) for start in range(0, rows, chunk_rows)]


def _biased_chunk(logits: torch.Tensor, bias: torch.Tensor | None, rows: slice,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows `rows` of `logits + bias` in fp32 (a new tensor, or `out` when given)."""
    if bias is None:
        return logits[rows].float() if out is None else out.copy_(logits[rows])
    return (logits[rows] + bias).float() if out is None else torch.add(logits[rows], bias, out=out)


def _chunked_forward(logits, labels, bias, chunk_rows, smoothing, losses, log_partition, predicted) -> None:
    entropy = None if smoothing is None else smoothing.entropy()
    for rows in row_chunks(logits.shape[0], chunk_rows):
        chunk = _biased_chunk(logits, bias, rows)
        predicted[rows] = chunk.argmax(dim=-1)
        if smoothing is None:
            log_partition[rows] = torch.logsumexp(chunk, dim=-1)
            losses[rows] = log_partition[rows] - chunk.gather(-1, labels[rows, None])[:, 0]
            continue
        # KL(q || p) = sum q log q - (1 - eps) log p(label) - spread * (sum_{v < V} log p(v) - log p(label)
        # - log p(pad)), from the fused log-softmax, as the former closed form took it. Its logsumexp
        # for the backward is read off at the row's maximum, where log p = -(logsumexp - max) exactly.
        log_probs = torch.log_softmax(chunk, dim=-1)
        at_maximum = predicted[rows, None]
        log_partition[rows] = (chunk.gather(-1, at_maximum) - log_probs.gather(-1, at_maximum))[:, 0]
        label_log_probs = log_probs.gather(-1, labels[rows, None])[:, 0]
        others = (log_probs[:, :smoothing.vocab_size].sum(-1) - label_log_probs
                  - log_probs[:, smoothing.pad_id])
        losses[rows] = (entropy - (1.0 - smoothing.epsilon) * label_log_probs
                        - smoothing.spread * others)


def _chunked_backward(logits, labels, bias, log_partition, grad_losses, chunk_rows, smoothing):
    """Each chunk's gradient, softmax - q times the loss's gradient, is computed in place: in the
    fp32 gradient itself when the logits are fp32, else in one fp32 chunk that is then rounded into
    the gradient."""
    promoted = logits.dtype if bias is None else torch.promote_types(logits.dtype, bias.dtype)
    compiling = torch.compiler.is_compiling()  # one chunk (`row_chunks`), its gradient made, not written into
    grad_logits = None if compiling else torch.empty_like(logits)
    in_place = not compiling and grad_logits.dtype == promoted == torch.float32
    grad_bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    label_weight = -1.0 if smoothing is None else smoothing.spread - (1.0 - smoothing.epsilon)
    for rows in row_chunks(logits.shape[0], chunk_rows):
        grad = _biased_chunk(logits, bias, rows, out=grad_logits[rows] if in_place else None)
        grad = _minus_target(grad.sub_(log_partition[rows, None]).exp_(), labels[rows], label_weight, smoothing)
        grad.mul_(grad_losses[rows, None].float())
        if not in_place:
            grad = grad.to(promoted)
            if compiling:
                grad_logits = grad.to(logits.dtype)
            else:
                grad_logits[rows] = grad
        if grad_bias is not None:
            grad_bias += grad.float().sum(0)
    return grad_logits, None if bias is None else grad_bias.to(bias.dtype)


def _minus_target(probabilities: torch.Tensor, labels: torch.Tensor, label_weight: float,
                  smoothing: LabelSmoothing | None) -> torch.Tensor:
    """`probabilities - q` (q: 1 at the label, or with `smoothing` spread below vocab_size, 0 at pad and
    1 - eps at the label; `label_weight` is what the label adds on top of the spread). Eager: in
    place, two slices and a scatter. Compiled: one pointwise expression of the column index, which
    inductor fuses with the exp before it and the casts after it, where a scatter would have it
    write the fp32 [rows, vocab] probabilities out first (1.2 GB at ~9,800 slots of 30,592 ids)."""
    if torch.compiler.is_compiling():
        columns = torch.arange(probabilities.shape[-1], device=probabilities.device)
        offset = torch.where(columns == labels[:, None], label_weight, 0.0)
        if smoothing is not None:
            offset = (offset - torch.where(columns < smoothing.vocab_size, smoothing.spread, 0.0)
                      + torch.where(columns == smoothing.pad_id, smoothing.spread, 0.0))
        return probabilities + offset
    if smoothing is not None:
        probabilities[:, :smoothing.vocab_size] -= smoothing.spread
        probabilities[:, smoothing.pad_id] += smoothing.spread
    return probabilities.scatter_add_(-1, labels[:, None], probabilities.new_full((probabilities.shape[0], 1),
                                                                                  label_weight))


def chunked_biased_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
                                 chunk_rows: int | None = None,
                                 label_smoothing: LabelSmoothing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 cross entropy per row, argmax per row) of `logits + bias` (bias broadcast over rows;
    None: no bias), equal to F.cross_entropy((logits + bias).float(), labels, reduction="none") and
    its argmax, with at most `chunk_rows` (None: CROSS_ENTROPY_CHUNK_ROWS) rows in fp32 at a time
    (`_ChunkedBiasedCrossEntropy`). With `label_smoothing`, the loss per row is its KL(q || p)
    instead (s2s fine-tuning)."""
    chunk_rows = chunk_rows or CROSS_ENTROPY_CHUNK_ROWS
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    if label_smoothing is not None and label_smoothing.vocab_size > logits.shape[-1]:
        raise ValueError(f"label smoothing over {label_smoothing.vocab_size} ids, but the logits have "
                         f"{logits.shape[-1]} columns")
    return _ChunkedBiasedCrossEntropy.apply(logits, labels, bias, chunk_rows, label_smoothing)


class LocalLayers:
    """Tensor parallel size 1: ordinary torch modules."""

    tensor_parallel_size = 1
    tensor_parallel_rank = 0

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

    def biased_cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor,
                             label_smoothing: LabelSmoothing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return chunked_biased_cross_entropy(logits, labels, bias, label_smoothing=label_smoothing)


class MegatronCoreLayers:
    """Tensor parallel size > 1 (or 1): megatron-core's parallel layers over its TP group.

    Requires `megatron.core.parallel_state` to be initialised (see `distributed.py`). Parameter
    names and per-rank shapes follow `TENSOR_PARALLEL_SPLITS`, which is also what checkpoint
    conversion uses to merge shards.
    """

    def __init__(self, init_std: float = 0.02, params_dtype=None):
        from megatron.core import parallel_state
        from megatron.core.model_parallel_config import ModelParallelConfig

        self.tensor_parallel_size = parallel_state.get_tensor_model_parallel_world_size()
        self.tensor_parallel_rank = parallel_state.get_tensor_model_parallel_rank()
        # The model overwrites every weight (model.initialize_weights: the same values for any
        # layout). megatron-core's own initialisation still runs because it is what marks the split
        # parameters (`tensor_model_parallel`, which gradient norms rely on); on the CPU, which keeps
        # its CUDA RNG tracker out of the way. DeepSpeed moves the module to the GPU.
        self._config = ModelParallelConfig(
            tensor_model_parallel_size=self.tensor_parallel_size,
            use_cpu_initialization=True,
            params_dtype=params_dtype or torch.float32,
            perform_initialization=True)
        self._init = lambda weight: nn.init.normal_(weight, std=init_std)

    def vocab_embedding(self, num_embeddings: int, embedding_dim: int) -> nn.Module:
        from megatron.core.tensor_parallel import VocabParallelEmbedding

        return VocabParallelEmbedding(num_embeddings, embedding_dim, init_method=self._init,
                                      config=self._config)

    def column_linear(self, in_features: int, out_features: int) -> nn.Module:
        return _column_parallel_linear_class()(in_features, out_features, config=self._config,
                                               init_method=self._init, bias=True, gather_output=False)

    def row_linear(self, in_features: int, out_features: int) -> nn.Module:
        return _row_parallel_linear_class()(in_features, out_features, config=self._config,
                                            init_method=self._init, bias=True, input_is_parallel=True,
                                            skip_bias_add=False)

    def tied_logits(self, hidden: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

        return F.linear(copy_to_tensor_model_parallel_region(hidden), embedding_weight)

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

        return vocab_parallel_cross_entropy(logits.float(), labels)

    def predicted_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """Argmax over the split vocabulary: each rank's best (score, id), then the best of those."""
        from megatron.core import parallel_state

        local_best, local_index = logits.detach().float().max(dim=-1)
        global_index = local_index + self.tensor_parallel_rank * logits.shape[-1]
        candidates = torch.stack([local_best, global_index.float()])
        gathered = [torch.empty_like(candidates) for _ in range(self.tensor_parallel_size)]
        torch.distributed.all_gather(gathered, candidates,
                                     group=parallel_state.get_tensor_model_parallel_group())
        stacked = torch.stack(gathered)  # [tp, 2, n]
        winner = stacked[:, 0].argmax(dim=0)
        return stacked[:, 1].gather(0, winner[None])[0].long()

    def biased_cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor,
                             label_smoothing: LabelSmoothing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """megatron-core's vocab_parallel_cross_entropy over the biased logits (it needs them whole).
        Its own label smoothing spreads over every id, label included, unlike s2s-ft's: refused."""
        if label_smoothing is not None:
            raise NotImplementedError("s2s-ft's label smoothing runs at tensor parallel size 1 (LocalLayers)")
        biased = logits + bias
        return self.cross_entropy(biased, labels), self.predicted_ids(biased)


def _column_parallel_linear_class():
    """ColumnParallelLinear returning just the output tensor (same parameter names)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class ColumnLinear(ColumnParallelLinear):
        def forward(self, input_):  # noqa: D102 - megatron returns (output, bias)
            return super().forward(input_)[0]

    return ColumnLinear


def _row_parallel_linear_class():
    from megatron.core.tensor_parallel import RowParallelLinear

    class RowLinear(RowParallelLinear):
        def forward(self, input_):  # noqa: D102
            return super().forward(input_)[0]

    return RowLinear



def fused_column_linear(input_: torch.Tensor, linears: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """Each of `linears`' outputs for the same input, from ONE GEMM over their stacked weights.

    The linears (column-parallel: nn.Linear at TP=1, megatron-core's ColumnParallelLinear above)
    keep their own parameters, so names, shapes, tensor-parallel splits and per-parameter optimizer
    state are untouched; only the forward stacks this rank's shards [W_1; W_2; ...] (a copy the
    size of the weights, whose backward is a split) and cuts the output back into views. Under
    tensor parallelism the input gradient is all-reduced once instead of once per linear.

    Falls back to one call per linear where stacking would be wrong: parameters partitioned by
    ZeRO-3 (they are gathered only when their own module runs) and megatron-core options whose
    forward is more than "replicated input, local linear" (sequence parallelism, gradient
    accumulation fusion, deferred weight gradients, gathered outputs, separate bias).
    """
    output = fused_column_output(input_, linears)
    if output is None:
        return tuple(linear(input_) for linear in linears)
    return output.split([linear.weight.shape[0] for linear in linears], dim=-1)


def fused_column_output(input_: torch.Tensor, linears: Sequence[nn.Module],
                        bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """`fused_column_linear`'s one GEMM, its output unsplit ([..., the linears' outputs side by side]),
    for a consumer that reads it whole and returns its gradient whole (the triton attention's packed
    q, k, v: no concatenation of three gradients); None where the linears cannot be fused. `bias`:
    added instead of the linears' biases stacked (the caller's: detached, when their gradient reaches
    them another way)."""
    if not _can_fuse(linears):
        return None
    weight = torch.cat([linear.weight for linear in linears])
    bias = torch.cat([linear.bias for linear in linears]) if bias is None else bias
    first = linears[0]
    if isinstance(first, nn.Linear):
        return F.linear(input_, weight, bias)
    return _megatron_column_linear(first, input_, weight, bias)


def _can_fuse(linears: Sequence[nn.Module]) -> bool:
    if any(hasattr(param, "ds_id") for linear in linears for param in linear.parameters(recurse=False)):
        return False  # ZeRO-3: the weights are empty until each linear's own forward gathers them
    if any(linear.bias is None for linear in linears):
        return False
    if all(isinstance(linear, nn.Linear) for linear in linears):
        return True
    return all(
        hasattr(linear, "allreduce_dgrad") and linear.tp_group is linears[0].tp_group
        and linear.allreduce_dgrad == linears[0].allreduce_dgrad
        and not (linear.sequence_parallel or linear.gradient_accumulation_fusion or linear.gather_output
                 or linear.skip_bias_add or linear.explicit_expert_comm or linear.disable_grad_reduce
                 or linear.config.defer_embedding_wgrad_compute
                 or linear.config._cpu_offloading_context is not None)
        for linear in linears)


def _megatron_column_linear(first: nn.Module, input_: torch.Tensor, weight: torch.Tensor,
                            bias: torch.Tensor) -> torch.Tensor:
    """ColumnParallelLinear.forward's path for our options (see `_can_fuse`) with another weight:
    the input gradient is all-reduced across the TP group in the linear's backward (or, at TP=1,
    by the identity `copy_to_tensor_model_parallel_region`)."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    if not first.allreduce_dgrad:
        input_ = copy_to_tensor_model_parallel_region(input_, group=first.tp_group)
    return first._forward_impl(
        input=input_, weight=weight, bias=bias, gradient_accumulation_fusion=False,
        allreduce_dgrad=first.allreduce_dgrad, sequence_parallel=False, grad_output_buffer=None,
        wgrad_deferral_limit=None, tp_group=first.tp_group)

# How each parameter is split across tensor-parallel ranks: name suffix -> dimension (None:
# replicated). Column-parallel outputs, the vocabulary and the attention heads are split;
# row-parallel inputs are split along dim 1 and their biases replicated.
TENSOR_PARALLEL_SPLITS: tuple[tuple[str, int | None], ...] = (
    ("embeddings.word_embeddings.weight", 0),
    ("rel_pos_bias.weight", 0),
    ("attention.self.query.weight", 0), ("attention.self.query.bias", 0),
    ("attention.self.key.weight", 0), ("attention.self.key.bias", 0),
    ("attention.self.value.weight", 0), ("attention.self.value.bias", 0),
    ("attention.output.dense.weight", 1),
    ("intermediate.dense.weight", 0), ("intermediate.dense.bias", 0),
    ("output.dense.weight", 1),
    ("cls.predictions.bias", 0),
)


def tensor_parallel_split_dim(name: str) -> int | None:
    """The dimension along which parameter `name` is split under tensor parallelism (None: replicated)."""
    for suffix, dim in TENSOR_PARALLEL_SPLITS:
        if name.endswith(suffix):
            return dim
    return None


def shard_state_dict(state: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """This tensor-parallel rank's slice of a full (TP=1) state dict."""
    out = {}
    for name, tensor in state.items():
        dim = tensor_parallel_split_dim(name)
        if dim is None or size == 1:
            out[name] = tensor.clone()
        else:
            if tensor.shape[dim] % size:
                raise ValueError(f"{name}: dimension {dim} of size {tensor.shape[dim]} does not split into {size}")
            out[name] = tensor.chunk(size, dim=dim)[rank].clone()
    return out


def merge_state_dicts(shards: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The full state dict from every tensor-parallel rank's state dict, in rank order."""
    out = {}
    for name in shards[0]:
        dim = tensor_parallel_split_dim(name)
        tensors = [shard[name] for shard in shards]
        out[name] = tensors[0].clone() if dim is None or len(shards) == 1 else torch.cat(tensors, dim=dim)
    return out
