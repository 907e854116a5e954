"""Shared fixtures: paths to the real data in ../shared/data (tests skip when it is absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"

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
