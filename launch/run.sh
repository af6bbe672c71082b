#!/usr/bin/env bash
# torchrun launcher for the main job: launch/run.sh NPROC CONFIG [key.path=value ...]
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
exec "$bin/torchrun" --standalone --nproc_per_node="$nproc" launch/train.py --config "$config" "$@"
