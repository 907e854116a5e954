"""Fine-tune and evaluate extractive question answering on SQuAD v1.1 / v2.0 with Hugging Face's `Trainer`.

    python -m megatron_pmlm.finetune_squad --model DIR --train-file train-v1.1.json \\
        --predict-file dev-v1.1.json --output-dir out/squad1 [--version-2-with-negative]

What run_qa.py + utils_qa.py do, thin: the input is "[CLS] question [SEP] passage [SEP]" (UniLMv2
§4.2: [SOS] Question [EOS] Passage [EOS]); a fast tokenizer with offsets cuts long passages into
windows of --max-seq-length tokens overlapping by --doc-stride tokens (questions cut to
--max-query-length tokens); a start/end classifier per token is trained on the window holding the
answer, [CLS] for none (SQuAD 2.0's unanswerable questions, and windows without the answer). The
answer of a question is the best span over its windows among the --n-best-size best starts and ends,
at most --max-answer-length tokens, inside the passage; with --version-2-with-negative it is empty
when the null score ([CLS] start + end, lowest over the windows) beats the best span by more than
--null-score-diff-threshold. Scores are the official SQuAD evaluation's: answers normalised (lower
case, punctuation and articles a/an/the removed, whitespace collapsed), exact match and token F1,
the best over the gold answers; an unanswerable question's only gold answer is the empty string.

OUTPUT_DIR receives predictions.json (id -> answer), nbest_predictions.json, null_odds.json (v2.0),
eval_results.json and all_results.json (eval_exact, eval_f1, eval_total; for v2.0 also
eval_HasAns_*, eval_NoAns_*, and eval_best_exact/eval_best_f1 with their null-odds thresholds),
all written atomically, and the fine-tuned model. Defaults are UniLMv2's (Table 9, SQuAD column:
lr 2e-5, batch 32, 4 epochs, warmup ratio 0.1, weight decay 0.01) and run_qa.py's (lengths).
Bad input (a file that is not SQuAD JSON, a model folder without a vocabulary, ...) stops with one
`error:` line, exit status 2, before anything is written.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import string
from pathlib import Path
from typing import Any, Callable

import numpy as np

from ..files import check_output_folder, file_problem, write_json_atomically
from ..config import HelpFormatter
from ..training.checkpoint_files import add_no_checksums_argument
from .hf_trainer import (InputError, add_trainer_arguments, check_model_path, check_trainer_arguments, declare_mean_loss,
                         load_tokenizer, model_max_positions, quiet_libraries, remove_if_created_empty,
                         resolve_model, save_fine_tuned, training_arguments)

SQUAD_DEFAULTS = dict(learning_rate=2e-5, per_device_train_batch_size=32, num_train_epochs=4.0, warmup_ratio=0.1,
                      weight_decay=0.01)
TABLE9 = ("UniLMv2 (Bao et al., 2020) Appendix C, Table 9, SQuAD v1.1/v2.0 column: batch 32, learning rate "
          "2e-5, linear schedule, warmup ratio 0.1, weight decay 0.01, 4 epochs (the same for both versions). "
          "Lengths, stride and post-processing: Hugging Face's run_qa.py / utils_qa.py.")


# ------------------------------------------------------------------------------------------------
# Reading SQuAD JSON
# ------------------------------------------------------------------------------------------------

def read_squad(path: Path, version_2_with_negative: bool, role: str = "--predict-file") -> list[dict[str, Any]]:
    """The questions of a SQuAD JSON file, flattened: id, title, context, question, answers
    ({'text': [...], 'answer_start': [...]}, empty for an unanswerable question), checked."""
    path = Path(path)
    problem = file_problem(path)
    if problem:
        raise InputError(f"{role} {path} {problem}")
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError as error:
        raise InputError(f"{role} {path} is not SQuAD JSON: not UTF-8 text (byte {error.start})") from None
    except json.JSONDecodeError as error:
        raise InputError(f"{role} {path} is not SQuAD JSON: not JSON ({error.msg}, line {error.lineno})") from None

    def bad(where: str, what: str) -> InputError:
        return InputError(f"{role} {path} is not SQuAD JSON: {where} {what}")

    if not isinstance(data, dict) or not isinstance(data.get("data"), list):
        raise bad("the top level", "has no 'data' list of articles")
    examples, seen = [], set()
    for a, article in enumerate(data["data"]):
        if not isinstance(article, dict) or not isinstance(article.get("paragraphs"), list):
            raise bad(f"data[{a}]", "has no 'paragraphs' list")
        for p, paragraph in enumerate(article["paragraphs"]):
            where = f"data[{a}].paragraphs[{p}]"
            if not isinstance(paragraph, dict) or not isinstance(paragraph.get("context"), str):
                raise bad(where, "has no 'context' string")
            if not isinstance(paragraph.get("qas"), list):
                raise bad(where, "has no 'qas' list")
            context = paragraph["context"]
            for q, qa in enumerate(paragraph["qas"]):
                here = f"{where}.qas[{q}]"
                if not isinstance(qa, dict):
                    raise bad(here, "is not an object")
                for key, kind in (("id", (str, int)), ("question", str), ("answers", list)):
                    if not isinstance(qa.get(key), kind):
                        raise bad(here, f"has no {key!r}" + (" list" if kind is list else ""))
                qid = str(qa["id"])
                if qid in seen:
                    raise InputError(f"{role} {path}: question id {qid!r} ({here}) appears twice")
                seen.add(qid)
                texts, starts = [], []
                for n, answer in enumerate(qa["answers"]):
                    if not (isinstance(answer, dict) and isinstance(answer.get("text"), str)
                            and isinstance(answer.get("answer_start"), int) and answer["answer_start"] >= 0):
                        raise bad(f"{here}.answers[{n}]", "needs 'text' (a string) and 'answer_start' (an integer >= 0)")
                    if answer["answer_start"] + len(answer["text"]) > len(context):
                        raise InputError(f"{role} {path}: {here}.answers[{n}] ends past the context "
                                         f"({answer['answer_start']} + {len(answer['text'])} > {len(context)} characters)")
                    texts.append(answer["text"])
                    starts.append(answer["answer_start"])
                impossible = bool(qa.get("is_impossible", False))
                if impossible:
                    texts, starts = [], []
                if not texts and not version_2_with_negative:
                    raise InputError(f"{role} {path}: question {qid!r} ({here}) is unanswerable (SQuAD 2.0); pass "
                                     "--version-2-with-negative")
                examples.append({"id": qid, "title": str(article.get("title", "")), "context": context,
                                 "question": qa["question"], "answers": {"text": texts, "answer_start": starts}})
    if not examples:
        raise InputError(f"{role} {path} has no questions")
    return examples


# ------------------------------------------------------------------------------------------------
# Features (run_qa.py's prepare_train_features / prepare_validation_features)
# ------------------------------------------------------------------------------------------------

def cut_questions(questions: list[str], tokenizer, max_query_length: int) -> list[str]:
    """Questions without leading whitespace, cut after their first `max_query_length` tokens."""
    questions = [q.lstrip() for q in questions]
    encoded = tokenizer(questions, add_special_tokens=False, return_offsets_mapping=True)
    cut = []
    for question, offsets in zip(questions, encoded["offset_mapping"]):
        cut.append(question[:offsets[max_query_length - 1][1]] if len(offsets) > max_query_length else question)
    return cut


def _encode(examples: list[dict], tokenizer, max_seq_length: int, doc_stride: int, max_query_length: int):
    return tokenizer(cut_questions([e["question"] for e in examples], tokenizer, max_query_length),
                     [e["context"] for e in examples], truncation="only_second", max_length=max_seq_length,
                     stride=doc_stride, return_overflowing_tokens=True, return_offsets_mapping=True)


def prepare_train_features(examples: list[dict], tokenizer, max_seq_length: int = 384, doc_stride: int = 128,
                           max_query_length: int = 64) -> dict[str, list]:
    """Windows of each example with start_positions / end_positions: the answer's first and last
    token when the window holds the whole answer, else [CLS]'s (as for an unanswerable question)."""
    encoded = _encode(examples, tokenizer, max_seq_length, doc_stride, max_query_length)
    features: dict[str, list] = {key: [] for key in encoded if key not in ("overflow_to_sample_mapping",
                                                                          "offset_mapping")}
    features.update(start_positions=[], end_positions=[])
    for i, offsets in enumerate(encoded["offset_mapping"]):
        for key in features:
            if key in encoded:
                features[key].append(encoded[key][i])
        input_ids = encoded["input_ids"][i]
        cls_index = input_ids.index(tokenizer.cls_token_id) if tokenizer.cls_token_id in input_ids else 0
        sequence_ids = encoded.sequence_ids(i)
        answers = examples[encoded["overflow_to_sample_mapping"][i]]["answers"]
        start, end = cls_index, cls_index
        if answers["answer_start"] and 1 in sequence_ids:
            start_char = answers["answer_start"][0]
            end_char = start_char + len(answers["text"][0])
            first = sequence_ids.index(1)
            last = len(sequence_ids) - 1 - sequence_ids[::-1].index(1)
            if offsets[first][0] <= start_char and offsets[last][1] >= end_char:
                start = first
                while start <= last and offsets[start][0] <= start_char:
                    start += 1
                start -= 1
                end = last
                while offsets[end][1] >= end_char:
                    end -= 1
                end += 1
        features["start_positions"].append(start)
        features["end_positions"].append(end)
    return features


def prepare_validation_features(examples: list[dict], tokenizer, max_seq_length: int = 384, doc_stride: int = 128,
                                max_query_length: int = 64) -> tuple[dict[str, list], list[dict]]:
    """(the model inputs of every window, per window: example_index and offset_mapping, None outside
    the passage so that no answer can start or end there)."""
    encoded = _encode(examples, tokenizer, max_seq_length, doc_stride, max_query_length)
    inputs = {key: list(encoded[key]) for key in encoded if key not in ("overflow_to_sample_mapping", "offset_mapping")}
    meta = []
    for i, offsets in enumerate(encoded["offset_mapping"]):
        sequence_ids = encoded.sequence_ids(i)
        meta.append({"example_index": encoded["overflow_to_sample_mapping"][i],
                     "offset_mapping": [tuple(o) if sequence_ids[k] == 1 else None for k, o in enumerate(offsets)]})
    return inputs, meta


# ------------------------------------------------------------------------------------------------
# Post-processing (utils_qa.py's postprocess_qa_predictions)
# ------------------------------------------------------------------------------------------------

def postprocess_qa_predictions(examples: list[dict], features: list[dict], start_logits: np.ndarray,
                               end_logits: np.ndarray, version_2_with_negative: bool = False, n_best_size: int = 20,
                               max_answer_length: int = 30, null_score_diff_threshold: float = 0.0):
    """Answers from start/end logits [features, tokens] (rows may be padded; columns past a
    feature's offsets are ignored). Returns (predictions {id: text}, n-best lists {id: [{text,
    probability, start_logit, end_logit}]}, null-score differences {id: float}, v2.0 only)."""
    by_example = collections.defaultdict(list)
    for index, feature in enumerate(features):
        by_example[feature["example_index"]].append(index)
    predictions, nbest_json, scores_diff = {}, {}, {}
    for example_index, example in enumerate(examples):
        null = None
        candidates = []
        for index in by_example[example_index]:
            starts, ends = np.asarray(start_logits[index]), np.asarray(end_logits[index])
            offsets = features[index]["offset_mapping"]
            null_score = float(starts[0] + ends[0])
            if null is None or null["score"] > null_score:
                null = {"offsets": (0, 0), "score": null_score, "start_logit": float(starts[0]),
                        "end_logit": float(ends[0])}
            best_starts = np.argsort(starts)[-1:-n_best_size - 1:-1].tolist()
            best_ends = np.argsort(ends)[-1:-n_best_size - 1:-1].tolist()
            for s in best_starts:
                for e in best_ends:
                    if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > max_answer_length:
                        continue
                    candidates.append({"offsets": (offsets[s][0], offsets[e][1]), "score": float(starts[s] + ends[e]),
                                       "start_logit": float(starts[s]), "end_logit": float(ends[e])})
        null_score = null["score"] if null is not None else 0.0  # before the scores are popped below
        if version_2_with_negative and null is not None:
            candidates.append(null)
        best = sorted(candidates, key=lambda c: c["score"], reverse=True)[:n_best_size]
        if version_2_with_negative and null is not None and not any(c["offsets"] == (0, 0) for c in best):
            best.append(null)
        context = example["context"]
        for candidate in best:
            start, end = candidate.pop("offsets")
            candidate["text"] = context[start:end]
        if not best or (len(best) == 1 and best[0]["text"] == ""):
            best.insert(0, {"text": "empty", "start_logit": 0.0, "end_logit": 0.0, "score": 0.0})
        scores = np.array([c.pop("score") for c in best])
        probabilities = np.exp(scores - scores.max())
        probabilities /= probabilities.sum()
        for candidate, probability in zip(best, probabilities):
            candidate["probability"] = float(probability)
        qid = example["id"]
        if not version_2_with_negative:
            predictions[qid] = best[0]["text"]
        else:
            non_null = next((c for c in best if c["text"] != ""), best[0])
            diff = null_score - non_null["start_logit"] - non_null["end_logit"]
            scores_diff[qid] = float(diff)
            predictions[qid] = "" if diff > null_score_diff_threshold else non_null["text"]
        nbest_json[qid] = [{"text": c["text"], "probability": c["probability"], "start_logit": c["start_logit"],
                            "end_logit": c["end_logit"]} for c in best]
    return predictions, nbest_json, scores_diff


# ------------------------------------------------------------------------------------------------
# The official evaluation (SQuAD v2.0's evaluate-v2.0.py; v1.1's scores are the same on v1.1 data)
# ------------------------------------------------------------------------------------------------

def normalize_answer(text: str) -> str:
    """Lower case, remove punctuation, articles (a, an, the) and extra whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def compute_exact(gold: str, prediction: str) -> int:
    return int(normalize_answer(gold) == normalize_answer(prediction))


def compute_f1(gold: str, prediction: str) -> float:
    gold_tokens = normalize_answer(gold).split() if gold else []
    pred_tokens = normalize_answer(prediction).split() if prediction else []
    if not gold_tokens or not pred_tokens:  # an unanswerable question: 1 if both are empty, else 0
        return float(gold_tokens == pred_tokens)
    same = sum((collections.Counter(gold_tokens) & collections.Counter(pred_tokens)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def gold_answers(example: dict) -> list[str]:
    """The gold answers that normalise to something; [''] for an unanswerable question."""
    return [text for text in example["answers"]["text"] if normalize_answer(text)] or [""]


def _best_threshold(predictions: dict, scores: dict, na_probs: dict, has_answer: dict) -> tuple[float, float]:
    """evaluate-v2.0.py's find_best_thresh: answer '' above the threshold on na_probs."""
    num_no_answer = sum(1 for qid in has_answer if not has_answer[qid])
    current = best = num_no_answer
    best_threshold = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        if qid not in scores:
            continue
        if has_answer[qid]:
            diff = scores[qid]
        else:
            diff = -1 if predictions[qid] else 0
        current += diff
        if current > best:
            best, best_threshold = current, na_probs[qid]
    return 100.0 * best / len(scores), best_threshold


def squad_evaluate(examples: list[dict], predictions: dict[str, str], na_probs: dict[str, float] | None = None,
                   version_2_with_negative: bool = False) -> dict[str, float]:
    """exact, f1, total (x100, the mean over questions of the best over gold answers); with
    version_2_with_negative also HasAns_* and NoAns_* (when there are such questions) and, given
    na_probs (e.g. the null-score differences), best_exact/best_f1 and their thresholds."""
    exact, f1, has_answer = {}, {}, {}
    for example in examples:
        qid = example["id"]
        golds = gold_answers(example)
        has_answer[qid] = golds != [""]
        prediction = predictions.get(qid, "")
        exact[qid] = max(compute_exact(gold, prediction) for gold in golds)
        f1[qid] = max(compute_f1(gold, prediction) for gold in golds)

    def summary(ids: list[str], prefix: str = "") -> dict[str, float]:
        return {f"{prefix}exact": 100.0 * sum(exact[i] for i in ids) / len(ids),
                f"{prefix}f1": 100.0 * sum(f1[i] for i in ids) / len(ids), f"{prefix}total": len(ids)}

    result = summary(list(exact))
    if version_2_with_negative:
        answerable = [qid for qid in exact if has_answer[qid]]
        unanswerable = [qid for qid in exact if not has_answer[qid]]
        if answerable:
            result.update(summary(answerable, "HasAns_"))
        if unanswerable:
            result.update(summary(unanswerable, "NoAns_"))
        if na_probs:
            result["best_exact"], result["best_exact_thresh"] = _best_threshold(predictions, exact, na_probs, has_answer)
            result["best_f1"], result["best_f1_thresh"] = _best_threshold(predictions, f1, na_probs, has_answer)
    return result


# ------------------------------------------------------------------------------------------------
# The command
# ------------------------------------------------------------------------------------------------

DEFAULT_MAX_SEQ_LENGTH = 384
DEFAULT_DOC_STRIDE = 128
"""run_qa.py's window and stride; a shorter window keeps the stride's share of it."""


def window_doc_stride(args: argparse.Namespace, window: int, why: str = "") -> int:
    """--doc-stride, or the default for windows of `window` tokens (run_qa.py's 128 from 384 tokens
    up, the same share of a shorter window); a stride that leaves no room to move on is an
    InputError naming the stride and the window."""
    stride = args.doc_stride if args.doc_stride is not None else \
        min(DEFAULT_DOC_STRIDE, window * DEFAULT_DOC_STRIDE // DEFAULT_MAX_SEQ_LENGTH)
    room = window - args.max_query_length - 3
    if stride >= room:
        given = "--doc-stride" if args.doc_stride is not None else "the default --doc-stride"
        raise InputError(f"{given} {stride} leaves no room to move on in windows of --max-seq-length {window}{why}: "
                         f"it must be below {window} - --max-query-length {args.max_query_length} - 3 = {room}")
    return stride


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m megatron_pmlm.finetune_squad", description=__doc__.split("\n\n")[0],
                                     epilog="Defaults: " + TABLE9, formatter_class=HelpFormatter)
    parser.add_argument("--model", required=True,
                        help="a Hugging Face folder (a converted one, or one fine-tuned by this command, for "
                             "evaluation alone) or a checkpoint directory of ours (converted into OUTPUT_DIR/model)")
    parser.add_argument("--train-file", type=Path, help="SQuAD JSON to train on (none: evaluate only)")
    parser.add_argument("--predict-file", type=Path, help="SQuAD JSON to answer and score (the dev set)")
    parser.add_argument("--version-2-with-negative", action="store_true",
                        help="SQuAD 2.0: unanswerable questions (empty answers) in training and prediction")
    parser.add_argument("--output-dir", required=True, type=Path)
    add_no_checksums_argument(parser)
    qa = parser.add_argument_group("windows and answers (run_qa.py's defaults)")
    qa.add_argument("--max-seq-length", type=int, default=DEFAULT_MAX_SEQ_LENGTH,
                    help="tokens per window (lowered to the model's positions when it has fewer)")
    qa.add_argument("--doc-stride", type=int, default=None,
                    help=f"tokens shared by consecutive windows of a passage (default: {DEFAULT_DOC_STRIDE}, run_qa.py's, "
                         f"for windows of {DEFAULT_MAX_SEQ_LENGTH} tokens or more; a shorter window gets the same "
                         f"share, window x {DEFAULT_DOC_STRIDE}/{DEFAULT_MAX_SEQ_LENGTH})")
    qa.add_argument("--max-query-length", type=int, default=64, help="question tokens kept")
    qa.add_argument("--n-best-size", type=int, default=20, help="best starts x best ends tried per window")
    qa.add_argument("--max-answer-length", type=int, default=30, help="tokens in an answer at most")
    qa.add_argument("--null-score-diff-threshold", type=float, default=0.0,
                    help="v2.0: answer '' when null score - best span score exceeds this")
    qa.add_argument("--max-train-samples", type=int, default=None, help="train on the first N questions only")
    qa.add_argument("--max-eval-samples", type=int, default=None, help="answer the first N questions only")
    add_trainer_arguments(parser, SQUAD_DEFAULTS, "UniLMv2 Table 9, see below")
    return parser


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, float]:
    """Fine-tune (with --train-file), answer and score (with --predict-file); the metrics."""
    if args.train_file is None and args.predict_file is None:
        raise InputError("give --train-file, --predict-file or both")
    check_trainer_arguments(args)
    for name in ("max_seq_length", "doc_stride", "max_query_length", "n_best_size", "max_answer_length"):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            raise InputError(f"--{name.replace('_', '-')} must be positive")
    window_doc_stride(args, args.max_seq_length)
    v2 = args.version_2_with_negative
    train = read_squad(args.train_file, v2, "--train-file")[:args.max_train_samples] if args.train_file else None
    evaluation = read_squad(args.predict_file, v2, "--predict-file")[:args.max_eval_samples] if args.predict_file else None
    check_model_path(args.model, "finetune_squad")
    output_dir = Path(args.output_dir)
    check_output_folder(output_dir, "--output-dir", error=InputError)  # `-`, a file, a device, FIFO, socket
    existed = output_dir.exists()
    try:
        return _train_and_predict(args, train, evaluation, output_dir, log)
    except InputError:
        remove_if_created_empty(output_dir, existed)
        raise


def _train_and_predict(args, train: list[dict] | None, evaluation: list[dict] | None, output_dir: Path, log):
    import datasets
    import transformers
    from transformers import AutoModelForQuestionAnswering, DataCollatorWithPadding, Trainer

    quiet_libraries()
    training_args = training_arguments(args, output_dir, has_eval=False)
    with training_args.main_process_first(local=False, desc="model conversion"):
        folder = resolve_model(args.model, output_dir / "model", log=log, checksums=args.checksums)
    tokenizer = load_tokenizer(folder)
    max_length = args.max_seq_length
    positions = model_max_positions(folder)
    if positions is not None and max_length > positions:
        max_length = positions
        stride = window_doc_stride(args, max_length, f" (--max-seq-length {args.max_seq_length} lowered to the "
                                                     f"model's {positions} positions)")
        log(f"--max-seq-length {args.max_seq_length} exceeds the model's {positions} positions: using {positions}"
            + ("" if args.doc_stride is not None else f", and --doc-stride {stride} to match"))
    lengths = dict(max_seq_length=max_length, doc_stride=window_doc_stride(args, max_length),
                   max_query_length=args.max_query_length)

    transformers.set_seed(args.seed)  # the new start/end classifier's initialisation
    model = AutoModelForQuestionAnswering.from_pretrained(str(folder), trust_remote_code=True)
    declare_mean_loss(model)
    pad_multiple = 8 if (args.fp16 or args.bf16) else None
    trainer = Trainer(model=model, args=training_args, processing_class=tokenizer,
                      data_collator=DataCollatorWithPadding(tokenizer, pad_to_multiple_of=pad_multiple))
    metrics: dict[str, Any] = {}
    if train is not None:
        features = {}
        for begin in range(0, len(train), 1000):  # run_qa.py maps batches of 1,000
            for key, values in prepare_train_features(train[begin:begin + 1000], tokenizer, **lengths).items():
                features.setdefault(key, []).extend(values)
        trainer.train_dataset = datasets.Dataset.from_dict(features)
        log(f"training on {len(train)} questions ({len(trainer.train_dataset)} windows) from {args.train_file}")
        metrics.update(trainer.train().metrics)
        metrics["train_samples"] = len(trainer.train_dataset)
        if not args.no_save_model:
            save_fine_tuned(trainer, folder, output_dir)
    if evaluation is not None:
        inputs, meta = prepare_validation_features(evaluation, tokenizer, **lengths)
        output = trainer.predict(datasets.Dataset.from_dict(inputs))
        start_logits, end_logits = output.predictions[:2]
        predictions, nbest, null_odds = postprocess_qa_predictions(
            evaluation, meta, start_logits, end_logits, args.version_2_with_negative, args.n_best_size,
            args.max_answer_length, args.null_score_diff_threshold)
        scores = squad_evaluate(evaluation, predictions, null_odds or None, args.version_2_with_negative)
        eval_metrics = {f"eval_{key}": value for key, value in scores.items()}
        eval_metrics["eval_samples"] = len(meta)
        metrics.update(eval_metrics)
        if trainer.is_world_process_zero():
            write_json_atomically(output_dir / "predictions.json", predictions)
            write_json_atomically(output_dir / "nbest_predictions.json", nbest)
            if args.version_2_with_negative:
                write_json_atomically(output_dir / "null_odds.json", null_odds)
            write_json_atomically(output_dir / "eval_results.json", eval_metrics)
            log(f"{args.predict_file}: exact {scores['exact']:.2f}, F1 {scores['f1']:.2f} over {scores['total']} "
                f"questions ({len(meta)} windows)")
    if trainer.is_world_process_zero():
        if train is not None:
            trainer.save_state()
        write_json_atomically(output_dir / "all_results.json", {"model": str(args.model), **metrics})
    return metrics
