#!/usr/bin/env bash
# GRPO on SmolLM2-135M-Instruct (make prepare-smollm2) with verl's own RL trainer on CPU:
# `python -m verl.trainer.main_ppo` (Ray, verl's default v1 trainer), the actor on mcore_rl
# (model_engine=mcore_rl, 2 processes, data-parallel), the rollout on mcore_rl's CPU server
# (rollout.name=mcore_rl, one replica per process), the arithmetic task with an exact-match reward
# (the main job's configs/grpo_smollm2.yaml, as verl keys). Extra arguments are Hydra overrides.
#   launch/verl/grpo_smollm2.sh [trainer.total_training_steps=24 ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv-verl/bin/python}
MODEL=${MCORE_RL_CACHE:-$HOME/.cache/mcore_rl}/smollm2/hf
OUT=${OUT:-outputs/verl_grpo_smollm2}
[ -f "$MODEL/config.json" ] || { echo "no SmolLM2 in $MODEL: run make prepare-smollm2" >&2; exit 2; }
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} TOKENIZERS_PARALLELISM=false WANDB_MODE=disabled \
  VERL_FILE_LOGGER_PATH=$(realpath -m "$OUT")/metrics.jsonl  # one JSON line of metrics per step
mkdir -p "$OUT"
$PY launch/verl/arithmetic_data.py --out "$OUT/data"
exec $PY -m verl.trainer.main_ppo hydra.searchpath=[pkg://mcore_rl.integrations.verl.hydra] \
  model_engine=mcore_rl algorithm.adv_estimator=grpo \
  data.train_files="$OUT/data/train.parquet" data.val_files="$OUT/data/val.parquet" \
  data.train_batch_size=8 data.max_prompt_length=64 data.max_response_length=16 data.dataloader_num_workers=0 \
  actor_rollout_ref.model.path="$MODEL" actor_rollout_ref.model.enable_gradient_checkpointing=False \
  actor_rollout_ref.actor.mcore_rl.dtype=float32 actor_rollout_ref.actor.optim.lr=1e-5 \
  actor_rollout_ref.actor.optim.lr_warmup_steps=2 actor_rollout_ref.actor.clip_ratio_low=0.2 \
  actor_rollout_ref.actor.clip_ratio_high=0.28 actor_rollout_ref.actor.loss_agg_mode=token-mean \
  actor_rollout_ref.actor.ppo_mini_batch_size=2 actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.rollout.name=mcore_rl actor_rollout_ref.rollout.n=8 actor_rollout_ref.rollout.temperature=1.0 \
  actor_rollout_ref.rollout.tensor_model_parallel_size=1 actor_rollout_ref.rollout.dtype=float32 \
  actor_rollout_ref.rollout.calculate_log_probs=True actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
  actor_rollout_ref.rollout.agent.num_workers=1 +actor_rollout_ref.rollout.engine_kwargs.mcore_rl.num_threads=1 \
  reward.custom_reward_function.path=launch/verl/arithmetic_reward.py reward.num_workers=1 \
  trainer.n_gpus_per_node=2 trainer.nnodes=1 trainer.device=cpu trainer.logger=[console,file] \
  trainer.total_training_steps=24 trainer.val_before_train=True trainer.test_freq=24 trainer.save_freq=-1 \
  trainer.default_local_dir="$OUT/checkpoints" trainer.project_name=verl_grpo_smollm2 trainer.experiment_name=run \
  +ray_kwargs.ray_init.num_gpus=2 ray_kwargs.ray_init.num_cpus=8 \
  transfer_queue.backend.SimpleStorage.num_data_storage_units=1 "$@"
