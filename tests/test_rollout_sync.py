"""A rollout engine (transformers' generate) fed from the trainer after every update: its
log-probs of its own samples equal the trainer's old log-probs (fp32) on every step of a short
GRPO-style run on the real model, at TP=3 (9 query heads do not split over TP=2; one sync) and
PP=2 (two syncs: a later sync refreshes what an earlier one sent); a broken sync at TP=1 makes
the mismatch exceed the bound by at least 10x: one run whose first sync skips one bucket and
whose second sync (complete again but for it) transposes one tensor.
"""
from __future__ import annotations

import os

import pytest
import torch

from mcore_rl.rollout.metrics import rollout_corr_metrics
from tests.dist import run_ranks
from tests.real_model import QUESTIONS, smollm2_dir

BOUND = 1e-4  # max |rollout log-prob - trainer log-prob| of a synced engine (fp32)


class _Broken:
    """Wraps an engine and breaks the sync after update ``i`` as ``breaks[i]`` = (skip, transpose)
    says (when given): drops every bucket holding ``skip``, transposes ``transpose``."""

    def __init__(self, engine, breaks: list[tuple[str | None, str | None]]) -> None:
        self.engine, self.breaks, self.syncs = engine, breaks, 0

    def generate(self, *a, **k):
        return self.engine.generate(*a, **k)

    def next_sync(self) -> None:
        self.syncs += 1

    def update_weights(self, named):
        skip, transpose = self.breaks[self.syncs - 1] if self.syncs <= len(self.breaks) else (None, None)
        named = list(named)
        if any(n == skip for n, _ in named):
            return 0
        return self.engine.update_weights((n, t.t() if n == transpose else t) for n, t in named)


def _run(hf_dir: str, layout_kwargs: dict, breaks: list[tuple[str | None, str | None]], steps: int) -> list[dict]:
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
        rollout = _Broken(TransformersRollout(hf_dir), breaks)
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
        out.append(rollout_corr_metrics(old, batch["rollout_log_probs"], mask))
        if step == steps - 1:
            break  # the last step's samples are scored; an update after them would not be
        # a fixed +-1 advantage per row: the update moves the policy in every step
        sign = torch.tensor([1.0, -1.0] * (len(prompts) // 2)).unsqueeze(1)
        batch.update(old_log_probs=old, advantages=sign * mask)
        actor.update_policy(batch)
        if rollout is not None:
            rollout.next_sync()
        sync_weights(rollout, engine.model, args, bucket_bytes=64 << 20)
    return out


@pytest.mark.parametrize("world,layout,steps", [(3, dict(tp=3), 2), (2, dict(pp=2), 3)], ids=["tp3", "pp2"])
def test_synced_engine_matches_trainer_every_step(world, layout, steps):
    hf_dir = os.path.join(smollm2_dir(), "hf")
    history = run_ranks(world, _run, hf_dir, layout, [], steps)[0]
    assert len(history) == steps
    for i, m in enumerate(history):
        print(f"{layout} step {i}: max |diff| {m['rollout_corr/max_abs_log_prob_diff']:.2e}, "
              f"k3_kl {m['rollout_corr/k3_kl']:.2e}, log_ppl_diff {m['rollout_corr/log_ppl_diff']:.2e}")
        assert m["rollout_corr/max_abs_log_prob_diff"] <= BOUND, (i, m)


# after update 1 one bucket is not sent; after update 2 everything is sent (the skipped bucket
# too) but one tensor transposed: each step's mismatch shows its own sync's fault
BREAKS = [("model.layers.20.mlp.down_proj.weight", None), (None, "model.layers.7.self_attn.o_proj.weight")]


def test_broken_sync_is_caught_by_the_mismatch_metric():
    hf_dir = os.path.join(smollm2_dir(), "hf")
    history = run_ranks(1, _run, hf_dir, {}, BREAKS, 3)[0]
    assert history[0]["rollout_corr/max_abs_log_prob_diff"] <= BOUND  # before any sync: the same weights
    for (skip, transpose), m in zip(BREAKS, history[1:]):
        print(f"skipped {skip}, transposed {transpose}: max |diff| {m['rollout_corr/max_abs_log_prob_diff']:.2e}, "
              f"k3_kl {m['rollout_corr/k3_kl']:.2e}")
        assert m["rollout_corr/max_abs_log_prob_diff"] >= 10 * BOUND, (skip, transpose, m)
