"""The flex attention backend equals the sdpa one (outputs and every gradient, the relative-bias table
included) for every objective, with padding, under activation checkpointing, at TP=2 and on the
base preset; accelerated.py's choices on this (CPU) machine."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from megatron_pmlm.models.accelerated import layer_norm
from megatron_pmlm.config import ConfigError, MaskingConfig, model_config_from_preset
from megatron_pmlm.models.flex_attention import FlexAttentionMask
from megatron_pmlm.models.layout import PAD
from megatron_pmlm.data.batches import build_batch
from megatron_pmlm.data.masking import mask_example
from megatron_pmlm.models.model import KeyValueCache, PMLMForPreTraining
from megatron_pmlm.models.objectives import PMLM_OBJECTIVES, get_objective
from pmlm_testing import run_tool, torchrun

VOCAB = 200


def _batch(objective, lengths=(40, 25, 33), seed=0):
    """Sequences of different lengths (sequence padding) with different masked counts (slot padding)."""
    rng = np.random.default_rng(seed)
    ids_list, segment_list, masks = [], [], []
    for length in lengths:
        ids = rng.integers(5, VOCAB, length)
        ids[0], ids[length // 2], ids[-1] = 1, 2, 2
        ids_list.append(ids)
        segment_list.append((np.arange(length) > length // 2).astype(np.int64))
        masks.append(mask_example(ids, ids >= 5, rng, MaskingConfig(), VOCAB, np.arange(5), 3,
                                  single_token_steps=objective.single_token_steps))
    return build_batch(ids_list, segment_list, masks, 4, 0, append_pseudo=objective.pseudo_masked)


def _forward_backward(backend, objective, batch, preset="tiny", checkpoint_activations=False, **overrides):
    config = model_config_from_preset(preset, vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                                      attention_backend=backend, **overrides)
    model = PMLMForPreTraining(config, objective, init_seed=5).train()
    model.bert.encoder.checkpoint_activations = checkpoint_activations
    hidden = model.bert(*batch.as_tuple()[:5])
    losses = model.forward_batch(batch)
    losses.loss.backward()
    return hidden.detach(), losses, {name: param.grad for name, param in model.named_parameters()}


def _assert_backends_agree(objective, batch, **kwargs):
    sdpa_hidden, sdpa, sdpa_grads = _forward_backward("sdpa", objective, batch, **kwargs)
    flex_hidden, flex, flex_grads = _forward_backward("flex", objective, batch, **kwargs)
    real = batch.roles != PAD
    torch.testing.assert_close(flex_hidden[real], sdpa_hidden[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(flex.loss, sdpa.loss, rtol=1e-5, atol=1e-5)
    assert sdpa_grads.keys() == flex_grads.keys()
    for name, grad in sdpa_grads.items():
        assert grad is not None and flex_grads[name] is not None, name
        torch.testing.assert_close(flex_grads[name], grad, rtol=1e-5, atol=1e-5, msg=name)
    return sdpa_grads


@pytest.mark.parametrize("objective", PMLM_OBJECTIVES)
def test_flex_equals_sdpa_outputs_and_every_gradient(objective):
    objective = get_objective(objective)
    batch = _batch(objective)
    assert (batch.roles == PAD).any()
    grads = _assert_backends_agree(objective, batch)
    assert grads["bert.rel_pos_bias.weight"].abs().sum() > 0  # the table learns through score_mod


def test_flex_equals_sdpa_without_relative_bias_and_with_activation_checkpointing():
    objective = get_objective("ae+par")
    batch = _batch(objective, seed=1)
    _assert_backends_agree(objective, batch, rel_pos=False)
    _assert_backends_agree(objective, batch, rel_pos=False, checkpoint_activations=True)
    # With the bias: the table goes through a reentrant checkpoint as an input (model.checkpointed_layer);
    # torch 2.13's non-reentrant recomputation gets its gradient wrong.
    grads = _assert_backends_agree(objective, batch, checkpoint_activations=True)
    assert grads["bert.rel_pos_bias.weight"].abs().sum() > 0


def test_per_tile_bias_tables_give_the_same_outputs_and_table_gradient(monkeypatch):
    """The score_mod reads a copy of the distance table per (sample, head, query tile, key tile), so
    the kernel's atomic adds of the table's gradient land in disjoint rows; the copies' gradients
    sum back to the table's. Tiles of 8 positions (dozens of tiles here) equal sdpa as one tile does."""
    from megatron_pmlm.models import flex_attention

    objective = get_objective("ae+par")
    batch = _batch(objective, seed=3)
    assert batch.input_ids.shape[1] > 4 * 8
    monkeypatch.setattr(flex_attention, "BIAS_GRADIENT_TILE", 8)
    grads = _assert_backends_agree(objective, batch)
    assert grads["bert.rel_pos_bias.weight"].abs().sum() > 0
    table = torch.randn(2, 9)
    tiles = flex_attention.tiled_distance_bias(table, 3, 20, 17, tile=8)
    assert tiles.shape == (3, 2, 3, 3, 9) and torch.equal(tiles[2, 1, 2, 0], table[1])


def test_flex_equals_sdpa_on_the_base_preset():
    objective = get_objective("ae+par")
    batch = _batch(objective, lengths=(48, 31), seed=2)
    _assert_backends_agree(objective, batch, preset="base", num_layers=2)


def test_a_flex_model_decodes_incrementally_like_its_full_forward():
    """Decoding runs the sdpa kernel over the same rule and table: the cached step equals the flex
    forward over the whole layout at the new slots."""
    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                                      attention_backend="flex")
    model = PMLMForPreTraining(config, init_seed=5).eval()
    batch = _batch(get_objective("ae+par"), lengths=(30, 30))
    inputs = batch.as_tuple()[:5]
    split = 30  # the whole corrupted sequence: it never sees the appended slots, so caching it is exact
    with torch.no_grad():
        full = model.bert(*inputs)
        assert isinstance(model.bert.embed(*inputs)[1], FlexAttentionMask)
        cache = KeyValueCache(config.num_layers)
        model.bert.forward_incremental(*(t[:, :split] for t in inputs), cache)
        cache.commit(split)
        new = model.bert.forward_incremental(*(t[:, split:] for t in inputs), cache)
    # The cached slots are the corrupted sequences (context/[M]: they attend only to each other), so
    # every new slot sees in the cache exactly what it sees in the full forward.
    real = batch.roles[:, split:] != PAD
    torch.testing.assert_close(new[real], full[:, split:][real], rtol=1e-5, atol=1e-5)


def test_flex_refuses_attention_dropout_and_unknown_backends():
    config = model_config_from_preset("tiny", vocab_size=VOCAB, attention_backend="flex")
    with pytest.raises(ConfigError, match="flex has no attention dropout: set --attention-dropout 0"):
        PMLMForPreTraining(config)
    with pytest.raises(ConfigError, match="attention_backend must be one of sdpa, flex, triton, got 'xla'"):
        PMLMForPreTraining(model_config_from_preset("tiny", vocab_size=VOCAB, attention_backend="xla"))


def test_tensor_parallel_2_with_flex_equals_tensor_parallel_1():
    script = Path(__file__).parent / "distributed" / "tp_flex_equivalence.py"
    result = subprocess.run(
        [*torchrun(2), str(script)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "TP=2 flex matches TP=1 sdpa" in result.stdout


def test_fused_kernels_are_chosen_on_cuda_only():
    # The fused AdamW choice: test_pretrain.py's test_fused_adamw_on_cuda_only_and_the_same_update.
    if not torch.cuda.is_available():
        norm = layer_norm(16, 1e-12)
        assert type(norm) is nn.LayerNorm and norm.eps == 1e-12
        assert {name for name, _ in norm.named_parameters()} == {"weight", "bias"}


def test_check_leakage_passes_with_the_flex_backend():
    from megatron_pmlm.check_leakage import run_check, run_seq2seq_check

    for objective in ("ae+par", "unilm"):
        report = run_check("tiny", objective, examples=1, seed=3, attention_backend="flex")
        assert report.passed, report.summary()
    assert run_seq2seq_check("tiny", "pseudo-masked", examples=1, attention_backend="flex").passed
    assert not run_check("tiny", "ae+par", examples=1, fault="implicit", attention_backend="flex").passed


def test_bench_train_takes_the_flex_backend():
    result = run_tool("bench_train.py", "--preset", "tiny", "--seq-length", "64", "--micro-batch-size", "2",
                      "--iterations", "1", "--warmup", "0", "--attention-backend", "flex")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "attention flex" in result.stdout and "ms/step" in result.stdout


def test_the_layers_of_a_pipeline_stage_build_one_block_mask_per_micro_batch():
    """Pipeline stages receive roles and steps, not the block mask: the first layer builds it, the
    stage's other layers (and a detached view of the same tensors, as activation checkpointing
    passes) reuse it; new or modified roles/steps build a new one, equal to a fresh build."""
    from megatron_pmlm.models.flex_attention import build_block_mask
    from megatron_pmlm.models.layout import pmlm_attention_allowed
    from megatron_pmlm.models.pipeline import LayerPipe, StageCache
    from megatron_pmlm.parallel.layers import LocalLayers

    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                                      attention_backend="flex")
    cache = StageCache()
    stage = [LayerPipe(config, LocalLayers(), stage_cache=cache) for _ in range(3)]
    batch = _batch(get_objective("ae+par"))
    hidden = torch.randn(*batch.input_ids.shape, config.hidden_size)
    table = torch.zeros(config.num_attention_heads, 2 * config.max_rel_pos + 1)

    def run(roles, steps):
        activations = (hidden, table, batch.position_ids, steps, batch.token_type_ids, roles, batch.labels,
                       batch.predicted_index)
        for layer in stage:
            activations = layer(activations)
        return activations[0]

    out = run(batch.roles, batch.steps)
    assert cache.builds == 1
    run(batch.roles.detach(), batch.steps.detach())
    assert cache.builds == 1
    roles = batch.roles.clone()  # the next micro batch's tensors (same content here, other storage)
    run(roles, batch.steps)
    assert cache.builds == 2
    builds = cache.builds
    roles[0, 0] = PAD  # modified in place: its version counter moves on
    run(roles, batch.steps)
    assert cache.builds == builds + 1
    fresh = build_block_mask(pmlm_attention_allowed, roles, batch.steps)
    cached = cache.get(lambda: None, ("block mask", pmlm_attention_allowed), roles, batch.steps)
    assert cache.builds == builds + 1 and torch.equal(cached.to_dense(), fresh.to_dense())
    cache.clear()  # the batch's end: nothing of it is kept, the next call builds
    run(roles, batch.steps)
    assert cache.builds == builds + 2
    assert torch.isfinite(out).all()
