"""Fine-tuning for understanding tasks: finetune_glue (GLUE on Trainer), finetune_squad (SQuAD v1.1/v2.0),
evaluate_downstream (a table per checkpoint). Tiny random models built here (no download); the
command-line runs are subprocesses with one thread (seconds each on 2 cores)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("sklearn")
pytest.importorskip("scipy")
pytest.importorskip("accelerate")

from pmlm_testing import run_module  # noqa: E402
from megatron_pmlm import evaluate_downstream, finetune_glue, finetune_squad  # noqa: E402
from megatron_pmlm.config import model_config_from_preset  # noqa: E402
from megatron_pmlm.tasks import glue  # noqa: E402
from megatron_pmlm.tasks.glue import TASKS, glue_metrics, read_glue_folder  # noqa: E402
from megatron_pmlm.tasks.hf_trainer import InputError, load_tokenizer  # noqa: E402
from megatron_pmlm.tasks.squad import (compute_exact, compute_f1, normalize_answer,  # noqa: E402
                                       postprocess_qa_predictions, prepare_train_features,
                                       prepare_validation_features, read_squad, squad_evaluate)
from megatron_pmlm.hf import convert, pmlm_adapter  # noqa: E402
from megatron_pmlm.models.model import PMLMForPreTraining  # noqa: E402


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, bert_vocab) -> Path:
    """A random tiny PMLM (relative position bias on) as a converted folder with the real vocabulary."""
    config = model_config_from_preset("tiny", vocab_size=30522)
    model = PMLMForPreTraining(config, init_seed=3)
    folder = tmp_path_factory.mktemp("glue-squad") / "tiny_hf"
    pmlm_adapter.write_hf_folder(folder, pmlm_adapter.to_hf_state_dict(model.state_dict(), config), config, bert_vocab)
    return folder


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory, tiny_model) -> Path:
    """The same model as a checkpoint directory of ours (what a pre-training --save holds)."""
    save = tmp_path_factory.mktemp("glue-ckpt") / "save"
    convert.import_from_hf(tiny_model, save, log=lambda message: None)
    assert (save / "latest").is_file()
    return save


@pytest.fixture(scope="module")
def glue_dir(shared_data) -> Path:
    folder = shared_data / "glue"
    if not (folder / "MRPC" / "train.tsv").is_file() or not (folder / "RTE" / "train.tsv").is_file():
        pytest.skip(f"{folder}/MRPC or RTE is absent")
    return folder


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


def results(folder: Path, name: str = "all_results.json") -> dict:
    return json.loads((folder / name).read_text())


# ------------------------------------------------------------------------------------------------
# GLUE
# ------------------------------------------------------------------------------------------------

def test_mrpc_twenty_steps_write_trainer_metrics(tiny_model, glue_dir, tmp_path):
    out = tmp_path / "mrpc"
    result = run_module("megatron_pmlm.finetune_glue", "--model", str(tiny_model), "--task", "mrpc", "--data-dir",
                        str(glue_dir), "--output-dir", str(out), "--max-steps", "20", "--max-train-samples", "320",
                        "--per-device-train-batch-size", "16", "--logging-steps", "5", "--disable-tqdm", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = results(out)
    assert metrics["task"] == "mrpc" and metrics["train_samples"] == 320 and metrics["eval_samples"] == 408
    for name in ("eval_accuracy", "eval_f1", "eval_combined_score", "eval_loss", "train_loss", "train_runtime"):
        assert isinstance(metrics[name], float), name
    assert 0.0 <= metrics["eval_accuracy"] <= 1.0 and 0.0 <= metrics["eval_f1"] <= 1.0
    assert metrics["eval_combined_score"] == pytest.approx((metrics["eval_accuracy"] + metrics["eval_f1"]) / 2)
    assert results(out, "eval_results.json")["eval_accuracy"] == metrics["eval_accuracy"]
    state = results(out, "trainer_state.json")
    assert state["global_step"] == 20 and [r["step"] for r in state["log_history"] if "loss" in r] == [5, 10, 15, 20]
    # The fine-tuned classifier, with its labels and the remote code (the relative position bias).
    config = results(out, "config.json")
    assert config["id2label"] == {"0": "not_equivalent", "1": "equivalent"} and config["rel_pos_bins"] == 32
    assert (out / "modeling_pmlm.py").is_file() and (out / "vocab.txt").is_file()
    assert "mrpc dev: accuracy" in result.stdout
    assert not list(out.glob(".*.tmp")) and not list(out.glob("checkpoint-*"))


def test_metric_functions_on_hand_checkable_inputs():
    # STS-B: x = 1..5, y = 1,2,3,5,4: Pearson = 9 / sqrt(10 * 10) = 0.9; Spearman = 1 - 6 * 2 / (5 * 24) = 0.9.
    stsb = glue_metrics("stsb", np.array([[1.0], [2.0], [3.0], [4.0], [5.0]]), np.array([1.0, 2.0, 3.0, 5.0, 4.0]))
    assert stsb == pytest.approx({"pearson": 0.9, "spearmanr": 0.9, "combined_score": 0.9})
    assert glue_metrics("sts-b", np.array([1.0, 2, 3]), np.array([3.0, 2, 1]))["pearson"] == pytest.approx(-1.0)
    # Spearman uses ranks only: monotone but not linear.
    monotone = glue_metrics("stsb", np.array([1.0, 2, 3, 10]), np.array([0.0, 1, 2, 3]))
    assert monotone["spearmanr"] == pytest.approx(1.0) and monotone["pearson"] < 0.95
    # CoLA: labels 1,1,0,0, predictions 1,0,0,0: TP 1, FN 1, TN 2, FP 0 -> MCC = 2 / sqrt(1*2*2*3).
    logits = np.array([[0.0, 1.0], [1.0, 0.0], [1.0, 0.0], [2.0, -1.0]])
    cola = glue_metrics("cola", logits, np.array([1, 1, 0, 0]))
    assert cola == pytest.approx({"matthews_correlation": 2 / np.sqrt(12)})
    assert glue_metrics("cola", np.array([[1.0, 0.0]] * 4), np.array([1, 1, 0, 0]))["matthews_correlation"] == 0.0
    # MRPC: predictions 1,0,1,0 against 1,1,0,0: accuracy 0.5, precision 0.5, recall 0.5, F1 0.5.
    mrpc = glue_metrics("mrpc", np.array([[0.0, 1], [1, 0], [0, 1], [1, 0]]), np.array([1, 1, 0, 0]))
    assert mrpc == pytest.approx({"accuracy": 0.5, "f1": 0.5, "combined_score": 0.5})
    # F1 of the positive class: none predicted -> 0, without a warning turning into an error.
    assert glue_metrics("qqp", np.array([[1.0, 0.0]] * 3), np.array([1, 0, 0]))["f1"] == 0.0
    assert glue_metrics("mnli", np.array([[0, 0, 1.0], [1.0, 0, 0]]), np.array([2, 1])) == {"accuracy": 0.5}


GLUE_FILES = {  # GLUE's original layouts: a header (except CoLA), each task's own columns and labels
    "cola": ("CoLA", {"train.tsv": "gj04\t1\t\tOur friends won't buy this analysis.\ngj04\t0\t*\tThey drank the pub.\n",
                      "dev.tsv": "cj99\t1\t\tThe sailors rode the breeze.\n"},
             ("Our friends won't buy this analysis.", None, 1), [1, 0]),
    "sst2": ("SST-2", {"train.tsv": "sentence\tlabel\nit 's a charming journey . \t1\nbad .\t0\n",
                       "dev.tsv": "sentence\tlabel\ngood .\t1\n"}, ("it 's a charming journey . ", None, 1), [1, 0]),
    "mrpc": ("MRPC", {"train.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t7\t8\tHe said \" no .\tHe "
                                   "denied it .\n0\t1\t2\tA b\tC d\n",
                      "dev.tsv": "\ufeffQuality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t3\t4\tX\tY\n"},
             ("He said \" no .", "He denied it .", 1), [1, 0]),
    "qqp": ("QQP", {"train.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n5\t1\t2\tHow?\tWhy?\t0\n",
                    "dev.tsv": "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n6\t3\t4\tA?\tA?\t1\n"},
            ("How?", "Why?", 0), [0]),
    "stsb": ("STS-B", {"train.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
                                    "\tscore\n0\tmain-captions\tMSRvid\t2012test\t0001\tnone\tnone\tA plane is taking"
                                    " off.\tAn air plane is taking off.\t5.000\n1\tg\tf\ty\t2\tn\tn\tA\tB\t0.5\n",
                       "dev.tsv": "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2"
                                  "\tscore\n0\tg\tf\ty\t1\tn\tn\tC\tD\t3.2\n"},
             ("A plane is taking off.", "An air plane is taking off.", 5.0), [5.0, 0.5]),
    "mnli": ("MNLI", {"train.tsv": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\t"
                                   "sentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n"
                                   "0\t1\t1n\tgov\t( a )\t( b )\t(A)\t(B)\tPremise.\tHypothesis.\tneutral\tneutral\n"
                                   "1\t2\t2c\tgov\t( a )\t( b )\t(A)\t(B)\tP.\tH.\tcontradiction\tcontradiction\n",
                      "dev_matched.tsv": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse"
                                         "\tsentence1_parse\tsentence2_parse\tsentence1\tsentence2\tlabel1\tlabel2\t"
                                         "label3\tlabel4\tlabel5\tgold_label\n0\t1\t1e\tfic\t(a)\t(b)\t(A)\t(B)\tS.\tT."
                                         "\tentailment\tentailment\tneutral\tentailment\tentailment\tentailment\n",
                      "dev_mismatched.tsv": "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\t"
                                            "sentence2_binary_parse\tsentence1_parse\tsentence2_parse\tsentence1\t"
                                            "sentence2\tlabel1\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n0\t1\t1e\t"
                                            "x\t(a)\t(b)\t(A)\t(B)\tU.\tV.\tneutral\tneutral\tneutral\tneutral\t"
                                            "neutral\tneutral\n"},
             ("Premise.", "Hypothesis.", 1), [1, 2]),
    "qnli": ("QNLI", {"train.tsv": "index\tquestion\tsentence\tlabel\n0\tWho?\tHim.\tnot_entailment\n",
                      "dev.tsv": "index\tquestion\tsentence\tlabel\n0\tQ?\tS.\tentailment\n"},
             ("Who?", "Him.", 1), [1]),
    "rte": ("RTE", {"train.tsv": "index\tsentence1\tsentence2\tlabel\n0\tNo WMD found.\tWMD found.\tnot_entailment\n"
                                 "1\tA.\tB.\tentailment\n",
                    "dev.tsv": "index\tsentence1\tsentence2\tlabel\n0\tC.\tD.\tentailment\n"},
            ("No WMD found.", "WMD found.", 1), [1, 0]),
}


def write_glue(root: Path, task: str) -> Path:
    folder_name, files, _, _ = GLUE_FILES[task]
    folder = root / folder_name
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


@pytest.mark.parametrize("task", sorted(GLUE_FILES))
def test_each_task_reads_its_own_glue_layout(task, tmp_path):
    folder = write_glue(tmp_path, task)
    _, _, (text_a, text_b, label), labels = GLUE_FILES[task]
    for data_dir in (tmp_path, folder):  # the GLUE folder or the task's own
        splits = read_glue_folder(data_dir, TASKS[task])
        train = splits["train"]
        assert (train.text_a[0], train.text_b[0] if train.text_b else None, train.labels[0]) == (text_a, text_b, label)
        assert train.labels == labels and len(splits["validation"]) == 1
    if task == "mnli":  # dev = dev_matched; the mismatched set is evaluated too (run_glue's _mm metrics)
        assert splits["validation"].text_a == ["S."] and splits["validation"].labels == [0]
        assert splits["validation_mismatched"].text_a == ["U."]
    else:
        assert "validation_mismatched" not in splits


def test_saved_dataset_dict_regression_end_to_end(tiny_model, tmp_path):
    """--dataset: a DatasetDict with the Hub's GLUE columns (STS-B: a float label, regression head)."""
    import datasets

    rng = np.random.default_rng(0)
    words = ["a", "man", "is", "playing", "guitar", "woman", "dog", "runs", "the", "cat"]

    def split(count):
        return datasets.Dataset.from_dict({
            "sentence1": [" ".join(rng.choice(words, 6)) for _ in range(count)],
            "sentence2": [" ".join(rng.choice(words, 5)) for _ in range(count)],
            "label": [float(x) for x in rng.uniform(0, 5, count)], "idx": list(range(count))})

    datasets.DatasetDict({"train": split(24), "validation": split(12), "test": split(4)}).save_to_disk(tmp_path / "stsb")
    out = tmp_path / "out"
    result = run_module("megatron_pmlm.finetune_glue", "--model", str(tiny_model), "--task", "stsb", "--dataset",
                        str(tmp_path / "stsb"), "--output-dir", str(out), "--max-steps", "3",
                        "--per-device-train-batch-size", "8", "--no-save-model", "--disable-tqdm", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    metrics = results(out)
    assert metrics["eval_samples"] == 12 and metrics["train_samples"] == 24
    assert -1.0 <= metrics["eval_pearson"] <= 1.0 and -1.0 <= metrics["eval_spearmanr"] <= 1.0
    assert not (out / "config.json").exists()  # --no-save-model
    assert not list((tmp_path / "stsb").rglob("cache-*.arrow"))  # the user's dataset folder is left alone


def test_torchrun_trains_data_parallel_with_the_right_loss_scale(tiny_checkpoint, glue_dir, tmp_path):
    """Two CPU processes: one conversion of the checkpoint directory, one copy of the results, and the
    loss a mean (Trainer would otherwise multiply it, and the gradients, by the number of processes)."""
    out = tmp_path / "ddp"
    result = run_module("megatron_pmlm.finetune_glue", "--model", str(tiny_checkpoint), "--task", "rte",
                        "--data-dir", str(glue_dir), "--output-dir", str(out), "--max-steps", "2",
                        "--max-train-samples", "32", "--max-eval-samples", "32", "--per-device-train-batch-size", "8",
                        "--no-save-model", "--disable-tqdm", nproc=2, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count(f"wrote {out / 'model'}") == 1
    assert result.stdout.count("rte dev: accuracy") == 1
    metrics = results(out)
    assert metrics["epoch"] == pytest.approx(1.0)  # 2 steps x 8 x 2 processes = the 32 examples
    assert 0.5 < metrics["train_loss"] < 1.0 and 0.5 < metrics["eval_loss"] < 1.0  # ~ln 2, not 2 ln 2
    assert results(out / "model", "config.json")["checkpoint_tag"] == "iter_0000000"


# ------------------------------------------------------------------------------------------------
# SQuAD
# ------------------------------------------------------------------------------------------------

PARAGRAPHS = [
    ("The Tower of London was built in 1078 by William the Conqueror. It is a castle on the River Thames.",
     [("q1", "When was the Tower of London built?", ["1078"]),
      ("q2", "Who built the Tower?", ["William the Conqueror", "William"])]),
    ("Paris is the capital of France. It lies on the Seine.",
     [("q3", "Which river does Paris lie on?", ["the Seine"])]),
]
UNANSWERABLE = ("Rain fell all day over the quiet valley.", "q4", "Who won the election?")


def squad_json(path: Path, version_2: bool = False) -> Path:
    paragraphs = []
    for index, (context, questions) in enumerate(PARAGRAPHS):
        qas = [{"id": qid, "question": question,
                "answers": [{"text": text, "answer_start": context.index(text)} for text in answers]}
               for qid, question, answers in questions]
        if version_2:
            for qa in qas:
                qa["is_impossible"] = False
        paragraphs.append({"context": context, "qas": qas})
    if version_2:
        context, qid, question = UNANSWERABLE
        paragraphs.append({"context": context, "qas": [{"id": qid, "question": question, "answers": [],
                                                        "is_impossible": True, "plausible_answers": [
                                                            {"text": "Rain", "answer_start": 0}]}]})
    path.write_text(json.dumps({"version": "v2.0" if version_2 else "1.1",
                                "data": [{"title": "Synthetic", "paragraphs": paragraphs}]}))
    return path


SQUAD_RUN = ("--max-steps", "60", "--learning-rate", "3e-3", "--warmup-ratio", "0", "--per-device-train-batch-size",
             "4", "--max-seq-length", "64", "--doc-stride", "16", "--max-query-length", "16", "--disable-tqdm")


@pytest.mark.parametrize("version_2", [False, True], ids=["v1.1", "v2.0"])
def test_squad_script_scores_what_a_hand_computation_gives(version_2, tiny_model, tmp_path):
    """Trained on the 3 (4) questions it is asked: it memorises them, and the official definitions
    give EM = F1 = 100 (q2 matches its first gold answer; v2.0's q4 is answered with nothing)."""
    data = squad_json(tmp_path / "squad.json", version_2)
    out = tmp_path / "out"
    flag = ("--version-2-with-negative",) if version_2 else ()
    result = run_module("megatron_pmlm.finetune_squad", "--model", str(tiny_model), "--train-file", str(data),
                        "--predict-file", str(data), "--output-dir", str(out), *flag, *SQUAD_RUN, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    predictions = json.loads((out / "predictions.json").read_text())
    expected = {"q1": "1078", "q2": "William the Conqueror", "q3": "the Seine"}
    if version_2:
        expected["q4"] = ""
    assert predictions == expected
    metrics = results(out)
    total = 4 if version_2 else 3
    assert metrics["eval_exact"] == metrics["eval_f1"] == 100.0 and metrics["eval_total"] == total
    assert metrics["train_samples"] == total and metrics["eval_samples"] == total  # one window each
    nbest = json.loads((out / "nbest_predictions.json").read_text())
    assert nbest["q1"][0]["text"] == "1078" and len(nbest["q1"]) <= 20 + version_2  # v2.0: + the null answer
    assert sum(c["probability"] for c in nbest["q1"]) == pytest.approx(1.0)
    if version_2:
        assert (metrics["eval_HasAns_exact"], metrics["eval_HasAns_total"]) == (100.0, 3)
        assert (metrics["eval_NoAns_exact"], metrics["eval_NoAns_f1"], metrics["eval_NoAns_total"]) == (100.0, 100.0, 1)
        odds = json.loads((out / "null_odds.json").read_text())
        assert odds["q4"] > 0 > max(odds[q] for q in ("q1", "q2", "q3"))
        assert metrics["eval_best_exact"] == 100.0
    else:
        assert "eval_HasAns_exact" not in metrics and not (out / "null_odds.json").exists()
    assert results(out, "eval_results.json")["eval_exact"] == 100.0
    if not version_2:  # evaluation alone, of the fine-tuned folder (with vocab.txt, so it loads as --model)
        again = tmp_path / "again"
        result = run_module("megatron_pmlm.finetune_squad", "--model", str(out), "--predict-file", str(data),
                            "--output-dir", str(again), *SQUAD_RUN[-7:], timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert json.loads((again / "predictions.json").read_text()) == expected
        assert results(again)["eval_exact"] == 100.0 and "train_loss" not in results(again)

    # Predictions changed by hand, scored as computed by hand: q1 'in 1078' against '1078' is not
    # exact, F1 = 2 * (1/2 * 1) / (1/2 + 1) = 2/3; q3 'Seine' against 'the Seine' is exact (article).
    hand = {**expected, "q1": "in 1078", "q3": "Seine"}
    scores = squad_evaluate(read_squad(data, version_2), hand, version_2_with_negative=version_2)
    assert scores["exact"] == pytest.approx(100 * (total - 1) / total)
    assert scores["f1"] == pytest.approx(100 * (total - 1 + 2 / 3) / total)


def test_normalize_exact_f1_official_definitions():
    assert normalize_answer("  The  Cat, sat!  ") == "cat sat"
    assert normalize_answer("An apple a day") == "apple day"
    assert normalize_answer("theatre") == "theatre"  # whole words only
    assert compute_exact("The Seine", "seine.") == 1 and compute_exact("Seine", "River Seine") == 0
    # gold [cat, sat], prediction [cat, sat, on, mat]: precision 1/2, recall 1 -> F1 2/3
    assert compute_f1("the cat sat", "cat sat on the mat") == pytest.approx(2 / 3)
    assert compute_f1("cat", "dog") == 0.0
    assert compute_f1("", "") == 1.0 and compute_f1("", "x") == 0.0 and compute_f1("x", "") == 0.0
    examples = [{"id": "a", "answers": {"text": ["William the Conqueror", "William"], "answer_start": [0, 0]}},
                {"id": "b", "answers": {"text": [], "answer_start": []}},
                {"id": "c", "answers": {"text": ["the"], "answer_start": [0]}}]  # normalises to '': unanswerable
    scores = squad_evaluate(examples, {"a": "the Conqueror", "b": "", "c": "x"}, version_2_with_negative=True)
    # a: exact 0, F1 max(2 * (1 * 1/2) / (3/2) = 2/3 vs 'William' 0) = 2/3; b: 1, 1; c: 0, 0
    assert scores["exact"] == pytest.approx(100 / 3) and scores["f1"] == pytest.approx(100 * (2 / 3 + 1) / 3)
    assert scores["HasAns_total"] == 1 and scores["NoAns_total"] == 2
    assert scores["HasAns_f1"] == pytest.approx(200 / 3) and scores["NoAns_exact"] == 50.0
    # evaluate-v2.0.py's best threshold on the null odds ('' above it; the search starts at 0.0 with
    # every answer ''): b and c get '' (both right), a keeps its answer: exact 2 of 3 (no better than
    # all '', so the threshold stays 0.0); F1 (2/3 + 1 + 1) / 3, first reached at a's odds, -1.
    best = squad_evaluate(examples, {"a": "the Conqueror", "b": "", "c": "x"}, {"a": -1.0, "b": 1.0, "c": 2.0}, True)
    assert best["best_exact"] == pytest.approx(200 / 3) and best["best_exact_thresh"] == 0.0
    assert best["best_f1"] == pytest.approx(100 * (2 / 3 + 2) / 3) and best["best_f1_thresh"] == -1.0
    # A missing prediction counts as '' (wrong for an answerable question).
    assert squad_evaluate(examples[:1], {})["exact"] == 0.0


CONTEXT = "The cat sat on the mat."
OFFSETS = [None, None, None, (0, 3), (4, 7), (8, 11), (12, 14), (15, 18), (19, 22), (22, 23), None]
#          [CLS] q     [SEP] The     cat     sat      on        the       mat       .         [SEP]


def logits(peaks: dict[int, float], length: int = len(OFFSETS)) -> np.ndarray:
    row = np.zeros(length)
    for index, value in peaks.items():
        row[index] = value
    return row


def test_postprocessing_on_crafted_logits():
    examples = [{"id": "x", "context": CONTEXT}]
    features = [{"example_index": 0, "offset_mapping": OFFSETS}]
    start, end = logits({7: 5.0, 4: 3.0}), logits({8: 4.0, 5: 3.5})
    predictions, nbest, _ = postprocess_qa_predictions(examples, features, start[None], end[None])
    assert predictions == {"x": "the mat"}  # 5 + 4
    assert [c["text"] for c in nbest["x"][:3]] == ["the mat", "cat sat on the mat", "cat sat"]  # 5+4, 3+4, 3+3.5
    # A longest answer of 1 token: the best single-token spans.
    predictions, _, _ = postprocess_qa_predictions(examples, features, start[None], end[None], max_answer_length=1)
    assert predictions == {"x": "the"}  # 'the'=5+0 beats 'mat'=0+4
    # An end before its start is never an answer (8 -> 5 would score 18), nor a span from or to a token
    # outside the passage (question 1 -> [SEP] 10: 40; 8 -> 10: 29); padded columns (-100) are ignored.
    start, end = logits({8: 9.0, 1: 20.0}), logits({5: 9.0, 10: 20.0, 8: 1.0})
    padded = [np.concatenate([start, [-100.0] * 3])], [np.concatenate([end, [-100.0] * 3])]
    predictions, _, _ = postprocess_qa_predictions(examples, features, *map(np.array, padded))
    assert predictions == {"x": "mat"}  # 9 + 1, above every span ending at 'sat' (0 + 9)


def test_postprocessing_null_answer_threshold_and_windows():
    examples = [{"id": "x", "context": CONTEXT}]
    features = [{"example_index": 0, "offset_mapping": OFFSETS}]
    start, end = logits({0: 6.0, 7: 3.0}), logits({0: 4.0, 8: 2.0})
    # null 6 + 4 = 10, best span 'the mat' 3 + 2 = 5: difference 5 > 0 -> ''
    predictions, nbest, diff = postprocess_qa_predictions(examples, features, start[None], end[None], True)
    assert predictions == {"x": ""} and diff == {"x": pytest.approx(5.0)} and nbest["x"][0]["text"] == ""
    predictions, _, _ = postprocess_qa_predictions(examples, features, start[None], end[None], True,
                                                   null_score_diff_threshold=5.5)
    assert predictions == {"x": "the mat"}
    # v1.1 ignores the null score.
    assert postprocess_qa_predictions(examples, features, start[None], end[None])[0] == {"x": "the mat"}
    # Two windows of one question: the best span over both; the null score is the lowest of the windows.
    second = {"example_index": 0, "offset_mapping": [None, None, None, None, (8, 11), (12, 14), (15, 18), (19, 22),
                                                     (22, 23), None, None]}
    starts = np.stack([logits({0: 1.0, 7: 1.0}), logits({0: 3.0, 5: 4.0})])
    ends = np.stack([logits({0: 1.0, 8: 1.0}), logits({0: 3.0, 7: 4.0})])
    predictions, _, diff = postprocess_qa_predictions(examples, [features[0], second], starts, ends, True)
    assert predictions == {"x": "on the mat"} and diff == {"x": pytest.approx(2.0 - 8.0)}


def test_train_and_validation_features_across_windows(tokenizer):
    context = ("Long before the castle, the site was a Roman settlement on the river. " * 3 +
               "The Tower of London was built in 1078 by William the Conqueror. " +
               "Later kings added walls, moats and towers over several centuries. " * 3)
    question = "Who built the Tower of London in the year after the long war that began with many battles?"
    examples = [{"id": "a", "question": "   " + question, "context": context,
                 "answers": {"text": ["William the Conqueror"], "answer_start": [context.index("William")]}}]
    features = prepare_train_features(examples, tokenizer, max_seq_length=48, doc_stride=12, max_query_length=8)
    windows = len(features["input_ids"])
    assert windows > 3 and all(len(ids) <= 48 for ids in features["input_ids"])
    hits = 0
    for ids, types, start, end in zip(features["input_ids"], features["token_type_ids"], features["start_positions"],
                                      features["end_positions"]):
        assert sum(1 for t in types if t == 0) == 1 + 8 + 1  # [CLS] + the question cut to 8 tokens + [SEP]
        if start == 0:
            assert end == 0  # the window does not hold the whole answer: [CLS]
        else:
            hits += 1
            assert tokenizer.decode(ids[start:end + 1]) == "william the conqueror"
    assert hits >= 1 and hits < windows
    inputs, meta = prepare_validation_features(examples, tokenizer, max_seq_length=48, doc_stride=12,
                                               max_query_length=8)
    assert inputs["input_ids"] == features["input_ids"] and all(m["example_index"] == 0 for m in meta)
    # Logits pointing at the answer in the window that holds it give the passage's own text back.
    starts = np.full((windows, 48), -5.0)
    ends = np.full((windows, 48), -5.0)
    window = next(i for i, s in enumerate(features["start_positions"]) if s)
    starts[window, features["start_positions"][window]] = 5.0
    ends[window, features["end_positions"][window]] = 5.0
    predictions, _, _ = postprocess_qa_predictions(examples, meta, starts, ends)
    assert predictions == {"a": "William the Conqueror"}
    # An unanswerable question (v2.0): [CLS] in every window.
    examples[0]["answers"] = {"text": [], "answer_start": []}
    features = prepare_train_features(examples, tokenizer, max_seq_length=48, doc_stride=12, max_query_length=8)
    assert set(features["start_positions"]) == set(features["end_positions"]) == {0}


# ------------------------------------------------------------------------------------------------
# evaluate_downstream
# ------------------------------------------------------------------------------------------------

def test_evaluate_downstream_mrpc_rte_from_a_checkpoint_directory(tiny_checkpoint, glue_dir, tmp_path):
    output = tmp_path / "eval" / "results.md"
    result = run_module("megatron_pmlm.evaluate_downstream", "--model", str(tiny_checkpoint), "--tasks", "mrpc,rte",
                        "--output", str(output), "--data-dir", str(glue_dir), "--max-steps", "3", "--seeds", "1,2",
                        "--max-train-samples", "48", "--max-eval-samples", "40", "--per-device-train-batch-size", "8",
                        timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert table["hf_folder"] == str(tmp_path / "eval" / "results-runs" / "model")  # converted once
    assert [(r["task"], r["metric"]) for r in table["rows"]] == [("mrpc", "accuracy"), ("mrpc", "f1"),
                                                                 ("rte", "accuracy")]
    for row in table["rows"]:
        assert row["seeds"] == [1, 2] and len(row["values"]) == 2
        assert row["mean"] == pytest.approx(np.mean(row["values"]))
        assert row["std"] == pytest.approx(np.std(row["values"], ddof=1))
        assert row["min"] == min(row["values"]) and 0.0 <= row["min"] <= row["max"] <= 100.0
        task = row["task"]
        assert row["values"] == [pytest.approx(100 * table["runs"][task][str(s)][f"eval_{row['metric']}"])
                                 for s in (1, 2)]
    assert table["runs"]["rte"]["1"]["eval_samples"] == 40 and table["settings"]["max_steps"] == 3
    markdown = output.read_text()
    assert "| task | metric | mean | std | min | max | seeds |" in markdown
    rte = table["rows"][2]
    assert f"| rte | accuracy | {rte['mean']:.2f} | {rte['std']:.2f} | {rte['min']:.2f} | {rte['max']:.2f} | 1,2 |" \
        in markdown
    for task in ("mrpc", "rte"):
        for seed in (1, 2):
            assert (tmp_path / "eval" / "results-runs" / task / f"seed-{seed}" / "all_results.json").is_file()


def test_evaluate_downstream_question_generation(tiny_model, shared_data, tmp_path):
    if not (shared_data / "qg" / "src-dev.txt").is_file():
        pytest.skip("the QG data is absent")
    output = tmp_path / "qg.md"
    result = run_module("megatron_pmlm.evaluate_downstream", "--model", str(tiny_model), "--tasks", "qg",
                        "--output", str(output), "--max-steps", "2", "--seeds", "7", "--qg-train-limit", "16",
                        "--qg-dev-limit", "4", "--qg-finetune-args",
                        "--max-source-length 48 --max-target-length 12 --micro-batch-size 8 --global-batch-size 8",
                        "--qg-decode-args", "--max-target-length 8 --beam-size 2", timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    table = json.loads((tmp_path / "qg.json").read_text())
    assert [(r["task"], r["metric"], r["seeds"]) for r in table["rows"]] == \
        [("qg", "bleu4", [7]), ("qg", "meteor", [7]), ("qg", "rougeL", [7])]
    scores = json.loads((tmp_path / "qg-runs" / "qg" / "seed-7" / "scores.json").read_text())
    assert scores["benchmark"] == "qg" and scores["qg_reference"] == "du"  # eval_s2s --benchmark qg
    assert (scores["meteor"] is None) == ("meteor_unavailable" in scores)
    runs = tmp_path / "qg-runs" / "qg"
    qg = shared_data / "qg"
    sources = qg.joinpath("src-dev.txt").read_text(encoding="utf-8").splitlines()
    # the split: training from the first 9,570 pairs, evaluation from the last 1,000
    assert (runs / "data" / "train.src").read_text(encoding="utf-8").splitlines() == sources[:16]
    assert (runs / "data" / "dev.src").read_text(encoding="utf-8").splitlines() == sources[-1000:][:4]
    assert len((runs / "seed-7" / "dev.pred").read_text().split("\n")) in (4, 5)
    assert table["runs"]["qg"]["7"]["examples"] == 4
    assert "| qg | bleu4 |" in output.read_text()


def test_qg_split_sizes(tmp_path):
    (tmp_path / "src-dev.txt").write_text("".join(f"s{i}\n" for i in range(10570)))
    (tmp_path / "tgt-dev.txt").write_text("".join(f"t{i}\n" for i in range(10570)))
    split = evaluate_downstream.read_qg(tmp_path, None, None)
    assert len(split["train"][0]) == 9570 and split["train"][0][-1] == "s9569"
    assert len(split["dev"][1]) == 1000 and split["dev"][1][0] == "t9570"


# ------------------------------------------------------------------------------------------------
# Bad input: exit 2, one line, nothing written
# ------------------------------------------------------------------------------------------------

def model_without_vocab(tiny_model: Path, tmp_path: Path) -> Path:
    """Neither vocab.txt nor tokenizer.json (where save_pretrained keeps the vocabulary)."""
    folder = tmp_path / "novocab"
    shutil.copytree(tiny_model, folder)
    (folder / "vocab.txt").unlink()
    (folder / "tokenizer.json").unlink()
    return folder


def bad_rte(tmp_path: Path, train: str) -> Path:
    folder = tmp_path / "RTE"
    folder.mkdir()
    (folder / "train.tsv").write_text(train)
    (folder / "dev.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\tC.\tD.\tentailment\n")
    return folder


def broken_checkpoint(tmp_path: Path) -> Path:
    folder = tmp_path / "broken"
    (folder / "iter_0000001").mkdir(parents=True)
    (folder / "latest").write_text("iter_0000009")
    return folder


HEADER = "index\tsentence1\tsentence2\tlabel\n"
GLUE_BAD = {
    "unknown task": (lambda tmp: ["--task", "wnli2", "--data-dir", str(bad_rte(tmp, HEADER + "0\tA\tB\tentailment\n"))],
                     "error: unknown task 'wnli2' (choose from cola, sst2, mrpc, qqp, stsb, mnli, qnli, rte)"),
    "missing columns": (lambda tmp: ["--task", "rte", "--data-dir", str(bad_rte(tmp, HEADER + "0\tA\tB\tentailment\n1\t"
                                                                              "only one sentence\n"))],
                        "RTE/train.tsv:3: 2 tab-separated fields, no column 'sentence2', 'label' (rte needs 4)"),
    "header without the column": (lambda tmp: ["--task", "rte", "--data-dir",
                                               str(bad_rte(tmp, "index\tsentence1\tsentence2\tgold\n0\tA\tB\tentailment\n"))],
                                  "RTE/train.tsv:1: no column 'label' in the header (index, sentence1, sentence2, gold)"),
    "label outside the set": (lambda tmp: ["--task", "rte", "--data-dir",
                                           str(bad_rte(tmp, HEADER + "0\tA\tB\tentailment\n1\tA\tB\tmaybe\n"))],
                              "RTE/train.tsv:3: label 'maybe' is not one of rte's labels (entailment, not_entailment)"),
    "checkpoint that does not convert": (lambda tmp: ["--task", "rte", "--data-dir",
                                                      str(bad_rte(tmp, HEADER + "0\tA\tB\tentailment\n")),
                                                      "--model", str(broken_checkpoint(tmp))],
                                         "latest names 'iter_0000009' but"),
    "a file missing": (lambda tmp: ["--task", "mrpc", "--data-dir", str(bad_rte(tmp, HEADER).parent)],
                       "holds neither train.tsv nor MRPC/train.tsv"),
}


@pytest.mark.parametrize("case", sorted(GLUE_BAD))
def test_finetune_glue_bad_input(case, tiny_model, tmp_path, capsys):
    make_args, message = GLUE_BAD[case]
    out = tmp_path / "out"
    code = finetune_glue.main(["--model", str(tiny_model), "--output-dir", str(out), *make_args(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert not out.exists()


def test_command_lines_bad_input_exit_2_without_traceback(tiny_model, tmp_path):
    """Through the real entry points (subprocesses): one `error:` line, exit status 2, nothing written."""
    no_vocab = model_without_vocab(tiny_model, tmp_path)
    rte = bad_rte(tmp_path, HEADER + "0\tA\tB\tentailment\n")
    squad = squad_json(tmp_path / "squad.json")
    not_squad = tmp_path / "not-squad.json"
    not_squad.write_text(json.dumps({"version": "1.1", "articles": []}))
    cases = [
        ("megatron_pmlm.finetune_glue", ["--model", str(no_vocab), "--task", "rte", "--data-dir", str(rte),
                                         "--output-dir", "OUT"], f"--model {no_vocab}: {no_vocab} has no vocabulary (neither vocab.txt nor tokenizer.json)"),
        ("megatron_pmlm.finetune_squad", ["--model", str(tiny_model), "--train-file", str(not_squad), "--output-dir",
                                          "OUT"], f"--train-file {not_squad} is not SQuAD JSON: the top level has no "
                                                  "'data' list of articles"),
        ("megatron_pmlm.finetune_squad", ["--model", str(no_vocab), "--predict-file", str(squad), "--output-dir",
                                          "OUT"], "has no vocabulary"),
        ("megatron_pmlm.evaluate_downstream", ["--model", str(tiny_model), "--tasks", "mrpc,squad3", "--output",
                                               "OUT/r.md"], "error: unknown task 'squad3' (choose from cola, sst2, mrpc, "
                                                            "qqp, stsb, mnli, qnli, rte, qg)"),
        ("megatron_pmlm.evaluate_downstream", ["--model", str(no_vocab), "--tasks", "rte", "--data-dir", str(tmp_path),
                                               "--output", "OUT/r.md"], "has no vocabulary"),
    ]
    for index, (module, args, message) in enumerate(cases):
        out = tmp_path / f"out{index}"
        args = [str(out) if a == "OUT" else str(out / "r.md") if a == "OUT/r.md" else a for a in args]
        result = run_module(module, *args, timeout=120)
        assert result.returncode == 2, (module, result.stdout[-2000:], result.stderr[-2000:])
        lines = result.stderr.strip().splitlines()
        assert message in lines[-1] and lines[-1].startswith("error: "), (module, result.stderr[-2000:])
        assert "Traceback" not in result.stderr
        assert not out.exists(), module


SQUAD_BAD = {
    "not JSON": ("{'data': ", "is not SQuAD JSON: not JSON (Expecting property name enclosed in double quotes, line 1)"),
    "no paragraphs": ({"data": [{"title": "x"}]}, "is not SQuAD JSON: data[0] has no 'paragraphs' list"),
    "no question": ({"data": [{"paragraphs": [{"context": "c", "qas": [{"id": "1", "answers": []}]}]}]},
                    "is not SQuAD JSON: data[0].paragraphs[0].qas[0] has no 'question'"),
    "bad answer": ({"data": [{"paragraphs": [{"context": "c", "qas": [{"id": "1", "question": "q",
                                                                       "answers": [{"text": "c"}]}]}]}]},
                   "data[0].paragraphs[0].qas[0].answers[0] needs 'text' (a string) and 'answer_start'"),
    "SQuAD 2.0 without the flag": ({"data": [{"paragraphs": [{"context": "c", "qas": [
        {"id": "u1", "question": "q", "answers": [], "is_impossible": True}]}]}]},
        "question 'u1' (data[0].paragraphs[0].qas[0]) is unanswerable (SQuAD 2.0); pass --version-2-with-negative"),
    "duplicate id": ({"data": [{"paragraphs": [{"context": "c", "qas": [
        {"id": "d", "question": "q", "answers": [{"text": "c", "answer_start": 0}]},
        {"id": "d", "question": "q", "answers": [{"text": "c", "answer_start": 0}]}]}]}]}, "question id 'd'"),
}


@pytest.mark.parametrize("case", sorted(SQUAD_BAD))
def test_finetune_squad_bad_input(case, tiny_model, tmp_path, capsys):
    content, message = SQUAD_BAD[case]
    path = tmp_path / "bad.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    out = tmp_path / "out"
    code = finetune_squad.main(["--model", str(tiny_model), "--predict-file", str(path), "--output-dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.startswith("error: ") and err.count("\n") == 1, err
    assert not out.exists()


def test_evaluate_downstream_bad_input_before_any_run(tiny_model, tmp_path, capsys):
    rte = bad_rte(tmp_path, HEADER + "0\tA\tB\tentailment\n1\tA\tB\tperhaps\n")
    good = tmp_path / "good"
    bad_rte(good.mkdir() or good, HEADER + "0\tA\tB\tentailment\n")
    cases = [
        (["--tasks", "rte", "--data-dir", str(tmp_path)], "RTE/train.tsv:3: label 'perhaps'"),
        (["--tasks", "rte", "--seeds", "1,x"], "--seeds '1,x' is not a comma-separated list of integers"),
        (["--tasks", "rte", "--data-dir", str(tmp_path / "none")], "is not a folder"),
        (["--tasks", "qg", "--qg-data-dir", str(tmp_path)], "src-dev.txt does not exist"),
        (["--tasks", "rte", "--data-dir", str(good), "--glue-args", "--no-such-option 3"],
         "--glue-args: finetune_glue does not accept --no-such-option 3"),
        (["--tasks", "rte", "--data-dir", str(good), "--glue-args", "--learning-rate x"],
         "--glue-args: argument --learning-rate: invalid float value: 'x'"),
        (["--tasks", "rte", "--data-dir", str(good), "--output", str(tmp_path / "eval" / "r.json")], "ends in .json"),
        (["--tasks", "rte", "--data-dir", str(good), "--output", "-"], "--output - is not a regular file: give --work-dir"),
        (["--tasks", "rte", "--data-dir", str(good), "--model", str(broken_checkpoint(tmp_path))],
         "latest names 'iter_0000009' but"),
    ]
    assert rte.is_dir()
    for args, message in cases:
        output = tmp_path / "eval" / "results.md"
        code = evaluate_downstream.main(["--model", str(tiny_model), "--output", str(output), *args])
        err = capsys.readouterr().err
        assert code == 2 and message in err and err.count("\n") == 1, (args, err)
        assert not (tmp_path / "eval").exists()


def test_input_error_is_a_value_error():
    assert issubclass(InputError, ValueError)
    with pytest.raises(InputError, match="unknown task 'foo'"):
        glue.get_task("foo")
    assert glue.get_task("SST-2").name == "sst2" and glue.get_task("STS-B").name == "stsb"


def test_help_names_table9(capsys):
    for module in (finetune_glue, finetune_squad):
        with pytest.raises(SystemExit):
            module.main(["--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "Table 9" in text and "--per-device-train-batch-size" in text and "--warmup-ratio" in text
    assert finetune_glue.build_parser().parse_args(["--model", "m", "--task", "rte", "--data-dir", "d",
                                                    "--output-dir", "o"]).learning_rate == 2e-5
    squad = finetune_squad.build_parser().parse_args(["--model", "m", "--output-dir", "o"])
    assert (squad.learning_rate, squad.per_device_train_batch_size, squad.num_train_epochs, squad.warmup_ratio,
            squad.weight_decay, squad.max_seq_length, squad.doc_stride, squad.max_query_length, squad.n_best_size,
            squad.max_answer_length) == (2e-5, 32, 4.0, 0.1, 0.01, 384, None, 64, 20, 30)


def test_squad_default_stride_follows_a_window_lowered_to_the_models_positions(tiny_model, tmp_path, capsys):
    """The tiny model has 128 positions: the default 384-token window is lowered to 128, and the
    default stride with it (128 x 128/384 = 42); an explicit stride too large for that window is
    refused in one line naming both."""
    data = squad_json(tmp_path / "squad.json")
    common = ["--model", str(tiny_model), "--predict-file", str(data), "--max-eval-samples", "1", "--disable-tqdm"]
    assert finetune_squad.main([*common, "--output-dir", str(tmp_path / "ok")]) == 0
    out = capsys.readouterr().out
    assert "--max-seq-length 384 exceeds the model's 128 positions: using 128, and --doc-stride 42 to match" in out
    code = finetune_squad.main([*common, "--output-dir", str(tmp_path / "bad"), "--doc-stride", "128"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1, err
    assert ("--doc-stride 128 leaves no room to move on in windows of --max-seq-length 128 (--max-seq-length 384 "
            "lowered to the model's 128 positions): it must be below 128 - --max-query-length 64 - 3 = 61") in err
    assert not (tmp_path / "bad").exists()


def test_every_fine_tuning_option_shows_its_default_in_help():
    """--help of every fine-tuning and decoding command: each option with a default shows it, and
    one computed later says what it computes to (never a bare 'None')."""
    from megatron_pmlm import decode_palm, decode_s2s, finetune_s2s
    from megatron_pmlm.tasks import squad

    parsers = {"finetune_s2s": finetune_s2s.build_parser(), "finetune_glue": glue.build_parser(),
               "finetune_squad": squad.build_parser(), "decode_s2s": decode_s2s.build_parser(),
               "decode_palm": decode_palm.build_parser()}
    for command, parser in parsers.items():
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or action.required or action.default == "==SUPPRESS==" \
                    or action.help == "==SUPPRESS==":  # positional, required, --help, hidden
                continue
            text = formatter._get_help_string(action) % {"default": action.default}
            assert "default" in text and "default: None" not in text, (command, action.option_strings, text)
        text = " ".join(parser.format_help().split())
        assert "default: None" not in text, command
    s2s_help = " ".join(parsers["finetune_s2s"].format_help().split())
    assert "--lr LR (default: 5e-05)" in s2s_help and "--max-source-length MAX_SOURCE_LENGTH (default: 464)" in s2s_help
    assert "default: 1000, s2s-ft's; a run with no more iterations than that warms up over 10% of them" in s2s_help
    assert "window x 128/384" in " ".join(parsers["finetune_squad"].format_help().split())
