"""The inputs of the decode commands (decode_s2s, decode_palm): sources read from text or .jsonl,
their wordpiece ids, and the checks made before any model is loaded."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..files import InputError, check_output


def read_sources(path: Path) -> list[str | list[str]]:
    """Sources from a text file (one per line) or a .jsonl file (`src` per line); a final newline is
    optional, empty sources are refused with their line number."""
    if not path.exists():
        raise InputError(f"input file {path} does not exist")
    if not path.is_file():
        raise InputError(f"input {path} is not a file")
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
