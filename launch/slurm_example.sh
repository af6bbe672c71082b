#!/usr/bin/env bash
# Example sbatch script: the main job on 2 nodes x 8 GPUs. Adapt the #SBATCH lines to your cluster.
#   sbatch launch/slurm_example.sh configs/grpo_demo.yaml checkpoint.root=/shared/ckpts/run1
# srun starts one task per node; each runs launch/run.sh (torchrun) for its node's GPUs.
# The checkpoint root may be shared by all nodes or node-local (a path on each node's own disk):
# the job detects which at the first save and, when node-local, copies each node the files it
# lacks, so every node holds the full checkpoint.
#SBATCH --job-name=mcore_rl
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --output=%x-%j.out
set -euo pipefail
config="${1:?usage: sbatch launch/slurm_example.sh CONFIG [key.path=value ...]}"
shift
cd "${SLURM_SUBMIT_DIR:-$(dirname "$0")/..}"

# the first node of the allocation hosts torchrun's c10d rendezvous
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT="${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}"  # per job: two jobs on a node differ
NPROC="${SLURM_GPUS_ON_NODE:-8}"
export MASTER_ADDR MASTER_PORT NPROC
export NNODES="$SLURM_JOB_NUM_NODES"
export RDZV_ID="mcore_rl_${SLURM_JOB_ID}"

# NODE_RANK must be evaluated inside each task: SLURM_NODEID differs per node
srun --ntasks-per-node=1 --kill-on-bad-exit=1 bash -c \
  'NODE_RANK="$SLURM_NODEID" exec launch/run.sh "$NPROC" "$@"' _ "$config" "$@"
