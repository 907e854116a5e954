#!/usr/bin/env bash
# UniLMv2 PMLM BASE pre-training, the paper's run: 8 nodes x 8 V100-32GB, batch 7,680, 500k steps,
# sequence length 512, fp16. Submit from the repository root (the job runs there):
#
#   sbatch slurm/pretrain_base.sh
#
# A tiny run on a CPU-only one-node SLURM (what tests/test_slurm.py does):
#
#   PRESET=tiny DEVICE=cpu GPUS_PER_NODE=2 MICRO_BATCH=4 GLOBAL_BATCH=16 TRAIN_ITERS=100 \
#   DATA_PATH=data/tiny-samples sbatch --nodes=1 --gres=none --time=30 slurm/pretrain_base.sh
#
# The same on two CPU-only nodes, one task each (tests/test_slurm_multinode.py, in network
# namespaces): GPUS_PER_NODE=1 and sbatch --nodes=2; the global batch stays 16.
#
# ---------------------------------------------------------------- task layout
# srun starts ONE TASK PER GPU (GPUS_PER_NODE tasks on each of NNODES nodes), each running
# `python -m megatron_pmlm.pretrain` directly: the ranks come from SLURM_PROCID / SLURM_NTASKS /
# SLURM_LOCALID (the GPU index on the node; every task sees the node's 8 GPUs), MASTER_ADDR is the
# first host of `scontrol show hostnames`. Not torchrun under srun: with one process per GPU,
# SLURM's signals (--signal, preemption, scontrol requeue, scancel --signal) reach every training
# process itself; torchrun would have to relay them (and dies on SIGUSR1).
#
# ---------------------------------------------------------------- stopping and resuming
# * Every start passes `--save $SAVE_DIR --load $SAVE_DIR`: the first start trains from scratch,
#   every later one resumes from $SAVE_DIR/latest exactly (same sample order, same RNG states).
# * --signal=USR1@600: SLURM sends SIGUSR1 to the training tasks 10 minutes (give or take its
#   ~1 minute granularity) before the time limit. They save at the end of the current iteration
#   (~3.4 s here) and exit 0; this script then sees the checkpoint short of --train-iters and
#   requeues its own job (`scontrol requeue`, needs --requeue), which continues from the checkpoint.
#   With --signal=B:USR1@600, or `scancel --batch --signal=USR1 JOBID`, this shell gets the signal
#   and relays it to the tasks: same result.
# * Preemption (PreemptMode=REQUEUE) and `scontrol requeue JOBID`: SLURM sends SIGTERM to every
#   process of the job, the tasks save and exit, and SLURM itself requeues the job. The save must
#   finish within the cluster's KillWait (or the preemption GraceTime) before SIGKILL; if it does
#   not, the previous checkpoint is used (`latest` is written only once every rank has saved).
#   `scancel JOBID` also saves a checkpoint (SIGTERM) and ends the job: resubmit to continue.
# * Crashes: any other non-zero exit (an NCCL error or timeout, a GPU Xid, out of memory, a rank
#   killed: srun --kill-on-bad-exit ends the whole step) first restarts the training INSIDE the job:
#   a new srun step, up to IN_JOB_RESTARTS (3) times per start of the job, resuming from the newest
#   complete checkpoint (a checkpoint cut short is skipped, see tools/verify_checkpoint.py), after
#   a crash with progress (a newer complete checkpoint than the step's start) or a node-level
#   failure whose node was excluded (below), whatever the progress. Per-step names: the history
#   file job<ID>-restart<N>[-step<S>].json, the task status and heartbeat folders, MASTER_PORT (an
#   in-job restart keeps SLURM_RESTART_COUNT). The log says why, which task and host failed, and
#   "time lost: X s from the failure to the first iteration of step S". Only then, or without
#   progress, the job requeues itself (`scontrol requeue`, needs --requeue) to continue from the
#   newest complete checkpoint. Failures that leave no newer checkpoint than the step's start count
#   as "without progress"; after MAX_FAILED_RESTARTS of those in a row (a broken node, a bad
#   argument, missing data) the job stops with the failing status instead of looping. The count
#   lives in $SAVE_DIR/.failed_restarts.
#   The log and that status name the root cause: the first failed task's own exit status or signal
#   ("exit status 2 of task 1 on host H", "signal 9 (SIGKILL) of task 0 on host H"), not the SIGTERM
#   srun then sent the other tasks (each task records its status, see slurm/task_status.sh), and
#   whether it crashed at start-up (no iteration logged and no checkpoint saved by this start) or
#   mid-run.
# * Nodes (--no-kill: a failed node leaves the job instead of ending it): before each step the node
#   list is read again from `scontrol show job` (SLURM_JOB_NODELIST goes stale). SPARE_NODES=N:
#   submit with --nodes=NNODES+N; the training uses SLURM_JOB_NUM_NODES - SPARE_NODES nodes, the
#   batch host first, and the others wait. A host is excluded from the next steps (srun --nodelist
#   without it; the log names it and why) when srun reports that the node failed, when `scontrol show
#   node` says DOWN, DRAIN, FAIL or not responding (also checked every POLL_SECONDS while the step
#   runs: the step is then SIGKILLed instead of waiting for a collective's timeout), or when the
#   root cause was on it twice. The next step takes a spare. With no spare left, SHRINK_ON_FAILURE=1
#   continues on the largest node count whose data-parallel size (x MICRO_BATCH) divides
#   GLOBAL_BATCH (7,680 does not divide by 7 x 8 x 20: 6 nodes), with --universal-checkpoint; else
#   the job requeues. A failure of the batch script's own host ends this script: SLURM requeues the
#   job (--requeue) or ends it.
# * Hangs: each rank writes its phase (start-up, step N, validation, saving, compiling) to a heartbeat
#   file ($SAVE_DIR/.heartbeat/<step>/rank-NNNNN.json, --heartbeat-dir); every POLL_SECONDS this script
#   asks `python -m megatron_pmlm.training.heartbeat check`. When no rank progressed for
#   HANG_TIMEOUT_SECONDS (0: max(600 s, 3 x the slowest iteration seen)) it logs the stalled ranks,
#   hosts and phases, ends the step with SIGKILL (SIGTERM would make the ranks try to save and hang
#   again) and restarts as above. It covers what the NCCL/gloo timeouts do not: a stuck data read, a
#   deadlock outside a collective, a hang at start-up or during a save.
# * A hung collective fails after --distributed-timeout-minutes (DIST_TIMEOUT_MINUTES, default 10)
#   instead of holding 64 GPUs idle until the time limit; with TORCH_NCCL_ASYNC_ERROR_HANDLING=1 the
#   NCCL watchdog then aborts the process, and the job restarts as above.
# * AUTO_REQUEUE=0 turns the self-requeue off (the job then ends after the checkpoint or failure).
# * --open-mode=append: every restart appends to the same log, logs/%x-%j.out under the submit
#   directory (the repository root: its logs/ folder is tracked, empty, since sbatch does not create
#   it and a job whose log folder is missing fails without a log).
# * The job name: the header's pmlm-base can't follow PRESET (#SBATCH lines are not expanded), so
#   a job submitted with PRESET=tiny renames itself pmlm-tiny at start (scontrol update; squeue and
#   sacct show it). The log file keeps the name it was submitted under: `sbatch -J pmlm-tiny` names
#   both.
#
# ---------------------------------------------------------------- batch size
# global batch 7,680 = micro batch 20 x 6 accumulation steps x 64 data-parallel GPUs (8 x 8).
# pretrain derives the accumulation steps from GLOBAL_BATCH / (MICRO_BATCH x GPUs), so other node
# counts keep the batch (e.g. 4 nodes: 20 x 12 x 32); GLOBAL_BATCH must divide evenly.
#
# Memory at micro batch 20 on a V100-32GB (fp16, ZeRO-1 over 64 ranks), an estimate, not measured:
#   sequence: 512 tokens + ~15% masked (~76) appended twice (original + [P]) -> T ~ 666 positions
#   model states, 109.5M parameters P: fp16 weights 2P = 0.22 GB, fp16 gradients 2P = 0.22 GB,
#     fp32 master weights + Adam m, v 12P / 64 ranks = 0.02 GB; DeepSpeed's two contiguous
#     gradient buffers (reduce_bucket_size 5e8 x fp16 x 2 with overlap_comm) = 2.0 GB
#   CUDA context, cuBLAS/NCCL workspaces ~1 GB                               -> ~3.5 GB fixed
#   activations per sample and layer (Korthikanti et al. 2022, fp16, attention probabilities kept,
#     i.e. without a fused kernel): 34 T h + 5 a T^2 bytes
#     = 34 x 666 x 768 (17.4 MB) + 5 x 12 x 666^2 (26.6 MB) = 44.0 MB; x 12 layers = 528 MB
#   attention bias [heads, T, T] fp16 (relative positions + pseudo-mask rule), built once and
#     shared by the 12 layers: 12 x 666^2 x 2 B = 10.6 MB, its gradient as much again
#   embeddings ~2 MB; MLM head only at the ~152 predicted slots: logits 152 x 30,592 in fp16 and
#     fp32 for the cross entropy ~28 MB; backward transients of one layer's [a, T, T] ~21 MB
#   => ~0.6 GB per sample; x 20 = ~12 GB; total ~15.5 GB, ~19 GB with 20% allocator slack:
#   micro batch 20 fits 32 GB (about 40 would not leave room). With torch's memory-efficient SDPA
#   kernel (usable on V100 with an additive bias) the 5 a T^2 term mostly goes: ~0.3 GB/sample.
#
# ---------------------------------------------------------------- environment (defaults)
# REPO            repository root (the submit directory); the job cd's there
# VENV            $REPO/.venv                     PYTHON defaults to $VENV/bin/python
# DATA_PATH       data/pretrain-samples           a build_samples directory (slurm/prepare_data.sh
#                                                 writes PREFIX-samples)
# SAVE_DIR        checkpoints/pmlm-$PRESET        --save and --load
# TB_DIR          tensorboard/pmlm-$PRESET        TensorBoard event files
# HISTORY_DIR     $SAVE_DIR/history               metrics JSON per start: job<ID>-restart<N>.json, and
#                                                 job<ID>-restart<N>-step<S>.json per in-job restart
# NNODES          $SLURM_JOB_NUM_NODES - SPARE_NODES   nodes used by the training step
# GPUS_PER_NODE   8                               tasks (GPUs) per node
# PRESET          base                            tiny | base | large
# DEVICE          gpu                             cpu: DS_ACCELERATOR=cpu, gloo, no GPU, no fp16
# PRECISION       fp16 (gpu) / fp32 (cpu)         fp16 | bf16 | fp32
# DS_CONFIG       ds_configs/pretrain_base_v100.json (gpu) / ds_configs/cpu_tiny.json (cpu)
# MICRO_BATCH     20                              sequences per GPU per micro step
# GLOBAL_BATCH    7680                            sequences per optimizer step
# TRAIN_ITERS     500000
# SAVE_INTERVAL   1000                            checkpoint every N steps (~1 h here), besides
#                                                 the ones on signals and at the end
# LOG_INTERVAL    100     EVAL_INTERVAL 5000     EVAL_ITERS 10
# MASTER_ADDR     first host of the step          MASTER_PORT 10000 + f(job id, restart count, step),
#                                                 below Linux's ephemeral range (32768-60999)
# AUTO_REQUEUE    1                               requeue this job after a signal-triggered stop
#                                                 or a failure
# MAX_FAILED_RESTARTS 3                           consecutive failures without progress before
#                                                 the job gives up
# DIST_TIMEOUT_MINUTES 10                         --distributed-timeout-minutes
# IN_JOB_RESTARTS 3                               training restarts inside the job (new srun steps)
#                                                 before it requeues; 0: requeue at once (as before)
# SPARE_NODES     0                               nodes of the allocation kept for failed ones
# SHRINK_ON_FAILURE 0                             1: with no spare left, go on on fewer nodes
#                                                 (--universal-checkpoint) rather than requeue
# HANG_TIMEOUT_SECONDS 0                          no progress on any rank for this long = a hang;
#                                                 0: max(600, 3 x the slowest iteration)
# POLL_SECONDS    5                               how often the hang and node checks run
# EXTRA_ARGS      ""                              more pretrain arguments, e.g. "--lr 4e-4"
# SRUN_ARGS       ""                              more srun options, e.g. "--gpu-bind=none --mpi=none"
#
# ---------------------------------------------------------------- network (exported when set)
# NCCL_SOCKET_IFNAME   unset (NCCL picks)   the interface for NCCL's bootstrap and socket transport,
#                                           e.g. ib0, or ^docker,lo to exclude some
# GLOO_SOCKET_IFNAME   2+ nodes: the interface this node routes to the second node through
#                      (`ip route get`), else unset. The same for gloo (the CPU path, and
#                      megatron-core's gloo groups on GPUs too). Left to itself gloo binds to the
#                      address of the node's own hostname: a loopback address where /etc/hosts
#                      says so (Debian's default 127.0.1.1), and the other nodes cannot connect
#                      ("Gloo connectFullMesh failed ... remote=[127.0.1.1]"). Set it where the
#                      interface names differ between nodes, or to use another network.
# NCCL_IB_HCA          unset                which InfiniBand adapters, e.g. mlx5_0,mlx5_1 (or ^mlx5_2)
# TORCH_NCCL_ASYNC_ERROR_HANDLING 1         a failed or timed-out collective aborts the process
#                                           (so the job ends and requeues) rather than hanging
# NCCL_DEBUG           WARN                 INFO when diagnosing the network
# One GPU per task (--gpus-per-task=1, --gpu-bind=single:1) also works: each task then sees one
# GPU and uses it (device = local rank modulo the visible GPUs).
#
#SBATCH --job-name=pmlm-base
#SBATCH --nodes=8
#SBATCH --gres=gpu:8
#SBATCH --exclusive
#SBATCH --time=24:00:00
#SBATCH --requeue
#SBATCH --no-kill
#SBATCH --signal=USR1@600
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

REPO=${REPO:-${SLURM_SUBMIT_DIR:-.}}
cd "$REPO"
PRESET=${PRESET:-base}
DEVICE=${DEVICE:-gpu}
VENV=${VENV:-$REPO/.venv}
PYTHON=${PYTHON:-$VENV/bin/python}
DATA_PATH=${DATA_PATH:-data/pretrain-samples}
SAVE_DIR=${SAVE_DIR:-checkpoints/pmlm-$PRESET}
TB_DIR=${TB_DIR:-tensorboard/pmlm-$PRESET}
HISTORY_DIR=${HISTORY_DIR:-$SAVE_DIR/history}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MICRO_BATCH=${MICRO_BATCH:-20}
GLOBAL_BATCH=${GLOBAL_BATCH:-7680}
TRAIN_ITERS=${TRAIN_ITERS:-500000}
SAVE_INTERVAL=${SAVE_INTERVAL:-1000}
LOG_INTERVAL=${LOG_INTERVAL:-100}
EVAL_INTERVAL=${EVAL_INTERVAL:-5000}
EVAL_ITERS=${EVAL_ITERS:-10}
AUTO_REQUEUE=${AUTO_REQUEUE:-1}
MAX_FAILED_RESTARTS=${MAX_FAILED_RESTARTS:-3}
DIST_TIMEOUT_MINUTES=${DIST_TIMEOUT_MINUTES:-10}
EXTRA_ARGS=${EXTRA_ARGS:-}
SRUN_ARGS=${SRUN_ARGS:-}
JOB_ID=${SLURM_JOB_ID:?run this script with sbatch}
IN_JOB_RESTARTS=${IN_JOB_RESTARTS:-3}
SPARE_NODES=${SPARE_NODES:-0}
SHRINK_ON_FAILURE=${SHRINK_ON_FAILURE:-0}
HANG_TIMEOUT_SECONDS=${HANG_TIMEOUT_SECONDS:-0}
POLL_SECONDS=${POLL_SECONDS:-5}
for knob in IN_JOB_RESTARTS SPARE_NODES HANG_TIMEOUT_SECONDS POLL_SECONDS; do
  [[ ${!knob} =~ ^[0-9]+$ ]] || { echo "$knob must be a whole number >= 0, got '${!knob}'" >&2; exit 2; }
done
case "$SHRINK_ON_FAILURE" in 0|1) ;; *) echo "SHRINK_ON_FAILURE must be 0 or 1, got '$SHRINK_ON_FAILURE'" >&2; exit 2 ;; esac
NNODES=${NNODES:-$(( ${SLURM_JOB_NUM_NODES:-8} - SPARE_NODES ))}
[[ $NNODES =~ ^[0-9]+$ ]] && (( NNODES >= 1 )) \
  || { echo "NNODES must be at least 1 (the job's ${SLURM_JOB_NUM_NODES:-8} nodes less SPARE_NODES=$SPARE_NODES), got '$NNODES'" >&2; exit 2; }
RESTART=${SLURM_RESTART_COUNT:-0}
[ -f slurm/task_status.sh ] || { echo "no slurm/task_status.sh in REPO=$REPO: submit from the repository root or set REPO" >&2; exit 2; }
# shellcheck source=task_status.sh
. slurm/task_status.sh  # TASK_STATUS_WRAPPER, task_root_cause

case "$DEVICE" in
  gpu) PRECISION=${PRECISION:-fp16}; DS_CONFIG=${DS_CONFIG:-ds_configs/pretrain_base_v100.json} ;;
  cpu) PRECISION=${PRECISION:-fp32}; DS_CONFIG=${DS_CONFIG:-ds_configs/cpu_tiny.json}
       export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES="" ;;
  *) echo "DEVICE must be gpu or cpu, got '$DEVICE'" >&2; exit 2 ;;
esac
case "$PRECISION" in
  fp16|bf16) PRECISION_ARGS=(--"$PRECISION") ;;
  fp32) PRECISION_ARGS=() ;;
  *) echo "PRECISION must be fp16, bf16 or fp32, got '$PRECISION'" >&2; exit 2 ;;
esac
[ -x "$PYTHON" ] || { echo "no Python at $PYTHON (set VENV or PYTHON; make env creates .venv)" >&2; exit 2; }

ALL_NODES=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
BATCH_HOST=${SLURMD_NODENAME:-$(head -n 1 <<< "$ALL_NODES")}
USER_MASTER_ADDR=${MASTER_ADDR:-}
USER_MASTER_PORT=${MASTER_PORT:-}
# Network: the site's choices when given, safe defaults otherwise.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
for variable in NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_HCA; do
  [ -z "${!variable:-}" ] || export "${variable?}"
done
GLOO_CHOICE=""
if [ -z "${GLOO_SOCKET_IFNAME:-}" ] && (( NNODES > 1 )) && command -v ip > /dev/null; then
  # The interface that carries this node's traffic to the second node (the same name on every node).
  PEER=$(sed -n 2p <<< "$ALL_NODES")
  PEER_ADDRESS=$(getent ahostsv4 "$PEER" 2>/dev/null | awk 'NR == 1 { print $1 }' || true)
  GLOO_INTERFACE=$( { [ -z "$PEER_ADDRESS" ] || ip -o route get "$PEER_ADDRESS" 2>/dev/null; } \
               | sed -n 's/.* dev \([^ ]*\).*/\1/p' | head -n 1 || true)
  if [ -n "$GLOO_INTERFACE" ] && [ "$GLOO_INTERFACE" != lo ]; then
    export GLOO_SOCKET_IFNAME=$GLOO_INTERFACE
    GLOO_CHOICE="GLOO_SOCKET_IFNAME unset: using $GLOO_INTERFACE, this node's interface to $PEER ($PEER_ADDRESS)"
  else
    GLOO_CHOICE="GLOO_SOCKET_IFNAME unset and no interface to $PEER found: gloo binds to the address of this node's hostname"
  fi
fi
CPUS_PER_TASK=$(( ${SLURM_CPUS_ON_NODE:-$GPUS_PER_NODE} / GPUS_PER_NODE ))
(( CPUS_PER_TASK >= 1 )) || CPUS_PER_TASK=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$CPUS_PER_TASK}
export PYTHONUNBUFFERED=1  # log lines reach the job log as they happen
# srun decides for itself whether a node failure ends a step: the job's --no-kill must not keep a
# step whose node died waiting for it.
unset SLURM_NO_KILL

STEP=0  # in-job restarts so far in this start of the job (SLURM_RESTART_COUNT counts requeues)
log() {
  if (( STEP == 0 )); then echo "[$(date -u +%FT%TZ)] job $JOB_ID restart $RESTART: $*"
  else echo "[$(date -u +%FT%TZ)] job $JOB_ID restart $RESTART step $STEP: $*"; fi
}
now_us() { echo "${EPOCHREALTIME/[.,]/}"; }
seconds_of() { printf '%d.%d' $(( $1 / 1000000 )) $(( $1 % 1000000 / 100000 )); }  # microseconds -> "S.D"

# "ITERATION TRAIN_ITERS EXIT_INTERVAL" of the newest complete checkpoint ("0 0 0" if none yet,
# or if it cannot be read: said in the log, and the training start says more).
checkpoint_state() {
  "$PYTHON" -m megatron_pmlm.training.checkpoint_files state "$SAVE_DIR" \
    || { log "could not read the checkpoint state of $SAVE_DIR (above); taking it as 0" >&2; echo 0 0 0; }
}
FAILURES_FILE=$SAVE_DIR/.failed_restarts
failures_without_progress() { cat "$FAILURES_FILE" 2>/dev/null || echo 0; }

# ---------------------------------------------------------------- nodes
# The job's nodes now: SLURM_JOB_NODELIST goes stale once a failed node leaves a --no-kill job.
current_job_nodes() {
  local list
  list=$(scontrol show job "$JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeList=//p' | head -n 1 || true)
  case "$list" in ""|"(null)") list=$SLURM_JOB_NODELIST ;; esac
  scontrol show hostnames "$list"
}
# Why HOST cannot take a task (scontrol show node: DOWN, DRAIN, FAIL, or not responding: a `*`),
# or nothing.
node_problem() {
  local state
  state=$(scontrol show node -o "$1" 2>/dev/null | tr ' ' '\n' | sed -n 's/^State=//p' | head -n 1 || true)
  case "$state" in
    *DOWN*|*DRAIN*|*FAIL*|*NOT_RESPONDING*|*'*'*) echo "scontrol show node says State=$state" ;;
  esac
}
declare -A EXCLUDED=()       # host -> why it takes no more steps
declare -A HOST_FAILURES=()  # host -> failed steps whose root cause was on it
exclude() {
  [ -z "${EXCLUDED[$1]:-}" ] || return 0
  EXCLUDED[$1]=$2
  log "excluding host $1 from the next steps: $2"
}
# STEP_NODES (an array) for the next step: NNODES usable hosts of the job, the batch host first; with
# fewer left, SHRINK_ON_FAILURE=1 takes the largest count whose data-parallel size divides the global
# batch and resumes through --universal-checkpoint. Returns 1 when no layout is left.
choose_nodes() {
  local host problem usable=() count
  for host in $(current_job_nodes); do
    [ -z "${EXCLUDED[$host]:-}" ] || continue
    problem=$(node_problem "$host")
    if [ -n "$problem" ]; then
      [ "$host" = "$BATCH_HOST" ] || exclude "$host" "$problem"
      continue
    fi
    if [ "$host" = "$BATCH_HOST" ]; then usable=("$host" ${usable[@]+"${usable[@]}"}); else usable+=("$host"); fi
  done
  count=${#usable[@]}
  if (( count < NNODES )); then
    if [ "$SHRINK_ON_FAILURE" != 1 ]; then
      log "$count usable node(s) left (${usable[*]:-none}), $NNODES needed, and SHRINK_ON_FAILURE=0"
      return 1
    fi
    while (( count > 0 )) && (( GLOBAL_BATCH % (count * GPUS_PER_NODE * MICRO_BATCH) != 0 )); do
      count=$(( count - 1 ))
    done
    if (( count == 0 )); then
      log "${#usable[@]} usable node(s) left: no node count up to it gives a data-parallel size that divides" \
          "GLOBAL_BATCH=$GLOBAL_BATCH into micro batches of $MICRO_BATCH"
      return 1
    fi
    log "SHRINK_ON_FAILURE=1: ${#usable[@]} usable node(s) left, $NNODES needed: continuing on $count node(s)" \
        "(data-parallel size $((count * GPUS_PER_NODE)), global batch $GLOBAL_BATCH kept) with --universal-checkpoint"
    NNODES=$count
    UNIVERSAL=1
  fi
  STEP_NODES=("${usable[@]:0:NNODES}")
}

# ---------------------------------------------------------------- one training step
# The run's arguments, and the hang detection's heartbeat files where this pretrain writes them.
read -r -a EXTRA <<< "$EXTRA_ARGS"
read -r -a SRUN_EXTRA <<< "$SRUN_ARGS"
HEARTBEATS=""
if "$PYTHON" -c "import megatron_pmlm.training.heartbeat" 2> /dev/null; then HEARTBEATS=1; fi
UNIVERSAL=""
step_arguments() {
  ARGS=(--preset "$PRESET" --data-path "$DATA_PATH" --deepspeed-config "$DS_CONFIG" ${PRECISION_ARGS[@]+"${PRECISION_ARGS[@]}"}
        --distributed-timeout-minutes "$DIST_TIMEOUT_MINUTES"
        --micro-batch-size "$MICRO_BATCH" --global-batch-size "$GLOBAL_BATCH" --train-iters "$TRAIN_ITERS"
        --save "$SAVE_DIR" --load "$SAVE_DIR" --save-interval "$SAVE_INTERVAL"
        --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
        --tensorboard-dir "$TB_DIR" --history-json "$HISTORY_FILE")
  [ -z "$HEARTBEATS" ] || ARGS+=(--heartbeat-dir "$HEARTBEAT_DIR")
  [ -z "$UNIVERSAL" ] || ARGS+=(--universal-checkpoint)
  ARGS+=(${EXTRA[@]+"${EXTRA[@]}"})
}
# The running step's id (JOB.ID for scancel), from squeue.
step_id() {
  squeue -h -s -j "$JOB_ID" -o %i 2>/dev/null | sed -n "s/^$JOB_ID\.\([0-9][0-9]*\)$/\1/p" | sort -n | tail -n 1 || true
}
# SIGKILL to every task of the step (SIGTERM would make them try to save, and hang again). scancel
# runs in the background: it waits for a dead node's answer, while the live nodes' tasks die at once.
SCANCEL_PID=""
kill_step() {
  local id
  id=$(step_id)
  if [ -n "$id" ]; then
    log "sending SIGKILL to step $JOB_ID.$id"
    scancel --signal=KILL "$JOB_ID.$id" 2> /dev/null &
    SCANCEL_PID=$!
  else
    log "no step id from squeue: killing srun (pid $SRUN_PID)"
    kill -KILL "$SRUN_PID" 2> /dev/null || true
  fi
}
# The first iteration this step logged (its history file)
# (or a heartbeat file's phase "step N" beyond the first: LOG_INTERVAL may be long), or nothing yet.
logged_iteration() {
  if grep -q '"loss"' "$HISTORY_FILE" 2> /dev/null; then echo 1; return; fi
  [ -n "$HEARTBEATS" ] || return 0
  cat "$HEARTBEAT_DIR"/rank-*.json 2> /dev/null | grep -o '"phase": *"step [0-9]*"' | grep -o '[0-9]*' \
    | awk -v first=$((START_ITER + 2)) '$1 >= first { print 1; exit }' || true
}
# Hosts srun reported as failed in the job log since the step started.
srun_failed_hosts() {
  local file
  for file in "$JOB_STDOUT" "$JOB_STDERR"; do
    [ -f "$file" ] || continue
    tail -c +"$(( ${LOG_OFFSET[$file]:-0} + 1 ))" "$file" 2> /dev/null \
      | sed -n 's/.*[Nn]ode failure on \([A-Za-z0-9_.-]*\).*/\1/p'
  done | sort -u
}
JOB_STDOUT=$(scontrol show job "$JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^StdOut=//p' | head -n 1 || true)
JOB_STDERR=$(scontrol show job "$JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^StdErr=//p' | head -n 1 || true)
declare -A LOG_OFFSET=()

# The job name follows the preset unless sbatch -J chose another (the header's names are defaults).
case "${SLURM_JOB_NAME:-}" in
  pmlm-base|pmlm-large)
    if [ "$SLURM_JOB_NAME" != "pmlm-$PRESET" ]; then
      if scontrol update JobId="$JOB_ID" JobName="pmlm-$PRESET" 2> /dev/null; then
        log "job name $SLURM_JOB_NAME -> pmlm-$PRESET (PRESET=$PRESET)"
      else
        log "could not rename the job to pmlm-$PRESET (scontrol update refused); sbatch -J pmlm-$PRESET names it"
      fi
    fi ;;
esac

# srun runs in the background so that this shell can act on signals while it waits: bash runs a
# trap only between commands, and `wait` returns early when one arrives.
SIGNALLED=""     # USR1 reached this shell (--signal=B:USR1@..., scancel --batch --signal=USR1)
TERMINATING=""   # SIGTERM: SLURM is ending the job (scancel, scontrol requeue, preemption, time limit)
SRUN_PID=""
trap 'SIGNALLED=1; log "received SIGUSR1: relaying it to the training tasks"; [ -z "$SRUN_PID" ] || kill -USR1 "$SRUN_PID" 2>/dev/null || true' USR1
trap 'TERMINATING=1; log "received SIGTERM: the training tasks got it too and save"' TERM

# The failure's requeue (today's rule: the failures without progress in a row, AUTO_REQUEUE), once
# no in-job restart is left or allowed.
requeue_after_failure() {
  if [ "$AUTO_REQUEUE" != 1 ]; then
    log "training failed with status $RC (checkpoint at iteration $ITER); AUTO_REQUEUE=$AUTO_REQUEUE: not requeueing"
    exit "$RC"
  fi
  log "training failed with status $RC (checkpoint at iteration $ITER, $START_ITER at the start; $FAILURES" \
      "failure(s) in a row without progress, at most $MAX_FAILED_RESTARTS): requeueing job $JOB_ID to continue" \
      "from the newest complete checkpoint"
  scontrol requeue "$JOB_ID" || { log "scontrol requeue failed (submitted with --no-requeue?): resubmit to continue"; exit "$RC"; }
  exit 0
}

mkdir -p "$SAVE_DIR" "$TB_DIR" "$HISTORY_DIR"
FAILED_AT=""  # when the previous step failed (microseconds): the time lost ends at this step's first iteration
RC=0 FAILURES=0
while :; do
  # Per-step names: an in-job restart keeps SLURM_RESTART_COUNT (the first step keeps today's names).
  STEP_TAG=job$JOB_ID-restart$RESTART
  (( STEP == 0 )) || STEP_TAG+=-step$STEP
  HISTORY_FILE=$HISTORY_DIR/$STEP_TAG.json
  TASK_STATUS_DIR=$SAVE_DIR/.task_status/$STEP_TAG
  HEARTBEAT_DIR=$SAVE_DIR/.heartbeat/$STEP_TAG
  read -r START_ITER _ _ <<< "$(checkpoint_state)"
  if ! choose_nodes; then
    if (( STEP == 0 )); then
      log "NNODES=$NNODES exceeds the job's usable nodes: submit with --nodes=NNODES+SPARE_NODES or lower NNODES"
      exit 2
    fi
    requeue_after_failure
  fi
  export MASTER_ADDR=${USER_MASTER_ADDR:-${STEP_NODES[0]}}
  # A port per job and start (jobs sharing a node, or a restart while the old port lingers, do not
  # collide), below the ephemeral range so that no outgoing connection holds it.
  export MASTER_PORT=${USER_MASTER_PORT:-$((10000 + (JOB_ID % 2000) * 10 + (RESTART * (IN_JOB_RESTARTS + 1) + STEP) % 10))}
  step_arguments
  TASKS=$((NNODES * GPUS_PER_NODE))
  log "$NNODES node(s) x $GPUS_PER_NODE task(s) on ${STEP_NODES[*]} | master $MASTER_ADDR:$MASTER_PORT |" \
      "$DEVICE $PRECISION | $SAVE_DIR at iteration $START_ITER"
  if (( STEP == 0 )); then
    [ -z "$GLOO_CHOICE" ] || log "$GLOO_CHOICE"
    (( SPARE_NODES == 0 )) || log "SPARE_NODES=$SPARE_NODES: the job's other node(s) wait as spares"
  fi
  log "$PYTHON -m megatron_pmlm.pretrain ${ARGS[*]}"

  # Each task records its own exit status (slurm/task_status.sh): when one fails, srun ends the
  # others, and its own status may be theirs (143) rather than the failure's.
  rm -rf "$TASK_STATUS_DIR" "$HEARTBEAT_DIR" && mkdir -p "$TASK_STATUS_DIR"
  [ -z "$HEARTBEATS" ] || mkdir -p "$HEARTBEAT_DIR"
  for file in "$JOB_STDOUT" "$JOB_STDERR"; do
    [ -f "$file" ] && LOG_OFFSET[$file]=$(stat -c %s "$file") || true
  done
  STEP_STARTED=$(date +%s)
  NODE_LIST=$(IFS=,; echo "${STEP_NODES[*]}")
  # A step on a node that died stays in SLURM's books (holding its CPUs and GPUs) until that node
  # answers again: the restarted steps overlap it.
  OVERLAP=()
  (( STEP == 0 )) || OVERLAP=(--overlap)
  srun ${OVERLAP[@]+"${OVERLAP[@]}"} --nodes="$NNODES" --nodelist="$NODE_LIST" --ntasks="$TASKS" --ntasks-per-node="$GPUS_PER_NODE" \
       --cpus-per-task="$CPUS_PER_TASK" --kill-on-bad-exit=1 ${SRUN_EXTRA[@]+"${SRUN_EXTRA[@]}"} \
       bash -c "$TASK_STATUS_WRAPPER" pmlm-task "$TASK_STATUS_DIR" \
       "$PYTHON" -u -m megatron_pmlm.pretrain "${ARGS[@]}" &
  SRUN_PID=$!

  # While the step runs: its first iteration (the end of the time a failure lost), a hang (no rank
  # progressed for HANG_TIMEOUT_SECONDS: SIGKILL, then a restart), a node of the step going down.
  HANG="" NODE_DOWN="" FIRST_ITERATION=""
  LAST_CHECK=$SECONDS
  while kill -0 "$SRUN_PID" 2> /dev/null; do
    sleep 1 & SLEEP_PID=$!
    wait "$SLEEP_PID" 2> /dev/null || true
    kill "$SLEEP_PID" 2> /dev/null || true  # a trap cut the wait short
    if [ -z "$FIRST_ITERATION" ] && [ -n "$(logged_iteration)" ]; then
      FIRST_ITERATION=$(now_us)
      if [ -n "$FAILED_AT" ]; then
        log "time lost: $(seconds_of $((FIRST_ITERATION - FAILED_AT))) s from the failure to the first iteration" \
            "of step $STEP (restart overhead; plus the iterations since the checkpoint at iteration $START_ITER," \
            "trained again)"
      fi
    fi
    (( SECONDS - LAST_CHECK >= POLL_SECONDS )) && [ -z "$TERMINATING$SIGNALLED$HANG$NODE_DOWN" ] || continue
    LAST_CHECK=$SECONDS
    if [ -n "$HEARTBEATS" ]; then
      CHECK_RC=0
      REPORT=$("$PYTHON" -m megatron_pmlm.training.heartbeat check "$HEARTBEAT_DIR" --ranks "$TASKS" \
               --timeout "$HANG_TIMEOUT_SECONDS" --since "$STEP_STARTED" 2>&1) || CHECK_RC=$?
      if (( CHECK_RC == 1 )); then
        HANG=$(now_us)
        log "hang: no rank progressed for the timeout (HANG_TIMEOUT_SECONDS=$HANG_TIMEOUT_SECONDS); stalled:"
        while IFS= read -r line; do log "  $line"; done <<< "$REPORT"
        kill_step
        continue
      elif (( CHECK_RC != 0 )); then
        log "the heartbeat check failed (status $CHECK_RC: $REPORT): no hang detection for this step"
        HEARTBEATS=""
      fi
    fi
    for host in "${STEP_NODES[@]}"; do
      PROBLEM=$(node_problem "$host")
      if [ -n "$PROBLEM" ]; then
        NODE_DOWN=$(now_us) NODE_DOWN_HOST=$host NODE_DOWN_WHY=$PROBLEM
        log "node $host of the step failed ($PROBLEM): ending the step"
        kill_step
        break
      fi
    done
  done
  while :; do
    SIGNALLED_BEFORE=$SIGNALLED TERMINATING_BEFORE=$TERMINATING
    RC=0; wait "$SRUN_PID" || RC=$?
    # A trap ran during `wait` (it returned early): wait again for srun itself.
    if (( RC > 128 )) && { [ "$SIGNALLED" != "$SIGNALLED_BEFORE" ] || [ "$TERMINATING" != "$TERMINATING_BEFORE" ]; }; then
      continue
    fi
    break
  done
  SRUN_PID=""
  if [ -n "$SCANCEL_PID" ]; then wait "$SCANCEL_PID" 2> /dev/null || true; SCANCEL_PID=""; fi
  rm -rf "$HEARTBEAT_DIR"

  read -r ITER TOTAL EXIT_AT <<< "$(checkpoint_state)"
  (( RC != 0 )) || break
  # The root cause: the first failed task's own status, not the SIGTERM srun sent the others.
  task_root_cause "$TASK_STATUS_DIR" "$RC"
  RC=$ROOT_STATUS
  FAILED_AT=${ROOT_WHEN:-$(now_us)}
  if [ -n "$HANG" ]; then
    ROOT_CAUSE="a hang (no rank progressed for the timeout; the step was ended with SIGKILL)"
    FAILED_AT=$HANG ROOT_HOST=""
  elif [ -n "$NODE_DOWN" ] && [ -z "$ROOT_WHEN" ]; then
    ROOT_CAUSE="the failure of node $NODE_DOWN_HOST ($NODE_DOWN_WHY; the step was ended with SIGKILL)"
    FAILED_AT=$NODE_DOWN ROOT_HOST=""
  fi
  rm -rf "$TASK_STATUS_DIR"
  # Start-up or mid-run: did this attempt log an iteration (its history file) or save a checkpoint?
  LOGGED=$(grep -o '"iteration": *[0-9]*' "$HISTORY_FILE" 2>/dev/null \
           | grep -o '[0-9]*$' | sort -n | tail -n 1 || true)
  if (( ${LOGGED:-0} > START_ITER || ITER > START_ITER )); then
    WHEN="mid-run (last iteration logged by this attempt: ${LOGGED:-none}; checkpoint at iteration $ITER, $START_ITER at the start)"
  else
    WHEN="at start-up (no iteration logged and no checkpoint saved by this attempt; LOG_INTERVAL=$LOG_INTERVAL)"
  fi
  if [ -n "$TERMINATING" ]; then
    log "training exited with status $RC while SLURM ends the job, $WHEN: $ROOT_CAUSE"
    exit "$RC"
  fi
  log "training crashed $WHEN: $ROOT_CAUSE"
  # SIGUSR1/SIGTERM before pretrain installed its handlers: e.g. a time limit shorter than the
  # start-up plus the --signal lead.
  if [[ $WHEN == at\ start-up* ]] && (( RC == 138 || RC == 143 )); then
    log "a signal stopped the training processes during start-up"
  fi
  if (( ITER > START_ITER )); then
    FAILURES=0
  else
    FAILURES=$(( $(failures_without_progress) + 1 ))
  fi
  echo "$FAILURES" > "$FAILURES_FILE"

  # Node-level causes exclude their host from the next steps; so does a second failure on one host.
  EXCLUDED_NOW="" BATCH_HOST_FAILED=""
  FAILED_HOSTS=$(srun_failed_hosts)
  for host in "${STEP_NODES[@]}"; do
    REASON=""
    if grep -qxF "$host" <<< "$FAILED_HOSTS"; then
      REASON="srun reports that the node failed"
    else
      REASON=$(node_problem "$host")
    fi
    [ -n "$REASON" ] || continue
    if [ "$host" = "$BATCH_HOST" ]; then
      BATCH_HOST_FAILED="the batch host $host failed ($REASON)"
    else
      exclude "$host" "$REASON"; EXCLUDED_NOW=1
    fi
  done
  if [ -n "$ROOT_HOST" ] && [ -z "${EXCLUDED[$ROOT_HOST]:-}" ]; then
    HOST_FAILURES[$ROOT_HOST]=$(( ${HOST_FAILURES[$ROOT_HOST]:-0} + 1 ))
    if (( ${HOST_FAILURES[$ROOT_HOST]} >= 2 )); then
      if [ "$ROOT_HOST" = "$BATCH_HOST" ]; then
        log "the batch host $ROOT_HOST failed ${HOST_FAILURES[$ROOT_HOST]} times: it cannot be excluded (this script runs there)"
      else
        exclude "$ROOT_HOST" "failed twice (this time: $ROOT_CAUSE)"; EXCLUDED_NOW=1
      fi
    fi
  fi

  if (( FAILURES >= MAX_FAILED_RESTARTS )); then
    log "training failed with status $RC, $FAILURES time(s) in a row without progress (checkpoint at" \
        "iteration $ITER); MAX_FAILED_RESTARTS=$MAX_FAILED_RESTARTS reached: not requeueing"
    exit "$RC"
  fi
  if [ -n "$BATCH_HOST_FAILED" ]; then
    log "$BATCH_HOST_FAILED: the batch script cannot leave it, no in-job restart"
    requeue_after_failure
  fi
  if [ -n "$EXCLUDED_NOW" ]; then WHY="a node-level failure, its host excluded"
  elif (( ITER > START_ITER )); then WHY="a crash after progress (checkpoint at iteration $ITER, $START_ITER at the step's start)"
  else
    log "no in-job restart: no newer checkpoint than the step's start (iteration $START_ITER) and no host excluded"
    requeue_after_failure
  fi
  if (( STEP >= IN_JOB_RESTARTS )); then
    log "no in-job restart left (IN_JOB_RESTARTS=$IN_JOB_RESTARTS used) after $WHY"
    requeue_after_failure
  fi
  STEP=$(( STEP + 1 ))
  log "in-job restart $STEP of $IN_JOB_RESTARTS after $WHY: ${ROOT_CAUSE}; resuming from the newest complete checkpoint"
done

rm -rf "$TASK_STATUS_DIR"
echo 0 > "$FAILURES_FILE"
if (( ITER >= TOTAL && TOTAL > 0 )) || (( EXIT_AT > 0 && ITER >= EXIT_AT )); then
  log "training complete: checkpoint at iteration $ITER of $TOTAL"
  exit 0
fi
if [ -n "$TERMINATING" ]; then
  log "stopped at iteration $ITER of $TOTAL by SLURM (requeued or preempted jobs restart by themselves; resubmit a cancelled one)"
  exit 0
fi
if (( ITER <= START_ITER )); then
  log "stopped at iteration $ITER without progress since the start ($START_ITER); not requeueing"
  exit 1
fi
if [ "$AUTO_REQUEUE" != 1 ]; then
  log "stopped at iteration $ITER of $TOTAL (signal); AUTO_REQUEUE=$AUTO_REQUEUE: resubmit to continue"
  exit 0
fi
log "stopped at iteration $ITER of $TOTAL (signal): requeueing job $JOB_ID to continue from the checkpoint"
scontrol requeue "$JOB_ID" || { log "scontrol requeue failed (submitted with --no-requeue?): resubmit to continue"; exit 1; }
