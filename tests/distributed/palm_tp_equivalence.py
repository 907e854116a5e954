"""torchrun --nproc-per-node 2 tests/distributed/palm_tp_equivalence.py: PALM at TP=2 starts from the
TP=1 weights and computes the same losses, accuracy counters and gradients, in both stages (run by
tests/test_palm.py)."""

import sys

import torch
import torch.distributed as dist

from megatron_pmlm.parallel.distributed import ends_process_groups, initialize_model_parallel
from megatron_pmlm.models.layout import CONTEXT, IGNORE_INDEX, MASKED, PAD
from megatron_pmlm.models.palm import PalmBatch, PalmForPreTraining, palm_config_from_preset
from megatron_pmlm.parallel.layers import MegatronCoreLayers, merge_state_dicts, shard_state_dict

VOCAB = 256


def batch() -> PalmBatch:
    generator = torch.Generator().manual_seed(5)
    context = torch.randint(5, VOCAB - 6, (3, 20), generator=generator)
    roles = torch.full_like(context, CONTEXT)
    roles[1, 15:] = PAD
    context[1, 15:] = 0
    masked = torch.zeros_like(context, dtype=torch.bool)
    masked[:, 3] = masked[:, 7] = True
    mlm_labels = torch.where(masked, context, IGNORE_INDEX)
    encoder_ids = torch.where(masked, torch.full_like(context, 3), context)
    decoder_ids = torch.randint(5, VOCAB - 6, (3, 9), generator=generator)
    decoder_ids[:, 2] = context[:, 4]  # tokens the copy distribution can reach
    labels = torch.cat([decoder_ids[:, 1:], torch.full((3, 1), 2)], 1)
    labels[2, 6:] = IGNORE_INDEX
    return PalmBatch(encoder_ids, torch.where(masked, MASKED, roles), context, mlm_labels, decoder_ids, labels)


@ends_process_groups
def main() -> int:
    initialize_model_parallel(tensor_parallel_size=2)
    rank = dist.get_rank()
    config = palm_config_from_preset("palm-tiny", vocab_size=VOCAB - 6, padded_vocab_size=VOCAB, hidden_dropout=0.0,
                                     attention_dropout=0.0)
    for stage in (1, 2):
        reference = PalmForPreTraining(config, stage=stage, init_seed=3)
        parallel = PalmForPreTraining(config, MegatronCoreLayers(), stage=stage, init_seed=3)
        expected = shard_state_dict(dict(reference.named_parameters()), rank, 2)
        for name, tensor in parallel.named_parameters():
            torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
        inputs = batch()
        if stage == 1:
            inputs.encoder_roles = torch.where(inputs.mlm_labels != IGNORE_INDEX, MASKED, inputs.encoder_roles)
        out_ref, out_tp = reference(*inputs.as_tuple()), parallel(*inputs.as_tuple())
        out_ref.loss.backward()
        out_tp.loss.backward()
        torch.testing.assert_close(out_tp.metrics(), out_ref.metrics(), rtol=1e-5, atol=1e-6)
        gathered = [None, None]
        dist.all_gather_object(gathered, {n: p.grad for n, p in parallel.named_parameters() if p.grad is not None})
        merged = merge_state_dicts(gathered)
        trained = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
        assert set(merged) == set(trained), sorted(set(merged) ^ set(trained))
        for name, grad in trained.items():
            torch.testing.assert_close(merged[name], grad, rtol=1e-4, atol=1e-6, msg=name)
        heads = parallel.decoder.layer[0].crossattention.self.query.weight.shape[0]
        assert heads == config.hidden_size // 2, heads  # cross-attention heads are split
        if rank == 0:
            print(f"stage {stage}: TP=2 matches TP=1 (loss {out_tp.loss.item():.6f} vs {out_ref.loss.item():.6f}, "
                  f"{len(trained)} gradients)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
