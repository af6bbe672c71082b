"""Critic: per-token values of response positions and clipped value-loss updates.

The value of response token j is read at the position that predicts it (the state before it),
as for the actor's log-probs. Same batch contract (mcore_rl.rl.batch) and dispatch modes
(mcore_rl.rl.minibatch) as the actor.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mcore_rl.models.micro_batch import MicroBatch
from mcore_rl.rl import losses
from mcore_rl.rl.batch import attended_responses, response_mask, row_tokens, validate_batch
from mcore_rl.rl.engine import ModelEngine
from mcore_rl.rl.minibatch import forward_rows, ppo_update, response_logits
from mcore_rl.models.hf_config import ConfigError

Tensor = torch.Tensor


@dataclass(frozen=True)
class CriticConfig:
    """Batching and value loss of the critic. Batch sizes count rows (samples), as in
    ActorConfig: ``ppo_mini_batch_size`` global rows per optimizer step, ``micro_batch_size``
    rows per micro-batch on each DP rank, ``max_tokens_per_micro_batch`` padded tokens per
    micro-batch on each DP rank (dynamic batching), ``dispatch`` 'global' or 'sharded',
    ``use_remove_padding`` packed micro-batches (as the actor's)."""

    micro_batch_size: int = 4  # rows per micro-batch on each DP rank
    max_tokens_per_micro_batch: int | None = None  # dynamic batching by padded tokens per DP rank
    ppo_mini_batch_size: int = 16  # global rows (samples, not prompts) per optimizer step
    ppo_epochs: int = 1
    cliprange_value: float | None = 0.5
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    dispatch: Literal["global", "sharded"] = "global"
    use_remove_padding: bool = False  # verl's name: packed (padding-free) micro-batches


class Critic:
    """A trainable value model built with role='critic' (hidden -> 1 head)."""

    def __init__(self, engine: ModelEngine, config: CriticConfig):
        if engine.role != "critic":
            raise ConfigError(f"Critic needs an engine built with role='critic', got {engine.role!r}; build it with ModelEngine(..., 'critic', ...).")
        self.engine, self.config = engine, config

    @torch.no_grad()
    def compute_values(self, batch: dict) -> Tensor:
        """[B, R] values of the response positions (zeros at attention padding), on the batch's
        device; every rank gets [B, R] with dispatch='global', its own rows with 'sharded'."""
        validate_batch(batch, vocab_size=self.engine.args.vocab_size)

        def loss_fn(mb: MicroBatch, output: Tensor):
            values = response_logits(output, mb).squeeze(-1).float()
            return values.sum() * 0.0, {"values": torch.where(attended_responses(mb).bool(), values, 0.0)}

        return forward_rows(self.engine, batch, self.config, loss_fn, ("values",))["values"]

    def update_critic(self, batch: dict) -> dict[str, float]:
        """Value-loss updates (ppo_epochs x mini-batches); needs 'values' (old) and 'returns'
        [B, R]. Returns metrics averaged over the optimizer steps."""
        validate_batch(batch, ("values", "returns"), vocab_size=self.engine.args.vocab_size)
        return ppo_update(self.engine, batch, self.config, self._value_loss_fn, "critic")

    def _value_loss_fn(self, denominator: float, scale: int):
        cfg = self.config

        def loss_fn(mb: MicroBatch, output: Tensor):
            values = response_logits(output, mb).squeeze(-1).float()
            mask = response_mask(mb).bool()
            vf, m = losses.value_loss(
                values, mb["values"], mb["returns"], mask, cfg.cliprange_value, cfg.loss_agg_mode,
                denominator, row_tokens(mb),  # context parallelism: whole-row token counts
            )
            n = mask.sum()
            stats = {"vf_loss": vf.detach(), "tokens": n, "vf_clipfrac_sum": m["vf_clipfrac"] * n,
                     "vpred_mean_sum": m["vpred_mean"] * n}
            return vf * scale, stats

        return loss_fn
