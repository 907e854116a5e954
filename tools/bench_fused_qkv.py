"""Q, K, V as one GEMM against three: `python tools/bench_fused_qkv.py [--preset base]
[--seq-length 128] [--micro-batch-size 4] [--repeats 15] [--device cpu] [--dtype fp32]`.

One BertLayer (the preset's width, sdpa, the real pseudo-masked layout of a micro batch as
tools/bench_train.py builds it, its dense relative-bias + rule bias) runs forward + backward with
`fuse_projections` off and on, alternately, after a warm-up; the median wall time of each is
reported with the matrix products (aten addmm/mm/linear) counted in one forward and one backward.
Nothing here is a test; the figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from megatron_pmlm.training.kernel_count import GemmCounter  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(preset: str, seq_length: int, micro_batch_size: int, device: str):
    """A BertLayer of the preset, the hidden states and the attention bias of a real micro batch."""
    from megatron_pmlm.config import model_config_from_preset
    from megatron_pmlm.models.layout import pmlm_attention_allowed
    from megatron_pmlm.models.model import BertLayer, RelativePositionBias, attention_inputs
    from megatron_pmlm.parallel.layers import LocalLayers
    from tools.bench_train import make_examples, pmlm_batch

    config = model_config_from_preset(preset, hidden_dropout=0.0, attention_dropout=0.0,
                                      max_position_embeddings=max(seq_length, 128), attention_backend="sdpa")
    batch = pmlm_batch(make_examples(micro_batch_size, seq_length, config.vocab_size, seed=1)).to(device)
    torch.manual_seed(0)
    rel_pos_bias = RelativePositionBias(config.num_attention_heads, config.rel_pos_bins, config.max_rel_pos)
    torch.nn.init.normal_(rel_pos_bias.weight, std=0.02)
    layer = BertLayer(config, LocalLayers()).to(device)
    hidden = torch.randn(*batch.input_ids.shape, config.hidden_size, device=device, requires_grad=True)
    bias = attention_inputs("sdpa", rel_pos_bias.to(device), pmlm_attention_allowed, batch.position_ids,
                            batch.roles, batch.steps, hidden.dtype).detach()
    return layer, hidden, bias


def step(layer, hidden, bias, dtype: torch.dtype, device: str) -> None:
    with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        output = layer(hidden, bias)
    output.float().square().mean().backward()
    layer.zero_grad(set_to_none=True)
    hidden.grad = None


def gemm_counts(layer, hidden, bias, dtype, device) -> tuple[int, int]:
    """Matrix products in one forward, and in its backward."""
    with GemmCounter() as forward, torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
        output = layer(hidden, bias)
    loss = output.float().square().mean()
    with GemmCounter() as backward:
        loss.backward()
    layer.zero_grad(set_to_none=True)
    hidden.grad = None
    return forward.count, backward.count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/bench_fused_qkv.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base", help="model preset (default base)")
    parser.add_argument("--seq-length", type=int, default=128, help="tokens per example before the layout (default 128)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="examples per micro batch (default 4)")
    parser.add_argument("--repeats", type=int, default=15, help="timed forward+backward per variant (default 15)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--dtype", choices=DTYPES, default="fp32", help="fp32 (default) or bf16 autocast")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no GPU is visible")
    dtype = DTYPES[args.dtype]
    layer, hidden, bias = build(args.preset, args.seq_length, args.micro_batch_size, args.device)
    attention = layer.attention.self
    synchronize = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    times = {False: [], True: []}
    counts = {}
    for fused in (False, True):
        attention.fuse_projections = fused
        counts[fused] = gemm_counts(layer, hidden, bias, dtype, args.device)
        for _ in range(3):
            step(layer, hidden, bias, dtype, args.device)
    for _ in range(args.repeats):
        for fused in (False, True):
            attention.fuse_projections = fused
            synchronize()
            start = time.perf_counter()
            step(layer, hidden, bias, dtype, args.device)
            synchronize()
            times[fused].append(time.perf_counter() - start)
    print(f"{args.preset}, seq {args.seq_length} (layout width {hidden.shape[1]}), micro batch {args.micro_batch_size}, "
          f"{args.dtype}, {args.device}, {torch.get_num_threads() if args.device == 'cpu' else 1} thread(s), "
          f"median of {args.repeats}")
    print("| Q, K, V | layer forward + backward | GEMMs forward | GEMMs backward |")
    print("|---|---|---|---|")
    for fused, label in ((False, "three GEMMs"), (True, "one GEMM")):
        print(f"| {label} | {statistics.median(times[fused]) * 1e3:.2f} ms | {counts[fused][0]} | {counts[fused][1]} |")
    ratio = statistics.median(times[False]) / statistics.median(times[True])
    print(f"speed-up {ratio:.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
