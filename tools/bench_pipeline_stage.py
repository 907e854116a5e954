#!/usr/bin/env python
"""One pipeline stage's transformer layers, eager against `--compile`: kernels and seconds per micro
batch, on any machine (the CPU's inductor C++ backend too).

    python tools/bench_pipeline_stage.py --preset base --hidden-size 96 --layers 6 --seq-length 128 \
        --micro-batch-size 4 --threads 2
    python tools/bench_pipeline_stage.py --preset base --layers 6 --seq-length 512 --micro-batch-size 16 --bf16 --json stage.json

A stage of `--layers` LayerPipes (models/pipeline.py: what `pretrain --pipeline-model-parallel-size`
gives each process) runs forward and backward over one micro batch as it receives it: the hidden
states, the fp32 relative-bias table and the layout of real PMLM masks (tools/bench_train.py's
examples), padded to the compile layout quantum for both. Then the same layers compiled as
`pretrain --compile` compiles them (`compiled.compile_transformer_layers`: one region, the layer's
`BertLayer.forward`, shared by the stage's layers). Per micro batch: kernels (training/kernel_count.py:
eager, dispatched ATen ops; compiled, generated kernels + extern calls + the eager rest), seconds
(median of --iterations after --warmup; the first compiled call, the compilation, is reported apart),
and how far the compiled output and the table's gradient are from eager's (dropout 0).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from megatron_pmlm.config import ATTENTION_BACKENDS, HelpFormatter, model_config_from_preset  # noqa: E402
from megatron_pmlm.files import OutputError, check_output, logs_to_stderr, write_json_atomically  # noqa: E402
from megatron_pmlm.models.compiled import check_compile, compile_layout_quantum, compile_transformer_layers  # noqa: E402
from megatron_pmlm.models.layout import pad_layout_inputs  # noqa: E402
from megatron_pmlm.models.pipeline import LayerPipe, StageCache  # noqa: E402
from megatron_pmlm.parallel.layers import LocalLayers  # noqa: E402
from megatron_pmlm.training.kernel_count import count_kernels, prepare_compiled_counting  # noqa: E402
from tools.bench_train import make_examples, pmlm_batch  # noqa: E402


def build_stage(config, layers: int, seed: int) -> nn.ModuleList:
    """`layers` LayerPipes sharing one stage cache, as `build_pipeline_model` gives a process."""
    torch.manual_seed(seed)
    cache = StageCache()
    return nn.ModuleList(LayerPipe(config, LocalLayers(), stage_cache=cache) for _ in range(layers))


def stage_inputs(config, micro_batch_size: int, seq_length: int, device: torch.device, dtype: torch.dtype,
                 seed: int) -> tuple[torch.Tensor, ...]:
    """What the stage receives (models/pipeline.py's 8-tuple), at the compile quantum's width."""
    batch = pmlm_batch(make_examples(micro_batch_size, seq_length, config.vocab_size, seed))
    ids, positions, segments, roles, steps = pad_layout_inputs(
        compile_layout_quantum(), batch.input_ids, batch.position_ids, batch.token_type_ids, batch.roles, batch.steps)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*ids.shape, config.hidden_size, generator=generator).to(device, dtype)
    table = (torch.randn(config.num_attention_heads, config.rel_pos_bins, generator=generator) * 0.5).to(device)
    labels = torch.zeros_like(ids)
    return tuple(t.to(device) for t in (hidden, table, positions, steps, segments, roles, labels)) + (
        torch.zeros(1, dtype=torch.long, device=device),)


def make_step(stage: nn.ModuleList, inputs: tuple[torch.Tensor, ...]):
    """Forward and backward of one micro batch; returns (output, table gradient). The gradient
    coming back is a fixed random tensor (the next stage's, in a pipeline: a LayerNorm output's mean
    square would give none). The stage cache is cleared after each, as `PMLMPipeline.end_batch`
    clears it after each batch."""
    output_gradient = torch.randn(inputs[0].shape, generator=torch.Generator().manual_seed(1)).to(inputs[0])

    def step():
        hidden = inputs[0].detach().requires_grad_()
        table = inputs[1].detach().requires_grad_()
        activations = (hidden, table) + tuple(inputs[2:])
        for layer in stage:
            activations = layer(activations)
        activations[0].backward(output_gradient)
        stage[0].stage_cache.clear()
        return activations[0].detach(), table.grad

    return step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seconds_per_step(step, device: torch.device, warmup: int, iterations: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iterations):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    overrides = {name: value for name, value in (("hidden_size", args.hidden_size),
                                                 ("num_attention_heads", args.num_attention_heads)) if value}
    if args.hidden_size and not args.ffn_hidden_size:
        overrides["ffn_hidden_size"] = 4 * args.hidden_size
    if args.ffn_hidden_size:
        overrides["ffn_hidden_size"] = args.ffn_hidden_size
    config = model_config_from_preset(args.preset, vocab_size=30522, hidden_dropout=0.0, attention_dropout=0.0,
                                      attention_backend=args.attention_backend, **overrides)
    check_compile(0, 1, config.attention_backend)
    prepare_compiled_counting()
    eager = build_stage(config, args.layers, args.seed).to(device, dtype)
    compiled = copy.deepcopy(eager)
    compile_transformer_layers(compiled)
    inputs = stage_inputs(config, args.micro_batch_size, args.seq_length, device, dtype, args.seed)
    eager_step, compiled_step = make_step(eager, inputs), make_step(compiled, inputs)

    start = time.perf_counter()
    compiled_output, compiled_table_gradient = compiled_step()
    sync(device)
    first_compiled = time.perf_counter() - start
    eager_output, eager_table_gradient = eager_step()

    def relative(ours: torch.Tensor, reference: torch.Tensor) -> float:
        return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max())

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": args.preset, "hidden_size": config.hidden_size, "heads": config.num_attention_heads,
        "layers": args.layers, "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
        "width": int(inputs[0].shape[1]), "dtype": str(dtype).removeprefix("torch."),
        "attention_backend": config.attention_backend, "threads": torch.get_num_threads(),
        "eager_kernels": count_kernels(eager_step, compiled=False),
        "compiled_kernels": count_kernels(compiled_step, compiled=True),
        "eager_seconds": seconds_per_step(eager_step, device, args.warmup, args.iterations),
        "compiled_seconds": seconds_per_step(compiled_step, device, args.warmup, args.iterations),
        "first_compiled_seconds": first_compiled,
        "output_difference": relative(compiled_output, eager_output),
        "table_gradient_difference": relative(compiled_table_gradient, eager_table_gradient),
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="base")
    parser.add_argument("--hidden-size", type=int, help="override the preset's (heads stay: 96 / 12 = 8 per head)")
    parser.add_argument("--num-attention-heads", type=int)
    parser.add_argument("--ffn-hidden-size", type=int, help="default: the preset's, or 4 x --hidden-size")
    parser.add_argument("--layers", type=int, default=6, help="transformer layers in the stage")
    parser.add_argument("--seq-length", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--attention-backend", choices=[b for b in ATTENTION_BACKENDS if b != "flex"], default="sdpa")
    parser.add_argument("--bf16", action="store_true", help="the stage's weights and hidden states in bf16")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    for name in ("layers", "seq_length", "micro_batch_size", "iterations"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    return args


def main(argv=None) -> int:
    return run_comparison(parse_args(argv), measure, report)


def run_comparison(args: argparse.Namespace, measure, report) -> int:
    """The body of an eager-against-compiled tool's main (this one's, bench_palm_step's): --json
    checked before any work, the figures measured, printed (on standard error under --json -) and
    written."""
    if args.json:
        try:
            check_output(args.json, "--json")
        except OutputError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    with logs_to_stderr(args.json):  # --json -: the JSON alone on standard output
        figures = measure(args)
        report(figures)
        if args.json:
            write_json_atomically(args.json, figures)
    return 0


def report(figures: dict) -> None:
    print(f"pipeline stage: {figures['layers']} layers, {figures['preset']} (hidden {figures['hidden_size']}, "
          f"{figures['heads']} heads), seq {figures['seq_length']} x {figures['micro_batch_size']} (width "
          f"{figures['width']}), {figures['dtype']}, {figures['attention_backend']}, {figures['device']}")
    report_comparison(figures, {"output": "output_difference", "table gradient": "table_gradient_difference"})


def report_comparison(figures: dict, differences: dict[str, str]) -> None:
    """The eager and compiled rows, their ratios and the compiled-vs-eager `differences` (label: key)."""
    print("| step | kernels per micro batch | seconds per micro batch |\n|---|---|---|")
    for name in ("eager", "compiled"):
        print(f"| {name} | {figures[name + '_kernels']:,} | {figures[name + '_seconds']:.4f} |")
    print(f"compiled / eager: kernels {figures['compiled_kernels'] / figures['eager_kernels']:.2f}x, "
          f"time {figures['compiled_seconds'] / figures['eager_seconds']:.2f}x; first compiled call "
          f"{figures['first_compiled_seconds']:.1f} s; compiled vs eager: "
          + ", ".join(f"{label} {figures[key]:.1e}" for label, key in differences.items()) + " (relative)")

if __name__ == "__main__":
    sys.exit(main())
