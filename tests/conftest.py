"""Shared fixtures: paths to the real data in ../shared/data (tests skip when it is absent)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pmlm_testing import SHARED_DATA, run_module

os.environ.setdefault("DS_ACCELERATOR", "cpu")

LONGEST_FILES = [
    "test_distributed.py", "test_compile.py", "test_slurm.py", "test_bucket_attention.py", "test_slurm_multinode.py",
    "test_gpu_check.py", "test_finetune_s2s.py", "test_relayout.py", "test_files.py", "test_clean_exit.py",
    "test_tracking.py", "test_glue_squad.py", "test_bucket_sums.py", "test_unilm.py", "test_flex_attention.py",
]
"""The test files that take longest, longest first (paths under tests/; the sums of a whole-suite
`--durations` run, docs/benchmarks.md). `make test` (pytest-xdist, --dist loadfile: a file's tests
stay on one worker) starts them first, so that the run ends on short files instead of one long file
running alone on one worker while the other has finished. Only the order changes; every file not
named keeps its place after them. Refresh it when a file's time changes much."""


def pytest_configure(config):
    """xdist queues the files of --dist loadfile by their test count (--loadscope-reorder, its
    default), which puts the few-but-long SLURM files last; keep the collection order instead."""
    if getattr(config.option, "dist", "no") in ("loadfile", "loadscope"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """The files of LONGEST_FILES first (in that order), each file's tests in their own order."""
    rank = {name: position for position, name in enumerate(LONGEST_FILES)}
    tests = Path(__file__).parent

    def position(item) -> int:
        name = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else None
        return rank.get(name, len(LONGEST_FILES))

    items.sort(key=position)


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
def palm_samples(pretraining_samples, tmp_path_factory) -> Path:
    """PALM pairs (contexts <= 48, continuations <= 16 tokens) from the tokenized wikitext slice
    behind the PMLM samples (tests/test_palm.py builds its own, checking the build is deterministic)."""
    output = tmp_path_factory.mktemp("palm_pairs") / "samples"
    result = run_module("data_prep.build_samples", "--layout", "palm", "--data-path",
                        str(pretraining_samples.parent / "wiki"), "--context-length", "48", "--continuation-length",
                        "16", "--split", "95,5,0", "--mask-epochs", "2", "--seed", "7", "--no-progress",
                        "--output", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    return output


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
