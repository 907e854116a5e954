"""Shared fixtures: small real slices of ../shared/data/corpus and the bert-base-uncased vocabulary.

The expensive steps (preprocess, build_samples) run once per session on the slices; tests that
change things work on copies in their own tmp_path.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"

# Characters taken from the start of each corpus file (cut back to the last blank line).
SLICE_CHARS = {"wikitext-2-valid.txt": 120_000, "botchan.txt": 40_000, "tinyshakespeare.txt": 40_000}


def slice_text(corpus_dir: Path, name: str, size: int) -> str:
    lines = (corpus_dir / name).read_text(encoding="utf-8")[:size].splitlines(keepends=True)
    blank = [i for i, line in enumerate(lines) if not line.strip()]
    # botchan.txt has no blank line at all: the whole book is one document; cut at a line end.
    return "".join(lines[:blank[-1] + 1] if blank else lines[:-1])


@pytest.fixture(scope="session")
def vocab_file() -> Path:
    path = SHARED_DATA / "vocab" / "bert-base-uncased-vocab.txt"
    if not path.is_file():
        pytest.skip(f"{path} is absent (the real data ships beside the repository in ../shared/data)")
    return path


@pytest.fixture(scope="session")
def corpus_slices(tmp_path_factory) -> list[Path]:
    """Text slices of the three corpora, as files."""
    corpus_dir = SHARED_DATA / "corpus"
    missing = [name for name in SLICE_CHARS if not (corpus_dir / name).is_file()]
    if missing:
        pytest.skip(f"{corpus_dir / missing[0]} is absent (the real corpora ship beside the repository)")
    directory = tmp_path_factory.mktemp("corpus")
    paths = []
    for name, size in SLICE_CHARS.items():
        path = directory / name
        path.write_text(slice_text(corpus_dir, name, size), encoding="utf-8")
        paths.append(path)
    return paths


@pytest.fixture(scope="session")
def tokenized(tmp_path_factory, corpus_slices, vocab_file) -> Path:
    """PREFIX of the three slices preprocessed together (several shards, one worker)."""
    from data_prep.preprocess import PreprocessConfig, run

    prefix = tmp_path_factory.mktemp("tokenized") / "corpus"
    run(PreprocessConfig(inputs=[str(p) for p in corpus_slices], output_prefix=str(prefix),
                         vocab_file=str(vocab_file), shard_size_mb=0.05, progress=False))
    return prefix


@pytest.fixture(scope="session")
def wiki_and_books(tmp_path_factory, corpus_slices, vocab_file) -> tuple[Path, Path]:
    """Two corpora for blending: wikitext alone, and the two books."""
    from data_prep.preprocess import PreprocessConfig, run

    directory = tmp_path_factory.mktemp("blend")
    wiki, books = directory / "wiki", directory / "books"
    run(PreprocessConfig(inputs=[str(corpus_slices[0])], output_prefix=str(wiki),
                         vocab_file=str(vocab_file), progress=False))
    run(PreprocessConfig(inputs=[str(p) for p in corpus_slices[1:]], output_prefix=str(books),
                         vocab_file=str(vocab_file), progress=False))
    return wiki, books


@pytest.fixture(scope="session")
def build_settings() -> dict:
    """The settings of the `built` fixture, for tests that recompute what it stored."""
    return dict(split="90,8,2", seq_length=128, mask_epochs=3, seed=4321, documents_per_chunk=100)


@pytest.fixture(scope="session")
def built(tmp_path_factory, tokenized, build_settings) -> Path:
    """Samples with masks from `tokenized` (seq 128, K=3, split 90,8,2), one worker."""
    from data_prep.build_samples import BuildConfig, build

    output = tmp_path_factory.mktemp("built") / "samples"
    build(BuildConfig(data_path=[str(tokenized)], output=str(output), progress=False, **build_settings))
    return output
