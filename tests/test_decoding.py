"""Decoding (SPEC §7.2): the cache equals a full recompute, greedy equals a 1-wide beam, n-gram
blocking and min length hold, the B.1 layout and the B.5/B.6 rules equal transcriptions of s2s-ft's
code, and `python -m megatron_pmlm.decode_s2s` keeps input order and refuses bad input.

Models are tiny and random, with the real bert-base-uncased vocabulary."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from megatron_pmlm.config import ConfigError, model_config_from_preset
from megatron_pmlm.decode_s2s import main
from megatron_pmlm.generation.decoding import Seq2SeqDecoder, build_decoder_batch
from megatron_pmlm.generation.search import (DecodingConfig, NGramBlocker, choose_hypotheses, detokenize,
                                             parse_ignore_tokens)
from megatron_pmlm.models.layout import PSEUDO, pmlm_attention_allowed
from megatron_pmlm.models.model import PMLMForPreTraining
from megatron_pmlm.tokenizer import WordPieceTokenizer
from pmlm_testing import one_thread, run_module

SOURCES = ["the american football conference champion denver broncos defeated the carolina panthers .",
           "where did super bowl 50 take place ?",
           "the game was played on february 7 , 2016 , at levi 's stadium in the san francisco bay area .",
           "beyonce"]


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny models gain nothing from threads, and lose a lot when another process holds a core."""
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tokenizer(bert_vocab) -> WordPieceTokenizer:
    return WordPieceTokenizer(bert_vocab)


@pytest.fixture(scope="module")
def sources(tokenizer) -> list[list[int]]:
    return [ids.tolist() for ids in tokenizer.encode_batch(SOURCES)]


def tiny_model(tokenizer, rel_pos: bool = True, seed: int = 3, sep_bias: float = 1.0,
               favoured: dict[int, float] | None = None, init_std: float = 0.05) -> PMLMForPreTraining:
    """Random weights with non-trivial biases and a relative position bias that matters. A long
    [SEP] embedding makes its logit depend on the input, so outputs end at different lengths
    (`sep_bias` shifts it); `favoured` raises some words' logits so that outputs repeat."""
    config = model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size, hidden_dropout=0.0,
                                      attention_dropout=0.0, rel_pos=rel_pos, max_position_embeddings=128,
                                      init_std=init_std)
    model = PMLMForPreTraining(config, init_seed=seed).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn(param.shape, generator=generator) * 0.05)
        if rel_pos:
            model.bert.rel_pos_bias.weight.normal_(0.0, 1.0, generator=generator)
        model.bert.embeddings.word_embeddings.weight[tokenizer.special.sep] *= 10.0
        bias = model.cls.predictions.bias
        bias[tokenizer.special.sep] += sep_bias
        for token_id, value in (favoured or {}).items():
            bias[token_id] += value
    return model


def cut(ids: list[int], tokenizer) -> list[int]:
    stop = {tokenizer.special.sep, tokenizer.special.pad}
    return ids[:next((i for i, t in enumerate(ids) if t in stop), len(ids))]


def repeated_bigrams(ids: list[int]) -> list[tuple[int, int]]:
    bigrams = list(zip(ids, ids[1:]))
    return [b for b in set(bigrams) if bigrams.count(b) > 1]


# ---------------------------------------------------------------------------------------------
# The cache against a full forward every step

@pytest.mark.parametrize("rel_pos", [True, False], ids=["relpos", "norelpos"])
@pytest.mark.parametrize("pos_shift", [False, True], ids=["standard", "pos_shift"])
@pytest.mark.parametrize("beam", [1, 4])
def test_cached_decoding_equals_full_recompute(tokenizer, sources, rel_pos, pos_shift, beam):
    model = tiny_model(tokenizer, rel_pos=rel_pos)
    config = DecodingConfig(beam_size=beam, max_target_length=12, max_seq_length=128, pos_shift=pos_shift,
                            min_length=2, length_penalty=1.0, no_repeat_ngram_size=2)
    cached = Seq2SeqDecoder(model, tokenizer.special, config).decode(sources)
    full = Seq2SeqDecoder(model, tokenizer.special, config, full_recompute=True).decode(sources)
    assert cached.token_ids == full.token_ids
    if beam > 1:
        assert torch.equal(cached.step_ids, full.step_ids)
        assert torch.equal(cached.back_pointers, full.back_pointers)
        # Finished hypotheses carry -10000 per step: float32 rounding there is relative.
        torch.testing.assert_close(cached.step_scores, full.step_scores, rtol=1e-6, atol=1e-5)
    lengths = {len(cut(ids, tokenizer)) for ids in cached.token_ids}
    assert len(lengths) > 1, "the outputs should end at different lengths"


def test_greedy_equals_a_one_wide_beam(tokenizer, sources):
    for pos_shift in (False, True):
        model = tiny_model(tokenizer)
        config = DecodingConfig(beam_size=1, min_length=0, max_target_length=12, max_seq_length=128,
                                pos_shift=pos_shift)
        decoder = Seq2SeqDecoder(model, tokenizer.special, config)
        greedy = decoder.decode(sources).token_ids
        beam = decoder.beam_search(decoder.build_batch(sources)).token_ids
        assert [cut(ids, tokenizer) for ids in greedy] == [cut(ids, tokenizer) for ids in beam]
        assert any(len(cut(ids, tokenizer)) < 12 for ids in greedy)


# ---------------------------------------------------------------------------------------------
# Constraints

def test_ngram_blocking_removes_repeats(tokenizer, sources):
    favoured = {tokenizer.token_to_id(t): 2.5 for t in ("the", "of", ".", "and")}
    model = tiny_model(tokenizer, sep_bias=-30.0, favoured=favoured)

    def run(**settings):
        config = DecodingConfig(beam_size=3, max_target_length=16, max_seq_length=128, **settings)
        return Seq2SeqDecoder(model, tokenizer.special, config, token_to_id=tokenizer.token_to_id).decode(sources)

    unblocked = run().token_ids
    assert sum(len(repeated_bigrams(ids)) for ids in unblocked) >= 4, "the model should repeat without blocking"
    for ids in run(no_repeat_ngram_size=2).token_ids:
        assert repeated_bigrams(cut(ids, tokenizer)) == []
    period = tokenizer.token_to_id(".")
    exempt_used = False
    for ids in run(no_repeat_ngram_size=2, ngram_ignore_tokens=["."]).token_ids:
        for first, second in repeated_bigrams(cut(ids, tokenizer)):
            assert period in (first, second)
            exempt_used = True
    assert exempt_used, "the exempt token should let some bigram repeat"


def test_min_length_holds_back_sep(tokenizer, sources):
    model = tiny_model(tokenizer, sep_bias=30.0)
    for pos_shift in (False, True):
        config = DecodingConfig(beam_size=3, min_length=0, max_target_length=10, max_seq_length=128,
                                pos_shift=pos_shift)
        eager = Seq2SeqDecoder(model, tokenizer.special, config).decode(sources).token_ids
        assert all(ids == [tokenizer.special.sep] for ids in eager), "a strong [SEP] bias should stop at once"
        for min_length in (1, 4):
            config = DecodingConfig(beam_size=3, min_length=min_length, max_target_length=10, max_seq_length=128,
                                    pos_shift=pos_shift)
            for ids in Seq2SeqDecoder(model, tokenizer.special, config).decode(sources).token_ids:
                assert len(cut(ids, tokenizer)) >= min_length
                assert ids[-1] == tokenizer.special.sep  # it still ends as soon as allowed


def reference_dup_ngram_candidates(seq, n, ignore):
    """s2s-ft's get_dup_ngram_candidates, transcribed."""
    cands = set()
    if len(seq) < n:
        return []
    tail = seq[-(n - 1):]
    if ignore and any(tk in ignore for tk in tail):
        return []
    for i in range(len(seq) - (n - 1)):
        mismatch = False
        for j in range(n - 1):
            if tail[j] != seq[i + j]:
                mismatch = True
                break
        if (not mismatch) and not (ignore and (seq[i + n - 1] in ignore)):
            cands.add(seq[i + n - 1])
    return sorted(cands)


def test_ngram_blocker_equals_s2s_ft_rule():
    rng = random.Random(0)
    vocab = 6
    for n in (1, 2, 3, 4):
        for ignore in (set(), {2}, {0, 5}):
            blocker = NGramBlocker(n, vocab, ignore)
            for length in range(0, 12):
                sequences = torch.tensor([[rng.randrange(vocab) for _ in range(length)] for _ in range(8)],
                                         dtype=torch.long).view(8, length)
                banned = blocker.banned(sequences)
                for row, seq in enumerate(sequences.tolist()):
                    expected = reference_dup_ngram_candidates(seq, n, ignore)
                    got = [] if banned is None else torch.nonzero(banned[row]).flatten().tolist()
                    assert got == expected, (n, ignore, seq)


def reference_final_choice(scores, wids_list, ptrs, eos_id, length_penalty):
    """s2s-ft's back tracking for one example, transcribed (lists over steps of lists over k)."""
    last_frame_id = len(scores) - 1
    for i, wids in enumerate(wids_list):
        if all(wid == eos_id for wid in wids):
            last_frame_id = i
            break
    max_score, frame_id, pos_in_frame = -math.inf, -1, -1
    for fid in range(last_frame_id + 1):
        for i, wid in enumerate(wids_list[fid]):
            if wid == eos_id or fid == last_frame_id:
                s = scores[fid][i]
                if length_penalty > 0:
                    s /= math.pow((5 + fid + 1) / 6.0, length_penalty)
                if s > max_score:
                    max_score, frame_id, pos_in_frame = s, fid, i
    if frame_id == -1:
        return []
    seq = [wids_list[frame_id][pos_in_frame]]
    for fid in range(frame_id, 0, -1):
        pos_in_frame = ptrs[fid][pos_in_frame]
        seq.append(wids_list[fid - 1][pos_in_frame])
    return seq[::-1]


def test_final_choice_equals_s2s_ft_backtracking():
    generator = torch.Generator().manual_seed(0)
    sep = 1
    for steps, batch, beam in ((1, 3, 2), (5, 6, 3), (9, 8, 4)):
        for length_penalty in (0.0, 0.7, 1.3):
            ids = torch.randint(0, 3, (steps, batch, beam), generator=generator)  # [SEP] often, all-[SEP] steps too
            scores = -torch.rand(steps, batch, beam, generator=generator).cumsum(0) * 3
            scores = (scores * 4).round() / 4  # exact ties
            pointers = torch.randint(0, beam, (steps, batch, beam), generator=generator)
            pointers[0] = 0
            got = choose_hypotheses(ids, scores, pointers, sep, length_penalty)
            for b in range(batch):
                expected = reference_final_choice(scores[:, b].tolist(), ids[:, b].tolist(), pointers[:, b].tolist(),
                                                  sep, length_penalty)
                assert got[b] == expected


# ---------------------------------------------------------------------------------------------
# Layout (B.1) against s2s-ft's Preprocess4Seq2seqDecoder

def reference_preprocess(source_length, max_a_len, max_len, max_tgt_length, pos_shift, source_type_id,
                         target_type_id):
    """Preprocess4Seq2seqDecoder.__call__ (mode s2s), transcribed: positions, segments, mask."""
    delta = 1 if pos_shift else 2
    padded = max_a_len + delta
    max_len_in_batch = min(max_tgt_length + padded, max_len)
    segment_ids = [source_type_id] * padded + [target_type_id] * (max_len_in_batch - padded)
    position_ids = list(range(source_length + delta)) + [0] * (padded - source_length - delta)
    position_ids += [i - padded + source_length + delta for i in range(padded, max_len_in_batch)]
    mask = torch.zeros(max_len_in_batch, max_len_in_batch, dtype=torch.long)
    mask[:, :source_length + delta] = 1
    size = max_len_in_batch - padded
    mask[padded:, padded:] = torch.tril(torch.ones(size, size, dtype=torch.long))
    return position_ids, segment_ids, mask.bool()


@pytest.mark.parametrize("pos_shift", [False, True], ids=["standard", "pos_shift"])
def test_layout_follows_s2s_ft_preprocessing(pos_shift):
    cls, sep, pad, mask_id = 101, 102, 0, 103
    sources = [[11, 12, 13, 14, 15], [21, 22]]
    config = DecodingConfig(max_target_length=3, max_seq_length=20, pos_shift=pos_shift)
    batch = build_decoder_batch(sources, config, cls, sep, pad, source_type_id=0, target_type_id=1)

    # Hand-written: A = 5; standard P = 7, L = 10; pos_shift P = 6, L = 9.
    if not pos_shift:
        assert batch.source_ids.tolist() == [[cls, 11, 12, 13, 14, 15, sep], [cls, 21, 22, sep, pad, pad, pad]]
        assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [0, 1, 2, 3, 0, 0, 0, 4, 5, 6]]
        assert batch.token_type_ids().tolist() == [[0] * 7 + [1] * 3] * 2
    else:
        assert batch.source_ids.tolist() == [[cls, 11, 12, 13, 14, 15], [cls, 21, 22, pad, pad, pad]]
        assert batch.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8], [0, 1, 2, 0, 0, 0, 3, 4, 5]]
        assert batch.token_type_ids().tolist() == [[0] * 6 + [1] * 3] * 2
    assert batch.num_steps == 3

    generated = torch.tensor([[7, 8, 9], [7, 8, 9]])
    everything = batch.source_slots().cat(batch.target_slots(0, generated))
    visible = pmlm_attention_allowed(everything.roles, everything.steps)
    for row, source in enumerate(sources):
        positions, segments, mask = reference_preprocess(len(source), 5, 20, 3, pos_shift, 0, 1)
        assert batch.position_ids[row].tolist() == positions
        assert batch.token_type_ids()[row].tolist() == segments
        assert torch.equal(everything.position_ids[row], batch.position_ids[row])
        assert torch.equal(visible[row], mask)

    # The [MASK] of step t (standard mode) sees what s2s-ft's row P + t sees, and nobody sees it.
    if not pos_shift:
        prefix = batch.prefix_length
        for step in range(batch.num_steps):
            masks = torch.full((2, 1), mask_id)
            slots = batch.source_slots().cat(batch.target_slots(0, generated[:, :step])).cat(
                batch.target_slots(step, masks, role=PSEUDO))
            allowed = pmlm_attention_allowed(slots.roles, slots.steps)
            assert slots.position_ids[:, -1].tolist() == batch.position_ids[:, prefix + step].tolist()
            for row, source in enumerate(sources):
                _, _, mask = reference_preprocess(len(source), 5, 20, 3, False, 0, 1)
                assert torch.equal(allowed[row, -1], mask[prefix + step, :prefix + step + 1])
                assert not allowed[row, :-1, -1].any()


def test_sources_are_cut_to_the_budget():
    config = DecodingConfig(max_target_length=4, max_seq_length=12)  # 12 - 2 - 4 = 6 wordpieces
    batch = build_decoder_batch([list(range(1000, 1010))], config, 101, 102, 0)
    assert batch.source_ids.tolist() == [[101, 1000, 1001, 1002, 1003, 1004, 1005, 102]]
    assert batch.total_length == 12
    shifted = build_decoder_batch([list(range(1000, 1010))], DecodingConfig(max_target_length=4, max_seq_length=12,
                                                                           pos_shift=True), 101, 102, 0)
    assert shifted.source_ids.tolist() == [[101, 1000, 1001, 1002, 1003, 1004, 1005, 1006]]


# ---------------------------------------------------------------------------------------------
# Text and settings

def test_detokenize():
    assert detokenize(["who", "won", "super", "bowl", "50", "?", "[SEP]", "extra"]) == "who won super bowl 50 ?"
    assert detokenize(["the", "play", "##offs", "began", "##n't", "[PAD]", "x"]) == "the playoffs begann't"
    assert detokenize(["##ing", "word", "##s"]) == "##ing words"
    assert detokenize(["[SEP]", "a"]) == ""
    assert detokenize([]) == ""
    # summaries' sentence separator, as the UniLM toolkit writes it: a newline token, an [X_SEP]
    # token, and "[X_SEP]" split into wordpieces by a vocabulary without it
    assert detokenize(["one", ".", "\n", "two"]) == "one .  [X_SEP]  two"  # s2s-ft's spacing
    assert detokenize(["one", ".", "[X_SEP]", "two"]) == "one . [X_SEP] two"
    assert detokenize(["one", ".", "[", "x", "_", "sep", "]", "two", "[", "x", "_", "sep", "]"]) == \
        "one . [X_SEP] two [X_SEP]"
    assert detokenize(["a", "[", "x", "_", "sep", "##s", "]"]) == "a [ x _ seps ]"


def test_ignore_token_parsing_and_config_validation():
    assert parse_ignore_tokens(". , ?") == [".", ",", "?"]
    assert parse_ignore_tokens("[sep]|.") == ["[SEP]", "."]
    assert parse_ignore_tokens("") == []
    for bad in (dict(beam_size=0), dict(min_length=5, max_target_length=4), dict(min_length=-1),
                dict(max_target_length=510, max_seq_length=512), dict(no_repeat_ngram_size=-1),
                dict(length_penalty=float("nan"))):
        with pytest.raises(ConfigError):
            DecodingConfig(**bad)


# ---------------------------------------------------------------------------------------------
# The command line

@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tokenizer, bert_vocab) -> Path:
    from megatron_pmlm.hf.pmlm_adapter import write_hf_folder
    from megatron_pmlm.hf.pmlm_adapter import to_hf_state_dict

    model = tiny_model(tokenizer)
    folder = tmp_path_factory.mktemp("decode") / "model"
    write_hf_folder(folder, to_hf_state_dict(model.state_dict(), model.config), model.config, bert_vocab)
    return folder


@pytest.fixture(scope="module")
def input_lines() -> list[str]:
    lines = list(SOURCES) + ["who was the coach of the broncos ?", "the broncos won 24 to 10 .", "levi 's stadium"]
    return lines


def decode_cli(tmp_path, model_folder, lines, *extra, name="in.txt") -> list[str]:
    source = tmp_path / name
    if name.endswith(".jsonl"):
        source.write_text("".join(json.dumps({"src": line, "tgt": "x"}) + "\n" for line in lines))
    else:
        source.write_text("\n".join(lines) + "\n")
    output = tmp_path / (name + ".pred")
    assert main(["--model", str(model_folder), "--input", str(source), "--output", str(output), "--no-progress",
                 "--max-target-length", "8", "--device", "cpu", *extra]) == 0
    return output.read_text().split("\n")[:-1]


def test_cli_keeps_input_order_whatever_the_batching(tmp_path, model_folder, input_lines, capsys):
    for beam in ("1", "3"):
        batched = decode_cli(tmp_path, model_folder, input_lines, "--beam-size", beam, "--batch-size", "4")
        assert len(batched) == len(input_lines)
        one_by_one = [decode_cli(tmp_path, model_folder, [line], "--beam-size", beam)[0] for line in input_lines]
        assert batched == one_by_one
        assert len(set(batched)) > 1
    assert "decoded 1 examples" in capsys.readouterr().out


def test_cli_jsonl_ignore_tokens_and_pos_shift_from_the_model(tmp_path, model_folder, input_lines):
    plain = decode_cli(tmp_path, model_folder, input_lines, "--beam-size", "2", "--no-repeat-ngram-size", "2",
                       "--ngram-ignore-tokens", ". | ,")
    assert decode_cli(tmp_path, model_folder, input_lines, "--beam-size", "2", "--no-repeat-ngram-size", "2",
                      "--ngram-ignore-tokens", ". | ,", name="in.jsonl") == plain
    forced = decode_cli(tmp_path, model_folder, input_lines, "--pos-shift")
    causal = tmp_path / "causal"
    causal.mkdir()
    for path in model_folder.iterdir():
        (causal / path.name).write_bytes(path.read_bytes())
    config = json.loads((causal / "config.json").read_text())
    (causal / "config.json").write_text(json.dumps({**config, "s2s_mode": "causal"}))
    assert decode_cli(tmp_path, causal, input_lines) == forced
    assert forced != decode_cli(tmp_path, model_folder, input_lines)


def test_cli_as_a_module_with_bf16(tmp_path, model_folder):
    source = tmp_path / "src.txt"
    source.write_text("where did super bowl 50 take place ?\nbeyonce\n")
    output = tmp_path / "out.txt"
    result = run_module("megatron_pmlm.decode_s2s", "--model", str(model_folder), "--input", str(source),
                        "--output", str(output), "--max-target-length", "6", "--bf16", "--beam-size", "2",
                        "--no-progress", "--device", "cpu", timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(output.read_text().split("\n")) == 3
    assert "tokens/s" in result.stdout


def test_cli_refuses_bad_input(tmp_path, model_folder, capsys):
    good = tmp_path / "good.txt"
    good.write_text("a source\n")
    output = tmp_path / "out.txt"

    def refused(*args, message, model=model_folder):
        code = main(["--model", str(model), "--output", str(output), "--no-progress", "--device", "cpu", *args])
        err = capsys.readouterr().err
        assert code == 2
        assert "error: " in err and message in err, err
        assert "Traceback" not in err
        assert not output.exists()
        assert not list(tmp_path.glob(".out.txt.*"))

    refused("--input", str(tmp_path / "missing.txt"), message="missing.txt does not exist")
    empty_line = tmp_path / "holes.txt"
    empty_line.write_text("first\n\nthird\n")
    refused("--input", str(empty_line), message="holes.txt line 2: empty source")
    no_src = tmp_path / "no_src.jsonl"
    no_src.write_text('{"src": "ok"}\n{"tgt": "no source"}\n')
    refused("--input", str(no_src), message="line 2: no `src` field")
    not_json = tmp_path / "not_json.jsonl"
    not_json.write_text('{"src": "ok"}\n{"src": "ok"}\nnot json\n')
    refused("--input", str(not_json), message="line 3: not JSON")
    refused("--input", str(good), "--beam-size", "0", message="--beam-size must be at least 1")
    refused("--input", str(good), "--min-length", "9", "--max-target-length", "8", message="--min-length")
    refused("--input", str(good), "--no-repeat-ngram-size", "2", "--ngram-ignore-tokens", "notawordpiecexyz",
            message="'notawordpiecexyz' is not in the vocabulary")
    code = main(["--model", str(model_folder), "--input", str(good), "--output", str(tmp_path / "nope" / "o.txt"),
                 "--no-progress"])
    assert code == 2 and "output folder" in capsys.readouterr().err

    no_vocab = tmp_path / "no_vocab"
    no_vocab.mkdir()
    for path in model_folder.iterdir():
        if path.name not in ("vocab.txt", "tokenizer.json"):  # where a folder's vocabulary is found
            (no_vocab / path.name).write_bytes(path.read_bytes())
    refused("--input", str(good), message="has no vocabulary", model=no_vocab)
    wrong_vocab = tmp_path / "wrong_vocab"
    wrong_vocab.mkdir()
    for path in no_vocab.iterdir():
        (wrong_vocab / path.name).write_bytes(path.read_bytes())
    (wrong_vocab / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\n[MASK]\na\nb\n")
    refused("--input", str(good), message="not this model's vocabulary", model=wrong_vocab)
