"""The model: relative position buckets, parameter count, AE = BERT, and '- rel pos' = HF BERT."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_pmlm.config import ConfigError, MaskingConfig, ModelConfig, model_config_from_preset
from megatron_pmlm.data.batches import build_batch
from megatron_pmlm.data.masking import mask_example
from megatron_pmlm.models.model import PMLMForPreTraining, count_parameters, relative_position_bucket
from megatron_pmlm.models.objectives import get_objective

# SPEC §5: |d| 0-7 exact; 8-11->8, 12-15->9, 16-22->10, 23-31->11, 32-45->12, 46-63->13, 64-90->14, >=91->15
SPEC_TABLE = [(0, 7, None), (8, 11, 8), (12, 15, 9), (16, 22, 10), (23, 31, 11), (32, 45, 12),
              (46, 63, 13), (64, 90, 14), (91, 600, 15)]


def test_relative_position_buckets_match_the_spec_table():
    for low, high, bucket in SPEC_TABLE:
        distances = torch.arange(low, high + 1)
        expected = distances if bucket is None else torch.full_like(distances, bucket)
        # key before the query (negative key - query): buckets 0-15
        assert torch.equal(relative_position_bucket(-distances), expected), (low, high)
        # key after the query: offset by 16
        after = relative_position_bucket(distances)
        assert torch.equal(after[distances > 0], expected[distances > 0] + 16), (low, high)
    assert relative_position_bucket(torch.tensor([0])).item() == 0


def _expected_parameters(c: ModelConfig) -> int:
    h, f, v = c.hidden_size, c.ffn_hidden_size, c.vocab_size
    embeddings = (v + c.max_position_embeddings + c.type_vocab_size) * h + 2 * h
    layer = 4 * (h * h + h) + 2 * (2 * h) + (h * f + f) + (f * h + h)
    head = h * h + h + 2 * h + v  # transform dense + LayerNorm + output bias (decoder tied)
    rel_pos = c.num_attention_heads * c.rel_pos_bins if c.rel_pos else 0
    return embeddings + c.num_layers * layer + head + rel_pos


def test_base_preset_has_about_110m_parameters():
    config = model_config_from_preset("base")
    assert (config.num_layers, config.hidden_size, config.num_attention_heads,
            config.ffn_hidden_size, config.vocab_size, config.max_position_embeddings) == (12, 768, 12, 3072, 30522, 512)
    model = PMLMForPreTraining(config)
    count = count_parameters(model)
    assert count == _expected_parameters(config) == 109_514_682
    assert 108e6 < count < 112e6
    assert model.bert.rel_pos_bias.weight.shape == (12, 32)
    assert model.cls.predictions.bias.shape == (30522,)
    # The output softmax is the word embedding itself.
    assert not any("decoder" in name for name, _ in model.named_parameters())


def test_large_preset_shape():
    config = model_config_from_preset("large")
    assert (config.num_layers, config.hidden_size, config.num_attention_heads, config.ffn_hidden_size) == (24, 1024, 16, 4096)


def _random_batch(objective, vocab=200, seed=0, lengths=(40, 25, 33)):
    rng = np.random.default_rng(seed)
    ids_list, segment_list, masks = [], [], []
    for length in lengths:
        ids = rng.integers(5, vocab, length)
        ids[0], ids[length // 2], ids[-1] = 1, 2, 2
        segments = (np.arange(length) > length // 2).astype(np.int64)
        ids_list.append(ids)
        segment_list.append(segments)
        masks.append(mask_example(ids, ids >= 5, rng, MaskingConfig(), vocab, np.arange(5), 3,
                                  single_token_steps=objective.single_token_steps))
    return ids_list, segment_list, masks


@pytest.mark.parametrize("rel_pos", [True, False])
def test_ae_outputs_equal_a_plain_forward_over_the_corrupted_sequence(rel_pos):
    torch.manual_seed(0)
    config = model_config_from_preset("tiny", vocab_size=200, rel_pos=rel_pos)
    model = PMLMForPreTraining(config).eval()
    ids, segments, masks = _random_batch(get_objective("ae+par"))
    full = build_batch(ids, segments, masks, 4, 0)
    plain = build_batch(ids, segments, masks, 4, 0, append_pseudo=False)
    with torch.no_grad():
        full_hidden = model.bert(*full.as_tuple()[:5])
        plain_hidden = model.bert(*plain.as_tuple()[:5])
    n = plain.input_ids.shape[1]
    real = plain.roles != 4  # compare real tokens, not padding
    torch.testing.assert_close(full_hidden[:, :n][real], plain_hidden[real], rtol=0, atol=1e-5)


def test_objectives_switch_losses():
    torch.manual_seed(0)
    config = model_config_from_preset("tiny", vocab_size=200)
    for name in ("ae", "ar", "par", "ae+ar", "ae+par"):
        objective = get_objective(name)
        model = PMLMForPreTraining(config, objective)
        ids, segments, masks = _random_batch(objective)
        batch = build_batch(ids, segments, masks, 4, 0, append_pseudo=objective.pseudo_masked)
        out = model.forward_batch(batch)
        assert (out.loss_ae > 0) == objective.autoencoding, name
        assert (out.loss_par > 0) == objective.pseudo_masked, name
        torch.testing.assert_close(out.loss, out.loss_ae + out.loss_par)
        out.loss.backward()
        assert model.bert.embeddings.word_embeddings.weight.grad.abs().sum() > 0
        # Untrained, every loss is close to log(vocab).
        for loss, on in ((out.loss_ae, objective.autoencoding), (out.loss_par, objective.pseudo_masked)):
            if on:
                assert abs(loss.item() - np.log(200)) < 1.0


def test_without_rel_pos_the_model_is_exactly_hugging_face_bert():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = model_config_from_preset("tiny", vocab_size=200, rel_pos=False)
    model = PMLMForPreTraining(config, "ae").eval()
    hf_config = transformers.BertConfig(
        vocab_size=200, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, intermediate_size=config.ffn_hidden_size,
        max_position_embeddings=config.max_position_embeddings, layer_norm_eps=config.layernorm_epsilon,
        hidden_act="gelu")
    hf = transformers.BertForMaskedLM(hf_config).eval()
    ours = model.state_dict()
    hf_state = hf.state_dict()
    missing = {k for k in hf_state if k not in ours and not k.endswith(("decoder.weight", "decoder.bias", "position_ids"))}
    assert not missing, f"HF keys with no counterpart: {sorted(missing)[:5]}"
    hf.load_state_dict({**hf_state, **{k: v for k, v in ours.items() if k in hf_state}}, strict=True)
    hf.tie_weights()
    ids, segments, masks = _random_batch(get_objective("ae"), lengths=(30, 30))
    batch = build_batch(ids, segments, masks, 4, 0, append_pseudo=False)
    with torch.no_grad():
        our_logits = model.mlm_logits(model.bert(*batch.as_tuple()[:5]))
        hf_logits = hf(input_ids=batch.input_ids, token_type_ids=batch.token_type_ids).logits
    torch.testing.assert_close(our_logits, hf_logits, rtol=1e-4, atol=1e-4)


def test_bad_model_arguments_give_clear_errors():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        model_config_from_preset("huge")
    with pytest.raises(ConfigError, match="unknown objective 'mlm'"):
        get_objective("mlm")
    with pytest.raises(ConfigError, match="not divisible by num_attention_heads"):
        model_config_from_preset("tiny", hidden_size=65)
    with pytest.raises(ConfigError, match="hidden_dropout"):
        ModelConfig(hidden_dropout=1.5)
