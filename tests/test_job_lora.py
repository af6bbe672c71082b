"""The main job with LoRA (``actor.lora.*``, ``critic.lora.*``): two PPO steps of the tiny llama at
TP=2 with a KL loss and the transformers rollout engine. The base weights of actor and critic
stay bit-identical while their adapters (and the critic's new value head) train; no reference
model is built (the actor's frozen base, adapters off, is the reference: KL 0 while B = 0, > 0
after an update); the rollout engine takes merged weights (its log-probs equal the trainer's
after an update). The LoRA keys' errors name the key."""
from __future__ import annotations

import os
import re

import pytest
import torch

from mcore_rl.config_loader import ConfigError
from mcore_rl.job.schema import JobConfig, load_job_config
from tests.dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOUND = 1e-4  # max |rollout log-prob - trainer log-prob| of a synced engine (fp32), as test_rollout_sync
RANKS = {"actor": 8, "critic": 4}
LORA = ["actor.lora.rank=8", "actor.lora.alpha=16", "critic.lora.rank=4", "critic.lora.alpha=8",
        "actor.use_kl_loss=true", "actor.kl_loss_coeff=0.1", "rollout.engine=transformers",
        "actor_optim.lr=1.0e-2", "critic_optim.lr=1.0e-2", "actor_optim.warmup_steps=0",
        "critic_optim.warmup_steps=0"]


def _config(tmp_path, *overrides: str) -> JobConfig:
    path = os.path.join(ROOT, "configs", "ppo_demo.yaml")
    return load_job_config(path, [f"output_dir={tmp_path}", "progress_bar=false", "rollout.prompts_per_step=8",
                                  *overrides])


def _params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for c in engine.model for n, p in c.named_parameters()}


def _train(cfg: JobConfig, steps: int) -> dict:
    """The job's models, ``steps`` job steps; the parameters before and after, the metrics."""
    from mcore_rl.job.loop import build, setup_rollout, train_step
    from mcore_rl.platform import active_platform

    actor, critic = build(cfg, active_platform())
    task, rollouts = setup_rollout(cfg, actor)
    before = {"actor": _params(actor.engine), "critic": _params(critic.engine)}
    history = [train_step(cfg, actor, critic, task, rollouts, step) for step in range(steps)]
    after = {"actor": _params(actor.engine), "critic": _params(critic.engine)}
    return {"history": history, "before": before, "after": after, "ref_built": actor.ref is not None}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    cfg = _config(tmp_path_factory.mktemp("lora"), "steps=2", *LORA)
    return run_ranks(2, _train, cfg, 2)


def test_base_frozen_adapters_and_value_head_train(lora_run):
    for rank in lora_run:
        for role in ("actor", "critic"):
            before, after = rank["before"][role], rank["after"][role]
            adapters = [n for n in before if ".lora." in n]
            assert len(adapters) == 2 * 4 * 2, (role, adapters)  # A and B of 4 linears in 2 layers
            ranks = {before[n].shape[0] for n in adapters if n.endswith(".lora.A")}  # A: [rank, in]
            assert ranks == {RANKS[role]}, (role, ranks)
            moved = sorted(n for n in before if not torch.equal(before[n], after[n]))
            head = [n for n in before if n.startswith("module.output_layer.")] if role == "critic" else []
            assert moved == sorted(adapters + head), (role, moved)


def test_reference_is_the_frozen_base_and_no_second_model(lora_run):
    history = lora_run[0]["history"]
    assert not any(r["ref_built"] for r in lora_run)  # the reference costs no memory
    assert history[0]["kl_to_ref"] == 0.0  # B = 0: the adapters add nothing yet
    assert history[1]["kl_to_ref"] != 0.0 and history[1]["actor/kl_loss"] > 0.0


def test_rollout_engine_takes_merged_weights(lora_run):
    for m in lora_run[0]["history"]:  # step 1 samples from the weights synced after step 0's update
        print(f"rollout vs trainer: max |diff| {m['rollout_corr/max_abs_log_prob_diff']:.2e}")
        assert m["rollout_corr/max_abs_log_prob_diff"] <= BOUND, m


@pytest.mark.parametrize("overrides, message", [
    (["actor.lora.rnk=8"], "unknown key 'actor.lora.rnk' (known keys of actor.lora: type, rank,"),
    (["actor.lora.rank=8", "actor.lora.type=dora"], "actor.lora.type: expected one of 'lora', 'canonical_lora', "
                                                    "got 'dora'"),
    (["actor.lora.rank=8", "actor.lora.target_modules=[linear_fc3]"],
     "actor.lora: invalid LoraConfig: lora.target_modules entry 'linear_fc3' names no linear"),
    (["algorithm.name=grpo", "critic.lora.rank=8"], "critic.lora.rank=8 with algorithm.name='grpo', which has no "
                                                    "critic: drop critic.lora or use ppo"),
])
def test_lora_keys_errors_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(tmp_path, *overrides)
