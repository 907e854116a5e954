"""Uncased WordPiece tokenization (HF `tokenizers`) and the special tokens PMLM needs.

[SOS]=[CLS], [EOS]=[SEP] as in UniLMv2 with a BERT vocabulary. The pseudo mask [P] is the `[P]`
token when the vocabulary has one (vocabularies trained here add it); a stock BERT vocabulary has no
such entry, and then [P] reuses [MASK]'s id, as the public s2s-ft fine-tuning toolkit does for its
pseudo masks: the attention pattern, not the embedding, tells [P] and [M] apart.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import BertWordPieceTokenizer

from .files import file_problem

PAD, UNK, CLS, SEP, MASK, PSEUDO = "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[P]"
TRAINED_SPECIAL_TOKENS = [PAD, UNK, CLS, SEP, MASK, PSEUDO]


@dataclass(frozen=True)
class SpecialTokenIds:
    pad: int
    unk: int
    cls: int
    sep: int
    mask: int
    pseudo: int

    def all_ids(self) -> np.ndarray:
        return np.unique(np.array([self.pad, self.unk, self.cls, self.sep, self.mask, self.pseudo]))


VOCAB_FILE = "vocab.txt"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
VOCAB_FILE_FORMAT = "it should be a WordPiece vocab.txt, one token per line, like bert-base-uncased's"


class VocabularyError(ValueError):
    """A folder's vocabulary is missing or unusable; the message names the file, in one line."""


@dataclass(frozen=True)
class Vocabulary:
    """A WordPiece vocabulary (tokens in id order) and its lower-casing, read from a vocab.txt or
    from the tokenizer.json that transformers' `save_pretrained` writes alone: our loaders take
    either, in memory, so a user's folder never needs a vocab.txt written into it."""

    tokens: tuple[str, ...]
    do_lower_case: bool
    source: Path
    """The file the tokens were read from (a vocab.txt or a tokenizer.json)."""

    @property
    def file(self) -> Path | None:
        """The vocab.txt it was read from; None when it came from a tokenizer.json."""
        return self.source if self.source.name != TOKENIZER_FILE else None

    def write(self, path: str | os.PathLike) -> Path:
        """A vocab.txt of these tokens at `path` (for a folder or checkpoint of ours)."""
        from .files import write_text_atomically

        path = Path(path)
        write_text_atomically(path, "\n".join(self.tokens) + "\n")
        return path


def check_vocabulary_tokens(tokens: Iterable[str], source: Path) -> None:
    """BERT's special tokens must be there; anything else (a corpus, a binary) is refused here in one
    line, before the tokenizers library fails on it with its own traceback."""
    present = set(tokens)
    missing = [t for t in (PAD, UNK, CLS, SEP, MASK) if t not in present]
    if missing:
        raise VocabularyError(f"vocabulary {source} lacks the special token(s) {', '.join(missing)}: "
                              f"{VOCAB_FILE_FORMAT}")


def read_vocabulary_file(vocab_file: str | os.PathLike, do_lower_case: bool = True) -> Vocabulary:
    """A vocab.txt: UTF-8 text, one token per line, with BERT's special tokens."""
    vocab_file = Path(vocab_file)
    problem = file_problem(vocab_file)
    if problem:
        raise VocabularyError(f"vocabulary file {vocab_file} {problem}")
    try:
        tokens = tuple(vocab_file.read_text(encoding="utf-8").rstrip("\n").split("\n"))
    except UnicodeDecodeError:
        raise VocabularyError(f"vocabulary {vocab_file} is not UTF-8 text: {VOCAB_FILE_FORMAT}") from None
    check_vocabulary_tokens(tokens, vocab_file)
    return Vocabulary(tokens, do_lower_case, vocab_file)


def _normalizer_lowercases(normalizer: dict | None) -> bool | None:
    """Whether a tokenizer.json normalizer lower-cases (None: it does not say)."""
    if not normalizer:
        return None
    kind = normalizer.get("type")
    if kind == "BertNormalizer":
        return bool(normalizer.get("lowercase", True))
    if kind == "Lowercase":
        return True
    if kind == "Sequence":
        found = [_normalizer_lowercases(n) for n in normalizer.get("normalizers", [])]
        return any(found) if any(f is not None for f in found) else None
    return None


def read_tokenizer_json(tokenizer_file: Path) -> tuple[tuple[str, ...], bool | None]:
    """(tokens in id order, whether its normalizer lower-cases) of a WordPiece tokenizer.json; its
    added tokens count when they extend the ids (as `[P]` may)."""
    import json

    try:
        data = json.loads(tokenizer_file.read_text(encoding="utf-8"))
        model = data["model"]
    except (ValueError, KeyError, TypeError) as error:
        raise VocabularyError(f"{tokenizer_file} is not a tokenizers JSON file ({error})") from None
    if model.get("type") != "WordPiece":
        raise VocabularyError(f"{tokenizer_file} is a {model.get('type')} tokenizer, not WordPiece: BERT/PMLM "
                              "models here need a WordPiece vocabulary (vocab.txt)")
    ids = dict(model.get("vocab") or {})
    for added in data.get("added_tokens") or []:
        ids.setdefault(added.get("content"), added.get("id"))
    by_id = {i: t for t, i in ids.items()}
    if sorted(by_id) != list(range(len(by_id))):
        raise VocabularyError(f"{tokenizer_file}: its WordPiece ids are not 0..{len(by_id) - 1} without gaps")
    tokens = tuple(by_id[i] for i in range(len(by_id)))
    check_vocabulary_tokens(tokens, tokenizer_file)
    return tokens, _normalizer_lowercases(data.get("normalizer"))


def folder_vocabulary(folder: str | os.PathLike) -> Vocabulary:
    """The one place a model folder's vocabulary is found: its vocab.txt, else the WordPiece
    vocabulary inside its tokenizer.json (what `save_pretrained` writes alone). Lower-casing: the
    tokenizer.json's normalizer when that is what was read, else tokenizer_config.json's
    `do_lower_case`, else on (BERT's uncased default)."""
    import json

    folder = Path(folder)
    configured = None
    config_file = folder / TOKENIZER_CONFIG_FILE
    if config_file.is_file():
        try:
            configured = json.loads(config_file.read_text()).get("do_lower_case")
        except (ValueError, AttributeError):
            configured = None
    if (folder / VOCAB_FILE).is_file():
        return read_vocabulary_file(folder / VOCAB_FILE, bool(configured if configured is not None else True))
    if (folder / TOKENIZER_FILE).is_file():
        tokens, lowercases = read_tokenizer_json(folder / TOKENIZER_FILE)
        do_lower_case = lowercases if lowercases is not None else configured if configured is not None else True
        return Vocabulary(tokens, bool(do_lower_case), folder / TOKENIZER_FILE)
    raise VocabularyError(f"{folder} has no vocabulary (neither {VOCAB_FILE} nor {TOKENIZER_FILE})")


class WordPieceTokenizer:
    """A thin wrapper: vocabulary, special ids, and batch encoding to numpy id arrays."""

    def __init__(self, vocab: str | os.PathLike | Vocabulary, lowercase: bool | None = None):
        """`vocab`: a vocab.txt, or a Vocabulary (in memory); `lowercase`: default the Vocabulary's, else on."""
        if not isinstance(vocab, Vocabulary):
            problem = file_problem(vocab)
            if problem:
                raise FileNotFoundError(f"vocabulary file {vocab} {problem}")
            vocab = read_vocabulary_file(vocab)
        self.vocabulary = vocab
        self.vocab_file = vocab.source
        lowercase = vocab.do_lower_case if lowercase is None else lowercase
        self._tokenizer = BertWordPieceTokenizer({t: i for i, t in enumerate(vocab.tokens)}, lowercase=lowercase)
        vocab = self._tokenizer.get_vocab()
        self.special = SpecialTokenIds(
            pad=vocab[PAD], unk=vocab[UNK], cls=vocab[CLS], sep=vocab[SEP], mask=vocab[MASK],
            pseudo=vocab.get(PSEUDO, vocab[MASK]))
        self.vocab_size = self._tokenizer.get_vocab_size()
        self._id_to_token = {i: t for t, i in vocab.items()}

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        encodings = self._tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int32) for e in encodings]

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        return [self._id_to_token.get(int(i), UNK) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)


def train_wordpiece(texts: Iterable[str], vocab_size: int, output_dir: str | os.PathLike) -> Path:
    """Train an uncased WordPiece vocabulary (with [P]) on `texts`; returns the vocab.txt path."""
    if vocab_size < len(TRAINED_SPECIAL_TOKENS) + 100:
        raise ValueError(f"vocabulary size {vocab_size} is too small to be useful (need >= 106)")
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=TRAINED_SPECIAL_TOKENS, show_progress=False)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    tmp_dir = output_dir / ".vocab.tmp"
    tmp_dir.mkdir(exist_ok=True)
    written = Path(tokenizer.save_model(str(tmp_dir))[0])
    final = output_dir / "vocab.txt"
    os.replace(written, final)
    tmp_dir.rmdir()
    return final


def vocabulary_content_problem(vocab_file: Path | None, source: str, recorded_sha256: str | None) -> str | None:
    """A vocab.txt whose sha256 is not the recorded one (None: it is, or nothing is recorded)."""
    if not recorded_sha256 or vocab_file is None:
        return None
    digest = hashlib.sha256(Path(vocab_file).read_bytes()).hexdigest()
    if digest != recorded_sha256:
        return (f"{source} is not the vocabulary the model was trained with (same size, other content: sha256 "
                f"{digest[:12]}..., recorded {recorded_sha256[:12]}...)")
    return None
