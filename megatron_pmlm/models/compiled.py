"""Compiled step (`--compile`, `compile_step_regions`): `torch.compile` applied region by region, as
torchtitan's `apply_compile` does per block, so that each region's many small kernels become a few
fused ones while the model, its names, its checkpoints and its parallel layouts stay as they are.
The regions (docs/benchmarks.md, "Compiled step", has the kernel counts behind the choice):

- the transformer layers (`compile_transformer_layers`, below);
- `BertModel.embed`: the three embeddings + LayerNorm, and the attention bias every layer shares
  (the attention rule, the relative-distance buckets, `RelativeBiasGather` with its custom
  backward): static shapes at the padded width, like the layers. On a GPU in training it hands out
  the bias without a gradient and its buckets, and the eager loop over the layers gives each
  compiled layer the bias through `relative_bias.LayerBiasUse` (each layer's bias gradient is
  reduced into the table as its backward ends);
- the model's `losses`: gather of the predicted slots, the MLM head (transform + tied logits), the
  chunked cross entropy (`_ChunkedBiasedCrossEntropy`, traced with its own backward) and the loss
  arithmetic (NSP for UniLM, label smoothing for seq2seq): the number of predicted slots changes
  every batch, so this region is compiled with `dynamic=True` (one graph for every count). Only
  `loss` leaves it differentiable (`_logged_parts_detached`: the logged parts are detached). It
  reads the encoder's output at the padded width: the cut back to T is never made (the real slots
  are gathered through a widened index, `BertModel.padded_forward`, `layout.gather_slots`).
The layout's padding itself (five small [B, T] pads) stays eager: as a `dynamic=True` region its
outputs carry torch's mark of symbolic sizes into the static embed region, which then traces
symbolically (torch 2.13); clearing that private mark was not worth five tiny kernels.
The optimizer stays outside (DeepSpeed owns it on the real path; torch's fused AdamW is already
one kernel on CUDA).

- Regional: the `BertLayer`s of a stack (PMLM, UniLM v1, seq2seq fine-tuning) share one region,
  `BertLayer.forward` called with each layer as an argument (each layer's `forward` on the
  instance): dynamo, inlining nn.Modules, treats parameters as inputs, so a 12-layer model
  compiles one layer graph per shape.
- Activation checkpointing stays outside: `model.checkpointed_layer` recomputes the compiled layer
  under non-reentrant checkpointing, unchanged. Inside the layer, each BertSelfOutput marks its
  residual sum for AOT autograd to save (`model.RESIDUAL_SUMS_SAVED`: selective checkpointing's
  policy, nothing recomputed), which with dropout it had recomputed in the backward.
- Shapes: the layout width T varies per micro batch. Compiled for static shapes, the model pads T
  to a multiple of `COMPILE_LAYOUT_QUANTUM` (`compile_layout_quantum`; $PMLM_LAYOUT_QUANTUM wins),
  so few widths compile; each new shape is counted and announced on rank 0 (`compilations`), and
  dynamo's recompile limit is raised to `COMPILE_LIMIT`. Why static and not `mark_dynamic`:
  docs/benchmarks.md, "Compiled layers".
- Pipeline stages (`pipeline.LayerPipe`): DeepSpeed's PipelineModule runs its own layer list and
  each LayerPipe first fetches what its attention reads from the stage's cache (Python bookkeeping
  on tensor identities, which would break a graph), so the region is the layer's computation,
  `BertLayer.forward`, called by the LayerPipe with itself as the module: one compiled graph for
  every layer of the stage. The first stage pads the width to the same quantum; checkpointed
  layers are recomputed by DeepSpeed's non-reentrant checkpoint (`build_pipeline_model`), so the
  recomputation runs the graph the forward ran (one compilation per width, not two). The last
  stage compiles its head (slot gather, transform) and its loss, `dynamic=True` as `losses`; the
  tied logits between them stay eager.
- PALM (`pretrain --model palm`): the encoder is a BertModel (its layers and embed as above, the
  context padded to the quantum; stage 2 reads it at the padded width, its extra slots PAD). The
  decoder's embed (embeddings, causal and key padding biases), its layers (one region,
  `DecoderLayer.forward` called with each layer as an argument), the pointer-generator (its copy
  attention adds and tanh's a [B, D, S, width] tensor) and the model's `losses` (continuation NLL
  and metrics) are regions with `dynamic=True`: their shapes combine the continuation's length
  with the context's, two widths that vary independently, so padding both would still compile a
  graph per pair.
- A compilation that fails does not end the run: the first call of a region at a new shape also
  compiles its backward (inductor otherwise compiles it at the first backward, where a failure
  could not be undone), and when either fails (`BackendCompilerFailed`: an inductor or Triton
  error, a full cache disk) the region runs eagerly at that shape from then on, announced in one
  line, recomputations included. A run compiles new widths for days (the layout width varies per
  micro batch), and a requeued run would meet the same width again.
- Refused (`compile_problem`, one line, before anything is built): ZeRO-3 (its parameter gather
  hooks fire inside the layer: graph breaks and no gain), tensor parallelism (megatron-core's
  layers are autograd Functions that call collectives) and the flex backend (already a compiled
  kernel; its CPU path patches torch's entry check at call time).

Compiled equals eager in outputs and gradients (fp32, dropout 0: tests/test_compile.py); with
dropout the random streams differ from eager's (inductor draws its own), as on any compiled model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from typing import Callable

import torch
import torch._dynamo.exc
import torch._functorch.config as functorch_config
import torch.fx.experimental._config as fx_config
from torch import nn

from ..config import ConfigError
from .accelerated import announce
from .flex_attention import LAYOUT_QUANTUM, LAYOUT_QUANTUM_ENV

COMPILE_LAYOUT_QUANTUM = LAYOUT_QUANTUM
"""Layout width multiple under --compile (static shapes: one compilation per width), the flex
backend's 16 for the same reason: at seq 512 it adds 1.2-2.1% cells for at most ~700 / 16 = 44
widths, where 64 adds 5-12% at every step of the run to save a few one-time compilations
(docs/benchmarks.md, "Layout width quantum" and "Compiled layers")."""
COMPILE_LIMIT = 128
"""Shapes the compiled layer may meet per process (dynamo's recompile limit is raised to it): up
to ~44 widths at seq 512, each with and without grad (training, validation), with room to spare."""


def compile_problem(zero_stage: int, tensor_parallel_size: int = 1, attention_backend: str = "sdpa") -> str | None:
    """Why --compile cannot run with these settings (one line), or None."""
    if zero_stage == 3:
        return ("--compile with --zero-stage 3: ZeRO-3 gathers each layer's parameters in hooks that fire inside the "
                "compiled layer (graph breaks, no gain); use --zero-stage 0, 1 or 2, or leave out --compile")
    if tensor_parallel_size > 1:
        return (f"--compile with --tensor-model-parallel-size {tensor_parallel_size}: megatron-core's tensor-parallel "
                "layers are autograd Functions that call collectives, which break the compiled graph; leave out "
                "--compile or use --tensor-model-parallel-size 1")
    if attention_backend == "flex":
        return ("--compile with --attention-backend flex: FlexAttention is already a compiled kernel and its CPU path "
                "patches torch at call time; use --attention-backend sdpa with --compile")
    return None


def check_compile(zero_stage: int, tensor_parallel_size: int = 1, attention_backend: str = "sdpa") -> None:
    """Raise `compile_problem`'s line as a ConfigError (the entry points print it and exit 2)."""
    problem = compile_problem(zero_stage, tensor_parallel_size, attention_backend)
    if problem:
        raise ConfigError(problem)


def compile_layout_quantum() -> int:
    """$PMLM_LAYOUT_QUANTUM when set, else COMPILE_LAYOUT_QUANTUM."""
    from .flex_attention import default_layout_quantum

    if os.environ.get(LAYOUT_QUANTUM_ENV) is not None:
        return default_layout_quantum("sdpa", torch.device("cpu"))  # validates and returns the variable
    return COMPILE_LAYOUT_QUANTUM


_signatures: set[tuple] = set()


def compilations() -> int:
    """Shapes the compiled regions have met in this process (each one a compilation)."""
    return len(_signatures)


def compile_transformer_layers(model: nn.Module, on_new_shape: Callable[[], None] | None = None) -> int:
    """Compile every transformer layer of `model` in place (see the module docstring); the stacks
    holding them get the compile layout quantum (`layout_quantum` where they have one and it is
    unset) and announce each new shape (and call `on_new_shape`: the trainer's heartbeat marks the
    compilation as progress). Returns the number of layers compiled."""
    import torch._dynamo

    config = torch._dynamo.config  # `cache_size_limit` before torch 2.6
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), COMPILE_LIMIT))
    if hasattr(config, "accumulated_recompile_limit"):
        config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, COMPILE_LIMIT)
    from .model import BertLayer
    from .palm import DecoderLayer

    compiled = 0
    stage_layer = None  # pipeline stages: one region for the stage's LayerPipes
    decoder_layer = None  # PALM's decoder: one region for its layers
    model_layer = None  # the stacks' BertLayers: one region
    for module in model.modules():
        if getattr(module, "layout_quantum", 0) is None:  # BertModel, WordEmbeddingPipe: pad for few shapes
            module.layout_quantum = compile_layout_quantum()
        if isinstance(module, DecoderLayer):
            # Symbolic sizes: a decoder layer's shapes are the continuation's length and the context's,
            # two widths that vary independently (padding both to a quantum would still compile one graph
            # per pair). Called with the layer as an argument, as the pipeline's LayerPipes are: one graph
            # for every decoder layer.
            if decoder_layer is None:
                decoder_layer = CompiledRegion("decoder layer", DecoderLayer.forward, dynamic=True,
                                               on_new_shape=on_new_shape)
            module.forward = functools.partial(decoder_layer, module)
            compiled += 1
            continue
        if isinstance(module, BertLayer) and hasattr(module, "layer_forward"):  # pipeline.LayerPipe
            if stage_layer is None:
                # DeepSpeed's pipeline engine runs a stage's backward once per floating-point output
                # (hidden states, then the bias table), retaining the graph for the second: a compiled
                # backward that reuses its saved tensors' memory (donated buffers) refuses that. Set for
                # the process: a patch around the region's calls does not reach the backward, compiled
                # later by the autograd engine (tried: the pipeline tests of test_compile.py failed).
                import torch._functorch.config

                torch._functorch.config.donated_buffer = False
                stage_layer = CompiledRegion("transformer layer", BertLayer.forward, dynamic=False,
                                             on_new_shape=on_new_shape)
            module.layer_forward = stage_layer
            compiled += 1
            continue
        layers = getattr(module, "layer", None)
        if not isinstance(layers, nn.ModuleList) or not any(isinstance(layer, BertLayer) for layer in layers):
            continue
        for layer in layers:
            if isinstance(layer, BertLayer):
                if model_layer is None:  # announced per stack by `_announce_new_shape`
                    model_layer = CompiledRegion("transformer layer", BertLayer.forward, dynamic=False,
                                                 announce=False)
                layer.forward = functools.partial(model_layer, layer)
                compiled += 1
        module.register_forward_pre_hook(functools.partial(_announce_new_shape, on_new_shape=on_new_shape))
    return compiled


def _announce_new_shape(stack: nn.Module, args: tuple, on_new_shape: Callable[[], None] | None = None) -> None:
    """Count and announce (rank 0, one line) each new input signature a stack of compiled layers
    meets: what the compiled layer is guarded on (shapes, dtype, grad mode)."""
    tensors = [arg for arg in args if isinstance(arg, torch.Tensor)]
    signature = (type(stack).__name__, tuple(tuple(t.shape) for t in tensors), tensors[0].dtype if tensors else None,
                 torch.is_grad_enabled())
    if signature in _signatures:
        return
    _signatures.add(signature)
    if on_new_shape is not None:
        on_new_shape()
    width = tensors[0].shape[1] if tensors and tensors[0].dim() > 1 else "?"
    announce(f"compiled layers: compiling {type(stack).__name__} layer for width {width} "
             f"(shapes {', '.join('x'.join(map(str, t.shape)) for t in tensors)}"
             f"{'' if torch.is_grad_enabled() else ', no grad'}; shape {len(_signatures)}, at most {COMPILE_LIMIT})")


def compile_step_regions(model: nn.Module, on_new_shape: Callable[[], None] | None = None) -> dict[str, int]:
    """--compile: the transformer layers (`compile_transformer_layers`), then every `BertModel.embed`
    and the model's `losses`, or a pipeline's head and loss stages (see the module docstring), each
    replaced on the instance by a `CompiledRegion`. Returns how many of each were compiled."""
    from .model import BertModel
    from .palm import PalmDecoder, PointerGenerator
    from .pipeline import HeadTransformPipe, LossPipe

    # Regions with symbolic sizes, by module type: (method, region name, announcing rank). A pipeline's
    # last stage announces on the last rank (DeepSpeed's topology puts it there); PALM's decoder side
    # varies with two independent lengths (see the module docstring).
    dynamic_regions = {HeadTransformPipe: ("forward", "head", -1), LossPipe: ("forward", "losses", -1),
                       PalmDecoder: ("embed", "decoder embed", 0), PointerGenerator: ("forward", "pointer generator", 0)}
    counts = {"layers": compile_transformer_layers(model, on_new_shape), "embed": 0, "losses": 0}
    for module in model.modules():
        if isinstance(module, BertModel):
            module.embed = CompiledRegion("embed", module.embed, dynamic=False, on_new_shape=on_new_shape)
            counts["embed"] += 1
        elif type(module) in dynamic_regions:
            method, name, rank = dynamic_regions[type(module)]
            setattr(module, method, CompiledRegion(name, getattr(module, method), dynamic=True,
                                                   on_new_shape=on_new_shape, announcing_rank=rank))
            counts[name] = counts.get(name, 0) + 1
    if callable(getattr(model, "losses", None)):
        model.losses = CompiledRegion("losses", _logged_parts_detached(model.losses), dynamic=True,
                                      on_new_shape=on_new_shape)
        counts["losses"] += 1
    return counts


def _logged_parts_detached(losses_method: Callable) -> Callable:
    """`losses_method` returning every differentiable tensor but `loss` detached (PMLM's loss_ae and
    loss_par, UniLM's loss_mlm and loss_nsp; values unchanged): they are logged, never
    backpropagated, and a compiled region's differentiable output that gets no gradient costs a
    zero-filled gradient per step (AOT autograd materialises it before the region's backward).
    The wrapper is named `losses`, as dynamo's log names what it traced."""

    @functools.wraps(losses_method)
    def losses(*args, **kwargs):
        result = losses_method(*args, **kwargs)
        parts = {field.name: getattr(result, field.name) for field in dataclasses.fields(result)}
        return type(result)(**{name: value.detach() if name != "loss" and isinstance(value, torch.Tensor) else value
                               for name, value in parts.items()})

    return losses


class CompiledRegion:
    """A method of one module instance compiled as one region (`torch.compile`), announcing (one
    rank, one line) and counting in `compilations` each new signature it meets, as the layers do.
    `dynamic`: False, static shapes (a new shape is a new compilation); True, symbolic sizes (one
    compilation for every size but 0 and 1, which dynamo specialises). `eager` is the method
    itself (tests explain it with `torch._dynamo.explain`; a shape whose compilation failed runs
    it). `announcing_rank`: the rank that announces (-1: the last, which holds a pipeline's last
    stage); `announce` False: the caller announces (the layers' stacks)."""

    def __init__(self, name: str, method: Callable, dynamic: bool,
                 on_new_shape: Callable[[], None] | None = None, announcing_rank: int = 0,
                 announce: bool = True) -> None:
        self.name, self.eager, self.dynamic, self.on_new_shape = name, method, dynamic, on_new_shape
        self.announcing_rank, self.announce = announcing_rank, announce
        self.compiled = torch.compile(method, dynamic=dynamic)
        self.seen: set[tuple] = set()
        """Signatures this region has met (compiled, or failed and run eagerly)."""
        self.eager_signatures: set[tuple] = set()
        """Signatures whose compilation failed: run eagerly."""

    def __call__(self, *args, **kwargs):
        # a pipeline stage's modules take one tuple of activations
        flat = [item for arg in (*args, *kwargs.values()) for item in (arg if isinstance(arg, tuple) else (arg,))]
        tensors = [item for item in flat if isinstance(item, torch.Tensor)]
        shapes = tuple(tuple(t.shape) if not self.dynamic else tuple(min(size, 2) for size in t.shape)
                       for t in tensors)
        signature = (self.name, shapes, tuple(t.dtype for t in tensors), torch.is_grad_enabled())
        if signature in self.eager_signatures:
            return self.eager(*args, **kwargs)
        if signature in self.seen:
            return self._compiled(args, kwargs)
        self.seen.add(signature)
        shape_text = ("every width" if self.dynamic else
                      f"width {tensors[0].shape[1] if tensors and tensors[0].dim() > 1 else '?'}")
        if self.announce and signature not in _signatures:
            _signatures.add(signature)
            if self.on_new_shape is not None:
                self.on_new_shape()
            announce(f"compiled regions: compiling {self.name} for {shape_text}"
                     + f" (shapes {', '.join('x'.join(map(str, t.shape)) for t in tensors[:2])}"
                     + f"{'' if torch.is_grad_enabled() else ', no grad'}; shape {len(_signatures)}, "
                     f"at most {COMPILE_LIMIT})", self.announcing_rank)
        try:
            # the backward compiled now, in this call, rather than at the first backward: a failure
            # of either arrives here, where the shape can still run eagerly
            with _backward_compiled_in_the_call():
                return self._compiled(args, kwargs)
        except torch._dynamo.exc.BackendCompilerFailed as error:
            self.eager_signatures.add(signature)
            cause = str(getattr(error, "inner_exception", None) or error).strip()
            reason = cause.splitlines()[0][:300] if cause else type(error).__name__
            announce(f"compiled regions: compiling {self.name} for {shape_text} failed ({reason}); it runs eagerly "
                     f"at this shape from now on and the run goes on", self.announcing_rank)
            return self.eager(*args, **kwargs)

    def _compiled(self, args: tuple, kwargs: dict):
        if not self.dynamic:
            return self.compiled(*args, **kwargs)
        # No duck sizing: two sizes that happen to be equal when the region is traced (a layout that
        # needed no padding, a width equal to the hidden size) would get one symbol, and the first
        # call where they differ would compile the region again.
        with fx_config.patch(use_duck_shape=False):
            return self.compiled(*args, **kwargs)


def _backward_compiled_in_the_call():
    """AOT autograd's switch that compiles a graph's backward with its forward, where this torch has
    it (2.13 does; without it the backward compiles at the first backward, where a failure still
    ends the step)."""
    if hasattr(functorch_config, "force_non_lazy_backward_lowering"):
        return functorch_config.patch(force_non_lazy_backward_lowering=True)
    return contextlib.nullcontext()
