"""Critic.compute_values equals HF's token-classification values and is the same across layouts;
update_critic gives the same parameters for DP=2 / PP=2 as for one rank."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import rl_batch, tiny_config, tiny_hf_model

LAYOUTS = {"tp2_sp": (2, dict(tp=2, sequence_parallel=True)), "pp2": (2, dict(pp=2)), "dp2": (2, dict())}


def _critic(hf_dir: str, layout: dict, update: bool) -> dict:
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.critic import Critic, CriticConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(**layout)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    optim = OptimConfig(lr=0.5, eps=1.0, clip_grad=1.0)  # eps=1: the step sees gradient scale
    engine = ModelEngine(args, layout, "critic", active_platform(), optim=optim, hf_weights=hf_dir)
    critic = Critic(engine, CriticConfig(micro_batch_size=2, ppo_mini_batch_size=8, cliprange_value=0.2))
    batch = rl_batch(200, batch=8)
    values = critic.compute_values(batch)
    out = {"values": values}
    if update:
        g = torch.Generator().manual_seed(9)
        mask = batch["attention_mask"][:, -6:]
        batch.update(values=values, returns=(values + torch.randn(values.shape, generator=g)) * mask)
        out["metrics"] = critic.update_critic(batch)
        out["params"] = export_hf(engine.model, args, "critic")
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("critic")
    hf = tiny_hf_model(tiny_config("qwen3", num_hidden_layers=4), role="critic")
    hf.save_pretrained(d)
    return str(d), hf


@pytest.fixture(scope="module")
def reference(model):
    return run_ranks(1, _critic, model[0], {}, True)[0]


def test_values_match_hf(model, reference):
    _, hf = model
    batch = rl_batch(200, batch=8)
    with torch.no_grad():
        full = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., 0]
    ref = full[:, -7:-1] * batch["attention_mask"][:, -6:]
    assert (reference["values"] - ref).abs().max() <= 1e-4 and ref.abs().max() > 0.1


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_across_layouts(layout, model, reference):
    world, kwargs = LAYOUTS[layout]
    for rank, result in enumerate(run_ranks(world, _critic, model[0], kwargs, True)):
        assert (result["values"] - reference["values"]).abs().max() <= 1e-5, f"rank {rank} values"
        worst = max(((result["params"][k] - p).abs().max().item(), k) for k, p in reference["params"].items())
        assert worst[0] <= 1e-5, f"rank {rank}: {worst[1]} differs by {worst[0]:.3g}"
        assert abs(result["metrics"]["critic/vf_loss"] - reference["metrics"]["critic/vf_loss"]) <= 1e-5


def test_update_moves_and_reports(reference, model):
    before = run_ranks(1, _critic, model[0], {}, False)[0]["values"]
    assert torch.equal(before, reference["values"])  # compute_values is deterministic
    m = reference["metrics"]
    assert m["critic/vf_loss"] > 0 and 0 <= m["critic/vf_clipfrac"] <= 1 and m["critic/grad_norm"] > 0
