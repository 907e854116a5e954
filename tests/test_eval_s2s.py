"""`python -m megatron_pmlm.eval_s2s`: ROUGE/BLEU equal hand-computed and sacrebleu's own values,
the normalisation is symmetric, bad input exits 2 without writing anything."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import sacrebleu

from megatron_pmlm.eval_s2s import evaluate, main, normalise
from pmlm_testing import run_module

QG_REFERENCES = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "qg" / "tgt-dev.txt"


def test_identical_text_scores_100():
    refs = ["which nfl team represented the afc at super bowl 50 ?", "where did super bowl 50 take place ?"]
    results = evaluate(refs, refs)
    for name in ("rouge1", "rouge2", "rougeL", "bleu4"):
        assert results[name] == pytest.approx(100.0), name
    assert results["bleu_precisions"] == pytest.approx([100.0] * 4)
    assert results["bleu_brevity_penalty"] == pytest.approx(1.0)
    assert results["examples"] == 2


def test_rouge_equals_hand_counted_overlaps():
    preds = ["the cat sat on the mat", "a quick brown fox"]
    refs = ["the cat is on the mat", "the quick fox"]
    results = evaluate(preds, refs)

    def f1(overlap, pred_len, ref_len):
        precision, recall = overlap / pred_len, overlap / ref_len
        return 2 * precision * recall / (precision + recall) if overlap else 0.0

    # Unigrams: {the x2, cat, on, mat} = 5 of 6 / 6; {quick, fox} = 2 of 4 / 3.
    assert results["rouge1"] == pytest.approx(100 * (f1(5, 6, 6) + f1(2, 4, 3)) / 2)
    # Bigrams: {the cat, on the, the mat} = 3 of 5 / 5; none in line 2.
    assert results["rouge2"] == pytest.approx(100 * (f1(3, 5, 5) + 0.0) / 2)
    # Longest common subsequence: "the cat on the mat" (5); "quick fox" (2).
    assert results["rougeL"] == pytest.approx(100 * (f1(5, 6, 6) + f1(2, 4, 3)) / 2)


def test_bleu_equals_hand_computed_values():
    # One differing last word: n-gram precisions 4/5, 3/4, 2/3, 1/2, equal lengths -> BP 1.
    results = evaluate(["what is the capital city"], ["what is the capital town"])
    assert results["bleu_precisions"] == pytest.approx([80.0, 75.0, 200 / 3, 50.0])
    assert results["bleu_brevity_penalty"] == pytest.approx(1.0)
    assert results["bleu4"] == pytest.approx(100 * (4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25)
    # Exact but one word short: all precisions 1, BP = exp(1 - 5/4).
    results = evaluate(["what is the capital"], ["what is the capital city"])
    assert results["bleu4"] == pytest.approx(100 * math.exp(1 - 5 / 4))


def test_bleu_equals_a_direct_sacrebleu_call():
    preds = ["What's the name of the team that won?", "who is the president of france", ""]
    refs = ["what 's the name of the team that lost ?", "who was president of france in 1990 ?",
            "when was it built ?"]
    results = evaluate(preds, refs)
    direct = sacrebleu.corpus_bleu(normalise(preds), [normalise(refs)], tokenize="none")
    assert results["bleu4"] == pytest.approx(direct.score)
    assert results["bleu_precisions"] == pytest.approx(direct.precisions)
    assert 0 < results["bleu4"] < 100


def test_bert_tokenization_separates_punctuation_on_both_sides():
    assert normalise(["What's up?"]) == ["what ' s up ?"]
    # The decoder writes "what's"; SQuAD-QG references are tokenized as "what 's": both agree.
    assert normalise(["What's the capital of France?", "what 's the capital of france ?"]) == \
        ["what ' s the capital of france ?"] * 2
    assert evaluate(["What's the capital of France?"], ["what 's the capital of france ?"])["bleu4"] == \
        pytest.approx(100.0)
    assert normalise(["What's up?"], "none") == ["what's up?"]
    assert normalise(["What's up?"], "13a") == ["what's up ?"]
    assert normalise(["What's up?"], "bert", lowercase=False) == ["What ' s up ?"]


def test_lowercase_matters_for_bleu_only_when_asked():
    preds, refs = ["What is the capital city"], ["what is the capital city"]
    assert evaluate(preds, refs)["bleu4"] == pytest.approx(100.0)
    cased = evaluate(preds, refs, lowercase=False)
    assert cased["bleu4"] < 100.0
    assert cased["rouge1"] == pytest.approx(100.0)  # rouge-score always lower-cases


def test_function_api_rejects_bad_input():
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        evaluate(["a", "b"], ["a"])
    with pytest.raises(ValueError, match=r"reference 1 \(0-based\) is empty"):
        evaluate(["a", "b"], ["a", "  "])
    with pytest.raises(ValueError, match="unknown --tokenize"):
        evaluate(["a"], ["a"], tokenize="spacy")


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_command_line_prints_the_table_and_writes_json(tmp_path, capsys):
    pred = _write(tmp_path / "pred.txt", ["what is the capital city", ""])  # an empty prediction is allowed
    ref = _write(tmp_path / "ref.txt", ["what is the capital town", "who built it ?"])
    output = tmp_path / "out" / "results.json"
    assert main(["--pred", str(pred), "--ref", str(ref), "--output", str(output)]) == 0
    table = capsys.readouterr().out
    for name in ("ROUGE-1", "ROUGE-2", "ROUGE-L", "BLEU-4", "2 examples"):
        assert name in table
    data = json.loads(output.read_text())
    assert set(data) >= {"rouge1", "rouge2", "rougeL", "bleu4", "bleu_precisions",
                         "bleu_brevity_penalty", "examples", "pred", "ref", "tokenize"}
    assert data["examples"] == 2 and data["tokenize"] == "bert"
    assert data["pred"] == str(pred) and data["ref"] == str(ref)
    assert data == {**evaluate(["what is the capital city", ""],
                               ["what is the capital town", "who built it ?"]),
                    "pred": str(pred), "ref": str(ref)}
    assert f"{data['bleu4']:.2f}" in table
    assert [p.name for p in output.parent.iterdir()] == ["results.json"]  # no temp file left


@pytest.mark.parametrize("case,expected", [
    ("missing prediction", "prediction file {pred} does not exist"),
    ("missing reference", "reference file {ref} does not exist"),
    ("line counts", "{pred} has 3 lines but {ref} has 2"),
    ("empty reference", "{ref} line 2: empty reference"),
    ("unknown tokenize", "unknown --tokenize 'spacy' (choose from bert, 13a, none)"),
])
def test_bad_input_exits_2_without_output(tmp_path, capsys, case, expected):
    pred = _write(tmp_path / "pred.txt", ["a b", "c d"])
    ref = _write(tmp_path / "ref.txt", ["a b", "c d"])
    args = []
    if case == "missing prediction":
        pred.unlink()
    elif case == "missing reference":
        ref.unlink()
    elif case == "line counts":
        _write(pred, ["a b", "c d", "e f"])
    elif case == "empty reference":
        _write(ref, ["a b", ""])
    else:
        args = ["--tokenize", "spacy"]
    output = tmp_path / "results.json"
    assert main(["--pred", str(pred), "--ref", str(ref), "--output", str(output), *args]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {expected.format(pred=pred, ref=ref)}\n"
    assert captured.out == ""
    assert not output.exists()


def test_module_entry_point_reports_one_line_errors(tmp_path):
    pred = _write(tmp_path / "pred.txt", ["a b"])
    ref = _write(tmp_path / "ref.txt", [" "])
    result = run_module("megatron_pmlm.eval_s2s", "--pred", str(pred), "--ref", str(ref), timeout=60)
    assert result.returncode == 2
    assert result.stderr == f"error: {ref} line 1: empty reference\n"
    assert "METEOR" in run_module("megatron_pmlm.eval_s2s", "--help", timeout=60).stdout


def test_real_question_generation_references():
    if not QG_REFERENCES.is_file():
        pytest.skip(f"{QG_REFERENCES} is absent (the shared data ships beside the repository)")
    refs = QG_REFERENCES.read_text(encoding="utf-8").split("\n")[:300]
    assert evaluate(refs[:200], refs[:200])["bleu4"] == pytest.approx(100.0)
    # Neighbouring SQuAD questions ask about the same paragraph ("which nfl team represented the
    # afc/nfc at super bowl 50 ?"), so a one-line shift still shares n-grams (BLEU ~12.5 here);
    # 100 lines on, the paragraphs differ (BLEU ~3).
    neighbours = evaluate(refs[1:201], refs[:200])
    assert neighbours["bleu4"] < 20, neighbours
    unrelated = evaluate(refs[100:300], refs[:200])
    assert unrelated["bleu4"] < 10 and unrelated["rouge1"] < 30, unrelated
