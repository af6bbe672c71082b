"""verl's asynchronous trainers on mcore_rl, on 2 CPU cores: ``python -m
verl.experimental.one_step_off_policy.main_ppo`` (the rollout of step k+1 overlaps the training
of step k) and ``python -m verl.experimental.fully_async_policy.fully_async_main`` (a rollouter
and a trainer on their own resources, bounded staleness, partial rollouts), with
model_engine=mcore_rl, rollout.name=mcore_rl and checkpoint_engine.backend=mcore_rl: the trainer
and the standalone rollout replica each on one fake GPU of one shared Ray head
(tests/verl/main_ppo_runner.py), a tiny llama with SmolLM2's chat tokenizer, arithmetic prompts,
fp32.

Per sample, the versions of the weights that generated it come from the rollout server
(``TokenOutput.extra_fields['global_steps']``, kept by verl as ``min/max_global_steps``) through
the reward (tests/verl/versioned_reward.py) into ``trainer.rollout_data_dir``; one-step-off's
trained batches (token ids, the rollout's log-probs) through ``data.custom_cls``
(tests/verl/recording_dataset.py).
"""
from __future__ import annotations

import math
import os

import pytest
import torch

pytest.importorskip("verl")

from tests.verl.main_ppo_runner import RayHead, launch  # noqa: E402
from tests.verl.ppo_fixtures import save_arithmetic_parquet, save_chat_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ONE_STEP_OFF = "verl.experimental.one_step_off_policy.main_ppo"
FULLY_ASYNC = "verl.experimental.fully_async_policy.fully_async_main"
T = 0.8
BOUND = 1e-4


@pytest.fixture(scope="module")
def head():
    with RayHead(num_cpus=32, num_gpus=2) as h:  # logical CPUs: each trainer, rollouter and TaskRunner actor asks for 10
        yield h


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("async")
    return {"model": save_chat_model(str(d / "model")), "train": save_arithmetic_parquet(str(d / "train.parquet"), 64),
            "val": save_arithmetic_parquet(str(d / "val.parquet"), 8, seed=1), "dir": str(d)}


def async_common(inputs: dict, response_length: int = 16) -> list[str]:
    """What both trainers share: mcore_rl everywhere, trainer and rollout on one (fake) GPU each,
    4 prompts x 4 samples, the versioned shaped reward."""
    return [
        "model_engine=mcore_rl", "actor_rollout_ref.rollout.name=mcore_rl",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=mcore_rl", "actor_rollout_ref.hybrid_engine=False",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.mcore_rl.dtype=float32",
        f"data.train_files={inputs['train']}", f"data.val_files={inputs['val']}", "data.train_batch_size=4",
        "data.max_prompt_length=64", f"data.max_response_length={response_length}", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={inputs['model']}", "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.dtype=float32",
        f"actor_rollout_ref.rollout.temperature={T}", "actor_rollout_ref.rollout.agent.num_workers=1",
        "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1",  # several buckets
        f"reward.custom_reward_function.path={HERE}/versioned_reward.py", "reward.custom_reward_function.name=compute_score",
        "reward.num_workers=1", "trainer.nnodes=1", "trainer.n_gpus_per_node=1", "rollout.nnodes=1",
        "rollout.n_gpus_per_node=1", "trainer.device=cpu", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
    ]


# ---- one-step-off -----------------------------------------------------------------------------
def one_step_off(inputs: dict, root: str, steps: int) -> list[str]:
    return [*async_common(inputs), f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
            f"trainer.default_local_dir={root}", f"data.custom_cls.path={HERE}/recording_dataset.py",
            "data.custom_cls.name=RecordingRLHFDataset"]


def trained_batches(directory: str) -> dict[int, list[dict]]:
    """recording_dataset.py's files: step -> the trained samples."""
    return {int(name.split(".")[0]): torch.load(os.path.join(directory, name))
            for name in os.listdir(directory) if name.endswith(".pt")}


def hf_weights(step_dir, role: str) -> dict:
    """The HF-named tensors of a saved role (the merge path: torch_dist read without megatron)."""
    from mcore_rl.conversion.merge import iter_hf_tensors, open_model_dir, plan_units

    model = open_model_dir(str(step_dir / role))
    units, dims = plan_units(model)
    return dict(iter_hf_tensors(model, units, dims))


def hf_model_at(model_dir: str, step_dir: str | None):
    """transformers' model of ``model_dir`` holding the actor's weights saved in ``step_dir``
    (``global_step_N``; None: the starting weights)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32)
    if step_dir is not None:
        from pathlib import Path

        missing, unexpected = model.load_state_dict(hf_weights(Path(step_dir), "actor"), strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)  # tied embeddings
    return model.eval()


def largest_log_prob_gap(model, samples: list[dict]) -> float:
    """max over samples and response tokens of |rollout log-prob - log_softmax(logits / T)| of
    ``model``."""
    gap = 0.0
    with torch.no_grad():
        for s in samples:
            ids = torch.tensor([s["prompt"] + s["response"]])
            logits = model(ids).logits[0].float()[len(s["prompt"]) - 1:-1] / T
            mine = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s["response"])[:, None])[:, 0]
            gap = max(gap, float((mine - s["rollout_log_probs"]).abs().max()))
    return gap


def generated_by(root: str, step: int) -> str | None:
    """Where the weights one-step-off generates step ``step``'s batch with are saved: the actor's
    weights at the start of step - 1, i.e. after step - 2 (the starting weights for steps 1, 2)."""
    return None if step <= 2 else os.path.join(root, f"global_step_{step - 2}")


def assert_one_step_off(run, inputs: dict, root: str, steps: int) -> None:
    """Every sample of step s: reported by the server as generated by the weights synced at step
    s - 1 (version s - 1; the sync before the first step is version 0), and its rollout
    log-probs equal to those of the actor's weights after step s - 2 within ``BOUND``."""
    assert run.returncode == 0, run.tail()
    assert sorted(run.metrics) == list(range(1, steps + 1)), run.tail()
    for step in range(1, steps + 1):
        rows = run.generations[step]
        versions = {(r["min_global_steps"], r["max_global_steps"]) for r in rows}
        assert versions == {(step - 1, step - 1)}, f"step {step}: versions {versions}"
        assert math.isfinite(run.metrics[step]["actor/grad_norm"]) and run.metrics[step]["actor/grad_norm"] > 0
    batches = trained_batches(os.path.join(root, "batches"))
    assert sorted(batches) == list(range(1, steps + 1))
    for step, samples in batches.items():
        assert {(s["min_global_steps"], s["max_global_steps"]) for s in samples} == {(step - 1, step - 1)}
        gap = largest_log_prob_gap(hf_model_at(inputs["model"], generated_by(root, step)), samples)
        assert gap <= BOUND, f"step {step}: rollout log-probs differ from the previous step's weights by {gap:.2e}"


def test_one_step_off_grpo_trains_each_step_on_the_previous_steps_weights(head, inputs, tmp_path):
    root = str(tmp_path / "ckpt")
    run = launch(head, str(tmp_path / "run"), one_step_off(inputs, root, 3), module=ONE_STEP_OFF,
                 job_env={"MCORE_RL_TEST_BATCHES": os.path.join(root, "batches")})
    assert_one_step_off(run, inputs, root, 3)
    # the check discriminates: step 3's samples are not those of the starting weights
    step3 = trained_batches(os.path.join(root, "batches"))[3]
    assert largest_log_prob_gap(hf_model_at(inputs["model"], None), step3) > 100 * BOUND


def test_one_step_off_control_without_weight_sync_fails_the_check(head, inputs, tmp_path):
    """The rollout keeps its starting weights (loaded from the same HF directory): the versions
    advance as before, but step 3's samples are not those of the weights after step 1."""
    root = str(tmp_path / "ckpt")
    run = launch(head, str(tmp_path / "run"), [
        *one_step_off(inputs, root, 3), "actor_rollout_ref.rollout.load_format=auto",
        "+actor_rollout_ref.rollout.engine_kwargs.mcore_rl.weight_sync=False"], module=ONE_STEP_OFF,
        job_env={"MCORE_RL_TEST_BATCHES": os.path.join(root, "batches")})
    with pytest.raises(AssertionError, match="step 3: rollout log-probs differ"):
        assert_one_step_off(run, inputs, root, 3)


# ---- fully-async ------------------------------------------------------------------------------
# 4 prompts x 4 samples per trainer step (one mini-batch), a sync after every step, 3 steps: the
# rollouter feeds 12 prompts. The trainer's workers are built before it knows the step count:
# the LR schedule's is given.
def fully_async(inputs: dict, root: str, staleness: int, steps: int = 3, response_length: int = 16) -> list[str]:
    return [*async_common(inputs, response_length), "data.train_batch_size=0", "data.gen_batch_size=1",
            f"rollout.total_rollout_steps={4 * steps}", f"actor_rollout_ref.actor.optim.total_training_steps={steps}",
            f"async_training.staleness_threshold={staleness}", "async_training.trigger_parameter_sync_step=1",
            "async_training.require_batches=1", "async_training.partial_rollout=True", "trainer.save_freq=1",
            f"trainer.default_local_dir={root}"]


def ages_per_step(run, resumed: bool = False) -> dict[int, list[tuple[int, int]]]:
    """Per dumped step, per GRPO group (one prompt's samples): (the version the trainer trained it
    with - the version that completed the group, that version - the oldest version that generated
    part of it). With a sync after every step, step s trains version s - 1; verl 0.9.1 numbers a
    resumed run's steps one higher (its load_checkpoint sets global_steps to version + 1, then
    fit() adds 1): there step s trains version s - 2."""
    out = {}
    for step, rows in run.generations.items():
        assert all(r["index"] >= 0 and 0 <= r["min_global_steps"] <= r["max_global_steps"] for r in rows), rows
        trained, groups = step - 1 - int(resumed), {}
        for r in rows:
            groups.setdefault(r["index"], []).append(r)
        out[step] = [(trained - max(r["max_global_steps"] for r in g), trained - min(r["min_global_steps"] for r in g))
                     for g in groups.values()]
    return out


def oldest_per_step(run, staleness: int, resumed: bool = False) -> dict[int, tuple[int, int]]:
    """verl's bound: a group enters the rollouter's FIFO queue when its last sample completes, with
    at most (staleness + 1) steps' worth of prompts queued or in flight, so it is trained at most
    ``staleness`` versions after the version that completed it. Checked per group; returns per
    step the oldest (completed-at age, oldest-token age). A partial rollout's first tokens can be
    older (verl's bound counts prompts, not tokens; its own metrics call this the worst case)."""
    per_step = ages_per_step(run, resumed)
    assert all(len(groups) == 4 for groups in per_step.values()), {s: len(g) for s, g in per_step.items()}
    oldest = {step: (max(a for a, _ in groups), max(b for _, b in groups)) for step, groups in per_step.items()}
    assert all(0 <= a <= staleness and a <= b for a, b in oldest.values()), f"staleness bound {staleness}: {oldest}"
    print(f"staleness bound {staleness}: per step (completed-at age, oldest-token age) {oldest}")
    return oldest


def test_fully_async_at_staleness_2_trains_no_older_sample(head, inputs, tmp_path):
    """4 steps, 16 prompts: the rollouter may run 12 ahead, so the last 4 start after the first
    sync and, 64 tokens long (the tiny model rarely ends one early) and generated one at a time
    (``full_determinism``), are still being generated at the next: aborted there and resumed on
    the new weights (partial rollouts: two or more versions per sample), they complete and are
    trained."""
    run = launch(head, str(tmp_path / "run"), [*fully_async(inputs, str(tmp_path / "ckpt"), 2, steps=4, response_length=64),
                                               "actor_rollout_ref.rollout.full_determinism=True"], module=FULLY_ASYNC)
    assert run.returncode == 0, run.tail()
    assert sorted(run.generations) == [1, 2, 3, 4], run.tail()
    oldest_per_step(run, 2)
    partial = [r for rows in run.generations.values() for r in rows if r["max_global_steps"] > r["min_global_steps"]]
    assert partial, "no sample was generated across a sync"
    assert all(r["output"] for r in partial), partial


# the trainer's actor dies in the middle of its 2nd save (step 2's weights, before the tracker)
KILL = {"MCORE_RL_CKPT_FAULT": "shards", "MCORE_RL_CKPT_FAULT_AT": "2"}


def test_fully_async_at_staleness_1_killed_in_step_2_resumes(head, inputs, tmp_path):
    """Staleness bound 1 over a run killed in step 2's checkpoint and its rerun: the tracker
    names step 1, whose checkpoint holds both parts (the trainer's actor, the rollouter's
    dataloader); the rerun resumes from it (steps 2 and 3), its rollout on the resumed weights."""
    root = tmp_path / "ckpt"
    killed = launch(head, str(tmp_path / "killed"), fully_async(inputs, str(root), 1), module=FULLY_ASYNC,
                    job_env=KILL)
    assert killed.returncode != 0, killed.tail()
    assert (root / "latest_checkpointed_iteration.txt").is_file(), killed.tail()  # the run's output when it is not
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "1", killed.tail()
    assert {"actor", "data.pt", "COMPLETE"} <= set(os.listdir(root / "global_step_1")), os.listdir(root / "global_step_1")
    assert 1 in killed.generations and 3 not in killed.generations, sorted(killed.generations)
    oldest_per_step(killed, 1)

    resumed = launch(head, str(tmp_path / "resumed"), fully_async(inputs, str(root), 1), module=FULLY_ASYNC)
    assert resumed.returncode == 0, resumed.tail()
    assert sorted(resumed.generations) == [3, 4], resumed.tail()  # versions 1 and 2 trained (verl's numbering)
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    assert {"actor", "data.pt"} <= set(os.listdir(root / "global_step_3"))
    oldest_per_step(resumed, 1, resumed=True)
    # the rerun's rollout starts on the checkpoint's weights (version 1), never the starting ones
    assert min(r["min_global_steps"] for r in resumed.generations[3]) == 1, resumed.generations[3]
