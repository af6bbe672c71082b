"""MoE layers whose expert group spans DP ranks (EP=2) run collectives in every forward, so the
micro-batcher must give every DP rank the same number of micro-batches (and, for the allgather
dispatcher, the same shape) even when the ranks hold different rows: dispatch='sharded' with
different row counts and sequence lengths, and dynamic batching with the allgather dispatcher."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.steps import EXACT_MOE
from tests.tiny import rl_batch, tiny_config, tiny_hf_model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe_batching")
    tiny_hf_model(tiny_config("qwen2_moe", num_hidden_layers=2), seed=5).save_pretrained(d)
    return str(d)


def _engine(hf_dir: str, layout: dict, dispatcher: str, optim=None):
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine

    layout = ParallelLayout(**layout)
    initialize_parallel_state(layout)
    options = BuildOptions(moe=MoEOptions(**{**EXACT_MOE, "dispatcher": dispatcher}))
    return ModelEngine(model_args_from_hf(hf_dir), layout, "actor", active_platform(), options, optim, hf_dir)


def _sharded_log_probs(hf_dir: str, layout: dict, dispatcher: str, batch: dict) -> torch.Tensor:
    """DP rank 0 passes all 16 rows, rank 1 the first 6 with one more padding column (S + 1)."""
    from megatron.core import parallel_state

    from mcore_rl.rl.actor import Actor, ActorConfig

    engine = _engine(hf_dir, layout, dispatcher)
    if parallel_state.get_data_parallel_rank() == 1:
        batch = {k: v[:6] for k, v in batch.items()}
        for key in ("input_ids", "attention_mask"):
            batch[key] = torch.cat([torch.zeros(6, 1, dtype=batch[key].dtype), batch[key]], dim=1)
    return Actor(engine, ActorConfig(micro_batch_size=2, dispatch="sharded")).compute_log_prob(batch)["log_probs"]


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_sharded_ranks_with_different_rows(dispatcher, hf_dir):
    batch = rl_batch(200, batch=16, prompt=10, response=8, seed=25)
    ref = run_ranks(1, _sharded_log_probs, hf_dir, {}, dispatcher, batch)[0]
    # rank 0 runs 8 micro-batches, rank 1 only 3 of its own: without agreement rank 0 hangs
    out = run_ranks(2, _sharded_log_probs, hf_dir, dict(ep=2), dispatcher, batch, timeout_s=120)
    assert (out[0] - ref).abs().max() <= 1e-5
    assert (out[1] - ref[:6]).abs().max() <= 1e-5


def _dynamic_update(hf_dir: str, layout: dict, max_tokens, batch: dict) -> dict:
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import OptimConfig

    engine = _engine(hf_dir, layout, "allgather", OptimConfig(lr=0.05, eps=1.0))
    actor = Actor(engine, ActorConfig(micro_batch_size=2, ppo_mini_batch_size=8, max_tokens_per_micro_batch=max_tokens))
    lp = actor.compute_log_prob(batch)["log_probs"]
    metrics = actor.update_policy(batch)
    return {"lp": lp, "pg_loss": metrics["actor/pg_loss"], "params": export_hf(engine.model, engine.args, "actor")}


def test_dynamic_batching_with_allgather_dispatcher(hf_dir):
    batch = rl_batch(200, batch=16, prompt=10, response=8, seed=26)
    g = torch.Generator().manual_seed(0)
    batch.update(old_log_probs=-3 * torch.rand(16, 8, generator=g), advantages=torch.randn(16, 8, generator=g))
    ref = run_ranks(1, _dynamic_update, hf_dir, {}, None, batch)[0]
    # different lengths on the two EP (= DP) ranks: trimmed pieces differ in shape unless agreed
    for rank, got in enumerate(run_ranks(2, _dynamic_update, hf_dir, dict(ep=2), 40, batch, timeout_s=120)):
        assert (got["lp"] - ref["lp"]).abs().max() <= 1e-5, rank
        assert abs(got["pg_loss"] - ref["pg_loss"]) <= 1e-5, rank
        worst = max((got["params"][k] - p).abs().max().item() for k, p in ref["params"].items())
        assert worst <= 1e-5, (rank, worst)
