"""`megatron_pmlm.generation.benchmark_scoring` and `eval_s2s --benchmark`: the QG benchmark's BLEU-4/METEOR/
ROUGE-L and the summarization benchmarks' ROUGE equal hand-computed values and the libraries called
directly on the same text; the toolkit's text handling (fix_tokenization, grouping by sentence,
[X_SEP] sentences, truncation) is reproduced rule by rule. METEOR shares one Java VM per module and
skips, with the reason, where no Java runtime can be found or installed."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.rouge.rouge import Rouge
from rouge_score import rouge_scorer

from megatron_pmlm.generation import benchmark_scoring as gm
from megatron_pmlm.eval_s2s import main
from pmlm_testing import SHARED_DATA, run_module

TINY, SMALL = 1e-15, 1e-9  # coco-caption BleuScorer's smoothing constants


@pytest.fixture(scope="module")
def meteor():
    """One METEOR jar for the module (its JVM takes seconds to start). Without java: as root with
    apt-get, Debian's default-jre-headless is installed (tests/system_packages.py); else skip."""
    reason = gm.java_missing()
    if reason is not None and hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        from system_packages import apt_install, install_lock
        try:
            with install_lock():
                apt_install(["default-jre-headless"], recommends=False)
        except (RuntimeError, TimeoutError) as error:
            pytest.skip(f"{reason}; installing default-jre-headless failed: {str(error)[:300]}")
        reason = gm.java_missing()
    if reason is not None:
        pytest.skip(reason)
    with gm.MeteorScorer() as scorer:
        yield scorer


# ------------------------------------------------------------------------------------------------
# The toolkit's text handling

@pytest.mark.parametrize("text,expected", [
    ("what ' s the name ?", "what 's the name ?"),
    ("he didn ' t go", "he did n't go"),
    ("she ' d say you ' ll see", "she 'd say you 'll see"),
    ("the ' best ' one", "the ` best ' one"),
    ('he said " hi " and " bye "', "he said `` hi '' and `` bye ''"),
    ("wait . . . what", "wait ... what"),
    ("$ 3 , 000 , 000 and 3 . 03", "$ 3,000,000 and 3.03"),
    ("the U . N . said", "the U.N. . said"),        # the toolkit advances two words: the "." stays
    ("a well - known - ish word", "a well-known-ish word"),
    ("1 - - 2", "1 -- 2"),
    ("- start and end -", "- start and end -"),
    ("a , - b", "a , - b"),                          # next to punctuation: a word of its own
    ("( a ) [ b ] { c }", "-lrb- a -rrb- -lsb- b -rsb- -lcb- c -rcb-"),
    ("[UNK] & < >", "UNK &amp; &lt; &gt;"),
])
def test_fix_tokenization_for_question_generation(text, expected):
    assert gm.fix_tokenization(text, "qg") == expected


def test_fix_tokenization_per_benchmark():
    text = '( a ) [UNK] " q " it \' s well - known <unk>'
    assert gm.fix_tokenization(text, "cnndm") == "-LRB- a -RRB- [UNK] `` q '' it 's well-known <unk>"
    assert gm.fix_tokenization(text, "gigaword") == "-lrb- a -rrb- UNK `` q '' it 's well-known UNK"
    # XSum's table: no token map, no quote alternation, no hyphen joining
    assert gm.fix_tokenization(text, "xsum") == '( a ) [UNK] " q " it \'s well - known <unk>'
    assert gm.fix_tokenization("  spaced   words ") == "spaced words"


def test_qg_text_of_both_reference_styles():
    # du: the prediction re-tokenized then lower-cased, the reference only stripped (Du et al.'s
    # references are lower-cased already: an upper-case reference stays upper-case, as in the toolkit)
    assert gm.qg_text(" What ' s in ( it ) ? ", " what 's in -lrb- it -rrb- ? ") == \
        ("what 's in -lrb- it -rrb- ?", "what 's in -lrb- it -rrb- ?")
    assert gm.qg_text("a", "Who ?")[1] == "Who ?"
    assert "upper-case" in gm.score_qg(["s"], ["who ?"], ["Who ?"], meteor=False)["note"]
    assert "note" not in gm.score_qg(["s"], ["who ?"], ["Who ?"], "unilm", meteor=False)
    # unilm: the prediction lower-cased only, the reference's wordpieces joined and lower-cased
    assert gm.qg_text(" What ' s in ( it ) ? ", "What ' s the cap ##ital ?", "unilm") == \
        ("what ' s in ( it ) ?", "what ' s the capital ?")
    with pytest.raises(ValueError, match="unknown QG reference style 'ptb'"):
        gm.qg_text("a", "b", "ptb")


def test_questions_are_grouped_by_sentence_with_the_last_prediction():
    sources = ["The sentence .", "the sentence . ", "another one ."]
    predictions = ["first guess ?", "second guess ?", "third ?"]
    references = ["q one ?", "q two ?", "q three ?"]
    gts, res = gm.qg_groups(sources, predictions, references)
    assert gts == {"the sentence .": ["q one ?", "q two ?"], "another one .": ["q three ?"]}
    assert res == {"the sentence .": ["second guess ?"], "another one .": ["third ?"]}
    with pytest.raises(ValueError, match="3 sources, 2 predictions and 3 references"):
        gm.qg_groups(sources, predictions[:2], references)


# ------------------------------------------------------------------------------------------------
# QG metrics: hand-computed and the COCO classes called directly

def test_qg_bleu_and_rouge_equal_hand_computed_values():
    results = gm.score_qg(["s1"], ["what is the capital city"], ["what is the capital town"], meteor=False)
    # n-gram precisions 4/5, 3/4, 2/3, 1/2 (coco's smoothing: (correct + 1e-15) / (guess + 1e-9));
    # equal lengths: the brevity penalty is exp(1 - 1/ratio) with ratio (5 + 1e-15) / (5 + 1e-9) ~ 1
    precisions = [(c + TINY) / (g + SMALL) for c, g in ((4, 5), (3, 4), (2, 3), (1, 2))]
    penalty = math.exp(1 - (5 + SMALL) / (5 + TINY))
    for n in range(1, 5):
        assert results[f"bleu{n}"] == pytest.approx(100 * math.prod(precisions[:n]) ** (1 / n) * penalty)
    # ROUGE-L: LCS 4 of 5 both ways, F with beta 1.2 = P = R = 0.8
    assert results["rougeL"] == pytest.approx(80.0)
    assert results["meteor"] is None and results["meteor_unavailable"] == "left out (--no-meteor)"
    assert list(results["metrics"]) == ["BLEU-4", "METEOR", "ROUGE-L"]
    assert results["examples"] == 1 and results["groups"] == 1


def test_qg_multi_reference_bleu_and_rouge_by_hand():
    # one sentence, two questions: BLEU clips against either reference and takes the closest
    # reference length (4, so no brevity penalty for 5 words); ROUGE-L takes the best P and best R
    sources = ["s", "s"]
    references = ["who wrote it ?", "who is the author of the book ?"]
    predictions = ["ignored: the last line's prediction counts", "who wrote the book ?"]
    results = gm.score_qg(sources, predictions, references, meteor=False)
    # unigrams 5/5; bigrams "who wrote", "the book", "book ?" 3/4; trigrams "the book ?" 1/3; 4-grams 0/2
    precisions = [(c + TINY) / (g + SMALL) for c, g in ((5, 5), (3, 4), (1, 3), (0, 2))]
    for n in range(1, 5):
        assert results[f"bleu{n}"] == pytest.approx(100 * math.prod(precisions[:n]) ** (1 / n), rel=1e-6)
    # LCS: "who wrote ?" (3) with the first, "who the book ?" (4) with the second:
    # best P = 4/5, best R = 3/4 -> (1 + 1.2^2) P R / (R + 1.2^2 P)
    p, r = 4 / 5, 3 / 4
    assert results["rougeL"] == pytest.approx(100 * (1 + 1.44) * p * r / (r + 1.44 * p))
    assert results["groups"] == 1


def test_qg_scores_equal_the_coco_classes_called_directly():
    sources = ["a b c .", "a b c .", "d e f .", "g h ."]
    predictions = ["What ' s a ?", "Who ' s b ( c ) ?", "what is d ?", "how is g ?"]
    references = ["what 's a ?", "who is b -lrb- c -rrb- ?", "what is e ?", "why is h ?"]
    results = gm.score_qg(sources, predictions, references, meteor=False)
    gts = {"a b c .": references[:2], "d e f .": [references[2]], "g h .": [references[3]]}
    res = {"a b c .": ["who 's b -lrb- c -rrb- ?"], "d e f .": ["what is d ?"], "g h .": ["how is g ?"]}
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    rouge, _ = Rouge().compute_score(gts, res)
    assert [results[f"bleu{n}"] for n in range(1, 5)] == pytest.approx([100 * b for b in bleu])
    assert results["rougeL"] == pytest.approx(100 * rouge)
    assert 0 < results["bleu4"] < 100 and 0 < results["rougeL"] < 100


def test_qg_meteor_hand_computed_and_direct(meteor):
    same = gm.score_qg(["s"], ["who wrote the book ?"], ["who wrote the book ?"], meteor=meteor)
    assert same["meteor"] == pytest.approx(100.0)
    assert gm.score_qg(["s"], ["xyz"], ["who wrote the book ?"], meteor=meteor)["meteor"] == 0.0
    sources = ["a b c .", "a b c .", "d e f ."]
    predictions = ["What ' s a ?", "who wrote the books ?", "when was it built ?"]
    references = ["what 's a ?", "who is the author of the book ?", "when was the house built ?"]
    results = gm.score_qg(sources, predictions, references, meteor=meteor)
    gts, res = gm.qg_groups(sources, predictions, references)
    direct, segments = meteor._meteor.compute_score(gts, res)  # the jar's corpus-level aggregate
    assert results["meteor"] == pytest.approx(100 * direct)
    assert 0 < results["meteor"] < 100 and len(segments) == 2
    assert results["metrics"]["METEOR"] == results["meteor"]


def test_qg_without_java_reports_why(monkeypatch):
    monkeypatch.setattr(gm.shutil, "which", lambda name: None)
    assert gm.java_missing() == gm.NO_JAVA
    results = gm.score_qg(["s"], ["a b"], ["a b"])
    assert results["meteor"] is None and results["meteor_unavailable"] == gm.NO_JAVA
    assert results["bleu1"] == pytest.approx(100.0)
    with pytest.raises(gm.MeteorError, match="not on PATH"):
        gm.MeteorScorer()


# ------------------------------------------------------------------------------------------------
# Summarization

def test_cnndm_postprocessing_as_the_toolkit():
    prediction = ("the cats were sitting on mats . [X_SEP] ok then . [X_SEP] the cats were sitting on mats . "
                  "[X_SEP] ( a ) b [c] d e f")
    # "ok then ." (3 words) dropped; the repeat shares all its words with the first: dropped;
    # "[c]" inside a word spaced out
    assert gm.postprocess_summary(prediction, "cnndm") == \
        ["the cats were sitting on mats .", "-LRB- a -RRB- b -LSB- c -RSB- d e f"]
    assert gm.postprocess_summary(prediction, "cnndm", duplicate_rate=1.0) == \
        ["the cats were sitting on mats .", "the cats were sitting on mats .", "-LRB- a -RRB- b -LSB- c -RSB- d e f"]
    # truncation: the first 9 words in all
    assert gm.postprocess_summary(prediction, "cnndm", truncation=9) == \
        ["the cats were sitting on mats .", "-LRB- a"]
    assert gm.postprocess_summary("one two three four five six", "cnndm", truncation=0) == \
        ["one two three four five six"]
    assert gm.reference_sentences("first one . <S_SEP> second one .", "cnndm") == ["first one .", "second one ."]
    assert gm.reference_sentences("first one . [X_SEP] second one .", "cnndm") == ["first one .", "second one ."]
    assert gm.reference_sentences("first one . <S_SEP> second one .", "xsum") == ["first one . <S_SEP> second one ."]
    assert gm.rouge_text(["-LRB- a -RRB- `` b ''", "C -lsb-"]) == '( a ) " b "\nc ['


def test_xsum_and_gigaword_postprocessing():
    assert gm.postprocess_summary(" a ( b )c  d ", "xsum") == ["a -LRB- b -RRB- c d"]
    assert gm.postprocess_summary("a ( b ) ' q ' 1 - 2", "gigaword") == ["a -lrb- b -rrb- ` q ' #-2"]
    assert gm.postprocess_summary("one two three four five six", "xsum", truncation=2) == ["one two"]
    with pytest.raises(ValueError, match="unknown summarization benchmark 'qg'"):
        gm.postprocess_summary("a", "qg")


def test_summary_rouge_equals_hand_counted_overlaps():
    # After stemming (words over 3 letters): the cat were sit on mat / the cat sat on the mat
    results = gm.score_summaries(["the cats were sitting on mats"], ["the cat sat on the mat ."], "cnndm")
    # unigrams the, cat, on, mat: 4 of 6 and 6; bigrams: "the cat" 1 of 5 and 5; LCS the cat on mat: 4
    assert results["rouge1"] == pytest.approx(100 * 2 / 3)
    assert results["rouge2"] == pytest.approx(20.0)
    assert results["rougeLsum"] == pytest.approx(100 * 2 / 3)
    assert list(results["metrics"]) == ["ROUGE-1", "ROUGE-2", "ROUGE-L"]
    assert results["metrics"]["ROUGE-L"] == results["rougeLsum"]


def test_rouge_l_is_summary_level_over_sentences():
    # Sentences in the other order: the summary-level LCS (union over sentences) still finds
    # "a b c" and "f g h" (6 of 10 both ways); a flat LCS over the whole text would find only 3.
    prediction = "f g h i j [X_SEP] a b c d e"
    reference = "a b c x y <S_SEP> f g z h w"
    results = gm.score_summaries([prediction], [reference], "cnndm")
    assert results["rougeLsum"] == pytest.approx(60.0)
    flat = rouge_scorer.RougeScorer(["rougeL"]).score("a b c x y f g z h w", "f g h i j a b c d e")
    assert flat["rougeL"].fmeasure == pytest.approx(0.3)


def test_summary_scores_equal_rouge_score_called_directly():
    predictions = ["the u . s . economy grew 3 . 5 percent [X_SEP] shares ( of apple ) rose sharply on monday",
                   "police said the man , 35 , was arrested [X_SEP] he didn ' t resist arrest at all"]
    references = ["the us economy grew 3.5 percent . <S_SEP> apple shares rose on monday .",
                  "a 35-year-old man was arrested by police . <S_SEP> he did not resist ."]
    results = gm.score_summaries(predictions, references, "cnndm")
    expected_predictions = ["the u . s . economy grew 3.5 percent\nshares ( of apple ) rose sharply on monday",
                            "police said the man , 35 , was arrested\nhe did n't resist arrest at all"]
    expected_references = ["the us economy grew 3.5 percent .\napple shares rose on monday .",
                           "a 35-year-old man was arrested by police .\nhe did not resist ."]
    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeLsum"], use_stemmer=True)
    direct = [scorer.score(r, p) for p, r in zip(expected_predictions, expected_references)]
    for name in ("rouge1", "rouge2", "rougeLsum"):
        assert results[name] == pytest.approx(100 * sum(d[name].fmeasure for d in direct) / 2), name
    # Gigaword writes digits as '#': the prediction's 1 matches the reference's #
    assert gm.score_summaries(["us stocks rise 1 percent"], ["us stocks rise # percent"], "gigaword")["rouge1"] \
        == pytest.approx(100.0)
    with pytest.raises(ValueError, match="2 predictions but 1 references"):
        gm.score_summaries(["a", "b"], ["a"], "xsum")


# ------------------------------------------------------------------------------------------------
# The command line

def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_benchmark_qg_command_line(tmp_path, capsys):
    src = _write(tmp_path / "src.txt", ["s one .", "s one .", "s two ."])
    pred = _write(tmp_path / "pred.txt", ["x ?", "what is the capital city", "who ' s he ?"])
    ref = _write(tmp_path / "ref.txt", ["what is the capital town", "which city ?", "who 's he ?"])
    output = tmp_path / "scores.json"
    assert main(["--benchmark", "qg", "--src", str(src), "--pred", str(pred), "--ref", str(ref), "--no-meteor",
                 "--output", str(output)]) == 0
    table = capsys.readouterr().out
    lines = table.splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["BLEU-4", "METEOR", "ROUGE-L"]
    assert lines[2].split() == ["METEOR", "n/a"]
    assert "3 examples in 2 source-sentence groups" in table and "left out (--no-meteor)" in table
    data = json.loads(output.read_text())
    expected = gm.score_benchmark("qg", ["x ?", "what is the capital city", "who ' s he ?"],
                                  ["what is the capital town", "which city ?", "who 's he ?"],
                                  ["s one .", "s one .", "s two ."], meteor=False)
    assert data == {**expected, "pred": str(pred), "ref": str(ref), "src": str(src)}
    assert list(data["metrics"]) == ["BLEU-4", "METEOR", "ROUGE-L"]
    assert f"{data['bleu4']:.2f}" in lines[1]


def test_benchmark_summarization_command_line(tmp_path, capsys):
    pred = _write(tmp_path / "pred.txt", ["the cats were sitting on mats [X_SEP] ok"])
    ref = _write(tmp_path / "ref.txt", ["the cat sat on the mat ."])
    output = tmp_path / "scores.json"
    assert main(["--benchmark", "cnndm", "--pred", str(pred), "--ref", str(ref), "--output", str(output)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines[1:4]] == ["ROUGE-1", "ROUGE-2", "ROUGE-L"]
    data = json.loads(output.read_text())
    assert data["benchmark"] == "cnndm" and data["truncation"] == 160 and data["duplicate_rate"] == 0.7
    assert data["metrics"] == pytest.approx({"ROUGE-1": 100 * 2 / 3, "ROUGE-2": 20.0, "ROUGE-L": 100 * 2 / 3})
    assert main(["--benchmark", "xsum", "--pred", str(pred), "--ref", str(ref), "--trunc-len", "3",
                 "--output", str(output)]) == 0
    assert json.loads(output.read_text())["truncation"] == 3


@pytest.mark.parametrize("args,expected", [
    (["--benchmark", "qg"], "--benchmark qg needs --src (the source sentences: the benchmark groups the "
                            "questions by sentence)"),
    (["--src", "{src}"], "--src goes with --benchmark"),
    (["--trunc-len", "5"], "--trunc-len goes with --benchmark"),
    (["--benchmark", "qg", "--src", "{src}", "--trunc-len", "5"], "--trunc-len goes with --benchmark cnndm|xsum|gigaword"),
    (["--benchmark", "cnndm", "--src", "{src}"], "--src goes with --benchmark qg"),
    (["--benchmark", "cnndm", "--trunc-len", "-1"], "--trunc-len must be 0 or more, got -1"),
    (["--benchmark", "cnndm", "--duplicate-rate", "2"], "--duplicate-rate must be between 0 and 1, got 2.0"),
    (["--benchmark", "qg", "--src", "{short}"], "{short} has 1 lines but {ref} has 2"),
    (["--benchmark", "qg", "--src", "{blank}"], "{blank} line 2: empty source"),
])
def test_benchmark_options_refused(tmp_path, capsys, args, expected):
    files = {"src": _write(tmp_path / "src.txt", ["a .", "b ."]), "short": _write(tmp_path / "short.txt", ["a ."]),
             "blank": _write(tmp_path / "blank.txt", ["a .", " "]),
             "pred": _write(tmp_path / "pred.txt", ["x", "y"]), "ref": _write(tmp_path / "ref.txt", ["x", "y"])}
    output = tmp_path / "scores.json"
    argv = ["--pred", str(files["pred"]), "--ref", str(files["ref"]), "--output", str(output), "--no-meteor"
            if "qg" in args else "--tokenize=bert", *[a.format(**files) for a in args]]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"error: {expected.format(**files)}\n"
    assert not output.exists()


def test_help_says_which_numbers_compare_with_what():
    result = run_module("megatron_pmlm.eval_s2s", "--help", timeout=60)
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for phrase in ("--benchmark {qg,cnndm,xsum,gigaword}", "not comparable with the papers",
                   "for comparing our runs with each other only", "SQuAD question generation tables",
                   "summarization tables"):
        assert phrase in text, phrase


def test_real_question_generation_data_grouping():
    src, tgt = SHARED_DATA / "qg" / "src-dev.txt", SHARED_DATA / "qg" / "tgt-dev.txt"
    if not (src.is_file() and tgt.is_file()):
        pytest.skip(f"{src.parent} is absent (the shared data ships beside the repository)")
    sources = src.read_text(encoding="utf-8").splitlines()[:200]
    references = tgt.read_text(encoding="utf-8").splitlines()[:200]
    gts, _ = gm.qg_groups(sources, references, references)
    assert len(gts) < len(sources)  # several questions per sentence, as in the benchmark
    results = gm.score_qg(sources, references, references, meteor=False)
    assert results["bleu4"] == pytest.approx(100.0) and results["rougeL"] == pytest.approx(100.0)
    assert results["groups"] == len(gts)
