"""Tokenize corpora into Megatron .bin/.idx: `python -m data_prep.preprocess --input ... --output-prefix P`.

One sequence per sentence, documents delimited (Megatron's indexed-dataset format), uncased WordPiece through HF `tokenizers`.
Inputs are cut into deterministic shards; each shard is tokenized on its own (in `--workers`
processes, streaming, so memory stays flat in the corpus size) into PREFIX.shards/shard-NNNNN.bin/.idx
with a JSON marker written last; a rerun skips shards whose marker exists, so a crashed run resumes.
A final merge joins the shards into PREFIX.bin/.idx (written under temporary names, then renamed)
and writes PREFIX.json (vocabulary hash, special ids, counts) for build_samples.

Multi-node: each rank (SLURM_PROCID/SLURM_NTASKS, or mpi4py under mpirun) takes shards r, r+W, ...;
then `--merge-only` joins them (see slurm/prepare_data.sh). Under mpi4py rank 0 merges after a barrier.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from data_prep.sentences import split_long_sentences
from data_prep.sources import (InputError, ReadStats, Shard, iter_documents, plan_shards,
                               resolve_inputs)
from megatron_pmlm.config import HelpFormatter, non_negative_int, positive_int
from megatron_pmlm.data.indexed import (IndexedDatasetWriter, bin_path, idx_path,
                                        merge_indexed_datasets, token_dtype_for_vocab)
from megatron_pmlm.files import STDOUT, check_output_folder, file_problem, special_file_kind, \
    write_json_atomically
from megatron_pmlm.data.text_data import split_sentences
from megatron_pmlm.tokenizer import WordPieceTokenizer, train_wordpiece

FORMAT_VERSION = 1


@dataclass
class PreprocessConfig:
    """Everything that decides the output; the shard plan is fingerprinted from it."""

    inputs: list[str]
    output_prefix: str
    vocab_file: str | None = None
    """WordPiece vocab.txt (uncased); bert-base-uncased in practice."""
    train_vocab: int | None = None
    """Train a WordPiece vocabulary of this size on the inputs (when there is no vocab file)."""
    json_key: str = "text"
    """Key of the text in JSONL records, or column of a `datasets` table."""
    workers: int = 1
    shard_size_mb: float = 256.0
    """Shard size: the unit of parallel work and of resumption."""
    max_sentence_tokens: int = 509
    """Longer sentences are split into pieces of this many tokens (counted); 509 = 512 - 3 specials."""
    documents_per_batch: int = 256
    """Documents tokenized per `encode_batch` call."""
    skip_bad_lines: bool = False
    strict_utf8: bool = False
    """Refuse invalid UTF-8 (default: replace with U+FFFD and count)."""
    overwrite: bool = False
    merge_only: bool = False
    vocab_only: bool = False
    """Train the --train-vocab vocabulary and stop (a multi-node job's first, single-task step)."""
    keep_shards: bool = False
    rank: int = 0
    world_size: int = 1
    progress: bool | None = None
    """tqdm progress bar; default: when stderr is a terminal."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise InputError(f"--workers must be >= 1, got {self.workers}")
        if self.shard_size_mb <= 0:
            raise InputError(f"--shard-size-mb must be positive, got {self.shard_size_mb}")
        if self.max_sentence_tokens < 1:
            raise InputError(f"--max-sentence-tokens must be >= 1, got {self.max_sentence_tokens}")
        if not 0 <= self.rank < self.world_size:
            raise InputError(f"rank {self.rank} is outside world size {self.world_size}")
        if self.vocab_file and self.train_vocab:
            raise InputError("give either --vocab-file or --train-vocab, not both")
        if not self.vocab_file and not self.train_vocab:
            raise InputError("a vocabulary is needed: --vocab-file PATH or --train-vocab SIZE")
        if self.vocab_only and not self.train_vocab:
            raise InputError("--vocab-only needs --train-vocab SIZE (the vocabulary to train)")


@dataclass
class ShardStats:
    documents: int = 0
    sentences: int = 0
    tokens: int = 0
    bytes: int = 0
    long_sentences_split: int = 0
    empty_documents: int = 0
    bad_lines: int = 0
    invalid_utf8: int = 0
    invalid_utf8_files: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def add(self, other: "ShardStats") -> None:
        for name in ("documents", "sentences", "tokens", "bytes", "long_sentences_split",
                     "empty_documents", "bad_lines", "invalid_utf8", "seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for path, count in other.invalid_utf8_files.items():
            self.invalid_utf8_files[path] = self.invalid_utf8_files.get(path, 0) + count


def file_sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def shard_dir(output_prefix: str | os.PathLike) -> Path:
    return Path(f"{output_prefix}.shards")


def shard_prefix(output_prefix: str | os.PathLike, index: int) -> Path:
    return shard_dir(output_prefix) / f"shard-{index:05d}"


# ---------------------------------------------------------------------------------------------
# One shard: documents -> sentences -> token ids, flat, vectorized over sentences.

_TOKENIZERS: dict[str, WordPieceTokenizer] = {}
_PROGRESS_QUEUE = None


def _tokenizer(vocab_file: str) -> WordPieceTokenizer:
    if vocab_file not in _TOKENIZERS:
        _TOKENIZERS[vocab_file] = WordPieceTokenizer(vocab_file)
    return _TOKENIZERS[vocab_file]


def tokenize_documents_flat(texts: Sequence[str], tokenizer: WordPieceTokenizer,
                            max_sentence_tokens: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    """(tokens, sentence lengths, sentences per document, long sentences split, empty documents)
    for a batch of documents; empty sentences and documents are dropped."""
    sentences_per_doc = []
    sentences: list[str] = []
    for text in texts:
        split = split_sentences(text)
        sentences.extend(split)
        sentences_per_doc.append(len(split))
    encoded = tokenizer.encode_batch(sentences)
    lengths = np.fromiter((len(e) for e in encoded), dtype=np.int64, count=len(encoded))
    tokens = np.concatenate(encoded) if encoded else np.zeros(0, np.int32)
    doc_of_sentence = np.repeat(np.arange(len(texts)), sentences_per_doc)
    nonempty = lengths > 0
    lengths, doc_of_sentence = lengths[nonempty], doc_of_sentence[nonempty]
    long_count = int((lengths > max_sentence_tokens).sum())
    if long_count:
        lengths, pieces = split_long_sentences(lengths, max_sentence_tokens)
        doc_of_sentence = np.repeat(doc_of_sentence, pieces)
    per_doc = np.bincount(doc_of_sentence, minlength=len(texts))
    empty_docs = int((per_doc == 0).sum())
    return tokens, lengths, per_doc[per_doc > 0], long_count, empty_docs


def plan_sha256(plan: dict) -> str:
    return hashlib.sha256(json.dumps(plan, sort_keys=True).encode()).hexdigest()


def shard_is_done(output_prefix: str | os.PathLike, index: int, plan_hash: str) -> bool:
    """A shard counts as done when its marker exists and was written for this very plan (stale
    markers of another run, e.g. after --overwrite on several ranks, do not count)."""
    marker = Path(f"{shard_prefix(output_prefix, index)}.json")
    if not marker.is_file():
        return False
    try:
        return json.loads(marker.read_text()).get("plan_sha256") == plan_hash
    except json.JSONDecodeError:
        return False


def process_shard(task: tuple[int, dict, dict, str, str]) -> tuple[int, dict]:
    """Tokenize one shard into its own .bin/.idx; the JSON stats marker is written last."""
    index, shard_json, config_json, vocab_file, plan_hash = task
    config = PreprocessConfig(**config_json)
    shard = Shard(**shard_json)
    tokenizer = _tokenizer(vocab_file)
    prefix = shard_prefix(config.output_prefix, index)
    writer = IndexedDatasetWriter(prefix, token_dtype_for_vocab(tokenizer.vocab_size))
    stats, read_stats = ShardStats(), ReadStats()
    started = time.perf_counter()
    try:
        batch: list[str] = []
        batch_bytes = 0
        documents = iter_documents(shard, read_stats, config.json_key, config.skip_bad_lines, config.strict_utf8)
        while True:
            item = next(documents, None)
            if item is not None:
                batch.append(item[0])
                batch_bytes += item[1]
            if batch and (item is None or len(batch) >= config.documents_per_batch):
                tokens, lengths, per_doc, long_count, empty_docs = tokenize_documents_flat(
                    batch, tokenizer, config.max_sentence_tokens)
                if len(per_doc):
                    writer.add_documents(tokens, lengths, per_doc)
                stats.documents += len(per_doc)
                stats.sentences += len(lengths)
                stats.tokens += len(tokens)
                stats.bytes += batch_bytes
                stats.long_sentences_split += long_count
                stats.empty_documents += empty_docs
                if _PROGRESS_QUEUE is not None:
                    _PROGRESS_QUEUE.put((len(batch), batch_bytes))
                batch, batch_bytes = [], 0
            if item is None:
                break
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    stats.bad_lines = read_stats.bad_lines
    stats.invalid_utf8 = read_stats.invalid_utf8
    stats.invalid_utf8_files = read_stats.invalid_utf8_files
    stats.seconds = time.perf_counter() - started
    write_json_atomically(Path(f"{prefix}.json"), {"shard": shard.to_json(), "plan_sha256": plan_hash,
                                                   "stats": asdict(stats)}, indent=1)
    return index, asdict(stats)


class _CallbackQueue:
    """Stands in for the progress queue when shards are tokenized in this process."""

    def __init__(self, callback):
        self.callback = callback

    def put(self, item: tuple[int, int]) -> None:
        self.callback(*item)


def _init_worker(queue) -> None:
    global _PROGRESS_QUEUE
    _PROGRESS_QUEUE = queue
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


# ---------------------------------------------------------------------------------------------
# The run: plan, resume, tokenize this rank's shards, merge.

def detect_rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int, object]:
    """Explicit values, else SLURM_PROCID/SLURM_NTASKS, else mpi4py's COMM_WORLD under mpirun."""
    if rank is not None or world_size is not None:
        return rank or 0, world_size or 1, None
    if "SLURM_NTASKS" in os.environ and "SLURM_PROCID" in os.environ:
        return int(os.environ["SLURM_PROCID"]), int(os.environ["SLURM_NTASKS"]), None
    launcher = next((k for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK") if k in os.environ), None)
    if launcher is not None:
        try:
            from mpi4py import MPI  # optional: pip install megatron-pmlm[mpi]
        except ImportError:
            size = os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("PMI_SIZE")
            if size is not None and int(size) == 1:
                return 0, 1, None
            # Every rank would take itself for the only one and write the same files.
            raise InputError(f"started by an MPI launcher ({launcher}={os.environ[launcher]}) but mpi4py is not "
                             "installed: pip install megatron-pmlm[mpi] (make mpi), or give --rank and "
                             "--world-size") from None
        return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size(), MPI.COMM_WORLD
    return 0, 1, None


def _abort_other_ranks(comm, status: int) -> None:
    """Under MPI, one rank's failure ends every rank (MPI_Abort; mpirun then exits non-zero): the
    others would otherwise wait for it forever, in the collective before the merge or in
    MPI_Finalize."""
    if comm is not None and comm.Get_size() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        comm.Abort(status)


def build_plan(config: PreprocessConfig, vocab_file: str) -> dict:
    inputs = resolve_inputs(config.inputs)
    shards = plan_shards(inputs, int(config.shard_size_mb * (1 << 20)))
    files = {str(p): [os.path.getsize(p) if p.is_file() else 0,
                      int(os.path.getmtime(p))] for _, p in inputs}
    return {"format_version": FORMAT_VERSION, "vocab_sha256": file_sha256(vocab_file),
            "json_key": config.json_key, "max_sentence_tokens": config.max_sentence_tokens,
            "strict_utf8": config.strict_utf8, "skip_bad_lines": config.skip_bad_lines,
            "inputs": files, "shards": [s.to_json() for s in shards]}


def _check_or_write_plan(config: PreprocessConfig, plan: dict) -> None:
    directory = shard_dir(config.output_prefix)
    plan_file = directory / "plan.json"
    if plan_file.is_file():
        previous = json.loads(plan_file.read_text())
        if previous != plan:
            if not config.overwrite:
                raise InputError(
                    f"{directory} holds shards of a different run (inputs or options changed); "
                    f"rerun with --overwrite to start over")
            if config.rank == 0 and config.world_size == 1:
                shutil.rmtree(directory)
    directory.mkdir(parents=True, exist_ok=True)
    write_json_atomically(plan_file, plan, indent=1)


def _check_outputs(config: PreprocessConfig) -> None:
    """What the run replaces (PREFIX.bin and .idx, renamed into place) or writes in (PREFIX.shards,
    PREFIX-vocab) is never `-`, a device, FIFO or socket, whatever the flags (PREFIX.json is written
    like any file output: `files.open_output`)."""
    if config.output_prefix == STDOUT:
        raise InputError("--output-prefix -: preprocess writes files PREFIX.bin, PREFIX.idx and PREFIX.json, not "
                         "standard output; give a path prefix")
    for path in (bin_path(config.output_prefix), idx_path(config.output_prefix)):
        kind = special_file_kind(path)
        if kind is not None:
            raise InputError(f"--output-prefix {config.output_prefix}: {path} is {kind}: refused, nothing is "
                             "written there")
    check_output_folder(shard_dir(config.output_prefix), "--output-prefix", error=InputError)
    check_output_folder(f"{config.output_prefix}-vocab", "--output-prefix", error=InputError)


def _train_vocabulary(config: PreprocessConfig) -> str:
    if config.world_size > 1:
        raise InputError("--train-vocab runs on one process: train the vocabulary first, then pass "
                         "--vocab-file to the multi-node run")
    shards = plan_shards(resolve_inputs(config.inputs), int(config.shard_size_mb * (1 << 20)))
    stats = ReadStats()

    def texts():
        for shard in shards:
            for text, _ in iter_documents(shard, stats, config.json_key, config.skip_bad_lines,
                                          config.strict_utf8):
                yield text

    documents = texts()
    first = next(documents, None)  # an empty input is found before a vocabulary is trained and written
    if first is None:
        raise InputError(f"empty input: no text in {', '.join(config.inputs)}")
    output_dir = Path(f"{config.output_prefix}-vocab")
    vocab = train_wordpiece(itertools.chain([first], documents), config.train_vocab, output_dir)
    print(f"trained a WordPiece vocabulary of {config.train_vocab} entries: {vocab}", file=sys.stderr)
    return str(vocab)


def run(config: PreprocessConfig, mpi_comm=None) -> dict | None:
    """Tokenize this rank's shards; merge when this process sees every shard (one rank, or rank 0
    after an MPI barrier, or --merge-only). Returns the summary, or None for a rank that did not merge."""
    started = time.perf_counter()
    output_prefix = Path(config.output_prefix)
    _check_outputs(config)
    existing = [p for p in (bin_path(output_prefix), idx_path(output_prefix)) if p.exists()]
    if existing and not config.overwrite:
        raise InputError(f"output exists: {existing[0]} (use --overwrite to replace it)")
    vocab_file = config.vocab_file
    if config.train_vocab:
        trained = Path(f"{config.output_prefix}-vocab") / "vocab.txt"
        # A rerun (resumption, --merge-only) keeps the vocabulary the shards were tokenized with.
        reuse = trained.is_file() and (config.merge_only or not config.overwrite)
        vocab_file = str(trained) if reuse else _train_vocabulary(config)
        if config.vocab_only:
            print(f"vocabulary: {vocab_file}", file=sys.stderr)
            return None
    problem = file_problem(vocab_file)
    if problem:
        raise InputError(f"vocabulary file {vocab_file} {problem}")
    _tokenizer(vocab_file)  # a file that is no vocabulary is refused before anything is written
    plan = build_plan(config, vocab_file)
    if not plan["shards"]:
        raise InputError(f"empty input: no text in {', '.join(config.inputs)}")
    _check_or_write_plan(config, plan)
    shards = plan["shards"]
    totals, skipped = ShardStats(), 0
    if not config.merge_only:
        mine = list(range(config.rank, len(shards), config.world_size))
        pending = [i for i in mine if not shard_is_done(output_prefix, i, plan_sha256(plan))]
        skipped = len(mine) - len(pending)
        if skipped:
            print(f"resuming: {skipped} of {len(mine)} shards already done", file=sys.stderr)
        _tokenize_shards(config, vocab_file, shards, pending, totals, plan_sha256(plan))
        if mpi_comm is not None:  # every rank's shards are done; rank 0 merges
            totals.bytes = mpi_comm.allreduce(totals.bytes)
            skipped = mpi_comm.allreduce(skipped)
        if config.world_size > 1 and not (mpi_comm is not None and config.rank == 0):
            then = "rank 0 merges" if mpi_comm is not None else "join them with --merge-only"
            print(f"rank {config.rank}/{config.world_size}: {len(mine)} shards done; {then}", file=sys.stderr)
            return None
    summary = _merge(config, vocab_file, plan)
    summary["seconds"] = time.perf_counter() - started
    summary["shards_skipped"] = skipped
    summary["bytes_this_run"] = totals.bytes
    return summary


def _tokenize_shards(config: PreprocessConfig, vocab_file: str, shards: list[dict],
                     pending: list[int], totals: ShardStats, plan_hash: str) -> None:
    if not pending:
        return
    from tqdm import tqdm

    config_json = asdict(config)
    tasks = [(i, shards[i], config_json, vocab_file, plan_hash) for i in pending]
    total_bytes = sum(_shard_bytes(shards[i]) for i in pending) or None
    show = sys.stderr.isatty() if config.progress is None else config.progress
    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1000, disable=not show,
               desc="tokenizing", dynamic_ncols=True)
    documents = 0

    def on_progress(docs: int, nbytes: int) -> None:
        nonlocal documents
        documents += docs
        bar.update(nbytes)
        bar.set_postfix(documents=documents, refresh=False)

    if config.workers == 1:
        global _PROGRESS_QUEUE
        _PROGRESS_QUEUE = _CallbackQueue(on_progress)
        try:
            for task in tasks:
                totals.add(ShardStats(**process_shard(task)[1]))
        finally:
            _PROGRESS_QUEUE = None
    else:
        context = multiprocessing.get_context("spawn")
        queue = context.Queue()
        with context.Pool(min(config.workers, len(tasks)), initializer=_init_worker, initargs=(queue,)) as pool:
            results = pool.imap_unordered(process_shard, tasks)
            remaining = len(tasks)
            while remaining:
                try:
                    _, stats = results.next(timeout=0.2)
                    totals.add(ShardStats(**stats))
                    remaining -= 1
                except multiprocessing.TimeoutError:
                    pass
                while not queue.empty():
                    on_progress(*queue.get())
    bar.close()


def _shard_bytes(shard: dict) -> int:
    if shard["kind"] in ("text", "jsonl"):
        return shard["end"] - shard["start"]
    return 0


def _merge(config: PreprocessConfig, vocab_file: str, plan: dict) -> dict:
    output_prefix = Path(config.output_prefix)
    shards, plan_hash = plan["shards"], plan_sha256(plan)
    missing = [i for i in range(len(shards)) if not shard_is_done(output_prefix, i, plan_hash)]
    if missing:
        raise InputError(f"cannot merge: {len(missing)} of {len(shards)} shards are not finished "
                         f"(first: {shard_prefix(output_prefix, missing[0])}); run the tokenizing ranks first")
    totals = ShardStats()
    for i in range(len(shards)):
        totals.add(ShardStats(**json.loads(Path(f"{shard_prefix(output_prefix, i)}.json").read_text())["stats"]))
    if totals.documents == 0:
        shutil.rmtree(shard_dir(output_prefix), ignore_errors=True)
        raise InputError(f"empty input: no document with text in {', '.join(config.inputs)}")
    merge_indexed_datasets([shard_prefix(output_prefix, i) for i in range(len(shards))], output_prefix)
    tokenizer = _tokenizer(vocab_file)
    summary = asdict(totals)
    summary["tokenizing_seconds_summed_over_shards"] = summary.pop("seconds")
    meta = {"format_version": FORMAT_VERSION, "vocab_file": str(Path(vocab_file).resolve()),
            "vocab_sha256": file_sha256(vocab_file), "vocab_size": tokenizer.vocab_size,
            "special_ids": asdict(tokenizer.special),
            "dtype": str(token_dtype_for_vocab(tokenizer.vocab_size)),
            "max_sentence_tokens": config.max_sentence_tokens, "inputs": config.inputs,
            "num_shards": len(shards), "stats": summary}
    write_json_atomically(Path(f"{output_prefix}.json"), meta, indent=1)
    if not config.keep_shards:
        shutil.rmtree(shard_dir(output_prefix), ignore_errors=True)
    return summary


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m data_prep.preprocess", description=__doc__,
                                     formatter_class=HelpFormatter)
    parser.add_argument("--input", nargs="+", required=True, dest="inputs",
                        help="text files (blank-line separated documents), JSONL, datasets save_to_disk "
                             "folders, .parquet or .arrow files; globs allowed")
    parser.add_argument("--output-prefix", required=True, help="writes PREFIX.bin, PREFIX.idx, PREFIX.json")
    parser.add_argument("--vocab-file", help="WordPiece vocab.txt (uncased), e.g. bert-base-uncased's (the "
                                             "docs/data_prep.md says where to get it); or --train-vocab")
    parser.add_argument("--train-vocab", type=positive_int, metavar="SIZE",
                        help="train a WordPiece vocabulary of SIZE on the inputs (PREFIX-vocab/vocab.txt)")
    parser.add_argument("--json-key", default="text", help="the text field of JSONL lines and datasets")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes on this node")
    parser.add_argument("--shard-size-mb", type=float, default=256.0,
                        help="input bytes per shard (the unit of parallelism and of resumption)")
    parser.add_argument("--max-sentence-tokens", type=int, default=509,
                        help="longer sentences are split (509 = 512 minus [SOS] and two [EOS])")
    parser.add_argument("--skip-bad-lines", action="store_true", help="count and skip malformed JSONL lines")
    parser.add_argument("--strict-utf8", action="store_true", help="refuse invalid UTF-8 instead of replacing it")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing output and its shards")
    parser.add_argument("--merge-only", action="store_true", help="join the finished shards of all ranks")
    parser.add_argument("--vocab-only", action="store_true",
                        help="with --train-vocab: train PREFIX-vocab/vocab.txt and stop (then tokenize on many "
                             "ranks with --vocab-file PREFIX-vocab/vocab.txt)")
    parser.add_argument("--keep-shards", action="store_true", help="keep PREFIX.shards after the merge")
    parser.add_argument("--rank", type=non_negative_int, help="default: SLURM_PROCID, or the MPI rank")
    parser.add_argument("--world-size", type=positive_int, help="default: SLURM_NTASKS, or the MPI size")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (logs, batch jobs)")
    return parser


def format_summary(summary: dict) -> str:
    megabytes = summary["bytes"] / 1e6
    seconds = max(summary["seconds"], 1e-9)
    # Throughput of what this run tokenized (a resumed run or --merge-only did less than the total).
    speed = summary.get("bytes_this_run", summary["bytes"]) / 1e6 / seconds
    lines = [f"documents {summary['documents']:,}  sentences {summary['sentences']:,}  "
             f"tokens {summary['tokens']:,}  text {megabytes:,.1f} MB in {seconds:,.1f} s "
             + (f"({speed:,.2f} MB/s)" if speed else "(merged only)")]
    if summary["shards_skipped"]:
        lines.append(f"resumed: {summary['shards_skipped']} shards were already done")
    if summary["long_sentences_split"]:
        lines.append(f"sentences longer than {summary.get('max_sentence_tokens', 'the limit')} tokens split: "
                     f"{summary['long_sentences_split']:,}")
    if summary["empty_documents"]:
        lines.append(f"documents without tokens dropped: {summary['empty_documents']:,}")
    if summary["bad_lines"]:
        lines.append(f"malformed JSONL lines skipped: {summary['bad_lines']:,}")
    if summary["invalid_utf8"]:
        files = ", ".join(f"{p} ({n})" for p, n in summary["invalid_utf8_files"].items())
        lines.append(f"invalid UTF-8 sequences replaced by U+FFFD: {summary['invalid_utf8']:,} in {files}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    comm = None
    try:
        rank, world_size, comm = detect_rank_and_world(args.rank, args.world_size)
        config = PreprocessConfig(
            inputs=args.inputs, output_prefix=args.output_prefix, vocab_file=args.vocab_file,
            train_vocab=args.train_vocab, json_key=args.json_key, workers=args.workers,
            shard_size_mb=args.shard_size_mb, max_sentence_tokens=args.max_sentence_tokens,
            skip_bad_lines=args.skip_bad_lines, strict_utf8=args.strict_utf8, overwrite=args.overwrite,
            merge_only=args.merge_only, vocab_only=args.vocab_only, keep_shards=args.keep_shards, rank=rank, world_size=world_size,
            progress=False if args.no_progress else None)
        summary = run(config, comm)
    except (InputError, FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        _abort_other_ranks(comm, 2)
        return 2
    except BaseException:
        if comm is not None and comm.Get_size() > 1:
            import traceback

            traceback.print_exc()
            _abort_other_ranks(comm, 1)
        raise
    if summary is not None:
        summary["max_sentence_tokens"] = config.max_sentence_tokens
        print(format_summary(summary))
        print(f"wrote {bin_path(config.output_prefix)} and {idx_path(config.output_prefix)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
