"""DeepSpeed's universal checkpoint for our models: what `ds_to_universal` needs to merge the
tensor-parallel slices (saved with every checkpoint), and the conversion of a ZeRO checkpoint for
a resume on another data-parallel size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

from ..files import write_text_atomically
from ..parallel.deepspeed_import import import_deepspeed
from . import heartbeat
from .checkpoint_files import RUN_STATE_FILE, UNIVERSAL_SUFFIX


def universal_checkpoint_info(embedding_rows: int, parameter_names: list[str]) -> dict[str, Any]:
    """What DeepSpeed's `ds_to_universal` needs to merge this model's tensor-parallel slices: which
    parameters every TP rank holds whole, which are split along their input (row-parallel), and the
    (padded) vocabulary of the word embedding. Everything else is split along dim 0 (column-parallel
    weights and biases, the vocabulary-split softmax bias, the relative bias split by heads).
    Only patterns that name a parameter of this model are listed (DeepSpeed refuses unused ones)."""
    import re

    import_deepspeed()
    from deepspeed.checkpoint import constants

    def used(patterns: list[str]) -> list[str]:
        return [p for p in patterns if any(re.match(p, name) for name in parameter_names)]

    return {
        constants.UNIVERSAL_CHECKPOINT_VERSION_KEY: constants.UNIVERSAL_CHECKPOINT_VERSION_VALUE,
        constants.TP_REPLICATED_PARAMETER_PATTERNS: used([
            # Suffixes only: they name the plain model's parameters (`bert.encoder.layer.N.output...`,
            # `cls.predictions.transform...`) and the pipeline stages' (`N.output...`, `N.transform...`) alike.
            r".*position_embeddings\.weight$", r".*token_type_embeddings\.weight$", r".*LayerNorm\.(weight|bias)$",
            r".*output\.dense\.bias$", r".*transform\.dense\.", r".*pooler\.", r".*seq_relationship\."]),
        constants.PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: used([r".*output\.dense\.weight$"]),
        constants.VOCABULARY_PARAMETER_PATTERNS: used([r".*word_embeddings\.weight$"]),
        constants.ORIGINAL_VOCAB_SIZE: embedding_rows,
    }


def convert_to_universal(tag_dir: Path, log: Callable[[str], None]) -> Path:
    """DeepSpeed's ds_to_universal on one checkpoint, into `<tag>_universal` next to it (written
    under a temporary name and renamed, so an interrupted conversion is redone, never half-used)."""
    import_deepspeed()
    from deepspeed.checkpoint import ds_to_universal

    target = tag_dir.with_name(tag_dir.name + UNIVERSAL_SUFFIX)
    if (target / RUN_STATE_FILE).is_file():
        return target
    staging = tag_dir.with_name(f".{tag_dir.name}{UNIVERSAL_SUFFIX}.tmp")
    import shutil

    shutil.rmtree(staging, ignore_errors=True)
    log(f"converting {tag_dir} to DeepSpeed's universal format in {target}")
    import argparse

    # Each file the converter writes (a parameter's fragment, a merged state) is progress.
    with heartbeat.beat_after_each_call(ds_to_universal, "_save_checkpoint",
                                        f"start-up: universal conversion of {tag_dir.name}"):
        ds_to_universal.main(argparse.Namespace(
            input_folder=str(tag_dir), output_folder=str(staging), num_extract_workers=1, num_merge_workers=1,
            keep_temp_folder=False, strict=True, inject_missing_state=False))
    shutil.copy2(tag_dir / RUN_STATE_FILE, staging / RUN_STATE_FILE)
    for rng_file in tag_dir.glob("rng_state_rank*.pt"):
        shutil.copy2(rng_file, staging / rng_file.name)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    # ds_to_universal names its output folder (our staging name) in `latest_universal`.
    write_text_atomically(tag_dir.parent / "latest_universal", target.name)
    return target
