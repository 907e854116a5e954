"""Continue texts with a PALM model: `python -m megatron_pmlm.decode_palm --model DIR --input contexts.txt
--output continuations.txt [--beam-size K] ...`.

    python -m megatron_pmlm.decode_palm --model SAVE_DIR|HF_DIR --input ctx.txt|ctx.jsonl --output out.txt
        [--beam-size K] [--length-penalty A] [--min-length N] [--max-target-length 100]
        [--max-context-length 400] [--no-repeat-ngram-size N [--ngram-ignore-tokens ". , ?"]]
        [--batch-size B] [--device cpu|cuda]

The model is a PALM pre-training checkpoint directory (`pretrain --model palm --save`) or its
converted Hugging Face folder. Input: one context per line, or the `src` field of each .jsonl line.
The encoder reads `[CLS] context [SEP]`; the decoder starts from [CLS] and generates under the copy
distribution P = λ P^v + (1 - λ) P^c until [SEP] (greedy, or the beam search of generation/search.py
with its n-gram blocking, minimum length and length penalty). Output: one line per input, written atomically
(`-`: standard output, the messages then go to standard error; a FIFO or device is written through).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from .config import ConfigError
from .files import InputError
from .generation.commands import (check_batch_and_output, decode_and_write, encode_sources, read_sources,
                                  run_decode_command)

DEFAULT_MAX_TARGET_LENGTH = 100
"""PALM's continuations: at most 100 tokens (§3.1)."""
DEFAULT_MAX_CONTEXT_LENGTH = 400
"""PALM's contexts: at most 400 tokens, [CLS] and [SEP] included."""


def build_parser() -> argparse.ArgumentParser:
    from .config import HelpFormatter

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
    parser.add_argument("--no-repeat-ngram-size", type=int, default=0, metavar="N",
                        help="beam search: never repeat an n-gram of N tokens (0: off)")
    parser.add_argument("--ngram-ignore-tokens", default="", metavar="TOKENS",
                        help="tokens exempt from n-gram blocking, separated by spaces or '|'")
    parser.add_argument("--batch-size", type=int, default=32, metavar="B", help="contexts per batch")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    return parser


def main(argv=None) -> int:
    return run_decode_command(build_parser, run, argv)


def build_palm_decoding_model(loaded, device: str = "cpu"):
    """The model of a `convert_palm.LoadedPalm`, without dropout, in eval mode (stage 2)."""
    from .models.palm import PalmForPreTraining

    config = replace(loaded.config, padded_vocab_size=0, hidden_dropout=0.0, attention_dropout=0.0)
    model = PalmForPreTraining(config, stage=2)
    missing, unexpected = model.load_state_dict(loaded.state_dict, strict=False)
    if missing or unexpected:
        raise ConfigError(f"{loaded.source}: weights do not fit the PALM model (missing {missing[:4]}, unexpected "
                          f"{unexpected[:4]})")
    return model.to(device).eval()


def run(args: argparse.Namespace) -> int:
    from .generation.search import DecodingConfig, parse_ignore_tokens

    # Everything a user can get wrong is refused before the model is loaded.
    if args.max_context_length < 3:
        raise InputError(f"--max-context-length must be at least 3 ([CLS] x [SEP]), got {args.max_context_length}")
    config = DecodingConfig(beam_size=args.beam_size, length_penalty=args.length_penalty, min_length=args.min_length,
                            max_target_length=args.max_target_length, max_seq_length=args.max_context_length,
                            no_repeat_ngram_size=args.no_repeat_ngram_size,
                            ngram_ignore_tokens=parse_ignore_tokens(args.ngram_ignore_tokens))
    check_batch_and_output(args)
    contexts = read_sources(args.input)

    import torch

    from .generation.decoding import PalmDecoder
    from .training.checkpoint_reader import ConversionError
    from .hf.convert_palm import load_palm
    from .tokenizer import WordPieceTokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available")
    try:
        loaded = load_palm(args.model)
    except ConversionError as error:
        raise ConfigError(str(error)) from None
    tokenizer = WordPieceTokenizer(loaded.vocab_file, lowercase=loaded.do_lower_case)
    model = build_palm_decoding_model(loaded, device)
    decoder = PalmDecoder(model, tokenizer.special, config, token_to_id=tokenizer.token_to_id)
    encoded = encode_sources(contexts, tokenizer)
    print(f"model: {loaded.source} (PALM, {model.config.num_layers} + {model.config.num_decoder_layers} layers, hidden "
          f"{model.config.hidden_size}, on {device}); {'greedy' if config.beam_size == 1 else f'beam {config.beam_size}'}, "
          f"{len(encoded)} contexts (cut to {decoder.max_source_tokens} wordpieces)", file=sys.stderr)

    decode_and_write(decoder, encoded, tokenizer, args, "contexts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
