"""Continue texts with a PALM model: `python -m megatron_pmlm.decode_palm --model DIR --input contexts.txt
--output continuations.txt [--beam-size K] ...`.

    python -m megatron_pmlm.decode_palm --model SAVE_DIR|HF_DIR --input ctx.txt|ctx.jsonl --output out.txt
        [--beam-size K] [--length-penalty A] [--min-length N] [--max-target-length 100]
        [--max-context-length 400] [--no-repeat-ngram-size N [--ngram-ignore-tokens ". , ?"]]
        [--batch-size B] [--device cpu|cuda]

The model is a PALM pre-training checkpoint directory (`pretrain --model palm --save`) or its
converted Hugging Face folder (`decode_s2s --model` decodes it the same way: this command is its
PALM alias, with PALM's defaults). Input: one context per line, or the `src` field of each .jsonl line.
The encoder reads `[CLS] context [SEP]`; the decoder starts from [CLS] and generates under the copy
distribution P = λ P^v + (1 - λ) P^c until [SEP] (greedy, or the beam search of generation/search.py
with its n-gram blocking, minimum length and length penalty). Output: one line per input, written atomically
(`-`: standard output, the messages then go to standard error; a FIFO or device is written through).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .generation.commands import PALM_MAX_CONTEXT_LENGTH as DEFAULT_MAX_CONTEXT_LENGTH
from .generation.commands import PALM_MAX_TARGET_LENGTH as DEFAULT_MAX_TARGET_LENGTH
from .files import exit_quietly_on_closed_pipe
from .generation.commands import run_decode_command, run_palm
from .training.checkpoint_files import add_no_checksums_argument


def build_parser() -> argparse.ArgumentParser:
    from .config import HelpFormatter, non_negative_int

    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.decode_palm", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="a PALM checkpoint directory (pretrain --model palm --save) or its Hugging Face folder")
    parser.add_argument("--input", required=True, type=Path, metavar="FILE",
                        help="contexts: text (one per line) or .jsonl (the `src` field of each line)")
    parser.add_argument("--output", required=True, type=Path, metavar="FILE",
                        help="continuations, one line per input ('-': standard output)")
    parser.add_argument("--beam-size", type=int, default=1, metavar="K", help="1: greedy")
    parser.add_argument("--length-penalty", type=float, default=0.0, metavar="A",
                        help="beam search: rank finished hypotheses by score / ((5 + length) / 6) ** A when A > 0")
    parser.add_argument("--min-length", type=int, default=1, metavar="N", help="beam search: no [SEP] before N tokens")
    parser.add_argument("--max-target-length", type=int, default=DEFAULT_MAX_TARGET_LENGTH, metavar="N",
                        help="tokens generated at most, [SEP] included")
    parser.add_argument("--max-context-length", type=int, default=DEFAULT_MAX_CONTEXT_LENGTH, metavar="N",
                        help="contexts are cut to N - 2 wordpieces ([CLS] and [SEP] added)")
    parser.add_argument("--no-repeat-ngram-size", type=non_negative_int, default=0, metavar="N",
                        help="beam search: never repeat an n-gram of N tokens (0: off)")
    parser.add_argument("--ngram-ignore-tokens", default="", metavar="TOKENS",
                        help="tokens exempt from n-gram blocking, separated by spaces or '|'")
    parser.add_argument("--batch-size", type=int, default=32, metavar="B", help="contexts per batch")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_no_checksums_argument(parser)
    return parser


def main(argv=None) -> int:
    return run_decode_command(build_parser, run_palm, argv)


if __name__ == "__main__":
    sys.exit(exit_quietly_on_closed_pipe(main))
