#!/usr/bin/env bash
# UniLMv2 PMLM LARGE pre-training (24 layers, hidden 1024, 16 heads, ~335M parameters) on 8 nodes x
# 8 V100-32GB: slurm/pretrain_base.sh with the large preset and a smaller micro batch. Submit from
# the repository root:
#
#   sbatch slurm/pretrain_large.sh
#
# Same environment variables, layout, signals and requeueing as slurm/pretrain_base.sh (read it);
# the defaults that differ: PRESET=large, MICRO_BATCH=12, SAVE_DIR=checkpoints/pmlm-large,
# TB_DIR=tensorboard/pmlm-large, and gradient clipping at 1.0.
# Where the values come from: the UniLMv2 paper trains and reports only BASE (its Table 7: batch
# 7,680, 500k steps, peak lr 6e-4, warmup 24k, Adam (0.9, 0.98), eps 1e-6, no clipping); the model
# shape is BERT-LARGE's. The recipe is BASE's except the clipping, which is not the paper's: deeper
# models in fp16 are prone to loss spikes, and BERT-LARGE, RoBERTa-LARGE and Megatron-LM all clip the
# gradient norm at 1.0. Change any of it through EXTRA_ARGS (given after these, so they win), e.g.
# EXTRA_ARGS="--lr 4e-4 --clip-grad 0".
#
# global batch 7,680 = micro batch 12 x 10 accumulation steps x 64 GPUs.
# Memory at micro batch 12, V100-32GB, fp16, ZeRO-1 over 64 ranks (estimate, T ~ 666 positions):
#   model states, P = 335M: fp16 weights + gradients 4P = 1.34 GB, fp32 master + Adam 12P / 64
#   = 0.06 GB, DeepSpeed gradient buffers 2.0 GB, CUDA context/workspaces ~1 GB -> ~4.4 GB
#   activations per sample and layer 34 T h + 5 a T^2 = 34 x 666 x 1024 (23.2 MB) + 5 x 16 x 666^2
#   (35.5 MB) = 58.7 MB; x 24 layers = 1.41 GB; shared bias [16, T, T] 14 MB (+ its gradient),
#   MLM head ~30 MB -> ~1.47 GB per sample; x 12 = 17.6 GB; total ~22 GB, ~26.5 GB with 20%
#   slack: fits. 16 (~33 GB with slack) would not; with EXTRA_ARGS=--checkpoint-activations
#   (~30% more compute) micro batch 20 (x 6 x 64) fits.
# Expected throughput (estimate, same efficiency as the paper's BASE run, ~17 model TFLOP/s per
# V100): 2.2 GFLOP per token x ~666 tokens -> ~11.6 sequences/s per V100, ~60 days for 500k steps.
#
#SBATCH --job-name=pmlm-large
#SBATCH --nodes=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --no-kill
#SBATCH --signal=USR1@900
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

export PRESET=${PRESET:-large}
export MICRO_BATCH=${MICRO_BATCH:-12}
export EXTRA_ARGS="--clip-grad 1.0 ${EXTRA_ARGS:-}"
REPO=${REPO:-${SLURM_SUBMIT_DIR:-.}}
# The batch script runs from a copy in SLURM's spool directory: find pretrain_base.sh in the repository.
exec bash "$REPO/slurm/pretrain_base.sh"
