"""Input corpora as deterministic shards of documents: plain text, JSONL and Hugging Face datasets.

A shard is a byte range of a text/JSONL file (cut at a document boundary), a row range of a
`datasets` table, or one parquet file. The shard list depends only on the inputs and the shard
size, so every rank of a multi-node run computes the same list and takes its share.

Invalid UTF-8 is replaced by U+FFFD and counted (or refused with `strict_utf8`, naming file and
line); a malformed JSONL line or one without the key is an error naming file and line, or is
counted and skipped with `skip_bad_lines`.
"""

from __future__ import annotations

import codecs
import glob
import json
import mmap
import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

from megatron_pmlm.files import InputError

TEXT, JSONL, HF_DISK, ARROW, PARQUET = "text", "jsonl", "hf_disk", "arrow", "parquet"
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclass(frozen=True)
class Shard:
    kind: str
    path: str
    start: int
    """Byte offset (text, JSONL) or row (datasets) where the shard begins."""
    end: int
    """Exclusive end; -1 for a whole parquet file."""
    split: str = ""
    """The split of a saved DatasetDict, else empty."""

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class ReadStats:
    """What reading a shard met besides documents; merged into the run summary."""

    bad_lines: int = 0
    invalid_utf8: int = 0
    """Invalid UTF-8 byte sequences replaced by U+FFFD."""
    invalid_utf8_files: dict[str, int] = field(default_factory=dict)


def resolve_inputs(inputs: list[str]) -> list[tuple[str, Path]]:
    """(kind, path) for every input, globs expanded, in a sorted deterministic order per argument."""
    resolved: list[tuple[str, Path]] = []
    for pattern in inputs:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        if not matches or not all(os.path.exists(m) for m in matches):
            raise InputError(f"input not found: {pattern}")
        for match in matches:
            path = Path(match)
            if path.is_dir():
                if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
                    resolved.append((HF_DISK, path))
                    continue
                files = sorted(p for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))
                if not files:
                    raise InputError(f"input directory is empty: {path}")
                resolved.extend((_kind_of_file(p), p) for p in files)
            else:
                resolved.append((_kind_of_file(path), path))
    if not resolved:
        raise InputError("no input given")
    return resolved


def _kind_of_file(path: Path) -> str:
    name = path.name.lower()
    if name.endswith(_JSONL_SUFFIXES):
        return JSONL
    if name.endswith(".parquet"):
        return PARQUET
    if name.endswith(".arrow"):
        return ARROW
    return TEXT


def plan_shards(inputs: list[tuple[str, Path]], shard_bytes: int) -> list[Shard]:
    """Cut the inputs into shards of about `shard_bytes`, at document (text) or line (JSONL) ends."""
    shards: list[Shard] = []
    for kind, path in inputs:
        if kind in (TEXT, JSONL):
            separator = _BLANK_LINE if kind == TEXT else _LINE_END
            for start, end in _byte_ranges(path, shard_bytes, separator):
                shards.append(Shard(kind, str(path), start, end))
        elif kind == PARQUET:
            shards.append(Shard(kind, str(path), 0, -1))
        else:
            for split, dataset in _open_datasets(kind, path):
                rows = len(dataset)
                nbytes = max(1, dataset.data.nbytes)
                rows_per_shard = max(1, int(rows * shard_bytes / nbytes))
                for start in range(0, rows, rows_per_shard):
                    shards.append(Shard(kind, str(path), start, min(rows, start + rows_per_shard), split))
    return shards


# A blank line (whitespace only, as `line.strip()` sees it in ASCII) ends a text document.
_BLANK_LINE = re.compile(rb"\n[ \t\r\f\v]*\n")
_LINE_END = re.compile(rb"\n")


def _byte_ranges(path: Path, shard_bytes: int, separator: re.Pattern) -> list[tuple[int, int]]:
    """Byte ranges of about shard_bytes, each cut just after a separator (a document end)."""
    size = path.stat().st_size
    if size == 0:
        return []
    if size <= shard_bytes:
        return [(0, size)]
    cuts = [0]
    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        target = shard_bytes
        while target < size:
            found = separator.search(data, max(target, cuts[-1]))
            if found is None:
                break
            cut = found.end()
            if cut >= size:
                break
            cuts.append(cut)
            target = cut + shard_bytes
    cuts.append(size)
    return list(zip(cuts[:-1], cuts[1:]))


def _open_datasets(kind: str, path: Path):
    """(split name, Dataset) pairs of a save_to_disk folder or an .arrow file, memory-mapped."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    if kind == ARROW:
        return [("", datasets.Dataset.from_file(str(path)))]
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        return [(name, loaded[name]) for name in sorted(loaded)]
    return [("", loaded)]


class _Utf8Policy:
    """Decodes bytes strictly; on invalid UTF-8 either refuses (naming file and line) or replaces
    and counts. The fast path is one strict decode; only bad input pays for the fallback."""

    def __init__(self, strict: bool, stats: ReadStats, path: str):
        self.strict, self.stats, self.path = strict, stats, path

    def decode(self, raw: bytes, line_of_error) -> str:
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as error:
            if self.strict:
                raise InputError(
                    f"{self.path}, line {line_of_error(error.start)}: invalid UTF-8 "
                    f"(rerun without --strict-utf8 to replace and count it)") from None
        counter = [0]

        def replace(error: UnicodeDecodeError):
            counter[0] += 1
            return "\ufffd", error.end

        handler_name = "pmlm_count_replace"
        codecs.register_error(handler_name, replace)
        text = raw.decode("utf-8", errors=handler_name)
        self.stats.invalid_utf8 += counter[0]
        self.stats.invalid_utf8_files[self.path] = self.stats.invalid_utf8_files.get(self.path, 0) + counter[0]
        return text


def _line_number(path: str, byte_offset: int) -> int:
    """1-based line number of a byte offset; only computed when reporting an error."""
    newlines, remaining = 0, byte_offset
    with open(path, "rb") as handle:
        while remaining > 0:
            block = handle.read(min(remaining, 64 << 20))
            if not block:
                break
            newlines += block.count(b"\n")
            remaining -= len(block)
    return newlines + 1


def iter_documents(shard: Shard, stats: ReadStats, json_key: str = "text",
                   skip_bad_lines: bool = False, strict_utf8: bool = False) -> Iterator[tuple[str, int]]:
    """(document text, its size in bytes) for each document of the shard."""
    if shard.kind == TEXT:
        yield from _text_documents(shard, stats, strict_utf8)
    elif shard.kind == JSONL:
        yield from _jsonl_documents(shard, stats, json_key, skip_bad_lines, strict_utf8)
    else:
        yield from _dataset_documents(shard, json_key)


def _text_documents(shard: Shard, stats: ReadStats, strict_utf8: bool) -> Iterator[tuple[str, int]]:
    """Runs of non-blank lines separated by blank lines, as `text_data.read_text_documents`."""
    policy = _Utf8Policy(strict_utf8, stats, shard.path)
    with open(shard.path, "rb") as handle:
        handle.seek(shard.start)
        position = shard.start
        lines: list[bytes] = []
        doc_start = position
        for line in handle:
            if position >= shard.end:
                break
            if line.strip():
                if not lines:
                    doc_start = position
                lines.append(line)
            elif lines:
                raw = b"".join(lines)
                yield policy.decode(raw, lambda at, s=doc_start: _line_number(shard.path, s + at)), len(raw)
                lines = []
            position += len(line)
        if lines:
            raw = b"".join(lines)
            yield policy.decode(raw, lambda at, s=doc_start: _line_number(shard.path, s + at)), len(raw)


def _jsonl_documents(shard: Shard, stats: ReadStats, json_key: str, skip_bad_lines: bool,
                     strict_utf8: bool) -> Iterator[tuple[str, int]]:
    policy = _Utf8Policy(strict_utf8, stats, shard.path)
    with open(shard.path, "rb") as handle:
        handle.seek(shard.start)
        position = shard.start
        for raw in handle:
            if position >= shard.end:
                break
            line_start = position
            position += len(raw)
            if not raw.strip():
                continue
            line_no = lambda at=0, s=line_start: _line_number(shard.path, s + at)  # noqa: E731
            problem = None
            try:
                record = json.loads(policy.decode(raw, line_no))
            except json.JSONDecodeError as error:
                problem = f"malformed JSON ({error.msg})"
            else:
                if not isinstance(record, dict) or json_key not in record:
                    keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
                    problem = f"no key {json_key!r} (has: {keys}); choose the key with --json-key"
                elif not isinstance(record[json_key], str):
                    problem = f"key {json_key!r} is not a string"
            if problem:
                if not skip_bad_lines:
                    raise InputError(f"{shard.path}, line {line_no()}: {problem} "
                                     f"(--skip-bad-lines counts and skips such lines)")
                stats.bad_lines += 1
                continue
            yield record[json_key], len(raw)


def _dataset_documents(shard: Shard, json_key: str) -> Iterator[tuple[str, int]]:
    """Rows of a `datasets` table, 1,000 at a time (parquet streamed, arrow memory-mapped)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    if shard.kind == PARQUET:
        dataset = datasets.load_dataset("parquet", data_files=shard.path, split="train", streaming=True)
        columns = list(dataset.features or {})
    else:
        dataset = dict(_open_datasets(shard.kind, Path(shard.path)))[shard.split]
        columns = dataset.column_names
    if json_key not in columns:
        raise InputError(f"{shard.path}: no column {json_key!r} (has: {', '.join(columns)}); "
                         f"choose it with --json-key")
    if shard.kind == PARQUET:
        batches = (batch[json_key] for batch in dataset.select_columns([json_key]).iter(batch_size=1000))
    else:
        batches = (dataset[start:min(shard.end, start + 1000)][json_key]
                   for start in range(shard.start, shard.end, 1000))
    for texts in batches:
        for text in texts:
            if isinstance(text, str):
                yield text, len(text.encode("utf-8", errors="replace"))
