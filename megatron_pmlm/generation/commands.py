"""What the decode commands (decode_s2s, decode_palm) share: their main (one `error:` line and exit
status 2 for bad input), the sources read from text or .jsonl and their wordpiece ids, the checks
made before any model is loaded, decoding in batches with a progress bar into the output, and the
PALM run (`run_palm`: decode_palm's, and decode_s2s's for a PALM model)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

from ..config import ConfigError
from ..files import InputError, check_output, file_problem, logs_to_stderr, quiet_libraries, write_text_atomically

PALM_MAX_TARGET_LENGTH = 100
"""PALM's continuations: at most 100 tokens (§3.1)."""
PALM_MAX_CONTEXT_LENGTH = 400
"""PALM's contexts: at most 400 tokens, [CLS] and [SEP] included."""


def run_decode_command(build_parser: Callable[[], argparse.ArgumentParser],
                       run: Callable[[argparse.Namespace], int], argv=None) -> int:
    """A decode command's main: parse and run, messages to standard error when the output is `-`;
    bad input is one `error:` line and exit status 2."""
    quiet_libraries()
    args = build_parser().parse_args(argv)
    try:
        with logs_to_stderr(args.output):
            return run(args)
    except (ConfigError, InputError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def read_sources(path: Path) -> list[str | list[str]]:
    """Sources from a text file (one per line) or a .jsonl file (`src` per line); a final newline is
    optional, empty sources are refused with their line number."""
    problem = file_problem(path)
    if problem:
        raise InputError(f"input file {path} {problem}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"input file {path} is not UTF-8 text (byte {error.start})") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    if not lines:
        raise InputError(f"input file {path} is empty")
    is_jsonl = path.suffix.lower() == ".jsonl"
    sources: list[str | list[str]] = []
    for number, line in enumerate(lines, 1):
        line = line.rstrip("\r")
        if not line.strip():
            raise InputError(f"{path} line {number}: empty source")
        if not is_jsonl:
            sources.append(line)
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise InputError(f"{path} line {number}: not JSON ({error.msg})") from None
        if not isinstance(record, dict) or "src" not in record:
            raise InputError(f"{path} line {number}: no `src` field")
        source = record["src"]
        is_tokens = isinstance(source, list) and all(isinstance(t, str) for t in source)
        if not (isinstance(source, str) or is_tokens):
            raise InputError(f"{path} line {number}: `src` must be a string or a list of wordpieces")
        if not source or (isinstance(source, str) and not source.strip()):
            raise InputError(f"{path} line {number}: empty source")
        sources.append(source)
    return sources


def encode_sources(sources: list[str | list[str]], tokenizer) -> list[list[int]]:
    """Wordpiece ids (no specials); pre-tokenized sources map unknown pieces to [UNK], as s2s-ft."""
    texts = [(i, s) for i, s in enumerate(sources) if isinstance(s, str)]
    encoded: list[list[int]] = [[] for _ in sources]
    for (index, _), ids in zip(texts, tokenizer.encode_batch([s for _, s in texts])):
        encoded[index] = ids.tolist()
    for index, source in enumerate(sources):
        if isinstance(source, list):
            encoded[index] = [tokenizer.special.unk if (i := tokenizer.token_to_id(t)) is None else i for t in source]
    return encoded


def check_batch_and_output(args: argparse.Namespace) -> None:
    """--batch-size and --output, refused before any model is loaded (decode_s2s and decode_palm)."""
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {args.batch_size}")
    check_output(args.output)  # an OutputError is a ValueError: one line, exit 2


def decode_and_write(decoder, encoded: list[list[int]], tokenizer, args: argparse.Namespace, noun: str) -> None:
    """Decode `encoded` (--batch-size at a time, a progress bar unless --no-progress), write one
    detokenized line per input to --output, and report the speed."""
    from tqdm import tqdm

    from .decoding import decode_in_batches
    from .search import detokenize, generated_length

    started = time.perf_counter()
    with tqdm(total=len(encoded), unit="ex", disable=args.no_progress, file=sys.stderr, dynamic_ncols=True) as bar:
        outputs = decode_in_batches(decoder, encoded, args.batch_size, progress=bar.update)
    seconds = time.perf_counter() - started
    lines = [detokenize(tokenizer.convert_ids_to_tokens(ids)) for ids in outputs]
    write_text_atomically(args.output, "".join(line + "\n" for line in lines))
    tokens = sum(generated_length(ids, {tokenizer.special.sep, tokenizer.special.pad}) for ids in outputs)
    print(f"decoded {len(lines)} {noun} in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s, {tokens} "
          f"tokens); wrote {args.output}")


def run_palm(args: argparse.Namespace) -> int:
    """Continue the contexts of --input with the PALM model of --model (decode_palm, and decode_s2s
    given a PALM model)."""
    from .search import DecodingConfig, parse_ignore_tokens

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

    from ..hf.family import PALM, check_family, wrong_family
    from ..pretrained import load_model
    from ..tokenizer import WordPieceTokenizer
    from .decoding import PalmDecoder, build_palm_decoding_model

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available")
    check_family("--model", args.model, "decode_palm", takes=PALM)  # before the weights are read
    loaded = load_model(args.model, args.checksums)
    if loaded.family != PALM:
        raise ConfigError(wrong_family("--model", args.model, loaded.family, "decode_palm", takes=PALM))
    tokenizer = WordPieceTokenizer(loaded.vocab_file, lowercase=loaded.do_lower_case)
    model = build_palm_decoding_model(loaded, device)
    decoder = PalmDecoder(model, tokenizer.special, config, token_to_id=tokenizer.token_to_id)
    encoded = encode_sources(contexts, tokenizer)
    print(f"model: {loaded.source} (PALM, {model.config.num_layers} + {model.config.num_decoder_layers} layers, hidden "
          f"{model.config.hidden_size}, on {device}); {'greedy' if config.beam_size == 1 else f'beam {config.beam_size}'}, "
          f"{len(encoded)} contexts (cut to {decoder.max_source_tokens} wordpieces)", file=sys.stderr)

    decode_and_write(decoder, encoded, tokenizer, args, "contexts")
    return 0
