"""Pre-train a PMLM: `python -m megatron_pmlm.pretrain --preset base --vocab-file V --text-data F...`.

Megatron-style arguments; the defaults of the `base` preset are the paper's recipe (SPEC §6).
Runs on DeepSpeed from one process up (torchrun / deepspeed launchers set the ranks).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .config import PRESETS, ConfigError, MaskingConfig, model_config_from_preset
from .layout import PMLMBatch
from .model import PMLMForPreTraining, count_parameters
from .objectives import DEFAULT_OBJECTIVE, OBJECTIVES, get_objective
from .text_data import PMLMCollator, Sample, pack_samples, read_text_documents, tokenize_documents
from .tokenizer import WordPieceTokenizer
from .training import Trainer, TrainingConfig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_pmlm.pretrain", description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    defaults = TrainingConfig()
    model = parser.add_argument_group("model")
    model.add_argument("--preset", default="base", help=f"one of {', '.join(PRESETS)}")
    model.add_argument("--num-layers", type=int)
    model.add_argument("--hidden-size", type=int)
    model.add_argument("--num-attention-heads", type=int)
    model.add_argument("--ffn-hidden-size", type=int)
    model.add_argument("--max-position-embeddings", type=int)
    model.add_argument("--hidden-dropout", type=float)
    model.add_argument("--attention-dropout", type=float)
    model.add_argument("--no-rel-pos", action="store_true", help="plain BERT: no relative position bias")
    model.add_argument("--objective", default=DEFAULT_OBJECTIVE, help=f"one of {', '.join(OBJECTIVES)}")

    data = parser.add_argument_group("data")
    data.add_argument("--vocab-file", required=True, help="WordPiece vocab.txt (uncased)")
    data.add_argument("--text-data", nargs="+", required=True,
                      help="plain-text files, documents separated by blank lines (read into memory)")
    data.add_argument("--valid-fraction", type=float, default=0.02,
                      help="fraction of documents held out for validation")
    data.add_argument("--short-seq-prob", type=float, default=0.1)

    train = parser.add_argument_group("training")
    for name in ("seq_length", "micro_batch_size", "global_batch_size", "train_iters",
                 "lr_warmup_iters", "zero_stage", "seed", "log_interval", "eval_interval", "eval_iters"):
        train.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(defaults, name))
    for name in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad"):
        train.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(defaults, name))
    train.add_argument("--deepspeed-config", help="a DeepSpeed JSON config; command-line values override it")
    train.add_argument("--save", help="directory for the final DeepSpeed checkpoint")
    train.add_argument("--history-json", help="write the logged metrics to this JSON file")
    return parser


def configs_from_args(args: argparse.Namespace, vocab_size: int):
    objective = get_objective(args.objective)
    model_config = model_config_from_preset(
        args.preset, vocab_size=vocab_size, num_layers=args.num_layers, hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads, ffn_hidden_size=args.ffn_hidden_size,
        max_position_embeddings=args.max_position_embeddings, hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout, rel_pos=False if args.no_rel_pos else None)
    training = TrainingConfig(**{f: getattr(args, f) for f in asdict(TrainingConfig())})
    if training.seq_length > model_config.max_position_embeddings:
        raise ConfigError(
            f"--seq-length {training.seq_length} exceeds the model's maximum sequence length "
            f"{model_config.max_position_embeddings} (preset {args.preset!r}); lower --seq-length or "
            f"raise --max-position-embeddings")
    return objective, model_config, training


def batch_iterator(samples: Sequence[Sample], collator: PMLMCollator, batch_size: int,
                   seed: int, shuffle: bool = True) -> Iterator[PMLMBatch]:
    """Endless batches: a fresh shuffle each epoch, masks re-sampled every time."""
    if not samples:
        raise ValueError("no training samples: the input text produced no sentences")
    rng = np.random.default_rng(seed)
    while True:
        order = rng.permutation(len(samples)) if shuffle else np.arange(len(samples))
        for start in range(0, len(order) - batch_size + 1, batch_size):
            yield collator([samples[i] for i in order[start:start + batch_size]])
        if len(order) < batch_size:
            yield collator([samples[i] for i in order])


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except (ConfigError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    tokenizer = WordPieceTokenizer(args.vocab_file)
    objective, model_config, training = configs_from_args(args, tokenizer.vocab_size)
    if not 0.0 <= args.valid_fraction < 1.0:
        raise ConfigError(f"--valid-fraction must be in [0, 1), got {args.valid_fraction}")
    ds_config_base = None
    if args.deepspeed_config:
        with open(args.deepspeed_config) as handle:
            ds_config_base = json.load(handle)

    rng = np.random.default_rng(training.seed)
    documents = tokenize_documents(read_text_documents(args.text_data), tokenizer, training.seq_length - 3)
    if not documents:
        raise ValueError(f"no text found in {', '.join(args.text_data)}")
    order = rng.permutation(len(documents))
    num_valid = int(round(args.valid_fraction * len(documents))) if len(documents) > 1 else 0
    valid_docs = [documents[i] for i in order[:num_valid]]
    train_docs = [documents[i] for i in order[num_valid:]]
    train_samples = pack_samples(train_docs, training.seq_length, tokenizer.special, rng, args.short_seq_prob)
    valid_samples = pack_samples(valid_docs, training.seq_length, tokenizer.special, rng, args.short_seq_prob)

    model = PMLMForPreTraining(model_config, objective)
    print(f"model: preset {args.preset}, {count_parameters(model):,} parameters, objective {objective.name}, "
          f"relative position bias {'on' if model_config.rel_pos else 'off'}")
    print(f"data: {len(train_docs)} training documents -> {len(train_samples)} samples, "
          f"{len(valid_docs)} validation documents -> {len(valid_samples)} samples")

    collator_args = dict(objective=objective, special=tokenizer.special, vocab_size=tokenizer.vocab_size,
                         max_length=model_config.max_position_embeddings, masking=MaskingConfig())
    trainer = Trainer(model, training, ds_config_base)
    train_batches = batch_iterator(train_samples, PMLMCollator(**collator_args, seed=training.seed + 1),
                                   training.micro_batch_size, training.seed)
    valid_batches = None
    if valid_samples:
        # The same masks every evaluation, so validation losses are comparable over time.
        def valid_batches():
            return batch_iterator(valid_samples, PMLMCollator(**collator_args, seed=training.seed + 2),
                                  training.micro_batch_size, training.seed, shuffle=False)
    history = trainer.train(train_batches, valid_batches)
    if args.save:
        trainer.save_checkpoint(args.save, {"model_config": asdict(model_config), "objective": objective.name})
        print(f"checkpoint saved under {Path(args.save).resolve()}")
    if args.history_json:
        Path(args.history_json).write_text(json.dumps(history, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
