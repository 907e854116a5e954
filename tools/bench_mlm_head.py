#!/usr/bin/env python
"""The MLM head and loss alone (issue 33 item 5): the former per-objective head and loss against
today's one gather, one head and chunked biased cross entropy, on the same final hidden states.

    python tools/bench_mlm_head.py --preset base --seq-length 128 --micro-batch-size 4 [--bf16]

Times forward + backward of the head and loss (the encoder runs once, outside the timing, its
output a leaf that takes the gradient) and, over the same work, the [slots, vocabulary] tensors
ops produce (a TorchDispatchMode): the largest, the largest fp32 one and the peak alive at once,
for both. The batch is
bench_train's (real blockwise masks, 15 %), the vocabulary padded to a multiple of 128 as in
pre-training.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import weakref
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from bench_train import make_examples, pmlm_batch  # noqa: E402
from megatron_pmlm.config import HelpFormatter, model_config_from_preset  # noqa: E402
from megatron_pmlm.models.layout import MASKED, PSEUDO, predicted_slots  # noqa: E402
from megatron_pmlm.models.model import PMLMForPreTraining, pmlm_losses  # noqa: E402
from megatron_pmlm.parallel import layers as parallel_layers  # noqa: E402
from megatron_pmlm.training.recipe import padded_vocab_size  # noqa: E402


def former_head_and_loss(model: PMLMForPreTraining, hidden: torch.Tensor, roles, labels) -> torch.Tensor:
    """The head and loss before issue 33: per objective a boolean index, a head call, the fp32
    padding buffer added to the logits and F.cross_entropy on `.float()` (the comparison's baseline)."""
    head, config = model.cls.predictions, model.config
    padding = torch.zeros(config.embedding_rows).masked_fill(
        torch.arange(config.embedding_rows) >= config.vocab_size, float("-inf"))
    weight = model.bert.embeddings.word_embeddings.weight
    total = hidden.new_zeros((), dtype=torch.float32)
    for role in (MASKED, PSEUDO):
        selected = predicted_slots(roles, labels, role)
        logits = F.linear(head.transform(hidden[selected]), weight) + head.bias + padding
        targets = labels[selected]
        loss = F.cross_entropy(logits.float(), targets, reduction="none").sum() / selected.sum().clamp(min=1)
        (logits.argmax(-1) == targets).sum()
        total = total + loss
    return total


class SlotsByVocabularyBytes(TorchDispatchMode):
    """The [rows, vocabulary] tensors ops produce (rows up to the predicted slots: logits, their fp32
    copies, log-softmax, gradients; not the [vocabulary, hidden] embedding gradient): the largest,
    the largest fp32 one, and the peak of those alive at once (new storages only, freed when the
    last reference goes: what the head and loss hold in memory, e.g. from forward to backward)."""

    def __init__(self, vocabulary: int, slots: int) -> None:
        super().__init__()
        self.vocabulary, self.slots = vocabulary, slots
        self.largest = self.largest_fp32 = self.live = self.peak_live = 0
        self.storages: set[int] = set()

    def _free(self, size: int, storage: int) -> None:
        self.live -= size
        self.storages.discard(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a) for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(tensor, torch.Tensor) and tensor.dim() == 2 and tensor.shape[1] == self.vocabulary
                    and tensor.shape[0] <= self.slots and id(tensor) not in inputs
                    and tensor.untyped_storage().data_ptr() not in self.storages):  # not a view of one counted
                size = tensor.numel() * tensor.element_size()
                self.largest = max(self.largest, size)
                if tensor.dtype == torch.float32:
                    self.largest_fp32 = max(self.largest_fp32, size)
                self.live += size
                self.peak_live = max(self.peak_live, self.live)
                storage = tensor.untyped_storage().data_ptr()
                self.storages.add(storage)
                weakref.finalize(tensor, self._free, size, storage)
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--preset", default="base", help="tiny, base or large")
    parser.add_argument("--seq-length", type=int, default=128, help="tokens per sample before the appended ones")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="samples per step")
    parser.add_argument("--bf16", action="store_true", help="autocast bf16 (else fp32)")
    parser.add_argument("--iterations", type=int, default=20, help="timed forward + backward passes of each")
    parser.add_argument("--warmup", type=int, default=3, help="untimed passes first")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--chunk-rows", type=int, default=0,
                        help="rows per fp32 chunk of the cross entropy (0: the library's CROSS_ENTROPY_CHUNK_ROWS)")
    parser.add_argument("--seed", type=int, default=1234, help="token ids and masks")
    args = parser.parse_args(argv)
    for name in ("seq_length", "micro_batch_size", "iterations"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.chunk_rows < 0:
        print("error: --chunk-rows must be >= 0", file=sys.stderr)
        return 2
    if args.chunk_rows:
        parallel_layers.CROSS_ENTROPY_CHUNK_ROWS = args.chunk_rows
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config = model_config_from_preset(args.preset, hidden_dropout=0.0, attention_dropout=0.0,
                                          max_position_embeddings=max(args.seq_length, 128))
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    config = replace(config, padded_vocab_size=padded_vocab_size(config.vocab_size, 128, 1))
    model = PMLMForPreTraining(config, "ae+par", init_seed=args.seed)
    batch = pmlm_batch(make_examples(args.micro_batch_size, args.seq_length, config.vocab_size, args.seed))
    with torch.no_grad():
        hidden = model.bert(*batch.as_tuple()[:5])
    hidden.requires_grad_()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    runs = {
        "former": lambda: former_head_and_loss(model, hidden, batch.roles, batch.labels),
        "now": lambda: pmlm_losses(hidden, batch.roles, batch.labels, model.objective, model.mlm_logits_and_bias,
                                   model.layers, batch.predicted_index).loss,
    }
    slots = int(batch.predicted_index.numel())
    print(f"{args.preset}, seq {args.seq_length}, micro batch {args.micro_batch_size}, "
          f"{'bf16 autocast' if args.bf16 else 'fp32'}, {slots} predicted slots, vocabulary "
          f"{config.vocab_size} padded to {config.embedding_rows}, cross-entropy chunks of "
          f"{parallel_layers.CROSS_ENTROPY_CHUNK_ROWS} rows, {torch.get_num_threads()} threads")
    for name, run in runs.items():
        def step():
            model.zero_grad(set_to_none=True)
            hidden.grad = None
            with autocast:
                loss = run()
            loss.backward()
            return loss

        with SlotsByVocabularyBytes(config.embedding_rows, slots) as sizes:
            loss = step()
        for _ in range(args.warmup):
            step()
        start = time.perf_counter()
        for _ in range(args.iterations):
            step()
        seconds = (time.perf_counter() - start) / args.iterations
        print(f"  {name:6s} loss {float(loss.detach()):.6f} | {seconds * 1e3:7.2f} ms fwd+bwd | [slots, vocab] "
              f"tensors: largest {sizes.largest / 2**20:5.1f} MiB, largest fp32 {sizes.largest_fp32 / 2**20:5.1f} MiB, "
              f"peak alive {sizes.peak_live / 2**20:5.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
