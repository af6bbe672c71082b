#!/usr/bin/env bash
# torchrun launcher for the main job: launch/run.sh NPROC CONFIG [key.path=value ...]
# NPROC is the number of processes on THIS node.
# Single node (default): torchrun --standalone.
# Multi-node: set NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT on every node (all four, same
# MASTER_ADDR:MASTER_PORT everywhere); nodes meet through torchrun's c10d rendezvous there.
# RDZV_ID (optional) names the job's rendezvous (default mcore_rl). launch/slurm_example.sh
# derives the four from SLURM's variables.
# Uses .venv/bin if present (what `make install` creates), else the current python.
set -euo pipefail
cd "$(dirname "$0")/.."
nproc="${1:?usage: launch/run.sh NPROC CONFIG [overrides]}"
config="${2:?usage: launch/run.sh NPROC CONFIG [overrides]}"
shift 2
bin=".venv/bin"
[ -x "$bin/torchrun" ] || bin="$(dirname "$(command -v python3)")"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# megatron's TP overlap orders kernels on one CUDA connection (it warns without this)
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"

multi=(NNODES NODE_RANK MASTER_ADDR MASTER_PORT)
set_count=0
missing=()
for name in "${multi[@]}"; do
  if [ -n "${!name:-}" ]; then set_count=$((set_count + 1)); else missing+=("$name"); fi
done
if [ "$set_count" -ne 0 ] && [ "$set_count" -ne "${#multi[@]}" ]; then
  echo "launch/run.sh: multi-node launch needs NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT;" \
    "missing: ${missing[*]} (set all four, or none for a single node)" >&2
  exit 2
fi

# a config mistake is one error line and exit code 2 here, before torchrun starts the ranks
# (after the multi-node variables, which need no Python);
# launch/torchrun_job.py is torchrun that ends a refusal in the ranks (a checkpoint it will not
# load, ...) the same way: one error line, exit code 2
"$bin/python" launch/train.py --check --config "$config" "$@" || exit $?

if [ "$set_count" -eq 0 ]; then
  exec "$bin/python" launch/torchrun_job.py --standalone --nproc_per_node="$nproc" \
    launch/train.py --config "$config" "$@"
fi
echo "launch/run.sh: node ${NODE_RANK} of ${NNODES}, ${nproc} process(es) here," \
  "rendezvous ${MASTER_ADDR}:${MASTER_PORT}" >&2
# GROUP_RANK/LOCAL_RANK set by torchrun identify the node for checkpoint storage (not host names)
exec "$bin/python" launch/torchrun_job.py --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$nproc" \
  --rdzv_backend=c10d --rdzv_endpoint="${MASTER_ADDR}:${MASTER_PORT}" \
  --rdzv_id="${RDZV_ID:-mcore_rl}" --max_restarts=0 \
  launch/train.py --config "$config" "$@"
