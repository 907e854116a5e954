"""Shared fixtures: paths to the real data in ../shared/data (tests skip when it is absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pmlm_testing import REPO_ROOT, SHARED_DATA, run_module

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
