"""Per-token log-probabilities and entropy from vocab-parallel logits.

The logits stay split over TP ranks ([..., V/tp] each): max, sum-exp, the label's logit and the
entropy's expectation are reduced across TP as scalars per token, so no rank ever holds a
[tokens, vocab] tensor. Padding columns (ids >= the real vocab size, added so the vocab divides
by TP) are excluded, so they never reach log-probs, entropy or sampling.

Memory: like megatron's ``VocabParallelCrossEntropy``, a custom autograd function works on one
fp32 copy of the shard in place (scaled -> shifted -> exp -> softmax) and saves only that softmax
[tokens, V/tp] plus per-token vectors for backward, which turns the softmax into the gradient in
place. Elementwise temporaries are bounded to row chunks of ``_CHUNK_ELEMENTS``.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from torch.autograd.function import once_differentiable

from mcore_rl.errors import McoreRLError

Tensor = torch.Tensor

# elements per row chunk of the temporaries in the entropy paths (4 MiB of fp32)
_CHUNK_ELEMENTS = 1 << 20


class LogProbError(McoreRLError, ValueError):
    """Bad input to the vocab-parallel log-prob / entropy computation."""


def _shard_range(shard_width: int) -> tuple[int, int]:
    rank = parallel_state.get_tensor_model_parallel_rank()
    return rank * shard_width, (rank + 1) * shard_width


def _real_columns(shard_width: int, vocab_size: int) -> int:
    """How many leading columns of this rank's shard are real vocab (the rest is padding)."""
    start, _ = _shard_range(shard_width)
    return max(0, min(shard_width, vocab_size - start))


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise LogProbError(f"temperature={temperature} must be > 0; use 1.0 for the raw policy.")


def masked_scaled_logits(logits: Tensor, vocab_size: int, temperature: float) -> Tensor:
    """logits [..., V/tp] / temperature in fp32 with padding columns set to -inf (one new shard).

    Differentiable; the division and the padding fill happen in place on the one fp32 copy.
    """
    _check_temperature(temperature)
    scaled = logits.to(torch.float32, copy=True)
    if temperature != 1.0:
        scaled.div_(temperature)
    real = _real_columns(logits.shape[-1], vocab_size)
    if real < logits.shape[-1]:  # this shard holds padding columns (always a suffix)
        scaled[..., real:] = float("-inf")
    return scaled


def _tp_all_reduce(x: Tensor, op: torch.distributed.ReduceOp) -> Tensor:
    """In-place all-reduce over megatron's TP group (a no-op at TP=1)."""
    if parallel_state.get_tensor_model_parallel_world_size() > 1:
        torch.distributed.all_reduce(x, op=op, group=parallel_state.get_tensor_model_parallel_group())
    return x


def _row_chunks(rows: int, width: int):
    step = max(1, _CHUNK_ELEMENTS // max(width, 1))
    for begin in range(0, rows, step):
        yield slice(begin, min(rows, begin + step))


def _exp_in_place(real: Tensor, with_entropy: bool) -> tuple[Tensor, Tensor]:
    """real [N, R] shifted logits -> exp(real) in place; returns sum_j e_j and sum_j e_j * s_j [N]."""
    if not with_entropy:
        real.exp_()
        return real.sum(dim=-1), torch.zeros(0, device=real.device)
    weighted = torch.empty(real.shape[0], device=real.device, dtype=real.dtype)
    for rows in _row_chunks(*real.shape):
        chunk = real[rows]
        exp = chunk.exp()  # the only temporary: one row chunk
        weighted[rows] = chunk.mul_(exp).sum(dim=-1)
        chunk.copy_(exp)
    return real.sum(dim=-1), weighted


class _VocabParallelLogProb(torch.autograd.Function):
    """(log p(label), entropy) [N] of softmax(logits / T) over the real vocab, logits [N, V/tp]."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_size, temperature, with_entropy, entropy_grad, need_grad):
        ctx.set_materialize_grads(False)  # an unused output (e.g. the entropy) costs no backward
        rows, width = labels.numel(), logits.shape[-1]
        work = torch.empty((rows, width), dtype=torch.float32, device=logits.device)
        work.view(logits.shape).copy_(logits)  # the one [N, V/tp] fp32 buffer, reused in place
        n_real = _real_columns(width, vocab_size)
        real = work[:, :n_real]  # padding columns are never read
        if temperature != 1.0:
            real.div_(temperature)
        if n_real > 0:
            shift = real.max(dim=-1).values
        else:  # a shard made only of padding: the other ranks hold the max
            shift = torch.full((rows,), float("-inf"), device=work.device)
        real.sub_(_tp_all_reduce(shift, torch.distributed.ReduceOp.MAX).unsqueeze(-1))

        start, _ = _shard_range(width)
        local = (labels.reshape(-1) - start).clamp(0, max(n_real - 1, 0))
        in_shard = (labels.reshape(-1) >= start) & (labels.reshape(-1) < start + n_real)
        picked = torch.zeros(rows, device=work.device)
        if n_real > 0:
            picked = torch.where(in_shard, real.gather(-1, local.unsqueeze(-1)).squeeze(-1), picked)
        sum_exp, weighted = _exp_in_place(real, with_entropy)
        # one collective for all per-token sums: [label logit, sum exp, (sum exp * shifted)]
        stats = _tp_all_reduce(torch.cat([picked, sum_exp, weighted]), torch.distributed.ReduceOp.SUM)
        log_z = stats[rows : 2 * rows].log()
        log_prob, entropy = (stats[:rows] - log_z).view(labels.shape), None
        if with_entropy:  # H = log Z - E_p[shifted]
            entropy = (log_z - stats[2 * rows :] / stats[rows : 2 * rows]).view(labels.shape)

        ctx.shape, ctx.dtype, ctx.temperature, ctx.done = logits.shape, logits.dtype, temperature, False
        ctx.entropy_grad = with_entropy and entropy_grad
        if need_grad:
            real.div_(stats[rows : 2 * rows].unsqueeze(-1))  # exp -> softmax p, in place
            work[:, n_real:] = 0.0  # padding has p = 0, hence gradient 0
            ctx.save_for_backward(work, local, in_shard, entropy if ctx.entropy_grad else None)
        if entropy is not None and not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        return log_prob, entropy

    @staticmethod
    @once_differentiable  # the gradient is computed in place, outside autograd
    def backward(ctx, grad_log_prob, grad_entropy):
        if ctx.done:
            raise LogProbError(
                "log_probs_and_entropy's backward ran twice on one graph (retain_graph=True): its "
                "saved softmax becomes the gradient in place; recompute the forward instead."
            )
        ctx.done = True
        grad, local, in_shard, entropy = ctx.saved_tensors  # grad: softmax p [N, V/tp], reused
        if not ctx.entropy_grad:
            grad_entropy = None
        if grad_log_prob is None and grad_entropy is None:
            return (None,) * 7
        _softmax_to_grad(grad, local, in_shard, entropy, grad_log_prob, grad_entropy)
        if ctx.temperature != 1.0:
            grad.div_(ctx.temperature)
        return grad.view(ctx.shape).to(ctx.dtype), None, None, None, None, None, None


def _softmax_to_grad(p, local, in_shard, entropy, g_lp, g_ent) -> None:
    """p [N, V/tp] -> dL/d(z/T) in place for L = sum(g_lp * log p_y + g_ent * H), g_* [N] or None:
    g_lp * (onehot_y - p) - g_ent * p * (log p + H)
    = p * (-g_lp - g_ent * H) - g_ent * p log p + g_lp * onehot_y.
    """
    g_lp = None if g_lp is None else g_lp.reshape(-1)
    if g_ent is None:
        p.mul_(-g_lp.unsqueeze(-1))
    else:
        g_ent = g_ent.reshape(-1)
        coeff = -g_ent * entropy.reshape(-1) if g_lp is None else -g_lp - g_ent * entropy.reshape(-1)
        for rows in _row_chunks(*p.shape):
            chunk = p[rows]
            p_log_p = torch.xlogy(chunk, chunk)  # the only temporary: one row chunk; 0 where p = 0
            chunk.mul_(coeff[rows].unsqueeze(-1)).addcmul_(p_log_p, g_ent[rows].unsqueeze(-1), value=-1.0)
    if g_lp is not None:  # + g_lp at the label's column, on the rank whose shard holds it
        p.scatter_add_(-1, local.unsqueeze(-1), torch.where(in_shard, g_lp, 0.0).unsqueeze(-1))


def _check_inputs(logits: Tensor, labels: Tensor, vocab_size: int, temperature: float) -> None:
    _check_temperature(temperature)
    if logits.shape[:-1] != labels.shape:
        raise LogProbError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree: logits must be "
            "labels' shape + [vocab shard] (this rank's V/tp columns)."
        )
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if not 0 < vocab_size <= logits.shape[-1] * tp:
        raise LogProbError(
            f"vocab_size={vocab_size} does not fit the logits: {tp} TP shards of {logits.shape[-1]} "
            "columns; pass the model's real (unpadded) vocab size."
        )
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise LogProbError(f"labels have dtype {labels.dtype}; pass integer token ids.")
    # one host sync; a label in the padding or out of range would silently give a wrong log-prob
    if labels.numel() and not (0 <= labels.min().item() and labels.max().item() < vocab_size):
        raise LogProbError(
            f"labels range over [{labels.min().item()}, {labels.max().item()}] but must be token ids in "
            f"[0, vocab_size={vocab_size}); mask padding positions with a valid id such as 0."
        )


def log_probs_and_entropy(
    logits: Tensor,
    labels: Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log p(labels) [...] and optionally the entropy [...] of softmax(logits / temperature), fp32.

    logits: [..., V/tp], this rank's vocab shard (megatron's parallel_output), any float dtype
    (computed in fp32; the gradient comes back in the logits' dtype); labels: [...] token ids
    < vocab_size. Differentiable; gradients flow into every shard. Backward keeps one fp32
    [..., V/tp] tensor and may run once per forward. ``entropy_grad=False`` returns a detached
    entropy (a metric only: it adds no backward work).
    """
    _check_inputs(logits, labels, vocab_size, temperature)
    need_grad = torch.is_grad_enabled() and logits.requires_grad
    log_prob, entropy = _VocabParallelLogProb.apply(
        logits, labels, vocab_size, float(temperature), with_entropy, entropy_grad, need_grad
    )
    return log_prob, entropy
