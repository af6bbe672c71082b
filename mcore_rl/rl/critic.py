"""Critic: per-token values of response positions and clipped value-loss updates.

The value of response token j is read at the position that predicts it (the state before it),
as for the actor's log-probs. Same batch contract as the actor (mcore_rl.rl.batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mcore_rl.rl import losses
from mcore_rl.rl.batch import concat_rows, response_mask, validate_batch
from mcore_rl.rl.engine import ModelEngine, gather_dp
from mcore_rl.rl.minibatch import local_rows, micro_batches, ppo_update, response_logits

Tensor = torch.Tensor


@dataclass(frozen=True)
class CriticConfig:
    """Batching and value loss of the critic."""

    micro_batch_size: int = 4
    max_tokens_per_micro_batch: int | None = None
    ppo_mini_batch_size: int = 16
    ppo_epochs: int = 1
    cliprange_value: float | None = 0.5
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"


class Critic:
    """A trainable value model built with role='critic' (hidden -> 1 head)."""

    def __init__(self, engine: ModelEngine, config: CriticConfig):
        if engine.role != "critic":
            raise ValueError(f"Critic needs an engine built with role='critic', got {engine.role!r}.")
        self.engine, self.config = engine, config

    @torch.no_grad()
    def compute_values(self, batch: dict) -> Tensor:
        """[B, R] values of the response positions (zeros at padding), on every rank."""
        validate_batch(batch)

        def loss_fn(mb: dict, output: Tensor):
            values = response_logits(output, mb).squeeze(-1).float()
            return values.sum() * 0.0, {"values": values * response_mask(mb)}

        self.engine.train(False)
        local = local_rows(batch)
        pieces = self.engine.run(micro_batches(local, self.config, self.engine), loss_fn, True)
        return gather_dp(concat_rows(pieces, local["input_ids"].shape[0])["values"])

    def update_critic(self, batch: dict) -> dict[str, float]:
        """Value-loss updates (ppo_epochs x mini-batches); needs 'values' (old) and 'returns'
        [B, R]. Returns metrics averaged over the optimizer steps."""
        validate_batch(batch, ("values", "returns"))
        return ppo_update(self.engine, batch, self.config, self._value_loss_fn, "critic")

    def _value_loss_fn(self, denominator: float, scale: int):
        cfg = self.config

        def loss_fn(mb: dict, output: Tensor):
            values = response_logits(output, mb).squeeze(-1).float()
            mask = response_mask(mb).to(values.dtype)
            vf, m = losses.value_loss(
                values, mb["values"], mb["returns"], mask, cfg.cliprange_value, cfg.loss_agg_mode,
                denominator,
            )
            n = mask.sum()
            stats = {"vf_loss": vf.detach(), "tokens": n, "vf_clipfrac_sum": m["vf_clipfrac"] * n,
                     "vpred_mean_sum": m["vpred_mean"] * n}
            return vf * scale, stats

        return loss_fn
