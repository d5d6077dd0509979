#!/bin/bash
# One llmexp training run over several nodes: one SLURM task per node, each running torchrun for the
# node's GPUs; torchrun's c10d rendezvous is built from SLURM's variables (first node = master).
#
#   sbatch --nodes=4 --gpus-per-node=8 launch/sbatch_multinode.sh experiment=seed_llama2_7b
#   sbatch --nodes=2 launch/sbatch_multinode.sh model.name_or_path=/models/llama lr=2e-5
#
# Near the time limit (USR1, 180 s before) the trainer is asked to checkpoint (SIGTERM through
# torchrun); the job is then requeued and resumes from that checkpoint in the same run directory.
# Sweeps do not need this file: `python -m llmexp --multirun cluster=slurm ...` submits them.
#SBATCH --job-name=llmexp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=32
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@180
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=slurm-%j.out
set -euo pipefail

gpus_on_node() { if command -v nvidia-smi >/dev/null; then nvidia-smi -L | wc -l; else echo 0; fi; }
GPUS_PER_NODE=${SLURM_GPUS_ON_NODE:-$(gpus_on_node)}
GPUS_PER_NODE=$(( GPUS_PER_NODE > 0 ? GPUS_PER_NODE : 1 ))  # CPU-only nodes: one process each
MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$(( 20000 + SLURM_JOB_ID % 20000 ))
# Every rank and every requeued attempt writes the same run directory: outputs/slurm-<job id>.
export LLMEXP_RUN_ID=${LLMEXP_RUN_ID:-slurm-$SLURM_JOB_ID}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( ${SLURM_CPUS_PER_TASK:-$GPUS_PER_NODE} / GPUS_PER_NODE ))}
echo "llmexp: $SLURM_NNODES nodes x $GPUS_PER_NODE processes, rendezvous $MASTER_ADDR:$MASTER_PORT," \
     "run dir outputs/$LLMEXP_RUN_ID, attempt ${SLURM_RESTART_COUNT:-0}"

checkpoint_and_requeue() {
  echo "llmexp: time limit near: checkpointing, then requeueing job $SLURM_JOB_ID"
  scancel --signal=TERM "$SLURM_JOB_ID.0"  # to torchrun, which passes SIGTERM to every trainer process
  wait "$SRUN_PID" || true                  # the trainer saves at the next step and exits `preempted`
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
}
trap checkpoint_and_requeue USR1

srun --kill-on-bad-exit=1 --ntasks-per-node=1 \
  torchrun --nnodes="$SLURM_NNODES" --nproc-per-node="$GPUS_PER_NODE" \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID" \
    -m llmexp train.resume=auto "$@" &
SRUN_PID=$!
wait "$SRUN_PID"
