"""Actor: per-token log-probs (and entropy) of responses, reference log-probs, PPO/GRPO updates.

Batch contract: mcore_rl.rl.batch. Who passes which rows and where results go:
mcore_rl.rl.minibatch (``dispatch='global'``: the same global batch everywhere, [B, R] results
on every rank; ``'sharded'``: each DP rank its own rows and results).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from mcore_rl.lora.layers import adapters_disabled
from mcore_rl.models.micro_batch import MicroBatch
from mcore_rl.models.mtp import MtpConfig, MtpConfigError
from mcore_rl.models.mtp_model import mtp_training
from mcore_rl.rl import losses
from mcore_rl.models.routing import ROUTED_EXPERTS
from mcore_rl.rl.batch import BatchError, attended_responses, response_mask, row_tokens, validate_batch
from mcore_rl.rl.engine import ModelEngine
from mcore_rl.rl.logprob import log_probs_and_entropy
from mcore_rl.rl.minibatch import forward_rows, ppo_update, response_logits
from mcore_rl.models.hf_config import ConfigError

Tensor = torch.Tensor
UPDATE_KEYS = ("old_log_probs", "advantages")


@dataclass(frozen=True)
class ActorConfig:
    """How the actor batches and what its policy loss is (names follow verl where they exist).

    Batch sizes count rows (= samples = responses), never prompts: with n samples per prompt
    verl's ``ppo_mini_batch_size`` (prompts) is ``ppo_mini_batch_size * n`` here.
    ``ppo_mini_batch_size``: global rows per optimizer step (over all DP ranks, in both dispatch
    modes). ``micro_batch_size``: rows per micro-batch on each DP rank (verl's
    ``ppo_micro_batch_size_per_gpu``). ``max_tokens_per_micro_batch``: dynamic batching — rows
    grouped by length up to this many padded tokens per micro-batch on each DP rank (verl's
    ``ppo_max_token_len_per_gpu``); replaces micro_batch_size when set. ``dispatch``: 'global'
    (every rank passes the whole batch) or 'sharded' (each DP rank passes its own rows).
    ``use_remove_padding`` (verl's name): each micro-batch's real tokens packed into one stream
    (no compute on padding; with max_tokens_per_micro_batch rows are packed by real tokens).
    ``router_replay`` (MoE; verl's ``router_replay.mode``): 'R2' — compute_log_prob also returns
    ``routed_experts`` [B, S, MoE layers, top_k] and update_policy routes every token to the
    experts in ``batch['routed_experts']`` (the old policy's); 'R3' — the same replay, with the
    routes the rollout recorded; 'disabled' — fresh routing.
    """

    temperature: float = 1.0
    micro_batch_size: int = 4  # rows per micro-batch on each DP rank
    max_tokens_per_micro_batch: int | None = None  # dynamic batching by padded tokens per DP rank
    ppo_mini_batch_size: int = 16  # global rows (samples, not prompts) per optimizer step
    ppo_epochs: int = 1
    clip_ratio_low: float = 0.2
    clip_ratio_high: float | None = None  # None: symmetric; DAPO's clip-higher when larger
    dual_clip_c: float | None = None
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coeff: float = 0.0
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl", "abs"] = "low_var_kl"
    dispatch: Literal["global", "sharded"] = "global"
    use_remove_padding: bool = False  # verl's name: packed (padding-free) micro-batches
    router_replay: Literal["disabled", "R2", "R3"] = "disabled"
    # multi-token-prediction layers (verl's model.mtp.*): built when the checkpoint has them;
    # enable_train adds their loss to update_policy's gradient (metric actor/mtp_loss)
    mtp: MtpConfig = MtpConfig()


class Actor:
    """A trainable policy (``engine``) and an optional frozen reference policy."""

    def __init__(self, engine: ModelEngine, config: ActorConfig, ref: ModelEngine | None = None):
        self.engine, self.config, self.ref = engine, config, ref
        _check_router_replay(engine, config.router_replay)
        if config.mtp.enable_train and not engine.args.mtp_built:
            raise MtpConfigError(
                f"mtp.enable_train=true but the actor has no multi-token-prediction layers (the checkpoint holds "
                f"{engine.args.mtp_layers}, built: {engine.args.mtp_built}); set mtp.enable_train=false or use a "
                "checkpoint with MTP layers and mtp.enable=true.")
        self._mtp: mtp_training | None = None

    def _forward_log_probs(self, engine: ModelEngine, batch: dict, with_entropy: bool,
                           record_routing: bool = False, replay_routing: bool = False) -> dict:
        validate_batch(batch, vocab_size=engine.args.vocab_size)
        vocab = engine.args.vocab_size
        temperature = self.config.temperature

        def loss_fn(mb: MicroBatch, output: Tensor):
            logits = response_logits(output, mb)
            lp, ent = log_probs_and_entropy(logits, mb["responses"], vocab, temperature, with_entropy)
            real = attended_responses(mb).bool()
            out = {"log_probs": torch.where(real, lp, 0.0).detach()}
            if with_entropy:
                out["entropy"] = torch.where(real, ent, 0.0).detach()
            return lp.sum() * 0.0, out

        keys = ("log_probs", "entropy") if with_entropy else ("log_probs",)
        return forward_rows(engine, batch, self.config, loss_fn, keys, record_routing, replay_routing)

    @torch.no_grad()
    def compute_log_prob(self, batch: dict, with_entropy: bool = False) -> dict[str, Tensor]:
        """{'log_probs': [B, R]} (+ 'entropy' [B, R]) of the responses under the current policy,
        at ``config.temperature``; zeros at attention padding; on the batch's device. [B, R] on
        every rank with dispatch='global', this DP rank's rows with 'sharded'. With
        router_replay='R2' also 'routed_experts' [B, S, MoE layers, top_k] (-1 at padding)."""
        return self._forward_log_probs(self.engine, batch, with_entropy, self.config.router_replay == "R2")

    @torch.no_grad()
    def compute_ref_log_prob(self, batch: dict) -> Tensor:
        """[B, R] log-probs under the frozen reference policy (rows as compute_log_prob): the
        ``ref`` engine, or for a LoRA actor without one the same engine with its adapters off
        (the frozen base). Router replay (R2/R3) with ``batch['routed_experts']`` present (verl
        passes the actor's routes): the LoRA reference replays those routes, so base and policy
        differ by the adapters only; without them it routes afresh, as a separate reference
        engine always does."""
        if self.ref is not None:
            return self._forward_log_probs(self.ref, batch, False)["log_probs"]
        if not self.engine.has_adapters:
            raise ConfigError("this Actor has no reference model; pass Actor(..., ref=ModelEngine(...)) or "
                              "train with LoRA (lora.rank > 0), whose frozen base is the reference.")
        replay = self.config.router_replay != "disabled" and ROUTED_EXPERTS in batch
        with adapters_disabled(self.engine.model):
            return self._forward_log_probs(self.engine, batch, False, replay_routing=replay)["log_probs"]

    # ---- update --------------------------------------------------------------------------
    def update_policy(self, batch: dict) -> dict[str, float]:
        """PPO/GRPO update: ppo_epochs x mini-batches of ppo_mini_batch_size global rows, one
        optimizer step each. Needs old_log_probs and advantages [B, R] (+ ref_log_prob with
        use_kl_loss); the loss mask is ``response_mask`` when given. Returns metrics averaged
        over the steps, the same on every rank (names: the metrics table in docs/rl-api.md)."""
        keys = UPDATE_KEYS + (("ref_log_prob",) if self.config.use_kl_loss else ())
        validate_batch(batch, keys, vocab_size=self.engine.args.vocab_size)
        replay = self.config.router_replay != "disabled"
        if replay and ROUTED_EXPERTS not in batch:
            source = "compute_log_prob's output (R2)" if self.config.router_replay == "R2" else "the rollout (R3)"
            raise BatchError(
                f"router_replay={self.config.router_replay!r} needs batch[{ROUTED_EXPERTS!r}] "
                f"[B, S, MoE layers, top_k] from {source}; pass it or set router_replay='disabled'."
            )
        with mtp_training(self.engine.model, self.config.mtp) as self._mtp:
            try:
                return ppo_update(self.engine, batch, self.config, self._policy_loss_fn, "actor", replay)
            finally:
                self._mtp = None

    def _policy_loss_fn(self, denominator: float, scale: int):
        cfg, vocab = self.config, self.engine.args.vocab_size

        def loss_fn(mb: MicroBatch, output: Tensor):
            logits = response_logits(output, mb)
            lp, ent = log_probs_and_entropy(
                logits, mb["responses"], vocab, cfg.temperature, True, entropy_grad=cfg.entropy_coeff != 0
            )
            mask = response_mask(mb).bool()
            rows = row_tokens(mb)  # context parallelism: whole-row token counts
            pg, m = losses.policy_loss(
                lp, mb["old_log_probs"], mb["advantages"], mask, cfg.clip_ratio_low,
                cfg.clip_ratio_high, cfg.dual_clip_c, cfg.loss_agg_mode, denominator, rows,
            )
            loss = pg - cfg.entropy_coeff * losses.entropy_bonus(ent, mask, cfg.loss_agg_mode, denominator, rows)
            n = mask.sum()
            negative = (mask & (mb["advantages"] < 0)).sum()
            stats = {
                "pg_loss": pg.detach(), "tokens": n,
                "entropy_sum": torch.where(mask, ent, 0.0).sum().detach(),
                "pg_clipfrac_sum": m["clipfrac"] * n,
                # verl's pg_clipfrac_lower: share of all loss tokens the dual clip capped
                "pg_clipfrac_lower_sum": m["dual_clipfrac"] * negative,
                # verl's ppo_kl: mean of -log ratio = old_lp - lp
                "ppo_kl_sum": torch.where(mask, mb["old_log_probs"] - lp, 0.0).sum().detach(),
            }
            if cfg.use_kl_loss:
                kl = losses.agg_loss(
                    # ref outside the mask may be anything (inf, NaN): keep it out of the gradient
                    losses.kl_penalty(lp, torch.where(mask, mb["ref_log_prob"], 0.0), cfg.kl_loss_type), mask,
                    cfg.loss_agg_mode, denominator, rows,
                )
                loss = loss + cfg.kl_loss_coeff * kl
                stats["kl_loss"] = kl.detach()
            stats["loss"] = loss.detach()
            mtp = self._mtp.pop_loss() if self._mtp is not None else None
            if mtp is not None:  # token-weighted over micro-batches, as the other _sum metrics
                stats["mtp_loss_sum"] = mtp * n
            return loss * scale, stats

        return loss_fn


def _check_router_replay(engine: ModelEngine, mode: str) -> None:
    """Router replay needs MoE routers, and megatron replays each router's one target during a
    recomputed forward: with PP > 1 the schedule recomputes after later micro-batches' forwards."""
    if mode not in ("disabled", "R2", "R3"):
        raise ConfigError(f"router_replay={mode!r}; use 'disabled', 'R2' or 'R3'.")
    if mode == "disabled":
        return
    if engine.routing is None:
        raise ConfigError(f"router_replay={mode!r} needs an MoE model; {engine.args.arch.model_type} "
                          "here is dense. Set router_replay='disabled'.")
    if engine.config.recompute_granularity and engine.layout.pp > 1:
        raise ConfigError(
            f"router_replay={mode!r} with recompute ({engine.config.recompute_granularity}) and "
            f"pp({engine.layout.pp}) is not supported: a recomputed forward would replay another "
            "micro-batch's routes. Turn recompute off or use pp=1."
        )
