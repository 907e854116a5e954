"""torchrun --nproc-per-node 2 tests/distributed/tp_flex_equivalence.py [BACKEND]: with the flex
attention backend (or BACKEND: triton, in Triton's interpreter), TP=2 (heads and the relative-bias
table split) gives TP=1 sdpa's loss and gradients (run by tests/test_flex_attention.py and
tests/test_bucket_attention.py)."""

import sys

import numpy as np
import torch
import torch.distributed as dist

from megatron_pmlm.config import MaskingConfig, model_config_from_preset
from megatron_pmlm.parallel.distributed import ends_process_groups, initialize_model_parallel
from megatron_pmlm.data.batches import build_batch
from megatron_pmlm.data.masking import mask_example
from megatron_pmlm.models.model import PMLMForPreTraining
from megatron_pmlm.parallel.layers import MegatronCoreLayers, merge_state_dicts


@ends_process_groups
def main() -> int:
    initialize_model_parallel(tensor_parallel_size=2)
    rank = dist.get_rank()
    backend = sys.argv[1] if len(sys.argv) > 1 else "flex"
    flex = model_config_from_preset("tiny", vocab_size=256, hidden_dropout=0.0, attention_dropout=0.0,
                                    attention_backend=backend)
    sdpa = model_config_from_preset("tiny", vocab_size=256, hidden_dropout=0.0, attention_dropout=0.0)
    reference = PMLMForPreTraining(sdpa, "ae+par", init_seed=3)  # TP=1, sdpa, on every rank
    parallel = PMLMForPreTraining(flex, "ae+par", layers=MegatronCoreLayers(), init_seed=3)

    rng = np.random.default_rng(1)
    ids, segments, masks = [], [], []
    for length in (40, 29, 35):
        x = rng.integers(5, 256, length)
        x[0], x[-1] = 1, 2
        ids.append(x)
        segments.append(np.zeros(length, dtype=np.int64))
        masks.append(mask_example(x, x >= 5, rng, MaskingConfig(), 256, np.arange(5), 3))
    batch = build_batch(ids, segments, masks, 4, 0)

    out_ref = reference.forward_batch(batch)
    out_ref.loss.backward()
    out_tp = parallel.forward_batch(batch)
    out_tp.loss.backward()
    torch.testing.assert_close(out_tp.loss, out_ref.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out_tp.loss_par, out_ref.loss_par, rtol=1e-5, atol=1e-6)

    gathered = [None, None]
    dist.all_gather_object(gathered, {n: p.grad for n, p in parallel.named_parameters()})
    merged = merge_state_dicts(gathered)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(merged[name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert parallel.bert.rel_pos_bias.weight.shape == (2, 32)  # each rank scores its own heads
    if rank == 0:
        print(f"TP=2 {backend} matches TP=1 sdpa: loss {out_tp.loss.item():.6f} vs {out_ref.loss.item():.6f}, "
              f"{len(merged)} gradients equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
