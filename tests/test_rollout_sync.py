"""A rollout engine (transformers' generate) fed from the trainer after every update: its
log-probs of its own samples equal the trainer's old log-probs (fp32; TP=3 and PP=2 (9 query heads do not split over TP=2); the broken syncs at TP=1) on every
step of a short GRPO-style run on the real model; a broken sync (one bucket skipped, one tensor
transposed) makes the mismatch exceed the bound by at least 10x."""
from __future__ import annotations

import os

import pytest
import torch

from mcore_rl.rollout.metrics import rollout_corr_metrics
from tests.dist import run_ranks
from tests.real_model import QUESTIONS, smollm2_dir

BOUND = 1e-4  # max |rollout log-prob - trainer log-prob| of a synced engine (fp32)


class _Broken:
    """Wraps an engine and breaks the sync: drops every bucket holding ``skip`` or transposes
    ``transpose``."""

    def __init__(self, engine, skip: str | None, transpose: str | None) -> None:
        self.engine, self.skip, self.transpose = engine, skip, transpose

    def generate(self, *a, **k):
        return self.engine.generate(*a, **k)

    def update_weights(self, named):
        named = list(named)
        if any(n == self.skip for n, _ in named):
            return 0
        return self.engine.update_weights((n, t.t() if n == self.transpose else t) for n, t in named)


def _run(hf_dir: str, layout_kwargs: dict, skip: str | None, transpose: str | None, steps: int) -> list[dict]:
    from transformers import AutoTokenizer

    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.batch import response_mask
    from mcore_rl.rl.engine import ModelEngine, OptimConfig
    from mcore_rl.rollout.engine import broadcast_rollout, sync_weights
    from mcore_rl.rollout.group import replica_group
    from mcore_rl.rollout.hf_generate import TransformersRollout

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout, seed=3)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "actor", active_platform(), BuildOptions(), OptimConfig(lr=2e-5), hf_dir)
    actor = Actor(engine, ActorConfig(temperature=0.9, micro_batch_size=4, ppo_mini_batch_size=8))
    src, replica = replica_group()
    rollout = None
    if torch.distributed.get_rank() == src:
        rollout = _Broken(TransformersRollout(hf_dir), skip, transpose)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=True, add_generation_prompt=True)
               for q in QUESTIONS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts] * 2
    out = []
    for step in range(steps):
        r = rollout.generate(prompts, 8, 0.9, seed=step) if rollout is not None else None
        batch = broadcast_rollout(r, src, group=replica).batch()
        old = actor.compute_log_prob(batch)["log_probs"]
        mask = response_mask(batch)
        metrics = rollout_corr_metrics(old, batch["rollout_log_probs"], mask)
        # a fixed +-1 advantage per row: the update moves the policy in every step
        sign = torch.tensor([1.0, -1.0] * (len(prompts) // 2)).unsqueeze(1)
        batch.update(old_log_probs=old, advantages=sign * mask)
        actor.update_policy(batch)
        sync_weights(rollout, engine.model, args, bucket_bytes=64 << 20)
        out.append(metrics)
    return out


@pytest.mark.parametrize("world,layout", [(3, dict(tp=3)), (2, dict(pp=2))], ids=["tp3", "pp2"])
def test_synced_engine_matches_trainer_every_step(world, layout):
    hf_dir = os.path.join(smollm2_dir(), "hf")
    steps = run_ranks(world, _run, hf_dir, layout, None, None, 3)[0]
    for i, m in enumerate(steps):
        print(f"{layout} step {i}: max |diff| {m['rollout_corr/max_abs_log_prob_diff']:.2e}, "
              f"k3_kl {m['rollout_corr/k3_kl']:.2e}, log_ppl_diff {m['rollout_corr/log_ppl_diff']:.2e}")
        assert m["rollout_corr/max_abs_log_prob_diff"] <= BOUND, (i, m)


@pytest.mark.parametrize("skip,transpose", [("model.layers.20.mlp.down_proj.weight", None), (None, "model.layers.7.self_attn.o_proj.weight")],
                         ids=["bucket_skipped", "tensor_transposed"])
def test_broken_sync_is_caught_by_the_mismatch_metric(skip, transpose):
    hf_dir = os.path.join(smollm2_dir(), "hf")
    steps = run_ranks(1, _run, hf_dir, {}, skip, transpose, 2)[0]
    assert steps[0]["rollout_corr/max_abs_log_prob_diff"] <= BOUND  # before any sync: the same weights
    for m in steps[1:]:
        print(f"broken: max |diff| {m['rollout_corr/max_abs_log_prob_diff']:.2e}, k3_kl {m['rollout_corr/k3_kl']:.2e}")
        assert m["rollout_corr/max_abs_log_prob_diff"] >= 10 * BOUND, m
