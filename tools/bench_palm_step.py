#!/usr/bin/env python
"""PALM's stage-2 step (encoder, decoder, pointer-generator, continuation loss), eager against
`pretrain --model palm --compile`: kernels and seconds per micro batch, on any machine (the CPU's
inductor C++ backend too).

    python tools/bench_palm_step.py --preset palm-base --hidden-size 96 --context-length 128 \
        --continuation-length 32 --micro-batch-size 4 --threads 2
    python tools/bench_palm_step.py --preset palm-base --context-length 512 --continuation-length 128 \
        --micro-batch-size 16 --bf16 --json palm.json

A forward and backward of one micro batch of random pairs (the last context shortened by a quarter,
as padding; every continuation token labelled) through `PalmForPreTraining`, then through a copy
compiled as `pretrain --compile` compiles it (`compiled.compile_step_regions`: the encoder's layers
and embed at the padded context width, one region for the decoder's layers and one for the
pointer-generator, both with symbolic sizes). Per micro batch: kernels (training/kernel_count.py:
eager, dispatched ATen ops; compiled, generated kernels + extern calls + the eager rest), seconds
(median of --iterations after --warmup; the first compiled call, the compilation, is reported
apart), and how far the compiled loss and gradients are from eager's (dropout 0; the gradients'
largest difference against the largest gradient).
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from megatron_pmlm.config import HelpFormatter  # noqa: E402
from megatron_pmlm.models.compiled import compile_step_regions  # noqa: E402
from megatron_pmlm.models.layout import CONTEXT, PAD  # noqa: E402
from megatron_pmlm.models.palm import PALM_PRESETS, PalmForPreTraining, palm_config_from_preset  # noqa: E402
from megatron_pmlm.training.kernel_count import count_kernels, prepare_compiled_counting  # noqa: E402
from megatron_pmlm.training.recipe import padded_vocab_size  # noqa: E402
from tools.bench_pipeline_stage import report_comparison, run_comparison, seconds_per_step, sync  # noqa: E402

VOCAB_SIZE = 30522  # bert-base-uncased's
PADDED_VOCAB_SIZE = padded_vocab_size(VOCAB_SIZE, 128, 1)  # as pretrain pads it (--make-vocab-size-divisible-by)


def random_pairs(micro_batch_size: int, context_length: int, continuation_length: int, device: torch.device,
                 seed: int) -> tuple[torch.Tensor, ...]:
    """`PalmBatch.as_tuple()` of stage 2 for random ids."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, VOCAB_SIZE, (micro_batch_size, context_length), generator=generator)
    roles = torch.full_like(ids, CONTEXT)
    padding = context_length // 4
    if padding:
        roles[-1, -padding:], ids[-1, -padding:] = PAD, 0
    decoder_ids = torch.randint(1000, VOCAB_SIZE, (micro_batch_size, continuation_length), generator=generator)
    labels = torch.randint(1000, VOCAB_SIZE, (micro_batch_size, continuation_length), generator=generator)
    return tuple(t.to(device) for t in (ids, roles, ids.clone(), torch.full_like(ids, -100), decoder_ids, labels))


def make_step(model: PalmForPreTraining, inputs: tuple[torch.Tensor, ...]):
    """Forward and backward of one micro batch; returns the loss (gradients left in the parameters)."""
    def step():
        model.zero_grad(set_to_none=True)
        loss = model(*inputs).loss
        loss.backward()
        return loss.detach()

    return step


def measure(args) -> dict:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    overrides = dict(hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                     ffn_hidden_size=args.ffn_hidden_size or (4 * args.hidden_size if args.hidden_size else None))
    config = palm_config_from_preset(args.preset, vocab_size=VOCAB_SIZE, padded_vocab_size=PADDED_VOCAB_SIZE,
                                     hidden_dropout=0.0, attention_dropout=0.0, **overrides)
    prepare_compiled_counting()
    eager = PalmForPreTraining(config, init_seed=args.seed).to(device, dtype).train()
    compiled = copy.deepcopy(eager)
    compile_step_regions(compiled)
    inputs = random_pairs(args.micro_batch_size, args.context_length, args.continuation_length, device, args.seed)
    eager_step, compiled_step = make_step(eager, inputs), make_step(compiled, inputs)

    start = time.perf_counter()
    compiled_loss = compiled_step()
    sync(device)
    first_compiled = time.perf_counter() - start
    eager_loss = eager_step()
    # Relative to the largest gradient: some are zero up to rounding (the key biases': softmax ignores
    # a constant added to every score of a row), so each against its own largest entry would be noise.
    pairs = [(ours.grad.float(), reference.grad.float())
             for reference, ours in zip(eager.parameters(), compiled.parameters()) if reference.grad is not None]
    gradient_difference = (max(float((ours - reference).abs().max()) for ours, reference in pairs)
                           / max(float(reference.abs().max()) for _, reference in pairs))

    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": args.preset, "hidden_size": config.hidden_size, "heads": config.num_attention_heads,
        "encoder_layers": config.num_layers, "decoder_layers": config.num_decoder_layers,
        "context_length": args.context_length, "continuation_length": args.continuation_length,
        "micro_batch_size": args.micro_batch_size, "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "eager_kernels": count_kernels(eager_step, compiled=False),
        "compiled_kernels": count_kernels(compiled_step, compiled=True),
        "eager_seconds": seconds_per_step(eager_step, device, args.warmup, args.iterations),
        "compiled_seconds": seconds_per_step(compiled_step, device, args.warmup, args.iterations),
        "first_compiled_seconds": first_compiled,
        "loss_difference": float((compiled_loss.float() - eager_loss.float()).abs() / eager_loss.float().abs()),
        "gradient_difference": gradient_difference,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="palm-base", choices=sorted(PALM_PRESETS))
    parser.add_argument("--hidden-size", type=int, help="override the preset's (its heads stay)")
    parser.add_argument("--num-attention-heads", type=int)
    parser.add_argument("--ffn-hidden-size", type=int, help="default: the preset's, or 4 x --hidden-size")
    parser.add_argument("--context-length", type=int, default=128)
    parser.add_argument("--continuation-length", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--bf16", action="store_true", help="the model's weights in bf16 (as DeepSpeed's bf16)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here (- : standard output)")
    args = parser.parse_args(argv)
    minimums = {"context_length": 2, "continuation_length": 2, "micro_batch_size": 1, "iterations": 1}
    for name, minimum in minimums.items():
        if getattr(args, name) < minimum:
            parser.error(f"--{name.replace('_', '-')} must be at least {minimum}, got {getattr(args, name)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be at least 0, got {args.warmup}")
    return args


def report(figures: dict) -> None:
    print(f"PALM stage 2: {figures['encoder_layers']} + {figures['decoder_layers']} layers, {figures['preset']} "
          f"(hidden {figures['hidden_size']}, {figures['heads']} heads), context {figures['context_length']}, "
          f"continuation {figures['continuation_length']}, micro batch {figures['micro_batch_size']}, "
          f"{figures['dtype']}, {figures['device']}")
    report_comparison(figures, {"loss": "loss_difference", "gradients": "gradient_difference"})


def main(argv=None) -> int:
    return run_comparison(parse_args(argv), measure, report)


if __name__ == "__main__":
    sys.exit(main())
