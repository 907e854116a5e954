"""No query row of any layout is fully masked, over real batches from the real loaders and batch
builders: every PMLM objective and UniLM v1 LM type, the three s2s-ft fine-tuning modes, s2s-ft
decoding (cached and recomputed), sequence and slot padding (also widened to the CUDA layout
quantum), and PALM (encoder, causal decoder, cross-attention and copy attention over padded
contexts).

Why: on a V100 the sdpa backend runs the memory-efficient kernel with our additive float mask, and
that kernel returns NaN for a query row whose keys are all masked (pytorch/pytorch 110213, SPEC
§13). A row with nothing to attend to would poison every later layer through the residual path.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pmlm_testing import one_thread
from megatron_pmlm.data import build_pretraining_loaders
from megatron_pmlm.models.flex_attention import LAYOUT_QUANTUM
from megatron_pmlm.models.layout import PAD, PMLMBatch, pmlm_attention_allowed
from megatron_pmlm.models.model import attention_bias
from megatron_pmlm.models.objectives import OBJECTIVES, PMLM_OBJECTIVES, UNILM_OBJECTIVES

MICRO_BATCH = 16


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Small tensors: threads only wait on each other, the more so on a shared machine."""
    with one_thread():
        yield


def fully_masked_rows(allowed: torch.Tensor) -> int:
    """Query rows of a boolean [B, (heads,) queries, keys] visibility that see no key at all."""
    return int((~allowed.any(-1)).sum())


def assert_every_row_attends(batch: PMLMBatch, where: str) -> None:
    """The rule over the batch, as the model builds it (and once widened to the CUDA quantum), and
    the additive bias the sdpa kernel receives: every row has an allowed key / a finite entry."""
    for quantum in (1, LAYOUT_QUANTUM):
        padded = batch.padded_to(quantum)
        allowed = pmlm_attention_allowed(padded.roles, padded.steps)
        assert fully_masked_rows(allowed) == 0, f"{where} (width quantum {quantum}): a query row sees no key"
        bias = attention_bias(None, pmlm_attention_allowed, padded.position_ids, padded.roles, padded.steps,
                              torch.float16)
        assert torch.isfinite(bias).any(-1).all(), f"{where}: a row of the sdpa bias is all -inf"


def epoch_batches(loader, count: int):
    return [next(loader) for _ in range(count)]


@pytest.mark.parametrize("objective", [*PMLM_OBJECTIVES, *UNILM_OBJECTIVES])
def test_pretraining_batches_of_every_objective(pretraining_samples, objective):
    loaders = build_pretraining_loaders(pretraining_samples, MICRO_BATCH, objective=objective,
                                        global_batch_size=4 * MICRO_BATCH)
    count = loaders.train.sampler.samples_per_epoch // MICRO_BATCH
    batches = epoch_batches(loaders.train, count) + epoch_batches(loaders.valid(), 2)
    assert len(batches) >= 10
    for number, batch in enumerate(batches):
        assert_every_row_attends(batch, f"{objective} batch {number}")
    # The batches did exercise padding: short samples (sequence padding) and, with appended
    # tokens, rows with fewer masked tokens than the most masked one (slot padding).
    assert any(bool((b.roles == PAD).any()) for b in batches)
    if OBJECTIVES[objective].is_unilm:
        # Every LM type of the objective occurred (UniLM v1 tells it by the [SOS]'s segment id).
        from megatron_pmlm.models.unilm import LM_SEGMENT_IDS

        wanted = {dict(l2r=2, r2l=3, s2s=4, bi=0)[name] for name, _ in OBJECTIVES[objective].lm_mixture}
        seen = {int(s) for b in batches for s in b.token_type_ids[:, 0]}
        assert wanted <= seen <= set(LM_SEGMENT_IDS[:, 0].tolist())


@pytest.fixture(scope="module")
def tokenizer(bert_vocab):
    from megatron_pmlm.tokenizer import WordPieceTokenizer

    return WordPieceTokenizer(bert_vocab)


@pytest.fixture(scope="module")
def qg_examples(qg_pairs, tokenizer):
    sources = Path(qg_pairs[0]).read_text(encoding="utf-8").splitlines()
    targets = Path(qg_pairs[1]).read_text(encoding="utf-8").splitlines()
    return tokenizer.encode_batch(sources), tokenizer.encode_batch(targets)


@pytest.mark.parametrize("mode", ["pseudo-masked", "masked", "causal"])
def test_seq2seq_fine_tuning_batches_of_every_mode(qg_examples, tokenizer, mode):
    from megatron_pmlm.models.seq2seq import Seq2SeqConfig, SpecialIds, build_examples, seq2seq_batches

    special = SpecialIds(cls=tokenizer.special.cls, sep=tokenizer.special.sep, mask=tokenizer.special.mask,
                         pad=tokenizer.special.pad)
    # Budgets below the longest pairs, so truncation happens too.
    config = Seq2SeqConfig(mode=mode, max_source_length=48, max_target_length=12)
    examples = build_examples(*qg_examples, config, special)
    assert examples.truncated_sources and examples.truncated_targets
    batches = seq2seq_batches(examples, config, special, tokenizer.vocab_size, MICRO_BATCH, 0, 1, seed=3)
    seen_padding = False
    for number in range(len(examples) // MICRO_BATCH):
        batch = next(batches)
        assert_every_row_attends(batch, f"s2s {mode} batch {number}")
        seen_padding |= bool((batch.roles == PAD).any())
    assert seen_padding


class RowCheckingRule:
    """The model's attention rule, checking every visibility it hands the kernel (full forwards
    and incremental decoding steps alike)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        allowed = pmlm_attention_allowed(*args)
        assert fully_masked_rows(allowed) == 0, "a query row sees no key"
        self.calls += 1
        return allowed


@pytest.mark.parametrize("pos_shift", [False, True], ids=["standard", "pos_shift"])
def test_decoding_steps_cached_and_recomputed(qg_examples, tokenizer, pos_shift):
    from megatron_pmlm.config import model_config_from_preset
    from megatron_pmlm.generation.decoding import Seq2SeqDecoder
    from megatron_pmlm.generation.search import DecodingConfig
    from megatron_pmlm.models.model import PMLMForPreTraining

    config = model_config_from_preset("tiny", vocab_size=tokenizer.vocab_size, hidden_dropout=0.0,
                                      attention_dropout=0.0)
    model = PMLMForPreTraining(config, init_seed=3).eval()
    rule = RowCheckingRule()
    model.bert.attention_rule = rule
    sources = [ids.tolist() for ids in qg_examples[0][:6]]  # of different lengths: padded sources
    assert len({len(s) for s in sources}) > 1
    decoding = DecodingConfig(beam_size=3, max_target_length=6, max_seq_length=128, pos_shift=pos_shift)
    for full_recompute in (False, True):
        Seq2SeqDecoder(model, tokenizer.special, decoding, full_recompute=full_recompute).decode(sources)
    assert rule.calls >= 2 * decoding.max_target_length


@pytest.mark.parametrize("stage", [1, 2])
def test_palm_encoder_decoder_and_cross_attention(palm_samples, stage):
    from megatron_pmlm.models.palm import causal_bias, key_padding_bias
    from megatron_pmlm.data.palm_data import build_palm_loaders

    loaders = build_palm_loaders(palm_samples, MICRO_BATCH, stage)
    count = loaders.train.sampler.samples_per_epoch // MICRO_BATCH
    padded_contexts = 0
    for number in range(count):
        batch = next(loaders.train)
        roles = batch.encoder_roles
        # Encoder self-attention: the one rule over context / [M] / padding (palm.encode).
        allowed = pmlm_attention_allowed(roles, torch.zeros_like(roles))
        assert fully_masked_rows(allowed) == 0, f"PALM stage {stage} batch {number}: encoder"
        context_valid = roles != PAD
        padded_contexts += int((~context_valid).any(-1).sum())
        # Cross-attention and the copy attention: every decoder row over the context's keys.
        cross = key_padding_bias(context_valid, torch.float16).expand(-1, 1, max(1, batch.decoder_ids.shape[1]), -1)
        assert torch.isfinite(cross).any(-1).all(), f"PALM stage {stage} batch {number}: cross-attention"
        # Decoder self-attention: causal over the (padded) continuation.
        length = batch.decoder_ids.shape[1]
        if length:
            assert torch.isfinite(causal_bias(length, torch.float16, "cpu")).any(-1).all()
    assert padded_contexts > 0
