#!/usr/bin/env bash
# Tokenize a corpus on several nodes, join the shards, then build the samples with their masks.
#
#   sbatch --nodes=4 --ntasks-per-node=1 --cpus-per-task=64 slurm/prepare_data.sh \
#       /data/out/pretrain "/data/raw/wiki/*.jsonl /data/raw/books/*.txt /data/raw/cc_news"
#
#   (or just `sbatch --nodes=4 --cpus-per-task=64 ...`: without --ntasks/--ntasks-per-node the
#   script runs one task per node; --ntasks=N runs N tasks however SLURM places them)
#
# Step 1: srun starts one task per node; each reads SLURM_PROCID/SLURM_NTASKS and tokenizes
#         shards r, r+W, ... of the (deterministic) shard list with --workers processes.
#         A crashed or preempted job resumes: rerun it and finished shards are skipped.
# Step 2: one task joins the shards into PREFIX.bin/.idx (--merge-only).
# Step 3: build_samples packs samples and precomputes K mask epochs, on one node's cores.
#
# Environment: VOCAB (required): a WordPiece vocab.txt, e.g. bert-base-uncased's (30,522 entries,
# the paper's; the vocab.txt of any bert-base-uncased download or Hugging Face folder); or instead
# TRAIN_VOCAB=SIZE: a step 0 trains an uncased WordPiece vocabulary of SIZE entries (with [P]) on
# the inputs in one task, into PREFIX-vocab/vocab.txt, which every rank then tokenizes with.
# Optional: PYTHON (default .venv/bin/python), JSON_KEY (text), SEQ_LENGTH (512), MASK_EPOCHS (10),
# SPLIT (949,50,1), SEED (1234), SHARD_SIZE_MB (256).
#SBATCH --job-name=pmlm-data
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

PREFIX=${1:?usage: prepare_data.sh OUTPUT_PREFIX "INPUT [INPUT...]"}
INPUTS=${2:?usage: prepare_data.sh OUTPUT_PREFIX "INPUT [INPUT...]"}
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"
[ -f slurm/task_status.sh ] || { echo "prepare_data.sh: submit it from the repository root (no slurm/task_status.sh in $PWD)" >&2; exit 2; }
# shellcheck source=task_status.sh
. slurm/task_status.sh  # TASK_STATUS_WRAPPER, task_root_cause
PYTHON=${PYTHON:-.venv/bin/python}
WORKERS=${SLURM_CPUS_PER_TASK:-$(nproc)}
# sbatch sets SLURM_NTASKS only when tasks were asked for: otherwise one task per node (not one
# task in all, which would leave every other node of the allocation idle).
if [ -n "${SLURM_NTASKS:-}" ]; then
  NTASKS=$SLURM_NTASKS LAYOUT=()
else
  NTASKS=${SLURM_JOB_NUM_NODES:-1} LAYOUT=(--ntasks-per-node=1)
fi
# Globs are expanded by preprocess itself (sorted), identically on every rank.
read -r -a INPUT_ARGS <<< "$INPUTS"

if [ -n "${TRAIN_VOCAB:-}" ] && [ -z "${VOCAB:-}" ]; then
  echo "[$(date -u +%FT%TZ)] training a WordPiece vocabulary of $TRAIN_VOCAB entries into $PREFIX-vocab"
  srun --ntasks=1 --nodes=1 "$PYTHON" -m data_prep.preprocess --input "${INPUT_ARGS[@]}" --output-prefix "$PREFIX" \
      --json-key "${JSON_KEY:-text}" --train-vocab "$TRAIN_VOCAB" --vocab-only --no-progress
  VOCAB=$PREFIX-vocab/vocab.txt
fi
VOCAB=${VOCAB:?set VOCAB to a WordPiece vocab.txt (e.g. bert-base-uncased's, 30,522 entries), or TRAIN_VOCAB=SIZE; see this script's header}
if [ ! -f "$VOCAB" ]; then echo "prepare_data.sh: VOCAB=$VOCAB does not exist" >&2; exit 2; fi
COMMON=(--input "${INPUT_ARGS[@]}" --output-prefix "$PREFIX" --vocab-file "$VOCAB"
        --json-key "${JSON_KEY:-text}" --shard-size-mb "${SHARD_SIZE_MB:-256}" --no-progress)

echo "[$(date -u +%FT%TZ)] tokenizing on $NTASKS task(s) x $WORKERS worker(s)"
# Each task records its own exit status (slurm/task_status.sh): when one fails, srun ends the
# others, and its own status may be theirs (143) rather than the failure's.
STATUS_DIR=$PREFIX.task-status
rm -rf "$STATUS_DIR" && mkdir -p "$STATUS_DIR"
RC=0
srun --ntasks="$NTASKS" ${LAYOUT[@]+"${LAYOUT[@]}"} --kill-on-bad-exit=1 bash -c "$TASK_STATUS_WRAPPER" pmlm-task "$STATUS_DIR" \
    "$PYTHON" -m data_prep.preprocess "${COMMON[@]}" --workers "$WORKERS" || RC=$?
if (( RC != 0 )); then
  task_root_cause "$STATUS_DIR" "$RC"
  rm -rf "$STATUS_DIR"
  echo "[$(date -u +%FT%TZ)] tokenizing failed: $ROOT_CAUSE (rerun to resume: finished shards are kept)" >&2
  exit "$ROOT_STATUS"
fi
rm -rf "$STATUS_DIR"

if [ "$NTASKS" -gt 1 ]; then  # a single task merges by itself
    echo "[$(date -u +%FT%TZ)] merging the shards into $PREFIX.bin/.idx"
    srun --ntasks=1 --nodes=1 "$PYTHON" -m data_prep.preprocess "${COMMON[@]}" --merge-only
fi

echo "[$(date -u +%FT%TZ)] building samples with precomputed masks into $PREFIX-samples"
srun --ntasks=1 --nodes=1 "$PYTHON" -m data_prep.build_samples --data-path "$PREFIX" \
    --output "$PREFIX-samples" --seq-length "${SEQ_LENGTH:-512}" --mask-epochs "${MASK_EPOCHS:-10}" \
    --split "${SPLIT:-949,50,1}" --seed "${SEED:-1234}" --workers "$WORKERS" --no-progress
echo "[$(date -u +%FT%TZ)] done: train with --data-path $PREFIX-samples"
