"""Critic: per-token values of response positions and clipped value-loss updates.

The value of response token j is read at the position that predicts it (the state before it),
as for the actor's log-probs. Same batch contract as the actor (mcore_rl.rl.batch).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mcore_rl.rl import losses
from mcore_rl.rl.actor import local_rows, micro_batches, response_logits
from mcore_rl.rl.batch import concat_rows, response_mask, split_rows, validate_batch
from mcore_rl.rl.engine import ModelEngine, all_reduce_dp, dp_rank_size, gather_dp

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
        rows = batch["input_ids"].shape[0]
        self.engine.train(True)
        steps = []
        for _ in range(self.config.ppo_epochs):
            for mini in split_rows(batch, min(self.config.ppo_mini_batch_size, rows)):
                steps.append(self._update_mini_batch(mini))
        return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}

    def _update_mini_batch(self, mini: dict) -> dict[str, float]:
        cfg = self.config
        denominator = losses.global_denominator(response_mask(mini), cfg.loss_agg_mode)
        pieces = micro_batches(local_rows(mini), cfg, self.engine)
        scale = len(pieces) * dp_rank_size()[1]  # see Actor._update_mini_batch

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

        stats = self.engine.run(pieces, loss_fn, False)
        step = self.engine.step()
        totals = {k: all_reduce_dp(sum(s[k] for s in stats)) for k in stats[0]}
        tokens = totals.pop("tokens").clamp(min=1)
        metrics = {k.removesuffix("_sum"): float(v / tokens) for k, v in totals.items() if k.endswith("_sum")}
        metrics["vf_loss"] = float(totals["vf_loss"])
        return {**{f"critic/{k}": v for k, v in metrics.items()}, **{f"critic/{k}": v for k, v in step.items()}}
