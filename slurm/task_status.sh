# Sourced by the batch scripts (not run by itself): why a multi-task srun step failed.
#
# With --kill-on-bad-exit=1, once one task fails srun ends the others (SIGTERM, SIGKILL after
# KillWait), and srun's own exit status is whichever task's it takes: often the 143 of a task it
# terminated itself, not the failure that caused it. So every task runs under TASK_STATUS_WRAPPER,
# which records its command's exit status, when it ended and on which host, in DIR/task-RANK:
#
#   srun ... bash -c "$TASK_STATUS_WRAPPER" task DIR COMMAND [ARGS...]
#
# (DIR on a file system every node shares; empty it before each step). `task_root_cause DIR
# SRUN_STATUS` then sets
#   ROOT_STATUS  the root cause's status, to exit with (128+N for signal N)
#   ROOT_CAUSE   in words: "exit status 2 of task 1 on host node3", "signal 9 (SIGKILL) of task 0 on
#                host node1"
#   ROOT_TASK, ROOT_HOST, ROOT_WHEN  its task rank, host and end time (microseconds since the epoch),
#                empty without a record
# The root cause is the failed task that ended first, SIGTERM'd tasks (143: what srun sends the
# others) counting only when every failed task was; a task ended by srun's SIGKILL records nothing.
# Without a record (srun could not start the tasks, or they were all SIGKILLed) srun's status stands.
#
# The wrapper leaves signals to the command: SLURM signals every process of the step (SIGUSR1 before
# the time limit, SIGTERM on preemption, requeue or cancel), the command acts on them, and the
# wrapping shell's traps only defer them until the command has ended (traps reset on exec, so the
# command starts with the default handlers, as without the wrapper).

# shellcheck disable=SC2016  # expanded by the task's shell
TASK_STATUS_WRAPPER='trap : TERM USR1 USR2 HUP INT
dir=$1; shift
"$@"; status=$?
when=${EPOCHREALTIME:-$(date +%s.%6N)}
printf "%s %s %s\n" "$status" "${when/[.,]/}" "${SLURMD_NODENAME:-$(hostname)}" > "$dir/task-${SLURM_PROCID:-0}"
exit "$status"'

task_root_cause() {
  local dir=$1 file task status when host rank
  local best_task="" best_status="" best_when="" best_host="" best_rank=""
  ROOT_STATUS=$2 ROOT_TASK="" ROOT_HOST="" ROOT_WHEN=""
  ROOT_CAUSE="srun's exit status $2 (no task recorded a failure)"
  for file in "$dir"/task-*; do
    [ -f "$file" ] || continue
    task=${file##*/task-}
    read -r status when host < "$file" || continue
    [[ $status =~ ^[0-9]+$ && $when =~ ^[0-9]+$ ]] || continue
    (( status != 0 )) || continue
    rank=0; (( status == 143 )) && rank=1
    if [ -z "$best_task" ] || (( rank < best_rank || (rank == best_rank && when < best_when) )); then
      best_task=$task best_status=$status best_when=$when best_host=$host best_rank=$rank
    fi
  done
  [ -n "$best_task" ] || return 0
  ROOT_STATUS=$best_status ROOT_TASK=$best_task ROOT_HOST=$best_host ROOT_WHEN=$best_when
  if (( best_status > 128 )); then
    ROOT_CAUSE="signal $((best_status - 128)) (SIG$(kill -l $((best_status - 128)) 2>/dev/null || echo '?'))"
  else
    ROOT_CAUSE="exit status $best_status"
  fi
  ROOT_CAUSE+=" of task $best_task on host $best_host"
}
