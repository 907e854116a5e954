#!/usr/bin/env python
"""The vocabulary head and loss alone (issue 33 item 5): the former losses, each with an fp32
[tokens, vocab] log-softmax, against today's chunked cross entropy, on the same final hidden states.

    python tools/bench_mlm_head.py --preset base --seq-length 128 --micro-batch-size 4 [--bf16]
    python tools/bench_mlm_head.py --loss s2s --preset base --seq-length 48 --micro-batch-size 32 [--bf16]
    python tools/bench_mlm_head.py --loss palm --preset base --seq-length 128 --micro-batch-size 32 [--bf16]

--loss mlm (pre-training): the former per-objective head and loss against one gather, one head
and the chunked biased cross entropy; the encoder runs once, outside the timing, its output a leaf
that takes the gradient; the batch is bench_train's (real blockwise masks, 15 %).
--loss s2s (s2s fine-tuning, pseudo-masked: every target token predicted): the MLM head on
micro-batch x seq-length target slots and the label-smoothed loss (--label-smoothing), the former
fp32 log-softmax over the cut logits against the chunked loss with its smoothing term.
--loss palm (PALM stage 2): the pointer-generator on micro-batch x seq-length decoder positions
over a context of --context-length, the continuation loss and its argmax of P, former against
chunked. s2s and palm start from random final hidden states (leaves that take the gradient): the
head and loss do not care where they come from.

Times forward + backward and, over the same work, the [tokens, vocabulary] tensors ops produce (a
TorchDispatchMode): the largest, the largest fp32 one and the peak alive at once, for both. The
vocabulary is padded to a multiple of 128 as in training.
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
from megatron_pmlm.models.palm import (COPY_PROBABILITY_FLOOR, CopyMixture, PointerGenerator,  # noqa: E402
                                       continuation_losses, copy_probability, palm_config_from_preset,
                                       scatter_copy)
from megatron_pmlm.models.seq2seq import label_smoothing_for, seq2seq_losses  # noqa: E402
from megatron_pmlm.parallel import layers as parallel_layers  # noqa: E402
from megatron_pmlm.parallel.layers import LocalLayers  # noqa: E402
from megatron_pmlm.training.recipe import padded_vocab_size  # noqa: E402

PAD_ID = 0
"""[PAD] of the BERT vocabulary: s2s-ft's label smoothing gives it no mass."""


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


def former_seq2seq_loss(model: PMLMForPreTraining, hidden: torch.Tensor, targets: torch.Tensor,
                        smoothing: float, pad_id: int) -> torch.Tensor:
    """s2s fine-tuning's loss before issue 33 item 5: the biased logits (fp32 under autocast) cut to
    the real vocabulary, their fp32 log-softmax, s2s-ft's label smoothing in closed form."""
    logits = model.mlm_logits(hidden)[:, :model.config.vocab_size]
    log_probs = F.log_softmax(logits.float(), dim=-1)
    label_log_probs = log_probs.gather(-1, targets[:, None]).squeeze(-1)
    if smoothing == 0.0:
        token_losses = -label_log_probs
    else:
        vocab = logits.shape[-1]
        spread = smoothing / (vocab - 2)
        constant = ((1.0 - smoothing) * torch.log(torch.tensor(1.0 - smoothing))
                    + (vocab - 2) * spread * torch.log(torch.tensor(spread)))
        others = log_probs.sum(-1) - label_log_probs - log_probs[:, pad_id]
        token_losses = constant - (1.0 - smoothing) * label_log_probs - spread * others
    (logits.argmax(-1) == targets).sum()
    return token_losses.sum() / (targets.numel() + 1e-5)


def former_palm_loss(mixture: CopyMixture, context_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """PALM stage 2's continuation loss before issue 33 item 5 (tensor parallel size 1): log P^v
    from an fp32 log-softmax over [B, D, vocab], the argmax of the whole fp32 P (five fp32
    [B, D, vocab] tensors)."""
    log_vocab = torch.log_softmax(mixture.vocab_logits.float(), -1).gather(-1, labels[..., None])[..., 0]
    copy = copy_probability(mixture.copy_attention, context_ids, labels)
    log_p = torch.logaddexp(mixture.log_gate + log_vocab,
                            mixture.log_gate_complement + torch.log(copy.clamp_min(COPY_PROBABILITY_FLOOR)))
    with torch.no_grad():  # the former final_distribution: P^v, P^c, both products and their sum apart
        vocab = torch.softmax(mixture.vocab_logits.float(), -1)
        copy = scatter_copy(mixture.copy_attention, context_ids, mixture.vocab_logits.shape[-1])
        distribution = mixture.log_gate.exp()[..., None] * vocab + mixture.log_gate_complement.exp()[..., None] * copy
        (distribution.argmax(-1) == labels).sum()
    return -log_p.sum() / labels.numel()


class SlotsByVocabularyBytes(TorchDispatchMode):
    """The [rows, vocabulary] tensors ops produce (rows up to the predicted slots, leading
    dimensions multiplied: logits, their fp32 copies, log-softmax, gradients; not the
    [vocabulary, hidden] embedding gradient): the largest, the largest fp32 one, and the peak of
    those alive at once (new storages only, freed when the last reference goes: what the head and
    loss hold in memory, e.g. from forward to backward). `vocabularies`: the last-dimension sizes
    that count (the padded and the real vocabulary)."""

    def __init__(self, vocabularies: set[int], slots: int) -> None:
        super().__init__()
        self.vocabularies, self.slots = vocabularies, slots
        self.largest = self.largest_fp32 = self.live = self.peak_live = 0
        self.storages: set[int] = set()

    def _free(self, size: int, storage: int) -> None:
        self.live -= size
        self.storages.discard(storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {id(a) for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)}
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if (isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] in self.vocabularies
                    and tensor.numel() // tensor.shape[-1] <= self.slots and id(tensor) not in inputs
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


def padded(config):
    """The vocabulary padded to a multiple of 128, as training pads it."""
    return replace(config, padded_vocab_size=padded_vocab_size(config.vocab_size, 128, 1))


def mlm_bench(args):
    """(config, {former, now}, leaves, modules, slots, description) of pre-training's MLM loss."""
    config = padded(model_config_from_preset(args.preset, hidden_dropout=0.0, attention_dropout=0.0,
                                             max_position_embeddings=max(args.seq_length, 128)))
    model = PMLMForPreTraining(config, "ae+par", init_seed=args.seed)
    batch = pmlm_batch(make_examples(args.micro_batch_size, args.seq_length, config.vocab_size, args.seed))
    with torch.no_grad():
        hidden = model.bert(*batch.as_tuple()[:5])
    hidden.requires_grad_()
    runs = {
        "former": lambda: former_head_and_loss(model, hidden, batch.roles, batch.labels),
        "now": lambda: pmlm_losses(hidden, batch.roles, batch.labels, model.objective, model.mlm_logits_and_bias,
                                   model.layers, batch.predicted_index).loss,
    }
    slots = int(batch.predicted_index.numel())
    return (config, runs, [hidden], [model], slots,
            f"seq {args.seq_length}, micro batch {args.micro_batch_size}, {slots} predicted slots")


def s2s_bench(args):
    """s2s fine-tuning's label-smoothed loss on micro-batch x seq-length target slots."""
    config = padded(model_config_from_preset(args.preset, hidden_dropout=0.0, attention_dropout=0.0))
    model = PMLMForPreTraining(config, "ae+par", init_seed=args.seed)
    generator = torch.Generator().manual_seed(args.seed)
    slots = args.micro_batch_size * args.seq_length
    hidden = torch.randn(slots, config.hidden_size, generator=generator).requires_grad_()
    targets = torch.randint(PAD_ID + 1, config.vocab_size, (slots,), generator=generator)
    smoothing = label_smoothing_for(args.label_smoothing, config.vocab_size, PAD_ID)
    runs = {
        "former": lambda: former_seq2seq_loss(model, hidden, targets, args.label_smoothing, PAD_ID),
        "now": lambda: seq2seq_losses(*model.mlm_logits_and_bias(hidden), targets, smoothing, model.layers).loss,
    }
    return (config, runs, [hidden], [model], slots,
            f"{args.micro_batch_size} x {args.seq_length} target tokens, label smoothing {args.label_smoothing}")


def palm_bench(args):
    """PALM stage 2's continuation loss on micro-batch x seq-length decoder positions."""
    config = padded(palm_config_from_preset(f"palm-{args.preset}", hidden_dropout=0.0, attention_dropout=0.0))
    layers = LocalLayers()
    torch.manual_seed(args.seed)
    pointer_generator = PointerGenerator(config, layers)
    embedding = torch.nn.Embedding(config.embedding_rows, config.hidden_size)
    torch.nn.init.normal_(embedding.weight, std=config.init_std)
    generator = torch.Generator().manual_seed(args.seed)
    batch, steps, context = args.micro_batch_size, args.seq_length, args.context_length
    decoder_hidden = torch.randn(batch, steps, config.hidden_size, generator=generator).requires_grad_()
    encoder_hidden = torch.randn(batch, context, config.hidden_size, generator=generator).requires_grad_()
    context_ids = torch.randint(PAD_ID + 1, config.vocab_size, (batch, context), generator=generator)
    # Half the targets from the context (PALM copies), half anywhere.
    from_context = context_ids.gather(1, torch.randint(0, context, (batch, steps), generator=generator))
    labels = torch.where(torch.rand(batch, steps, generator=generator) < 0.5, from_context,
                         torch.randint(PAD_ID + 1, config.vocab_size, (batch, steps), generator=generator))
    context_valid = torch.ones(batch, context, dtype=torch.bool)

    def mixture():
        return CopyMixture(*pointer_generator(decoder_hidden, encoder_hidden, context_valid, embedding.weight))

    runs = {
        "former": lambda: former_palm_loss(mixture(), context_ids, labels),
        "now": lambda: continuation_losses(mixture(), context_ids, labels, layers).loss,
    }
    return (config, runs, [decoder_hidden, encoder_hidden], [pointer_generator, embedding], batch * steps,
            f"{batch} x {steps} decoder positions, context {context}")


BENCHES = {"mlm": mlm_bench, "s2s": s2s_bench, "palm": palm_bench}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--loss", choices=("mlm", "s2s", "palm"), default="mlm",
                        help="pre-training's MLM loss, s2s fine-tuning's label-smoothed loss, PALM stage 2's")
    parser.add_argument("--preset", default="base", help="tiny, base or large (palm: palm- is prefixed)")
    parser.add_argument("--seq-length", type=int, default=128,
                        help="mlm: tokens per sample before the appended ones; s2s, palm: target tokens per example")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="samples per step")
    parser.add_argument("--context-length", type=int, default=128, help="palm: context tokens the decoder copies from")
    parser.add_argument("--label-smoothing", type=float, default=0.1, help="s2s: s2s-ft's label smoothing")
    parser.add_argument("--bf16", action="store_true", help="autocast bf16 (else fp32)")
    parser.add_argument("--iterations", type=int, default=20, help="timed forward + backward passes of each")
    parser.add_argument("--warmup", type=int, default=3, help="untimed passes first")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--chunk-rows", type=int, default=0,
                        help="rows per fp32 chunk of the cross entropy (0: the library's CROSS_ENTROPY_CHUNK_ROWS)")
    parser.add_argument("--seed", type=int, default=1234, help="token ids and masks")
    args = parser.parse_args(argv)
    for name in ("seq_length", "micro_batch_size", "iterations", "context_length"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if args.chunk_rows < 0:
        print("error: --chunk-rows must be >= 0", file=sys.stderr)
        return 2
    if not 0.0 <= args.label_smoothing < 1.0:
        print(f"error: --label-smoothing must be in [0, 1), got {args.label_smoothing}", file=sys.stderr)
        return 2
    if args.chunk_rows:
        parallel_layers.CROSS_ENTROPY_CHUNK_ROWS = args.chunk_rows
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        config, runs, leaves, modules, slots, what = BENCHES[args.loss](args)
    except ValueError as error:  # ConfigError included
        print(f"error: {error}", file=sys.stderr)
        return 2
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)
    print(f"{args.preset}, {what}, {'bf16 autocast' if args.bf16 else 'fp32'}, vocabulary "
          f"{config.vocab_size} padded to {config.embedding_rows}, cross-entropy chunks of "
          f"{parallel_layers.CROSS_ENTROPY_CHUNK_ROWS} rows, {torch.get_num_threads()} threads")
    for name, run in runs.items():
        def step():
            for module in modules:
                module.zero_grad(set_to_none=True)
            for leaf in leaves:
                leaf.grad = None
            with autocast:
                loss = run()
            loss.backward()
            return loss

        with SlotsByVocabularyBytes({config.embedding_rows, config.vocab_size}, slots) as sizes:
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
