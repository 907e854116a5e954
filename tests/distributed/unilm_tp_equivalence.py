"""torchrun --nproc-per-node 2 tests/distributed/unilm_tp_equivalence.py: for the UniLM v1 mixture
(all four LM types and the NSP head in one batch), TP=2's losses, per-LM metrics and every merged
gradient equal TP=1's (run by tests/test_unilm.py)."""

import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_pmlm.config import model_config_from_preset
from megatron_pmlm.parallel.distributed import ends_process_groups, initialize_model_parallel
from megatron_pmlm.models.model import PMLMForPreTraining
from megatron_pmlm.parallel.layers import MegatronCoreLayers, merge_state_dicts, shard_state_dict
from megatron_pmlm.tokenizer import SpecialTokenIds
from megatron_pmlm.data.unilm_batches import build_unilm_batch, sample_keys
from megatron_pmlm.models.unilm import TYPE_VOCAB_SIZE

VOCAB = 256


@ends_process_groups
def main() -> int:
    initialize_model_parallel(tensor_parallel_size=2)
    rank = dist.get_rank()
    config = model_config_from_preset("tiny", vocab_size=VOCAB, hidden_dropout=0.0, attention_dropout=0.0,
                                      type_vocab_size=TYPE_VOCAB_SIZE)
    reference = PMLMForPreTraining(config, "unilm", init_seed=3)
    parallel = PMLMForPreTraining(config, "unilm", layers=MegatronCoreLayers(), init_seed=3)
    expected = shard_state_dict(dict(reference.named_parameters()), rank, 2)
    for name, tensor in parallel.named_parameters():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)

    rng = np.random.default_rng(1)
    lengths = np.array([40, 29, 35, 33, 38])
    ids = np.zeros((len(lengths), lengths.max()), dtype=np.int64)
    second = np.zeros_like(ids, dtype=bool)
    for row, length in enumerate(lengths):
        ids[row, :length] = rng.integers(6, VOCAB, length)
        split = length // 2
        ids[row, 0], ids[row, split], ids[row, length - 1] = 2, 3, 3
        second[row, split + 1:length] = True
    special = SpecialTokenIds(pad=0, unk=1, cls=2, sep=3, mask=4, pseudo=5)
    batch = build_unilm_batch(ids, lengths, second, np.array([0, 1, 2, 3, 0]), np.array([1, -1, -1, -1, 0]),
                              sample_keys(5, 0, np.arange(len(lengths))), special, VOCAB)

    out_ref = reference.forward_batch(batch)
    out_ref.loss.backward()
    out_tp = parallel.forward_batch(batch)
    out_tp.loss.backward()
    torch.testing.assert_close(out_tp.loss, out_ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_tp.metrics(), out_ref.metrics(), rtol=1e-5, atol=1e-5)
    counts = out_ref.counts.detach()
    assert float(out_ref.loss_nsp.detach()) > 0 and all(float(c) > 0 for c in counts[6::2]), counts

    grads_tp = {n: p.grad for n, p in parallel.named_parameters()}
    gathered = [None, None]
    dist.all_gather_object(gathered, grads_tp)
    merged = merge_state_dicts(gathered)
    for name, param in reference.named_parameters():
        assert param.grad is not None, name
        torch.testing.assert_close(merged[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert "bert.pooler.dense.weight" in merged and "cls.seq_relationship.weight" in merged
    if rank == 0:
        print(f"UniLM TP=2 matches TP=1: loss {out_tp.loss.item():.6f} vs {out_ref.loss.item():.6f}, "
              f"{len(merged)} gradients equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
