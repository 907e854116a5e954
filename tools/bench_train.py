#!/usr/bin/env python
"""Training throughput of the PMLM model on one device: tokens/s, samples/s, model TFLOP/s, MFU and
peak memory; and, with --naive-cloze, PMLM's efficiency claim measured.

    python tools/bench_train.py --preset base --seq-length 512 --micro-batch-size 20 --bf16
    python tools/bench_train.py --preset tiny --seq-length 128 --micro-batch-size 8       # CPU, seconds
    python tools/bench_train.py --preset base --seq-length 128 --micro-batch-size 2 --naive-cloze

One step = forward + backward + AdamW over one micro batch laid out exactly as in pre-training:
real blockwise masks (Algorithm 1, 15%, factorization order, 80/10/10) on random token ids, the
originals and [P] tokens appended (T ~ 1.3 x the sequence length). Model FLOPs per token are
training.recipe.flops_per_token (6 x parameters + attention), so TFLOP/s and MFU count useful model work,
not recomputation. MFU divides by the device's dense peak for the precision (table below, or
--peak-tflops); a CPU's peak is estimated from its cores and clock and labelled as such.

--naive-cloze also times, on the same examples, what a cloze model needs for the same
predictions without PMLM's layout: one forward/backward per factorization step over the plain
sequence (tokens of later steps still masked, those of earlier steps revealed), plus the AE pass.
It prints the cost ratio PMLM / naive (UniLMv2's claim: one pass serves AE and every PAR step).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megatron_pmlm.models import flex_attention  # noqa: E402
from megatron_pmlm.config import ATTENTION_BACKENDS, HelpFormatter, MaskingConfig, model_config_from_preset  # noqa: E402
from megatron_pmlm.files import OutputError, check_output, logs_to_stderr, write_json_atomically  # noqa: E402
from megatron_pmlm.models.layout import CONTEXT, IGNORE_INDEX, MASKED, PAD, PMLMBatch, padded_width  # noqa: E402
from megatron_pmlm.data.batches import build_batch  # noqa: E402
from megatron_pmlm.data.masking import mask_example  # noqa: E402
from megatron_pmlm.models.compiled import check_compile, compile_layout_quantum, compile_transformer_layers  # noqa: E402,E501
from megatron_pmlm.models.model import PMLMForPreTraining, check_attention_backend  # noqa: E402
from megatron_pmlm.parallel.layers import LocalLayers  # noqa: E402
from megatron_pmlm.training.recipe import flops_per_token  # noqa: E402

# Dense peak TFLOP/s per device and precision (vendor datasheets, without sparsity).
PEAK_TFLOPS = {
    "V100": {"fp16": 125.0, "bf16": None, "fp32": 15.7},
    "A100": {"fp16": 312.0, "bf16": 312.0, "fp32": 19.5},
    "H100": {"fp16": 989.0, "bf16": 989.0, "fp32": 67.0},
    "H200": {"fp16": 989.0, "bf16": 989.0, "fp32": 67.0},
}
CPU_FP32_FLOPS_PER_CYCLE = 32
"""Per core: two 256-bit FMA units x 8 fp32 lanes x 2 (AVX2); an estimate for x86 CPUs."""
SPECIAL_IDS = np.array([0, 100, 101, 102, 103])  # [PAD] [UNK] [CLS] [SEP] [MASK] of bert-base-uncased
CLS, SEP, MASK, PAD_ID = 101, 102, 103, 0


def device_peak_tflops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(peak, where the number comes from) for this device and precision."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peaks in PEAK_TFLOPS.items():
            if key in name:
                return peaks[precision], f"{key} datasheet, {precision}"
        return None, f"unknown GPU {name!r}: pass --peak-tflops"
    cores = os.cpu_count() or 1
    ghz = _cpu_ghz()
    peak = cores * ghz * CPU_FP32_FLOPS_PER_CYCLE / 1e3
    return peak, f"estimate: {cores} cores x {ghz:.2f} GHz x {CPU_FP32_FLOPS_PER_CYCLE} fp32 FLOP/cycle"


def _cpu_ghz() -> float:
    try:
        mhz = [float(line.split(":")[1]) for line in Path("/proc/cpuinfo").read_text().splitlines()
               if line.startswith("cpu MHz")]
        return max(mhz) / 1e3 if mhz else 2.0
    except OSError:
        return 2.0


def make_examples(count: int, seq_length: int, vocab_size: int, seed: int):
    """Random token ids as [CLS] A [SEP] B [SEP] with real PMLM masks."""
    rng = np.random.default_rng(seed)
    masking = MaskingConfig()
    examples = []
    for _ in range(count):
        body = rng.integers(1000, vocab_size, size=seq_length - 3)
        split = seq_length // 2
        ids = np.concatenate([[CLS], body[:split - 1], [SEP], body[split - 1:], [SEP]]).astype(np.int64)
        segments = np.concatenate([np.zeros(split + 1), np.ones(seq_length - split - 1)]).astype(np.int64)
        maskable = ~np.isin(ids, SPECIAL_IDS)
        masks = mask_example(ids, maskable, rng, masking, vocab_size, SPECIAL_IDS, MASK)
        examples.append((ids, segments, masks))
    return examples


def pmlm_batch(examples) -> PMLMBatch:
    ids, segments, masks = zip(*examples)
    return build_batch(ids, segments, masks, pseudo_token_id=MASK, pad_token_id=PAD_ID)


def naive_cloze_batches(examples) -> list[PMLMBatch]:
    """The same predictions without pseudo masks: the AE pass, then for every factorization step
    s a pass over the plain sequence where steps >= s show [MASK], steps < s their originals, and
    step s's tokens are predicted. Examples with fewer steps are padded with empty passes."""
    steps = max(int(m.step_ids.max()) if len(m.step_ids) else 0 for _, _, m in examples)
    batches = []
    for step in range(0, steps + 1):  # 0: the AE pass (BERT's corruption, every masked token)
        rows = []
        for ids, segments, masks in examples:
            shown = ids.copy()
            labels = np.full_like(ids, IGNORE_INDEX)
            roles = np.full_like(ids, CONTEXT)
            if step == 0:
                shown[masks.masked_positions] = masks.corrupted_ids
                predicted = masks.masked_positions
            else:
                later = masks.masked_positions[masks.step_ids >= step]
                shown[later] = MASK
                predicted = masks.masked_positions[masks.step_ids == step]
            labels[predicted] = ids[predicted]
            roles[predicted] = MASKED
            rows.append((shown, segments, roles, labels))
        width = max(len(r[0]) for r in rows)

        def stack(index, fill):
            return torch.from_numpy(np.stack([np.pad(r[index], (0, width - len(r[index])), constant_values=fill)
                                              for r in rows]))
        input_ids, token_types, roles, labels = stack(0, PAD_ID), stack(1, 0), stack(2, PAD), stack(3, IGNORE_INDEX)
        positions = torch.arange(width).expand_as(input_ids).contiguous()
        batches.append(PMLMBatch(input_ids, positions, token_types, roles, torch.zeros_like(roles), labels))
    return batches


def timed_steps(model, optimizer, batches: list[PMLMBatch], device, autocast_dtype, scaler,
                iterations: int, warmup: int, first_step: list[float] | None = None) -> float:
    """Seconds per iteration, where one iteration runs fwd+bwd on every batch then one optimizer step.
    `first_step` (if given) receives the seconds of the first warmup iteration: compilation included."""
    batches = [b.to(device) for b in batches]

    def iteration():
        for batch in batches:
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = model(*batch.as_tuple()).loss
            (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for number in range(warmup):
        start = time.perf_counter()
        iteration()
        if number == 0 and first_step is not None:
            _synchronize(device)
            first_step.append(time.perf_counter() - start)
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(iterations):
        iteration()
    _synchronize(device)
    return (time.perf_counter() - start) / iterations


def compiled_graphs() -> int:
    """Graphs torch.compile has compiled in this process so far (each new layout shape is one for the
    flex kernel; sdpa compiles nothing)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="base", help="tiny, base or large")
    parser.add_argument("--seq-length", type=int, default=512, help="tokens per sample before the appended ones")
    parser.add_argument("--micro-batch-size", type=int, default=20, help="samples per step")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="autocast fp16 with loss scaling (CUDA)")
    precision.add_argument("--bf16", action="store_true", help="autocast bf16")
    parser.add_argument("--attention-backend", default="sdpa", choices=ATTENTION_BACKENDS,
                        help="sdpa (dense bias) or flex (block mask + score_mod; compiled on CUDA, torch's unfused "
                             "reference path on a CPU)")
    parser.add_argument("--layout-quantum", type=int, default=0,
                        help="pad the layout width to a multiple of this (1: no padding; 0: the model's default, "
                             f"{flex_attention.LAYOUT_QUANTUM} for flex on CUDA, else 1)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each transformer layer (models/compiled.py; the layout width is then "
                             "padded to the compile quantum unless --layout-quantum says otherwise)")
    parser.add_argument("--iterations", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak for MFU (default: the table, or a CPU "
                                                          "estimate)")
    parser.add_argument("--naive-cloze", action="store_true",
                        help="also time one pass per factorization step on the same examples; print the ratio")
    parser.add_argument("--seed", type=int, default=1234, help="token ids and masks")
    parser.add_argument("--json", help="also write the figures to this file ('-': standard output, the table "
                        "then goes to standard error)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.layout_quantum < 0:
        print("error: --layout-quantum must be >= 0 (0: the model's default)", file=sys.stderr)
        return 2
    if args.json:
        try:
            check_output(args.json, "--json")
        except OutputError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    with logs_to_stderr(args.json):
        return benchmark(args)


def benchmark(args: argparse.Namespace) -> int:
    for name in ("seq_length", "micro_batch_size", "iterations"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "fp32"
    if args.fp16 and device.type != "cuda":
        print("error: --fp16 needs a GPU here (CPU autocast supports bf16)", file=sys.stderr)
        return 2
    try:
        config = model_config_from_preset(args.preset, hidden_dropout=0.0, attention_dropout=0.0,
                                          max_position_embeddings=max(args.seq_length, 128),
                                          attention_backend=args.attention_backend)
        check_attention_backend(config, device.type)  # flex: refused below compute capability 8.0
        if args.compile:
            check_compile(0, attention_backend=args.attention_backend)
        quantum = args.layout_quantum or (compile_layout_quantum() if args.compile else
                                          flex_attention.default_layout_quantum(args.attention_backend, device))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    model = PMLMForPreTraining(config, "ae+par", LocalLayers(), init_seed=args.seed).to(device)
    model.bert.layout_quantum = quantum
    if args.compile:
        compile_transformer_layers(model)
    # torch's fused AdamW on CUDA (one kernel for all parameters), as training uses it.
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    autocast_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
    scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
    examples = make_examples(args.micro_batch_size, args.seq_length, config.vocab_size, args.seed)
    batch = pmlm_batch(examples)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    graphs_before, first_step = compiled_graphs(), []
    seconds = timed_steps(model, optimizer, [batch], device, autocast_dtype, scaler, args.iterations, args.warmup,
                          first_step)
    compilations = compiled_graphs() - graphs_before

    tokens = batch.num_tokens()
    sequence_tokens = args.micro_batch_size * args.seq_length
    flops = flops_per_token(config, args.seq_length) * tokens
    tflops = flops / seconds / 1e12
    peak, peak_source = (args.peak_tflops, "--peak-tflops") if args.peak_tflops else device_peak_tflops(device, precision)
    width = padded_width(batch.input_ids.shape[1], quantum)  # what the kernels see
    padding = 1.0 - tokens / (args.micro_batch_size * width)
    memory = (torch.cuda.max_memory_allocated(device) / 2**30, "CUDA max allocated") if device.type == "cuda" else \
        (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "process peak RSS")
    figures = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU ({os.cpu_count()} cores, "
                                                                                     f"{torch.get_num_threads()} threads)",
        "preset": args.preset, "seq_length": args.seq_length, "micro_batch_size": args.micro_batch_size,
        "precision": precision, "attention_backend": args.attention_backend, "layout_width": int(batch.input_ids.shape[1]),
        "layout_quantum": quantum, "padded_width": width, "padding_share": padding,
        "compilations": compilations, "recompilations": max(0, compilations - 1),
        "first_step_seconds": first_step[0] if first_step else None,
        "seconds_per_step": seconds, "samples_per_sec": args.micro_batch_size / seconds,
        "tokens_per_sec": tokens / seconds, "sequence_tokens_per_sec": sequence_tokens / seconds,
        "model_tflops": tflops, "peak_tflops": peak, "peak_source": peak_source,
        "mfu": tflops / peak if peak else None, "peak_memory_gb": memory[0], "memory_source": memory[1],
    }
    print(f"{figures['device']} | {args.preset}, seq {args.seq_length} (layout width {figures['layout_width']}"
          + (f", padded to {width}" if width != figures["layout_width"] else "")
          + f", padding {padding:.1%}), micro batch {args.micro_batch_size}, {precision}, attention {args.attention_backend}")
    print(f"  {seconds * 1e3:.1f} ms/step | {figures['samples_per_sec']:.2f} samples/s | "
          f"{figures['tokens_per_sec']:,.0f} tokens/s | {tflops:.3f} model TFLOP/s | "
          + (f"MFU {figures['mfu']:.1%} of {peak:.1f} TFLOP/s ({peak_source})" if peak else f"MFU ? ({peak_source})")
          + f" | peak memory {memory[0]:.2f} GB ({memory[1]}) | compilations {compilations}"
          + (f" (first step {first_step[0]:.1f} s)" if first_step else ""))

    if args.naive_cloze:
        naive = naive_cloze_batches(examples)
        naive_seconds = timed_steps(model, optimizer, naive, device, autocast_dtype, scaler, args.iterations,
                                    args.warmup)
        figures.update(naive_passes=len(naive), naive_seconds_per_step=naive_seconds,
                       pmlm_over_naive=seconds / naive_seconds)
        print(f"  naive cloze: {len(naive)} passes (AE + one per factorization step) {naive_seconds * 1e3:.1f} "
              f"ms/step; PMLM's one pass costs {seconds / naive_seconds:.3f}x of it")
    if args.json:
        write_json_atomically(args.json, figures, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
