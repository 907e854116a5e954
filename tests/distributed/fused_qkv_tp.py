"""torchrun --nproc-per-node 2 tests/distributed/fused_qkv_tp.py: at TP=2 (megatron-core column-parallel
shards) Q/K/V as one GEMM per rank give the per-rank projections, losses and gradients of three
GEMMs, for PMLM and PALM (run by tests/test_fused_qkv.py)."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_pmlm.config import model_config_from_preset
from megatron_pmlm.models.model import BertSelfAttention, PMLMForPreTraining
from megatron_pmlm.models.palm import PalmForPreTraining, palm_config_from_preset
from megatron_pmlm.parallel.distributed import ends_process_groups, initialize_model_parallel
from megatron_pmlm.parallel.layers import MegatronCoreLayers

sys.path.insert(0, str(Path(__file__).parent))
from palm_tp_equivalence import VOCAB, batch as palm_batch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parents[1]))
from test_fused_qkv import GemmCounter, assert_equal_to_rounding, pmlm_batch, set_fused  # noqa: E402


def loss_and_gradients(model, loss_of, fused: bool):
    set_fused(model, fused)
    model.zero_grad(set_to_none=True)
    loss = loss_of()
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def check_equal(model, loss_of, label: str) -> None:
    loss_separate, grads_separate = loss_and_gradients(model, loss_of, fused=False)
    loss_fused, grads_fused = loss_and_gradients(model, loss_of, fused=True)
    torch.testing.assert_close(loss_fused, loss_separate, rtol=1e-6, atol=0, msg=label)
    assert grads_fused.keys() == grads_separate.keys(), label
    for name, grad in grads_separate.items():
        assert_equal_to_rounding(grads_fused[name], grad, 1e-6, f"{label} {name}")


@ends_process_groups
def main() -> int:
    initialize_model_parallel(tensor_parallel_size=2)
    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0)
    pmlm = PMLMForPreTraining(config, "ae+par", layers=MegatronCoreLayers(), init_seed=3)
    attention = pmlm.bert.encoder.layer[0].attention.self
    assert attention.query.weight.shape == (config.hidden_size // 2, config.hidden_size)  # really split
    batch = pmlm_batch()
    check_equal(pmlm, lambda: pmlm.forward_batch(batch).loss, "pmlm")

    hidden = torch.randn(2, 9, config.hidden_size, requires_grad=True)
    outputs, gemms = {}, {}
    for fused in (False, True):
        attention.fuse_projections = fused
        with GemmCounter() as counter:
            outputs[fused] = attention._project(hidden, attention.query, attention.key, attention.value)
        gemms[fused] = counter.count
    assert gemms == {False: 3, True: 1}, gemms
    for separate, fused in zip(outputs[False], outputs[True]):
        torch.testing.assert_close(fused, separate, rtol=1e-6, atol=0)
    # The input gradient is this rank's partial sum all-reduced over the group: the same either way.
    grads = [torch.autograd.grad(sum(o.square().sum() for o in outputs[fused]), hidden)[0] for fused in (False, True)]
    assert_equal_to_rounding(grads[1], grads[0], 1e-6, "input gradient")

    palm_config = palm_config_from_preset("palm-tiny", vocab_size=VOCAB - 6, padded_vocab_size=VOCAB,
                                          hidden_dropout=0.0, attention_dropout=0.0)
    palm = PalmForPreTraining(palm_config, MegatronCoreLayers(), stage=2, init_seed=3)
    inputs = palm_batch()
    check_equal(palm, lambda: palm(*inputs.as_tuple()).loss, "palm")
    assert any(isinstance(m, BertSelfAttention) for m in palm.decoder.modules())
    if dist.get_rank() == 0:
        print("TP=2 fused Q/K/V matches three GEMMs (PMLM and PALM: loss, every gradient, per-rank projections)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
