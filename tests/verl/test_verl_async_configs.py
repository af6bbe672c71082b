"""The configs of verl's asynchronous trainers (``one_step_off_policy``, ``fully_async_policy``)
composed with ``model_engine=mcore_rl``, no processes (their launches: test_verl_async_trainers.py)."""
from __future__ import annotations

import pytest

pytest.importorskip("verl")

from tests.verl.test_verl_config import _ref_config, model_dir  # noqa: E402,F401 - model_dir is a fixture

# verl's asynchronous trainers: their own config (next to their code), composed with mcore_rl's
# search path after verl's (their relative search path is replaced by the command line's).
ASYNC_CONFIGS = {"one_step_off": ("one_step_off_policy", "one_step_off_ppo_trainer"),
                 "fully_async": ("fully_async_policy", "fully_async_ppo_trainer")}


@pytest.mark.parametrize("trainer", list(ASYNC_CONFIGS))
def test_async_trainer_configs_build_mcore_rl_actor_and_reference(model_dir, trainer):
    """The configs of ``one_step_off_policy.main_ppo`` and ``fully_async_main`` with
    model_engine=mcore_rl: verl's checks pass and the actor and reference dataclasses build with
    fully-async's ``actor.use_rollout_log_probs=True`` (a TypeError before: the field was unknown)."""
    import os

    import verl.experimental
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    package, name = ASYNC_CONFIGS[trainer]
    config_dir = os.path.join(os.path.dirname(verl.experimental.__file__), package, "config")
    overrides = ["hydra.searchpath=[pkg://verl.trainer.config,pkg://mcore_rl.integrations.verl.hydra]",
                 "model_engine=mcore_rl", "actor_rollout_ref.rollout.name=mcore_rl",
                 "actor_rollout_ref.rollout.checkpoint_engine.backend=mcore_rl", "actor_rollout_ref.hybrid_engine=False",
                 f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.use_kl_loss=True",
                 "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1", "algorithm.adv_estimator=grpo",
                 "actor_rollout_ref.actor.mcore_rl.tensor_model_parallel_size=2"]
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name=name, overrides=overrides)
    validate_config(cfg, use_reference_policy=True, use_critic=False)
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    assert (actor.strategy, actor.engine.tensor_model_parallel_size) == ("mcore_rl", 2)
    assert actor.use_rollout_log_probs is (trainer == "fully_async")
    ref = _ref_config(cfg)
    assert ref.strategy == "mcore_rl" and ref.engine.forward_only
    assert cfg.algorithm.rollout_correction.bypass_mode is True  # the trainers' own default
