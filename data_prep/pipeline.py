"""Both offline steps in one call, for the demo and small runs: text -> tokenized corpus -> samples.

`prepare_pretraining_data` is idempotent: a corpus tokenized from the same inputs with the same
vocabulary is reused, and build_samples reuses a build with the same settings, so `make demo`
pays for the preparation once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from data_prep.build_samples import BuildConfig, build
from data_prep.preprocess import PreprocessConfig, file_sha256, run


def prepare_pretraining_data(inputs: Sequence[str | os.PathLike], vocab_file: str | os.PathLike,
                             output_dir: str | os.PathLike, seq_length: int = 512, mask_epochs: int = 10,
                             split: str = "949,50,1", seed: int = 1234, workers: int = 1,
                             short_seq_prob: float = 0.1, progress: bool | None = None) -> Path:
    """Tokenize `inputs` into OUTPUT_DIR/corpus.{bin,idx} and build OUTPUT_DIR/samples; returns the
    samples directory (what `megatron_pmlm.data.build_pretraining_loaders` reads)."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    prefix = output_dir / "corpus"
    inputs = [str(p) for p in inputs]
    meta_path = Path(f"{prefix}.json")
    up_to_date = False
    if meta_path.is_file() and Path(f"{prefix}.bin").is_file() and Path(f"{prefix}.idx").is_file():
        meta = json.loads(meta_path.read_text())
        up_to_date = meta.get("inputs") == inputs and meta.get("vocab_sha256") == file_sha256(vocab_file)
    if not up_to_date:
        run(PreprocessConfig(inputs=inputs, output_prefix=str(prefix), vocab_file=str(vocab_file),
                             workers=workers, overwrite=True, progress=progress))
    samples = output_dir / "samples"
    build(BuildConfig(data_path=[str(prefix)], output=str(samples), split=split, seq_length=seq_length,
                      short_seq_prob=short_seq_prob, mask_epochs=mask_epochs, seed=seed, workers=workers,
                      overwrite=True, progress=progress))
    return samples
