"""update_policy through megatron's schedules, DDP and DistributedOptimizer: the same update for
DP=2 as DP=1 and for PP=2 (and PP x VPP) as PP=1 on the same global batch."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import rl_batch, tiny_config, tiny_hf_model

LAYOUTS = {
    "dp2": (2, dict()),
    "pp2": (2, dict(pp=2)),
    "pp2_vpp2": (2, dict(pp=2, vpp=2)),
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True)),
}


def _update(hf_dir: str, layout: dict, optim: dict, actor: dict) -> dict:
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(**layout)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "actor", active_platform(), optim=OptimConfig(**optim), hf_weights=hf_dir)
    act = Actor(engine, ActorConfig(**{"micro_batch_size": 2, "ppo_mini_batch_size": 8, **actor}))
    batch = rl_batch(200, batch=8)
    old = act.compute_log_prob(batch)["log_probs"]
    g = torch.Generator().manual_seed(5)
    mask = batch["attention_mask"][:, -6:]
    batch.update(old_log_probs=old - 0.05 * torch.rand(old.shape, generator=g) * mask,
                 advantages=torch.randn(old.shape, generator=g) * mask)
    metrics = act.update_policy(batch)
    return {"params": export_hf(engine.model, args, "actor"), "metrics": metrics}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("update")
    tiny_hf_model(tiny_config("llama", num_hidden_layers=4)).save_pretrained(d)
    return str(d)


# Adam's first step is lr * g / (|g| + eps): with eps = 1 it is close to lr * g, so the test
# also sees gradient scale (with a tiny eps, Adam's first step would hide a 2x scaling bug)
SGD = dict(name="adam", lr=0.5, eps=1.0, clip_grad=1.0)
ACTOR = dict(entropy_coeff=0.01, clip_ratio_high=0.28)


@pytest.fixture(scope="module")
def reference(hf_dir):
    return run_ranks(1, _update, hf_dir, {}, SGD, ACTOR)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_update_equals_single_rank(layout, hf_dir, reference):
    world, kwargs = LAYOUTS[layout]
    ref = reference
    start = run_ranks(1, _update, hf_dir, {}, dict(SGD, lr=0.0), ACTOR)[0]["params"]
    moved = max((ref["params"][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1e-3, "the update did not move the parameters"
    for rank, result in enumerate(run_ranks(world, _update, hf_dir, kwargs, SGD, ACTOR)):
        worst = max(((result["params"][k] - p).abs().max().item(), k) for k, p in ref["params"].items())
        assert worst[0] <= 1e-5, f"rank {rank}: {worst[1]} differs by {worst[0]:.3g}"
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/clipfrac", "actor/entropy"):
            assert abs(result["metrics"][key] - ref["metrics"][key]) <= 1e-5, key


def test_update_metrics(reference):
    m = reference["metrics"]
    assert set(m) >= {"actor/pg_loss", "actor/loss", "actor/clipfrac", "actor/approx_kl",
                      "actor/entropy", "actor/grad_norm", "actor/lr"}
    assert m["actor/lr"] == 0.5 and m["actor/grad_norm"] > 0 and 0 <= m["actor/clipfrac"] <= 1
    assert m["actor/approx_kl"] > 0 and m["actor/entropy"] > 0


def _bf16(hf_dir: str) -> dict:
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(tp=2, sequence_parallel=True)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "actor", active_platform(), BuildOptions(params_dtype=torch.bfloat16),
                         OptimConfig(lr=1e-3), hf_dir)
    actor = Actor(engine, ActorConfig(micro_batch_size=2, ppo_mini_batch_size=8))
    batch = rl_batch(200, batch=8)
    lp = actor.compute_log_prob(batch)["log_probs"]
    batch.update(old_log_probs=lp, advantages=torch.randn(lp.shape, generator=torch.Generator().manual_seed(0)))
    metrics = actor.update_policy(batch)
    after = actor.compute_log_prob(batch)["log_probs"]
    return {"lp": lp, "after": after, "metrics": metrics}


def test_bf16_update(hf_dir):
    from transformers import AutoModelForCausalLM

    from tests.tiny import hf_log_probs

    result = run_ranks(2, _bf16, hf_dir)[0]
    ref, _ = hf_log_probs(AutoModelForCausalLM.from_pretrained(hf_dir), rl_batch(200, batch=8))
    # bf16 keeps 8 mantissa bits: ~0.4% relative error per op, a few 1e-2 on log-probs
    assert (result["lp"] - ref).abs().max() < 0.1
    assert all(torch.isfinite(torch.tensor(v)) for v in result["metrics"].values())
    assert result["metrics"]["actor/grad_norm"] > 0 and not torch.equal(result["after"], result["lp"])


def _samples(count: int) -> dict:
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.rl.sampler import sample_vocab_parallel
    from megatron.core import parallel_state

    initialize_parallel_state(ParallelLayout(tp=2))
    full = torch.randn(1, 128, generator=torch.Generator().manual_seed(0)).expand(count, 128)
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = full[:, rank * 64 : (rank + 1) * 64]  # vocab 80: rank 1 holds 16 real + 48 padding
    ids = sample_vocab_parallel(shard, 80, 0.8, torch.Generator().manual_seed(1 + rank))
    return {"ids": ids, "probs": torch.softmax(full[0, :80].double() / 0.8, -1)}


def test_vocab_parallel_sampling_matches_softmax():
    results = run_ranks(2, _samples, 20000)
    assert torch.equal(results[0]["ids"], results[1]["ids"])  # every TP rank agrees
    ids, probs = results[0]["ids"], results[0]["probs"]
    assert int(ids.max()) < 80  # padding ids are never drawn
    freq = torch.bincount(ids, minlength=80).double() / ids.numel()
    assert (freq - probs).abs().max() < 0.015  # 20000 draws: sd of a frequency <= 0.0036
