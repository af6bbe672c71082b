"""rollout.temperature drives the job: the sampler draws at it and the log-probs the update uses
are log_softmax(logits / T) at it (checked against the transformers model of the same weights)."""
from __future__ import annotations

import os

import pytest
import torch

from mcore_rl.job.schema import JobConfig, load_job_config
from tests.dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPT, RESPONSE = 4, 2


def _config(temperature: float, tmp_path, *overrides: str) -> JobConfig:
    return load_job_config(os.path.join(ROOT, "configs", "grpo_demo.yaml"), [
        f"output_dir={tmp_path}", f"rollout.temperature={temperature}", "rollout.prompts_per_step=16",
        "rollout.samples_per_prompt=4", f"task.response_length={RESPONSE}",
        "actor.micro_batch_size=32", "actor.ppo_mini_batch_size=64", *overrides,
    ])


def _rollouts(configs: list[JobConfig]) -> list[dict]:
    from mcore_rl.job.loop import build, rollout, setup_rollout
    from mcore_rl.parallel.layout import destroy_parallel_state
    from mcore_rl.platform import active_platform

    batches = []
    for cfg in configs:
        actor, _ = build(cfg, active_platform())
        task, rollouts = setup_rollout(cfg, actor)
        batch, _, _, _ = rollout(cfg, actor, task, rollouts, 0, {})
        batches.append({k: v.cpu() for k, v in batch.items()})
        destroy_parallel_state()
    return batches


def _hf_logits(cfg: JobConfig, input_ids: torch.Tensor) -> torch.Tensor:
    """[B, R, V] logits that predict each response token, from transformers."""
    from mcore_rl.job.loop import tiny_hf_model

    with torch.no_grad():
        logits = tiny_hf_model(cfg.model.tiny).eval()(input_ids).logits.float()
    return logits[:, -RESPONSE - 1 : -1]


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory):
    configs = [_config(t, tmp_path_factory.mktemp("t")) for t in (1e-4, 2.0)]
    return configs, run_ranks(2, _rollouts, configs)[0]


@pytest.mark.parametrize("index, temperature", [(0, 1e-4), (1, 2.0)])
def test_update_log_probs_use_rollout_temperature(rollouts, index, temperature):
    configs, batches = rollouts
    batch = batches[index]
    logits = _hf_logits(configs[index], batch["input_ids"])
    expected = torch.log_softmax(logits / temperature, -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    # at T=1e-4 the sampled (greedy) tokens have log-prob ~0 and any other ~ -1000s: compare
    # the probabilities there, the log-probs at T=2
    if temperature < 1e-3:
        torch.testing.assert_close(batch["old_log_probs"].exp(), expected.exp(), atol=1e-3, rtol=0)
    else:
        torch.testing.assert_close(batch["old_log_probs"], expected, atol=1e-4, rtol=0)


def test_sampler_draws_at_rollout_temperature(rollouts):
    configs, (cold, hot) = rollouts
    for batch, cfg in ((cold, configs[0]), (hot, configs[1])):
        top2 = _hf_logits(cfg, batch["input_ids"]).topk(2, dim=-1)
        batch["greedy"] = top2.indices[..., 0]
        batch["clear"] = (top2.values[..., 0] - top2.values[..., 1]) > 2e-3  # 20 T: no Gumbel flip
    assert cold["clear"].float().mean() > 0.8
    # T=1e-4 is greedy wherever the top-2 margin is clear; T=2 is not
    assert torch.equal(cold["responses"][cold["clear"]], cold["greedy"][cold["clear"]])
    assert (hot["responses"] != hot["greedy"]).float().mean() > 0.5


def test_sampler_with_sequence_parallel_and_odd_length(tmp_path):
    # S = 5 + 2 = 7 does not divide by tp=2: the micro-batcher left-pads a column, and the
    # sampler must still read the logits of the last real position (greedy at T=1e-4)
    cfg = _config(1e-4, tmp_path, "layout.sequence_parallel=true", "task.prompt_length=5")
    batch = run_ranks(2, _rollouts, [cfg])[0][0]
    assert batch["input_ids"].shape[1] == 7
    top2 = _hf_logits(cfg, batch["input_ids"]).topk(2, dim=-1)
    clear = (top2.values[..., 0] - top2.values[..., 1]) > 2e-3
    assert clear.float().mean() > 0.8
    assert torch.equal(batch["responses"][clear], top2.indices[..., 0][clear])
