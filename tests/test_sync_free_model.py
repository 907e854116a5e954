"""Issue 33 items 4 (model side) and 5: no host-device synchronisation in any model family's forward,
backward, loss and metrics vector (counted on the CPU by training/host_syncs.py), and the one
gather + one head + chunked biased cross entropy equal to the former head and loss, which is kept
below as the reference, in fp32 and under bf16 autocast; likewise s2s fine-tuning's label-smoothed
loss and PALM's continuation loss, chunked the same way, against their former fp32 log-softmax."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_pmlm.config import MaskingConfig, model_config_from_preset
from megatron_pmlm.data.batches import build_batch
from megatron_pmlm.data.masking import mask_example
from megatron_pmlm.models.layout import (CONTEXT, IGNORE_INDEX, MASKED, PSEUDO, PMLMBatch, gather_slots, labelled_index,
                                         pmlm_predicted_index, predicted_slots)
from megatron_pmlm.models.model import PMLMForPreTraining, mask_vocabulary_padding
from megatron_pmlm.models.objectives import get_objective
from megatron_pmlm.models.palm import (COPY_PROBABILITY_FLOOR, PalmBatch, PalmForPreTraining, copy_probability,
                                      final_distribution, palm_config_from_preset, scatter_copy)
from megatron_pmlm.models.palm import predicted_ids as palm_predicted_ids
from megatron_pmlm.models.pipeline import (EmbeddingPipe, HeadTransformPipe, LayerPipe, LossPipe, WordEmbeddingPipe,
                                           canonical_parameter_name, tied_logits_forward)
from megatron_pmlm.models.seq2seq import MODES, PMLMForSeq2Seq, Seq2SeqConfig, SpecialIds, build_seq2seq_batch
from megatron_pmlm.models.unilm import TYPE_VOCAB_SIZE
from megatron_pmlm.parallel import layers as parallel_layers
from megatron_pmlm.parallel.layers import LabelSmoothing, chunked_biased_cross_entropy
from megatron_pmlm.training.host_syncs import HostSyncCounter
from pmlm_testing import unilm_mixture_batch

VOCAB, PADDED_VOCAB = 200, 256  # a padded vocabulary: the -inf padding path is exercised
PSEUDO_ID, PAD_ID = 4, 0


def tiny_config(**overrides):
    return model_config_from_preset("tiny", vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB, hidden_dropout=0.0,
                                    attention_dropout=0.0, **overrides)


def pmlm_batch(objective: str, seed: int = 0, lengths=(40, 25, 33)) -> PMLMBatch:
    """What the loader builds: real blockwise masks, the objective's layout and predicted index."""
    rng = np.random.default_rng(seed)
    ids, segments, masks = [], [], []
    for length in lengths:
        tokens = rng.integers(6, VOCAB, length)
        ids.append(tokens)
        segments.append((np.arange(length) >= length // 2).astype(np.int64))
        masks.append(mask_example(tokens, np.ones(length, bool), rng, MaskingConfig(), VOCAB,
                                  np.arange(6), PSEUDO_ID))
    chosen = get_objective(objective)
    return build_batch(ids, segments, masks, PSEUDO_ID, PAD_ID, append_pseudo=chosen.pseudo_masked,
                       predict_masked=chosen.autoencoding)


def unilm_batch() -> PMLMBatch:
    """Every LM type and NSP labels, as data/unilm_batches.py builds them."""
    return unilm_mixture_batch(VOCAB, seed=3, max_length=39)


def seq2seq_batch(mode: str) -> PMLMBatch:
    rng = np.random.default_rng(7)
    sources = [rng.integers(6, VOCAB, n) for n in (9, 14, 6)]
    targets = [rng.integers(6, VOCAB, n) for n in (5, 3, 7)]
    special = SpecialIds(cls=2, sep=3, mask=4, pad=0)
    return build_seq2seq_batch(sources, targets, [np.random.default_rng(i) for i in range(3)],
                               Seq2SeqConfig(mode=mode, max_source_length=16, max_target_length=8), special, VOCAB)


def palm_batch(stage: int) -> PalmBatch:
    generator = torch.Generator().manual_seed(5)
    context = torch.randint(6, VOCAB, (3, 20), generator=generator)
    roles = torch.full_like(context, CONTEXT)
    roles[1, 15:], context[1, 15:] = 4, 0  # PAD
    masked = torch.zeros_like(context, dtype=torch.bool)
    masked[:, 3] = masked[:, 7] = masked[0, 11] = stage == 1
    mlm_labels = torch.where(masked, context, IGNORE_INDEX)
    encoder_roles = torch.where(masked, MASKED, roles)
    decoder_ids = torch.randint(6, VOCAB, (3, 9 if stage == 2 else 0), generator=generator)
    labels = torch.cat([decoder_ids[:, 1:], torch.full((3, 1 if stage == 2 else 0), 3)], 1)
    if stage == 2:
        labels[2, 6:] = IGNORE_INDEX
    index = pmlm_predicted_index(encoder_roles, mlm_labels, pseudo_masked=False) if stage == 1 else None
    return PalmBatch(torch.where(masked, 4, context), encoder_roles, context, mlm_labels, decoder_ids, labels, index)


def assert_step_is_sync_free(model: torch.nn.Module, inputs: tuple) -> None:
    """forward + backward + the metrics vector: nothing waits for the device, ours or anyone's
    (the backward's ops are attributed to this file, "other": they are counted too)."""
    with HostSyncCounter() as syncs:
        losses = model(*inputs)
        losses.loss.backward()
        losses.metrics()
    assert syncs.count() == 0, syncs.report()


# --------------------------------------------------------------------------------- no host syncs

@pytest.mark.parametrize("objective", ["ae+par", "ae", "par", "ar"])
def test_pmlm_step_is_sync_free(objective):
    assert_step_is_sync_free(PMLMForPreTraining(tiny_config(), objective), pmlm_batch(objective).as_tuple())


def test_unilm_step_is_sync_free():
    model = PMLMForPreTraining(tiny_config(type_vocab_size=TYPE_VOCAB_SIZE), "unilm", init_seed=2)
    assert_step_is_sync_free(model, unilm_batch().as_tuple())


@pytest.mark.parametrize("mode", list(MODES))
def test_seq2seq_step_is_sync_free(mode):
    model = PMLMForSeq2Seq(tiny_config(), Seq2SeqConfig(mode=mode, max_source_length=16, max_target_length=8))
    assert_step_is_sync_free(model, seq2seq_batch(mode).as_tuple())


@pytest.mark.parametrize("stage", [1, 2])
def test_palm_step_is_sync_free(stage):
    config = palm_config_from_preset("palm-tiny", vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB,
                                     hidden_dropout=0.0, attention_dropout=0.0)
    assert_step_is_sync_free(PalmForPreTraining(config, stage=stage), palm_batch(stage).as_tuple())


def test_without_the_index_the_model_finds_the_slots_itself_and_agrees():
    """Convenience callers (a batch built by hand) still work, at the price of the sync."""
    model = PMLMForPreTraining(tiny_config(), "ae+par")
    batch = pmlm_batch("ae+par")
    with HostSyncCounter() as syncs:
        derived = model(*batch.as_tuple()[:6]).metrics()
    assert syncs.count("ours") > 0
    torch.testing.assert_close(derived, model(*batch.as_tuple()).metrics(), rtol=0, atol=0)


# ------------------------------------------------------------------- the pipeline's stages

def pipeline_chain(model: PMLMForPreTraining):
    """The pipeline's layer modules (models/pipeline.py) in one process, with the plain model's weights."""
    config, layers, objective = model.config, model.layers, model.objective
    word = WordEmbeddingPipe(config, layers, objective)
    body = [EmbeddingPipe(config, layers)] + [LayerPipe(config, layers) for _ in range(config.num_layers)]
    head, loss = HeadTransformPipe(config, objective), LossPipe(config, layers, objective)
    state = model.state_dict()
    named = [("tied_modules.word_embeddings.", word)] + [(f"{i + 1}.", m) for i, m in enumerate(body)] + \
        [(f"{config.num_layers + 2}.", head), (f"{config.num_layers + 4}.", loss)]
    with torch.no_grad():
        for prefix, module in named:
            for name, param in module.named_parameters():
                param.copy_(state[canonical_parameter_name(prefix + name, config.num_layers)])

    def run(inputs):
        activations = word(inputs)
        for module in body + [head]:
            activations = module(activations)
        return loss(tied_logits_forward(layers)(word, activations))

    parameters = {canonical_parameter_name(prefix + name, config.num_layers): param
                  for prefix, module in named for name, param in module.named_parameters()}
    return run, parameters


@pytest.mark.parametrize("objective", ["ae+par", "par", "unilm"])
def test_pipeline_stages_are_sync_free_and_equal_the_model(objective):
    config = tiny_config(type_vocab_size=TYPE_VOCAB_SIZE) if objective == "unilm" else tiny_config()
    model = PMLMForPreTraining(config, objective, init_seed=4)
    batch = unilm_batch() if objective == "unilm" else pmlm_batch(objective)
    run, parameters = pipeline_chain(model)
    with HostSyncCounter() as syncs:
        metrics = run(batch.as_tuple())
        metrics[0].backward()
    assert syncs.count() == 0, syncs.report()
    expected = model(*batch.as_tuple())
    expected.loss.backward()
    torch.testing.assert_close(metrics.detach(), expected.metrics(), rtol=1e-6, atol=1e-7)
    for name, param in parameters.items():
        torch.testing.assert_close(param.grad, dict(model.named_parameters())[name].grad, rtol=1e-5, atol=1e-7,
                                   msg=lambda m, name=name: f"{name}: {m}")


# ------------------------------------------------------------ equal to the former head and loss

def reference_pmlm_losses(model: PMLMForPreTraining, batch: PMLMBatch) -> torch.Tensor:
    """The head and loss as they were before issue 33: per objective, boolean indexing, its own head
    call, the fp32 padding buffer added to the logits, F.cross_entropy on `.float()`."""
    hidden = model.bert(*batch.as_tuple()[:5])
    head, config = model.cls.predictions, model.config
    padding = torch.zeros(config.embedding_rows).masked_fill(torch.arange(config.embedding_rows) >= config.vocab_size,
                                                             float("-inf"))
    weight = model.bert.embeddings.word_embeddings.weight
    values = {}
    for name, role, enabled in (("ae", MASKED, model.objective.autoencoding),
                                ("par", PSEUDO, model.objective.pseudo_masked)):
        selected = predicted_slots(batch.roles, batch.labels, role)
        if not enabled:
            selected = torch.zeros_like(selected)
        logits = F.linear(head.transform(hidden[selected]), weight) + head.bias + padding
        targets = batch.labels[selected]
        count = selected.sum()
        values[f"loss_{name}"] = F.cross_entropy(logits.float(), targets, reduction="none").sum() / count.clamp(min=1)
        values[f"{name}_correct"] = (logits.argmax(-1) == targets).sum()
        values[f"{name}_count"] = count
    loss = values["loss_ae"] + values["loss_par"]
    return torch.stack([loss, values["loss_ae"], values["loss_par"], values["ae_correct"].float(),
                        values["ae_count"].float(), values["par_correct"].float(), values["par_count"].float()])


def losses_and_gradients(model, step):
    model.zero_grad(set_to_none=True)
    metrics = step()
    metrics[0].backward()
    return metrics.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("objective", ["ae+par", "ae", "par"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_one_head_and_chunked_loss_equal_the_former_head_and_loss(objective, precision):
    model = PMLMForPreTraining(tiny_config(), objective, init_seed=1)
    with torch.no_grad():  # a non-zero output bias (it starts at zero), so adding it in the wrong dtype shows
        model.cls.predictions.bias.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    batch = pmlm_batch(objective, seed=2)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def ours():
        with autocast:
            return model(*batch.as_tuple()).metrics_with_grad()

    def reference():
        with autocast:
            return reference_pmlm_losses(model, batch)

    got, got_grads = losses_and_gradients(model, ours)
    expected, expected_grads = losses_and_gradients(model, reference)
    # Losses within fp32 rounding (bf16 too: the logits are the same bf16 GEMM, the bias is added in
    # fp32 as before); accuracy counts identical.
    torch.testing.assert_close(got[:3], expected[:3], rtol=1e-6, atol=1e-7)
    assert torch.equal(got[3:], expected[3:]), (got, expected)
    assert got_grads.keys() == expected_grads.keys()
    # bf16: the AE and [P] rows now share one GEMM (bf16 outputs, 1-2 ulp apart from two GEMMs').
    tolerance = dict(rtol=1e-5, atol=1e-7) if precision == "fp32" else dict(rtol=1.6e-2, atol=2e-3)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **tolerance, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_biased_cross_entropy_equals_cross_entropy_of_the_biased_logits(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(11, 37, generator=generator) * 3).to(dtype).requires_grad_()
    bias = torch.randn(37, generator=generator).masked_fill(torch.arange(37) >= 33, float("-inf")).requires_grad_()
    labels = torch.randint(0, 33, (11,), generator=generator)
    upstream = torch.rand(11, generator=generator)

    losses, predicted = chunked_biased_cross_entropy(logits, labels, bias, chunk_rows=4)
    (losses * upstream).sum().backward()
    got = (losses.detach(), predicted, logits.grad, bias.grad)
    logits.grad = bias.grad = None
    biased = (logits + bias).float()
    expected_losses = F.cross_entropy(biased, labels, reduction="none")
    (expected_losses * upstream).sum().backward()
    assert losses.dtype == torch.float32 and torch.equal(predicted, biased.argmax(-1))
    torch.testing.assert_close(got[0], expected_losses.detach(), rtol=1e-6, atol=1e-6)
    grad_tolerance = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(got[2], logits.grad, **grad_tolerance)
    torch.testing.assert_close(got[3], bias.grad, rtol=1e-5, atol=1e-6)
    assert got[2].dtype == dtype and torch.equal(got[3][33:], torch.zeros(4))


class LargestFloat32Output(TorchDispatchMode):
    """The largest number of elements of an fp32 tensor any op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.largest = max(self.largest, tensor.numel())
        return out


def test_the_loss_holds_no_fp32_slots_by_vocabulary_tensor_beyond_one_chunk():
    logits = torch.randn(64, 300).to(torch.bfloat16).requires_grad_()
    bias = torch.zeros(300, requires_grad=True)
    labels = torch.randint(0, 300, (64,))
    with LargestFloat32Output() as chunked:
        chunked_biased_cross_entropy(logits, labels, bias, chunk_rows=8)[0].sum().backward()
    assert chunked.largest == 8 * 300
    with LargestFloat32Output() as plain:  # what the former loss did
        F.cross_entropy((logits + bias).float(), labels).backward()
    assert plain.largest == 64 * 300


def test_bench_mlm_head_compares_the_former_and_todays_head_and_loss():
    from pmlm_testing import run_module

    result = run_module("tools.bench_mlm_head", "--preset", "tiny", "--seq-length", "32", "--micro-batch-size", "2",
                        "--iterations", "1", "--warmup", "0", "--chunk-rows", "8", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    former, now = (line for line in result.stdout.splitlines() if "ms fwd+bwd" in line)
    assert former.split("|")[0].split()[-1] == now.split("|")[0].split()[-1]  # the same loss
    bad = run_module("tools.bench_mlm_head", "--chunk-rows", "-1")
    assert bad.returncode == 2 and "--chunk-rows must be >= 0" in bad.stderr


@pytest.mark.parametrize("loss", ["s2s", "palm"])
def test_bench_mlm_head_compares_the_former_and_todays_s2s_and_palm_losses(loss):
    from pmlm_testing import run_module

    result = run_module("tools.bench_mlm_head", "--loss", loss, "--preset", "tiny", "--seq-length", "6",
                        "--micro-batch-size", "3", "--context-length", "10", "--iterations", "1", "--warmup", "0",
                        "--chunk-rows", "4", "--bf16", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    former, now = (line for line in result.stdout.splitlines() if "ms fwd+bwd" in line)
    assert abs(float(former.split()[2]) - float(now.split()[2])) <= 1e-5 * float(former.split()[2])
    # Only one chunk of fp32 [positions, vocabulary] now (4 x 30,592 x 4 bytes = 0.5 MiB), 18 rows before.
    assert "largest fp32   0.5 MiB" in now and "largest fp32   0.5 MiB" not in former, (former, now)
    bad = run_module("tools.bench_mlm_head", "--loss", loss, "--label-smoothing", "1")
    assert bad.returncode == 2 and "--label-smoothing must be in [0, 1)" in bad.stderr


# ---------------------------------------- s2s fine-tuning's and PALM's losses equal to the former ones

def former_label_smoothed_loss(logits: torch.Tensor, labels: torch.Tensor, smoothing: float,
                               pad_id: int) -> torch.Tensor:
    """models/seq2seq.py's label_smoothed_loss before issue 33 item 5, verbatim: an fp32
    [tokens, vocab] log-softmax."""
    log_probs = F.log_softmax(logits.float(), dim=-1)
    label_log_probs = log_probs.gather(-1, labels[:, None]).squeeze(-1)
    if smoothing == 0.0:
        return -label_log_probs
    vocab = logits.shape[-1]
    spread = smoothing / (vocab - 2)
    entropy_term = (1.0 - smoothing) * torch.log(torch.tensor(1.0 - smoothing)) if smoothing < 1.0 else 0.0
    constant = entropy_term + (vocab - 2) * spread * torch.log(torch.tensor(spread))
    others = log_probs.sum(-1) - label_log_probs - log_probs[:, pad_id]
    return constant - (1.0 - smoothing) * label_log_probs - spread * others


def reference_seq2seq_losses(model: PMLMForSeq2Seq, batch: PMLMBatch) -> torch.Tensor:
    """PMLMForSeq2Seq.forward before issue 33 item 5: the biased logits (fp32 under autocast) cut
    to the real vocabulary, then the former label-smoothed loss; [loss, correct, count]."""
    hidden = model.bert(*batch.as_tuple()[:5])
    index = labelled_index(batch.labels)
    logits = model.mlm_logits(gather_slots(hidden, index))[:, :model.config.vocab_size]
    targets = gather_slots(batch.labels, index)
    token_losses = former_label_smoothed_loss(logits, targets, model.seq2seq.label_smoothing, model.pad_token_id)
    count = torch.full((), targets.numel())
    loss = token_losses.sum() / (count.float() + 1e-5)
    return torch.stack([loss, (logits.argmax(-1) == targets).sum().float(), count.float()])


def former_final_distribution(mixture, context_ids: torch.Tensor) -> torch.Tensor:
    """models/palm.py's final_distribution before issue 33 item 5 (tensor parallel size 1)."""
    vocab = torch.softmax(mixture.vocab_logits.float(), -1)
    copy = scatter_copy(mixture.copy_attention, context_ids, mixture.vocab_logits.shape[-1])
    return mixture.log_gate.exp()[..., None] * vocab + mixture.log_gate_complement.exp()[..., None] * copy


def reference_palm_losses(model: PalmForPreTraining, batch: PalmBatch) -> torch.Tensor:
    """Stage 2's continuation_losses before issue 33 item 5 (tensor parallel size 1): log P^v from
    an fp32 log-softmax over [B, D, vocab], the argmax of the whole fp32 P; PALM_METRICS' vector."""
    mixture = model.mixture(model.encode(batch.encoder_ids, batch.encoder_roles), batch.encoder_roles,
                            batch.decoder_ids)
    valid = batch.labels != IGNORE_INDEX
    targets = torch.where(valid, batch.labels, 0)
    log_vocab = torch.log_softmax(mixture.vocab_logits.float(), -1).gather(-1, targets[..., None])[..., 0]
    copy = copy_probability(mixture.copy_attention, batch.context_ids, targets)
    log_p = torch.logaddexp(mixture.log_gate + log_vocab,
                            mixture.log_gate_complement + torch.log(copy.clamp_min(COPY_PROBABILITY_FLOOR)))
    count = valid.sum()
    loss = -(log_p * valid).sum() / count.clamp(min=1)
    predicted = former_final_distribution(mixture, batch.context_ids).argmax(-1)
    correct = ((predicted == targets) & valid).sum()
    return torch.stack([loss, correct.float(), count.float(), (mixture.log_gate.exp() * valid).sum().detach(),
                        (copy * valid).sum().detach()])


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 4 rows, so that the test batches span several."""
    monkeypatch.setattr(parallel_layers, "CROSS_ENTROPY_CHUNK_ROWS", 4)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("smoothing", [0.1, 0.0])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_seq2seq_chunked_loss_equals_the_former_loss(mode, smoothing, precision, small_chunks):
    model = PMLMForSeq2Seq(tiny_config(), Seq2SeqConfig(mode=mode, max_source_length=16, max_target_length=8,
                                                        label_smoothing=smoothing), pad_token_id=PAD_ID, init_seed=5)
    with torch.no_grad():  # a non-zero output bias, so adding it in the wrong dtype or place shows
        model.cls.predictions.bias.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(3))
    batch = seq2seq_batch(mode)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def ours():
        with autocast:
            losses = model(*batch.as_tuple())
            return torch.stack([losses.loss, losses.correct.float(), losses.count.float()])

    def reference():
        with autocast:
            return reference_seq2seq_losses(model, batch)

    got, got_grads = losses_and_gradients(model, ours)
    expected, expected_grads = losses_and_gradients(model, reference)
    assert expected[2] > 4  # several chunks
    torch.testing.assert_close(got[0], expected[0], rtol=1e-6, atol=0)
    assert torch.equal(got[1:], expected[1:]), (got, expected)
    assert got_grads.keys() == expected_grads.keys()
    # bf16: the same bf16 logits; the logits' gradient is rounded to bf16 where it was fp32 before.
    tolerance = dict(rtol=1e-5, atol=1e-7) if precision == "fp32" else dict(rtol=1.6e-2, atol=2e-3)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **tolerance, msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_palm_chunked_continuation_loss_equals_the_former_loss(precision, small_chunks):
    config = palm_config_from_preset("palm-tiny", vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB,
                                     hidden_dropout=0.0, attention_dropout=0.0)
    model = PalmForPreTraining(config, stage=2, init_seed=6)
    batch = palm_batch(2)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16")

    def ours():
        with autocast:
            losses = model(*batch.as_tuple())
            return torch.stack([losses.loss, losses.token_correct.float(), losses.token_count.float(),
                                losses.gate_sum.float(), losses.copy_sum.float()])

    def reference():
        with autocast:
            return reference_palm_losses(model, batch)

    got, got_grads = losses_and_gradients(model, ours)
    expected, expected_grads = losses_and_gradients(model, reference)
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    assert torch.equal(got[1:3], expected[1:3]), (got, expected)
    assert got_grads.keys() == expected_grads.keys() and len(got_grads) > 0
    tolerance = dict(rtol=1e-5, atol=1e-7) if precision == "fp32" else dict(rtol=1.6e-2, atol=2e-3)
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, expected_grads[name], **tolerance, msg=lambda m, name=name: f"{name}: {m}")


def test_palm_chunked_predicted_ids_equal_the_argmax_of_the_whole_distribution():
    """Every decoder position's argmax of P, a chunk of positions at a time (chunks that cut across
    sequences), equals the argmax of the former [B, D, vocab] P."""
    config = palm_config_from_preset("palm-tiny", vocab_size=VOCAB, padded_vocab_size=PADDED_VOCAB,
                                     hidden_dropout=0.0, attention_dropout=0.0)
    model = PalmForPreTraining(config, stage=2, init_seed=7).eval()
    batch = palm_batch(2)
    with torch.no_grad():
        mixture = model.mixture(model.encode(batch.encoder_ids, batch.encoder_roles), batch.encoder_roles,
                                batch.decoder_ids)
        former = former_final_distribution(mixture, batch.context_ids)
        assert torch.equal(final_distribution(mixture, batch.context_ids), former)  # in place, the same values
        expected = former.argmax(-1)
        assert len(set(expected.flatten().tolist())) >= 3  # not one id everywhere: which context a row reads shows
        for chunk_rows in (4, 5, 27, 100):
            got = palm_predicted_ids(mixture, batch.context_ids, model.layers, chunk_rows=chunk_rows)
            assert torch.equal(got, expected), chunk_rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_chunked_label_smoothing_equals_the_former_closed_form(dtype, with_bias):
    """Over the real vocabulary only (the padding columns get no mass, no gradient), [PAD] left out,
    a label that is [PAD] included (the former formula, whatever it means); the padding -inf in the
    bias (the MLM head's) or in the logits themselves (PALM's, no bias)."""
    generator = torch.Generator().manual_seed(1)
    logits = (torch.randn(11, 37, generator=generator) * 3).to(dtype).requires_grad_()
    padding = torch.arange(37) >= 33
    bias = torch.randn(37, generator=generator).masked_fill(padding, float("-inf")).requires_grad_()
    labels = torch.randint(0, 33, (11,), generator=generator)
    labels[3] = 2  # the pad id below
    upstream = torch.rand(11, generator=generator)
    smoothing = LabelSmoothing(0.1, 33, pad_id=2)

    def inputs():
        return (logits, bias) if with_bias else (mask_vocabulary_padding(logits, padding), None)

    scores, score_bias = inputs()
    losses, predicted = chunked_biased_cross_entropy(scores, labels, score_bias, chunk_rows=4,
                                                     label_smoothing=smoothing)
    (losses * upstream).sum().backward()
    got = (losses.detach(), predicted, logits.grad, bias.grad)
    logits.grad = bias.grad = None
    scores, score_bias = inputs()
    biased = (scores + score_bias).float() if with_bias else scores.float()
    expected_losses = former_label_smoothed_loss(biased[:, :33], labels, 0.1, pad_id=2)
    (expected_losses * upstream).sum().backward()
    torch.testing.assert_close(got[0], expected_losses.detach(), rtol=1e-6, atol=0)
    assert torch.equal(got[1], biased.argmax(-1))
    grad_tolerance = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-3)
    torch.testing.assert_close(got[2], logits.grad, **grad_tolerance)
    assert got[2].dtype == dtype and torch.equal(got[2][:, 33:], torch.zeros(11, 4, dtype=dtype))
    if with_bias:
        torch.testing.assert_close(got[3], bias.grad, rtol=1e-5, atol=1e-6)
        assert torch.equal(got[3][33:], torch.zeros(4))
    else:
        assert got[3] is None


def test_the_smoothed_loss_holds_no_fp32_tokens_by_vocabulary_tensor_beyond_one_chunk():
    logits = torch.randn(64, 300).to(torch.bfloat16).requires_grad_()
    bias = torch.zeros(300).masked_fill(torch.arange(300) >= 290, float("-inf")).requires_grad_()
    labels = torch.randint(1, 290, (64,))
    with LargestFloat32Output() as chunked:
        chunked_biased_cross_entropy(logits, labels, bias, chunk_rows=8,
                                     label_smoothing=LabelSmoothing(0.1, 290, 0))[0].sum().backward()
    assert chunked.largest == 8 * 300
    with LargestFloat32Output() as plain:  # what the former loss did
        former_label_smoothed_loss((logits + bias)[:, :290], labels, 0.1, 0).sum().backward()
    assert plain.largest == 64 * 300  # the biased logits, then the log-softmax of 64 x 290


@pytest.mark.parametrize("epsilon,vocab_size,pad_id", [(0.0, 30, 0), (1.0, 30, 0), (0.1, 2, 0), (0.1, 30, 30)])
def test_label_smoothing_refuses_what_it_cannot_spread(epsilon, vocab_size, pad_id):
    with pytest.raises(ValueError, match="label smoothing"):
        LabelSmoothing(epsilon, vocab_size, pad_id)


def test_tensor_parallel_layers_refuse_label_smoothing_rather_than_spread_it_differently():
    from megatron_pmlm.parallel.layers import MegatronCoreLayers

    layers = object.__new__(MegatronCoreLayers)  # the check comes before any process group is needed
    with pytest.raises(NotImplementedError, match="tensor parallel size 1"):
        layers.biased_cross_entropy(torch.zeros(2, 5), torch.zeros(2, dtype=torch.long), torch.zeros(5),
                                    LabelSmoothing(0.1, 5, 0))
