"""Offload frees the storage of params, grads and optimizer state; after onload, training is
bit-identical to a run that never offloaded."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import rl_batch, tiny_config, tiny_hf_model


def _two_updates(hf_dir: str, offload: bool, layout: dict) -> dict:
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig
    from mcore_rl.rl.offload import Offloader

    layout = ParallelLayout(**layout)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "actor", active_platform(), optim=OptimConfig(lr=1e-2), hf_weights=hf_dir)
    actor = Actor(engine, ActorConfig(micro_batch_size=2, ppo_mini_batch_size=8))
    info = {}
    for step in range(2):
        batch = rl_batch(200, batch=8, seed=step)
        batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
        batch["advantages"] = torch.randn(batch["old_log_probs"].shape, generator=torch.Generator().manual_seed(step))
        actor.update_policy(batch)
        if offload and step == 0:
            offloader = Offloader(engine)
            info["freed"] = offloader.offload()
            info["sizes"] = [s.nbytes() for s in offloader.storages()]
            info["numel"] = sum(p.numel() for c in engine.model for p in c.parameters())
            offloader.onload()
    info["params"] = export_hf(engine.model, args, "actor")
    return info


@pytest.mark.parametrize("layout", [dict(), dict(tp=2)], ids=["single", "tp2"])
def test_offload_onload_is_bit_identical(layout, tmp_path):
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(tmp_path)
    world = layout.get("tp", 1)
    plain = run_ranks(world, _two_updates, str(tmp_path), False, layout)
    moved = run_ranks(world, _two_updates, str(tmp_path), True, layout)
    for a, b in zip(plain, moved):
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        assert set(b["sizes"]) == {0}  # every storage really was freed
        # fp32 params + fp32 grads + Adam's two moments (the fp32 master shards are the params)
        assert b["freed"] >= 4 * 4 * b["numel"]
