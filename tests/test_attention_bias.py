"""The sdpa backend's attention bias built once per micro batch (issue 33 item 2): outputs and every
gradient equal those of the former construction (kept below, written plainly) for every objective,
the s2s fine-tuning modes, UniLM v1 and PALM, in fp32 and under autocast bf16; no layer pads, copies
or casts it; the one-hot table gradient equals F.embedding's backward."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megatron_pmlm.config import MaskingConfig, model_config_from_preset
from megatron_pmlm.data.batches import build_batch
from megatron_pmlm.data.masking import mask_example
from megatron_pmlm.data.unilm_batches import build_unilm_batch, sample_keys
from megatron_pmlm.tokenizer import SpecialTokenIds
from megatron_pmlm.models import bucket_sums
from megatron_pmlm.models.layout import CONTEXT, PAD
from megatron_pmlm.models.model import BertModel, PMLMForPreTraining, relative_position_bucket
from megatron_pmlm.models.objectives import get_objective
from megatron_pmlm.models.palm import PalmForPreTraining, palm_config_from_preset
from megatron_pmlm.models.relative_bias import (RelativeBiasGather, bias_bytes_per_step, is_sdpa_aligned,
                                                relative_buckets, table_gradient)
from megatron_pmlm.models.seq2seq import (MODES, PMLMForSeq2Seq, Seq2SeqConfig, SpecialIds, build_seq2seq_batch,
                                          example_rng)
from megatron_pmlm.models.unilm import TYPE_VOCAB_SIZE

VOCAB = 300
FP32_RELATIVE = 1e-6
BF16_RELATIVE = 2 ** -7  # two bf16 roundings (8-bit mantissa) of the accumulated bias gradient


# ------------------------------------------------------------------------------ the former bias

def former_attention_bias(rel_pos_bias, attention_rule, position_ids, roles, steps, dtype):
    """The bias as model.py built it before issue 33: F.embedding of the buckets in the table's dtype,
    cast to the hidden states' dtype, plus the -inf mask, made contiguous."""
    allowed = attention_rule(roles, steps)[:, None]
    blocked = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, float("-inf"))
    if rel_pos_bias is None:
        return blocked
    relative = position_ids[:, None, :] - position_ids[:, :, None]
    buckets = relative_position_bucket(relative, rel_pos_bias.num_buckets, rel_pos_bias.max_distance)
    bias = F.embedding(buckets, rel_pos_bias.weight.t()).permute(0, 3, 1, 2)
    return (bias.to(dtype) + blocked).contiguous()


def former_embed(self, input_ids, position_ids, token_type_ids, roles, steps):
    hidden = self.embeddings(input_ids, position_ids, token_type_ids)
    return hidden, former_attention_bias(self.rel_pos_bias, self.attention_rule, position_ids, roles, steps,
                                         hidden.dtype)


@contextlib.contextmanager
def former_bias():
    """BertModel.embed as it was, for the reference run (every other line of the model is today's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BertModel, "embed", former_embed)
        yield


# ------------------------------------------------------------------------------ the models

def pmlm_case(objective_name: str, layers: int = 2):
    objective = get_objective(objective_name)
    rng = np.random.default_rng(0)
    ids_list, segments, masks = [], [], []
    for length in (40, 25, 33):  # widths not multiples of 8: the alignment matters
        ids = rng.integers(5, VOCAB, length)
        ids[0], ids[length // 2], ids[-1] = 1, 2, 2
        ids_list.append(ids)
        segments.append((np.arange(length) > length // 2).astype(np.int64))
        masks.append(mask_example(ids, ids >= 5, rng, MaskingConfig(), VOCAB, np.arange(5), 3,
                                  single_token_steps=objective.single_token_steps))
    batch = build_batch(ids_list, segments, masks, 4, 0, append_pseudo=objective.pseudo_masked)
    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                                      num_layers=layers)
    return PMLMForPreTraining(config, objective, init_seed=3), lambda model: model.forward_batch(batch).loss


def seq2seq_case(mode: str):
    rng = np.random.default_rng(1)
    special = SpecialIds(cls=1, sep=2, mask=3, pad=0)
    sources = [np.concatenate([[1], rng.integers(5, VOCAB, n), [2]]) for n in (11, 6, 9)]
    targets = [np.concatenate([rng.integers(5, VOCAB, n), [2]]) for n in (5, 7, 3)]
    seq2seq = Seq2SeqConfig(mode=mode, max_source_length=16, max_target_length=10)
    batch = build_seq2seq_batch(sources, targets, [example_rng(0, i) for i in range(3)], seq2seq, special, VOCAB)
    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0)
    return PMLMForSeq2Seq(config, seq2seq, init_seed=4), lambda model: model.forward_batch(batch).loss


def unilm_case():
    special = SpecialTokenIds(pad=0, unk=1, cls=2, sep=3, mask=4, pseudo=5)
    rng = np.random.default_rng(2)
    lengths = np.array([30, 19, 26, 23])
    ids = np.zeros((4, lengths.max()), dtype=np.int64)
    second = np.zeros_like(ids, dtype=bool)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(6, VOCAB, length)
        split = length // 2
        ids[row, 0], ids[row, split], ids[row, length - 1] = special.cls, special.sep, special.sep
        second[row, split + 1:length] = True
    batch = build_unilm_batch(ids, lengths, second, np.arange(4) % 4, np.array([0, -1, -1, -1]),
                              sample_keys(3, 0, np.arange(4)), special, VOCAB)
    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                                      type_vocab_size=TYPE_VOCAB_SIZE)
    return PMLMForPreTraining(config, "unilm", init_seed=5), lambda model: model.forward_batch(batch).loss


def palm_case(rel_pos: bool):
    """PALM's encoder is our BertModel (no relative bias in its presets; with one, as the option allows)."""
    config = palm_config_from_preset("palm-tiny", vocab_size=VOCAB, padded_vocab_size=304, hidden_dropout=0.0,
                                     attention_dropout=0.0, rel_pos=rel_pos)
    generator = torch.Generator().manual_seed(6)
    ids = torch.randint(5, VOCAB, (3, 21), generator=generator)
    roles = torch.full_like(ids, CONTEXT)
    roles[-1, 15:], ids[-1, 15:] = PAD, 0
    decoder_ids = torch.randint(5, VOCAB, (3, 9), generator=generator)
    weights = torch.randn(3, 9, VOCAB, generator=generator)
    return (PalmForPreTraining(config, init_seed=7),
            lambda model: (model.distribution(ids, roles, ids, decoder_ids) * weights).sum())


CASES = {**{f"pmlm-{name}": (lambda name=name: pmlm_case(name)) for name in ("ae+par", "ae", "par", "ar")},
         **{f"s2s-{mode}": (lambda mode=mode: seq2seq_case(mode)) for mode in MODES},
         "unilm": unilm_case, "palm": lambda: palm_case(False), "palm-rel-pos": lambda: palm_case(True)}


def output_and_gradients(model, loss_of, autocast_dtype):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        loss = loss_of(model)
    loss.backward()
    return loss.detach().float(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def relative_difference(ours: torch.Tensor, reference: torch.Tensor) -> float:
    """Largest difference over the largest magnitude of the reference."""
    return float((ours.float() - reference.float()).abs().max() / reference.float().abs().max().clamp(min=1e-30))


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16], ids=["fp32", "autocast-bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_every_gradient_equal_the_former_bias(case, autocast_dtype):
    model, loss_of = CASES[case]()
    assert (model.bert.rel_pos_bias is None) == (case == "palm")
    with former_bias():
        former_loss, former_grads = output_and_gradients(model, loss_of, autocast_dtype)
    loss, grads = output_and_gradients(model, loss_of, autocast_dtype)
    assert set(grads) == set(former_grads)
    tolerance = FP32_RELATIVE if autocast_dtype is None else BF16_RELATIVE
    assert relative_difference(loss, former_loss) <= tolerance, (loss, former_loss)
    worst = {name: relative_difference(grads[name], former_grads[name]) for name in grads}
    assert max(worst.values()) <= tolerance, sorted(worst.items(), key=lambda item: -item[1])[:3]
    if model.bert.rel_pos_bias is not None:
        assert former_grads["bert.rel_pos_bias.weight"].abs().max() > 0


def test_without_the_relative_bias_outputs_and_gradients_are_unchanged():
    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                                      rel_pos=False)
    _, loss_of = pmlm_case("ae+par")
    model = PMLMForPreTraining(config, "ae+par", init_seed=3)
    for autocast_dtype in (None, torch.bfloat16):
        with former_bias():
            former_loss, former_grads = output_and_gradients(model, loss_of, autocast_dtype)
        loss, grads = output_and_gradients(model, loss_of, autocast_dtype)
        assert torch.equal(loss, former_loss)
        assert all(torch.equal(grads[name], former_grads[name]) for name in grads)


def test_with_bf16_weights_as_deepspeed_casts_them_only_the_table_gradients_summation_changes():
    """DeepSpeed's bf16 casts the weights (no autocast): the bias was bf16 already, so outputs and
    every other gradient are unchanged; the table's gradient is now summed in fp32 (F.embedding's
    CPU backward summed ~10^4 bf16 terms per bucket in bf16, see the pieces' test below)."""
    model, loss_of = pmlm_case("ae+par")
    model = model.to(torch.bfloat16)
    with former_bias():
        former_loss, former_grads = output_and_gradients(model, loss_of, None)
    loss, grads = output_and_gradients(model, loss_of, None)
    assert torch.equal(loss, former_loss)
    table = "bert.rel_pos_bias.weight"
    assert all(torch.equal(grads[name], former_grads[name]) for name in grads if name != table)
    assert grads[table].dtype == torch.bfloat16 and relative_difference(grads[table], former_grads[table]) <= 0.05


# ------------------------------------------------------------------------------ per-layer work

PER_LAYER_COPIES = ("_to_copy", "clone", "copy_", "constant_pad_nd", "contiguous")


def copies_of_bias_shaped_tensors(layers: int, autocast_dtype) -> tuple[int, dict]:
    model, _ = pmlm_case("ae+par", layers=layers)
    batch = pmlm_case_batch()
    result = bias_bytes_per_step(model, batch, autocast_dtype)
    copies = sum(count for op, count in result["ops"].items() if op.split(".")[0] in PER_LAYER_COPIES)
    return copies, result


def pmlm_case_batch():
    rng = np.random.default_rng(0)
    ids = [rng.integers(5, VOCAB, n) for n in (37, 22)]
    masks = [mask_example(i, i >= 5, rng, MaskingConfig(), VOCAB, np.arange(5), 3) for i in ids]
    return build_batch(ids, [np.zeros_like(i) for i in ids], masks, 4, 0)


@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16], ids=["fp32", "autocast-bf16"])
def test_no_layer_pads_copies_or_casts_the_bias(autocast_dtype):
    """Counted over one forward + backward of the whole model (relative_bias.bias_bytes_per_step):
    the copies, casts and pads of [B, heads or 1, T, >= T] tensors do not grow with the layers, and
    every mask SDPA receives is in the queries' dtype and aligned (SDPA would pad it otherwise)."""
    one, result_one = copies_of_bias_shaped_tensors(1, autocast_dtype)
    three, result_three = copies_of_bias_shaped_tensors(3, autocast_dtype)
    assert one == three, (result_one["ops"], result_three["ops"])
    assert result_three["sdpa_calls"] == 3 and result_three["sdpa_pad_bytes"] == 0
    assert result_three["mask_dtypes"] == [str(autocast_dtype or torch.float32)]


def test_the_bias_is_an_aligned_view_in_the_compute_dtype():
    model, _ = pmlm_case("ae+par")
    batch = pmlm_case_batch()
    width = batch.input_ids.shape[1]
    assert width % 8  # the case the alignment is for
    for autocast_dtype, expected in ((None, torch.float32), (torch.bfloat16, torch.bfloat16)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast_dtype is not None):
            _, bias = model.bert.embed(*batch.as_tuple()[:5])
        assert bias.shape == (2, 4, width, width) and bias.dtype == expected and is_sdpa_aligned(bias)
    _, bias = model.to(torch.bfloat16).bert.embed(*batch.as_tuple()[:5])  # DeepSpeed bf16: bf16 weights
    assert bias.dtype == torch.bfloat16 and is_sdpa_aligned(bias)
    assert not is_sdpa_aligned(torch.zeros(2, 4, width, width))


# ------------------------------------------------------------------------------ the pieces

def test_buckets_equal_the_bucket_function_for_any_positions():
    positions = torch.tensor([[0, 1, 2, 3, 300, 301, 5, 0], [7, 6, 5, 140, 0, 0, 0, 0]])
    keys = torch.tensor([[0, 1, 2, 3, 4, 500, 2, 1, 0], [0, 0, 0, 0, 0, 260, 9, 8, 7]])
    ours = relative_buckets(positions, keys, 32, 128)
    assert ours.dtype == torch.uint8
    assert torch.equal(ours.long(), relative_position_bucket(keys[:, None, :] - positions[:, :, None], 32, 128))


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_table_gradient_equals_the_embedding_backward_across_chunks(grad_dtype, monkeypatch):
    generator = torch.Generator().manual_seed(0)
    buckets = torch.randint(0, 32, (3, 13, 21), dtype=torch.uint8, generator=generator)
    buffer = torch.randn(3, 5, 13, 24, generator=generator).to(grad_dtype)
    grad = buffer[..., :21]  # an aligned view, as SDPA may hand the gradient back
    table = torch.zeros(5, 32, requires_grad=True)
    expected, = torch.autograd.grad(F.embedding(buckets.long(), table.t()).permute(0, 3, 1, 2), table, grad.float())
    sequence_bytes = 13 * 21 * 32 * 4
    # One chunk; 2 whole sequences a chunk (batched GEMMs over 2 + 1, contiguous gradients only); 5 rows a chunk.
    for chunk_bytes in (bucket_sums.ONE_HOT_CHUNK_BYTES, 2 * sequence_bytes, 5 * 21 * 32 * 4):
        monkeypatch.setattr(bucket_sums, "ONE_HOT_CHUNK_BYTES", chunk_bytes)
        for layout, gradient in (("aligned view", grad), ("contiguous", grad.contiguous())):
            ours = table_gradient(gradient, buckets, 32, torch.float32)
            assert relative_difference(ours, expected) <= FP32_RELATIVE, (chunk_bytes, layout)
    exact = table_gradient(grad.double(), buckets, 32, torch.float64)
    assert relative_difference(table_gradient(grad, buckets, 32, grad_dtype), exact) <= 2 ** -8  # one rounding


def test_gather_forward_masks_and_gradients():
    generator = torch.Generator().manual_seed(1)
    table = torch.randn(3, 8, generator=generator, requires_grad=True)
    buckets = torch.randint(0, 8, (2, 5, 7), dtype=torch.uint8, generator=generator)
    allowed = torch.rand(2, 5, 7, generator=generator) > 0.3
    bias = RelativeBiasGather.apply(table, buckets, allowed, torch.float32)
    expected = table[:, buckets.long()].permute(1, 0, 2, 3).masked_fill(~allowed[:, None], float("-inf"))
    assert torch.equal(bias, expected) and is_sdpa_aligned(bias)
    upstream = torch.randn(2, 3, 5, 7, generator=generator)
    ours, = torch.autograd.grad(bias, table, upstream)
    plain, = torch.autograd.grad(table[:, buckets.long()].permute(1, 0, 2, 3), table, upstream)
    torch.testing.assert_close(ours, plain, rtol=1e-6, atol=1e-6)


def test_the_bench_tool_reports_bias_bytes_and_table_gradient_timings(tmp_path):
    import json

    from tools import bench_attention_bias

    output = tmp_path / "bias.json"
    assert bench_attention_bias.main(["--preset", "tiny", "--shapes", "16x2", "--precisions", "fp32,autocast-bf16",
                                      "--repeats", "1", "--json", str(output)]) == 0
    results = json.loads(output.read_text())
    fp32, bf16 = results["bias_bytes"]
    assert fp32["sdpa_pad_bytes"] == bf16["sdpa_pad_bytes"] == 0 and fp32["ops"]["gather.out"] == 1
    # The same ops in bf16, but for the one copy of the gradient the table's sum reads as [heads, pairs]:
    # a clone in fp32, a cast to fp32 in bf16 (the whole micro batch in one chunk here).
    copies = ("clone.default", "_to_copy.default")
    assert fp32["ops"]["clone.default"] == bf16["ops"]["_to_copy.default"] == 1
    assert ({op: n for op, n in bf16["ops"].items() if op not in copies}
            == {op: n for op, n in fp32["ops"].items() if op not in copies})
    assert bf16["bias_bytes"] < fp32["bias_bytes"]
    timing, = results["table_gradient"]
    assert timing["table_gradient_error"] < 1e-5 and timing["table_gradient_s"] > 0
    # Bytes a pair: the GEMMs' one-hot and fp32 copy against the kernel's one read of the bf16 gradient.
    assert timing["gemm_bytes_read_per_pair"] > 5 * timing["kernel_bytes_read_per_pair"] > 0
    assert timing["gemm_bytes_written_per_pair"] > 5 * timing["kernel_bytes_written_per_pair"] > 0
    assert bench_attention_bias.main(["--shapes", "16"]) == 2
