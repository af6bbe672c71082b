"""The batch contract fixes values only on real tokens: whatever a trainer leaves at padding
(-100 in responses/input_ids, NaN or inf in advantages, old/ref log-probs, returns, old values)
must change nothing, neither the losses' gradients nor an update through megatron."""
from __future__ import annotations

import pytest
import torch

from mcore_rl.rl import losses
from tests.dist import run_ranks
from tests.tiny import hf_log_probs, rl_batch, tiny_config, tiny_hf_model

R = 8


def _inputs():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 8, [1] * 2 + [0] * 6]).bool()
    return mask, *(torch.randn(3, R, generator=g) for _ in range(4))


@pytest.mark.parametrize("garbage", [float("nan"), float("inf"), -1e30])
def test_loss_gradients_ignore_padding_values(garbage):
    mask, lp, old, adv, ret = _inputs()
    dirty = lambda x: x.masked_fill(~mask, garbage)  # noqa: E731
    grads = []
    for fill in (lambda x: x.masked_fill(~mask, 0.0), dirty):
        x = lp.clone().requires_grad_()
        pg, _ = losses.policy_loss(x, fill(old), fill(adv), mask, 0.2, 0.28, 3.0)
        vf, _ = losses.value_loss(x, fill(old), fill(ret), mask, 0.5)
        (pg + vf).backward()
        grads.append(x.grad)
    assert torch.isfinite(grads[1]).all() and torch.equal(grads[0], grads[1]), grads


def _update(hf_dir: str, batch: dict) -> dict:
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout()
    initialize_parallel_state(layout)
    engine = ModelEngine(model_args_from_hf(hf_dir), layout, "actor", active_platform(),
                         optim=OptimConfig(lr=0.05, eps=1.0), hf_weights=hf_dir)
    actor = Actor(engine, ActorConfig(micro_batch_size=4, ppo_mini_batch_size=8, use_kl_loss=True,
                                      kl_loss_coeff=0.1, kl_loss_type="k2", max_tokens_per_micro_batch=60))
    lp = actor.compute_log_prob(batch)["log_probs"]
    metrics = actor.update_policy(batch)
    return {"lp": lp, "after": actor.compute_log_prob(batch)["log_probs"], "metrics": metrics}


def test_update_ignores_padding_values(tmp_path):
    hf = tiny_hf_model(tiny_config("llama", num_hidden_layers=2))
    hf.save_pretrained(tmp_path)
    batch = rl_batch(200, batch=8, prompt=10, response=R, seed=4)
    lp, _ = hf_log_probs(hf, batch)
    g = torch.Generator().manual_seed(1)
    real = batch["attention_mask"][:, -R:].bool()
    assert not real.all()  # some response padding to fill with garbage
    batch.update(old_log_probs=torch.where(real, lp + torch.randn(lp.shape, generator=g), 0.0),
                 advantages=torch.where(real, torch.randn(lp.shape, generator=g), 0.0),
                 ref_log_prob=torch.where(real, lp - 0.3, 0.0))
    dirty = dict(batch)
    for key in ("old_log_probs", "advantages", "ref_log_prob"):
        dirty[key] = batch[key].masked_fill(~real, float("nan"))
    dirty["responses"] = batch["responses"].masked_fill(~real, -100)  # HF's ignore index
    dirty["input_ids"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    clean, got = (run_ranks(1, _update, str(tmp_path), b)[0] for b in (batch, dirty))
    assert torch.equal(got["lp"], clean["lp"])
    assert torch.isfinite(got["after"]).all() and torch.equal(got["after"], clean["after"])
    assert got["metrics"] == clean["metrics"]
