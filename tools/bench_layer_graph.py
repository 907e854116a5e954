#!/usr/bin/env python
"""A compiled transformer layer's kernels on a GPU, without a GPU: Inductor's CUDA schedule of one
`--compile`d layer (its fused Triton kernels and extern calls, forward and backward) and the bytes
each one reads and writes.

    python tools/bench_layer_graph.py [--preset base] [--width 176] [--micro-batch-size 256] [--json FILE]
    python tools/bench_layer_graph.py --width 176 --micro-batch-size 256 --trace gpu-check/.../x.pretrain.trace.json
    python tools/bench_layer_graph.py --instructions
    python tools/bench_layer_graph.py --gemm-templates       # the GEMMs as Inductor's Triton templates, epilogues fused

Why: on the H100s `make gpu-check` ran, Inductor's fused elementwise kernels (GELU, the residual,
dropout and LayerNorm, the bias gradients) took ~21 ms of pretrain's ~86 ms compiled step at seq 128 x
256, memory-bound at 1.7-2.9 TB/s: their bytes are their time. The CPU's own Inductor schedules
differently (C++ kernels, other fusions), so this tool asks Inductor what it would run on CUDA:
- the layer (the triton attention backend, as `--attention-backend auto` picks on SM 8.0+, bf16
  weights as DeepSpeed casts them, the recipe's dropout) is traced by dynamo and split into forward
  and backward by AOT autograd on the CPU, as `--compile` does (device-independent steps but one:
  LayerNorm's decomposition keeps its per-token mean and 1/std in the input's dtype on a CPU, in fp32
  on a GPU, 1/768 of an activation each);
- each graph is then lowered and scheduled for a CUDA device with fake tensors (shapes, strides and
  dtypes only), torch.cuda answering as an H100 would; Triton kernels are generated, not compiled.
Per scheduled kernel: what it fuses (its ATen ops) and the bytes of the buffers it reads and writes
(Inductor's `get_read_write_buffers_sizes`: whole buffers, no cache effects), also in "activations"
(one [tokens, hidden] tensor in the compute dtype), which do not depend on the micro batch. The
floor in ms is those bytes at the peak HBM bandwidth given (`--bandwidth`, H100 SXM's 3.35 TB/s).
With `--trace`, a GPU step's Chrome trace at the same shape gives each of these kernels' time there
(matched by name) and so the bandwidth it reached: which kernels are slow for their bytes. With
`--instructions`, each kernel is also compiled for SM 9.0 (Triton's compiler and cuobjdump, still no
GPU) and its SASS instructions an element give an issue floor beside the bytes' floor: a kernel whose
instructions take longer than its bytes is slow for its arithmetic (Inductor's dropout draws were).
With `--gemm-templates`, the layer's GEMMs are Inductor's Triton templates instead of cuBLAS calls, as
`TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1` makes them where its autotuner times a template faster (every
template is given the same time here, cuBLAS a longer one: which template's launch wins does not
matter to the bytes), with the elementwise work Inductor fuses into them (`benchmark_epilogue_fusion`
off: fused where its heuristics allow): what that mode could save of the fused kernels' bytes, before a
GPU says whether the templates keep cuBLAS's speed.
Figures: docs/benchmarks.md, "The compiled layer's kernels on a GPU".
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib.util
import json
import re
import sys
import types
import unittest.mock
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_pmlm.files import OutputError, check_output, logs_to_stderr, write_json_atomically  # noqa: E402

H100_SXM_BANDWIDTH_TBPS = 3.35
"""HBM3 bandwidth of an H100 SXM (NVIDIA's datasheet): the floor's denominator."""


OUR_MEMORY_BOUND_KERNELS = {"megatron_pmlm.gelu_backward_with_bias_sums.default": "gelu_backward_kernel",
                            "megatron_pmlm.dropout_keep_bits.default": "dropout_keep_bits_kernel"}
"""Our custom ops that run beside Inductor's fused kernels, with the name of their Triton kernel in a GPU
trace (kind "ours"): GELU's backward (`models/ffn_activation.py`), whose time is its bytes, and the
hidden dropout's bits (`models/hidden_dropout.py`), whose few bytes are counted but whose time is its
Philox arithmetic (a call per 8 positions)."""


class _Stop(BaseException):
    """Raised once a graph has been captured or scheduled: nothing is ever run."""


def capture_layer_graphs(preset: str, batch: int, width: int, dropout: float | None,
                         functorch_settings: dict | None = None, residual_sums_saved: bool = True) -> tuple[list, object]:
    """The forward and backward graphs AOT autograd hands Inductor for one compiled BertLayer (as
    `compiled.compile_transformer_layers` compiles it), with their example inputs and Inductor's
    keyword arguments; and the model config. `functorch_settings`: torch._functorch.config values
    for the split (its partitioner's); `residual_sums_saved`: `model.RESIDUAL_SUMS_SAVED` (False: the
    partitioner decides, as before that mark)."""
    from torch._inductor.compile_fx import compile_fx
    import torch._functorch.config as functorch_config

    from megatron_pmlm.config import model_config_from_preset
    from megatron_pmlm.models import bucket_attention, ffn_activation, hidden_dropout, model
    from megatron_pmlm.models.model import BertLayer
    from megatron_pmlm.parallel.layers import LocalLayers

    overrides = {"attention_backend": "triton"}
    if dropout is not None:
        overrides.update(hidden_dropout=dropout, attention_dropout=dropout)
    config = model_config_from_preset(preset, **overrides)
    layer = BertLayer(config, LocalLayers()).to(torch.bfloat16).train()
    hidden = torch.randn(batch, width, config.hidden_size, dtype=torch.bfloat16, requires_grad=True)
    codes = torch.randint(0, config.rel_pos_bins, (batch, width, width), dtype=torch.uint8)
    table = torch.zeros(config.num_attention_heads, config.rel_pos_bins, requires_grad=True)
    inputs = bucket_attention.kernel_inputs(codes, table)

    captured: dict = {}

    def keep_graph(graph_module, example_inputs):
        captured["dynamo"] = (graph_module, example_inputs)

        def stop(*args, **kwargs):
            raise _Stop

        return stop

    # Traced, never run: the triton backend's attention is a custom op, opaque to Inductor, which the model
    # accepts on the CPU only in Triton's interpreter; the trace sees it as the interpreter would.
    with contextlib.suppress(_Stop), unittest.mock.patch.object(bucket_attention, "INTERPRETED", True), \
            unittest.mock.patch.object(ffn_activation, "INTERPRETED", ffn_activation.KERNEL_ENABLED), \
            unittest.mock.patch.object(hidden_dropout, "INTERPRETED", hidden_dropout.KERNEL_ENABLED), \
            unittest.mock.patch.object(model, "RESIDUAL_SUMS_SAVED", residual_sums_saved):
        torch.compile(BertLayer.forward, backend=keep_graph, dynamic=False)(layer, hidden, inputs)
    graph_module, example_inputs = captured["dynamo"]

    graphs: list = []

    def keep_partitions(partition, partition_inputs, *args, **kwargs):
        graphs.append((partition, list(partition_inputs), kwargs))
        if len(graphs) == 2:
            raise _Stop
        return lambda *a, **k: None

    with contextlib.suppress(_Stop), functorch_config.patch(force_non_lazy_backward_lowering=True,
                                                            **(functorch_settings or {})):
        compile_fx(graph_module, example_inputs, inner_compile=keep_partitions)
    if len(graphs) != 2:
        raise RuntimeError(f"AOT autograd produced {len(graphs)} graphs for the layer, not a forward and a backward")
    return graphs, config


@contextlib.contextmanager
def fake_cuda_device(name: str = "NVIDIA H100 80GB HBM3", capability: tuple[int, int] = (9, 0)):
    """torch.cuda, Inductor's device interface and Triton's driver answering as one GPU would, for
    lowering and scheduling only (no CUDA library is loaded; every patch is undone on exit)."""
    from torch._dynamo.device_interface import CudaInterface
    import torch._inductor.codegen.triton
    import torch._inductor.scheduler
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver

    properties = types.SimpleNamespace(
        name=name, major=capability[0], minor=capability[1], multi_processor_count=132, total_memory=80 << 30,
        max_threads_per_multi_processor=2048, warp_size=32, regs_per_multiprocessor=65536,
        shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472, max_threads_per_block=1024,
        L2_cache_size=50 << 20, gcnArchName="", clock_rate=1980000, memory_clock_rate=2619000,
        memory_bus_width=5120, uuid="fake")
    answers = {
        (torch.cuda, "is_available"): lambda: True,
        (torch.cuda, "device_count"): lambda: 1,
        (torch.cuda, "current_device"): lambda: 0,
        (torch.cuda, "set_device"): lambda *a, **k: None,
        (torch.cuda, "synchronize"): lambda *a, **k: None,
        (torch.cuda, "get_device_properties"): lambda *a, **k: properties,
        (torch.cuda, "get_device_capability"): lambda *a, **k: capability,
        (torch.cuda, "get_device_name"): lambda *a, **k: name,
        (torch.cuda, "is_bf16_supported"): lambda *a, **k: True,
        (torch.cuda, "get_rng_state"): lambda *a, **k: torch.zeros(16, dtype=torch.uint8),
        (torch.cuda, "set_rng_state"): lambda *a, **k: None,
        (torch.cuda, "_exchange_device"): lambda index: 0,
        (torch.cuda, "_maybe_exchange_device"): lambda index: 0,
        (CudaInterface, "get_device_properties"): staticmethod(lambda *a, **k: properties),
        (CudaInterface.Worker, "get_device_properties"): staticmethod(lambda *a, **k: properties),
        (CudaInterface, "get_compute_capability"): staticmethod(lambda *a, **k: capability[0] * 10 + capability[1]),
        (CudaInterface, "current_device"): staticmethod(lambda: 0),
        (CudaInterface.Worker, "current_device"): staticmethod(lambda: 0),
        (CudaInterface, "is_available"): staticmethod(lambda: True),
        (torch._inductor.scheduler, "has_triton"): lambda: True,
        (torch._inductor.codegen.triton, "has_triton"): lambda: True,
        # The CPU build's Python indexing asks for a CUDA device guard: basic indexing as view ops.
        (torch.Tensor, "__getitem__"): _basic_indexing(torch.Tensor.__getitem__),
    }
    missing = object()
    saved = {key: vars(key[0]).get(key[1], missing) for key in answers}
    capability_code = capability[0] * 10 + capability[1]
    active_driver = driver._active  # None until something asks Triton for its driver
    try:
        for (owner, attribute), value in answers.items():
            setattr(owner, attribute, value)
        driver.set_active(types.SimpleNamespace(get_current_target=lambda: GPUTarget("cuda", capability_code, 32),
                                                get_current_device=lambda: 0))
        yield
    finally:
        for (owner, attribute), value in saved.items():
            if value is missing:  # inherited (Tensor.__getitem__ from the C base class)
                delattr(owner, attribute)
            else:
                setattr(owner, attribute, value)
        driver._active = active_driver


def _basic_indexing(original):
    def getitem(self, index):
        items = index if isinstance(index, tuple) else (index,)
        if self.device.type != "cuda" or not all(
                isinstance(item, (int, slice)) or item is None or item is Ellipsis for item in items):
            return original(self, index)
        if Ellipsis in items:
            at = items.index(Ellipsis)
            missing = self.dim() - sum(1 for item in items if item is not None and item is not Ellipsis)
            items = items[:at] + (slice(None),) * missing + items[at + 1:]
        out, dim = self, 0
        for item in items:
            if item is None:
                out, dim = out.unsqueeze(dim), dim + 1
            elif isinstance(item, int):
                out = out.select(dim, item)
            else:
                start, stop, step = item.indices(out.shape[dim])
                out, dim = torch.ops.aten.slice.Tensor(out, dim, start, stop, step), dim + 1
        return out

    return getitem


def schedule_for_cuda(graph, inputs: list, kwargs: dict) -> tuple[list[dict], str]:
    """Lower and schedule one captured graph for CUDA (inside `fake_cuda_device`): one record per
    scheduled node (kind, the ATen ops it fuses, bytes read and written), and the wrapper code."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.codegen.triton import TritonScheduling
    from torch._inductor.compile_fx import compile_fx_inner
    import torch._inductor.graph as graph_lowering
    from torch._inductor.virtualized import V
    from torch._subclasses.fake_tensor import FakeTensorMode

    cuda = torch.device("cuda", 0)

    def on_cuda(value):
        if isinstance(value, torch.device) and value.type == "cpu":
            return cuda
        if isinstance(value, (list, tuple)):
            return type(value)(on_cuda(item) for item in value)
        return value

    for node in graph.graph.nodes:
        node.args = on_cuda(node.args)
        node.kwargs = {key: on_cuda(value) for key, value in node.kwargs.items()}
    graph.recompile()
    mode = FakeTensorMode()
    with mode:
        fakes = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=cuda) if isinstance(t, torch.Tensor)
                 else t for t in inputs]
    scheduled: dict = {}
    kernel_names: dict[str, str] = {}  # scheduler node -> the Triton kernel it went into (a GPU trace's name)

    def define_kernel(scheduling, src_code, node_schedule, kernel):
        name = define_kernel.original(scheduling, src_code, node_schedule, kernel)
        for node in node_schedule:
            for part in (node.get_nodes() if hasattr(node, "get_nodes") else ()):
                kernel_names[part.get_name()] = name
        return name

    def keep_schedule(lowering):
        wrapper = lowering.codegen()
        scheduled["nodes"] = [_describe(node, kernel_names) for node in lowering.scheduler.nodes]
        code = wrapper[0] if isinstance(wrapper, tuple) else wrapper
        scheduled["code"] = getattr(code, "value", str(code))
        raise _Stop

    define_kernel.original = TritonScheduling.define_kernel
    with contextlib.suppress(_Stop), tracing(TracingContext(mode)), V.set_fake_mode(mode), \
            unittest.mock.patch.object(graph_lowering.GraphLowering, "compile_to_module", keep_schedule), \
            unittest.mock.patch.object(TritonScheduling, "define_kernel", define_kernel):
        compile_fx_inner(graph, fakes, **kwargs)
    if "nodes" not in scheduled:
        raise RuntimeError("Inductor did not reach its scheduler for the layer's graph")
    return scheduled["nodes"], scheduled["code"]


def _describe(node, kernel_names: dict[str, str]) -> dict:
    from torch._inductor.scheduler import ExternKernelSchedulerNode, NopKernelSchedulerNode

    if isinstance(node, ExternKernelSchedulerNode):
        kind = "extern"
        kernel = (getattr(node.node, "python_kernel_name", None) or getattr(node.node, "op_overload", None)
                  or type(node.node).__name__)  # MultiOutput: an output of the op before it (no bytes)
        ops = [str(kernel).replace("extern_kernels.", "").replace("torch.ops.", "")]
        if ops[0] in OUR_MEMORY_BOUND_KERNELS:
            kind, kernel_names = "ours", {node.get_name(): OUR_MEMORY_BOUND_KERNELS[ops[0]]}
    else:
        kind = "none" if isinstance(node, NopKernelSchedulerNode) else "gemm" if node.is_template() else "triton"
        targets = {origin.target for sub in node.get_nodes() for origin in getattr(sub.node, "origins", ())
                   if origin.op == "call_function"}
        ops = sorted({getattr(target, "__name__", str(target)).split(".")[0] for target in targets})
    kernels = sorted({kernel_names[part.get_name()] for part in node.get_nodes() if part.get_name() in kernel_names})
    # a GEMM template with what it fused: Inductor's own count leaves out the buffers its prologue and main
    # loop read (it counted 0.2 activations for a weight gradient reading 5): every buffer it reads or writes
    moved = _buffer_bytes(node) if kind == "gemm" else int(node.get_read_write_buffers_sizes())
    return {"node": node.get_name(), "kind": kind, "kernel": ", ".join(kernels) or ops[0], "ops": ops,
            "bytes": moved}


def _buffer_bytes(node) -> int:
    """The bytes of every buffer a scheduled node reads or writes, each once (an epilogue that reads the
    template's output in place counts it once)."""
    from torch._inductor.virtualized import V

    total = 0
    for name in sorted({dependency.name for dependency in (*node.read_writes.reads, *node.read_writes.writes)}):
        buffer = V.graph.try_get_buffer(name)
        if buffer is None:
            continue
        total += int(torch.Size(int(size) for size in buffer.get_size()).numel()) * buffer.get_dtype().itemsize
    return total


GEMM_EXTERNS = {"mm", "addmm", "bmm", "baddbmm", "aten.mm.default", "aten.addmm.default", "aten.bmm.default",
                "SubgraphBuffer"}
"""Extern calls that are GEMMs, counted beside the templates as the layer's GEMM bytes: cuBLAS calls, and a
GEMM the autotuner split along its long reduction dimension (`SubgraphBuffer`: decompose-k, a choice
that is not a template)."""
GEMM_TEMPLATE_SETTINGS = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "TRITON",
                          "benchmark_epilogue_fusion": False}
"""`--gemm-templates`: every GEMM one of Inductor's Triton templates, epilogues fused where Inductor's
heuristics allow (no timing of the fusion: there is no GPU)."""


@contextlib.contextmanager
def templates_timed_alike():
    """Inductor's autotuner answered without a device: every template choice the same time, any extern
    (cuBLAS) choice a longer one."""
    from torch._inductor import select_algorithm

    def benchmark(self, choices, *args, **kwargs):
        return {choice: 2.0 if isinstance(choice, select_algorithm.ExternKernelCaller) else 1.0 for choice in choices}

    with unittest.mock.patch.object(select_algorithm.AlgorithmSelectorCache, "benchmark", benchmark):
        yield


H100_SXM_ISSUE = (132, 4, 1.98e9)
"""An H100 SXM's SMs, the warp instructions each issues a clock (one a scheduler) and its boost clock:
the issue floor's denominator (optimistic: integer multiplies, Philox's, issue at half that rate)."""
OUR_LAUNCHES = {
    "gelu_backward_kernel": ("megatron_pmlm.models.ffn_activation_triton", {
        "grad_ptr": "*bf16", "pre_ptr": "*bf16", "out_ptr": "*bf16", "partial_ptr": "*fp32", "rows": "i32",
        "columns": "i32", "ROWS": "constexpr", "COLUMNS": "constexpr", "ROUND_TO_BF16": "constexpr"},
        {"ROWS": 32, "COLUMNS": 128, "ROUND_TO_BF16": False}, 4, 32 * 128, "ffn"),
    "dropout_keep_bits_kernel": ("megatron_pmlm.models.hidden_dropout_triton", {
        "seed_ptr": "*i64", "bits_ptr": "*u8", "rows": "i32", "columns": "i32", "byte_columns": "i32",
        "threshold": "i32", "ROWS": "constexpr", "BYTES": "constexpr"},
        {"ROWS": 32, "BYTES": 32}, 4, 32 * 32 * 8, "hidden")}
"""Our kernels' launches as models/ffn_activation.py and models/hidden_dropout.py make them: module,
signature, constexprs, warps, elements a program (GELU: [tokens, ffn] values; dropout: positions of
[tokens, hidden]) and which width's [tokens, width] elements the launch covers."""
KERNEL_SOURCE = re.compile(r"(\w+) = async_compile\.triton\('\w+', '''(.*?)''', device_str='cuda'\)", re.S)
"""An Inductor kernel's definition in its wrapper code: its name and Triton source."""


def _sass(compiled) -> tuple[list[str], list[str], int]:
    """(every SASS instruction, the hot loop's, registers a thread) of a compiled Triton kernel, read by
    Triton's cuobjdump as tools/bench_kernel_code.py reads it."""
    import subprocess
    import tempfile

    from bench_kernel_code import INSTRUCTION, binary_tools, hot_loop

    cuobjdump = binary_tools()
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run([cuobjdump, "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True, check=True).stdout
    registers = re.search(r"\bREG:(\d+)", usage)
    return [text for _, text in INSTRUCTION.findall(sass)], hot_loop(sass), int(registers.group(1)) if registers else 0


def _count(kernel, signature: dict, constexprs: dict, attributes: dict, warps: int, capability: int) -> dict:
    """One kernel compiled for a GPU of `capability`: its SASS instructions, its hot loop's, its registers."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attributes),
                              target=GPUTarget("cuda", capability, 32), options={"num_warps": warps, "num_stages": 1})
    instructions, loop, registers = _sass(compiled)
    return {"sass_instructions": len(instructions), "loop_instructions": len(loop), "registers": registers,
            "num_warps": warps}


def inductor_launches(source: str, folder: Path):
    """(the jitted kernel, Inductor's candidate launches as [(constexprs, warps)], its signature and
    alignment) of one Inductor kernel's source: its heuristics decorator run with the autotuner
    replaced by a recorder (the launches it would time on the GPU; inside `fake_cuda_device`)."""
    from torch._inductor.runtime import triton_heuristics

    name = re.search(r"^def (\w+)\(", source, re.M).group(1)
    recorded: dict = {}

    def record(size_hints, configs, triton_meta, heuristic_type, filename=None, inductor_meta=None, **kwargs):
        recorded.update(configs=list(configs), meta=triton_meta)
        return lambda kernel: kernel

    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.py"
    path.write_text(source.replace("triton_helpers.set_driver_to_gpu()", ""))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    with unittest.mock.patch.object(triton_heuristics, "cached_autotune", record):
        spec.loader.exec_module(module)
    meta = recorded["meta"]
    launches = []
    for launch in recorded["configs"]:
        constexprs = {key: value for key, value in {**meta.get("constants", {}), **launch.kwargs}.items()
                      if key in meta["signature"]}
        if (constexprs, launch.num_warps) not in launches:
            launches.append((constexprs, launch.num_warps))
    return getattr(module, name), launches, meta["signature"], meta["configs"][0]


def _instructions_per_element(source: str, sizes: dict, constexprs: dict, warps: int, folder: Path,
                              capability: int) -> dict:
    """A thread's SASS instructions per element of an Inductor kernel's iteration space at one launch:
    a pointwise kernel's per block of elements; a persistent reduction's per block of whole rows (a
    mix-order reduction's loop over rows, an iteration per XBLOCK rows); a looped reduction's whole
    program over its rows, its loop of R0_BLOCK-wide chunks counted from the kernel compiled for one
    and for two chunks (Triton unrolls loops of constant trip counts, partly or wholly)."""
    kernel, _, signature, alignment = inductor_launches(source, folder / "launch")
    row = _count(kernel, signature, constexprs, alignment, warps, capability)
    rows = min(constexprs.get("XBLOCK", 1), sizes["x"]) * min(constexprs.get("YBLOCK", 1), sizes.get("y", 1))
    threads = warps * 32
    if "@triton_heuristics.persistent_reduction(" in source or "r0_" not in sizes:
        issued = row["loop_instructions"] or row["sass_instructions"]
        return {**row, "instructions_per_element": issued * threads / (rows * sizes.get("r0_", 1))}
    chunk = min(constexprs.get("R0_BLOCK", sizes["r0_"]), sizes["r0_"])
    totals = []
    for chunks in (1, 2):
        variant = re.sub(r"\br0_numel = \d+", f"r0_numel = {chunk * chunks}", source)
        kernel, _, _, _ = inductor_launches(variant, folder / f"chunks{chunks}")
        totals.append(_count(kernel, signature, constexprs, alignment, warps, capability)["sass_instructions"])
    trips = -(-sizes["r0_"] // chunk)
    issued = totals[0] + (trips - 1) * (totals[1] - totals[0])
    return {**row, "instructions_per_element": issued * threads / (rows * sizes["r0_"])}


def kernel_instructions(codes: list[str], tokens: int, config, wanted: set[str], capability: int = 90) -> dict[str, dict]:
    """Each Triton kernel named in `wanted` of the scheduled graphs' wrapper `codes` (Inductor's, of static
    sizes: at the fewest instructions among the launches Inductor would time) and of ours, compiled for a
    GPU of `capability` on the CPU (Triton's compiler and cuobjdump, no GPU): SASS instructions a thread
    issues per element of the kernel's iteration space, and the elements (`tokens` rows for ours)."""
    import tempfile

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="bench_layer_graph_") as folder:
        for name, source in (pair for code in codes for pair in KERNEL_SOURCE.findall(code)):
            sizes = {axis: int(value) for axis, value in re.findall(r"\b(x|y|r0_)numel = (\d+)", source)}
            if "x" not in sizes or name in results or name not in wanted:
                continue  # of symbolic sizes, counted, or not asked for
            _, launches, signature, _ = inductor_launches(source, Path(folder) / name)
            counted = []
            for constexprs, warps in launches:
                if any(kind == "constexpr" and key not in constexprs for key, kind in signature.items()):
                    continue  # a launch parameter this tool does not model
                row = _instructions_per_element(source, sizes, constexprs, warps, Path(folder) / name, capability)
                counted.append({**row, "launch": {key: value for key, value in constexprs.items()
                                                  if key.endswith(("BLOCK", "SIZE"))}})
            if counted:
                results[name] = {**min(counted, key=lambda row: row["instructions_per_element"]),
                                 "launches": len(counted), "elements": sizes["x"] * sizes.get("y", 1) * sizes.get("r0_", 1)}
    for name, (module_name, signature, constexprs, warps, per_program, width) in OUR_LAUNCHES.items():
        if name not in wanted:
            continue
        columns = config.ffn_hidden_size if width == "ffn" else config.hidden_size
        values = {"rows": tokens, "columns": columns, "byte_columns": -(-columns // 8)}
        # as Triton's launcher specialises a launch: pointers (PyTorch's allocations) and integers that
        # are multiples of 16 marked so, which lets it load vectors
        alignment = {(index,): [["tt.divisibility", 16]] for index, (argument, kind) in enumerate(signature.items())
                     if kind.startswith("*") or (kind == "i32" and values.get(argument, 1) % 16 == 0)}
        row = _count(getattr(importlib.import_module(module_name), name), signature, constexprs, alignment, warps,
                     capability)
        results[name] = {**row, "instructions_per_element": row["sass_instructions"] * warps * 32 / per_program,
                         "launches": 1, "launch": dict(constexprs),
                         "elements": tokens * (config.ffn_hidden_size if width == "ffn" else config.hidden_size)}
    return results


def parse_settings(texts: list[str]) -> tuple[dict, dict]:
    """`inductor.NAME=VALUE` and `functorch.NAME=VALUE` (a Python literal) into torch._inductor.config
    and torch._functorch.config values, each name checked against its config (ValueError: one line)."""
    import ast

    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    settings: dict[str, dict] = {"inductor": {}, "functorch": {}}
    for text in texts:
        name, equals, value = text.partition("=")
        owner, _, key = name.partition(".")
        if not equals or owner not in settings or not key:
            raise ValueError(f"{text!r}: give inductor.NAME=VALUE or functorch.NAME=VALUE")
        config = inductor_config if owner == "inductor" else functorch_config
        if key not in config._config:  # torch's ConfigModule: every setting by its dotted name
            raise ValueError(f"{text!r}: torch's {owner} config has no setting {key!r}")
        try:
            settings[owner][key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            raise ValueError(f"{text!r}: {value!r} is not a Python literal (True, 0.9, 'name')") from None
    return settings["inductor"], settings["functorch"]


def layer_report(preset: str, batch: int, width: int, dropout: float | None, bandwidth_tbps: float,
                 settings: list[str] | None = None, residual_sums_saved: bool = True, instructions: bool = False,
                 gemm_templates: bool = False) -> dict:
    """Both graphs' schedules with their totals (see the module docstring), under `settings`
    (`parse_settings`) and `residual_sums_saved` (`capture_layer_graphs`); with `instructions`, each
    fused kernel's SASS instructions an element and its issue floor beside its bytes' floor
    (`kernel_instructions`); with `gemm_templates`, the GEMMs as Inductor's Triton templates
    (GEMM_TEMPLATE_SETTINGS, `templates_timed_alike`)."""
    import torch._inductor.config as inductor_config

    inductor_settings, functorch_settings = parse_settings(settings or [])
    if gemm_templates:
        inductor_settings = {**GEMM_TEMPLATE_SETTINGS, **inductor_settings}
    graphs, config = capture_layer_graphs(preset, batch, width, dropout, functorch_settings, residual_sums_saved)
    activation = batch * width * config.hidden_size * 2  # one [tokens, hidden] bf16 tensor
    report = {"preset": preset, "micro_batch_size": batch, "width": width, "hidden_size": config.hidden_size,
              "num_layers": config.num_layers, "dropout": config.hidden_dropout, "activation_bytes": activation,
              "bandwidth_tbps": bandwidth_tbps, "settings": list(settings or []),
              "residual_sums_saved": residual_sums_saved, "gemm_templates": gemm_templates, "graphs": {}}
    codes = []
    with fake_cuda_device(), inductor_config.patch(inductor_settings), \
            (templates_timed_alike() if gemm_templates else contextlib.nullcontext()):
        for name, (graph, inputs, kwargs) in zip(("forward", "backward"), graphs):
            nodes, code = schedule_for_cuda(graph, inputs, kwargs)
            codes.append(code)
            nodes = [node for node in nodes if node["kind"] != "none"]
            fused = sum(node["bytes"] for node in nodes if node["kind"] == "triton")
            ours = sum(node["bytes"] for node in nodes if node["kind"] == "ours")
            gemms = [node for node in nodes if node["kind"] == "gemm"
                     or (node["kind"] == "extern" and node["ops"][0] in GEMM_EXTERNS)]
            report["graphs"][name] = {
                "nodes": nodes, "triton_launches": code.count(".run("),
                "our_kernels": sum(1 for node in nodes if node["kind"] == "ours"),
                "extern_calls": sum(1 for node in nodes if node["kind"] == "extern"),
                "gemm_templates": sum(1 for node in nodes if node["kind"] == "gemm"),
                "triton_bytes": fused, "our_bytes": ours,
                "extern_bytes": sum(node["bytes"] for node in nodes if node["kind"] == "extern"),
                # cuBLAS calls and templates alike: their operands, outputs and what a template fused
                "gemm_bytes": sum(node["bytes"] for node in gemms), "gemms": len(gemms),
                "memory_bound_activations": (fused + ours) / activation}
    moved = sum(graph["triton_bytes"] + graph["our_bytes"] for graph in report["graphs"].values())
    report["memory_bound_activations_per_layer"] = moved / activation
    report["gemm_activations_per_layer"] = sum(graph["gemm_bytes"] for graph in report["graphs"].values()) / activation
    report["memory_bound_floor_ms_per_step"] = moved * config.num_layers / (bandwidth_tbps * 1e12) * 1e3
    if instructions:
        # the kernels moving at least 1% of an activation (seeds, concatenations of weights: not worth compiling)
        wanted = {node["kernel"] for graph in report["graphs"].values() for node in graph["nodes"]
                  if node["kind"] in ("triton", "ours") and node["bytes"] >= activation / 100}
        with fake_cuda_device():  # Inductor's launch heuristics read the device
            counted = kernel_instructions(codes, batch * width, config, wanted)
        sms, issue, clock = H100_SXM_ISSUE
        for node in (node for graph in report["graphs"].values() for node in graph["nodes"]):
            row = counted.get(node["kernel"])
            if row and node["kind"] in ("triton", "ours"):
                node.update({key: row[key] for key in ("instructions_per_element", "registers", "num_warps", "launch")},
                            issue_floor_us=row["instructions_per_element"] * row["elements"] / 32 / (sms * issue * clock) * 1e6,
                            bytes_floor_us=node["bytes"] / (bandwidth_tbps * 1e12) * 1e6)
        report["issue_rate"] = {"sms": sms, "warp_instructions_per_clock": issue, "clock_hz": clock}
    return report


def trace_bandwidth(report: dict, trace_path: str) -> dict:
    """Each fused kernel's time in a GPU trace of a step at the report's shape (a Chrome trace from
    torch.profiler: `make gpu-check`'s `*.trace.json`) and the bandwidth it reached moving its bytes.
    Kernels are matched by name (Inductor names a kernel by its fused ops and its place in the graph,
    the same on the GPU as here); a name met in the trace more often than the layers run it also
    counts other graphs' kernels of that name (the embedding's, the losses')."""
    with open(trace_path, encoding="utf-8") as file:
        trace = json.load(file)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    durations: dict[str, list[float]] = collections.defaultdict(list)
    for event in events:
        if isinstance(event, dict) and event.get("cat") == "kernel" and "dur" in event:
            durations[event.get("name", "")].append(float(event["dur"]))
    kernels: dict[str, dict] = {}
    for graph_name, graph in report["graphs"].items():
        for node in graph["nodes"]:
            if node["kind"] not in ("triton", "ours"):
                continue
            row = kernels.setdefault(node["kernel"], {"graph": graph_name, "kernel": node["kernel"],
                                                      "bytes": node["bytes"], "nodes": 0})
            row["nodes"] += 1
    for name, row in kernels.items():
        times = [duration for part in name.split(", ") for duration in durations.get(part, [])]
        row["calls"] = len(times)
        row["mean_us"] = sum(times) / len(times) if times else None
        row["tb_per_s"] = row["bytes"] / (row["mean_us"] * 1e-6) / 1e12 if times and row["mean_us"] > 0 else None
    matched = [row for row in kernels.values() if row["calls"]]
    total_us = sum(row["mean_us"] * row["calls"] for row in matched)
    floor_us = sum(row["bytes"] * row["calls"] for row in matched) / (report["bandwidth_tbps"] * 1e12) * 1e6
    return {"path": trace_path, "kernels": sorted(kernels.values(), key=lambda row: -(row["mean_us"] or 0)),
            "matched": len(matched), "unmatched": len(kernels) - len(matched), "total_ms": total_us / 1e3,
            "floor_ms": floor_us / 1e3}


def print_report(report: dict) -> None:
    print(f"{report['preset']} layer, micro batch {report['micro_batch_size']} x width {report['width']}, dropout "
          f"{report['dropout']}{', ' + ', '.join(report['settings']) if report['settings'] else ''}"
          f"{'' if report['residual_sums_saved'] else ', residual sums recomputed'}"
          f"{', GEMMs as Triton templates' if report['gemm_templates'] else ''}: "
          f"one activation = {report['activation_bytes'] / 1e6:.1f} MB")
    for name, graph in report["graphs"].items():
        print(f"\n{name}: {graph['triton_launches']} Triton launches of Inductor's, {graph['our_kernels']} of ours, "
              f"{graph['extern_calls']} extern calls; the memory-bound kernels move "
              f"{(graph['triton_bytes'] + graph['our_bytes']) / 1e9:.3f} GB = {graph['memory_bound_activations']:.2f} "
              f"activations")
        counted = "issue_rate" in report
        extra = f" {'instr/el':>8s} {'issue us':>8s} {'bytes us':>8s}" if counted else ""
        print(f"  {'kind':7s} {'MB':>9s} {'activations':>11s}{extra}  kernel (a GPU trace's name) or extern call")
        for node in sorted(graph["nodes"], key=lambda node: -node["bytes"]):
            extra = ""
            if counted:
                extra = (f" {node['instructions_per_element']:8.1f} {node['issue_floor_us']:8.1f} {node['bytes_floor_us']:8.1f}"
                         if "issue_floor_us" in node else f" {'':8s} {'':8s} {'':8s}")
            print(f"  {node['kind']:7s} {node['bytes'] / 1e6:9.1f} {node['bytes'] / report['activation_bytes']:11.2f}{extra}  "
                  f"{node['kernel'][:110]}")
    print(f"\nmemory-bound kernels: {report['memory_bound_activations_per_layer']:.2f} activations a layer; x "
          f"{report['num_layers']} layers at {report['bandwidth_tbps']} TB/s: {report['memory_bound_floor_ms_per_step']:.2f} "
          f"ms a step at least")
    gemms = sum(graph["gemms"] for graph in report["graphs"].values())
    print(f"GEMMs ({gemms}, {'Triton templates with what they fused' if report['gemm_templates'] else 'cuBLAS'}): their "
          f"operands and outputs {report['gemm_activations_per_layer']:.2f} activations a layer; with the memory-bound "
          f"kernels {report['memory_bound_activations_per_layer'] + report['gemm_activations_per_layer']:.2f}")
    if "issue_rate" in report:
        rate = report["issue_rate"]
        slower = sorted({node["kernel"] for graph in report["graphs"].values() for node in graph["nodes"]
                         if node.get("bytes_floor_us", 0) >= 1 and node["issue_floor_us"] > node["bytes_floor_us"]})
        print(f"instructions: SASS for SM 9.0 a thread issues per element (Inductor's kernels: the fewest among the "
              f"launches it would time); issue floor at {rate['warp_instructions_per_clock']} warp instructions a clock "
              f"on {rate['sms']} SMs at {rate['clock_hz'] / 1e9:.2f} GHz; issuing takes longer than the bytes (>= 1 us "
              f"of them) in: {', '.join(slower) or 'none'}")
    trace = report.get("trace")
    if trace:
        print(f"\nin the trace {trace['path']}: {trace['matched']} of {trace['matched'] + trace['unmatched']} kernels "
              f"found, {trace['total_ms']:.2f} ms of kernel time (their bytes at {report['bandwidth_tbps']} TB/s: "
              f"{trace['floor_ms']:.2f} ms)")
        print(f"  {'calls':>5s} {'mean us':>9s} {'TB/s':>6s} {'MB':>8s}  kernel")
        for row in trace["kernels"]:
            mean = f"{row['mean_us']:9.1f}" if row["mean_us"] is not None else f"{'-':>9s}"
            rate = f"{row['tb_per_s']:6.2f}" if row["tb_per_s"] is not None else f"{'-':>6s}"
            print(f"  {row['calls']:5d} {mean} {rate} {row['bytes'] / 1e6:8.1f}  {row['kernel'][:100]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="base", help="model preset (megatron_pmlm.config.PRESETS)")
    parser.add_argument("--width", type=int, default=176,
                        help="the layout width T (176: seq 128's under --compile; 688: seq 512's)")
    parser.add_argument("--micro-batch-size", type=int, default=256, help="sequences a micro batch")
    parser.add_argument("--dropout", type=float, default=None,
                        help="hidden and attention dropout (default: the preset's, the recipe's 0.1)")
    parser.add_argument("--bandwidth", type=float, default=H100_SXM_BANDWIDTH_TBPS,
                        help="HBM bandwidth in TB/s for the floor (H100 SXM: 3.35)")
    parser.add_argument("--config", action="append", default=[], metavar="OWNER.NAME=VALUE",
                        help="a torch setting for the compilation, repeatable: inductor.NAME=VALUE "
                        "(torch._inductor.config) or functorch.NAME=VALUE (AOT autograd's partitioner)")
    parser.add_argument("--recompute-residual-sums", action="store_true",
                        help="leave the residual sums to AOT autograd's partitioner (models.model.RESIDUAL_SUMS_SAVED "
                        "off), as before they were marked to be saved: the schedule that mark changed")
    parser.add_argument("--trace", help="a Chrome trace of a GPU step at this shape (make gpu-check's *.trace.json): "
                        "each fused kernel's time there and the bandwidth it reached")
    parser.add_argument("--instructions", action="store_true",
                        help="also compile each fused kernel moving >= 1%% of an activation for SM 9.0 (Triton's compiler "
                        "and cuobjdump, no GPU): SASS instructions an element, and the time issuing them takes at least "
                        "beside the bytes' floor")
    parser.add_argument("--gemm-templates", action="store_true",
                        help="the GEMMs as Inductor's Triton templates with the elementwise work it fuses into them "
                        "(as TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 where a template times faster than cuBLAS): what that "
                        "mode could save of the fused kernels' bytes")
    parser.add_argument("--json", help="also write the figures to this file ('-': standard output)")
    args = parser.parse_args(argv)
    from megatron_pmlm.config import PRESETS

    if args.preset not in PRESETS:
        parser.error(f"--preset {args.preset!r}: choose one of {', '.join(sorted(PRESETS))}")
    for flag, value in (("--width", args.width), ("--micro-batch-size", args.micro_batch_size)):
        if value < 2:  # dynamo specialises sizes 0 and 1
            parser.error(f"{flag} {value}: give at least 2")
    if args.dropout is not None and not 0 <= args.dropout < 1:
        parser.error(f"--dropout {args.dropout}: give a probability in [0, 1)")
    if args.bandwidth <= 0:
        parser.error(f"--bandwidth {args.bandwidth}: give a positive bandwidth in TB/s")
    if args.trace and not Path(args.trace).is_file():
        parser.error(f"--trace {args.trace}: no such file")
    try:
        parse_settings(args.config)
    except ValueError as error:
        parser.error(f"--config {error}")
    if importlib.util.find_spec("triton") is None:
        parser.error("Triton is not installed here (pyproject's test extra installs it on x86_64 Linux): Inductor "
                     "generates the GPU's kernels with it")
    if args.json:
        try:
            check_output(args.json, "--json")
        except OutputError as error:
            parser.error(str(error))
    with logs_to_stderr(args.json):
        report = layer_report(args.preset, args.micro_batch_size, args.width, args.dropout, args.bandwidth,
                              args.config, residual_sums_saved=not args.recompute_residual_sums,
                              instructions=args.instructions, gemm_templates=args.gemm_templates)
        if args.trace:
            try:
                report["trace"] = trace_bandwidth(report, args.trace)
            except (OSError, ValueError, KeyError, TypeError) as error:
                print(f"error: --trace {args.trace}: not a Chrome trace ({type(error).__name__}: {error})",
                      file=sys.stderr)
                return 2
        print_report(report)
    if args.json:
        write_json_atomically(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
