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

Every run also reports the step's CPU proxies of GPU cost (training/host_syncs.py,
training/kernel_count.py): host_syncs_per_step (our code's; every owner's in --json),
kernels_per_step (eager: dispatched ATen ops less views/aliases/bare allocations; compiled: generated
kernels + extern calls + the eager rest) and bias_bytes_per_step (bytes of [B, heads or 1, T, >=T]
tensors one forward+backward allocates). --deepspeed also times pretrain's own step
(`Trainer.train_step`: DeepSpeed ZeRO-1, the real loader, the padded vocabulary); --huggingface,
BertForMaskedLM of the same size three ways; --profile-trace, one step in a Chrome trace.

    python tools/bench_train.py --preset base --seq-length 128 --micro-batch-size 64 --bf16 --deepspeed --huggingface
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import resource
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from megatron_pmlm.models import flex_attention  # noqa: E402
from megatron_pmlm.config import ATTENTION_BACKENDS, ConfigError, HelpFormatter, MaskingConfig, model_config_from_preset  # noqa: E402
from megatron_pmlm.files import OutputError, check_output, logs_to_stderr, write_json_atomically  # noqa: E402
from megatron_pmlm.models.layout import CONTEXT, IGNORE_INDEX, MASKED, PAD, PMLMBatch, padded_width  # noqa: E402
from megatron_pmlm.data.batches import build_batch  # noqa: E402
from megatron_pmlm.data.masking import mask_example  # noqa: E402
from megatron_pmlm.models.compiled import check_compile, compile_layout_quantum, compile_step_regions  # noqa: E402,E501
from megatron_pmlm.models.model import PMLMForPreTraining, check_attention_backend  # noqa: E402
from megatron_pmlm.parallel.layers import LocalLayers  # noqa: E402
from megatron_pmlm.parallel.deepspeed_import import import_deepspeed  # noqa: E402
from megatron_pmlm.training.recipe import flops_per_token, padded_vocab_size  # noqa: E402

# Dense peak TFLOP/s per device and precision (NVIDIA datasheets, without sparsity), the most specific
# name first: (what the device name contains, the product, {precision: peak}).
PEAK_TFLOPS = (
    (("H100", "PCIE"), "H100 PCIe", {"fp16": 756.0, "bf16": 756.0, "fp32": 51.0}),
    (("H100", "NVL"), "H100 NVL", {"fp16": 835.0, "bf16": 835.0, "fp32": 60.0}),
    (("H100",), "H100 SXM", {"fp16": 989.0, "bf16": 989.0, "fp32": 67.0}),
    (("H200", "NVL"), "H200 NVL", {"fp16": 835.0, "bf16": 835.0, "fp32": 60.0}),
    (("H200",), "H200 SXM", {"fp16": 989.0, "bf16": 989.0, "fp32": 67.0}),
    (("A100",), "A100", {"fp16": 312.0, "bf16": 312.0, "fp32": 19.5}),
    (("V100", "PCIE"), "V100 PCIe", {"fp16": 112.0, "bf16": None, "fp32": 14.0}),
    (("V100",), "V100 SXM2", {"fp16": 125.0, "bf16": None, "fp32": 15.7}),
)
"""H100 SXM reports itself as e.g. "NVIDIA H100 80GB HBM3", the others name their form factor."""


def peak_from_device_name(name: str, precision: str) -> tuple[float | None, str]:
    """(dense peak TFLOP/s, its source) for a CUDA device name and a precision (fp16, bf16, fp32)."""
    upper = name.upper()
    for needles, product, peaks in PEAK_TFLOPS:
        if all(needle in upper for needle in needles):
            peak = peaks[precision]
            if peak is None:
                return None, f"{product} datasheet: no {precision} (pass --peak-tflops)"
            return peak, f"{product} datasheet, dense {precision} (device {name!r})"
    return None, f"unknown GPU {name!r}: pass --peak-tflops"


CPU_FP32_FLOPS_PER_CYCLE = 32
"""Per core: two 256-bit FMA units x 8 fp32 lanes x 2 (AVX2); an estimate for x86 CPUs."""
SPECIAL_IDS = np.array([0, 100, 101, 102, 103])  # [PAD] [UNK] [CLS] [SEP] [MASK] of bert-base-uncased
CLS, SEP, MASK, PAD_ID = 101, 102, 103, 0


def device_peak_tflops(device: torch.device, precision: str) -> tuple[float | None, str]:
    """(peak, where the number comes from) for this device and precision."""
    if device.type == "cuda":
        return peak_from_device_name(torch.cuda.get_device_name(device), precision)
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


def training_iteration(model, optimizer, batches: list[PMLMBatch], device, autocast_dtype, scaler):
    """The step `timed_steps` times: fwd+bwd on every batch, then AdamW."""
    batches = [b.to(device) for b in batches]

    def iteration():
        for batch in batches:
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = model(*batch.as_tuple()).loss
            (scaler.scale(loss) if scaler else loss).backward()
        optimizer_step(optimizer, scaler)

    return iteration


def optimizer_step(optimizer, scaler) -> None:
    """AdamW's step (through the fp16 loss scaler where there is one), gradients cleared."""
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed_steps(model, optimizer, batches: list[PMLMBatch], device, autocast_dtype, scaler,
                iterations: int, warmup: int, first_step: list[float] | None = None) -> float:
    """Seconds per iteration, where one iteration runs fwd+bwd on every batch then one optimizer step.
    `first_step` (if given) receives the seconds of the first warmup iteration: compilation included."""
    iteration = training_iteration(model, optimizer, batches, device, autocast_dtype, scaler)
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


def step_proxies(model, optimizer, batch: PMLMBatch, device, autocast_dtype, scaler, heads: int, width: int,
                 compiled: bool) -> dict:
    """The CPU proxies of one step (issue 33, item 9), measured after the timed steps.

    host_ms_outside_ops: training.kernel_count.host_ms_outside_ops, the step's host time outside
    ATen ops (Python, hooks); host_syncs_per_step: training.host_syncs over forward+backward+AdamW, our code's syncs only
    (the list of every owner's in host_syncs); kernels_per_step: training.kernel_count over the same
    step (kernels_by_source: the profiler's count of one step by phase and op, the backward named after
    its autograd node, `kernel_count.profiled_kernel_sources`); bias_bytes_per_step: models.relative_bias.bias_bytes_per_step, the bytes ops write into
    [B, heads or 1, T, >=T] tensors over forward+backward outside SDPA's own scores (building,
    casting, copying the attention bias and summing its gradient), beside what SDPA's fused GPU
    kernel would pad per call (computed: a CPU never pads). Syncs and bias bytes are counted by
    dispatch modes, which run a compiled model eagerly: they describe the eager step."""
    from megatron_pmlm.models.relative_bias import bias_bytes_per_step
    from megatron_pmlm.training.host_syncs import HostSyncCounter
    from megatron_pmlm.training.kernel_count import count_kernels, host_ms_outside_ops, kernel_sources

    step = training_iteration(model, optimizer, [batch], device, autocast_dtype, scaler)
    outside_ops = host_ms_outside_ops(step)
    # Kernels first, from the compiled step; the counters below run it eagerly (dispatch modes, and
    # HostSyncCounter's "force_eager" stance), after which the compiled regions run compiled again.
    sources = kernel_sources(step)  # one profiled step; a compiled step's kernel count is their sum
    kernels = sum(sources.values()) if compiled else count_kernels(step, compiled=False)
    with HostSyncCounter() as syncs:
        step()
    bias = bias_bytes_per_step(model, batch.to(device), autocast_dtype)
    return {"host_syncs_per_step": syncs.count("ours"), "host_syncs_all_owners": syncs.count(),
            "host_syncs": syncs.report().splitlines() if syncs.count() else [],
            "kernels_per_step": kernels, "kernels_counted": "compiled (profiler)" if compiled else "eager (dispatch)",
            "host_ms_outside_ops": outside_ops,
            "kernels_by_source": dict(sources.most_common()),
            "bias_bytes_per_step": bias["bias_bytes"], "bias_ops": bias["ops"],
            "sdpa_pad_bytes_per_step": bias["sdpa_pad_bytes"],
            "table_gradient": table_gradient_path(model, device, autocast_dtype or next(model.parameters()).dtype)}


def table_gradient_path(model, device, dtype) -> str:
    """How the step took the relative-bias table's gradient, as the model decides it
    (`BertModel.table_gradient_per_layer`, `bucket_sums.runs_on`), asked after the timed steps so
    that a Triton kernel that failed and handed over to the GEMMs shows."""
    from megatron_pmlm.models import bucket_sums

    if not model.config.rel_pos:
        return "none (no relative bias)"
    if model.config.attention_backend == "triton":
        return "each layer's score gradient, written by the triton backend's backward, Triton kernel"
    if model.config.attention_backend != "sdpa":
        return "not the sdpa bias's (flex: the score_mod's gradient)"
    how = "Triton kernel" if bucket_sums.runs_on(device, dtype) else "one-hot GEMMs"
    if model.bert.table_gradient_per_layer(device, dtype):
        return f"each layer's bias gradient, {how}"
    return f"the layers' summed bias gradient, {how}"


HOST_PROXY_SEQ_LENGTH = 16
"""host_ms_per_step's sequence length: 16 tokens (a layout of ~21 slots), where a step's arithmetic is
negligible next to its per-op host cost (python, dispatcher, launch)."""
HOST_PROXY_STEPS = 15
"""Timed steps of host_ms_per_step (the median is reported), after 2 untimed ones (compilation)."""


def host_step_proxy(model, optimizer, config, device, autocast_dtype, scaler, seed: int,
                    steps: int = HOST_PROXY_STEPS) -> dict:
    """The per-step host overhead floor (issue 33, item 9): the median wall time of full steps
    (forward + backward + AdamW) of micro batch 1 at HOST_PROXY_SEQ_LENGTH on one thread, where
    a GPU step that is launch-bound cannot be faster; and of its forward + backward alone (the
    optimizer's share is memory traffic over every parameter on a CPU, one fused kernel on CUDA)."""
    batch = pmlm_batch(make_examples(1, HOST_PROXY_SEQ_LENGTH, config.vocab_size, seed)).to(device)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        total, forward_backward = [], []
        for number in range(steps + 2):
            _synchronize(device)
            start = time.perf_counter()
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                loss = model(*batch.as_tuple()).loss
            (scaler.scale(loss) if scaler else loss).backward()
            _synchronize(device)
            middle = time.perf_counter()
            optimizer_step(optimizer, scaler)
            _synchronize(device)
            if number >= 2:
                total.append(time.perf_counter() - start)
                forward_backward.append(middle - start)
    finally:
        torch.set_num_threads(threads)
    return {"host_ms_per_step": float(np.median(total)) * 1e3,
            "host_ms_forward_backward": float(np.median(forward_backward)) * 1e3,
            "host_proxy_shape": f"micro batch 1, seq {HOST_PROXY_SEQ_LENGTH} (layout width "
                                f"{batch.input_ids.shape[1]}), 1 thread, median of {steps}"}


def proxies_line(figures: dict) -> str:
    return (f"  proxies: host syncs/step {figures['host_syncs_per_step']} ours ({figures['host_syncs_all_owners']} "
            f"all) | kernels/step {figures['kernels_per_step']} ({figures['kernels_counted']}) | host ms outside "
            f"ops/step {figures['host_ms_outside_ops']:.1f} | attention-bias "
            f"bytes/step {figures['bias_bytes_per_step'] / 2**20:,.1f} MiB (+ {figures['sdpa_pad_bytes_per_step'] / 2**20:,.1f} "
            f"MiB a GPU's SDPA would pad) | table gradient: {figures['table_gradient']}"
            + (f" | host ms/step {figures['host_ms_per_step']:.1f} (fwd+bwd {figures['host_ms_forward_backward']:.1f}; "
               f"{figures['host_proxy_shape']})" if "host_ms_per_step" in figures else ""))


# ------------------------------------------------------------------------------------------------
# --deepspeed: pretrain's own step (DeepSpeed, ZeRO-1, the real loader, the padded vocabulary)
# ------------------------------------------------------------------------------------------------

COMPILE_SETTLED_STEPS = 10
"""--deepspeed --compile: warm-up goes on until this many steps in a row compiled nothing. The real
loader's length bucketing hands out several layout widths (seq 512: 560-688 in 16-wide steps), each
compiled once when first met; timing while new ones still arrive measured compilation, not the
step (the first H200 run: 1.38 s a step at seq 512 against 0.13 s eager)."""
COMPILE_WARMUP_LIMIT = 200
"""--deepspeed --compile: at most this many extra warm-up steps (compilations during the timed steps,
if any are left, are reported)."""
SHARED_DATA_PLACES = (Path(__file__).resolve().parents[2] / "shared" / "data",
                      Path(__file__).resolve().parents[1] / "shared" / "data")
SHARED_DATA = next((place for place in SHARED_DATA_PLACES if place.is_dir()), SHARED_DATA_PLACES[0])
"""../shared/data beside the repository (or shared/data inside it, as a lent GPU machine's copy of the
checkout may carry it): corpus text and bert-base-uncased's vocabulary."""
SHARED_CORPUS = SHARED_DATA / "corpus" / "wikitext-2-valid.txt"
SHARED_VOCAB = SHARED_DATA / "vocab" / "bert-base-uncased-vocab.txt"


ARTICLE_HEADING = re.compile(r" = [^=].* = ")
"""A wikitext article's title line (" = Title = "; sections are " = = Section = = ")."""


def article_documents(text: str) -> str:
    """wikitext with one document per article: blank lines (which end a document for
    data_prep.preprocess) kept only before an article's title. wikitext puts a blank line after
    every paragraph, so read as it is its documents are paragraphs (~90 tokens) and no sample
    reaches seq 512 (the H200 run's seq 512 steps carried 235 tokens per sample); pre-training
    corpora (Wikipedia, books) have documents of thousands of tokens, as these articles do."""
    out: list[str] = []
    for line in filter(str.strip, text.splitlines()):
        if ARTICLE_HEADING.fullmatch(line) and out:
            out.append("")
        out.append(line)
    return "\n".join(out) + "\n"


def build_shared_samples(directory: Path, seq_length: int) -> Path | str:
    """A samples folder at `seq_length` built from ../shared/data (wikitext-2, one document per
    article: `article_documents`) with data_prep.preprocess and data_prep.build_samples (as a user
    would); or why it cannot be built (one line)."""
    from data_prep import build_samples, preprocess

    missing = [str(p) for p in (SHARED_CORPUS, SHARED_VOCAB) if not p.is_file()]
    if missing:
        return f"{', '.join(missing)} absent: pass --data-path SAMPLES_DIR (a data_prep.build_samples folder)"
    corpus = directory / "articles.txt"
    corpus.write_text(article_documents(SHARED_CORPUS.read_text(encoding="utf-8")), encoding="utf-8")
    with contextlib.redirect_stdout(sys.stderr):
        if preprocess.main(["--input", str(corpus), "--output-prefix", str(directory / "corpus"),
                            "--vocab-file", str(SHARED_VOCAB), "--no-progress"]):
            return "data_prep.preprocess failed on ../shared/data (see above)"
        if build_samples.main(["--data-path", str(directory / "corpus"), "--output", str(directory / "samples"),
                               "--seq-length", str(seq_length), "--split", "99,1,0", "--mask-epochs", "1",
                               "--no-progress"]):
            return "data_prep.build_samples failed (see above)"
    return directory / "samples"


def deepspeed_precision(device: torch.device, precision: str) -> str:
    """pretrain's precision on this device: the bench's on a GPU (bf16 where the GPU has it, else
    fp16); on the CPU bf16 where DeepSpeed's CPU accelerator has it and --bf16 asks for it (the
    optimizer path a GPU's bf16 run takes, for the kernel count), else fp32."""
    if device.type != "cuda":
        import_deepspeed()
        from deepspeed.accelerator import get_accelerator

        return "bf16" if precision == "bf16" and get_accelerator().is_bf16_supported() else "fp32"
    if precision == "fp32":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return precision


def deepspeed_step(args: argparse.Namespace, device: torch.device, precision: str, peak: float | None) -> dict:
    """Times `Trainer.train_step` of a one-process `python -m megatron_pmlm.pretrain` run (its own
    argument parsing, checks, model, DeepSpeed engine with ZeRO-1 and loader): global batch = micro
    batch x --gradient-accumulation-steps, so one step is that many micro batches and one optimizer
    step (per-step figures are per optimizer step; samples/s and tokens/s count every micro batch)."""
    import tempfile

    from megatron_pmlm.config import UniLMMaskingConfig
    from megatron_pmlm.data.loader import DevicePrefetcher
    from megatron_pmlm.parallel.distributed import end_distributed
    from megatron_pmlm.pretrain import build_parser as pretrain_parser
    from megatron_pmlm.training.host_syncs import HostSyncCounter
    from megatron_pmlm.training.kernel_count import OUTSIDE_OPS_CALLS, count_kernels, host_ms_outside_ops
    from megatron_pmlm.training.pmlm_recipe import pmlm_pretraining_run
    from megatron_pmlm.training.preflight import check_sizes
    from megatron_pmlm.training.recipe import start_pretraining

    precision = deepspeed_precision(device, precision)
    with tempfile.TemporaryDirectory(prefix="bench-deepspeed-") as scratch:
        samples = Path(args.data_path) if args.data_path else build_shared_samples(Path(scratch), args.seq_length)
        if isinstance(samples, str):
            return {"skipped": samples}
        # + the syncs' step, the kernel count's, the trace's, host_ms_outside_ops's
        steps = args.warmup + args.iterations + 3 + OUTSIDE_OPS_CALLS + (COMPILE_WARMUP_LIMIT if args.compile else 0)
        pretrain_args = pretrain_parser().parse_args(
            ["--data-path", str(samples), "--preset", args.preset, "--seq-length", str(args.seq_length),
             "--micro-batch-size", str(args.micro_batch_size),
             "--global-batch-size", str(args.micro_batch_size * args.gradient_accumulation_steps),
             "--zero-stage", "1", "--attention-backend", args.attention_backend, "--train-iters", str(steps),
             "--eval-iters", "0", "--seed", str(args.seed)] + ([f"--{precision}"] if precision != "fp32" else [])
            + (["--hidden-size", str(args.hidden_size), "--ffn-hidden-size", str(4 * args.hidden_size)]
               if args.hidden_size else [])
            + (["--compile"] if args.compile else []))
        check_sizes(pretrain_args)
        plan = pmlm_pretraining_run(pretrain_args, UniLMMaskingConfig())
        held_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0  # the bare model's
        # The Trainer takes SIGTERM/SIGUSR1/SIGINT to save at the next iteration of its loop; this
        # loop is not a run to save, so they keep their usual meaning (timeout, Ctrl-C end the bench).
        handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
        try:
            with contextlib.redirect_stdout(sys.stderr):
                try:
                    trainer, loaders = start_pretraining(pretrain_args, plan)
                finally:
                    for signum, handler in handlers.items():
                        signal.signal(signum, handler)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            # As Trainer.train feeds it: the next batch built and copied by a background thread.
            with DevicePrefetcher(loaders.train, trainer.device) as train_batches:
                graphs_before, first_step_seconds = compiled_graphs(), time.perf_counter()
                def warmup_step(number: int) -> bool:
                    """One untimed step; under --compile, a line for each that compiled (where a compiled
                    warm-up's minutes go, as they go). Whether it compiled."""
                    graphs, step_started = compiled_graphs(), time.perf_counter()
                    trainer.train_step(train_batches)
                    new_graphs = compiled_graphs() - graphs
                    if args.compile and new_graphs:
                        print(f"compile warm-up step {number}: {new_graphs} new graphs in "
                              f"{time.perf_counter() - step_started:.1f} s", file=sys.stderr, flush=True)
                    return new_graphs > 0

                for index in range(args.warmup):
                    warmup_step(index + 1)
                    if index == 0:  # compilation included under --compile
                        _synchronize(device)
                        first_step_seconds = time.perf_counter() - first_step_seconds
                settled, extra_warmup = 0, 0
                while args.compile and settled < COMPILE_SETTLED_STEPS and extra_warmup < COMPILE_WARMUP_LIMIT:
                    extra_warmup += 1
                    settled = 0 if warmup_step(args.warmup + extra_warmup) else settled + 1
                _synchronize(device)
                compilations = compiled_graphs() - graphs_before
                start, tokens = time.perf_counter(), 0
                for _ in range(args.iterations):
                    tokens += trainer.train_step(train_batches)[1]
                _synchronize(device)
                seconds = (time.perf_counter() - start) / args.iterations
                compiled_while_timed = compiled_graphs() - graphs_before - compilations
                memory = ((torch.cuda.max_memory_allocated(device) - held_before) / 2**30 if device.type == "cuda"
                          else None)
                # What the engine runs, read back from DeepSpeed rather than from the arguments given.
                engine = {"zero_stage": trainer.engine.zero_optimization_stage(),
                          "gradient_accumulation_steps": trainer.engine.gradient_accumulation_steps(),
                          "precision": "fp16" if trainer.engine.fp16_enabled() else
                          "bf16" if trainer.engine.bfloat16_enabled() else "fp32",
                          "padded_vocab_size": int(trainer.engine.module.bert.embeddings.word_embeddings.weight.shape[0])}
                with HostSyncCounter() as syncs:  # this thread's: the step's, not the loader thread's
                    trainer.train_step(train_batches)
                kernels = count_kernels(lambda: trainer.train_step(train_batches), compiled=args.compile)
                outside_ops = host_ms_outside_ops(lambda: trainer.train_step(train_batches))
                traced = {}
                if args.profile_trace:  # pretrain's step traced too: where its time goes beside the bare model's
                    trace_path = companion_trace_path(args.profile_trace, "pretrain")
                    traced = {"profile_trace": trace_path,
                              "top_kernels": profile_step(lambda: trainer.train_step(train_batches), device,
                                                          trace_path),
                              "device_timeline": device_timeline(trace_path)}
        finally:
            end_distributed()
    tokens_per_step = tokens / args.iterations
    tflops = plan.flops_per_token * tokens_per_step / seconds / 1e12
    return {**engine, "data_path": str(args.data_path or f"built from {SHARED_DATA}"),
            "hidden_dropout": plan.model_config.hidden_dropout, "compile": bool(args.compile),
            "first_step_seconds": first_step_seconds if args.warmup else None, "compilations": compilations,
            "warmup_steps": args.warmup + extra_warmup, "compilations_while_timed": compiled_while_timed,
            "seconds_per_step": seconds,
            "samples_per_sec": args.micro_batch_size * args.gradient_accumulation_steps / seconds,
            "tokens_per_step": tokens_per_step, "tokens_per_sec": tokens_per_step / seconds, "model_tflops": tflops,
            "mfu": tflops / peak if peak else None, "peak_memory_gb": memory,
            "memory_source": "CUDA max allocated less what the process held before" if memory is not None else None,
            "host_syncs_per_step": syncs.count("ours"), "host_syncs_all_owners": syncs.count(),
            "host_syncs": syncs.report().splitlines() if syncs.count() else [], "kernels_per_step": kernels,
            "host_ms_outside_ops": outside_ops,
            "table_gradient": table_gradient_path(trainer.engine.module, device, {
                "bf16": torch.bfloat16, "fp16": torch.float16}.get(engine["precision"], torch.float32)), **traced}


# ------------------------------------------------------------------------------------------------
# --huggingface: BertForMaskedLM of the same size, side by side
# ------------------------------------------------------------------------------------------------

def huggingface_steps(config, args: argparse.Namespace, width: int, device: torch.device, autocast_dtype,
                      mask_prob: float = 0.15) -> list[dict]:
    """Seconds per step (forward + backward + AdamW) of Hugging Face's BertForMaskedLM (sdpa, random
    init, our size, same micro batch and precision) over (a) the sequence length, (b) our layout
    width T, (c) the sequence length with the MLM head applied to the masked positions only."""
    from transformers import BertConfig, BertForMaskedLM

    hf_config = BertConfig(vocab_size=config.vocab_size, hidden_size=config.hidden_size,
                           num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
                           intermediate_size=config.ffn_hidden_size, max_position_embeddings=max(width, 512),
                           hidden_dropout_prob=config.hidden_dropout,
                           attention_probs_dropout_prob=config.attention_dropout, attn_implementation="sdpa")
    torch.manual_seed(args.seed)
    model = BertForMaskedLM(hf_config).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    scaler = torch.amp.GradScaler("cuda") if autocast_dtype == torch.float16 else None
    generator = torch.Generator().manual_seed(args.seed)
    rows = []
    for name, length, masked_only in (("hf-seq", args.seq_length, False), ("hf-width", width, False),
                                      ("hf-seq-masked-head", args.seq_length, True)):
        input_ids = torch.randint(1000, config.vocab_size, (args.micro_batch_size, length), generator=generator)
        masked = torch.rand(input_ids.shape, generator=generator) < mask_prob
        labels = torch.where(masked, input_ids, IGNORE_INDEX)
        input_ids, masked, labels = input_ids.to(device), masked.to(device), labels.to(device)
        masked_index = masked.flatten().nonzero().squeeze(1)  # built once, outside the timed step

        def step():
            with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                if masked_only:
                    hidden = model.bert(input_ids=input_ids).last_hidden_state
                    logits = model.cls(hidden.flatten(0, 1).index_select(0, masked_index))
                    loss = torch.nn.functional.cross_entropy(logits.float(), labels.flatten()[masked_index])
                else:
                    loss = model(input_ids=input_ids, labels=labels).loss
            (scaler.scale(loss) if scaler else loss).backward()
            optimizer_step(optimizer, scaler)

        for _ in range(args.warmup):
            step()
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(args.iterations):
            step()
        _synchronize(device)
        rows.append({"name": name, "length": length, "masked_head_only": masked_only,
                     "seconds_per_step": (time.perf_counter() - start) / args.iterations})
    return rows


# ------------------------------------------------------------------------------------------------
# --profile-trace: one step under torch.profiler
# ------------------------------------------------------------------------------------------------

def profile_step(step, device: torch.device, trace_path: str, top: int = 20) -> list[dict]:
    """One call of `step` traced to a Chrome trace file; the `top` kernels by self device time on
    CUDA (self CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as trace:
        step()
        _synchronize(device)
    Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
    trace.export_chrome_trace(trace_path)
    on_device = device.type == "cuda"
    averages = [e for e in trace.key_averages()
                if (e.self_device_time_total if on_device else e.self_cpu_time_total) > 0]
    averages.sort(key=lambda e: -(e.self_device_time_total if on_device else e.self_cpu_time_total))
    return [{"name": e.key, "calls": e.count,
             "self_us": e.self_device_time_total if on_device else e.self_cpu_time_total}
            for e in averages[:top]]


DEVICE_EVENT_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
"""Chrome-trace categories of work on the GPU (torch.profiler's export)."""
KERNEL_KINDS = (
    ("attention, ours", ("attention_", "bucket_sums_kernel", "dense_bias_kernel", "dropout_keep_kernel")),
    ("other Triton kernels of ours", ("gelu_backward_kernel", "dropout_keep_bits_kernel")),
    ("GEMMs", ("triton_tem_", "gemm", "xmma", "nvjet", "cublas", "sm90_", "sm80_", "ampere_")),
    ("Inductor's fused kernels", ("triton_",)),
    ("attention, torch's", ("fmha", "flash", "attention")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("communication", ("nccl",)),
)
"""A GPU kernel's kind by its name (the first kind one of whose fragments its lowercased name contains;
those beginning `triton_`, Inductor's kernel names, it must begin with): our attention kernels (models/
bucket_attention_triton.py, bucket_sums_triton.py), our other Triton kernels (the FFN's GELU backward,
hidden dropout's bits), GEMMs (cuBLAS and CUTLASS, Inductor's GEMM templates), Inductor's fused
elementwise and reduction kernels, torch's own attention (SDPA's fused kernels), DeepSpeed's and torch's
optimizer steps, NCCL; copies and fills by their trace category; the rest "other" (torch's eager
elementwise, index and embedding kernels)."""


def kernel_kind(name: str, category: str = "kernel") -> str:
    """`KERNEL_KINDS`' kind of one GPU event of a Chrome trace."""
    if category in ("gpu_memcpy", "gpu_memset"):
        return "copies and fills"
    lowered = name.lower()
    for kind, fragments in KERNEL_KINDS:
        if any(lowered.startswith(fragment) if fragment.startswith("triton_") else fragment in lowered
               for fragment in fragments):
            return kind
    return "other"


def device_timeline(trace_path: str) -> dict | None:
    """From a traced step's Chrome trace: the span from its first GPU kernel to its last, the time
    the GPU was busy in it (the union of kernel intervals, streams overlapping) and the rest, idle,
    where it waited for the host to launch the next kernel; and the kernels' time by kind
    (`kernel_kind`, ms, largest first: where a busy step's time goes). None without GPU events (a
    CPU trace). A step mostly idle is bound by the host's launches; one mostly busy, by its kernels."""
    events = json.loads(Path(trace_path).read_text())
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    device_events = [e for e in events if e.get("ph") == "X" and e.get("cat") in DEVICE_EVENT_CATEGORIES]
    intervals = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in device_events)
    if not intervals:
        return None
    by_kind: dict[str, float] = {}
    for event in device_events:
        kind = kernel_kind(str(event.get("name", "")), event["cat"])
        by_kind[kind] = by_kind.get(kind, 0.0) + float(event.get("dur", 0)) / 1e3
    busy, (current_start, current_end) = 0.0, intervals[0]
    for start, end in intervals[1:]:
        if start > current_end:
            busy += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    busy += current_end - current_start
    span = current_end - intervals[0][0]  # the last merged run ends last
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "kernels": len(intervals), "ms_by_kind": dict(sorted(by_kind.items(), key=lambda item: -item[1]))}


def companion_trace_path(trace_path: str, what: str) -> str:
    """`x.trace.json` -> `x.<what>.trace.json` (another step's trace beside the bare model's)."""
    path = Path(trace_path)
    stem = path.name[:-len(".trace.json")] if path.name.endswith(".trace.json") else path.stem
    return str(path.with_name(f"{stem}.{what}.trace.json"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="base", help="tiny, base or large")
    parser.add_argument("--hidden-size", type=int, default=None,
                        help="override the preset's hidden size (FFN 4x it; layers, heads and parameter tensors "
                             "kept): the preset's structure with little arithmetic, for the host-side proxies "
                             "(host ms outside ops, kernels) on a CPU")
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
                        help="torch.compile the step's regions: each transformer layer, the embeddings + attention bias, "
                             "the heads + loss (models/compiled.py; the layout width is then padded to the compile "
                             "quantum unless --layout-quantum says otherwise)")
    parser.add_argument("--iterations", type=int, default=5, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--peak-tflops", type=float, help="the device's peak for MFU (default: the table, or a CPU "
                                                          "estimate)")
    parser.add_argument("--naive-cloze", action="store_true",
                        help="also time one pass per factorization step on the same examples; print the ratio")
    parser.add_argument("--seed", type=int, default=1234, help="token ids and masks")
    parser.add_argument("--deepspeed", action="store_true",
                        help="also time pretrain's own step (Trainer.train_step: DeepSpeed ZeRO-1, bf16 on a GPU with "
                             "bf16, else fp16; fp32 on a CPU; the real loader, the padded vocabulary, pretrain's "
                             "dropout) on one process; with --compile, pretrain's --compile")
    parser.add_argument("--gradient-accumulation-steps", type=int, default=1,
                        help="with --deepspeed: micro batches per optimizer step (global batch = micro batch x "
                             "this), as a data-parallel run of the paper's global batch has them: DeepSpeed's "
                             "reduction and optimizer step are paid once per step, not per micro batch")
    parser.add_argument("--data-path", help="with --deepspeed: a data_prep.build_samples folder at --seq-length "
                                            "(default: built in a temporary folder from ../shared/data)")
    parser.add_argument("--huggingface", action="store_true",
                        help="also time Hugging Face BertForMaskedLM (sdpa, same size, precision and micro batch) at "
                             "the sequence length, at our layout width, and with its head on the masked positions "
                             "only; print our step's ratio to each")
    parser.add_argument("--skip-host-proxy", action="store_true",
                        help="leave out host_ms_per_step (steps at micro batch 1, seq 16): with --compile that shape "
                             "is a compilation of its own (30-90 s on a CPU or a GPU), which make gpu-check's "
                             "--compile rows spare; their trace's GPU idle time says whether the compiled step "
                             "still waits on the host")
    parser.add_argument("--profile-trace", help="trace one step with torch.profiler to this Chrome trace file (JSON) "
                                                "and report its top-20 kernels")
    parser.add_argument("--json", help="also write the figures to this file ('-': standard output, the table "
                        "then goes to standard error)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.layout_quantum < 0:
        print("error: --layout-quantum must be >= 0 (0: the model's default)", file=sys.stderr)
        return 2
    if args.gradient_accumulation_steps < 1:
        print("error: --gradient-accumulation-steps must be >= 1", file=sys.stderr)
        return 2
    if args.gradient_accumulation_steps > 1 and not args.deepspeed:
        print("error: --gradient-accumulation-steps is for --deepspeed (pretrain's step; the bare model's step is one "
              "micro batch)", file=sys.stderr)
        return 2
    if args.data_path and not args.deepspeed:
        print("error: --data-path is for --deepspeed (the samples pretrain's loader reads)", file=sys.stderr)
        return 2
    if args.data_path and not Path(args.data_path).is_dir():
        print(f"error: --data-path {args.data_path}: no such samples folder", file=sys.stderr)
        return 2
    if args.json or args.profile_trace:
        try:
            for path, flag in ((args.json, "--json"), (args.profile_trace, "--profile-trace")):
                if path:
                    check_output(path, flag)
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
    if getattr(args, "compile", False):
        from megatron_pmlm.training.kernel_count import prepare_compiled_counting

        prepare_compiled_counting()  # before anything compiles: inductor's C++ kernels show in the profiler
    try:
        config = model_config_from_preset(args.preset, hidden_dropout=0.0, attention_dropout=0.0,
                                          max_position_embeddings=max(args.seq_length, 128),
                                          attention_backend=args.attention_backend)
        if args.hidden_size:
            if args.hidden_size % config.num_attention_heads:
                raise ValueError(f"--hidden-size {args.hidden_size} is not a multiple of the preset's "
                                 f"{config.num_attention_heads} attention heads")
            config = replace(config, hidden_size=args.hidden_size, ffn_hidden_size=4 * args.hidden_size)
        # The vocabulary padded as pre-training pads it (--make-vocab-size-divisible-by 128, TP 1).
        config = replace(config, padded_vocab_size=padded_vocab_size(config.vocab_size, 128, 1))
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
        compile_step_regions(model)
    # torch's fused AdamW (one kernel for all parameters), as training uses it on CUDA; on a CPU too,
    # so that the CPU proxies count the step a GPU runs (torch's default CPU AdamW is ~10 ops per
    # parameter tensor: ~2,000 of an eager base step's ~2,900 kernels).
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
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
        "preset": args.preset, "hidden_size": config.hidden_size, "seq_length": args.seq_length,
        "micro_batch_size": args.micro_batch_size, "precision": precision, "attention_backend": args.attention_backend,
        "layout_width": int(batch.input_ids.shape[1]),
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

    compiled = bool(getattr(args, "compile", False))  # the --compile flag, where this version has it
    if config.attention_backend == "flex":
        # flex_attention's eager path compiles itself (torch.compile, backend "eager"), which the
        # counters' dispatch modes block; the proxies are about the sdpa path's bias anyway.
        figures["proxies_skipped"] = "flex: its eager path compiles itself, which dispatch modes block"
        print(f"  proxies: not measured ({figures['proxies_skipped']})")
    else:
        # The host proxy before step_proxies' dispatch modes (see there).
        host = ({"host_proxy_skipped": "--skip-host-proxy"} if args.skip_host_proxy else
                host_step_proxy(model, optimizer, config, device, autocast_dtype, scaler, args.seed))
        figures.update(step_proxies(model, optimizer, batch, device, autocast_dtype, scaler,
                                    config.num_attention_heads, width, compiled), **host)
        print(proxies_line(figures))
    if args.profile_trace:
        figures["profile_trace"] = args.profile_trace
        figures["top_kernels"] = profile_step(training_iteration(model, optimizer, [batch], device, autocast_dtype,
                                                                 scaler), device, args.profile_trace)
        figures["device_timeline"] = device_timeline(args.profile_trace)
        print(f"  profile: one step traced to {args.profile_trace}; top kernel "
              f"{figures['top_kernels'][0]['name']} ({figures['top_kernels'][0]['self_us'] / 1e3:.1f} ms)")
    if args.huggingface:
        rows = huggingface_steps(config, args, width, device, autocast_dtype)
        for row in rows:
            row["ours_over_theirs"] = seconds / row["seconds_per_step"]
            print(f"  {row['name']} (BertForMaskedLM sdpa, length {row['length']}"
                  + (", head on the masked positions only" if row["masked_head_only"] else "")
                  + f"): {row['seconds_per_step'] * 1e3:.1f} ms/step; ours/theirs {row['ours_over_theirs']:.2f}")
        figures["huggingface"] = rows
    if args.deepspeed:
        try:
            real_peak = args.peak_tflops or device_peak_tflops(device, deepspeed_precision(device, precision))[0]
            real = deepspeed_step(args, device, precision, real_peak)
        except (ConfigError, ValueError) as error:
            print(f"error: --deepspeed: {error}", file=sys.stderr)
            return 2
        figures["deepspeed"] = real
        if "skipped" in real:
            print(f"  deepspeed: skipped: {real['skipped']}")
        else:
            accumulation = real["gradient_accumulation_steps"]
            print(f"  deepspeed (pretrain's Trainer.train_step, ZeRO-1, {real['precision']}, vocabulary padded to "
                  f"{real['padded_vocab_size']}"
                  + (f", {accumulation} micro batches a step" if accumulation > 1 else "")
                  + f"): {real['seconds_per_step'] * 1e3:.1f} ms/step | "
                  f"{real['samples_per_sec']:.2f} samples/s | {real['tokens_per_sec']:,.0f} tokens/s | "
                  f"{real['model_tflops']:.3f} model TFLOP/s | "
                  + (f"MFU {real['mfu']:.1%}" if real["mfu"] is not None else "MFU ?")
                  + f" | host syncs/step {real['host_syncs_per_step']} ours ({real['host_syncs_all_owners']} all) | "
                  f"kernels/step {real['kernels_per_step']} | host ms outside ops/step {real['host_ms_outside_ops']:.1f}"
                  f" | table gradient: {real['table_gradient']}"
                  + (f" | compiled: {real['compilations']} graphs in {real['warmup_steps']} warm-up steps "
                     f"(first step {real['first_step_seconds']:.1f} s), {real['compilations_while_timed']} while "
                     "timed" if real["compile"] else ""))
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
