"""What the sdpa backend's dense attention bias costs a training step, on this machine (issue 33 item 2).

    python tools/bench_attention_bias.py [--preset base] [--shapes 128x4,512x2] [--json out.json]

Two measurements, each on the real pseudo-masked layout of a micro batch (tools/bench_train.py's
batches):

- bias bytes per step (`relative_bias.bias_bytes_per_step`): bytes that ops write into
  [B, heads or 1, T, >= T] tensors during one forward + backward of the whole model, SDPA's own
  scores left out, in fp32, under autocast bf16 and with bf16 weights (what DeepSpeed's bf16 does),
  plus the bytes SDPA's memory-efficient kernel would pad per layer on a GPU (computed from the
  masks' strides, a CPU kernel never pads);
- the relative-position table's gradient alone: `F.embedding`'s backward over the B x T x T bucket
  indices (what the model did before) against `relative_bias.table_gradient`, best of --repeats;
  and the bytes per query-key pair of a bf16 gradient's table gradient: the one-hot GEMMs counted
  op by op, the Triton kernel a GPU uses (`models/bucket_sums.py`) computed from its tiles.

Nothing here is a test; figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

from megatron_pmlm.config import ConfigError, HelpFormatter, model_config_from_preset  # noqa: E402
from megatron_pmlm.files import OutputError, check_output, write_json_atomically  # noqa: E402

PRECISIONS = ("fp32", "autocast-bf16", "bf16-weights")


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'128x4,512x2' -> [(128, 4), (512, 2)] (sequence length x micro batch)."""
    shapes = []
    for item in text.split(","):
        try:
            seq_length, micro_batch = (int(part) for part in item.split("x"))
        except ValueError:
            raise ConfigError(f"--shapes: {item!r} is not SEQxBATCH, e.g. 128x4") from None
        if seq_length < 8 or micro_batch < 1:
            raise ConfigError(f"--shapes: {item!r} needs a sequence length >= 8 and a micro batch >= 1")
        shapes.append((seq_length, micro_batch))
    return shapes


def bias_bytes(preset: str, seq_length: int, micro_batch: int, precision: str) -> dict:
    from megatron_pmlm.models.model import PMLMForPreTraining
    from megatron_pmlm.models.relative_bias import bias_bytes_per_step
    from tools.bench_train import make_examples, pmlm_batch

    config = model_config_from_preset(preset, hidden_dropout=0.0, attention_dropout=0.0,
                                      max_position_embeddings=max(seq_length, 128))
    model = PMLMForPreTraining(config)
    if precision == "bf16-weights":
        model = model.to(torch.bfloat16)
    batch = pmlm_batch(make_examples(micro_batch, seq_length, config.vocab_size, seed=1))
    result = bias_bytes_per_step(model, batch, torch.bfloat16 if precision == "autocast-bf16" else None)
    return {"seq_length": seq_length, "micro_batch": micro_batch, "width": batch.input_ids.shape[1],
            "precision": precision, "layers": config.num_layers, **result}


def best_seconds(functions: dict, repeats: int) -> dict:
    """Best wall time of each function, the functions interleaved (a shared machine's load then
    weighs on all of them alike)."""
    best = {name: float("inf") for name in functions}
    for function in functions.values():
        function()
    for _ in range(repeats):
        for name, function in functions.items():
            start = time.perf_counter()
            function()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def table_gradient_timings(heads: int, bins: int, width: int, micro_batch: int, repeats: int) -> dict:
    """Seconds for the [heads, bins] gradient from a [B, heads, T, T] bias gradient, both ways, and
    each one's largest difference from a float64 sum (relative to the largest entry)."""
    from megatron_pmlm.models.relative_bias import table_gradient

    generator = torch.Generator().manual_seed(0)
    buckets = torch.randint(0, bins, (micro_batch, width, width), dtype=torch.uint8, generator=generator)
    grad = torch.randn(micro_batch, heads, width, width, generator=generator)
    table = torch.zeros(heads, bins, requires_grad=True)
    embedded = F.embedding(buckets.long(), table.t()).permute(0, 3, 1, 2)  # the former forward

    def embedding_backward():
        return torch.autograd.grad(embedded, table, grad, retain_graph=True)[0]

    def one_hot_contraction():
        return table_gradient(grad, buckets, bins, torch.float32)

    exact = table_gradient(grad.double(), buckets, bins, torch.float64)

    def error(result):
        return float((result.double() - exact).abs().max() / exact.abs().max())

    seconds = best_seconds({"embedding_backward_s": embedding_backward, "table_gradient_s": one_hot_contraction},
                           repeats)
    return {"width": width, "micro_batch": micro_batch, "heads": heads, "bins": bins, **seconds,
            "embedding_backward_error": error(embedding_backward()),
            "table_gradient_error": error(one_hot_contraction()),
            **table_gradient_bytes(heads, bins, width, micro_batch)}


class _OpBytes(TorchDispatchMode):
    """Bytes each computing op reads (its tensor inputs) and writes (its outputs); views and
    allocations are free."""

    FREE = ("empty", "empty_strided", "view", "_unsafe_view", "transpose", "expand", "slice", "select", "t",
            "detach", "alias", "as_strided")

    def __init__(self) -> None:
        super().__init__()
        self.read = self.written = self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in self.FREE:
            def size(tree):
                return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))
            self.read += size((args, kwargs))
            self.written += size(out)
            self.ops += 1
        return out


def table_gradient_bytes(heads: int, bins: int, width: int, micro_batch: int) -> dict:
    """Bytes per query-key pair of the table gradient from a bf16 bias gradient in the model's
    aligned layout: the one-hot GEMMs counted op by op (`_OpBytes`), and the Triton kernel a GPU
    uses (`models/bucket_sums.py`), computed from its tiles: it reads each pair's gradient (every
    head) and bucket once and writes one [heads, bins] fp32 partial table per program, which the
    final sum reads back."""
    from megatron_pmlm.models import bucket_sums
    from megatron_pmlm.models.relative_bias import aligned_bias_buffer, table_gradient

    buckets = torch.randint(0, bins, (micro_batch, width, width), dtype=torch.uint8)
    grad = aligned_bias_buffer(micro_batch, heads, width, width, torch.bfloat16, torch.device("cpu")).normal_()
    pairs = micro_batch * width * width
    with _OpBytes() as counted:
        table_gradient(grad, buckets, bins, torch.float32)
    programs = micro_batch * -(-width // bucket_sums.ROWS)
    partial = programs * bucket_sums._block(heads) * bucket_sums._block(bins) * 4
    return {"gemm_bytes_read_per_pair": counted.read / pairs, "gemm_bytes_written_per_pair": counted.written / pairs,
            "gemm_ops": counted.ops,
            "kernel_bytes_read_per_pair": (pairs * (heads * grad.element_size() + buckets.element_size()) + partial)
            / pairs,
            "kernel_bytes_written_per_pair": (partial + heads * bins * 4) / pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="base", help="model preset")
    parser.add_argument("--shapes", default="128x4,512x2", help="SEQxMICRO_BATCH,...: the micro batches measured")
    parser.add_argument("--precisions", default=",".join(PRECISIONS),
                        help=f"comma-separated, of: {', '.join(PRECISIONS)}")
    parser.add_argument("--repeats", type=int, default=5, help="timing repetitions (best is kept)")
    parser.add_argument("--skip-bytes", action="store_true", help="only time the table gradient")
    parser.add_argument("--skip-timing", action="store_true", help="only measure the bias bytes")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        shapes = parse_shapes(args.shapes)
        precisions = args.precisions.split(",")
        unknown = [p for p in precisions if p not in PRECISIONS]
        if unknown:
            raise ConfigError(f"--precisions: unknown {', '.join(unknown)}; choose from {', '.join(PRECISIONS)}")
        if args.repeats < 1:
            raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
        config = model_config_from_preset(args.preset)
        if args.json:
            check_output(args.json, "--json")
    except (ConfigError, OutputError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    results: dict = {"bias_bytes": [], "table_gradient": [], "threads": torch.get_num_threads()}
    for seq_length, micro_batch in shapes:
        widths = set()
        if not args.skip_bytes:
            for precision in precisions:
                row = bias_bytes(args.preset, seq_length, micro_batch, precision)
                widths.add(row["width"])
                results["bias_bytes"].append(row)
                print(f"seq {seq_length} x {micro_batch} (width {row['width']}) {precision:>13}: "
                      f"{row['bias_bytes'] / 2 ** 20:8.1f} MiB written to bias-shaped tensors, "
                      f"{row['sdpa_pad_bytes'] / 2 ** 20:7.1f} MiB SDPA GPU padding, ops {row['ops']}", flush=True)
        if not args.skip_timing:
            from tools.bench_train import make_examples, pmlm_batch

            examples = make_examples(micro_batch, seq_length, config.vocab_size, seed=1)
            width = widths.pop() if widths else pmlm_batch(examples).input_ids.shape[1]
            row = table_gradient_timings(config.num_attention_heads, config.rel_pos_bins, width, micro_batch,
                                         args.repeats)
            results["table_gradient"].append(row)
            print(f"table gradient, width {width} x {micro_batch}: F.embedding backward "
                  f"{row['embedding_backward_s'] * 1e3:.1f} ms, "
                  f"one-hot contraction {row['table_gradient_s'] * 1e3:.1f} ms; "
                  f"largest error against a float64 sum {row['embedding_backward_error']:.1e} and "
                  f"{row['table_gradient_error']:.1e}", flush=True)
            print(f"  bytes a query-key pair (bf16 gradient): one-hot GEMMs {row['gemm_bytes_read_per_pair']:.1f} "
                  f"read + {row['gemm_bytes_written_per_pair']:.1f} written ({row['gemm_ops']} ops); the GPU's Triton "
                  f"kernel {row['kernel_bytes_read_per_pair']:.1f} read + {row['kernel_bytes_written_per_pair']:.1f} "
                  f"written", flush=True)
    if args.json:
        write_json_atomically(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
