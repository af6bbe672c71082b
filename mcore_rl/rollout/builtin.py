"""The no-dependency rollout engine: the actor's own megatron model and the demo sampler
(``rl/sampler.py``: vocab-parallel sampling, no KV cache), behind the ``RolloutEngine`` contract."""
from __future__ import annotations

from typing import Iterable

import torch

from mcore_rl.models.routing import ROUTED_EXPERTS
from mcore_rl.rl.actor import Actor
from mcore_rl.rl.sampler import generate
from mcore_rl.rollout.engine import Rollout, RolloutError, left_pad

Tensor = torch.Tensor


class BuiltinRollout:
    """Samples from the trainer's own parameters, so there are no weights to sync. Collective:
    every rank calls ``generate`` with the same prompts and gets the whole batch. Rollout
    log-probs come from the same vocab-parallel logits the sample was drawn from; they differ
    from the trainer's old log-probs only by batch-shape numerics."""

    collective = True  # runs on every rank of every replica, not on one rank per replica

    def __init__(self, actor: Actor, eos_id: int | None = None, pad_id: int = 0,
                 record_routing: bool = False) -> None:
        """``record_routing`` (MoE): rollouts carry ``routed_experts`` (router replay R3)."""
        self.actor, self.eos_id, self.pad_id, self.record_routing = actor, eos_id, pad_id, record_routing

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> Rollout:
        """One response per prompt at ``temperature`` (0: greedy, no log-probs); collective."""
        ids, mask = left_pad(prompts, self.pad_id)
        out = generate(self.actor, ids, max_new_tokens, temperature, seed, attention_mask=mask,
                       eos_id=self.eos_id, pad_id=self.pad_id, record_routing=self.record_routing)
        return Rollout(out["input_ids"], out["attention_mask"], out["responses"], out.get("rollout_log_probs"),
                       out.get(ROUTED_EXPERTS))

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Refused: the engine reads the trainer's parameters, a copy would go nowhere."""
        raise RolloutError("the builtin rollout engine samples from the trainer's own parameters; "
                           "there is nothing to sync (use rollout.engine=transformers for a separate model).")
