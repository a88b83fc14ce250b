#!/usr/bin/env bash
# Common body of every slurm/*.sbatch script: run launchers/train.py on all nodes of the
# allocation, and on preemption checkpoint, stop and requeue. See slurm/README.md.
#
#   exec bash "$ROOT/slurm/launch.sh" CONFIG_NAME [hydra overrides...]   (from a *.sbatch script)
#
# Environment (all optional):
#   MEGALIGN_ROOT       repository root on the nodes (default: $SLURM_SUBMIT_DIR)
#   MEGALIGN_PYTHON     python to run (default: python from PATH; sbatch exports the submitter's
#                       environment, so an activated venv carries over)
#   MEGALIGN_LAUNCHER   srun (default: one process per task, ranks from SLURM_PROCID) or
#                       torchrun (one torchrun per node, c10d rendezvous at MASTER_ADDR:MASTER_PORT)
#   NPROC_PER_NODE      torchrun mode: processes per node (default: GPUs per node, else 1)
#   MASTER_PORT         rendezvous port (default: 20000 + job id % 20000, the same after a requeue)
#   MEGALIGN_PREFLIGHT  0 skips the config check before the processes start
#   MEGALIGN_CPU_THREADS  CPU-only runs: threads per process (default: the node's CPUs / processes per node)
set -uo pipefail

log() { echo "[megalign $(date +%T)] $*"; }
die() { log "ERROR: $*"; exit 2; }

[ -n "${SLURM_JOB_ID:-}" ] || die "not inside a Slurm job: submit with sbatch slurm/<job>.sbatch"
[ $# -ge 1 ] || die "usage: launch.sh CONFIG_NAME [hydra overrides...]"
CONFIG_NAME=$1
shift
ROOT=${MEGALIGN_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}
[ -f "$ROOT/launchers/train.py" ] || die "no launchers/train.py under $ROOT: run sbatch from the repository root or set MEGALIGN_ROOT"
[ -f "$ROOT/configs/$CONFIG_NAME.yaml" ] || die "no configs/$CONFIG_NAME.yaml under $ROOT"
cd "$ROOT" || die "cannot cd to $ROOT"

# --- preemption: USR1 (#SBATCH --signal=B:USR1@N) -> checkpoint, stop, requeue -------------
# The training processes save at the next step boundary and exit 75 (launchers/preemption.py).
# The stop file reaches processes that did not have their handler yet (torchrun workers ignore
# USR1 until then); a process that gets USR1 before it ignores or handles it dies, and the job
# is requeued all the same.
export MEGALIGN_STOP_FILE=${MEGALIGN_STOP_FILE:-$ROOT/slurm/logs/.stop-$SLURM_JOB_ID}
rm -f "$MEGALIGN_STOP_FILE"
PREEMPTED=
preempt() {
  PREEMPTED=1
  log "got USR1: asking the training processes to checkpoint and stop"
  touch "$MEGALIGN_STOP_FILE"
  scancel --signal=USR1 "$SLURM_JOB_ID"  # every process of the job's steps, not this shell
}
trap preempt USR1

PYTHON=${MEGALIGN_PYTHON:-python}
LAUNCHER=${MEGALIGN_LAUNCHER:-srun}

# --- rendezvous: the first node's address (its name may not resolve on every node) -------
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
ADDR=$(scontrol show node "$HEAD" -o | tr ' ' '\n' | sed -n 's/^NodeAddr=//p')
export MASTER_ADDR=${MASTER_ADDR:-${ADDR:-$HEAD}}
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}

# --- world size and one process per GPU --------------------------------------------------
NNODES=${SLURM_NNODES:-1}
GPUS=${SLURM_GPUS_ON_NODE:-0}
case "$LAUNCHER" in
  srun)
    PER_NODE=${SLURM_NTASKS_PER_NODE:-$(( ${SLURM_NTASKS:-1} / NNODES ))}
    if [ "$GPUS" -gt 0 ] && [ "$PER_NODE" -ne "$GPUS" ]; then
      die "$PER_NODE tasks per node but $GPUS GPUs per node: srun runs one process per GPU, set #SBATCH --ntasks-per-node=$GPUS (or --gpus-per-node=$PER_NODE)"
    fi
    WORLD=${SLURM_NTASKS:-$PER_NODE}
    # ranks come from SLURM_PROCID/SLURM_LOCALID (parallel/state.py); LOCAL_WORLD_SIZE sets the
    # CPU threads per process on a CPU-only run (launchers/common.py)
    export LOCAL_WORLD_SIZE=${LOCAL_WORLD_SIZE:-$PER_NODE}
    CMD=(srun --kill-on-bad-exit=0 "$PYTHON" launchers/train.py --config-name "$CONFIG_NAME" "$@")
    ;;
  torchrun)
    PER_NODE=${NPROC_PER_NODE:-$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 1)}
    WORLD=$((NNODES * PER_NODE))
    # torchrun's agent would die of SIGUSR1 (default action): it ignores it, the workers
    # install their own handler (launchers/preemption.py).
    CMD=(srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=0
         bash -c 'trap "" USR1; exec "$@"' torchrun
         "$PYTHON" -m torch.distributed.run --nnodes="$NNODES" --nproc-per-node="$PER_NODE"
         --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"
         launchers/train.py --config-name "$CONFIG_NAME" "$@")
    ;;
  *) die "MEGALIGN_LAUNCHER=$LAUNCHER: valid values are srun, torchrun" ;;
esac

log "job $SLURM_JOB_ID ($SLURM_JOB_NAME) restart ${SLURM_RESTART_COUNT:-0}: $NNODES node(s) $SLURM_JOB_NODELIST," \
    "$PER_NODE process(es) per node, world size $WORLD, $LAUNCHER, rendezvous $MASTER_ADDR:$MASTER_PORT"
log "config $CONFIG_NAME, overrides: $*"

# --- cheap checks before any training process starts ------------------------------------
if [ "${MEGALIGN_PREFLIGHT:-1}" != 0 ]; then
  "$PYTHON" launchers/preflight.py --world-size "$WORLD" --config-name "$CONFIG_NAME" "$@" \
    || die "config check failed (above); nothing was started. Fix the override, or MEGALIGN_PREFLIGHT=0 to skip"
fi
if [ -n "$PREEMPTED" ]; then
  log "got USR1 before training started: requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi

"${CMD[@]}" &
STEP=$!
while :; do
  wait "$STEP"
  rc=$?
  kill -0 "$STEP" 2>/dev/null || break  # wait returns early when the trap ran: wait again
done
rm -f "$MEGALIGN_STOP_FILE"

if [ "$rc" -eq 0 ]; then
  log "training finished"
  exit 0
fi
if [ -n "$PREEMPTED" ]; then
  log "training stopped with exit code $rc after USR1: requeueing job $SLURM_JOB_ID (it resumes from the latest checkpoint)"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
log "training failed with exit code $rc"
exit "$rc"
