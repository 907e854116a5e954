"""How far gradients accumulated in bf16 drift from the exact sum:
`python tools/bench_accumulation_precision.py [--preset tiny] [--micro-batch-size 8] [--seq-length 64]
[--micro-batches 1 2 4 8 15 16 32 48]`.

With `--bf16` at ZeRO-1/2, DeepSpeed keeps each parameter's gradient in bf16 and lets autograd add
every micro batch's into it (its default `"data_types": {"grad_accum_dtype"}` is the model's dtype;
"fp32" switches ZeRO-1 to its BF16_Optimizer, which accumulates in fp32). This tool takes the
model in bf16 weights (as DeepSpeed's bf16 engine holds it, dropout off), computes the bf16
gradient of successive micro batches (bench_train's random pseudo-masked batches), and adds them
up three ways: in bf16 in place (what the run does), in fp32, and in float64 (the reference). It
prints the relative error of the two over the whole gradient (the norm of the difference over the
norm of the reference) and the worst parameter tensor's largest absolute error over its largest
value, at each count of micro batches asked. Nothing here is a test; the figures go to
docs/benchmarks.md and docs/pretraining.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
from bench_train import make_examples, pmlm_batch  # noqa: E402
from megatron_pmlm.config import HelpFormatter, model_config_from_preset  # noqa: E402
from megatron_pmlm.models.model import PMLMForPreTraining  # noqa: E402


def relative_error(accumulated: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    difference = sum(((a.double() - r) ** 2).sum() for a, r in zip(accumulated, reference)).sqrt()
    return float(difference / sum((r ** 2).sum() for r in reference).sqrt())


def worst_tensor_error(accumulated: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    return max(float((a.double() - r).abs().max() / r.abs().max().clamp_min(1e-300))
               for a, r in zip(accumulated, reference))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="tiny", help="tiny, base or large")
    parser.add_argument("--micro-batch-size", type=int, default=8, help="samples per micro batch")
    parser.add_argument("--seq-length", type=int, default=64, help="tokens per sample before the appended ones")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2, 4, 8, 15, 16, 32, 48],
                        help="print the errors after these many micro batches")
    parser.add_argument("--seed", type=int, default=100, help="the first micro batch's seed (then +1 each)")
    args = parser.parse_args(argv)
    if min(args.micro_batches) < 1 or args.micro_batch_size < 1 or args.seq_length < 8:
        parser.error("--micro-batches and --micro-batch-size must be >= 1, --seq-length >= 8")
    config = model_config_from_preset(args.preset, vocab_size=30522)
    model = PMLMForPreTraining(config, init_seed=1).to(torch.bfloat16).train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0  # the same function for every micro batch's gradient: only the sums differ
    parameters = [p for p in model.parameters() if p.requires_grad]
    in_bf16 = in_fp32 = reference = None
    print(f"{args.preset}, micro batch {args.micro_batch_size} x seq {args.seq_length}, bf16 weights and gradients")
    for count in range(1, max(args.micro_batches) + 1):
        model.zero_grad(set_to_none=True)
        batch = pmlm_batch(make_examples(args.micro_batch_size, args.seq_length, config.vocab_size,
                                         args.seed + count))
        model(*batch.as_tuple()).loss.backward()
        gradients = [p.grad.detach() for p in parameters]  # bf16: what each micro batch adds
        if reference is None:
            in_bf16 = [g.clone() for g in gradients]
            in_fp32 = [g.float() for g in gradients]
            reference = [g.double() for g in gradients]
        else:
            for total, g in zip(in_bf16, gradients):
                total.add_(g)  # autograd's accumulation into a bf16 .grad
            for total, g in zip(in_fp32, gradients):
                total.add_(g.float())
            for total, g in zip(reference, gradients):
                total.add_(g.double())
        if count in args.micro_batches:
            print(f"{count:4d} micro batches: accumulated in bf16: relative error {relative_error(in_bf16, reference):.2e} "
                  f"(worst tensor {worst_tensor_error(in_bf16, reference):.2e}) | in fp32: "
                  f"{relative_error(in_fp32, reference):.2e} ({worst_tensor_error(in_fp32, reference):.2e})",
                  flush=True)


if __name__ == "__main__":
    main()
