"""verl's own RL entry point, ``python -m verl.trainer.main_ppo`` (Ray, verl's default v1 trainer),
trains with mcore_rl on 2 CPU cores: the actor, reference and critic on mcore_rl engines, the
rollout on mcore_rl's CPU rollout backend (rollout.name=mcore_rl), a tiny llama with SmolLM2's
chat tokenizer, arithmetic prompts and a shaped rule reward (tests/verl/arithmetic_reward.py).

Launches share one Ray head (tests/verl/main_ppo_runner.py). What each asserts:
- GRPO at TP=2, written as a verl Megatron script (MEGATRON_SCRIPT: only model_engine,
  rollout.name and the search path change): non-zero grad norm at every step, and verl's
  rollout-vs-trainer mismatch metrics within 1e-4 at every step; a control launch without weight
  sync exceeds that bound (the policy moves by far more than 1e-4 per step).
- PPO with a critic (GAE): see test_ppo_* below.
"""
from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("verl")

from tests.verl.main_ppo_runner import RayHead, launch  # noqa: E402
from tests.verl.ppo_fixtures import REWARD_FILE, save_arithmetic_parquet, save_chat_model  # noqa: E402

MISMATCH = ("training/rollout_probs_diff_max", "rollout_corr/log_ppl_diff_max", "rollout_corr/log_ppl_diff_min",
            "rollout_corr/kl")
BOUND = 1e-4


@pytest.fixture(scope="module")
def head():
    with RayHead() as h:
        yield h


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("main_ppo")
    return {"model": save_chat_model(str(d / "model")), "train": save_arithmetic_parquet(str(d / "train.parquet"), 64),
            "val": save_arithmetic_parquet(str(d / "val.parquet"), 8, seed=1), "dir": str(d)}


def common(inputs: dict, steps: int) -> list[str]:
    """What every launch here shares: data, the shaped reward, CPU-sized trainer settings."""
    return [
        f"data.train_files={inputs['train']}", f"data.val_files={inputs['val']}", "data.train_batch_size=8",
        "data.max_prompt_length=64", "data.max_response_length=16", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={inputs['model']}", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.calculate_log_probs=True", "actor_rollout_ref.rollout.temperature=0.8",
        "actor_rollout_ref.rollout.agent.num_workers=1", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        f"reward.custom_reward_function.path={REWARD_FILE}", "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1", "trainer.n_gpus_per_node=2", "trainer.nnodes=1", "trainer.device=cpu",
        "trainer.val_before_train=False", "trainer.test_freq=-1", f"trainer.total_training_steps={steps}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


# A main_ppo command for verl's own Megatron engine (GRPO, actor and reference at TP=2, fp32), as
# its users write it; the keys under *.megatron.* are the ones mcore_rl reads.
MEGATRON_SCRIPT = [
    "model_engine=megatron", "actor_rollout_ref.rollout.name=vllm", "algorithm.adv_estimator=grpo",
    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.use_kl_loss=True",
    "actor_rollout_ref.actor.kl_loss_coef=0.01", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=1", "actor_rollout_ref.actor.megatron.dtype=float32",
    "actor_rollout_ref.actor.megatron.use_distributed_optimizer=True", "actor_rollout_ref.actor.megatron.seed=11",
    "actor_rollout_ref.actor.megatron.use_mbridge=True", "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=1",
]
MIGRATION = {"model_engine=megatron": "model_engine=mcore_rl", "actor_rollout_ref.rollout.name=vllm":
             "actor_rollout_ref.rollout.name=mcore_rl"}  # plus the search path (the runner adds it)


def migrated(script: list[str]) -> list[str]:
    out = [MIGRATION.get(o, o) for o in script]
    assert sum(a != b for a, b in zip(script, out)) == len(MIGRATION)
    return out


def assert_every_step_trains_on_policy(run, steps: int) -> None:
    assert run.returncode == 0, run.tail()
    assert sorted(run.metrics) == list(range(1, steps + 1)), run.tail()
    for step, m in run.metrics.items():
        assert math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0, (step, m["actor/grad_norm"])
        for key in MISMATCH:
            assert abs(m[key]) <= BOUND, f"step {step}: {key}={m[key]} exceeds {BOUND}"


def test_grpo_from_a_verl_megatron_script_at_tp2_stays_on_policy(head, inputs, tmp_path):
    run = launch(head, str(tmp_path), [*migrated(MEGATRON_SCRIPT), *common(inputs, 3), "trainer.save_freq=3",
                                        f"trainer.default_local_dir={tmp_path / 'ckpt'}"])
    assert_every_step_trains_on_policy(run, 3)
    assert all(len(run.generations[s]) == 32 for s in (1, 2, 3))  # 8 prompts x 4 samples per step
    with open(tmp_path / "ckpt" / "global_step_3" / "actor" / "mcore_rl.json") as f:
        layout = json.load(f)["layout"]
    assert (layout["tp"], layout["pp"]) == (2, 1), layout  # the megatron.* keys reached the engine
    scores = [sum(g["score"] for g in run.generations[s]) / 32 for s in (1, 2, 3)]
    assert len(set(scores)) == 3 and all(0 < s < 1 for s in scores), scores  # shaped: partial credit varies


def test_control_without_weight_sync_exceeds_the_bound(head, inputs, tmp_path):
    """The rollout keeps the starting weights (loaded from the same HF directory): step 1 agrees,
    step 2 measures how far one update moved the policy — far beyond the bound above."""
    run = launch(head, str(tmp_path), [
        "model_engine=mcore_rl", "actor_rollout_ref.rollout.name=mcore_rl", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.mcore_rl.dtype=float32", *common(inputs, 2),
        "trainer.save_freq=-1", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        "actor_rollout_ref.rollout.load_format=auto", "+actor_rollout_ref.rollout.engine_kwargs.mcore_rl.weight_sync=False"])
    assert run.returncode == 0, run.tail()
    first, second = run.metrics[1], run.metrics[2]
    assert all(abs(first[k]) <= BOUND for k in MISMATCH), first
    assert second["rollout_corr/log_ppl_diff_max"] > 100 * BOUND and second["rollout_corr/kl"] > 100 * BOUND, second
