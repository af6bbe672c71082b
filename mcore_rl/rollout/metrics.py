"""Rollout-versus-training mismatch metrics, with the names and definitions of verl's
``rollout_corr`` diagnostics (``verl/trainer/ppo/rollout_corr_helper.py``): inputs are the
trainer's old log-probs and the rollout engine's log-probs of the same sampled tokens."""
from __future__ import annotations

import torch

from mcore_rl.rollout.engine import RolloutError

Tensor = torch.Tensor
SAFETY_BOUND = 20.0  # |log ratio| clamp before exponentiating, as verl does


def _mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    if dim is None:
        return (x * mask).sum() / mask.sum()
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def rollout_corr_metrics(old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor) -> dict[str, float]:
    """``rollout_corr/*`` metrics from log-probs [B, R] and the response mask [B, R] (1 = token).

    kl = E[rollout - old]; k3_kl = E[exp(r) - r - 1] with r = old - rollout; log_ppl_diff = batch
    mean over rows of (row mean rollout - row mean old); chi2_token = E[exp(clamp(r))^2] - 1."""
    mask = mask.to(old_log_probs.dtype)
    if not mask.any():
        raise RolloutError("rollout_corr_metrics needs at least one response token (the mask is all 0); "
                           "pass a batch with a non-empty response.")
    old, roll = old_log_probs.double(), rollout_log_probs.double()
    mask = mask.double()
    rows = mask.sum(-1) > 0
    log_ratio = old - roll
    row_old, row_roll = _mean(old, mask, -1)[rows], _mean(roll, mask, -1)[rows]
    log_ppl_diff = row_roll - row_old
    rho = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    out = {
        "training_log_ppl": (-row_old).mean(),
        "rollout_log_ppl": (-row_roll).mean(),
        "kl": _mean(roll - old, mask),
        "k3_kl": _mean(torch.exp(log_ratio) - log_ratio - 1, mask),
        "log_ppl_diff": log_ppl_diff.mean(),
        "log_ppl_abs_diff": log_ppl_diff.abs().mean(),
        "chi2_token": _mean(rho.square(), mask) - 1.0,
        "max_abs_log_prob_diff": (log_ratio.abs() * mask).max(),
    }
    return {f"rollout_corr/{k}": float(v) for k, v in out.items()}
