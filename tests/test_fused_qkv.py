"""Q, K and V as one GEMM (issue 33 item 6): the fused projection gives the three-GEMM outputs and
gradients for every model family, in fp32 and under bf16 autocast, with one GEMM where there were
three (two for PALM's cross-attention keys/values), the same parameters and state dict keys, and
the same losses and gradients at tensor parallel size 2 (megatron-core layers, torchrun)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_pmlm.config import MaskingConfig, model_config_from_preset
from megatron_pmlm.data.batches import build_batch
from megatron_pmlm.data.masking import mask_example
from megatron_pmlm.models.model import BertSelfAttention, PMLMForPreTraining
from megatron_pmlm.training.kernel_count import GemmCounter
from pmlm_testing import torchrun, unilm_mixture_batch

VOCAB = 256


def set_fused(model: torch.nn.Module, fused: bool) -> None:
    for module in model.modules():
        if isinstance(module, BertSelfAttention):
            module.fuse_projections = fused


def pmlm_batch(seed: int = 1):
    rng = np.random.default_rng(seed)
    ids, segments, masks = [], [], []
    for length in (40, 29, 35):
        x = rng.integers(5, VOCAB, length)
        x[0], x[-1] = 1, 2
        ids.append(x)
        segments.append(np.zeros(length, dtype=np.int64))
        masks.append(mask_example(x, x >= 5, rng, MaskingConfig(), VOCAB, np.arange(5), 3))
    return build_batch(ids, segments, masks, 4, 0)


def pmlm_case(backend: str = "sdpa"):
    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                                      attention_backend=backend)
    model = PMLMForPreTraining(config, "ae+par", init_seed=3)
    batch = pmlm_batch()
    return model, lambda: model.forward_batch(batch).loss


def seq2seq_case():
    from megatron_pmlm.models.seq2seq import PMLMForSeq2Seq, Seq2SeqConfig, SpecialIds, build_examples, \
        build_seq2seq_batch

    special = SpecialIds(cls=1, sep=2, mask=3, pad=0)
    seq2seq = Seq2SeqConfig(max_source_length=12, max_target_length=8, label_smoothing=0.1)
    rng = np.random.default_rng(0)
    examples = build_examples([rng.integers(5, VOCAB, n) for n in (9, 4, 7)],
                              [rng.integers(5, VOCAB, n) for n in (3, 7, 5)], seq2seq, special)
    batch = build_seq2seq_batch(examples.source_ids, examples.target_ids,
                                [np.random.default_rng(i) for i in range(3)], seq2seq, special, VOCAB)
    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0)
    model = PMLMForSeq2Seq(config, seq2seq, init_seed=3)
    return model, lambda: model(*batch.as_tuple()).loss


def unilm_case():
    from megatron_pmlm.models.unilm import TYPE_VOCAB_SIZE

    batch = unilm_mixture_batch(VOCAB, seed=5, max_length=29)
    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                                      type_vocab_size=TYPE_VOCAB_SIZE)
    model = PMLMForPreTraining(config, "unilm", init_seed=2)
    return model, lambda: model.forward_batch(batch).loss


def palm_case():
    import importlib.util

    from megatron_pmlm.models.palm import PalmForPreTraining, palm_config_from_preset

    spec = importlib.util.spec_from_file_location(
        "palm_tp_equivalence", Path(__file__).parent / "distributed" / "palm_tp_equivalence.py")
    palm_tp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(palm_tp)
    config = palm_config_from_preset("palm-tiny", vocab_size=VOCAB - 6, padded_vocab_size=VOCAB,
                                     hidden_dropout=0.0, attention_dropout=0.0)
    model = PalmForPreTraining(config, stage=2, init_seed=3)
    inputs = palm_tp.batch()
    return model, lambda: model(*inputs.as_tuple()).loss


CASES = {"pmlm": pmlm_case, "pmlm-flex": lambda: pmlm_case("flex"), "seq2seq": seq2seq_case,
         "unilm": unilm_case, "palm": palm_case}


def assert_equal_to_rounding(ours: torch.Tensor, reference: torch.Tensor, relative: float, name: str,
                             absolute: float = 1e-10) -> None:
    """Elementwise within `relative` of the tensor's largest magnitude: the two paths sum the same
    products in another order (an input gradient is one GEMM over 3 x hidden instead of three summed
    GEMMs), so entries far below the scale (the key bias's gradient, zero up to rounding) only match
    to the rounding of the larger ones."""
    scale = reference.abs().max().item()
    error = (ours - reference).abs().max().item()
    assert error <= relative * scale + absolute, f"{name}: max error {error:.3g} at scale {scale:.3g}"


def loss_and_gradients(model, loss_of, fused: bool, autocast: bool = False):
    set_fused(model, fused)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_of()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", CASES)
def test_fused_projections_give_the_three_gemm_loss_and_every_gradient(family):
    model, loss_of = CASES[family]()
    loss_separate, grads_separate = loss_and_gradients(model, loss_of, fused=False)
    loss_fused, grads_fused = loss_and_gradients(model, loss_of, fused=True)
    torch.testing.assert_close(loss_fused, loss_separate, rtol=1e-6, atol=0)
    assert grads_fused.keys() == grads_separate.keys()
    assert any(".attention.self.query." in name for name in grads_fused)
    for name, grad in grads_separate.items():
        assert_equal_to_rounding(grads_fused[name], grad, 1e-6, name)


def test_under_bf16_autocast_too():
    model, loss_of = pmlm_case()
    loss_separate, grads_separate = loss_and_gradients(model, loss_of, fused=False, autocast=True)
    loss_fused, grads_fused = loss_and_gradients(model, loss_of, fused=True, autocast=True)
    # The same bf16 products, each column from the same row of the same cast weights.
    torch.testing.assert_close(loss_fused, loss_separate, rtol=1e-3, atol=0)
    for name, grad in grads_separate.items():
        # absolute: the key bias's gradient (zero but for rounding) is ~1e-8 noise in bf16.
        assert_equal_to_rounding(grads_fused[name], grad, 1e-2, name, absolute=1e-7)


@pytest.mark.parametrize("fused, expected", [(False, 3), (True, 1)])
def test_one_gemm_for_query_key_and_value(fused, expected):
    model, _ = pmlm_case()
    attention = model.bert.encoder.layer[0].attention.self
    if not fused:  # fused is the default
        attention.fuse_projections = False
    hidden = torch.randn(2, 9, model.config.hidden_size)
    with GemmCounter() as counter:
        attention(hidden, None)
    assert counter.count == expected
    # The whole layer: Q/K/V, the attention output, the FFN's two.
    layer = model.bert.encoder.layer[0]
    with GemmCounter() as counter:
        layer(hidden, None)
    assert counter.count == expected + 3


@pytest.mark.parametrize("fused, expected", [(False, 2), (True, 1)])
def test_palm_cross_attention_keys_and_values_are_one_gemm(fused, expected):
    model, _ = palm_case()
    cross = model.decoder.layer[0].crossattention.self
    if not fused:  # fused is the default
        cross.fuse_projections = False
    with GemmCounter() as counter:
        key, value = cross.encoder_keys_values(torch.randn(2, 7, model.config.hidden_size))
    assert counter.count == expected
    assert key.shape == value.shape == (2, model.config.num_attention_heads, 7, model.config.head_dim)


def test_parameters_and_state_dict_keys_are_those_of_three_linears():
    model, _ = pmlm_case()
    attention = model.bert.encoder.layer[0].attention.self
    hidden = model.config.hidden_size
    assert {name: tuple(t.shape) for name, t in attention.state_dict().items()} == {
        f"{projection}.{kind}": (hidden, hidden) if kind == "weight" else (hidden,)
        for projection in ("query", "key", "value") for kind in ("weight", "bias")}
    keys = list(model.state_dict())
    set_fused(model, False)
    assert list(model.state_dict()) == keys


def test_parameters_partitioned_by_zero3_go_through_their_own_modules():
    """ZeRO-3 gathers a parameter only for its own module's forward (DeepSpeed's module hooks), so
    linears whose parameters carry ZeRO-3's `ds_id` are called one by one: each module's forward
    runs, and no stacked weight is read from outside. (The ZeRO-3 layouts of test_distributed and
    test_convert_checkpoint run this path end to end.)"""
    from megatron_pmlm.parallel.layers import fused_column_linear

    model, _ = pmlm_case()
    attention = model.bert.encoder.layer[0].attention.self
    linears = (attention.query, attention.key, attention.value)
    called = []
    for linear in linears:
        linear.register_forward_hook(lambda module, args, output: called.append(module))
    hidden = torch.randn(2, 5, model.config.hidden_size)
    with GemmCounter() as counter:
        fused = fused_column_linear(hidden, linears)
    assert (called, counter.count) == ([], 1)
    for linear in linears:
        linear.weight.ds_id = linear.bias.ds_id = id(linear)  # what deepspeed.zero.Init marks its parameters with
    with GemmCounter() as counter:
        separate = fused_column_linear(hidden, linears)
    assert (called, counter.count) == (list(linears), 3)
    for ours, reference in zip(fused, separate):
        assert_equal_to_rounding(ours, reference, 1e-6, "projection")


def test_incremental_decoding_with_fused_projections_equals_three_gemms():
    """The cache keeps views of the fused output; two incremental steps give the states and cached
    keys/values of the three-GEMM path."""
    from megatron_pmlm.models.layout import CONTEXT
    from megatron_pmlm.models.model import KeyValueCache

    model, _ = pmlm_case()
    model.eval()
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(5, VOCAB, (2, 12), generator=generator)
    inputs = (ids, torch.arange(12)[None].expand(2, 12), torch.zeros_like(ids), torch.full_like(ids, CONTEXT),
              torch.zeros_like(ids))
    states, caches = {}, {}
    for fused in (False, True):
        set_fused(model, fused)
        cache = KeyValueCache(model.config.num_layers)
        with torch.no_grad():
            first = model.bert.forward_incremental(*(x[:, :8] for x in inputs), cache)
            cache.commit(6)
            second = model.bert.forward_incremental(*(x[:, 8:] for x in inputs), cache)
            cache.commit(4)
        states[fused], caches[fused] = torch.cat([first, second], 1), cache
    assert_equal_to_rounding(states[True], states[False], 1e-6, "states")
    for fused_layer, separate_layer in zip(caches[True].layers, caches[False].layers):
        assert fused_layer.key.shape == (2, model.config.num_attention_heads, 10, model.config.head_dim)
        assert_equal_to_rounding(fused_layer.key, separate_layer.key, 1e-6, "cached keys")
        assert_equal_to_rounding(fused_layer.value, separate_layer.value, 1e-6, "cached values")


def test_tensor_parallel_2_fused_equals_separate():
    """megatron-core ColumnParallelLinear shards at TP=2: one GEMM over each rank's [q; k; v] shards
    gives the per-rank outputs, loss and gradients of three calls (PMLM and PALM)."""
    script = Path(__file__).parent / "distributed" / "fused_qkv_tp.py"
    result = subprocess.run(
        [*torchrun(2), str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "TP=2 fused Q/K/V matches three GEMMs" in result.stdout
