"""verl's PPO trainer configs with ``model_engine=mcore_rl`` (Hydra groups shipped in
mcore_rl/integrations/verl/hydra): they compose into mcore_rl's actor / reference / critic
configs, and verl's own ActorRolloutRefWorker built from them runs on mcore_rl (TP=2):
reference and old log-probs agree, and an update with verl's ppo_loss reports verl's metrics;
the critic built as verl's PPO trainer builds it computes values and updates.
(The Ray trainer itself needs a rollout engine: not runnable here.)"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("verl")

from tests.dist import run_ranks  # noqa: E402
from tests.verl import rl_bodies as B  # noqa: E402
from tests.verl.verl_fixtures import save_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("ppo") / "model"))


def test_ppo_config_composes_into_mcore_rl_configs(model_dir):
    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine import EngineRegistry

    from mcore_rl.integrations.verl.config import McoreRLActorConfig, McoreRLCriticConfig, McoreRLEngineConfig

    cfg = B.ppo_config(model_dir, "actor_rollout_ref.actor.mcore_rl.pipeline_model_parallel_size=2",
                       "critic.mcore_rl.expert_model_parallel_size=2")
    from verl.utils.config import validate_config

    validate_config(cfg, use_reference_policy=True, use_critic=True)  # what main_ppo runs first
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    critic = omega_conf_to_dataclass(cfg.critic)
    assert isinstance(actor, McoreRLActorConfig) and isinstance(actor.engine, McoreRLEngineConfig)
    assert isinstance(critic, McoreRLCriticConfig) and isinstance(critic.engine, McoreRLEngineConfig)
    assert (actor.strategy, critic.strategy, actor.engine.pipeline_model_parallel_size,
            critic.engine.expert_model_parallel_size) == ("mcore_rl", "mcore_rl", 2, 2)
    ref_cfg = cfg.actor_rollout_ref.ref
    with open_dict(ref_cfg):  # what ActorRolloutRefWorker does before converting it
        renames = {"log_prob_micro_batch_size": "ppo_micro_batch_size", "log_prob_use_dynamic_bsz": "use_dynamic_bsz",
                   "log_prob_micro_batch_size_per_gpu": "ppo_micro_batch_size_per_gpu",
                   "log_prob_max_token_len_per_gpu": "ppo_max_token_len_per_gpu"}
        for old, new in renames.items():
            ref_cfg[new] = ref_cfg.pop(old)
        ref_cfg.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    ref = omega_conf_to_dataclass(ref_cfg)
    # the reference follows the actor's layout (one process holds both engines)
    assert ref.engine.forward_only and ref.engine.pipeline_model_parallel_size == 2
    for model_type in ("language_model", "value_model"):
        assert "mcore_rl" in EngineRegistry._engines[model_type]


def test_verl_actor_and_ref_workers_run_on_mcore_rl(model_dir):
    ranks = run_ranks(2, B.ppo_workers_body, model_dir, 5)
    for r in ranks:
        assert r["engines"] == ["McoreRLEngineWithLMHead"] * 2 and r["ref_forward_only"] and r["tp"] == 2
    outputs = [r for r in ranks if r["metrics"] is not None]
    assert len(outputs) == 1  # TP rank 0 of the only DP rank collects outputs
    r = outputs[0]
    mask = r["old"] != 0
    assert mask.sum() > 10
    diff = float((r["old"] - r["ref"]).abs().max())
    assert diff <= 1e-5, f"reference and actor log-probs at the same weights differ by {diff}"
    m = r["metrics"]
    assert len(m["actor/pg_loss"]) == len(m["grad_norm"]) == B.ROWS // B.MINI  # one entry per optimizer step
    assert all(math.isfinite(g) and g > 0 for g in m["grad_norm"])
    assert m["actor/pg_clipfrac"][0] > 0 and m["kl_loss"][0] > 0
    lr, style = r["lr"]
    assert style == "constant" and m["lr"] == [pytest.approx(lr)]
    assert torch.isfinite(r["old"]).all()
    assert r["critic_engine"] == "McoreRLEngineWithValueHead" and torch.isfinite(r["critic_values"]).all()
    assert r["critic_values"][mask].abs().max() > 0  # a value at every response token
    c = r["critic_metrics"]
    assert len(c["critic/vf_loss"]) == B.ROWS // B.MINI and all(g > 0 for g in c["grad_norm"])
