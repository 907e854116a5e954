"""Question generation and summarization scored as the benchmarks (and the UniLM toolkit) score them.

Question generation (SQuAD split of Du et al. 2017; UniLM v1 README, UniLMv2 Table 4): BLEU-4,
METEOR and ROUGE-L from the COCO caption evaluation code (`pycocoevalcap`: the same Bleu(4), Meteor
1.5 jar and Rouge classes as nqg's `qgevalcap`, ported to Python 3), over the toolkit's text:
  * one group per distinct source sentence (the source line, stripped and lower-cased): its
    references are the questions of all its lines, its prediction the one of its *last* line (the
    toolkit overwrites a dict entry per line); BLEU is corpus-level over the groups (closest
    reference length), METEOR the jar's corpus-level aggregate, ROUGE-L (beta 1.2) the mean over
    groups;
  * reference "du" (the toolkit's `qg/eval.py`, Du et al.'s tokenized lower-cased questions): the
    reference line stripped, unchanged; the prediction re-tokenized by `fix_tokenization` (PTB-style
    brackets and quotes, "' s" -> "'s", "n ' t" -> "n't", ...), then lower-cased;
  * reference "unilm" (`qg/eval_on_unilm_tokenized_ref.py`, UniLM's WordPiece-tokenized
    questions): the reference's '##' pieces joined to the word before them, lower-cased; the
    prediction stripped and lower-cased only.

Summarization (s2s-ft `evaluations/eval_for_{cnndm,xsum,gigaword}.py`, UniLM v1 `cnndm/eval.py`,
`gigaword/eval.py`, run with --perl, i.e. ROUGE-1.5.5 -c 95 -m -r 1000 -n 2 -a): each prediction is
post-processed as the toolkit does (`postprocess_summary`), both sides are lower-cased with the PTB
bracket/quote tokens mapped back (pyrouge's `clean`), and ROUGE-1/2/L F1 come from Google's
`rouge-score` (Porter stemming of words over 3 letters, non-alphanumerics dropped: its tokenization
mirrors ROUGE-1.5.5's), averaged over examples; ROUGE-L is the summary-level LCS over the sentences
(ROUGE-1.5.5's ROUGE-L on multi-sentence summaries, rouge-score's `rougeLsum`). rouge-score lacks
ROUGE-1.5.5's WordNet exceptions for irregular forms (ran -> run); on 300 synthetic CNN/DM-, XSum-
and Gigaword-style pairs its scores were within 0.1 of ROUGE-1.5.5's (-c 95 -m -r 1000 -n 2 -a).
"""

from __future__ import annotations

import contextlib
import re
import shutil
import string
import subprocess
import sys
from dataclasses import dataclass

QG = "qg"
SUMMARIZATION = ("cnndm", "xsum", "gigaword")
BENCHMARKS = (QG, *SUMMARIZATION)
QG_REFERENCES = ("du", "unilm")

# Per-benchmark tables of the toolkit's `fix_tokenization`: whole tokens replaced, and whether the
# double-quote / single-quote alternation and the hyphen joining apply.
_BRACKETS_LOWER = {"(": "-lrb-", ")": "-rrb-", "[": "-lsb-", "]": "-rsb-", "{": "-lcb-", "}": "-rcb-"}
_ESCAPES = {"[UNK]": "UNK", "&": "&amp;", "<": "&lt;", ">": "&gt;"}


@dataclass(frozen=True)
class _Fixes:
    tokens: dict
    quotes: bool = True
    hyphens: bool = True


FIXES = {
    QG: _Fixes({**_BRACKETS_LOWER, **_ESCAPES}),
    "cnndm": _Fixes({key: value.upper() for key, value in _BRACKETS_LOWER.items()}),
    "xsum": _Fixes({}, quotes=False, hyphens=False),
    "gigaword": _Fixes({**_BRACKETS_LOWER, **_ESCAPES, "<unk>": "UNK"}),
}

# pyrouge (bs_pyrouge.clean) maps these back before ROUGE-1.5.5 sees the lower-cased text.
_PTB_BACK = {"-lrb-": "(", "-rrb-": ")", "-lcb-": "{", "-rcb-": "}", "-lsb-": "[", "-rsb-": "]",
             "``": '"', "''": '"'}
_PTB_BACK_PATTERN = re.compile("|".join(re.escape(token) for token in _PTB_BACK))

# s2s-ft's CNN/DM defaults: --trunc_len 160 (its README; the script's default is 60, UniLM v1's
# README uses 70), --duplicate_rate 0.7; XSum and Gigaword: no truncation.
DEFAULT_TRUNCATION = {"cnndm": 160, "xsum": 0, "gigaword": 0}
DEFAULT_DUPLICATE_RATE = 0.7
SENTENCE_SEPARATOR = "[X_SEP]"   # between the sentences of a decoded summary (decode_s2s, s2s-ft)
REFERENCE_SEPARATOR = "<S_SEP>"  # between the sentences of the toolkit's CNN/DM gold summaries


def _is_number_with_commas(word: str) -> bool:
    return all(ch.isdigit() or ch == "," for ch in word)


def _is_single_capital(word: str) -> bool:
    return len(word) == 1 and word.isupper()


def fix_tokenization(text: str, benchmark: str = QG) -> str:
    """The toolkit's `fix_tokenization` for `benchmark`: BERT-style words (punctuation split off,
    as decode_s2s writes them) turned into the PTB-style tokens of the benchmark's references.

    Left to right over the whitespace-separated words: a word in the benchmark's table is replaced
    (brackets -> -lrb- etc.); '"' alternates `` and ''; "n ' t" -> "n't" (the n moves); "' s|d|ll" ->
    "'s" etc.; another "'" alternates ` and '; ". . ." -> "..."; "3 , 000" -> "3,000"; "3 . 03" ->
    "3.03"; "U . N ." -> "U.N." followed by the second "." again (the toolkit advances two words
    only); "- -" -> "--"; a "-" between two words that are not punctuation joins them ("well - known"
    -> "well-known"). XSum's table has no quote alternation and no hyphen rule.
    """
    fixes = FIXES[benchmark]
    words = text.split()
    out: list[str] = []
    left_double = left_single = False
    after_hyphen = False
    i, count = 0, len(words)
    while i < count:
        word = words[i]
        next_word = words[i + 1] if i + 1 < count else None
        joined_hyphen = False
        if word in fixes.tokens:
            out.append(fixes.tokens[word])
            i += 1
        elif fixes.quotes and word == '"':
            out.append("''" if left_double else "``")
            left_double = not left_double
            i += 1
        elif word == "'" and out and out[-1].endswith("n") and next_word == "t":
            out[-1] = out[-1][:-1]
            out.append("n't")
            i += 2
        elif word == "'" and next_word in ("s", "d", "ll"):
            out.append("'" + next_word)
            i += 2
        elif fixes.quotes and word == "'":
            out.append("'" if left_single else "`")
            left_single = not left_single
            i += 1
        elif word == "." and i + 2 < count and words[i + 1] == "." and words[i + 2] == ".":
            out.append("...")
            i += 3
        elif word == "," and out and _is_number_with_commas(out[-1]) and next_word is not None \
                and _is_number_with_commas(next_word):
            out[-1] += "," + next_word
            i += 2
        elif word == "." and out and out[-1].isdigit() and next_word is not None and next_word.isdigit():
            out[-1] += "." + next_word
            i += 2
        elif word == "." and out and _is_single_capital(out[-1]) and i + 2 < count \
                and _is_single_capital(words[i + 1]) and words[i + 2] == ".":
            end = i + 3
            while end + 2 < count and _is_single_capital(words[end + 1]) and words[end + 2] == ".":
                end += 2
            out[-1] += "".join(words[i:end])
            i += 2
        elif fixes.hyphens and word == "-":
            if next_word == "-":
                out.append("--")
                i += 2
            elif i == count - 1 or i == 0:
                out.append("-")
                i += 1
            elif out[-1] not in string.punctuation and next_word[0] not in string.punctuation:
                # `not in` on strings: a substring test, as the toolkit's (a word like "$" or "!?"
                # counts as punctuation, "-lrb-" does not)
                out[-1] += "-"
                joined_hyphen = True
                i += 1
            else:
                out.append("-")
                i += 1
        elif after_hyphen and out and word[0] not in string.punctuation:
            out[-1] += word
            i += 1
        else:
            out.append(word)
            i += 1
        after_hyphen = joined_hyphen
    return " ".join(out)


def join_wordpieces(words: list[str]) -> list[str]:
    """'##' pieces joined to the word before them (a leading '##' piece stays as it is)."""
    joined: list[str] = []
    for word in words:
        if word.startswith("##") and joined:
            joined[-1] += word[2:]
        else:
            joined.append(word)
    return joined


# ------------------------------------------------------------------------------------------------
# Question generation

def qg_text(prediction: str, reference: str, reference_style: str = "du") -> tuple[str, str]:
    """(prediction, reference) as the toolkit's QG evaluation scores them."""
    if reference_style == "du":
        return fix_tokenization(prediction.strip(), QG).lower(), reference.strip()
    if reference_style == "unilm":
        return prediction.strip().lower(), " ".join(join_wordpieces(reference.strip().split())).lower()
    raise ValueError(f"unknown QG reference style {reference_style!r} (choose from {', '.join(QG_REFERENCES)})")


def qg_groups(sources: list[str], predictions: list[str], references: list[str],
              reference_style: str = "du") -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(references, prediction) per source sentence, as the toolkit builds its `gts` and `res`:
    keyed by the stripped, lower-cased source; all the references of a source's lines, and the
    prediction of its last line."""
    if not len(sources) == len(predictions) == len(references):
        raise ValueError(f"{len(sources)} sources, {len(predictions)} predictions and {len(references)} "
                         "references")
    gts: dict[str, list[str]] = {}
    res: dict[str, list[str]] = {}
    for source, prediction, reference in zip(sources, predictions, references):
        key = source.strip().lower()
        prediction, reference = qg_text(prediction, reference, reference_style)
        res[key] = [prediction]
        gts.setdefault(key, []).append(reference)
    return gts, res


NO_JAVA = ("METEOR needs a Java runtime (pycocoevalcap runs the METEOR 1.5 jar) and `java` is not on "
           "PATH: install one (e.g. Debian's default-jre-headless)")


def java_missing() -> str | None:
    """Why METEOR cannot run here, or None when a `java` that starts is on PATH."""
    java = shutil.which("java")
    if java is None:
        return NO_JAVA
    try:
        result = subprocess.run([java, "-version"], capture_output=True, timeout=60, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"METEOR needs a Java runtime and {java} -version failed: {error}"
    if result.returncode:
        return f"METEOR needs a Java runtime and {java} -version exited {result.returncode}"
    return None


class MeteorError(RuntimeError):
    """The METEOR jar could not be started or stopped answering."""


class MeteorScorer:
    """pycocoevalcap's Meteor (one JVM, started here: a few seconds; reuse it), closed by close()
    or on leaving a `with` block."""

    def __init__(self) -> None:
        reason = java_missing()
        if reason is not None:
            raise MeteorError(reason)
        from pycocoevalcap.meteor.meteor import Meteor

        self._meteor = Meteor()

    def compute_score(self, gts: dict[str, list[str]], res: dict[str, list[str]]) -> float:
        """The jar's corpus-level METEOR (a fraction) of `res` against `gts` (pycocoevalcap's format)."""
        process = self._meteor.meteor_p
        try:
            score, _ = self._meteor.compute_score(gts, res)
        except (ValueError, OSError) as error:
            if self._meteor.lock.locked():  # left held by the failed call; its __del__ takes it again
                self._meteor.lock.release()
            detail = ""
            if process.poll() is not None:
                detail = process.stderr.read().decode(errors="replace").strip()[-2000:]
            raise MeteorError(f"the METEOR jar failed ({error}){': ' + detail if detail else ''}") from None
        return float(score)

    def close(self) -> None:
        process = self._meteor.meteor_p
        if process.poll() is None:
            with contextlib.suppress(OSError):
                process.stdin.close()
            process.kill()
            process.wait()

    def __enter__(self) -> "MeteorScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def score_qg(sources: list[str], predictions: list[str], references: list[str], reference_style: str = "du",
             meteor: MeteorScorer | bool | None = True) -> dict:
    """BLEU-1..4, METEOR and ROUGE-L (x100) as the toolkit's QG evaluation computes them.

    `meteor`: a MeteorScorer to use, True to start (and stop) one here, False/None to leave METEOR out.
    When no Java runtime is found, METEOR is None and `meteor_unavailable` says why.
    """
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.rouge.rouge import Rouge

    if not predictions:
        raise ValueError("no examples to score")
    gts, res = qg_groups(sources, predictions, references, reference_style)
    with contextlib.redirect_stdout(sys.stderr):  # the COCO classes print as they go
        bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
        rouge_l, _ = Rouge().compute_score(gts, res)
    results = {f"bleu{n}": 100.0 * float(value) for n, value in enumerate(bleu, 1)}
    results.update(meteor=None, rougeL=100.0 * float(rouge_l))
    if isinstance(meteor, MeteorScorer):
        results["meteor"] = 100.0 * meteor.compute_score(gts, res)
    elif meteor:
        reason = java_missing()
        if reason is None:
            with MeteorScorer() as scorer:
                results["meteor"] = 100.0 * scorer.compute_score(gts, res)
        else:
            results["meteor_unavailable"] = reason
    else:
        results["meteor_unavailable"] = "left out (--no-meteor)"
    results.update(examples=len(predictions), groups=len(gts), qg_reference=reference_style)
    if reference_style == "du" and any(ref != ref.lower() for refs in gts.values() for ref in refs):
        # The toolkit does not lower-case these references (Du et al.'s are lower-case already)
        results["note"] = ("some references have upper-case letters: Du et al.'s are lower-cased, and the "
                           "benchmark's scoring (like this one) compares them as they are with lower-cased predictions")
    results["metrics"] = {"BLEU-4": results["bleu4"], "METEOR": results["meteor"], "ROUGE-L": results["rougeL"]}
    return results


# ------------------------------------------------------------------------------------------------
# Summarization

def _drop_repeated_sentences(sentences: list[str], rate: float) -> list[str]:
    """The toolkit's remove_duplicate: a sentence whose distinct lower-cased words are more than
    `rate` words seen in the sentences before it (kept or not) is dropped."""
    kept, seen = [], set()
    for sentence in sentences:
        words = set(sentence.lower().split())
        if len(words & seen) / len(words) <= rate:
            kept.append(sentence)
        seen |= words
    return kept


def _truncate(sentences: list[str], limit: int) -> list[str]:
    """The first `limit` words, sentence by sentence (words re-joined by single spaces)."""
    kept = []
    for sentence in sentences:
        words = sentence.split()
        take = min(len(words), limit)
        kept.append(" ".join(words[:take]))
        limit -= take
        if limit <= 0:
            break
    return kept


def _single_spaces(text: str) -> str:
    return re.sub(" {2,}", " ", text)


def postprocess_summary(prediction: str, benchmark: str, truncation: int | None = None,
                        duplicate_rate: float | None = DEFAULT_DUPLICATE_RATE) -> list[str]:
    """The sentences of a decoded summary as the toolkit scores them.

    cnndm: split at [X_SEP]; each sentence fix_tokenization'd, brackets inside words spaced out as
    -LRB- etc.; sentences of 4 words or fewer dropped, then (duplicate_rate < 1) sentences mostly
    repeating earlier words; then cut to `truncation` words in all (default 160; 0: no cut).
    xsum: one sentence, fix_tokenization'd (XSum's table), round brackets spaced out as -LRB-/-RRB-.
    gigaword: one sentence, fix_tokenization'd, every '1' replaced by '#' (Gigaword's references
    write digits as #). Neither cuts unless `truncation` is given.
    """
    if benchmark not in SUMMARIZATION:
        raise ValueError(f"unknown summarization benchmark {benchmark!r} (choose from {', '.join(SUMMARIZATION)})")
    truncation = DEFAULT_TRUNCATION[benchmark] if truncation is None else truncation
    line = prediction.strip()
    if benchmark == "cnndm":
        sentences = []
        for part in line.split(SENTENCE_SEPARATOR):
            sentence = fix_tokenization(part, "cnndm")
            for bracket, token in (("(", " -LRB- "), (")", " -RRB- "), ("[", " -LSB- "), ("]", " -RSB- ")):
                sentence = sentence.replace(bracket, token)
            sentence = _single_spaces(sentence)
            # (the toolkit also skips a sentence whose unigram F1 with an earlier one exceeds 1.0:
            # never, F1 is at most 1)
            if len(sentence.split()) > 4:
                sentences.append(sentence)
        if duplicate_rate and duplicate_rate < 1:
            sentences = _drop_repeated_sentences(sentences, duplicate_rate)
    elif benchmark == "xsum":
        sentence = fix_tokenization(line, "xsum").replace("(", " -LRB- ").replace(")", " -RRB- ")
        sentences = [_single_spaces(sentence)]
    else:
        sentences = [fix_tokenization(line, "gigaword").replace("1", "#")]
    return _truncate(sentences, truncation) if truncation else sentences


def reference_sentences(reference: str, benchmark: str) -> list[str]:
    """A gold summary's sentences: CNN/DM's are separated by ' <S_SEP> ' in the toolkit's files
    (also accepted here: decode_s2s's [X_SEP]); XSum's and Gigaword's are one line."""
    line = reference.strip()
    if benchmark != "cnndm":
        return [line]
    line = line.replace(f" {REFERENCE_SEPARATOR} ", "\n")
    return [s.strip() for s in line.replace(SENTENCE_SEPARATOR, "\n").split("\n")]


def rouge_text(sentences: list[str]) -> str:
    """What ROUGE-1.5.5 is given (pyrouge): one sentence per line, lower-cased, PTB brackets and
    quotes mapped back."""
    text = "\n".join(sentences).lower()
    return _PTB_BACK_PATTERN.sub(lambda match: _PTB_BACK[match.group()], text)


def score_summaries(predictions: list[str], references: list[str], benchmark: str,
                    truncation: int | None = None, duplicate_rate: float | None = DEFAULT_DUPLICATE_RATE) -> dict:
    """ROUGE-1/2/L F1 (x100, mean over examples) as the toolkit's summarization evaluation reports
    them (ROUGE-L: summary-level, over sentences)."""
    from rouge_score import rouge_scorer

    if len(predictions) != len(references):
        raise ValueError(f"{len(predictions)} predictions but {len(references)} references")
    if not predictions:
        raise ValueError("no examples to score")
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeLsum"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeLsum": 0.0}
    for prediction, reference in zip(predictions, references):
        scores = scorer.score(rouge_text(reference_sentences(reference, benchmark)),
                              rouge_text(postprocess_summary(prediction, benchmark, truncation, duplicate_rate)))
        for name in totals:
            totals[name] += scores[name].fmeasure
    results = {name: 100.0 * total / len(predictions) for name, total in totals.items()}
    results.update(examples=len(predictions),
                   truncation=DEFAULT_TRUNCATION[benchmark] if truncation is None else truncation,
                   duplicate_rate=duplicate_rate if benchmark == "cnndm" else None)
    results["metrics"] = {"ROUGE-1": results["rouge1"], "ROUGE-2": results["rouge2"], "ROUGE-L": results["rougeLsum"]}
    return results


def score_benchmark(benchmark: str, predictions: list[str], references: list[str], sources: list[str] | None = None,
                    **options) -> dict:
    """score_qg (needs `sources`) or score_summaries, with `benchmark` added to the results."""
    if benchmark == QG:
        if sources is None:
            raise ValueError("qg: the source sentences are needed (the benchmark groups questions by sentence)")
        results = score_qg(sources, predictions, references, **options)
    elif benchmark in SUMMARIZATION:
        results = score_summaries(predictions, references, benchmark, **options)
    else:
        raise ValueError(f"unknown benchmark {benchmark!r} (choose from {', '.join(BENCHMARKS)})")
    return {"benchmark": benchmark, **results}
