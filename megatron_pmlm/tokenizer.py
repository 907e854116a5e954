"""Uncased WordPiece tokenization (HF `tokenizers`) and the special tokens PMLM needs.

[SOS]=[CLS], [EOS]=[SEP] as in UniLMv2 with a BERT vocabulary. The pseudo mask [P] is the `[P]`
token when the vocabulary has one (vocabularies trained here add it); a stock BERT vocabulary has no
such entry, and then [P] reuses [MASK]'s id, as the public s2s-ft fine-tuning toolkit does for its
pseudo masks: the attention pattern, not the embedding, tells [P] and [M] apart.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np
from tokenizers import BertWordPieceTokenizer

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


def check_vocabulary_file(vocab_file: Path) -> None:
    """A WordPiece vocab.txt is UTF-8 text, one token per line, with BERT's special tokens; anything
    else (a corpus, a tokenizer.json, a binary) is refused here in one line, before the tokenizers
    library fails on it with its own traceback."""
    what = "it should be a WordPiece vocab.txt, one token per line, like bert-base-uncased's"
    try:
        tokens = set(vocab_file.read_text(encoding="utf-8").splitlines())
    except UnicodeDecodeError:
        raise ValueError(f"vocabulary {vocab_file} is not UTF-8 text: {what}") from None
    missing = [t for t in (PAD, UNK, CLS, SEP, MASK) if t not in tokens]
    if missing:
        raise ValueError(f"vocabulary {vocab_file} lacks the special token(s) {', '.join(missing)}: {what}")


class WordPieceTokenizer:
    """A thin wrapper: vocabulary, special ids, and batch encoding to numpy id arrays."""

    def __init__(self, vocab_file: str | os.PathLike, lowercase: bool = True):
        vocab_file = Path(vocab_file)
        if not vocab_file.is_file():
            raise FileNotFoundError(f"vocabulary file not found: {vocab_file}")
        self.vocab_file = vocab_file
        check_vocabulary_file(vocab_file)
        self._tokenizer = BertWordPieceTokenizer(str(vocab_file), lowercase=lowercase)
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
