"""Issue 33 items 4 (model side) and 5: no host-device synchronisation in any model family's forward,
backward, loss and metrics vector (counted on the CPU by training/host_syncs.py), and the one
gather + one head + chunked biased cross entropy equal to the former head and loss, which is kept
below as the reference, in fp32 and under bf16 autocast."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_pmlm.config import MaskingConfig, model_config_from_preset
from megatron_pmlm.data.batches import build_batch
from megatron_pmlm.data.masking import mask_example
from megatron_pmlm.models.layout import (CONTEXT, IGNORE_INDEX, MASKED, PSEUDO, PMLMBatch, pmlm_predicted_index,
                                         predicted_slots)
from megatron_pmlm.models.model import PMLMForPreTraining
from megatron_pmlm.models.objectives import get_objective
from megatron_pmlm.models.palm import PalmBatch, PalmForPreTraining, palm_config_from_preset
from megatron_pmlm.models.pipeline import (EmbeddingPipe, HeadTransformPipe, LayerPipe, LossPipe, WordEmbeddingPipe,
                                           canonical_parameter_name, tied_logits_forward)
from megatron_pmlm.models.seq2seq import MODES, PMLMForSeq2Seq, Seq2SeqConfig, SpecialIds, build_seq2seq_batch
from megatron_pmlm.models.unilm import TYPE_VOCAB_SIZE
from megatron_pmlm.parallel.layers import chunked_biased_cross_entropy
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
