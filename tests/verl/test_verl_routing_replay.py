"""Router replay through verl's TrainingWorker (engine.router_replay.mode=R2) on a tiny
DeepSeek-V3 at EP=2, padded and packed: infer_batch returns ``routed_experts`` in verl's jagged
layout equal to mcore_rl's Actor's recording on every real token; after the routers of both are
perturbed identically, train_mini_batch replaying those routes (two optimizer steps) ends at the
parameters of the Actor's replayed update, and not at those of an update that routes afresh.
mcore_rl's Actor replay is itself checked against transformers in tests/test_routing_replay.py."""
from __future__ import annotations

from functools import partial

import pytest
import torch

pytest.importorskip("verl")

from tests.dist import run_ranks  # noqa: E402
from tests.verl import rl_bodies as B  # noqa: E402
from tests.verl.verl_fixtures import save_tiny_model  # noqa: E402

LAYOUT = {"expert_model_parallel_size": 2}


def _worker(path: str, remove_padding: bool, mode: str):
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreOptimizerConfig, TrainingWorkerConfig
    from verl.workers.config.engine import EngineRouterReplayConfig
    from verl.workers.engine_workers import TrainingWorker

    from mcore_rl.integrations.verl import McoreRLEngineConfig

    engine = McoreRLEngineConfig(dtype="float32", use_dynamic_bsz=False, micro_batch_size_per_gpu=B.MICRO,
                                 infer_micro_batch_size_per_gpu=B.MICRO, router_replay=EngineRouterReplayConfig(mode=mode),
                                 **LAYOUT)
    optim = McoreOptimizerConfig(lr=B.LR, lr_warmup_steps=0, total_training_steps=10, weight_decay=0.01, clip_grad=1.0)
    model = HFModelConfig(path=path, use_remove_padding=remove_padding, enable_gradient_checkpointing=False)
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model, engine_config=engine,
                                                 optimizer_config=optim, checkpoint_config=CheckpointConfig()))
    worker.reset()
    return worker


def _perturb(chunks) -> None:
    with torch.no_grad():  # fresh routing now differs from the recorded one for many tokens
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if name.endswith("router.weight"):
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)).to(p) * 0.3)


def _own_update(path: str, rows: dict, replay: bool) -> list:
    from mcore_rl.rl.actor import Actor, ActorConfig

    engine = B._own_engine(path, LAYOUT, "actor", 10)
    actor = Actor(engine, ActorConfig(
        temperature=B.TEMPERATURE, micro_batch_size=B.MICRO, ppo_mini_batch_size=B.MINI, clip_ratio_low=B.CLIP_LOW,
        clip_ratio_high=B.CLIP_HIGH, dual_clip_c=B.CLIP_C, entropy_coeff=B.ENTROPY_COEFF, use_kl_loss=True,
        kl_loss_coeff=B.KL_COEFF, kl_loss_type="low_var_kl", dispatch="sharded",
        router_replay="R2" if replay else "disabled"))
    _perturb(engine.model)
    engine.refresh_optimizer_params()
    for s in B._steps(B._ranks()[1]):
        actor.update_policy({k: v[s] for k, v in rows.items()})
    return B._local_params(engine.model)


def replay_body(path: str, seed: int) -> dict:
    B._env()
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig as VerlActorConfig
    from verl.workers.utils.losses import ppo_loss

    from mcore_rl.rl.actor import Actor, ActorConfig

    verl_loss = partial(ppo_loss, config=VerlActorConfig(
        strategy="mcore_rl", rollout_n=1, ppo_mini_batch_size=B.MINI, ppo_micro_batch_size_per_gpu=B.MICRO,
        clip_ratio_low=B.CLIP_LOW, clip_ratio_high=B.CLIP_HIGH, clip_ratio_c=B.CLIP_C, entropy_coeff=B.ENTROPY_COEFF,
        use_kl_loss=True, kl_loss_coef=B.KL_COEFF, kl_loss_type="low_var_kl", calculate_entropy=True))
    workers = {rp: _worker(path, rp == "packed", "R2") for rp in ("padded", "packed")}
    dpr, dp = B._ranks()  # the workers set up megatron's parallel state
    rows = B.rows_of(B.global_batch(workers["padded"].engine.engine.args.vocab_size, seed), dpr, dp)
    recorder = Actor(B._own_engine(path, LAYOUT, "actor", 10), ActorConfig(
        temperature=B.TEMPERATURE, micro_batch_size=B.MICRO, dispatch="sharded", router_replay="R2"))
    own = recorder.compute_log_prob(rows)
    rows.update(B.update_inputs(own["log_probs"], torch.zeros_like(own["log_probs"]), rows["response_mask"], seed + 1))
    rows["routed_experts"] = own["routed_experts"]
    replayed, fresh = _own_update(path, rows, True), _own_update(path, rows, False)
    out = {"replay_vs_fresh": B._max_diff(replayed, fresh)}
    for rp, worker in workers.items():
        td = B._to_verl(rows, (), calculate_entropy=False, compute_loss=False, temperature=B.TEMPERATURE)
        result = worker.infer_batch(td)
        routes = None if result is None else tu.get(result, "routed_experts")
        real = rows["attention_mask"].bool()
        out[f"{rp}_routes_equal"] = None if routes is None else torch.equal(routes.values(), own["routed_experts"][real])
        _perturb(worker.engine.engine.model)
        worker.engine.engine.refresh_optimizer_params()
        worker.set_loss_fn(verl_loss)
        td = B._to_verl(rows, ("old_log_probs", "advantages", "ref_log_prob", "routed_experts"),
                        temperature=B.TEMPERATURE, calculate_entropy=True, global_batch_size=B.MINI,
                        mini_batch_size=B.MINI, epochs=1, seed=42, dataloader_kwargs={"shuffle": False},
                        compute_loss=True)
        worker.train_mini_batch(td)
        out[f"{rp}_vs_replayed"] = B._max_diff(B._local_params(worker.engine.engine.model), replayed)
    return out


def test_verl_engine_records_and_replays_routes(tmp_path):
    path = save_tiny_model(str(tmp_path / "actor"), "deepseek_v3", seed=1, num_hidden_layers=2)
    ranks = run_ranks(2, replay_body, path, 7)
    for r in ranks:
        assert r["replay_vs_fresh"] > 1e-4, r  # replay decides the update here
        for rp in ("padded", "packed"):
            assert r[f"{rp}_routes_equal"] in (True, None), r
            assert r[f"{rp}_vs_replayed"] <= 1e-5, (rp, r)
    assert any(r["padded_routes_equal"] for r in ranks) and any(r["packed_routes_equal"] for r in ranks)
