"""Load a model for fine-tuning or decoding from whatever a user has: a Hugging Face folder (ours, a
plain BERT, a released UniLMv2 / s2s-ft folder) or a checkpoint directory of ours (pre-training or
fine-tuning `--save`, any parallel layout the converter reads).

The result is our ModelConfig with an unpadded vocabulary, a state dict in our (= Hugging Face BERT)
names, the vocabulary file and lower-casing, plus the seq2seq settings a fine-tuned folder records
(`source_type_id`, `target_type_id`, `s2s_mode`). A PALM model (folder or checkpoint) loads as the
PALM adapter's `LoadedPalm`; `family` says which ("pmlm", "palm").
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .config import ConfigError, ModelConfig
from .files import read_json
from .data.samples import recorded_vocab_sha256
from .tokenizer import (Vocabulary, VocabularyError, folder_vocabulary, read_vocabulary_file,
                        vocabulary_content_problem)
from .training.checkpoint_files import LATEST_FILE

HF_EXPORT_DIR = "hf"
"""A fine-tuning `--save` directory keeps its Hugging Face export here."""
SETTINGS = ("source_type_id", "target_type_id", "s2s_mode", "s2s_max_source_length", "s2s_max_target_length")
"""Seq2seq settings a fine-tuned model records (config.json, or run_state.json's args)."""


@dataclass
class LoadedModel:
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]
    vocabulary: Vocabulary
    """Its WordPiece vocabulary and lower-casing (tokenizer.folder_vocabulary for a folder)."""
    source: str
    """What was read, for logs."""
    settings: dict[str, Any] = field(default_factory=dict)
    """Seq2seq settings recorded with the model: source_type_id, target_type_id, s2s_mode."""
    family: str = "pmlm"

    @property
    def vocab_file(self) -> Path | None:
        """The vocab.txt the vocabulary was read from; None when it came from a tokenizer.json."""
        return self.vocabulary.file

    @property
    def do_lower_case(self) -> bool:
        return self.vocabulary.do_lower_case

    @property
    def source_type_id(self) -> int:
        return int(self.settings.get("source_type_id", 0))

    @property
    def target_type_id(self) -> int:
        return int(self.settings.get("target_type_id", 1))


def load_model(path: str | os.PathLike, checksums: bool = True):
    """A Hugging Face folder, or a checkpoint directory (its export when it is up to date; else the
    checkpoint, its files checked against its manifest unless `checksums` is False: see
    checkpoint_reader.resolve_tag): a LoadedModel, or for a PALM model the PALM adapter's
    LoadedPalm (`family` tells them apart)."""
    from .hf.family import PALM, model_family
    from .training.checkpoint_reader import ConversionError

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"--model {path} does not exist")
    if model_family(path) == PALM:
        from .hf.palm_adapter import load_palm

        try:
            return load_palm(path, checksums)
        except ConversionError as error:
            raise ConfigError(str(error)) from None
    if (path / "config.json").is_file():
        return load_hf_folder(path)
    if (path / LATEST_FILE).is_file():
        export = path / HF_EXPORT_DIR
        latest = (path / LATEST_FILE).read_text().strip()
        if (export / "config.json").is_file():
            with contextlib.suppress(json.JSONDecodeError, OSError):
                if json.loads((export / "config.json").read_text()).get("checkpoint_tag") == latest:
                    return load_hf_folder(export)
        try:
            return load_checkpoint_dir(path, checksums)
        except ConversionError as error:
            raise ConfigError(str(error)) from None
    raise ConfigError(f"--model {path} is neither a Hugging Face folder (no config.json) nor a checkpoint "
                      f"directory (no '{LATEST_FILE}' file)")


def vocabulary_problem(vocabulary: Vocabulary | None, vocab_size: int, source: str,
                       recorded_sha256: str | None = None) -> str | None:
    """Why `vocabulary` is not the one of a model whose embedding has `vocab_size` rows (None: it
    is): another size, or, where the model records its vocabulary's sha256, other content. The one
    check of finetune_s2s, decode_s2s, finetune_glue/squad and evaluate_downstream."""
    size = len(vocabulary.tokens)
    if size != vocab_size:
        return f"{source} has {size} entries but the model's embedding has {vocab_size} rows: not this model's vocabulary"
    return vocabulary_content_problem(vocabulary.file, source, recorded_sha256)


def check_vocabulary(vocabulary: Vocabulary, vocab_size: int, recorded_sha256: str | None = None) -> None:
    problem = vocabulary_problem(vocabulary, vocab_size, str(vocabulary.source), recorded_sha256)
    if problem:
        raise ConfigError(problem)


def load_hf_folder(folder: Path) -> LoadedModel:
    from .hf.pmlm_adapter import from_hf_state_dict, model_config_from_hf, read_hf_weights
    from .training.checkpoint_reader import ConversionError

    config_file = folder / "config.json"
    hf = read_json(config_file, ConfigError, missing="not a Hugging Face model folder")
    try:
        config = model_config_from_hf(hf, str(config_file), padded_vocab_size=0)
        vocabulary = folder_vocabulary(folder)
        check_vocabulary(vocabulary, config.vocab_size)
        state, _ = from_hf_state_dict(read_hf_weights(folder), config, str(folder))
    except (ConversionError, VocabularyError) as error:
        raise ConfigError(str(error)) from None
    settings = {k: hf[k] for k in SETTINGS if k in hf}
    return LoadedModel(config, state, vocabulary, f"Hugging Face folder {folder}", settings)


def load_checkpoint_dir(directory: Path, checksums: bool = True) -> LoadedModel:
    from .hf.folder import find_vocab_file
    from .hf.pmlm_adapter import to_hf_state_dict
    from .training.checkpoint_reader import load_pretraining_checkpoint

    checkpoint = load_pretraining_checkpoint(directory, checksums=checksums)
    args = checkpoint.run_state.get("args", {})
    if args.get("vocab_file") and Path(args["vocab_file"]).is_file():
        vocab_file = Path(args["vocab_file"])
    else:
        vocab_file = find_vocab_file(checkpoint, None)
    try:
        vocabulary = read_vocabulary_file(vocab_file, bool(args.get("do_lower_case", True)))
    except VocabularyError as error:
        raise ConfigError(str(error)) from None
    check_vocabulary(vocabulary, checkpoint.model_config.vocab_size, recorded_vocab_sha256(args))
    config = replace(checkpoint.model_config, padded_vocab_size=0)
    state = to_hf_state_dict(checkpoint.state_dict, checkpoint.model_config)  # vocabulary padding cut
    settings = {k: args[k] for k in SETTINGS if k in args}
    return LoadedModel(config, state, vocabulary, f"checkpoint {checkpoint.tag_dir} ({checkpoint.layout})", settings)


def resize_position_embeddings(state: dict[str, torch.Tensor], rows: int) -> dict[str, torch.Tensor]:
    """s2s-ft's `reuse_position_embedding`: a longer table repeats the trained rows (row k = old
    row k mod old rows); a table is never shrunk here (longer inputs are refused elsewhere)."""
    name = "bert.embeddings.position_embeddings.weight"
    table = state[name]
    if rows <= table.shape[0]:
        return state
    index = torch.arange(rows) % table.shape[0]
    return {**state, name: table[index].clone()}
