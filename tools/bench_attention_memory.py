"""Attention memory of the two backends: `python tools/bench_attention_memory.py [--preset base]
[--seq-length 512] [--micro-batch-size 20]`.

For each backend, in a fresh process: the real pseudo-masked layout of a micro batch (blockwise
masks, as tools/bench_train.py builds it), the per-batch attention inputs (`model.attention_inputs`:
the dense additive bias for sdpa, the block mask + relative-bias table for flex) and one
self-attention layer's forward and backward at the preset's width; the peak RSS above the process's
baseline is reported next to what the per-batch inputs alone hold. On a CPU both backends
materialise the scores (sdpa's math kernel; FlexAttention's unfused reference path), so the
measured peaks are close: the dense bias is what flex removes, and its size is the figure that
carries over to a GPU, where the fused kernels never hold the scores. Nothing here is a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

from megatron_pmlm.config import ATTENTION_BACKENDS, model_config_from_preset, positive_int  # noqa: E402


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(backend: str, preset: str, seq_length: int, micro_batch_size: int) -> dict:
    from megatron_pmlm.models.flex_attention import FlexAttentionMask
    from megatron_pmlm.models.layout import pmlm_attention_allowed
    from megatron_pmlm.models.model import BertSelfAttention, RelativePositionBias, attention_inputs
    from megatron_pmlm.parallel.layers import LocalLayers
    from tools.bench_train import make_examples, pmlm_batch

    config = model_config_from_preset(preset, hidden_dropout=0.0, attention_dropout=0.0,
                                      max_position_embeddings=max(seq_length, 128), attention_backend=backend)
    batch = pmlm_batch(make_examples(micro_batch_size, seq_length, config.vocab_size, seed=1))
    rel_pos_bias = RelativePositionBias(config.num_attention_heads, config.rel_pos_bins, config.max_rel_pos)
    torch.nn.init.normal_(rel_pos_bias.weight, std=0.02)
    attention = BertSelfAttention(config, LocalLayers())
    hidden = torch.randn(*batch.input_ids.shape, config.hidden_size, requires_grad=True)
    baseline = peak_rss_bytes()
    inputs = attention_inputs(backend, rel_pos_bias, pmlm_attention_allowed, batch.position_ids, batch.roles,
                              batch.steps, hidden.dtype)
    if isinstance(inputs, FlexAttentionMask):
        block_mask = inputs.block_mask
        held = sum(t.numel() * t.element_size() for t in block_mask.as_tuple() if isinstance(t, torch.Tensor))
        held += batch.roles.shape[0] * batch.roles.shape[1] ** 2  # the rule's boolean [B, T, T] the mask_mod reads
        held += inputs.distance_bias.numel() * inputs.distance_bias.element_size()
    else:
        held = inputs.numel() * inputs.element_size()
    attention(hidden, inputs).sum().backward()
    return {"backend": backend, "preset": preset, "seq_length": seq_length, "micro_batch_size": micro_batch_size,
            "layout_width": int(batch.input_ids.shape[1]), "heads": config.num_attention_heads,
            "per_batch_inputs_bytes": int(held), "peak_rss_above_baseline_bytes": int(peak_rss_bytes() - baseline)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tools/bench_attention_memory.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="base")
    parser.add_argument("--seq-length", type=positive_int, default=512)
    parser.add_argument("--micro-batch-size", type=positive_int, default=20)
    parser.add_argument("--backends", default=",".join(ATTENTION_BACKENDS))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.child, args.preset, args.seq_length, args.micro_batch_size)))
        return 0
    for backend in args.backends.split(","):
        result = subprocess.run([sys.executable, __file__, "--child", backend, "--preset", args.preset, "--seq-length",
                                 str(args.seq_length), "--micro-batch-size", str(args.micro_batch_size)],
                                capture_output=True, text=True)
        if result.returncode:
            print(result.stderr[-3000:], file=sys.stderr)
            return result.returncode
        figures = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"{backend}: {figures['preset']}, seq {figures['seq_length']} (layout width {figures['layout_width']}), "
              f"micro batch {figures['micro_batch_size']}, {figures['heads']} heads | per-batch attention inputs "
              f"{figures['per_batch_inputs_bytes'] / 2**20:,.1f} MiB | one layer forward + backward, peak RSS above "
              f"baseline {figures['peak_rss_above_baseline_bytes'] / 2**20:,.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
