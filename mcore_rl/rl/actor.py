"""Actor: per-token log-probs (and entropy) of responses, reference log-probs, PPO/GRPO updates.

Every rank calls these with the same global batch (see mcore_rl.rl.batch for the contract).
Each DP rank computes its slice of rows; results come back as [B, R] on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mcore_rl.rl import losses
from mcore_rl.rl.batch import concat_rows, response_mask, validate_batch
from mcore_rl.rl.engine import ModelEngine, gather_dp
from mcore_rl.rl.logprob import log_probs_and_entropy
from mcore_rl.rl.minibatch import local_rows, micro_batches, ppo_update, response_logits

Tensor = torch.Tensor
UPDATE_KEYS = ("old_log_probs", "advantages")


@dataclass(frozen=True)
class ActorConfig:
    """How the actor batches and what its policy loss is (names follow verl where they exist)."""

    temperature: float = 1.0
    micro_batch_size: int = 4  # rows per micro-batch on each DP rank
    max_tokens_per_micro_batch: int | None = None  # dynamic batching by padded tokens
    ppo_mini_batch_size: int = 16  # global rows per optimizer step
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float | None = None  # None: symmetric; DAPO's clip-higher when larger
    dual_clip_c: float | None = None
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coeff: float = 0.0
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = "low_var_kl"


class Actor:
    """A trainable policy (``engine``) and an optional frozen reference policy."""

    def __init__(self, engine: ModelEngine, config: ActorConfig, ref: ModelEngine | None = None):
        self.engine, self.config, self.ref = engine, config, ref

    def _forward_log_probs(self, engine: ModelEngine, batch: dict, with_entropy: bool) -> dict:
        validate_batch(batch)
        vocab = engine.args.vocab_size
        temperature = self.config.temperature

        def loss_fn(mb: dict, output: Tensor):
            logits = response_logits(output, mb)
            lp, ent = log_probs_and_entropy(logits, mb["responses"], vocab, temperature, with_entropy)
            mask = response_mask(mb).to(lp.dtype)
            out = {"log_probs": (lp * mask).detach()}
            if with_entropy:
                out["entropy"] = (ent * mask).detach()
            return lp.sum() * 0.0, out

        engine.train(False)
        local = local_rows(batch)
        pieces = engine.run(micro_batches(local, self.config, engine), loss_fn, True)
        rows = local["input_ids"].shape[0]
        return {k: gather_dp(v) for k, v in concat_rows(pieces, rows).items()}

    @torch.no_grad()
    def compute_log_prob(self, batch: dict, with_entropy: bool = False) -> dict[str, Tensor]:
        """{'log_probs': [B, R]} (+ 'entropy' [B, R]) of the responses under the current policy,
        at ``config.temperature``; zeros at padding. Same result on every rank."""
        return self._forward_log_probs(self.engine, batch, with_entropy)

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: dict) -> Tensor:
        """[B, R] log-probs under the frozen reference policy."""
        if self.ref is None:
            raise ValueError("this Actor has no reference model; pass ref=ModelEngine(...).")
        return self._forward_log_probs(self.ref, batch, False)["log_probs"]

    # ---- update --------------------------------------------------------------------------
    def update_policy(self, batch: dict) -> dict[str, float]:
        """PPO/GRPO update: ppo_epochs x mini-batches of ppo_mini_batch_size global rows, one
        optimizer step each. Needs old_log_probs and advantages [B, R] (+ ref_log_prob with
        use_kl_loss). Returns metrics averaged over the steps, the same on every rank."""
        keys = UPDATE_KEYS + (("ref_log_prob",) if self.config.use_kl_loss else ())
        validate_batch(batch, keys)
        return ppo_update(self.engine, batch, self.config, self._policy_loss_fn, "actor")

    def _policy_loss_fn(self, denominator: float, scale: int):
        cfg, vocab = self.config, self.engine.args.vocab_size

        def loss_fn(mb: dict, output: Tensor):
            logits = response_logits(output, mb)
            lp, ent = log_probs_and_entropy(
                logits, mb["responses"], vocab, cfg.temperature, True, entropy_grad=cfg.entropy_coeff != 0
            )
            mask = response_mask(mb).to(lp.dtype)
            pg, m = losses.policy_loss(
                lp, mb["old_log_probs"], mb["advantages"], mask, cfg.clip_ratio_low,
                cfg.clip_ratio_high, cfg.dual_clip_c, cfg.loss_agg_mode, denominator,
            )
            loss = pg - cfg.entropy_coeff * losses.entropy_bonus(ent, mask, cfg.loss_agg_mode, denominator)
            n = mask.sum()
            stats = {"pg_loss": pg.detach(), "tokens": n, "entropy_sum": (ent * mask).sum().detach(),
                     "clipfrac_sum": m["clipfrac"] * n, "approx_kl_sum": m["approx_kl"] * n}
            if cfg.use_kl_loss:
                kl = losses.agg_loss(
                    losses.kl_penalty(lp, mb["ref_log_prob"], cfg.kl_loss_type), mask,
                    cfg.loss_agg_mode, denominator,
                )
                loss = loss + cfg.kl_loss_coeff * kl
                stats["kl_loss"] = kl.detach()
            stats["loss"] = loss.detach()
            return loss * scale, stats

        return loss_fn
