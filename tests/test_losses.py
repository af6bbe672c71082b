"""RL losses checked against naive per-sequence / per-token Python loops (float64, atol 1e-6)."""
from __future__ import annotations

import math
import statistics

import pytest
import torch

from mcore_rl.rl.losses import (AGG_MODES, agg_loss, broadcast_to_tokens, compute_gae,
                                entropy_bonus, grpo_advantages, kl_penalty, policy_loss,
                                value_loss, whiten)

T = 8
# rows: fully padded, right padded, left padded, middle gaps, full, single token, gap at both ends
MASK_ROWS = [
    [0, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 1, 1, 1, 0, 0, 0],
    [0, 0, 0, 1, 1, 1, 1, 1],
    [1, 1, 0, 0, 1, 0, 1, 1],
    [1, 1, 1, 1, 1, 1, 1, 1],
    [0, 0, 0, 0, 1, 0, 0, 0],
    [0, 1, 1, 0, 1, 1, 1, 0],
]


def make_mask(dtype=torch.float64) -> torch.Tensor:
    return torch.tensor(MASK_ROWS, dtype=dtype)


def randn(seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(MASK_ROWS), T, generator=g, dtype=torch.float64) * scale


def close(actual: torch.Tensor, expected) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual.to(torch.float64), expected, atol=1e-6, rtol=0)


def ref_agg(loss, mask, mode, denominator=None) -> float:
    """Loop reference: collect each row's valid tokens, then reduce."""
    rows = [[v for v, m in zip(lr, mr) if m] for lr, mr in zip(loss.tolist(), mask.tolist())]
    if mode == "token-mean":
        tokens = [v for row in rows for v in row]
        num, count = sum(tokens), len(tokens)
    else:
        seqs = [sum(r) if mode == "seq-mean-token-sum" else sum(r) / len(r) for r in rows if r]
        num, count = sum(seqs), len(seqs)
    if denominator is not None:
        return num / denominator
    return num / count if count else 0.0


def ref_masked_mean(values, mask) -> float:
    picked = [v for vr, mr in zip(values, mask.tolist()) for v, m in zip(vr, mr) if m]
    return sum(picked) / len(picked)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("mask_dtype", [torch.float64, torch.bool])
def test_agg_loss_matches_loops(mode, mask_dtype):
    loss, mask = randn(0), make_mask(mask_dtype)
    loss[mask == 0] = float("nan")  # padding garbage must not leak into the result
    close(agg_loss(loss, mask, mode), ref_agg(loss, mask, mode))
    close(entropy_bonus(loss, mask, mode), ref_agg(loss, mask, mode))
    assert float(agg_loss(loss, torch.zeros_like(mask), mode)) == 0.0  # all padding: 0, not NaN


@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_denominator_splits_micro_batches(mode):
    loss, mask = randn(1), make_mask()
    tokens, seqs = int(mask.sum()), int((mask.sum(-1) > 0).sum())
    global_denom = tokens if mode == "token-mean" else seqs
    whole = agg_loss(loss, mask, mode)
    for denom in (float(global_denom), torch.tensor(float(global_denom), dtype=torch.float64)):
        parts = agg_loss(loss[:3], mask[:3], mode, denom) + agg_loss(loss[3:], mask[3:], mode, denom)
        close(parts, whole)
    close(agg_loss(loss, mask, mode, 5.0), ref_agg(loss, mask, mode, 5.0))
    # without the global denominator each micro-batch is normalised locally: a different number
    local = agg_loss(loss[:3], mask[:3], mode) + agg_loss(loss[3:], mask[3:], mode)
    assert abs(float(local) - float(whole)) > 1e-3


def test_agg_loss_errors():
    loss, mask = randn(3), make_mask()
    msg = "agg_mode='foo' is not supported; use one of token-mean, seq-mean-token-sum, seq-mean-token-mean"
    with pytest.raises(ValueError, match=msg):
        agg_loss(loss, mask, "foo")
    with pytest.raises(ValueError, match=r"shape mismatch: loss_mat=\(7, 8\), mask=\(7, 7\)"):
        agg_loss(loss, mask[:, :7], "token-mean")
    with pytest.raises(ValueError, match="denominator=0.0 must be > 0"):
        agg_loss(loss, mask, "token-mean", 0.0)


def ref_kl(lp: float, ref: float, kind: str) -> float:
    d = lp - ref
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "abs":
        return abs(d)
    r = math.exp(max(-20.0, min(20.0, ref - lp)))
    return r - math.log(r) - 1


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl", "abs"])
def test_kl_penalty_matches_loops(kind):
    lp, ref = randn(4), randn(5)
    out = kl_penalty(lp, ref, kind)
    expected = [[ref_kl(a, b, kind) for a, b in zip(ra, rb)] for ra, rb in zip(lp.tolist(), ref.tolist())]
    close(out, expected)


def test_kl_k3_is_stable_for_far_tokens():
    lp = torch.tensor([[-500.0, 0.0]], dtype=torch.float64)
    out = kl_penalty(lp, lp.flip(-1), "k3")
    assert torch.isfinite(out).all()
    close(out, [[math.exp(20) - 21, math.exp(-20) + 19]])


def test_kl_penalty_bad_kind():
    msg = "kl kind='k4' is not supported; use one of k1, k2, k3, low_var_kl, abs"
    with pytest.raises(ValueError, match=msg):
        kl_penalty(randn(0), randn(1), "k4")


def ref_policy(lp, old, adv, mask, clip_low, clip_high, dual_c, mode):
    """Token-by-token PPO surrogate with explicit branches."""
    clip_high = clip_low if clip_high is None else clip_high
    loss, sums = [], dict(n=0, clip=0, kl=0.0, ratio=0.0, neg=0, dual=0)
    for rl, ro, ra, rm in zip(lp.tolist(), old.tolist(), adv.tolist(), mask.tolist()):
        row = []
        for a, o, A, m in zip(rl, ro, ra, rm):
            r = math.exp(a - o)
            unclipped, clipped = -A * r, -A * min(max(r, 1 - clip_low), 1 + clip_high)
            value = clipped if clipped > unclipped else unclipped
            dual = dual_c is not None and A < 0 and -A * dual_c < value
            row.append(-A * dual_c if dual else value)
            if m:
                for key, inc in [("n", 1), ("clip", clipped > unclipped), ("kl", 0.5 * (a - o) ** 2),
                                 ("ratio", r), ("neg", A < 0), ("dual", dual)]:
                    sums[key] += inc
        loss.append(row)
    n = sums["n"]
    metrics = dict(clipfrac=sums["clip"] / n, approx_kl=sums["kl"] / n, ratio_mean=sums["ratio"] / n,
                   dual_clipfrac=sums["dual"] / sums["neg"])
    return ref_agg(torch.tensor(loss), mask, mode), metrics


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("clip_low,clip_high,dual_c", [
    (0.2, None, None), (0.2, 0.28, None), (0.2, None, 3.0), (0.1, 0.3, 1.5)])
def test_policy_loss_matches_loops(mode, clip_low, clip_high, dual_c):
    old, adv, mask = randn(6), randn(7), make_mask()
    lp = old + randn(8, scale=1.2)  # ratios spread well past both clip bounds
    loss, metrics = policy_loss(lp, old, adv, mask, clip_low, clip_high, dual_c, mode)
    exp_loss, exp_metrics = ref_policy(lp, old, adv, mask, clip_low, clip_high, dual_c, mode)
    close(loss, exp_loss)
    assert set(metrics) == set(exp_metrics)
    for name, value in exp_metrics.items():
        assert metrics[name].dim() == 0
        close(metrics[name], value)
    assert 0 < exp_metrics["clipfrac"] < 1  # inputs exercise both branches
    assert (0 < exp_metrics["dual_clipfrac"] < 1) if dual_c else exp_metrics["dual_clipfrac"] == 0


def test_policy_loss_hand_values():
    one = torch.ones(1, 1, dtype=torch.float64)
    lp = torch.log(torch.tensor([[1.25]], dtype=torch.float64))
    # adv > 0, ratio 1.25: clipped to 1.2 symmetric, untouched under clip-higher 0.28
    close(policy_loss(lp, 0 * one, one, one)[0], -1.2)
    close(policy_loss(lp, 0 * one, one, one, clip_high=0.28)[0], -1.25)
    # adv = -1, ratio 5: PPO loss 5, dual clip c=3 caps it at 3
    lp5 = torch.log(torch.tensor([[5.0]], dtype=torch.float64))
    loss, m = policy_loss(lp5, 0 * one, -one, one, dual_clip_c=3.0)
    close(loss, 3.0)
    close(m["dual_clipfrac"], 1.0)
    close(policy_loss(lp5, 0 * one, -one, one)[0], 5.0)


def test_policy_loss_padding_does_not_poison_gradients():
    old, adv, mask = randn(9), randn(10), make_mask()
    lp = randn(11).requires_grad_()
    with torch.no_grad():
        lp[mask == 0] = 1000.0  # garbage log-probs on padding
    loss, _ = policy_loss(lp, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert (lp.grad[mask == 0] == 0).all()


@pytest.mark.parametrize("c", [1.0, 0.5])
def test_policy_loss_bad_dual_clip(c):
    with pytest.raises(ValueError, match=rf"dual_clip_c={c} must be > 1 \(typical 3.0\); pass None"):
        policy_loss(randn(0), randn(1), randn(2), make_mask(), dual_clip_c=c)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("clip_range", [None, 0.2])
def test_value_loss_matches_loops(mode, clip_range):
    values, old, returns, mask = randn(12), randn(13), randn(14), make_mask()
    loss, metrics = value_loss(values, old, returns, mask, clip_range, mode)
    rows, flags = [], []
    for rv, ro, rr in zip(values.tolist(), old.tolist(), returns.tolist()):
        row, frow = [], []
        for v, o, R in zip(rv, ro, rr):
            plain = (v - R) ** 2
            vc = v if clip_range is None else o + min(max(v - o, -clip_range), clip_range)
            row.append(0.5 * max(plain, (vc - R) ** 2))
            frow.append(1.0 if (vc - R) ** 2 > plain else 0.0)
        rows.append(row)
        flags.append(frow)
    close(loss, ref_agg(torch.tensor(rows), mask, mode))
    close(metrics["vf_clipfrac"], ref_masked_mean(flags, mask))
    close(metrics["vpred_mean"], ref_masked_mean(values.tolist(), mask))
    if clip_range is not None:
        assert 0 < metrics["vf_clipfrac"] < 1


def ref_gae(rewards, values, mask, gamma, lam):
    """Per row: compact the valid tokens into a list, run textbook GAE, scatter back."""
    adv = [[0.0] * T for _ in MASK_ROWS]
    ret = [[0.0] * T for _ in MASK_ROWS]
    for i, mrow in enumerate(mask.tolist()):
        idx = [j for j, m in enumerate(mrow) if m]
        running = 0.0
        for k in range(len(idx) - 1, -1, -1):
            j = idx[k]
            next_v = values[i, idx[k + 1]].item() if k + 1 < len(idx) else 0.0
            running = rewards[i, j].item() + gamma * next_v - values[i, j].item() + gamma * lam * running
            adv[i][j], ret[i][j] = running, running + values[i, j].item()
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0)])
def test_compute_gae_matches_loops(gamma, lam):
    rewards, values, mask = randn(15), randn(16), make_mask()
    rewards[mask == 0] = 1e6  # padding rewards/values must be ignored
    values[mask == 0] = -1e6
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    exp_adv, exp_ret = ref_gae(rewards, values, mask, gamma, lam)
    close(adv, exp_adv)
    close(ret, exp_ret)


def test_compute_gae_monte_carlo_when_gamma_lam_one():
    rewards, values, mask = randn(17), randn(18), make_mask()
    adv, ret = compute_gae(rewards, values, mask)
    for i, mrow in enumerate(MASK_ROWS):
        for j in range(T):
            future = sum(rewards[i, k].item() for k in range(j, T) if mrow[k])
            close(ret[i, j], future if mrow[j] else 0.0)
            close(adv[i, j], future - values[i, j].item() if mrow[j] else 0.0)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_matches_population_std(shift_mean):
    x, mask = randn(19, scale=3.0) + 2.0, make_mask()
    picked = [v for v, m in zip(x.flatten().tolist(), mask.flatten().tolist()) if m]
    mean, var = statistics.fmean(picked), statistics.pvariance(picked)
    out = whiten(x, mask, shift_mean=shift_mean)
    expected = [[((v - mean) / math.sqrt(var + 1e-8) + (0 if shift_mean else mean)) * m
                 for v, m in zip(rv, rm)] for rv, rm in zip(x.tolist(), mask.tolist())]
    close(out, expected)


def ref_grpo(scores, ids, norm_by_std, eps):
    groups: dict[int, list[float]] = {}
    for s, g in zip(scores, ids):
        groups.setdefault(g, []).append(s)
    out = []
    for s, g in zip(scores, ids):
        members = groups[g]
        if len(members) == 1:
            out.append(0.0)
            continue
        centred = s - statistics.fmean(members)
        out.append(centred / (statistics.stdev(members) + eps) if norm_by_std else centred)
    return out


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantages_matches_loops(norm_by_std):
    # interleaved ids, a singleton group (7), a constant-score group (9) and a negative id
    ids = [3, 1, 3, 7, 1, 3, 9, 9, -2, 1, -2, 3]
    scores = torch.randn(len(ids), generator=torch.Generator().manual_seed(20), dtype=torch.float64)
    scores[6] = scores[7] = 0.5
    out = grpo_advantages(scores, torch.tensor(ids), norm_by_std=norm_by_std)
    close(out, ref_grpo(scores.tolist(), ids, norm_by_std, 1e-6))
    assert out[3] == 0.0 and out[6] == 0.0


def test_grpo_advantages_errors():
    with pytest.raises(ValueError, match=r"scores \(4,\) and group_ids \(3,\) must both be 1-D"):
        grpo_advantages(torch.zeros(4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="group_ids has dtype torch.float32; pass integer ids"):
        grpo_advantages(torch.zeros(4), torch.zeros(4))


def test_broadcast_to_tokens():
    per_seq = torch.arange(1, len(MASK_ROWS) + 1, dtype=torch.float64)
    out = broadcast_to_tokens(per_seq, make_mask(torch.bool))
    close(out, [[per_seq[i].item() if m else 0.0 for m in row] for i, row in enumerate(MASK_ROWS)])
    with pytest.raises(ValueError, match="per_seq .* must be \\[b\\] and mask"):
        broadcast_to_tokens(per_seq[:3], make_mask())
