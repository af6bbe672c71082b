"""verl's own RL entry point, ``python -m verl.trainer.main_ppo`` (Ray, verl's default v1 trainer),
trains with mcore_rl on 2 CPU cores: the actor, reference and critic on mcore_rl engines, the
rollout on mcore_rl's CPU rollout backend (rollout.name=mcore_rl), a tiny llama with SmolLM2's
chat tokenizer, arithmetic prompts and a shaped rule reward (tests/verl/arithmetic_reward.py).

Launches share one Ray head (tests/verl/main_ppo_runner.py). What each asserts:
- GRPO at TP=2, written as a verl Megatron script (MEGATRON_SCRIPT: only model_engine,
  rollout.name and the search path change): non-zero grad norm at every step, and verl's
  rollout-vs-trainer mismatch metrics within 1e-4 at every step; a control launch without weight
  sync exceeds that bound (the policy moves by far more than 1e-4 per step). Its last step is
  saved with ``hf_model``: the actor's HF weights exported in the background into
  ``global_step_2/actor/model/huggingface/`` (the last save waits for them), equal to
  ``mcore_to_hf.py merge`` of the part, transformers' log-probs from them equal to those of
  mcore_rl's engine loaded from the part (fp32).
- GRPO with LoRA (verl's Megatron keys ``model.lora.*`` added to that script, merged weight
  sync) and PPO with a LoRA actor (adapter-only sync) and a LoRA critic (GAE): see the tests.
"""
from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("verl")

from tests.verl.export_checks import assert_exported, engine_log_prob_gap  # noqa: E402
from tests.verl.lora_checks import assert_adapter_only, base_mismatches, same_trained_tensors  # noqa: E402
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
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1",  # several buckets
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
    run = launch(head, str(tmp_path), [*migrated(MEGATRON_SCRIPT), *common(inputs, 2), "trainer.save_freq=2",
                                        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
                                        f"trainer.default_local_dir={tmp_path / 'ckpt'}"])
    assert_every_step_trains_on_policy(run, 2)  # step 2 samples from the weights synced after step 1
    assert all(len(run.generations[s]) == 32 for s in (1, 2))  # 8 prompts x 4 samples per step
    with open(tmp_path / "ckpt" / "global_step_2" / "actor" / "mcore_rl.json") as f:
        layout = json.load(f)["layout"]
    assert (layout["tp"], layout["pp"]) == (2, 1), layout  # the megatron.* keys reached the engine
    actor = str(tmp_path / "ckpt" / "global_step_2" / "actor")
    assert_exported(actor, 2)  # the TP=2 part's HF weights, as merge writes them
    gap = engine_log_prob_gap(actor)
    assert gap["gap"] <= 1e-5 and gap["tokens"] > 50, gap
    scores = [sum(g["score"] for g in run.generations[s]) / 32 for s in (1, 2)]
    assert len(set(scores)) == 2 and all(0 < s < 1 for s in scores), scores  # shaped: partial credit varies


# LoRA on the policy (verl's Megatron keys; verl then computes the reference in the actor with the
# adapters disabled, ``ref_in_actor``) with the KL loss that reads that reference; adapter-only
# steps (the GRPO launch's saved with ``hf_model``: the merged export, checked below)
LORA = ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.alpha=16",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.01"]
LORA_CRITIC = ["critic.model.lora.rank=8", "critic.model.lora.alpha=16"]
BASE_TENSORS = 38  # HF tensors of the tiny llama's trunk: embedding, 4 x 9 per layer, final norm


def assert_reference_is_the_base(run) -> None:
    """verl's KL loss compares the policy with the reference. Step 1: the adapters start with
    B = 0, so the policy is the base and the loss is 0 exactly; later steps: the policy has moved
    from the base and the loss exceeds the rounding bound (a reference computed with the adapters
    on is the policy itself: 0 up to rounding; 1.5e-2 to 7.5e-2 here)."""
    assert run.metrics[1]["actor/kl_loss"] == 0.0, run.metrics[1]["actor/kl_loss"]
    for step in sorted(run.metrics)[1:]:
        assert run.metrics[step]["actor/kl_loss"] > BOUND, (step, run.metrics[step]["actor/kl_loss"])


def assert_merged_export(role_dir: str, step: int, base_dir: str) -> None:
    """An adapter-only step whose background HF export is complete (as ``merge`` writes it) and
    holds, in every base tensor, the base on disk plus ``s B A`` of the step's saved factors."""
    assert_adapter_only(role_dir)
    assert_exported(role_dir, step)
    compared, differ = base_mismatches(role_dir, base_dir)
    assert compared == BASE_TENSORS and not differ, f"{role_dir}: export is not base + s B A in {differ}"


def test_grpo_with_lora_and_merged_sync_at_tp2_trains_adapters_only(head, inputs, tmp_path):
    """The Megatron script plus verl's LoRA keys, ``lora.merge=True``: the rollout gets the
    merged weights ``W + s B A`` at every sync; the last step saved with ``hf_model`` (the
    trainer's last save waits for its background export)."""
    run = launch(head, str(tmp_path), [*migrated(MEGATRON_SCRIPT), *LORA, "actor_rollout_ref.model.lora.merge=True",
                                        *common(inputs, 2), "trainer.save_freq=2",
                                        "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
                                        f"trainer.default_local_dir={tmp_path / 'ckpt'}"])
    assert_every_step_trains_on_policy(run, 2)
    assert_reference_is_the_base(run)
    actor = tmp_path / "ckpt" / "global_step_2" / "actor"
    with open(actor / "mcore_rl.json") as f:
        assert json.load(f)["layout"]["tp"] == 2  # sharded adapters, merged per shard
    assert_merged_export(str(actor), 2, inputs["model"])


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


# ---- PPO with a LoRA actor and a LoRA critic: checkpoint every step, a kill during step 3, the resume ---
def ppo(inputs: dict, root: str) -> list[str]:
    """GAE with a critic; the actor's adapters reach the rollout unmerged (``lora.merge=False``,
    verl's default: the base once per process, then the adapter factors only)."""
    return [*LORA, *LORA_CRITIC, "model_engine=mcore_rl", "actor_rollout_ref.rollout.name=mcore_rl",
            "algorithm.adv_estimator=gae", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.mcore_rl.dtype=float32", f"critic.model.path={inputs['model']}",
            "critic.model.enable_gradient_checkpointing=False",
            "critic.ppo_micro_batch_size_per_gpu=8", "critic.mcore_rl.dtype=float32", "critic.optim.lr=1e-3",
            *common(inputs, 3),
            "actor_rollout_ref.rollout.full_determinism=True", "data.seed=7", "trainer.save_freq=1",
            "trainer.max_actor_ckpt_to_keep=2", "trainer.max_critic_ckpt_to_keep=1",
            f"trainer.default_local_dir={root}"]


# verl's colocated worker saves the actor, then the critic, in one process: the 6th save is step
# 3's critic; both ranks die in the middle of it (after the actor's part of step 3 is written)
KILL = {"MCORE_RL_CKPT_FAULT": "shards", "MCORE_RL_CKPT_FAULT_AT": "6"}


def listing(root) -> dict[str, list[str]]:
    return {name: sorted(os.listdir(os.path.join(root, name))) for name in sorted(os.listdir(root))
            if name.startswith("global_step_")}


def test_ppo_with_lora_actor_and_critic_killed_during_step_3_resumes_both_roles(head, inputs, tmp_path):
    straight = launch(head, str(tmp_path / "straight"), ppo(inputs, str(tmp_path / "a")))
    assert_every_step_trains_on_policy(straight, 3)
    assert_reference_is_the_base(straight)
    for step, m in straight.metrics.items():
        assert m["critic/grad_norm"] > 0 and math.isfinite(m["critic/vf_loss"]), (step, m)
    for role in ("actor", "critic"):
        assert_adapter_only(str(tmp_path / "a" / "global_step_3" / role))

    root = tmp_path / "b"
    killed = launch(head, str(tmp_path / "killed"), ppo(inputs, str(root)), job_env=KILL)
    assert killed.returncode != 0 and sorted(killed.metrics) == [1, 2], killed.tail()
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    on_disk = listing(root)
    assert "critic" not in on_disk["global_step_1"]  # max_critic_ckpt_to_keep=1
    assert {"actor", "critic", "data.pt", "COMPLETE"} <= set(on_disk["global_step_2"])  # sealed at step 3's save
    assert "critic" not in on_disk["global_step_3"] or not (root / "global_step_3" / "critic" / "PART").exists()

    resumed = launch(head, str(tmp_path / "resumed"), ppo(inputs, str(root)))
    assert resumed.returncode == 0, resumed.tail()
    assert sorted(resumed.metrics) == [3]  # resumed at step 3 from step 2, both roles
    compare_resumed_step(straight, killed, resumed, 3, tmp_path / "a", root)
    for role in ("actor", "critic"):
        assert_adapter_only(str(root / "global_step_3" / role))


# Metrics that do not depend on the order of the batch's rows or on float rounding.
EXACT = ("critic/score/max", "critic/score/min", "critic/rewards/max", "critic/rewards/min", "response_length/",
         "prompt_length/", "response/aborted_ratio", "training/global_step", "training/epoch")
WALL_CLOCK = ("timing_", "perf/", "time_per", "throughput", "mfu")  # time and memory of this machine


def agree(a: dict, b: dict, where: str) -> None:
    """Metrics of two runs at one step: the order-free ones exactly, the rest to rounding. verl's
    v1 replay buffer materializes a step's batch in TransferQueue insertion order, i.e. in the
    order rollouts complete (timing), so two runs sum the same rows in another order: sums and
    means differ by float rounding (~1e-7 relative); quantities that are themselves rounding
    (the rollout_corr metrics of an on-policy run, a zero-mean advantage: ~1e-7..1e-6) by about
    their size: relative 1e-5, absolute 1e-5."""
    keys = [k for k in a if not any(w in k for w in WALL_CLOCK)]
    assert set(keys) == {k for k in b if not any(w in k for w in WALL_CLOCK)}, where
    for k in keys:
        if k.startswith(EXACT):
            assert a[k] == b[k], f"{where}: {k} {a[k]} != {b[k]}"
        else:
            assert abs(a[k] - b[k]) <= max(1e-5 * max(abs(a[k]), abs(b[k])), 1e-5), f"{where}: {k} {a[k]} vs {b[k]}"


def samples(run, step: int) -> list[tuple]:
    return sorted((g["input"], g["output"], g["score"]) for g in run.generations[step])


def same_weights(a_step, b_step, where: str) -> None:
    """Both roles' trained tensors (adapters, the critic's value head) agree but for Adam's
    amplified rounding: a row order changes a gradient by rounding, and Adam turns rounding in
    near-zero gradients into visible steps for a few elements (the uninterrupted pair below shows
    it). A step from a wrong optimizer state or LR moves most elements by ~lr (1e-3 here)."""
    for role in ("actor", "critic"):
        same_trained_tensors(str(a_step / role), str(b_step / role), f"{where}, {role}")


def compare_resumed_step(straight, killed, resumed, step: int, a_root, b_root) -> None:
    """The killed run's completed steps and the resumed step against the uninterrupted run:
    the same samples (exactly), the same metrics (see ``agree``), and after the resumed step's
    update (it uses the restored Adam state) the same weights of both roles, as close as two
    uninterrupted runs' weights are (step ``step - 1`` of the straight and the killed run)."""
    for s in range(1, step):
        assert samples(killed, s) == samples(straight, s), f"step {s}"
        agree(killed.metrics[s], straight.metrics[s], f"killed run, step {s}")
    assert samples(resumed, step) == samples(straight, step), f"resumed step {step}: other samples"
    agree(resumed.metrics[step], straight.metrics[step], f"resumed step {step}")
    same_weights(a_root / f"global_step_{step - 1}", b_root / f"global_step_{step - 1}", "two uninterrupted runs")
    same_weights(a_root / f"global_step_{step}", b_root / f"global_step_{step}", f"after the resumed step {step}")
