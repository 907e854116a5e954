"""`make demo`: corpus -> WordPiece vocabulary -> a tiny PMLM pre-trained on DeepSpeed, on the CPU.

    python -m megatron_pmlm.demo [--input FILE ...] [--vocab-file VOCAB] [--output-dir outputs/demo]

Without --input the corpus is the documentation text every CPython ships (`pydoc_data.topics`,
~465 KB of English). Without --vocab-file a WordPiece vocabulary is trained on the corpus.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from .pretrain import main as pretrain_main
from .text_data import read_text_documents
from .tokenizer import train_wordpiece


def write_pydoc_corpus(path: Path) -> int:
    """One document per pydoc topic; blank lines inside a topic collapsed so it stays one document."""
    from pydoc_data.topics import topics

    documents = [re.sub(r"\n\s*\n", "\n", text.strip()) for _, text in sorted(topics.items())]
    text = "\n\n".join(d for d in documents if d) + "\n"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return len(text.encode("utf-8"))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", nargs="+", help="plain-text files (documents separated by blank lines)")
    parser.add_argument("--vocab-file", help="use this WordPiece vocab.txt instead of training one")
    parser.add_argument("--output-dir", default="outputs/demo")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--train-iters", type=int, default=300)
    parser.add_argument("--objective", default="ae+par")
    args = parser.parse_args(argv)
    started = time.time()

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    if args.input:
        missing = [p for p in args.input if not Path(p).is_file()]
        if missing:
            print(f"error: input file(s) not found: {', '.join(missing)}", file=sys.stderr)
            return 2
        corpus_files = list(args.input)
        print(f"[1/3] corpus: {len(corpus_files)} input file(s), "
              f"{sum(Path(p).stat().st_size for p in corpus_files) / 1e6:.2f} MB")
    else:
        corpus = out / "corpus.txt"
        size = write_pydoc_corpus(corpus)
        corpus_files = [str(corpus)]
        print(f"[1/3] corpus: pydoc_data.topics -> {corpus} ({size / 1e3:.0f} KB)")

    if args.vocab_file:
        vocab = Path(args.vocab_file)
        if not vocab.is_file():
            print(f"error: vocabulary file not found: {vocab}", file=sys.stderr)
            return 2
        print(f"[2/3] vocabulary: {vocab}")
    else:
        vocab = train_wordpiece(read_text_documents(corpus_files), args.vocab_size, out)
        print(f"[2/3] vocabulary: trained WordPiece ({args.vocab_size} entries) -> {vocab}")

    history_file = out / "history.json"
    checkpoint_dir = out / "checkpoints"
    print(f"[3/3] pre-training a tiny PMLM ({args.objective}) for {args.train_iters} steps on DeepSpeed")
    status = pretrain_main([
        "--preset", "tiny", "--objective", args.objective, "--vocab-file", str(vocab),
        "--text-data", *corpus_files, "--seq-length", "128", "--micro-batch-size", "16",
        "--global-batch-size", "16", "--train-iters", str(args.train_iters), "--lr", "1e-3",
        "--lr-warmup-iters", str(max(1, args.train_iters // 10)), "--log-interval",
        str(max(1, args.train_iters // 10)), "--eval-interval", str(max(1, args.train_iters // 2)),
        "--eval-iters", "4", "--valid-fraction", "0.05", "--seed", "1234",
        "--save", str(checkpoint_dir), "--history-json", str(history_file)])
    if status:
        return status

    history = [h for h in json.loads(history_file.read_text()) if "loss" in h]
    first, last = history[0], history[-1]
    print("\nlosses (training, averaged over a log interval):")
    for key in ("loss_ae", "loss_par"):
        if first[key] or last[key]:
            print(f"  {key:<9} {first[key]:.3f} at iteration {first['iteration']} -> "
                  f"{last[key]:.3f} at iteration {last['iteration']}")
    falling = all(last[k] < first[k] for k in ("loss_ae", "loss_par") if first[k])
    print(f"\n{'the losses fell' if falling else 'WARNING: the losses did not fall'}; "
          f"demo took {time.time() - started:.0f} s")
    print(f"outputs under {out.resolve()}:")
    print(f"  vocabulary   {Path(vocab).resolve()}")
    print(f"  metrics      {history_file.resolve()}")
    print(f"  checkpoint   {checkpoint_dir.resolve()} (DeepSpeed format)")
    return 0 if falling else 1


if __name__ == "__main__":
    sys.exit(main())
