"""Shared fixtures: paths to the real data in ../shared/data (tests skip when it is absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pmlm_testing import SHARED_DATA, run_module

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data folder {SHARED_DATA} is absent (it ships beside the repository)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def bert_vocab(shared_data) -> Path:
    path = shared_data / "vocab" / "bert-base-uncased-vocab.txt"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return path


@pytest.fixture(scope="session")
def wikitext(shared_data) -> Path:
    path = shared_data / "corpus" / "wikitext-2-valid.txt"
    if not path.is_file():
        pytest.skip(f"{path} is absent")
    return path


@pytest.fixture(scope="session")
def pretraining_samples(tmp_path_factory, wikitext, bert_vocab) -> Path:
    """A small build_samples directory from real text (wikitext slice, bert-base-uncased vocab)."""
    directory = tmp_path_factory.mktemp("pretraining")
    lines = wikitext.read_text(encoding="utf-8")[:150_000].splitlines(keepends=True)
    last_blank = max(i for i, line in enumerate(lines) if not line.strip())  # whole documents only
    corpus = directory / "wiki.txt"
    corpus.write_text("".join(lines[:last_blank + 1]), encoding="utf-8")
    result = run_module("data_prep.preprocess", "--input", str(corpus), "--output-prefix",
                        str(directory / "wiki"), "--vocab-file", str(bert_vocab), "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_module("data_prep.build_samples", "--data-path", str(directory / "wiki"), "--output",
                        str(directory / "samples"), "--seq-length", "64", "--split", "95,5,0",
                        "--mask-epochs", "2", "--seed", "7", "--no-progress")
    assert result.returncode == 0, result.stderr[-3000:]
    return directory / "samples"


@pytest.fixture(scope="session")
def tiny_hf_model(tmp_path_factory, bert_vocab) -> Path:
    """A random tiny PMLM as a Hugging Face folder with the real vocabulary."""
    from megatron_pmlm.config import model_config_from_preset
    from megatron_pmlm.hf.pmlm_adapter import write_hf_folder
    from megatron_pmlm.hf.pmlm_adapter import to_hf_state_dict
    from megatron_pmlm.models.model import PMLMForPreTraining

    config = model_config_from_preset("tiny", vocab_size=30522)
    model = PMLMForPreTraining(config, init_seed=5)
    folder = tmp_path_factory.mktemp("s2s") / "tiny_hf"
    write_hf_folder(folder, to_hf_state_dict(model.state_dict(), config), config, bert_vocab)
    return folder


@pytest.fixture(scope="session")
def qg_pairs(shared_data, tmp_path_factory) -> tuple[Path, Path]:
    src, tgt = shared_data / "qg" / "src-dev.txt", shared_data / "qg" / "tgt-dev.txt"
    if not src.is_file() or not tgt.is_file():
        pytest.skip(f"{src.parent} is absent")
    folder = tmp_path_factory.mktemp("qg")
    for path in (src, tgt):
        lines = path.read_text(encoding="utf-8").splitlines()[:96]
        (folder / path.name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return folder / src.name, folder / tgt.name
