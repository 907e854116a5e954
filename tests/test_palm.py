"""PALM (issue 14, SPEC §9): the pointer-generator's distribution, the copy path, causality, the
data's context/continuation pairs, TP=2 = TP=1, training on real text (both stages), exact resume,
verified conversion and continuation decoding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from pmlm_testing import REPO_ROOT, plotted_panels, run_module, run_tool

from data_prep.palm_pairs import palm_pairs
from megatron_pmlm.models.layout import CONTEXT, IGNORE_INDEX, PAD
from megatron_pmlm.models.palm import PalmForPreTraining, next_log_probs, palm_config_from_preset, start_decoding

VOCAB = 250
PALM_TINY = ["--model", "palm", "--preset", "palm-tiny", "--micro-batch-size", "4", "--global-batch-size", "8",
             "--lr", "2e-3", "--lr-warmup-iters", "2", "--log-interval", "1", "--eval-iters", "0"]


def tiny_model(seed: int = 0) -> PalmForPreTraining:
    config = palm_config_from_preset("palm-tiny", vocab_size=VOCAB, padded_vocab_size=256, hidden_dropout=0.0,
                                     attention_dropout=0.0)
    return PalmForPreTraining(config, init_seed=seed).eval()


def random_inputs(seed: int = 0, batch: int = 2, context: int = 12, continuation: int = 7):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, VOCAB, (batch, context), generator=generator)
    roles = torch.full_like(ids, CONTEXT)
    roles[-1, context - 3:] = PAD
    ids[-1, context - 3:] = 0
    decoder_ids = torch.randint(5, VOCAB, (batch, continuation), generator=generator)
    return ids, roles, decoder_ids


@torch.no_grad()
def test_the_final_distribution_sums_to_one_over_the_vocabulary():
    model = tiny_model()
    ids, roles, decoder_ids = random_inputs()
    probabilities = model.distribution(ids, roles, ids, decoder_ids)
    assert probabilities.shape == (2, 7, VOCAB)
    assert (probabilities >= 0).all()
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(2, 7), rtol=0, atol=1e-5)


@torch.no_grad()
def test_with_the_gate_at_copy_a_context_token_outside_the_generators_top_k_is_reproduced():
    model = tiny_model(seed=1)
    decoder_ids = torch.tensor([[3, 17, 42]])
    k = 10
    for rare in range(5, VOCAB):  # a token the generator ranks outside its top k at every position
        context = torch.tensor([[1] + [rare] * 8 + [2]])
        roles = torch.full_like(context, CONTEXT)
        mixture = model.mixture(model.encode(context, roles), roles, decoder_ids)
        top = mixture.vocab_logits.topk(k, -1).indices
        if not (top == rare).any():
            break
    gate = model.pointer_generator.gate
    gate.weight.zero_()
    gate.bias.fill_(-40.0)  # λ -> 0: P = P^c
    predicted = model.distribution(context, roles, context, decoder_ids).argmax(-1)
    assert (predicted == rare).all(), predicted
    gate.bias.fill_(40.0)  # λ -> 1: P = P^v, which never picks it
    probabilities = model.distribution(context, roles, context, decoder_ids)
    assert (probabilities.argmax(-1) == mixture.vocab_logits[..., :VOCAB].argmax(-1)).all()
    assert not (probabilities.argmax(-1) == rare).any()


@torch.no_grad()
def test_the_decoder_never_reacts_to_later_continuation_tokens():
    model = tiny_model()
    ids, roles, decoder_ids = random_inputs()
    before = model.distribution(ids, roles, ids, decoder_ids)
    for t in (2, 5):
        perturbed = decoder_ids.clone()
        perturbed[:, t] = (perturbed[:, t] + 11) % VOCAB
        after = model.distribution(ids, roles, ids, perturbed)
        torch.testing.assert_close(after[:, :t], before[:, :t], rtol=0, atol=1e-6)
        assert (after[:, t] - before[:, t]).abs().amax(-1).min() > 1e-4  # position t reads token t


@torch.no_grad()
def test_the_encoder_never_sees_the_continuation_and_padding_changes_nothing():
    model = tiny_model()
    ids, roles, decoder_ids = random_inputs()
    seen = []
    hook = model.bert.register_forward_hook(lambda module, inputs, output: seen.append(output))
    model.distribution(ids, roles, ids, decoder_ids)
    model.distribution(ids, roles, ids, (decoder_ids * 7 + 3) % VOCAB)
    hook.remove()
    torch.testing.assert_close(seen[0], seen[1], rtol=0, atol=0)
    # The padded context's real positions are what they are without the padding.
    short = model.distribution(ids[-1:, :9], roles[-1:, :9], ids[-1:, :9], decoder_ids[-1:])
    padded = model.distribution(ids[-1:], roles[-1:], ids[-1:], decoder_ids[-1:])
    torch.testing.assert_close(short, padded, rtol=0, atol=1e-6)


@torch.no_grad()
def test_incremental_decoding_equals_the_full_forward():
    model = tiny_model()
    ids, roles, decoder_ids = random_inputs()
    full = model.distribution(ids, roles, ids, decoder_ids)
    state = start_decoding(model, ids, roles, ids)
    for t in range(decoder_ids.shape[1]):
        step = next_log_probs(model, state, decoder_ids[:, t])
        torch.testing.assert_close(step.exp(), full[:, t], rtol=1e-5, atol=1e-6)


def test_pairs_are_whole_sentences_sliding_by_one_sentence():
    lengths = np.array([5, 7, 3, 9, 4, 6, 2, 8])  # two documents: sentences 0-4 and 5-7
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + 100
    rows, long_count = palm_pairs(lengths, starts, np.array([0, 5, 8]), np.array([10, 11]),
                                  context_length=14, continuation_length=11)
    assert long_count == 0
    # Context budget 12 tokens, continuation budget 10: greedy whole sentences, within a document.
    expected = [  # (document, first sentence, context sentences, continuation sentences)
        (10, 0, [0, 1], [2]), (10, 1, [1, 2], [3]), (10, 2, [2, 3], [4]), (10, 3, [3], [4]),
        (11, 5, [5, 6], [7])]
    assert len(rows) == len(expected)
    for row, (document, _, context, continuation) in zip(rows, expected):
        assert row[1] == document
        assert row[2] == starts[context[0]] and row[3] == lengths[context].sum()
        assert row[4] == starts[continuation[0]] == row[2] + row[3]  # the continuation follows the context
        assert row[5] == lengths[continuation].sum()
    # A sentence longer than a budget is cut into pieces that fit.
    rows, long_count = palm_pairs(np.array([30, 4]), np.array([0, 30]), np.array([0, 2]), np.array([0]), 14, 11)
    assert long_count == 1 and rows[:, 3].max() <= 12 and rows[:, 5].max() <= 10


@pytest.fixture(scope="module")
def palm_samples(pretraining_samples, tmp_path_factory) -> Path:
    """PALM pairs from the same tokenized wikitext slice as the PMLM samples."""
    output = tmp_path_factory.mktemp("palm") / "samples"
    args = ["--layout", "palm", "--data-path", str(pretraining_samples.parent / "wiki"), "--context-length", "48",
            "--continuation-length", "16", "--split", "95,5,0", "--mask-epochs", "2", "--seed", "7", "--no-progress"]
    result = run_module("data_prep.build_samples", *args, "--output", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    again = run_module("data_prep.build_samples", *args, "--output", str(output.parent / "again"))
    assert again.returncode == 0, again.stderr[-3000:]
    for name in ("samples.bin", "mask_offsets.bin", "mask_positions.bin", "mask_corrupted.bin"):
        assert (output / "train" / name).read_bytes() == (output.parent / "again" / "train" / name).read_bytes()
    return output


def test_batches_hold_the_context_for_the_encoder_and_the_continuation_for_the_decoder(palm_samples):
    from megatron_pmlm.data.samples import PretrainingSamples
    from megatron_pmlm.data.palm_data import PalmBatchBuilder

    samples = PretrainingSamples(palm_samples, "train")
    tokens = samples.corpora[0].tokens
    indices = np.arange(6)
    stage2 = PalmBatchBuilder(samples, 2)(indices, 0)
    stage1 = PalmBatchBuilder(samples, 1)(indices, 0)
    special = samples.special
    for i, row in enumerate(samples.rows[indices]):
        _, _, a_start, a_len, b_start, b_len = (int(v) for v in row)
        assert a_len + 2 <= 48 and b_len + 1 <= 16 and b_start == a_start + a_len
        context = [special.cls, *tokens[a_start:a_start + a_len], special.sep]
        assert stage2.encoder_ids[i, :a_len + 2].tolist() == context
        assert (stage2.encoder_roles[i, a_len + 2:] == PAD).all()
        continuation = tokens[b_start:b_start + b_len].tolist()
        assert stage2.decoder_ids[i, :b_len + 1].tolist() == [special.cls, *continuation]
        assert stage2.labels[i, :b_len + 1].tolist() == [*continuation, special.sep]
        # Stage 1: the stored masks corrupt the context only; the labels are its original tokens.
        masked = stage1.mlm_labels[i] != IGNORE_INDEX
        assert 0 < int(masked.sum()) and masked.nonzero().max() <= a_len
        assert stage1.mlm_labels[i][masked].tolist() == stage2.encoder_ids[i][masked].tolist()
    assert stage1.decoder_ids.shape[1] == 0


def test_tensor_parallel_2_equals_1_in_both_stages():
    result = run_module("torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        str(REPO_ROOT / "tests" / "distributed" / "palm_tp_equivalence.py"), timeout=300,
                        env={"PYTHONPATH": str(REPO_ROOT)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "stage 1: TP=2 matches TP=1" in result.stdout and "stage 2: TP=2 matches TP=1" in result.stdout


def pretrain(samples: Path, history: Path, *args: str):
    result = run_module("megatron_pmlm.pretrain", "--data-path", str(samples), *PALM_TINY,
                        "--history-json", str(history), *args)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return [r for r in json.loads(history.read_text()) if "loss" in r], result


@pytest.fixture(scope="module")
def trained(palm_samples, tmp_path_factory):
    """Stage 1, then stage 2 from it: once uninterrupted, once stopped at iteration 4 and resumed."""
    work = tmp_path_factory.mktemp("palm_runs")
    stage1, _ = pretrain(palm_samples, work / "stage1.json", "--palm-stage", "1", "--train-iters", "12",
                         "--save", str(work / "stage1"))
    start = ["--palm-stage", "2", "--train-iters", "8"]
    full, _ = pretrain(palm_samples, work / "full.json", *start, "--load", str(work / "stage1"), "--finetune",
                       "--save", str(work / "full"))
    first, _ = pretrain(palm_samples, work / "first.json", *start, "--load", str(work / "stage1"), "--finetune",
                        "--save", str(work / "resumed"), "--exit-interval", "4")
    second, resumed = pretrain(palm_samples, work / "second.json", *start, "--load", str(work / "resumed"),
                               "--save", str(work / "resumed"))
    return dict(work=work, stage1=stage1, full=full, first=first, second=second, resumed=resumed.stdout)


def test_both_stages_learn_on_real_text(trained):
    stage1, full = trained["stage1"], trained["full"]
    assert {"mlm_acc"} <= set(stage1[0]) and {"token_acc", "generate_gate", "target_copy_prob"} <= set(full[0])
    assert np.mean([r["loss"] for r in stage1[-3:]]) < np.mean([r["loss"] for r in stage1[:3]]) - 0.1
    assert np.mean([r["loss"] for r in full[-3:]]) < np.mean([r["loss"] for r in full[:3]]) - 0.1
    work = trained["work"]
    panels = plotted_panels([work / "stage1.json", work / "full.json"], work / "curves.png", ["stage 1", "stage 2"])
    assert panels == {"loss": ["stage 1 train", "stage 2 train"], "mlm_acc": ["stage 1 train"],
                      "token_acc": ["stage 2 train"]}, panels


def test_resume_is_exact(trained):
    """Dropout on: the RNG states, the sample order and the optimizer all come back."""
    assert "resumed from" in trained["resumed"] and "iteration 4" in trained["resumed"]
    assert [r["iteration"] for r in trained["second"]] == [5, 6, 7, 8]
    resumed = [r["loss"] for r in trained["first"] + trained["second"]]
    assert resumed == pytest.approx([r["loss"] for r in trained["full"]], rel=1e-6)


def test_a_stage_1_checkpoint_resumes_only_as_stage_1(trained, palm_samples, tmp_path):
    result = run_module("megatron_pmlm.pretrain", "--data-path", str(palm_samples), *PALM_TINY, "--train-iters", "20",
                        "--load", str(trained["work"] / "stage1"))
    assert result.returncode == 2 and "trained in --palm-stage 1" in result.stderr and "--finetune" in result.stderr
    result = run_module("megatron_pmlm.pretrain", "--data-path", str(palm_samples), *PALM_TINY,
                        "--pipeline-model-parallel-size", "2")
    assert result.returncode == 2 and "error: --model palm does not run with --pipeline" in result.stderr


def test_a_palm_resume_on_other_samples_needs_allow_data_change(trained, palm_samples, tmp_path):
    """PALM records the samples' identity as PMLM does (issue 34 item 4); a rebuild with another seed
    is other samples."""
    from megatron_pmlm.data.samples import data_identity, read_metadata

    saved = json.loads((trained["work"] / "resumed" / "iter_0000008" / "run_state.json").read_text())
    assert saved["args"]["data_identity"] == data_identity(read_metadata(palm_samples))
    assert data_identity(read_metadata(palm_samples.parent / "again")) == saved["args"]["data_identity"]
    other = tmp_path / "seed8"
    result = run_module("data_prep.build_samples", "--layout", "palm", "--data-path",
                        read_metadata(palm_samples)["blend"][0]["prefix"], "--context-length", "48",
                        "--continuation-length", "16", "--split", "95,5,0", "--mask-epochs", "2", "--seed", "8",
                        "--no-progress", "--output", str(other))
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_module("megatron_pmlm.pretrain", "--data-path", str(other), *PALM_TINY, "--palm-stage", "2",
                        "--train-iters", "9", "--load", str(trained["work"] / "resumed"), "--save", str(tmp_path / "s"))
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert "was trained on other samples (data_path " in result.stderr and "seed 7 -> 8" in result.stderr
    assert "--allow-data-change" in result.stderr and not list((tmp_path / "s").glob("iter_*"))


def test_conversion_verifies_and_the_folder_decodes_like_the_checkpoint(trained, palm_samples, tmp_path):
    checkpoint = trained["work"] / "full"
    converted = run_tool("convert_checkpoint.py", "--load", str(checkpoint), "--output", str(tmp_path / "hf"),
                         "--verify")
    assert converted.returncode == 0, converted.stdout[-3000:] + converted.stderr[-3000:]
    assert "-> OK" in converted.stdout and (tmp_path / "hf" / "modeling_palm.py").is_file()
    contexts = tmp_path / "contexts.txt"
    contexts.write_text("the park also includes a long path .\nrobert is an english actor .\n")
    outputs = []
    # decode_s2s decodes a PALM model as its alias decode_palm does.
    for command, model in (("decode_palm", checkpoint), ("decode_palm", tmp_path / "hf"), ("decode_s2s", checkpoint)):
        output = tmp_path / f"{command}-{model.name}.txt"
        result = run_module(f"megatron_pmlm.{command}", "--model", str(model), "--input", str(contexts), "--output",
                            str(output), "--beam-size", "3", "--max-target-length", "6", "--no-progress")
        assert result.returncode == 0, result.stderr[-3000:]
        outputs.append(output.read_text())
    assert outputs[0] == outputs[1] == outputs[2] and len(outputs[0].splitlines()) == 2
