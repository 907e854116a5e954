"""Generate text with a fine-tuned sequence-to-sequence model, as s2s-ft's decode_seq2seq.py does.

    python -m megatron_pmlm.decode_s2s --model DIR --input src.txt|src.jsonl --output pred.txt
        [--beam-size K] [--length-penalty A] [--min-length N] [--max-target-length N]
        [--no-repeat-ngram-size N [--ngram-ignore-tokens ". , ?"]] [--batch-size B]
        [--fp16|--bf16] [--max-seq-length 512] [--pos-shift] [--device cpu|cuda]
    python -m megatron_pmlm.decode_s2s --model PALM_DIR --input ctx.txt --output out.txt [--max-context-length 400] ...

A PALM model (a `pretrain --model palm` checkpoint or its converted folder) is decoded as
`decode_palm` decodes it, with PALM's defaults (--max-target-length 100, --max-context-length 400);
--fp16, --bf16, --pos-shift and --max-seq-length are for PMLM/UniLM/BERT models.

Input: one source per line, or with a .jsonl file the `src` field of each line (a string, or a
list of wordpieces as s2s-ft also accepts). Output: one line per input, in input order, written
atomically (`-`: standard output, the messages then go to standard error; a FIFO or device is written
through: `megatron_pmlm.files`). SPEC §7.2 gives the exact rules; `megatron_pmlm.generation.decoding` implements them.
A summary's sentences are separated by " [X_SEP] " as the UniLM toolkit writes them (see
`generation.search.detokenize`), where `eval_s2s --benchmark cnndm` (and the toolkit's own evaluation) splits them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import HelpFormatter, non_negative_int
from .files import InputError, exit_quietly_on_closed_pipe
from .training.checkpoint_files import add_no_checksums_argument
from .generation.commands import (PALM_MAX_CONTEXT_LENGTH, PALM_MAX_TARGET_LENGTH, check_batch_and_output,
                                  decode_and_write, encode_sources, read_sources, run_decode_command, run_palm)


def half_matmul_works(device: str) -> bool:
    import torch

    try:
        a = torch.ones(2, 2, dtype=torch.float16, device=device)
        return bool((a @ a).float().sum().item() == 8.0)
    except RuntimeError:
        return False


NOT_FINE_TUNED_WARNING = (
    "warning: --model {model} records no sequence-to-sequence fine-tuning (no s2s_mode or source/target "
    "settings, which finetune_s2s writes): decoding it anyway, but a model never fine-tuned for generation "
    "rarely generates anything useful")
DEFAULT_MAX_TARGET_LENGTH = 128
DEFAULT_MAX_SEQ_LENGTH = 512


def lengths_from_model(args: argparse.Namespace, settings: dict) -> tuple[int, int]:
    """(max target length, max sequence length): the flags, else what the model was fine-tuned with
    (recorded by finetune_s2s), else s2s-ft's defaults."""
    trained_source, trained_target = settings.get("s2s_max_source_length"), settings.get("s2s_max_target_length")
    target = args.max_target_length or trained_target or DEFAULT_MAX_TARGET_LENGTH
    if args.max_seq_length:
        return target, args.max_seq_length
    if trained_source and trained_target:
        return target, int(trained_source) + int(target)
    return target, DEFAULT_MAX_SEQ_LENGTH


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_pmlm.decode_s2s", description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR",
                        help="a Hugging Face folder or a checkpoint directory (fine-tuning --save); a PALM "
                        "model (pretrain --model palm) decodes as with decode_palm")
    parser.add_argument("--input", required=True, type=Path, metavar="FILE",
                        help="sources: text (one per line) or .jsonl (the `src` field of each line)")
    parser.add_argument("--output", required=True, type=Path, metavar="FILE",
                        help="predictions, one line per input ('-': standard output)")
    parser.add_argument("--beam-size", type=int, default=1, metavar="K",
                        help="beam width (default 1 = greedy, s2s-ft's: argmax at every step, ignoring "
                        "--min-length, --no-repeat-ngram-size and --length-penalty, which are beam search only)")
    parser.add_argument("--length-penalty", type=float, default=0.0, metavar="A",
                        help="beam search: rank finished hypotheses by score / ((5 + length) / 6) ** A when A > 0 "
                        "(default 0)")
    parser.add_argument("--min-length", type=int, default=1, metavar="N",
                        help="beam search: no [SEP] before N tokens (default 1)")
    parser.add_argument("--max-target-length", type=int, default=None, metavar="N",
                        help="tokens generated at most, [SEP] included (default: the --max-target-length the "
                        f"model was fine-tuned with, else s2s-ft's {DEFAULT_MAX_TARGET_LENGTH})")
    parser.add_argument("--max-seq-length", type=int, default=None, metavar="N",
                        help="source + target slots; sources are cut to N - 2 - max-target-length wordpieces "
                        "(default: the fine-tuning's source + target lengths, so sources are cut as in "
                        f"training; else s2s-ft's {DEFAULT_MAX_SEQ_LENGTH})")
    parser.add_argument("--no-repeat-ngram-size", type=non_negative_int, default=0, metavar="N",
                        help="beam search: never repeat an n-gram of N tokens (default 0 = off; s2s-ft's "
                        "--forbid_duplicate_ngrams --ngram_size N)")
    parser.add_argument("--ngram-ignore-tokens", default="", metavar="TOKENS",
                        help="tokens exempt from n-gram blocking, separated by spaces or '|', e.g. \". , ?\"")
    parser.add_argument("--batch-size", type=int, default=32, metavar="B", help="sources per batch (default 32)")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true", help="cast the model to float16")
    precision.add_argument("--bf16", action="store_true", help="cast the model to bfloat16")
    parser.add_argument("--pos-shift", action="store_true",
                        help="decode with the position shift (default: when the model's s2s_mode is 'causal')")
    parser.add_argument("--max-context-length", type=int, default=None, metavar="N",
                        help="PALM models: contexts are cut to N - 2 wordpieces ([CLS] and [SEP] added; default "
                        f"{PALM_MAX_CONTEXT_LENGTH})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda when available")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_no_checksums_argument(parser)
    return parser


PMLM_ONLY = (("fp16", "--fp16"), ("bf16", "--bf16"), ("pos_shift", "--pos-shift"), ("max_seq_length", "--max-seq-length"))
"""Options a PALM model does not take."""


def run_palm_model(args: argparse.Namespace) -> int:
    """A PALM model: decode_palm's run, with PALM's defaults."""
    for name, flag in PMLM_ONLY:
        if getattr(args, name):
            raise InputError(f"{flag} is for PMLM/UniLM/BERT models; --model {args.model} is a PALM model "
                             "(encoder-decoder: --max-context-length sets its input length)")
    args.max_target_length = args.max_target_length or PALM_MAX_TARGET_LENGTH
    args.max_context_length = args.max_context_length or PALM_MAX_CONTEXT_LENGTH
    return run_palm(args)


def main(argv=None) -> int:
    return run_decode_command(build_parser, run, argv)


def run(args: argparse.Namespace) -> int:
    from .generation.search import DecodingConfig, parse_ignore_tokens
    from .hf.family import PALM, model_family

    if model_family(args.model) == PALM:
        return run_palm_model(args)
    if args.max_context_length is not None:
        raise InputError(f"--max-context-length is for PALM models; --model {args.model} is a PMLM/UniLM/BERT model "
                         "(--max-seq-length sets its source + target length)")
    # Everything a user can get wrong is refused before the model is loaded.
    target_length, seq_length = lengths_from_model(args, {})
    settings = dict(beam_size=args.beam_size, length_penalty=args.length_penalty, min_length=args.min_length,
                    max_target_length=target_length, max_seq_length=seq_length,
                    no_repeat_ngram_size=args.no_repeat_ngram_size,
                    ngram_ignore_tokens=parse_ignore_tokens(args.ngram_ignore_tokens))
    DecodingConfig(**settings)
    check_batch_and_output(args)
    sources = read_sources(args.input)

    import torch

    from .generation.decoding import Seq2SeqDecoder, build_decoding_model
    from .pretrained import load_model
    from .tokenizer import WordPieceTokenizer

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available")
    if args.fp16 and device == "cpu" and not half_matmul_works("cpu"):
        raise InputError("--fp16: this torch cannot multiply float16 matrices on the CPU; use --bf16 or --device cuda")
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.float32

    loaded = load_model(args.model, args.checksums)
    if not loaded.settings:
        print(NOT_FINE_TUNED_WARNING.format(model=args.model), file=sys.stderr)
    pos_shift = args.pos_shift or loaded.settings.get("s2s_mode") == "causal"
    settings["max_target_length"], settings["max_seq_length"] = lengths_from_model(args, loaded.settings)
    config = DecodingConfig(**settings, pos_shift=pos_shift)
    tokenizer = WordPieceTokenizer(loaded.vocabulary)
    model = build_decoding_model(loaded, config.max_seq_length, dtype, device)
    decoder = Seq2SeqDecoder(model, tokenizer.special, config, loaded.source_type_id, loaded.target_type_id,
                             token_to_id=tokenizer.token_to_id)
    encoded = encode_sources(sources, tokenizer)
    print(f"model: {loaded.source} ({model.config.num_layers} layers, hidden {model.config.hidden_size}, "
          f"{str(dtype).replace('torch.', '')} on {device}); {'position shift (causal mode), ' if pos_shift else ''}"
          f"{'greedy' if config.beam_size == 1 else f'beam {config.beam_size}'}, {len(encoded)} sources "
          f"(cut to {config.max_source_tokens} wordpieces)", file=sys.stderr)

    decode_and_write(decoder, encoded, tokenizer, args, "examples")
    return 0


if __name__ == "__main__":
    sys.exit(exit_quietly_on_closed_pipe(main))
