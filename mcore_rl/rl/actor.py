"""Actor: per-token log-probs (and entropy) of responses, reference log-probs, PPO/GRPO updates.

Every rank calls these with the same global batch (see mcore_rl.rl.batch for the contract).
Each DP rank computes its slice of rows; results come back as [B, R] on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mcore_rl.rl import losses
from mcore_rl.rl.batch import (
    BatchError,
    concat_rows,
    response_mask,
    select_rows,
    split_by_tokens,
    split_rows,
    validate_batch,
)
from mcore_rl.rl.engine import ModelEngine, all_reduce_dp, dp_rank_size, gather_dp
from mcore_rl.rl.logprob import log_probs_and_entropy

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


def local_rows(batch: dict) -> dict:
    """This DP rank's contiguous slice of the global batch."""
    rank, size = dp_rank_size()
    b = batch["input_ids"].shape[0]
    if b % size != 0:
        raise BatchError(f"batch of {b} rows does not divide over {size} data-parallel ranks.")
    per = b // size
    return select_rows(batch, slice(rank * per, (rank + 1) * per))


def micro_batches(batch: dict, config: ActorConfig, engine: ModelEngine) -> list[dict]:
    """Fixed-size micro-batches, or token-budget ones that keep the pipeline schedule's rules."""
    if config.max_tokens_per_micro_batch:
        multiple = engine.layout.pp if engine.layout.vpp else 1
        return split_by_tokens(batch, config.max_tokens_per_micro_batch, multiple)
    return split_rows(batch, min(config.micro_batch_size, batch["input_ids"].shape[0]))


def response_logits(output: Tensor, batch: dict) -> Tensor:
    """Logits [b, R, V/tp] that predict the R response tokens (position p predicts p + 1)."""
    s, r = batch["input_ids"].shape[1], batch["responses"].shape[1]
    return output[:, s - r - 1 : s - 1]


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
        rows = batch["input_ids"].shape[0]
        self.engine.train(True)
        steps = []
        for _ in range(self.config.ppo_epochs):
            for mini in split_rows(batch, min(self.config.ppo_mini_batch_size, rows)):
                steps.append(self._update_mini_batch(mini))
        return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}

    def _update_mini_batch(self, mini: dict) -> dict[str, float]:
        mask = response_mask(mini)
        denominator = losses.global_denominator(mask, self.config.loss_agg_mode)
        pieces = micro_batches(local_rows(mini), self.config, self.engine)
        # megatron divides each micro-batch loss by the micro-batch count and DDP averages over
        # DP; with a global denominator the sum over all of them is the mini-batch loss
        scale = len(pieces) * dp_rank_size()[1]
        stats = self.engine.run(pieces, self._policy_loss_fn(denominator, scale), False)
        step = self.engine.step()
        totals = {k: all_reduce_dp(sum(s[k] for s in stats)) for k in stats[0]}
        tokens = totals.pop("tokens").clamp(min=1)
        metrics = {k.removesuffix("_sum"): float(v / tokens) for k, v in totals.items() if k.endswith("_sum")}
        metrics.update({k: float(v) for k, v in totals.items() if not k.endswith("_sum")})
        return {**{f"actor/{k}": v for k, v in metrics.items()}, **{f"actor/{k}": v for k, v in step.items()}}

    def _policy_loss_fn(self, denominator: float, scale: int):
        cfg, vocab = self.config, self.engine.args.vocab_size

        def loss_fn(mb: dict, output: Tensor):
            logits = response_logits(output, mb)
            lp, ent = log_probs_and_entropy(logits, mb["responses"], vocab, cfg.temperature, True)
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
