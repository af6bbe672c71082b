"""Critic.compute_values equals HF's token-classification values; update_critic, with the value
clip active on some tokens and not others, equals a plain-torch reference (HF model, the loss
by formula, torch Adam) on one rank, and one rank for TP=2+SP, PP=2 and DP=2."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import rl_batch, tiny_config, tiny_hf_model

LAYOUTS = {"tp2_sp": (2, dict(tp=2, sequence_parallel=True)), "pp2": (2, dict(pp=2)), "dp2": (2, dict())}
CLIP = 0.2
OPTIM = dict(lr=0.05, eps=1.0, clip_grad=1.0)  # eps=1: the step sees gradient scale
R = 6


def _critic(hf_dir: str, layout: dict, batch: dict) -> dict:
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.critic import Critic, CriticConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(**layout)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "critic", active_platform(), optim=OptimConfig(**OPTIM), hf_weights=hf_dir)
    critic = Critic(engine, CriticConfig(micro_batch_size=2, ppo_mini_batch_size=8, cliprange_value=CLIP))
    values = critic.compute_values(batch)
    metrics = critic.update_critic(batch)
    return {"values": values, "metrics": metrics, "params": export_hf(engine.model, args, "critic")}


def _hf_values(hf, batch: dict) -> torch.Tensor:
    return hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, -R - 1 : -1, 0]


def _reference(hf, batch: dict) -> dict:
    """0.5 max((v - R)^2, (clip(v, old +- c) - R)^2), token-mean; clip fraction; torch Adam."""
    hf.eval()  # the token-classification head has dropout in train mode
    v = _hf_values(hf, batch).double()
    m = batch["attention_mask"][:, -R:].bool()
    old, ret = batch["values"].double(), batch["returns"].double()
    unclipped = (v - ret) ** 2
    clipped = (old + (v - old).clamp(-CLIP, CLIP) - ret) ** 2
    loss = 0.5 * torch.maximum(unclipped, clipped)[m].sum() / m.sum()
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), OPTIM["clip_grad"])
    torch.optim.Adam(hf.parameters(), lr=OPTIM["lr"], eps=OPTIM["eps"]).step()
    frac = (clipped > unclipped)[m].double().mean()
    metrics = {"critic/vf_loss": float(loss), "critic/vf_clipfrac": float(frac), "critic/grad_norm": float(grad_norm)}
    return {"metrics": metrics, "params": {k: p.detach().clone() for k, p in hf.state_dict().items()}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("critic")
    hf = tiny_hf_model(tiny_config("qwen3", num_hidden_layers=4), role="critic")
    hf.save_pretrained(d)
    batch = rl_batch(200, batch=8)
    with torch.no_grad():
        values = _hf_values(hf, batch)
    g = torch.Generator().manual_seed(9)
    mask = batch["attention_mask"][:, -R:]
    old = (values + 0.3 * torch.randn(values.shape, generator=g)) * mask  # |v - old| > 0.2 often
    batch.update(values=old, returns=(values + torch.randn(values.shape, generator=g)) * mask)
    return str(d), hf, batch, values * mask


@pytest.fixture(scope="module")
def single(model):
    return run_ranks(1, _critic, model[0], {}, model[2])[0]


def test_values_match_hf(model, single):
    _, _, _, hf_values = model
    assert (single["values"] - hf_values).abs().max() <= 1e-4 and hf_values.abs().max() > 0.1


def test_update_equals_formula_reference(model, single):
    _, hf, batch, _ = model
    ref = _reference(hf, batch)
    assert 0.1 <= ref["metrics"]["critic/vf_clipfrac"] <= 0.9, ref["metrics"]  # the clip is active
    for key, value in ref["metrics"].items():
        assert abs(single["metrics"][key] - value) <= 1e-5, f"{key}: {single['metrics'][key]} vs {value}"
    worst = max(((single["params"][k] - p).abs().max().item(), k) for k, p in ref["params"].items())
    assert worst[0] <= 1e-5, f"{worst[1]} differs by {worst[0]:.3g}"
    assert single["metrics"]["critic/lr"] == OPTIM["lr"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_across_layouts(layout, model, single):
    world, kwargs = LAYOUTS[layout]
    for rank, result in enumerate(run_ranks(world, _critic, model[0], kwargs, model[2])):
        assert (result["values"] - single["values"]).abs().max() <= 1e-5, f"rank {rank} values"
        worst = max(((result["params"][k] - p).abs().max().item(), k) for k, p in single["params"].items())
        assert worst[0] <= 1e-5, f"rank {rank}: {worst[1]} differs by {worst[0]:.3g}"
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/grad_norm"):
            assert abs(result["metrics"][key] - single["metrics"][key]) <= 1e-5, f"rank {rank} {key}"
