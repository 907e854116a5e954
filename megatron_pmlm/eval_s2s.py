"""Score sequence-to-sequence outputs (question generation, summarization): ROUGE and BLEU-4.

    python -m megatron_pmlm.eval_s2s --pred P --ref R [--output results.json] [--tokenize bert]

P and R hold one example per line (the decoder's output, SPEC §7.2 B.7, and the references), in
the same order. The metrics come from maintained packages, not re-implementations:
  ROUGE-1/2/L  F1 from Google's `rouge-score` (use_stemmer=True), averaged over examples, x100;
  BLEU-4       corpus BLEU from `sacrebleu` (single reference), as the question-generation
               literature (Du & Cardie 2017, UniLM) reports it: lower-cased, tokenized text.
Both sides are normalised the same way before both metrics (--tokenize):
  bert  (default) lower-case and split with transformers' BasicTokenizer, so punctuation is
        separated identically on both sides whatever the tokenizer that produced each (our decoder
        emits WordPiece-joined words; SQuAD-QG references are already tokenized and lower-cased);
  13a   lower-case, then sacrebleu's default (WMT) tokenizer;
  none  lower-case only; the text is taken as already tokenized.
`--no-lowercase` keeps case for BLEU. ROUGE is case-insensitive regardless: rouge-score lower-cases
and replaces every non-alphanumeric character with a space itself, so it never sees punctuation.
Corpus BLEU uses sacrebleu's defaults otherwise ('exp' smoothing, which only matters when some
n-gram order has no match at all); coco-caption's Bleu_4, used by some QG papers, can differ slightly.
METEOR is not reported: the one maintained implementation (nltk's meteor_score) needs the WordNet
corpus downloaded at run time, and nothing here may download data while it runs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .files import InputError, OutputError, check_output, logs_to_stderr, write_json_atomically

TOKENIZERS = ("bert", "13a", "none")
NO_METEOR = ("METEOR is not reported: nltk's meteor_score needs the WordNet corpus downloaded at "
             "run time, and nothing here may download data while it runs.")


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
    if not path.exists():
        raise InputError(f"{role} file {path} does not exist")
    if not path.is_file():
        raise InputError(f"{role} file {path} is not a file")
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.eval_s2s",
                                     description=__doc__.split("\n\n")[0], epilog=NO_METEOR,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--pred", required=True, type=Path, help="predictions, one per line")
    parser.add_argument("--ref", required=True, type=Path, help="references, one per line")
    parser.add_argument("--output", type=Path, default=None,
                        help="also write the scores here (JSON; '-': standard output, the table then goes to "
                        "standard error)")
    parser.add_argument("--tokenize", default="bert",
                        help=f"normalisation of both sides: {', '.join(TOKENIZERS)} (see the module "
                        "docstring)")
    parser.add_argument("--no-lowercase", action="store_true", help="keep case (BLEU; ROUGE ignores case)")
    args = parser.parse_args(argv)
    try:
        with logs_to_stderr(args.output):
            return _evaluate_files(args)
    except (InputError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


def _evaluate_files(args: argparse.Namespace) -> int:
    if args.tokenize not in TOKENIZERS:
        raise InputError(f"unknown --tokenize {args.tokenize!r} (choose from {', '.join(TOKENIZERS)})")
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
    results = evaluate(predictions, references, args.tokenize, not args.no_lowercase)
    print(format_table(results))
    if args.output is not None:
        try:
            write_json_atomically(args.output, {**results, "pred": str(args.pred), "ref": str(args.ref)})
        except OSError as error:
            raise InputError(f"cannot write {args.output}: {error.strerror or error}") from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
