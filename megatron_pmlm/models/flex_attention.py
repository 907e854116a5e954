"""The FlexAttention backend (`attention_backend="flex"`): attention without a dense [B, heads, T, T] bias.

The sdpa backend adds one dense tensor (the -inf mask plus the relative position bias) to the
scores, which rules out FlashAttention-style kernels and costs B x heads x T x T floats per batch
(426 MB in fp32 at base, sequence 512, micro batch 20). Here:

- the mask is a `BlockMask` derived once per batch from the same attention rule the sdpa backend
  uses (`layout.pmlm_attention_allowed` or any other rule): the rule gives a boolean [B, Q, K]
  (no heads, one byte per pair) and blocks nobody may attend are skipped by the kernel;
- the relative position bias is a `score_mod` that looks the bias up per (head, key - query
  distance) in a [heads, 2 x max_distance + 1] table computed from the learned [heads, bins]
  table by `RelativePositionBias`, so gradients reach the learned table.

On CUDA the kernel is `torch.compile(flex_attention)` (fused forward and backward), compiled for
static shapes: one compilation per layout shape, so the model pads the layout width T to a multiple
of `LAYOUT_QUANTUM` there (`default_layout_quantum`) and each new shape is counted and announced
(`compilations`, at most `COMPILE_LIMIT`). Triton, which compiles it, supports compute capability
8.0+ only: `flex_capability_problem` refuses older GPUs (the V100 is 7.0; its path is sdpa). On the CPU
torch 2.13 has a compiled forward only (fp32, static shapes) and no backward; there the backend
runs torch's unfused reference implementation of FlexAttention, which does differentiate, so the
flex path can be checked against sdpa on any machine (it materialises the scores, like sdpa's
math kernel: the speed and memory gain is a GPU matter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.attention.flex_attention as torch_flex
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from ..config import ConfigError

ScoreMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class FlexAttentionMask:
    """What every layer's FlexAttention needs for one batch: who sees whom and the score bias."""

    block_mask: BlockMask
    distance_bias: torch.Tensor | None
    """[heads, 2 x max_distance + 1] bias per key - query distance; None for a model without one."""
    position_ids: torch.Tensor
    key_position_ids: torch.Tensor
    max_distance: int

    @property
    def score_mod(self) -> ScoreMod | None:
        if self.distance_bias is None:
            return None
        return relative_bias_score_mod(self.distance_bias, self.position_ids, self.key_position_ids,
                                       self.max_distance, BIAS_GRADIENT_TILE)

    def with_distance_bias(self, distance_bias: torch.Tensor) -> "FlexAttentionMask":
        """The same mask over another tensor of the bias table (activation checkpointing passes the
        table explicitly, see `model.checkpointed_layer`)."""
        return dataclasses.replace(self, distance_bias=distance_bias)


def build_flex_attention_mask(attention_rule, roles: torch.Tensor, steps: torch.Tensor,
                              distance_bias: torch.Tensor | None, position_ids: torch.Tensor,
                              max_distance: int, key_roles: torch.Tensor | None = None,
                              key_steps: torch.Tensor | None = None,
                              key_position_ids: torch.Tensor | None = None,
                              block_mask: BlockMask | None = None) -> FlexAttentionMask:
    """The block mask from `attention_rule` over (roles, steps) and the relative-bias score_mod.

    The rule is evaluated once, to a boolean [B, queries, keys]: any rule layout.py defines works
    unchanged. Keys default to the queries (a full forward). `block_mask`: the one `build_block_mask`
    already made for these (roles, steps) (pipeline stages, see `pipeline.StageCache`).
    """
    if block_mask is None:
        block_mask = build_block_mask(attention_rule, roles, steps, key_roles, key_steps)
    key_position_ids = position_ids if key_position_ids is None else key_position_ids
    return FlexAttentionMask(block_mask, distance_bias, position_ids, key_position_ids, max_distance)


def build_block_mask(attention_rule, roles: torch.Tensor, steps: torch.Tensor, key_roles: torch.Tensor | None = None,
                     key_steps: torch.Tensor | None = None) -> BlockMask:
    allowed = (attention_rule(roles, steps) if key_roles is None else
               attention_rule(roles, steps, key_roles, key_steps))
    batch, queries, keys = allowed.shape

    def mask_mod(b, h, q_idx, kv_idx):
        return allowed[b, q_idx, kv_idx]

    # Compiled on CUDA: one fused kernel instead of materialising [B, 1, Q, K] and reducing it per
    # block in eager ops (the rule's boolean is already materialised once, at one byte per pair).
    return create_block_mask(mask_mod, batch, None, queries, keys, device=allowed.device,
                             _compile=allowed.device.type == "cuda")


BIAS_GRADIENT_TILE = 128
"""Query and key tile (positions) that gets its own copy of the distance-bias table in the score_mod.

The gradient of a tensor captured by a score_mod is an atomic add per score into that tensor
(inductor's FlexAttention backward). With one [heads, 2 x max_distance + 1] table every program of
the kernel adds into the same few entries: at seq 512 most pairs sit at the two clamped distances,
so the atomics serialise (SPEC §14). Indexed per (sample, head, query tile, key tile) instead, the
programs add into disjoint rows and the tiles' gradients are summed afterwards by the expand's
backward, one small deterministic reduction ([B, heads, T/128, T/128, 257] floats: 8.9 MB in fp32
at base, seq 512, micro batch 20)."""


def tiled_distance_bias(distance_bias: torch.Tensor, batch: int, queries: int, keys: int,
                        tile: int = BIAS_GRADIENT_TILE) -> torch.Tensor:
    """[B, heads, query tiles, key tiles, distances]: a copy of the table per tile (see BIAS_GRADIENT_TILE)."""
    heads, distances = distance_bias.shape
    return distance_bias[None, :, None, None, :].expand(
        batch, heads, -(-queries // tile), -(-keys // tile), distances).clone()


def relative_bias_score_mod(distance_bias: torch.Tensor, position_ids: torch.Tensor,
                            key_position_ids: torch.Tensor, max_distance: int,
                            tile: int = BIAS_GRADIENT_TILE) -> ScoreMod:
    """score + distance_bias[head, clamp(key position - query position) + max_distance], read from the
    copy of the table of the score's (sample, query tile, key tile) (`tiled_distance_bias`).

    Buckets are constant beyond max_distance, so clamping the distance loses nothing.
    """
    (batch, queries), keys = position_ids.shape, key_position_ids.shape[1]
    tiles = tiled_distance_bias(distance_bias, batch, queries, keys, tile)

    def score_mod(score, b, h, q_idx, kv_idx):
        distance = (key_position_ids[b, kv_idx] - position_ids[b, q_idx]).clamp(-max_distance, max_distance)
        return score + tiles[b, h, q_idx // tile, kv_idx // tile, distance + max_distance].to(score.dtype)

    return score_mod


def flex_attention_forward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           mask: FlexAttentionMask) -> torch.Tensor:
    """Softmax attention [B, heads, Q, head_dim] under the block mask and score_mod."""
    if query.device.type == "cuda":
        _count_compilation(query, key, mask)
        return _compiled_flex_attention()(query, key, value, score_mod=mask.score_mod, block_mask=mask.block_mask)
    with _reference_backward_allowed():
        return flex_attention(query, key, value, score_mod=mask.score_mod, block_mask=mask.block_mask)


# ------------------------------------------------------------------ GPU gate, shapes, compilations

MIN_CAPABILITY = (8, 0)
"""Triton (FlexAttention's compiler) supports compute capability 8.0+ (SPEC §13); Volta's tensor-core
code generation is deprecated and fp16 `tl.dot` has been reported to return zeros there."""
ALLOW_BELOW_MIN_CAPABILITY_ENV = "PMLM_ALLOW_FLEX_BELOW_SM80"
LAYOUT_QUANTUM = 16
"""Layout width multiple on CUDA with flex. Measured on real samples (docs/benchmarks.md, "Layout
width quantum"): 16 adds 1.2-2.1% cells at seq 128 and 512 for 6-33 widths over 20 epochs; 64 adds
5-12% (every step, for the whole run) to save a few one-time compilations; 128 adds 14-49%."""
LAYOUT_QUANTUM_ENV = "PMLM_LAYOUT_QUANTUM"
COMPILE_LIMIT = 128
"""Compiled shapes allowed per process (torch._dynamo's recompile limit is raised to it): at seq 512
and quantum 16 widths are at most ~700 / 16 = 44, each compiled with and without grad (training,
validation). Past it torch would fall back to the unfused path, which materialises the scores:
refused instead."""


def flex_capability_problem(device_type: str = "cuda") -> str | None:
    """Why the flex backend should not run on this device (one line), or None: not CUDA, compute
    capability >= 8.0, or PMLM_ALLOW_FLEX_BELOW_SM80=1 (experiments)."""
    if device_type != "cuda" or not torch.cuda.is_available():
        return None
    capability = tuple(torch.cuda.get_device_capability())
    if capability >= MIN_CAPABILITY or os.environ.get(ALLOW_BELOW_MIN_CAPABILITY_ENV) == "1":
        return None
    return (f"--attention-backend flex needs a GPU of compute capability >= 8.0 (FlexAttention compiles through "
            f"Triton, which supports SM 8.0+; this GPU is SM {capability[0]}.{capability[1]}): use --attention-backend "
            f"sdpa, the V100 path (or set {ALLOW_BELOW_MIN_CAPABILITY_ENV}=1 to try flex anyway)")


def default_layout_quantum(backend: str, device: torch.device) -> int:
    """The multiple the layout width is padded to: $PMLM_LAYOUT_QUANTUM when set (1: no padding),
    else LAYOUT_QUANTUM for flex on CUDA (its kernel is compiled per shape) and 1 elsewhere (the sdpa
    kernels and the CPU reference path take any width: padding would only cost)."""
    value = os.environ.get(LAYOUT_QUANTUM_ENV)
    if value is not None:
        if not value.isdigit() or int(value) < 1:
            raise ConfigError(f"{LAYOUT_QUANTUM_ENV} must be a positive integer (1: no padding), got {value!r}")
        return int(value)
    return LAYOUT_QUANTUM if backend == "flex" and device.type == "cuda" else 1


_compiled: Callable | None = None
_compiled_signatures: set[tuple] = set()


def compilations() -> int:
    """Shapes the compiled kernel has been called with in this process (each one a compilation)."""
    return len(_compiled_signatures)


def compiled_signatures() -> frozenset[tuple]:
    """(query shape, key shape, dtype, grad enabled, with bias) of each of them."""
    return frozenset(_compiled_signatures)


def _compiled_flex_attention() -> Callable:
    """One compiled kernel per process, for static shapes (one compilation per layout shape)."""
    global _compiled
    if _compiled is None:
        import torch._dynamo

        config = torch._dynamo.config  # the limit is `cache_size_limit` before torch 2.6
        name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        setattr(config, name, max(getattr(config, name), COMPILE_LIMIT))
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def _count_compilation(query: torch.Tensor, key: torch.Tensor, mask: FlexAttentionMask) -> None:
    """Count and announce (rank 0, one line) each new shape the compiled kernel meets: what
    torch.compile guards on here (shapes, dtype, grad mode, with or without the bias)."""
    signature = (tuple(query.shape), tuple(key.shape), query.dtype, torch.is_grad_enabled(),
                 mask.distance_bias is not None)
    if signature in _compiled_signatures:
        return
    problem = flex_capability_problem(query.device.type)  # entry points refuse earlier; this is the backstop
    if problem:
        raise ConfigError(problem)
    if len(_compiled_signatures) >= COMPILE_LIMIT:
        raise RuntimeError(f"flex attention has compiled {COMPILE_LIMIT} shapes in this process and would fall back "
                           f"to the unfused kernel; pad the layout to fewer widths ({LAYOUT_QUANTUM_ENV}, now "
                           f"{os.environ.get(LAYOUT_QUANTUM_ENV, 'unset')}) or use --attention-backend sdpa")
    _compiled_signatures.add(signature)
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized() and dist.get_rank() != 0):
        batch, heads, queries, _ = query.shape
        print(f"flex attention: compiling for batch {batch} x {heads} heads x {queries} queries x {key.shape[2]} keys, "
              f"{str(query.dtype).replace('torch.', '')}{'' if torch.is_grad_enabled() else ', no grad'} "
              f"(shape {len(_compiled_signatures)}, at most {COMPILE_LIMIT})", file=sys.stderr, flush=True)


_entry_check_lock = threading.RLock()  # re-entered when activation checkpointing recomputes


@contextlib.contextmanager
def _reference_backward_allowed():
    """Off CUDA, flex_attention's entry check refuses inputs that require grad (its compiled CPU
    kernel has no backward), although the unfused reference path it then runs is differentiable.
    Skip that one check for the duration of the call; every other validation still runs. (torch's
    warning that the call is not compiled is expected here and silenced.)"""
    with _entry_check_lock, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        original = torch_flex._validate_device
        torch_flex._validate_device = _validate_device_allowing_cpu_backward
        try:
            yield
        finally:
            torch_flex._validate_device = original


def _validate_device_allowing_cpu_backward(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    if query.device.type not in ("cpu", "cuda"):
        raise ValueError(f"the flex attention backend runs on CUDA or the CPU, not {query.device.type}")
