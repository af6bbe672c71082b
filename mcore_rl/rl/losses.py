"""Pure-torch RL losses for PPO, GRPO and DAPO, plus GAE / GRPO advantage estimators.

Conventions: every per-token tensor is ``[b, t]`` over response tokens; ``mask`` is ``[b, t]``
(1 = real response token, 0 = padding), float or bool. Padding positions may hold any value
(even inf/NaN): they are selected away with ``torch.where``, never multiplied by zero.
"""
from __future__ import annotations

import torch
from torch import Tensor
from mcore_rl.errors import McoreRLError

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
KL_KINDS = ("k1", "k2", "k3", "low_var_kl", "abs")
# exp(20) ~ 4.9e8: large enough never to bind on sane inputs, small enough to stay finite.
_LOG_RATIO_CLAMP = 20.0


class LossInputError(McoreRLError, ValueError):
    """Loss or estimator inputs of the wrong shape, dtype or range; the message says the fix."""


def _check_shapes(**tensors: Tensor) -> None:
    shapes = {name: tuple(x.shape) for name, x in tensors.items()}
    if len(set(shapes.values())) > 1:
        listed = ", ".join(f"{name}={shape}" for name, shape in shapes.items())
        raise LossInputError(f"shape mismatch: {listed}; all per-token tensors must be [b, t]")


def _zero_outside(valid: Tensor, x: Tensor) -> Tensor:
    """``x`` with 0 where ``valid`` is False: an inf/NaN input there would otherwise reach the
    gradient as 0 * NaN through the product rule even though the loss selects it away."""
    return torch.where(valid, x, torch.zeros_like(x))


def _masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``x`` over ``mask`` (bool, same shape); 0 when the mask is empty."""
    total = torch.where(mask, x, 0.0).sum()
    return total / mask.sum().clamp(min=1)


def agg_loss(loss_mat: Tensor, mask: Tensor, agg_mode: str,
             denominator: float | Tensor | None = None, row_tokens: Tensor | None = None) -> Tensor:
    """Reduce a per-token loss ``[b, t]`` to a scalar over the valid tokens in ``mask`` ``[b, t]``.

    ``token-mean``: sum over tokens / token count. ``seq-mean-token-sum``: per-sequence token sum,
    mean over sequences. ``seq-mean-token-mean``: per-sequence token mean, mean over sequences.
    Sequences without tokens are ignored. If ``denominator`` (float or 0-dim tensor) is given, the
    summed numerator is divided by it instead: the global token count (token-mean) or the global
    count of non-empty sequences (seq modes) of a mini-batch spread over micro-batches and DP
    ranks, so that summing the micro-batch results gives the whole-batch loss. ``row_tokens`` [b]:
    each sequence's token count when ``mask`` holds only part of it (a context-parallel rank's
    share), for ``seq-mean-token-mean``; default ``mask.sum(-1)``.
    """
    if agg_mode not in AGG_MODES:
        raise LossInputError(f"agg_mode={agg_mode!r} is not supported; use one of {', '.join(AGG_MODES)}")
    _check_shapes(loss_mat=loss_mat, mask=mask)
    if isinstance(denominator, Tensor) and denominator.dim() != 0:
        raise LossInputError(f"denominator has shape {tuple(denominator.shape)}; pass a float or 0-dim tensor")
    if isinstance(denominator, (int, float)) and denominator <= 0:
        raise LossInputError(f"denominator={denominator} must be > 0; pass the global token/sequence count")
    valid = mask.bool()
    masked = torch.where(valid, loss_mat, 0.0)
    if agg_mode == "token-mean":
        numerator, count = masked.sum(), valid.sum()
    else:
        per_seq = masked.sum(dim=-1)
        tokens = valid.sum(dim=-1)
        if agg_mode == "seq-mean-token-mean":
            # clamp: empty rows have a zero sum, so they stay 0 instead of 0/0
            per_seq = per_seq / (tokens if row_tokens is None else row_tokens).clamp(min=1)
        numerator, count = per_seq.sum(), (tokens > 0).sum()
    if denominator is None:
        # an all-padding batch gives 0, not NaN
        return numerator / count.clamp(min=1)
    return numerator / denominator


def kl_penalty(log_prob: Tensor, ref_log_prob: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of the policy from the reference, ``[b, t]`` in and out.

    ``k1``: lp - ref. ``k2``: 0.5 (lp - ref)^2. ``k3`` / ``low_var_kl``: r - log r - 1 with
    r = exp(ref - lp) (non-negative, unbiased, low variance). ``abs``: |lp - ref|.
    """
    if kind not in KL_KINDS:
        raise LossInputError(f"kl kind={kind!r} is not supported; use one of {', '.join(KL_KINDS)}")
    _check_shapes(log_prob=log_prob, ref_log_prob=ref_log_prob)
    diff = log_prob - ref_log_prob
    if kind == "k1":
        return diff
    if kind == "k2":
        return 0.5 * diff.square()
    if kind == "abs":
        return diff.abs()
    # clamp the log-ratio to [-20, 20] before exp so a far-off token cannot overflow to inf/NaN
    log_ratio = (-diff).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return log_ratio.exp() - log_ratio - 1.0


def policy_loss(log_prob: Tensor, old_log_prob: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float | None = None,
                dual_clip_c: float | None = None, agg_mode: str = "token-mean",
                denominator: float | Tensor | None = None,
                row_tokens: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss; all inputs ``[b, t]``, returns (scalar loss, metrics).

    ratio = exp(lp - old_lp) is clipped to [1 - clip_low, 1 + clip_high]; ``clip_high`` defaults
    to ``clip_low`` (a larger one is DAPO's "clip-higher"). ``dual_clip_c`` (> 1; Ye et al. 2020)
    caps the loss of negative-advantage tokens at -adv * c. Metrics are detached 0-dim masked token
    means over ``mask`` (``denominator`` is not used for them): ``clipfrac`` (clip active),
    ``approx_kl`` (k2 estimator 0.5 (lp - old_lp)^2), ``ratio_mean``, ``dual_clipfrac`` (share of
    negative-advantage tokens whose loss the dual clip capped; 0 when disabled).
    """
    if clip_high is None:
        clip_high = clip_low
    if clip_low < 0 or clip_high < 0:
        raise LossInputError(f"clip_low={clip_low}, clip_high={clip_high} must be >= 0; typical is 0.2")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise LossInputError(f"dual_clip_c={dual_clip_c} must be > 1 (typical 3.0); pass None to disable it")
    _check_shapes(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages, mask=mask)
    valid = mask.bool()
    old_log_prob, advantages = _zero_outside(valid, old_log_prob), _zero_outside(valid, advantages)
    log_ratio = log_prob - old_log_prob
    # clamp before exp: padding or stale tokens with huge log-ratios would give inf and NaN grads
    ratio = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP).exp()
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    clipped = torch.maximum(pg1, pg2)
    loss_mat = clipped
    negative = valid & (advantages < 0)
    dual_active = torch.zeros_like(valid)
    if dual_clip_c is not None:
        cap = -advantages * dual_clip_c
        # the cap only applies to negative advantages, where an unbounded ratio is unbounded loss
        loss_mat = torch.where(advantages < 0, torch.minimum(clipped, cap), clipped)
        dual_active = negative & (cap < clipped)
    loss = agg_loss(loss_mat, mask, agg_mode, denominator, row_tokens)
    with torch.no_grad():  # metrics are for logging only
        metrics = {
            "clipfrac": _masked_mean((pg2 > pg1).to(log_prob.dtype), valid),
            "approx_kl": _masked_mean(0.5 * log_ratio.square(), valid),
            "ratio_mean": _masked_mean(ratio, valid),
            "dual_clipfrac": dual_active.sum().to(log_prob.dtype) / negative.sum().clamp(min=1),
        }
    return loss, metrics


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor,
               clip_range: float | None = None, agg_mode: str = "token-mean",
               denominator: float | Tensor | None = None,
               row_tokens: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Critic loss 0.5 (v - R)^2, optionally PPO value-clipped; inputs ``[b, t]``.

    With ``clip_range``: v_clip = old_v + clamp(v - old_v, -c, c) and the per-token loss is
    0.5 max((v - R)^2, (v_clip - R)^2). Returns (scalar loss, metrics) with detached 0-dim masked
    means ``vf_clipfrac`` (clipped term larger; 0 without clipping) and ``vpred_mean``.
    """
    if clip_range is not None and clip_range <= 0:
        raise LossInputError(f"clip_range={clip_range} must be > 0; pass None to disable value clipping")
    _check_shapes(values=values, old_values=old_values, returns=returns, mask=mask)
    valid = mask.bool()
    old_values, returns = _zero_outside(valid, old_values), _zero_outside(valid, returns)
    unclipped = (values - returns).square()
    if clip_range is None:
        loss_mat = 0.5 * unclipped
        clip_active = torch.zeros_like(valid)
    else:
        v_clipped = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (v_clipped - returns).square()
        loss_mat = 0.5 * torch.maximum(unclipped, clipped)
        clip_active = clipped > unclipped
    loss = agg_loss(loss_mat, mask, agg_mode, denominator, row_tokens)
    with torch.no_grad():  # metrics are for logging only
        metrics = {
            "vf_clipfrac": _masked_mean(clip_active.to(values.dtype), valid),
            "vpred_mean": _masked_mean(values, valid),
        }
    return loss, metrics


def entropy_bonus(entropy: Tensor, mask: Tensor, agg_mode: str = "token-mean",
                  denominator: float | Tensor | None = None, row_tokens: Tensor | None = None) -> Tensor:
    """Aggregated per-token entropy ``[b, t]`` -> scalar; the caller subtracts coeff * this."""
    return agg_loss(entropy, mask, agg_mode, denominator, row_tokens)


@torch.no_grad()
def compute_gae(token_rewards: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0,
                lam: float = 1.0) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation; inputs and both outputs are ``[b, t]``.

    Runs backwards over the valid tokens of each row only: padding is skipped (a gap in the middle
    is not a step), the value after the last valid token is 0. returns = advantages + values.
    Padding positions of both outputs are 0. No gradient flows (values are treated as targets).
    """
    _check_shapes(token_rewards=token_rewards, values=values, mask=mask)
    valid = mask.bool()
    advantages = torch.zeros_like(values)
    # carried per row: the value and the advantage of the next *valid* token
    next_value = values.new_zeros(values.shape[0])
    next_adv = values.new_zeros(values.shape[0])
    for i in reversed(range(values.shape[1])):
        m = valid[:, i]
        delta = token_rewards[:, i] + gamma * next_value - values[:, i]
        adv = delta + gamma * lam * next_adv
        advantages[:, i] = torch.where(m, adv, 0.0)
        # on padding, keep carrying the state so the step skips the gap
        next_value = torch.where(m, values[:, i], next_value)
        next_adv = torch.where(m, adv, next_adv)
    returns = torch.where(valid, advantages + values, 0.0)
    return advantages, returns


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise ``x`` ``[b, t]`` to unit variance over the valid tokens of ``mask`` ``[b, t]``.

    Uses the masked mean and the biased (population, divide by N) variance:
    (x - mean) / sqrt(var + eps), plus the mean back if ``shift_mean`` is False. Padding -> 0.
    """
    _check_shapes(x=x, mask=mask)
    valid = mask.bool()
    mean = _masked_mean(x, valid)
    var = _masked_mean((x - mean).square(), valid)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(valid, out, 0.0)


def grpo_advantages(scores: Tensor, group_ids: Tensor, norm_by_std: bool = True,
                    eps: float = 1e-6) -> Tensor:
    """GRPO advantages ``[b]`` from one score per response ``[b]`` and its prompt's group id ``[b]``.

    advantage = (score - group mean) / (group std + eps) with the sample (unbiased, N - 1) std, as
    torch.std and verl's GRPO; a group of one gets 0 (its std is taken as 1). With
    ``norm_by_std=False`` only the group mean is subtracted (Dr. GRPO).
    """
    if scores.dim() != 1 or group_ids.shape != scores.shape:
        raise LossInputError(f"scores {tuple(scores.shape)} and group_ids {tuple(group_ids.shape)} "
                         "must both be 1-D [b]; pass one score and one group id per response")
    if group_ids.is_floating_point():
        raise LossInputError(f"group_ids has dtype {group_ids.dtype}; pass integer ids (e.g. .long())")
    if not scores.is_floating_point():
        scores = scores.to(torch.get_default_dtype())  # integer rewards: means need a float dtype
    _, group = torch.unique(group_ids, return_inverse=True)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count.index_add_(0, group, torch.ones_like(scores))
    total = torch.zeros_like(count).index_add_(0, group, scores)
    centred = scores - (total / count)[group]
    if not norm_by_std:
        return centred
    sq = torch.zeros_like(count).index_add_(0, group, centred.square())
    # a singleton has no spread: std 1 keeps its (already 0) advantage finite
    std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), 1.0)
    return centred / (std[group] + eps)


def broadcast_to_tokens(per_seq: Tensor, mask: Tensor) -> Tensor:
    """Spread one value per sequence ``[b]`` over its valid tokens ``[b, t]``; padding gets 0."""
    if per_seq.dim() != 1 or mask.dim() != 2 or per_seq.shape[0] != mask.shape[0]:
        raise LossInputError(f"per_seq {tuple(per_seq.shape)} must be [b] and mask {tuple(mask.shape)} "
                         "[b, t] with the same b")
    return torch.where(mask.bool(), per_seq[:, None], 0.0).to(per_seq.dtype)


def global_denominator(mask: Tensor, agg_mode: str) -> float:
    """What agg_loss divides by for a whole mini-batch [b, t]: its token count (token-mean) or
    its number of non-empty sequences (seq-mean-*). Micro-batch losses aggregated with it sum
    to the mini-batch loss."""
    if agg_mode not in AGG_MODES:
        raise LossInputError(f"agg_mode={agg_mode!r} is not supported; use one of {', '.join(AGG_MODES)}")
    if agg_mode == "token-mean":
        return float(max(mask.sum().item(), 1))
    return float(max((mask.sum(-1) > 0).sum().item(), 1))
