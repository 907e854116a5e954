"""UniLM v1 pre-training (SPEC §8): the four LMs' masks in the one attention rule, the mixture, UniLM
v1's n-gram masking, next-sentence prediction, TP=2 == TP=1, learning on real text, conversion.

(The perturbation check of every LM type's visibility is in test_check_leakage.py.)"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_pmlm.config import UniLMMaskingConfig, model_config_from_preset
from megatron_pmlm.data import PretrainingSamples, build_pretraining_loaders
from megatron_pmlm.data.samples import A_LEN, A_START, B_LEN, DOCUMENT
from megatron_pmlm.models.layout import IGNORE_INDEX, PAD, pmlm_attention_allowed
from megatron_pmlm.models.model import PMLMForPreTraining
from megatron_pmlm.models.objectives import get_objective
from megatron_pmlm.tokenizer import SpecialTokenIds
from megatron_pmlm.data.unilm_batches import (UniLMBatchBuilder, build_unilm_batch, draw_lm_types, expected_visibility,
                                              ngram_masks, sample_keys)
from megatron_pmlm.models.unilm import BIDIRECTIONAL, LM_TYPES, NSP_IS_NEXT, NSP_IS_RANDOM, SEQ2SEQ, TYPE_VOCAB_SIZE
from pmlm_testing import plotted_panels, run_module, torchrun, unilm_rows

SPECIAL = SpecialTokenIds(pad=0, unk=1, cls=2, sep=3, mask=4, pseudo=5)
VOCAB = 300


def _synthetic(batch_size=16, seed=0, min_length=12, max_length=64):
    """[SOS] A [EOS] B [EOS] rows of random ordinary tokens, right-padded."""
    return unilm_rows(batch_size, seed, VOCAB, min_length, max_length)


def test_each_lm_types_roles_and_steps_give_spec_tables_mask_under_the_one_rule():
    ids, lengths, second = _synthetic(32)
    lm_types = np.arange(32) % 4
    batch = build_unilm_batch(ids, lengths, second, lm_types, np.full(32, -1), sample_keys(1, 0, np.arange(32)),
                              SPECIAL, VOCAB)
    allowed = pmlm_attention_allowed(batch.roles, batch.steps).numpy()
    for row, length in enumerate(lengths):
        first_target = int(np.argmax(second[row]))
        expected = expected_visibility(int(lm_types[row]), int(length), first_target)
        np.testing.assert_array_equal(allowed[row, :length, :length], expected, err_msg=LM_TYPES[lm_types[row]])
        assert not allowed[row, :, length:].any()  # nobody sees padding
        assert allowed[row, length:].any(axis=1).all()  # padding rows are not empty (no NaN)
    # Segment ids tell the LM type (the released loader's --new_segment_ids): 0/1, 2, 3, 4/5.
    assert batch.token_type_ids[:, 0].tolist() == [0, 2, 3, 4] * 8


def test_the_mixture_is_a_third_bi_a_third_seq2seq_a_sixth_each_direction():
    keys = sample_keys(1234, 3, np.arange(120_000))
    drawn = draw_lm_types(keys, get_objective("unilm").lm_mixture)
    shares = np.bincount(drawn, minlength=4) / len(drawn)
    np.testing.assert_allclose(shares[[LM_TYPES.index(lm) for lm in ("bi", "s2s", "l2r", "r2l")]],
                               [1 / 3, 1 / 3, 1 / 6, 1 / 6], atol=0.006)
    # Per sample, not per position in the batch: the same sample gets the same LM type in any batch.
    assert (draw_lm_types(keys[5:9], get_objective("unilm").lm_mixture) == drawn[5:9]).all()
    assert (draw_lm_types(keys, get_objective("unilm-s2s").lm_mixture) == SEQ2SEQ).all()


def _released_loader_masking(is_candidate_row: np.ndarray, length: int, rng: np.random.Generator,
                             ngram_prob: float) -> np.ndarray:
    """SPEC §8's n-gram rule written the plain sequential way (the released loader's loop), for
    comparing distributions with the vectorized `ngram_masks`."""
    candidates = list(np.flatnonzero(is_candidate_row))
    rng.shuffle(candidates)
    n_pred = max(1, int(np.round(0.15 * length)))
    last = max(candidates)
    masked: set[int] = set()
    for position in candidates:
        if len(masked) >= n_pred:
            break
        if position in masked:
            continue
        span = int(rng.integers(2, 4)) if rng.random() < ngram_prob else 1
        for p in range(position, position + span):
            if p <= last and is_candidate_row[p]:
                masked.add(p)
            else:
                break
    chosen = sorted(masked)
    if len(chosen) > n_pred:
        chosen = rng.choice(chosen, n_pred, replace=False)
    out = np.zeros(len(is_candidate_row), dtype=bool)
    out[list(chosen)] = True
    return out


def _share_in_runs(masked: np.ndarray) -> float:
    """Share of masked tokens with a masked neighbour (part of a run of >= 2)."""
    padded = np.pad(masked, ((0, 0), (1, 1)))
    return float((masked & (padded[:, :-2] | padded[:, 2:])).sum() / masked.sum())


@pytest.mark.parametrize("ngram_prob", [0.2, 0.0])
def test_ngram_masking_takes_fifteen_percent_and_matches_the_released_loaders_rule(ngram_prob):
    ids, lengths, second = _synthetic(600, seed=3, min_length=100, max_length=128)
    is_candidate = (np.arange(ids.shape[1])[None, :] < lengths[:, None]) & (ids > 5)
    masked = ngram_masks(is_candidate, lengths, sample_keys(9, 0, np.arange(600)),
                         UniLMMaskingConfig(ngram_prob=ngram_prob))
    assert not (masked & ~is_candidate).any()
    np.testing.assert_array_equal(masked.sum(1), np.maximum(1, np.round(0.15 * lengths)))
    rng = np.random.default_rng(0)
    reference = np.stack([_released_loader_masking(is_candidate[row], int(lengths[row]), rng, ngram_prob)
                          for row in range(600)])
    np.testing.assert_array_equal(reference.sum(1), masked.sum(1))
    # Bigrams/trigrams show as runs: about half the masked tokens with the paper's 0.2, about a
    # quarter (chance neighbours) with single tokens only; the two implementations agree.
    assert abs(_share_in_runs(masked) - _share_in_runs(reference)) < 0.03, (_share_in_runs(masked),
                                                                          _share_in_runs(reference))
    assert (_share_in_runs(masked) > 0.45) == (ngram_prob > 0)


def test_masked_tokens_are_80_mask_10_random_10_kept_and_labels_hold_the_originals():
    ids, lengths, second = _synthetic(400, seed=4, min_length=60, max_length=64)
    batch = build_unilm_batch(ids, lengths, second, np.zeros(400, dtype=np.int64), np.full(400, -1),
                              sample_keys(2, 0, np.arange(400)), SPECIAL, VOCAB)
    labelled = batch.labels != IGNORE_INDEX
    labelled[:, 0] = False
    original = torch.from_numpy(ids)
    assert torch.equal(batch.labels[labelled], original[labelled])
    shown = batch.input_ids[labelled]
    as_mask = (shown == SPECIAL.mask).float().mean().item()
    kept = (shown == original[labelled]).float().mean().item()
    assert abs(as_mask - 0.8) < 0.02 and abs(kept - 0.1 - 0.1 / VOCAB) < 0.02, (as_mask, kept)
    assert (shown >= 6).logical_or(shown == SPECIAL.mask).all()  # random tokens are never special
    assert torch.equal(batch.input_ids[~labelled & (batch.roles != PAD)], original[~labelled & (batch.roles != PAD)])


@pytest.fixture(scope="module")
def train_samples(pretraining_samples) -> PretrainingSamples:
    return PretrainingSamples(pretraining_samples, "train")


def test_nsp_half_random_second_segments_from_other_documents_deterministic(train_samples):
    builder = UniLMBatchBuilder(train_samples, get_objective("unilm-bi"), seed=11)
    indices = np.arange(len(train_samples))
    batch, draws = builder.build(indices, epoch=0)
    has_b = train_samples.rows[indices, B_LEN] > 0
    assert (draws.lm_types == BIDIRECTIONAL).all()
    assert ((draws.nsp_labels >= 0) == has_b).all()
    labels = draws.nsp_labels[has_b]
    assert abs((labels == NSP_IS_RANDOM).mean() - 0.5) < 0.07, (labels == NSP_IS_RANDOM).mean()
    np.testing.assert_array_equal(batch.labels[:, 0].numpy(), np.where(draws.nsp_labels >= 0, draws.nsp_labels,
                                                                        IGNORE_INDEX))
    own_ids, _ = train_samples.tokens(indices)
    for row in np.flatnonzero(has_b)[:200]:
        length = len(own_ids[row])
        second = batch.token_type_ids[row] == 1
        shown, truth = batch.input_ids[row][second].numpy(), batch.labels[row][second].numpy()
        tokens = np.where(truth != IGNORE_INDEX, truth, shown)[:-1]  # B without its [EOS], masks undone
        if draws.nsp_labels[row] == NSP_IS_NEXT:
            a_len = train_samples.rows[row, A_LEN]
            np.testing.assert_array_equal(tokens, own_ids[row][a_len + 2:length - 1])
        else:
            partner = draws.partners[row]
            assert train_samples.rows[partner, DOCUMENT] != train_samples.rows[row, DOCUMENT]
            start = train_samples.rows[partner, A_START]
            corpus_tokens = train_samples.corpora[0].tokens
            np.testing.assert_array_equal(tokens, corpus_tokens[start:start + len(tokens)])
    # A pure function of (seed, epoch, sample): the same sample in another batch draws the same.
    again, again_draws = builder.build(indices[10:30][::-1], epoch=0)
    np.testing.assert_array_equal(again_draws.nsp_labels, draws.nsp_labels[10:30][::-1])
    np.testing.assert_array_equal(again.labels[0, :].numpy()[again.roles[0].numpy() != PAD],
                                  batch.labels[29].numpy()[batch.roles[29].numpy() != PAD])
    other_epoch = builder.build(indices, epoch=1)[1]
    assert (other_epoch.nsp_labels != draws.nsp_labels).any()
    # --unilm-nsp-random-prob reaches the loader: 0 keeps every true continuation.
    loaders = build_pretraining_loaders(train_samples.directory, micro_batch_size=64, objective="unilm-bi",
                                        unilm_masking=UniLMMaskingConfig(nsp_random_prob=0.0))
    labels = next(loaders.train).labels[:, 0]
    assert set(labels.tolist()) <= {NSP_IS_NEXT, IGNORE_INDEX} and (labels == NSP_IS_NEXT).any()


def test_flex_attention_equals_sdpa_on_the_mixture():
    ids, lengths, second = _synthetic(8, seed=5)
    batch = build_unilm_batch(ids, lengths, second, np.arange(8) % 4, np.array([0, -1, -1, -1, 1, -1, -1, -1]),
                              sample_keys(3, 0, np.arange(8)), SPECIAL, VOCAB)
    losses = {}
    for backend in ("sdpa", "flex"):
        config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                                          type_vocab_size=TYPE_VOCAB_SIZE, attention_backend=backend)
        losses[backend] = PMLMForPreTraining(config, "unilm", init_seed=2).forward_batch(batch).metrics()
    torch.testing.assert_close(losses["flex"], losses["sdpa"], rtol=1e-5, atol=1e-5)


def test_tensor_parallel_2_equals_1():
    script = Path(__file__).parent / "distributed" / "unilm_tp_equivalence.py"
    result = subprocess.run(
        [*torchrun(2),
         str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "UniLM TP=2 matches TP=1" in result.stdout


def test_unilm_losses_fall_on_real_text_reach_tensorboard_and_the_conversion_verifies(tmp_path, pretraining_samples):
    history = tmp_path / "history.json"
    result = run_module(
        "megatron_pmlm.pretrain", "--preset", "tiny", "--objective", "unilm", "--data-path", str(pretraining_samples),
        "--micro-batch-size", "8", "--global-batch-size", "16", "--train-iters", "60", "--lr", "2e-3",
        "--lr-warmup-iters", "6", "--log-interval", "10", "--eval-interval", "60", "--eval-iters", "2",
        "--zero-stage", "2", "--history-json", str(history), "--tensorboard-dir", str(tmp_path / "tb"),
        "--save", str(tmp_path / "ckpt"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    records = [r for r in json.loads(history.read_text()) if "loss" in r and r.get("iteration") and "lr" in r]
    first, last = records[0], records[-1]
    for lm in LM_TYPES:
        assert first[f"loss_unilm_{lm}"] > 8.5 and last[f"loss_unilm_{lm}"] < first[f"loss_unilm_{lm}"] - 1.5, records
    assert 0.0 <= last["nsp_acc"] <= 1.0 and 0.5 < last["loss_nsp"] < 0.9

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(next((tmp_path / "tb").glob("events.out.tfevents.*"))))
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    wanted = {f"train/loss_unilm_{lm}" for lm in LM_TYPES} | {"train/loss_nsp", "train/nsp_acc", "train/mlm_acc",
                                                               "train/loss_mlm", "valid/loss_unilm_s2s"}
    assert wanted <= tags, wanted - tags
    panels = plotted_panels([tmp_path / "tb"], tmp_path / "curves.png")
    assert {"loss", "loss_mlm", "loss_nsp", "mlm_acc", "nsp_acc", *(f"loss_unilm_{lm}" for lm in LM_TYPES)} == set(panels)
    assert panels["loss_unilm_s2s"] == ["train", "valid"] and panels["nsp_acc"] == ["train", "valid"], panels

    converted = run_module("tools.convert_checkpoint", "--load", str(tmp_path / "ckpt"), "--output",
                           str(tmp_path / "hf"), "--verify")
    assert converted.returncode == 0, converted.stdout[-3000:] + converted.stderr[-3000:]
    assert "next-sentence logits max |difference|" in converted.stdout and "-> OK" in converted.stdout
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["PMLMForPreTraining"] and config["type_vocab_size"] == TYPE_VOCAB_SIZE

    import transformers

    model, info = transformers.AutoModelForPreTraining.from_pretrained(
        str(tmp_path / "hf"), trust_remote_code=True, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


def test_pipeline_stages_reproduce_one_process_and_the_pipeline_checkpoint_converts(tmp_path, pretraining_samples):
    """PP=2 (the pooler on the last stage's head, the next-sentence head in its loss layer) logs the
    single process's losses, per LM and NSP included; its layer files convert and verify."""
    histories = {}
    for name, extra, nproc in (("one", [], 1), ("pp2", ["--pipeline-model-parallel-size", "2", "--save",
                                                          str(tmp_path / "ckpt")], 2)):
        history = tmp_path / f"{name}.json"
        result = run_module(
            "megatron_pmlm.pretrain", "--preset", "tiny", "--objective", "unilm", "--data-path", str(pretraining_samples),
            "--hidden-dropout", "0", "--attention-dropout", "0", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0", "--history-json", str(history), *extra,
            nproc=nproc)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        histories[name] = [r for r in json.loads(history.read_text()) if "loss_mlm" in r]
    keys = ["loss", "loss_mlm", "loss_nsp", "nsp_acc"] + [f"loss_unilm_{lm}" for lm in LM_TYPES]
    assert len(histories["pp2"]) == 3
    for one, pp2 in zip(histories["one"], histories["pp2"]):
        for key in keys:
            assert pp2[key] == pytest.approx(one[key], rel=2e-4, abs=2e-4), (key, one, pp2)
    converted = run_module("tools.convert_checkpoint", "--load", str(tmp_path / "ckpt"), "--output",
                           str(tmp_path / "hf"), "--verify")
    assert converted.returncode == 0, converted.stdout[-3000:] + converted.stderr[-3000:]
    assert "pipeline parallel 2" in converted.stdout and "next-sentence logits" in converted.stdout


def test_a_bert_checkpoint_imports_for_unilm_as_the_released_code_initialises_it(tmp_path, bert_vocab,
                                                                               pretraining_samples):
    """The paper starts UniLM v1 from BERT: --from-hf --objective unilm keeps BERT's pooler and
    next-sentence head and grows the segment embedding to 6 rows (2, 3, 4 <- 0; 5 <- 1); pretrain
    --objective unilm --finetune starts from it (with the other attention backend, which a resume
    may switch)."""
    import shutil

    import transformers

    from megatron_pmlm.training.checkpoint_reader import load_pretraining_checkpoint

    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, max_position_embeddings=128)
    bert = transformers.BertForPreTraining(config).eval()
    folder = tmp_path / "bert"
    bert.save_pretrained(str(folder))
    shutil.copyfile(bert_vocab, folder / "vocab.txt")
    imported = tmp_path / "imported"
    result = run_module("megatron_pmlm.hf.convert", "--from-hf", str(folder), "--save", str(imported),
                        "--objective", "unilm", "--add-rel-pos")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    checkpoint = load_pretraining_checkpoint(imported)
    state = checkpoint.state_dict
    segments = bert.bert.embeddings.token_type_embeddings.weight.detach()
    torch.testing.assert_close(state["bert.embeddings.token_type_embeddings.weight"], segments[[0, 1, 0, 0, 0, 1]])
    torch.testing.assert_close(state["cls.seq_relationship.weight"], bert.cls.seq_relationship.weight.detach())
    torch.testing.assert_close(state["bert.pooler.dense.weight"], bert.bert.pooler.dense.weight.detach())
    assert checkpoint.model_config.type_vocab_size == TYPE_VOCAB_SIZE
    history = tmp_path / "history.json"
    result = run_module("megatron_pmlm.pretrain", "--preset", "tiny", "--objective", "unilm", "--data-path",
                        str(pretraining_samples), "--load", str(imported), "--finetune", "--attention-backend", "flex",
                        "--attention-dropout", "0", "--micro-batch-size", "4", "--global-batch-size", "4",
                        "--train-iters", "2", "--log-interval", "1", "--eval-iters", "0", "--history-json", str(history))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "loaded the weights of" in result.stdout
    first = [r for r in json.loads(history.read_text()) if "loss_mlm" in r][0]
    # BERT-initialised (random here, but the imported weights): the NSP head is BERT's, not a fresh one.
    assert 0.0 < first["loss_nsp"] < 5.0
