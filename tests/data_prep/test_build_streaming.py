"""build_samples in bounded memory (issue 36): the streamed build writes the very bytes the
in-memory build of before wrote (pinned digests, and an in-memory reference blend computed here),
and neither the blend, the packing nor the task queue holds an array or list of every sample."""

from __future__ import annotations

import hashlib
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from data_prep import build_samples
from data_prep.build_samples import BuildConfig, build
from megatron_pmlm.data.text_data import pack_sentences

SPLIT_FILES = ("samples", "mask_offsets", "mask_positions", "mask_steps", "mask_corrupted")

# sha256 over every split's .bin files (in SPLIT_FILES order) as the in-memory build of commit
# 86df4f5 (before issue 36) wrote them for the settings of each case below.
GOLDEN = {
    "pmlm": "febee99c1e94087faec4d310dccf80b1c4f7a0d4beca24258acfc031739af359",
    "blend": "d0c457875c67b3d1dfc428d221d21303a6f9c198b6d0f1bd858a6c724b5b3108",
    "palm": "afc21f6624452b99bfbca18b08374727c92dd32f2964c88e9b5802fc1221e3ac",
}


def outputs_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for split in ("train", "valid", "test"):
        for name in SPLIT_FILES:
            path = folder / split / f"{name}.bin"
            digest.update(f"{split}/{name}:".encode())
            digest.update(path.read_bytes() if path.exists() else b"absent")
    return digest.hexdigest()


def _cases(tokenized: Path, wiki_and_books: tuple[Path, Path]) -> dict[str, dict]:
    wiki, books = wiki_and_books
    return {
        "pmlm": dict(data_path=[str(tokenized)], split="90,8,2", seq_length=128, mask_epochs=2, seed=5,
                     documents_per_chunk=50),
        # Oversampled books (several shuffled passes), small tasks: many blend windows and mask tasks.
        "blend": dict(data_path=["0.3", str(wiki), "0.7", str(books)], split="95,5", seq_length=64, mask_epochs=1,
                      seed=11, num_samples=[900, 40], workers=2, samples_per_task=64),
        "palm": dict(data_path=[str(tokenized)], split="90,8,2", seq_length=96, mask_epochs=1, seed=3,
                     layout="palm", continuation_length=40),
    }


@pytest.mark.parametrize("case, block_sentences", [("pmlm", None), ("pmlm", 7), ("blend", None), ("palm", None),
                                                    ("palm", 7)])
def test_outputs_are_the_in_memory_builds_bytes(tmp_path, tokenized, wiki_and_books, case, block_sentences,
                                                 monkeypatch):
    """Also with packing blocks of a few sentences (in-process builds: a spawned worker would not see it)."""
    settings = _cases(tokenized, wiki_and_books)[case]
    if block_sentences:
        monkeypatch.setattr(build_samples, "PACK_BLOCK_SENTENCES", block_sentences)
    build(BuildConfig(output=str(tmp_path / case), progress=False, **settings))
    assert outputs_digest(tmp_path / case) == GOLDEN[case]


def reference_blend(rows_per_corpus: list[np.ndarray], counts: np.ndarray, seed: int, split_id: int) -> np.ndarray:
    """The in-memory blend build_samples used before issue 36: every pick, one global stable argsort."""
    chosen, keys = [], []
    for corpus, (rows, count) in enumerate(zip(rows_per_corpus, counts.tolist())):
        if count == 0:
            continue
        rng = np.random.default_rng([seed, split_id, corpus, 7])
        passes = -(-count // len(rows))
        picks = np.concatenate([rng.permutation(len(rows)) for _ in range(passes)])[:count]
        chosen.append(rows[picks])
        keys.append((np.arange(count) + 0.5) / count)
    if not chosen:
        return np.zeros((0, 6), dtype=np.int64)
    return np.concatenate(chosen)[np.argsort(np.concatenate(keys), kind="stable")]


@pytest.mark.parametrize("sizes, counts", [([700, 300, 5], [1000, 250, 17]), ([50, 0, 9], [13, 0, 200]),
                                           ([1], [3]), ([4000], [4000]), ([30, 30], [0, 0])])
@pytest.mark.parametrize("window", [1, 7, 1024])
def test_streamed_blend_is_the_in_memory_blend(tmp_path, sizes, counts, window):
    rng = np.random.default_rng(0)
    natural = [rng.integers(0, 1 << 40, size=(n, 6)) for n in sizes]
    expected = reference_blend(natural, np.array(counts), seed=9, split_id=1)
    streamed = list(build_samples.blended_windows(natural, np.array(counts), 9, 1, tmp_path, window))
    got = np.concatenate(streamed) if streamed else np.zeros((0, 6), np.int64)
    np.testing.assert_array_equal(got, expected)
    assert all(len(part) <= window + len(sizes) for part in streamed)
    assert not list(tmp_path.iterdir()), "the picks files are removed"


def _traced_peak(function) -> int:
    """tracemalloc's peak (numpy's buffers included; pages of memory maps are not) while `function` runs."""
    tracemalloc.start()
    try:
        function()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_blend_holds_no_array_of_every_samples_rows(tmp_path):
    """A 2-corpus blend of 400,000 samples from memory-mapped rows: the streamed blend holds the
    picks of one pass (8 bytes a sample) and a window; the in-memory one every row several times."""
    sizes, counts = [150_000, 50_000], np.array([300_000, 100_000])
    natural = []
    for corpus, size in enumerate(sizes):
        path = tmp_path / f"natural-{corpus}.bin"
        np.arange(size * 6, dtype=np.int64).tofile(path)
        natural.append(np.memmap(path, dtype=np.int64, mode="r", shape=(size, 6)))
    total = int(counts.sum())
    bound = 10 * total + (1 << 20)

    def stream() -> None:
        for window in build_samples.blended_windows(natural, counts, 3, 0, tmp_path, 4096):
            assert len(window) <= 4096 + 2

    assert _traced_peak(stream) < bound
    assert _traced_peak(lambda: reference_blend(natural, counts, 3, 0)) > 4 * bound  # what the test guards against


def test_packing_holds_no_python_list_of_every_sentence():
    """pack_sentences over a chunk of 100,000 sentences: its peak is the rows (48 bytes a sample) and
    one document's lists, not ~100 bytes of Python ints per sentence of the chunk."""
    rng = np.random.default_rng(0)
    sentences_per_document = rng.integers(5, 60, size=3_000)
    lengths = rng.integers(5, 40, size=int(sentences_per_document.sum()))
    bounds = np.concatenate([[0], np.cumsum(sentences_per_document)])
    rows = []
    peak = _traced_peak(lambda: rows.append(pack_sentences(lengths, np.cumsum(lengths) - lengths, bounds,
                                                           np.arange(3_000), 512, np.random.default_rng(1))))
    assert len(lengths) > 90_000 and len(rows[0]) > 5_000
    assert peak < 64 * len(rows[0]) + (1 << 20), peak


def test_tasks_are_drawn_at_most_a_window_ahead():
    """The pool gets tasks lazily: never more than IN_FLIGHT_PER_WORKER x workers ahead of the
    consumer, so tasks and finished results do not pile up (the pool's imap buffers every result)."""
    drawn = []

    def tasks():
        for index in range(40):
            drawn.append(index)
            yield "x" * index

    workers, ahead = 2, []
    results = []
    for result in build_samples._run_tasks(len, tasks(), 40, workers, "test", False):
        results.append(result)
        ahead.append(len(drawn) - len(results))
    assert results == list(range(40))
    assert max(ahead) <= build_samples.IN_FLIGHT_PER_WORKER * workers


def test_document_blocks_cover_the_chunk_in_bounded_blocks(tokenized, monkeypatch):
    from megatron_pmlm.data.indexed import IndexedDatasetReader

    reader = IndexedDatasetReader(tokenized)
    ends = np.asarray(reader.document_indices)
    monkeypatch.setattr(build_samples, "PACK_BLOCK_SENTENCES", 40)
    low, high = 3, reader.num_documents - 2
    blocks = list(build_samples._document_blocks(reader, low, high))
    assert len(blocks) > 3 and blocks[0][0] == low and blocks[-1][1] == high
    for (first, end, sentence), following in zip(blocks, blocks[1:] + [(high, None, None)]):
        assert end == following[0] and sentence == ends[first]  # contiguous, none skipped
        assert ends[end] - ends[first] <= 40 or end == first + 1  # bounded, or one long document


def test_reader_checks_document_order_block_by_block(tmp_path, monkeypatch):
    """The reader's check of the document indices runs in blocks (no whole-corpus temporary), and
    still finds a decrease anywhere, a block boundary included."""
    from megatron_pmlm.data import indexed

    monkeypatch.setattr(indexed, "CHECK_BLOCK_ENTRIES", 4)
    prefix = tmp_path / "c"
    lengths = np.full(20, 3)
    indexed.bin_path(prefix).write_bytes(np.zeros(60, np.uint16).tobytes())
    good = np.arange(0, 21, 2)
    indexed.write_index(indexed.idx_path(prefix), np.uint16, lengths, good)
    assert indexed.IndexedDatasetReader(prefix).num_documents == 10
    for where in (3, 4, 5, 8):  # inside a block, and across the boundary between two
        bad = good.copy()
        bad[where] = bad[where + 1] + 1
        indexed.write_index(indexed.idx_path(prefix), np.uint16, lengths, bad)
        with pytest.raises(indexed.IndexedDatasetError, match=r"c\.idx: inconsistent document indices"):
            indexed.IndexedDatasetReader(prefix)
