"""Score sequence-to-sequence outputs (question generation, summarization): ROUGE, BLEU-4, METEOR.

    python -m megatron_pmlm.eval_s2s --pred P --ref R [--output results.json] [--tokenize bert]
    python -m megatron_pmlm.eval_s2s --benchmark qg --src S --pred P --ref R [--qg-reference du|unilm]
    python -m megatron_pmlm.eval_s2s --benchmark cnndm|xsum|gigaword --pred P --ref R [--trunc-len N]

P and R (and S, the source sentences) hold one example per line (the decoder's output, SPEC §7.2
B.7, and the references), in the same order.

--benchmark: the numbers of the papers' tables, scored as the benchmark and the UniLM toolkit score
them (megatron_pmlm.generation.benchmark_scoring says exactly how):
  qg        BLEU-4, METEOR, ROUGE-L (COCO caption code, pycocoevalcap; METEOR needs `java`), with
            the questions grouped by source sentence as nqg/UniLM's qg/eval.py does: comparable
            with UniLM's and UniLMv2's SQuAD question generation tables. --qg-reference du (the
            default: Du et al.'s tokenized questions, tgt-*.txt, qg/eval.py) or unilm (UniLM's
            WordPiece-tokenized questions, qg/eval_on_unilm_tokenized_ref.py).
  cnndm, xsum, gigaword
            ROUGE-1/2/L F1 with stemming after the toolkit's post-processing of the predictions
            (CNN/DM: sentences at [X_SEP], short and repeated ones dropped, cut to --trunc-len
            words), ROUGE-L over sentences: comparable with the summarization tables (ROUGE-1.5.5
            numbers; rouge-score, used here, mirrors it).

Without --benchmark (the default metrics, for quick comparisons between our own runs; not the
papers' numbers) the metrics come from maintained packages, not re-implementations:
  ROUGE-1/2/L  F1 from Google's `rouge-score` (use_stemmer=True), averaged over examples, x100;
  BLEU-4       corpus BLEU from `sacrebleu` (one reference per line, no grouping by sentence),
               over lower-cased, tokenized text.
Both sides are normalised the same way before both metrics (--tokenize):
  bert  (default) lower-case and split with transformers' BasicTokenizer, so punctuation is
        separated identically on both sides whatever the tokenizer that produced each (our decoder
        emits WordPiece-joined words; SQuAD-QG references are already tokenized and lower-cased);
  13a   lower-case, then sacrebleu's default (WMT) tokenizer;
  none  lower-case only; the text is taken as already tokenized.
`--no-lowercase` keeps case for BLEU. ROUGE is case-insensitive regardless: rouge-score lower-cases
and replaces every non-alphanumeric character with a space itself, so it never sees punctuation.
Corpus BLEU uses sacrebleu's defaults otherwise ('exp' smoothing, which only matters when some
n-gram order has no match at all); the QG benchmark's (coco-caption's) Bleu_4 differs: --benchmark qg.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .files import (InputError, OutputError, check_output, exit_quietly_on_closed_pipe, file_problem, logs_to_stderr,
                    write_json_atomically)

TOKENIZERS = ("bert", "13a", "none")
COMPARABLE = ("Which numbers compare with what: without --benchmark, corpus BLEU-4 (sacrebleu) and "
              "ROUGE-1/2/L (rouge-score) on our own normalisation, no METEOR: for comparing our runs "
              "with each other only. --benchmark qg: BLEU-4/METEOR/ROUGE-L as UniLM's and UniLMv2's "
              "SQuAD question generation tables (--qg-reference du: Du et al.'s references, UniLM "
              "README's note; unilm: its main table). --benchmark cnndm|xsum|gigaword: ROUGE-1/2/L F1 "
              "as the summarization tables (ROUGE-1.5.5 -m -n 2, ROUGE-L summary-level).")


def normalise(texts: list[str], tokenize: str = "bert", lowercase: bool = True) -> list[str]:
    """The strings both metrics see: tokens joined by single spaces."""
    if tokenize == "bert":
        from transformers import BasicTokenizer  # imported here: ~1.5 s, and only this mode needs it
        splitter = BasicTokenizer(do_lower_case=lowercase)
        return [" ".join(splitter.tokenize(text)) for text in texts]
    if tokenize not in TOKENIZERS:
        raise InputError(f"unknown --tokenize {tokenize!r} (choose from {', '.join(TOKENIZERS)})")
    texts = [text.lower() if lowercase else text for text in texts]
    if tokenize == "13a":
        from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
        texts = [Tokenizer13a()(text) for text in texts]
    return [" ".join(text.split()) for text in texts]


def evaluate(predictions: list[str], references: list[str], tokenize: str = "bert",
             lowercase: bool = True) -> dict:
    """ROUGE-1/2/L F1 (mean over examples) and corpus BLEU-4, all x100.

    Raises InputError (a ValueError) for different lengths, no examples, an empty reference or an
    unknown `tokenize`; an empty prediction is fine (it scores 0).
    """
    import sacrebleu
    from rouge_score import rouge_scorer

    if len(predictions) != len(references):
        raise InputError(f"{len(predictions)} predictions but {len(references)} references")
    if not references:
        raise InputError("no examples to score")
    for index, reference in enumerate(references):
        if not reference.strip():
            raise InputError(f"reference {index} (0-based) is empty")
    preds = normalise(predictions, tokenize, lowercase)
    refs = normalise(references, tokenize, lowercase)

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
    totals = {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}
    for pred, ref in zip(preds, refs):
        scores = scorer.score(ref, pred)  # score(target, prediction)
        for name in totals:
            totals[name] += scores[name].fmeasure
    # Already normalised, so sacrebleu only splits on whitespace.
    bleu = sacrebleu.corpus_bleu(preds, [refs], tokenize="none", lowercase=False)
    return {**{name: 100.0 * total / len(preds) for name, total in totals.items()},
            "bleu4": bleu.score, "bleu_precisions": list(bleu.precisions),
            "bleu_brevity_penalty": bleu.bp, "examples": len(preds), "tokenize": tokenize,
            "lowercase": lowercase}


def read_lines(path: Path, role: str) -> list[str]:
    """One example per line ('\\n'-separated, as `wc -l` counts; a final newline is optional)."""
    problem = file_problem(path)
    if problem:
        raise InputError(f"{role} file {path} {problem}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise InputError(f"{role} file {path} is not UTF-8 text (byte {error.start})") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def format_table(results: dict) -> str:
    rows = [("ROUGE-1", results["rouge1"]), ("ROUGE-2", results["rouge2"]),
            ("ROUGE-L", results["rougeL"]), ("BLEU-4", results["bleu4"])]
    precisions = "/".join(f"{p:.1f}" for p in results["bleu_precisions"])
    lines = [f"{'metric':<10}{'value':>8}"] + [f"{name:<10}{value:>8.2f}" for name, value in rows]
    count = results["examples"]
    lines.append(f"({count} example{'s' * (count != 1)}; tokenize {results['tokenize']}"
                 f"{'' if results['lowercase'] else ', cased'}; BLEU n-gram precisions {precisions}, "
                 f"brevity penalty {results['bleu_brevity_penalty']:.3f})")
    return "\n".join(lines)


def format_benchmark_table(results: dict) -> str:
    """The paper's metrics, in its order and with its names, then how they were computed."""
    lines = [f"{'metric':<10}{'value':>8}"]
    for name, value in results["metrics"].items():
        lines.append(f"{name:<10}{'n/a' if value is None else f'{value:.2f}':>8}")
    count = results["examples"]
    if results["benchmark"] == "qg":
        lines.append(f"(benchmark qg, {results['qg_reference']} references: {count} example"
                     f"{'s' * (count != 1)} in {results['groups']} source-sentence groups; BLEU-1/2/3 "
                     + "/".join(f"{results[f'bleu{n}']:.2f}" for n in (1, 2, 3)) + ")")
        if results["meteor"] is None:
            lines.append(f"(METEOR: {results['meteor_unavailable']})")
        if "note" in results:
            lines.append(f"(note: {results['note']})")
    else:
        extra = f", duplicate rate {results['duplicate_rate']}" if results["duplicate_rate"] is not None else ""
        lines.append(f"(benchmark {results['benchmark']}: {count} example{'s' * (count != 1)}; F1 with stemming, "
                     f"ROUGE-L over sentences; predictions cut to {results['truncation'] or 'no limit of'} words"
                     f"{extra})")
    return "\n".join(lines)


def main(argv=None) -> int:
    from .generation.benchmark_scoring import BENCHMARKS, DEFAULT_DUPLICATE_RATE, QG_REFERENCES

    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.eval_s2s",
                                     description=__doc__.split("\n\n")[0], epilog=COMPARABLE,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pred", required=True, type=Path, help="predictions, one per line")
    parser.add_argument("--ref", required=True, type=Path, help="references, one per line")
    parser.add_argument("--benchmark", choices=BENCHMARKS, default=None,
                        help="score as this benchmark and the UniLM toolkit do: the papers' numbers "
                        "(none: our own BLEU-4/ROUGE, not comparable with the papers)")
    parser.add_argument("--src", type=Path, default=None,
                        help="--benchmark qg: the source sentences, one per line (questions are grouped by them)")
    parser.add_argument("--qg-reference", choices=QG_REFERENCES, default="du",
                        help="--benchmark qg: du = Du et al.'s tokenized questions (qg/eval.py: predictions "
                        "re-tokenized PTB-style); unilm = UniLM's WordPiece-tokenized questions "
                        "(qg/eval_on_unilm_tokenized_ref.py)")
    parser.add_argument("--no-meteor", action="store_true",
                        help="--benchmark qg: leave METEOR out (it starts a Java VM: a few seconds)")
    parser.add_argument("--trunc-len", type=int, default=None, metavar="N",
                        help="--benchmark cnndm|xsum|gigaword: cut each prediction to N words (none: "
                        "cnndm 160 as s2s-ft's README; xsum, gigaword: no cut; 0: no cut)")
    parser.add_argument("--duplicate-rate", type=float, default=DEFAULT_DUPLICATE_RATE,
                        help="--benchmark cnndm: drop a sentence whose distinct words are more than this "
                        "share of words already seen (1: keep all)")
    parser.add_argument("--output", type=Path, default=None,
                        help="also write the scores here (JSON; '-': standard output, the table then goes to "
                        "standard error)")
    parser.add_argument("--tokenize", default="bert",
                        help=f"without --benchmark: normalisation of both sides: {', '.join(TOKENIZERS)} (see "
                        "the module docstring)")
    parser.add_argument("--no-lowercase", action="store_true", help="without --benchmark: keep case (BLEU; ROUGE ignores case)")
    args = parser.parse_args(argv)
    try:
        with logs_to_stderr(args.output):
            return _evaluate_files(args)
    except BrokenPipeError:  # the reader went away (`| head`): exit_quietly_on_closed_pipe ends quietly
        raise
    except (InputError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _check_benchmark_options(args: argparse.Namespace) -> None:
    if args.benchmark is None:
        for flag, given in (("--src", args.src is not None), ("--no-meteor", args.no_meteor),
                            ("--trunc-len", args.trunc_len is not None)):
            if given:
                raise InputError(f"{flag} goes with --benchmark")
    elif args.benchmark == "qg":
        if args.src is None:
            raise InputError("--benchmark qg needs --src (the source sentences: the benchmark groups the "
                             "questions by sentence)")
        if args.trunc_len is not None:
            raise InputError("--trunc-len goes with --benchmark cnndm|xsum|gigaword")
    else:
        if args.src is not None or args.no_meteor:
            raise InputError(f"{'--src' if args.src is not None else '--no-meteor'} goes with --benchmark qg")
        if args.trunc_len is not None and args.trunc_len < 0:
            raise InputError(f"--trunc-len must be 0 or more, got {args.trunc_len}")
    if not 0.0 <= args.duplicate_rate <= 1.0:
        raise InputError(f"--duplicate-rate must be between 0 and 1, got {args.duplicate_rate}")


def _score_benchmark(args: argparse.Namespace, predictions: list[str], references: list[str]) -> dict:
    from .generation.benchmark_scoring import MeteorError, score_benchmark

    if args.benchmark == "qg":
        sources = read_lines(args.src, "source")
        if len(sources) != len(references):
            raise InputError(f"{args.src} has {len(sources)} lines but {args.ref} has {len(references)}")
        empty = next((number for number, line in enumerate(sources, 1) if not line.strip()), None)
        if empty is not None:
            raise InputError(f"{args.src} line {empty}: empty source")
        try:
            return score_benchmark("qg", predictions, references, sources, reference_style=args.qg_reference,
                                   meteor=not args.no_meteor)
        except MeteorError as error:
            raise InputError(str(error)) from None
    return score_benchmark(args.benchmark, predictions, references, truncation=args.trunc_len,
                           duplicate_rate=args.duplicate_rate)


def _evaluate_files(args: argparse.Namespace) -> int:
    if args.tokenize not in TOKENIZERS:
        raise InputError(f"unknown --tokenize {args.tokenize!r} (choose from {', '.join(TOKENIZERS)})")
    _check_benchmark_options(args)
    if args.output is not None:
        try:
            check_output(args.output, create_folders=True)
        except OutputError as error:
            raise InputError(str(error)) from None
    predictions = read_lines(args.pred, "prediction")
    references = read_lines(args.ref, "reference")
    if len(predictions) != len(references):
        raise InputError(f"{args.pred} has {len(predictions)} lines but {args.ref} has {len(references)}")
    if not references:
        raise InputError(f"{args.ref} is empty")
    empty = next((number for number, line in enumerate(references, 1) if not line.strip()), None)
    if empty is not None:
        raise InputError(f"{args.ref} line {empty}: empty reference")
    if args.benchmark is None:
        results = evaluate(predictions, references, args.tokenize, not args.no_lowercase)
        print(format_table(results))
    else:
        results = _score_benchmark(args, predictions, references)
        print(format_benchmark_table(results))
    if args.output is not None:
        files = {"pred": str(args.pred), "ref": str(args.ref), **({"src": str(args.src)} if args.src else {})}
        try:
            write_json_atomically(args.output, {**results, **files})
        except BrokenPipeError:
            raise
        except OSError as error:
            raise InputError(f"cannot write {args.output}: {error.strerror or error}") from None
    return 0


if __name__ == "__main__":
    sys.exit(exit_quietly_on_closed_pipe(main))
