"""What converting either model family to a Hugging Face folder shares (hf/convert.py drives it,
hf/pmlm_adapter.py and hf/palm_adapter.py add each family's parts): the vocabulary a checkpoint was
trained with, the staged output folder, the weights and tokenizer files, the held-out samples
`--verify` compares on and the verification result's verdict."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path

import torch

from ..files import OUTPUT_MARKER, check_output_folder, file_problem, replacing_folder
from ..training.checkpoint_files import LATEST_FILE, RUN_STATE_FILE
from ..training.checkpoint_reader import ConversionError

VERIFY_TOLERANCE = 1e-4


# ------------------------------------------------------------------------------------------------
# Vocabulary
# ------------------------------------------------------------------------------------------------

def read_vocab(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").rstrip("\n").split("\n")


def hf_vocabulary(hf_dir: Path):
    """The folder's vocabulary (tokenizer.folder_vocabulary: vocab.txt, else tokenizer.json), None
    when it has neither; an unusable one is a ConversionError."""
    from ..tokenizer import TOKENIZER_FILE, VOCAB_FILE, VocabularyError, folder_vocabulary

    if not (hf_dir / VOCAB_FILE).is_file() and not (hf_dir / TOKENIZER_FILE).is_file():
        return None
    try:
        return folder_vocabulary(hf_dir)
    except VocabularyError as error:
        raise ConversionError(str(error)) from None


def find_vocab_file(checkpoint, override: str | None) -> Path:
    """--vocab-file, else the checkpoint's own vocab.txt (imports), else the run's data's vocab_file.
    `checkpoint`: either family's (tag_dir, run_state, model_config)."""
    args = checkpoint.run_state.get("args", {})
    if override:
        path = Path(override)
        problem = file_problem(path)
        if problem:
            raise ConversionError(f"--vocab-file {path} {problem}")
    elif (checkpoint.tag_dir / "vocab.txt").is_file():
        path = checkpoint.tag_dir / "vocab.txt"
    else:
        data_path = args.get("data_path")
        if not data_path:
            raise ConversionError(f"{checkpoint.tag_dir / RUN_STATE_FILE} names no data_path to find the vocabulary "
                                  "in: pass --vocab-file")
        metadata_file = Path(data_path) / "metadata.json"
        if not metadata_file.is_file():
            raise ConversionError(f"the run's samples {data_path} are gone ({metadata_file} is missing), so its "
                                  "vocabulary is unknown: pass --vocab-file")
        vocab = json.loads(metadata_file.read_text()).get("vocab_file")
        path = Path(vocab) if vocab else None
        if path is None or not path.is_file():
            raise ConversionError(f"the vocabulary {vocab} named by {metadata_file} does not exist: pass --vocab-file")
    size = len(read_vocab(path))
    if size != checkpoint.model_config.vocab_size:
        raise ConversionError(f"vocabulary {path} has {size} entries, the model {checkpoint.model_config.vocab_size}: "
                              "not the vocabulary this checkpoint was trained with")
    from ..data.samples import recorded_vocab_sha256
    from ..tokenizer import vocabulary_content_problem

    problem = vocabulary_content_problem(path, f"vocabulary {path}", recorded_vocab_sha256(args))
    if problem:
        raise ConversionError(problem)
    return path


# ------------------------------------------------------------------------------------------------
# Writing
# ------------------------------------------------------------------------------------------------

EXPORT_FILES = frozenset({"config.json", "pytorch_model.bin", "model.safetensors", "vocab.txt", "tokenizer.json",
                          "tokenizer_config.json", "special_tokens_map.json", "configuration_pmlm.py",
                          "modeling_pmlm.py", "configuration_palm.py", "modeling_palm.py", OUTPUT_MARKER})
"""Every file a Hugging Face export of ours holds."""


def older_output(folder: Path) -> bool:
    """Whether `folder`, without OUTPUT_MARKER, is still recognisably an output of ours written before
    the marker existed: a checkpoint (`latest` naming a tag with run_state.json, which no other tool
    writes), or an export of a model only this project defines (config.json's model_type pmlm or
    palm) holding nothing but an export's files. A BERT export without the marker is not recognised:
    a downloaded bert-base looks the same."""
    latest = folder / LATEST_FILE
    if latest.is_file():
        tag = latest.read_text(errors="replace").strip()
        return bool(tag) and "/" not in tag and (folder / tag / RUN_STATE_FILE).is_file()
    config = folder / "config.json"
    if not config.is_file() or not {p.name for p in folder.iterdir()} <= EXPORT_FILES:
        return False
    try:
        values = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return False
    return isinstance(values, dict) and values.get("model_type") in ("pmlm", "palm")


def staged_output(destination: Path, overwrite: bool, flag: str = "--output"):
    """A temporary folder next to `destination` (holding OUTPUT_MARKER), renamed to it when the
    block completes (its mode and its files' follow the umask: `files.replacing_folder`). The
    command line checks the destination first (`check_output_folder`, which --overwrite cannot pass
    for a folder not ours); here, for callers replacing a folder of their own (a fine-tuning run's
    hf/), only what is never replaced is refused."""
    check_output_folder(destination, flag, overwrite, recognise=lambda folder: True, error=ConversionError)
    return replacing_folder(destination)


def write_weights(folder: Path, state: dict[str, torch.Tensor], weights_format: str) -> None:
    """model.safetensors or pytorch_model.bin."""
    if weights_format == "safetensors":
        from safetensors.torch import save_file

        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        torch.save(state, folder / "pytorch_model.bin")


def pad_token_id(vocab: list[str]) -> int:
    return vocab.index("[PAD]") if "[PAD]" in vocab else 0


def write_hf_tokenizer(folder: Path, vocab_file: Path, vocab: list[str], do_lower_case: bool,
                       model_max_length: int) -> None:
    """vocab.txt (as trained; s2s-ft reads it), tokenizer.json (the fast tokenizer, so that
    `AutoTokenizer` needs no conversion), tokenizer_config.json and special_tokens_map.json.

    `[P]`, when the vocabulary has it, is an additional special token: never split, never
    lower-cased. The class stays `BertTokenizer` (transformers 5's is the fast one; older versions
    pick BertTokenizerFast from tokenizer.json, or the slow one from vocab.txt)."""
    from tokenizers import BertWordPieceTokenizer

    from ..tokenizer import PSEUDO

    shutil.copyfile(vocab_file, folder / "vocab.txt")
    extra = [PSEUDO] if PSEUDO in vocab else []
    special = {"unk_token": "[UNK]", "sep_token": "[SEP]", "pad_token": "[PAD]", "cls_token": "[CLS]",
               "mask_token": "[MASK]"}
    if extra:
        special["additional_special_tokens"] = extra
    fast = BertWordPieceTokenizer(str(vocab_file), lowercase=do_lower_case)  # adds the present BERT specials
    fast.add_special_tokens(extra)
    (folder / "tokenizer.json").write_text(fast.to_str(pretty=True) + "\n", encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "BertTokenizer", "do_lower_case": do_lower_case,
        "model_max_length": model_max_length, **special}, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def copy_remote_code(folder: Path, names: tuple[str, ...]) -> None:
    here = Path(__file__).resolve().parent
    for name in names:
        shutil.copyfile(here / name, folder / name)


# ------------------------------------------------------------------------------------------------
# Verification
# ------------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Verification:
    """Our model against the Hugging Face one on `samples` samples; each family adds the maximum
    differences it measures (`differences`) and its line."""

    samples: int
    tokens: int
    loss_ours: float
    loss_hf: float
    split: str

    def differences(self) -> list[float]:
        raise NotImplementedError

    @property
    def passed(self) -> bool:
        return all(d <= VERIFY_TOLERANCE for d in self.differences()) and \
            abs(self.loss_ours - self.loss_hf) <= VERIFY_TOLERANCE

    @property
    def kind(self) -> str:
        return "training" if self.split == "train" else "held-out"

    @property
    def verdict(self) -> str:
        return "OK" if self.passed else "FAILED"

    def line(self) -> str:
        raise NotImplementedError


class VerificationFailed(RuntimeError):
    def __init__(self, result: Verification):
        super().__init__(result.line())
        self.result = result


NO_HELD_OUT_NOTE = ("note: {data_path} has no held-out split (its valid and test splits are empty): --verify "
                    "compares on training {noun}, which checks the conversion just as well")


def held_out_samples(data_path: str | os.PathLike, noun: str = "samples", layout: str | None = None):
    """The first non-empty of the valid, test and train splits of `data_path` (training samples when
    no split is held out), and its metadata; with `layout`, samples of another layout are refused."""
    from ..data.samples import PretrainingSamples, SamplesError, read_metadata

    try:
        metadata = read_metadata(data_path)
        if layout == "palm" and metadata.get("layout") != "palm":
            raise ConversionError(f"--verify: {data_path} holds PMLM samples, not PALM pairs")
        for split in ("valid", "test", "train"):
            if metadata["splits"].get(split, {}).get("num_samples", 0) > 0:
                return PretrainingSamples(data_path, split), metadata
    except SamplesError as error:
        raise ConversionError(f"--verify: {error}") from None
    raise ConversionError(f"--verify: {data_path} has no {noun} at all (every split is empty)")
