"""dispatch='sharded' (each DP rank passes only its rows, gets only its results) equals
dispatch='global' for log-probs, values and one update, at DP=2 and PP=2xDP=2; ranks that must
pass the same rows and do not get a named error."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import rl_batch, saved_tiny_llama

ROWS, R = 8, 6


def _batch() -> dict:
    batch = rl_batch(200, batch=ROWS)
    g = torch.Generator().manual_seed(2)
    mask = batch["attention_mask"][:, -R:]
    batch.update(old_log_probs=-3.0 * torch.rand(ROWS, R, generator=g) * mask,
                 advantages=torch.randn(ROWS, R, generator=g) * mask)
    return batch


def _run(hf_dir: str, layout: dict, dispatch: str) -> dict:
    from megatron.core import parallel_state

    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(**layout)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "actor", active_platform(), optim=OptimConfig(lr=0.5, eps=1.0), hf_weights=hf_dir)
    actor = Actor(engine, ActorConfig(micro_batch_size=2, ppo_mini_batch_size=ROWS, dispatch=dispatch))
    batch = _batch()
    if dispatch == "sharded":  # this DP rank's rows only
        dp, size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
        per = ROWS // size
        batch = {k: v[dp * per : (dp + 1) * per] for k, v in batch.items()}
    out = actor.compute_log_prob(batch, with_entropy=True)
    metrics = actor.update_policy(batch)
    return {"lp": out["log_probs"], "ent": out["entropy"], "metrics": metrics,
            "params": export_hf(engine.model, args, "actor"),
            "dp": parallel_state.get_data_parallel_rank(), "dp_size": parallel_state.get_data_parallel_world_size()}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return saved_tiny_llama(tmp_path_factory.mktemp("dispatch"))


@pytest.fixture(scope="module")
def single(hf_dir):
    return run_ranks(1, _run, hf_dir, {}, "global")[0]


@pytest.mark.parametrize("world,layout", [(2, {}), (4, dict(pp=2))], ids=["dp2", "pp2_dp2"])
def test_sharded_equals_global(world, layout, hf_dir, single):
    """single: dispatch='global' on one rank (global mode at DP=2, PP=2 equals it: test_actor_update)."""
    for rank, s in enumerate(run_ranks(world, _run, hf_dir, layout, "sharded")):
        per = ROWS // s["dp_size"]
        rows = slice(s["dp"] * per, (s["dp"] + 1) * per)
        assert s["dp_size"] == 2 and s["lp"].shape == (per, R), (rank, s["lp"].shape)
        for key in ("lp", "ent"):
            assert (s[key] - single[key][rows]).abs().max() <= 1e-5, f"rank {rank} sharded {key}"
        worst = max(((s["params"][k] - p).abs().max().item(), k) for k, p in single["params"].items())
        assert worst[0] <= 1e-5, f"rank {rank}: {worst[1]} differs by {worst[0]:.3g}"
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/ppo_kl", "actor/entropy"):
            assert abs(s["metrics"][key] - single["metrics"][key]) <= 1e-5, f"rank {rank} {key}"


def test_update_moves_parameters(hf_dir, single):
    from mcore_rl.mapping.hf_io import SafetensorsReader

    start = SafetensorsReader(hf_dir)
    assert max((single["params"][k] - start[k]).abs().max().item() for k in single["params"]) > 1e-3


def _mismatch(hf_dir: str, layout: dict, dispatch: str) -> str:
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine
    from mcore_rl.rl.minibatch import BatchMismatchError

    layout = ParallelLayout(**layout)
    initialize_parallel_state(layout)
    engine = ModelEngine(model_args_from_hf(hf_dir), layout, "actor", active_platform(), hf_weights=hf_dir)
    batch = rl_batch(200, batch=4, seed=3 + torch.distributed.get_rank())  # each rank its own rows
    try:
        Actor(engine, ActorConfig(micro_batch_size=2, dispatch=dispatch)).compute_log_prob(batch)
    except BatchMismatchError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("layout,dispatch,group", [
    (dict(tp=2), "sharded", "model-parallel group"),
    (dict(pp=2), "sharded", "model-parallel group"),
    (dict(), "global", "world"),
], ids=["tp2_sharded", "pp2_sharded", "dp2_global"])
def test_peers_with_different_rows_are_refused(layout, dispatch, group, hf_dir):
    for message in run_ranks(2, _mismatch, hf_dir, layout, dispatch):
        assert message.startswith(f"ranks of one {group}") and "passed different batches" in message, message


def test_dp_ranks_may_differ_in_sharded_mode(hf_dir):
    assert run_ranks(2, _mismatch, hf_dir, {}, "sharded") == ["no error", "no error"]
