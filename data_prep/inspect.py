"""Print one sample and its masks: `python -m data_prep.inspect DIR --sample I [--mask-epoch E] [--json]`.

DIR is a build_samples output directory; `--json` prints an object with `input_ids`, `tokens`,
`segment_ids` and `steps` (the factorization order as [start, end) spans over input_ids, in order),
plus the masked positions, the corrupted ids and where the sample comes from. Given a preprocess
PREFIX (PREFIX.bin/.idx) instead, it prints sentence I and the document it belongs to.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

import numpy as np

from megatron_pmlm.config import HelpFormatter, non_negative_int
from megatron_pmlm.data.indexed import IndexedDatasetError, IndexedDatasetReader, idx_path
from megatron_pmlm.data.samples import (METADATA_FILE, PretrainingSamples, SamplesError, get_sample)
from megatron_pmlm.files import exit_quietly_on_closed_pipe
from megatron_pmlm.tokenizer import WordPieceTokenizer


def step_spans(positions: np.ndarray, step_ids: np.ndarray) -> list[list[int]]:
    """[start, end) per factorization step, in step order (each step is one contiguous block)."""
    spans = []
    for step in np.unique(step_ids).tolist():
        at = positions[step_ids == step]
        spans.append([int(at.min()), int(at.max()) + 1])
    return spans


def describe_sample(directory: str, index: int, split: str = "train", mask_epoch: int = 0) -> dict:
    samples = PretrainingSamples(directory, split)
    if not 0 <= index < len(samples):
        raise SamplesError(f"--sample {index} is out of range: the {split} split of {directory} has "
                           f"{len(samples)} samples")
    if not 0 <= mask_epoch < samples.mask_epochs:
        raise SamplesError(f"--mask-epoch {mask_epoch} is out of range: {directory} was built with "
                           f"--mask-epochs {samples.mask_epochs} (0 to {samples.mask_epochs - 1})")
    view = get_sample(samples, index, mask_epoch)
    tokenizer = WordPieceTokenizer(samples.metadata["vocab_file"])
    masks = view.masks
    corpus = samples.metadata["blend"][int(view.row[0])]["prefix"]
    return {
        "split": split, "sample": index, "mask_epoch": mask_epoch,
        "corpus": corpus, "document": int(view.row[1]),
        "input_ids": view.input_ids.tolist(), "tokens": tokenizer.convert_ids_to_tokens(view.input_ids),
        "segment_ids": view.segment_ids.tolist(),
        "steps": step_spans(masks.masked_positions, masks.step_ids),
        "masked_positions": masks.masked_positions.tolist(), "step_ids": masks.step_ids.tolist(),
        "corrupted_ids": masks.corrupted_ids.tolist(),
        "corrupted_tokens": tokenizer.convert_ids_to_tokens(masks.corrupted_ids),
    }


def describe_sentence(prefix: str, index: int) -> dict:
    reader = IndexedDatasetReader(prefix)
    if not 0 <= index < reader.num_sequences:
        raise IndexedDatasetError(f"--sample {index} is out of range: {prefix} has {reader.num_sequences} sentences")
    meta_path = Path(f"{prefix}.json")
    tokenizer = WordPieceTokenizer(json.loads(meta_path.read_text())["vocab_file"]) if meta_path.is_file() else None
    document = int(np.searchsorted(reader.document_indices, index, side="right")) - 1
    ids = reader[index]
    return {"sentence": index, "document": document,
            "document_sentences": [int(reader.document_indices[document]), int(reader.document_indices[document + 1])],
            "input_ids": ids.tolist(),
            "tokens": tokenizer.convert_ids_to_tokens(ids) if tokenizer else None}


def format_sample(info: dict) -> str:
    tokens = info["tokens"]
    lines = [f"{info['split']} sample {info['sample']} (mask epoch {info['mask_epoch']}) from "
             f"{info['corpus']}, document {info['document']}: {len(tokens)} tokens"]
    segment_b = [t for t, s in zip(tokens, info["segment_ids"]) if s == 1]
    segment_a = [t for t, s in zip(tokens, info["segment_ids"]) if s == 0]
    lines.append("A: " + " ".join(segment_a))
    if segment_b:
        lines.append("B: " + " ".join(segment_b))
    corrupted = dict(zip(info["masked_positions"], info["corrupted_tokens"]))
    lines.append(f"factorization order ({len(info['steps'])} steps, {len(corrupted)} masked tokens):")
    for step, (start, end) in enumerate(info["steps"], 1):
        shown = " ".join(corrupted[p] for p in range(start, end))
        lines.append(f"  {step:3d}. [{start}, {end}) {' '.join(tokens[start:end])!r} shown as {shown!r}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep.inspect", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("prefix", help="a build_samples directory (or a preprocess PREFIX)")
    parser.add_argument("--sample", type=non_negative_int, required=True,
                        help="sample index in the split (sentence index for a preprocess PREFIX)")
    parser.add_argument("--mask-epoch", type=non_negative_int, default=0,
                        help="which of the build's --mask-epochs masks")
    parser.add_argument("--split", default="train", choices=("train", "valid", "test"), help="which split")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    try:
        if not (Path(args.prefix) / METADATA_FILE).is_file() and idx_path(args.prefix).is_file():
            info = describe_sentence(args.prefix, args.sample)
            print(json.dumps(info) if args.json else
                  f"sentence {info['sentence']} of document {info['document']}: {' '.join(info['tokens'] or map(str, info['input_ids']))}")
            return 0
        info = describe_sample(args.prefix, args.sample, args.split, args.mask_epoch)
    except (SamplesError, IndexedDatasetError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(info) if args.json else format_sample(info))
    return 0


if __name__ == "__main__":
    sys.exit(exit_quietly_on_closed_pipe(main))
