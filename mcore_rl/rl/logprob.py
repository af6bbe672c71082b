"""Per-token log-probabilities and entropy from vocab-parallel logits.

The logits stay split over TP ranks ([..., V/tp] each): max, sum-exp, the label's logit and the
entropy's expectation are reduced across TP as scalars per token, so no rank ever holds a
[tokens, vocab] tensor. Padding columns (ids >= the real vocab size, added so the vocab divides
by TP) are excluded, so they never reach log-probs, entropy or sampling.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

Tensor = torch.Tensor


def _shard_range(shard_width: int) -> tuple[int, int]:
    rank = parallel_state.get_tensor_model_parallel_rank()
    return rank * shard_width, (rank + 1) * shard_width


def masked_scaled_logits(logits: Tensor, vocab_size: int, temperature: float) -> Tensor:
    """logits [..., V/tp] / temperature with padding columns set to -inf (one new shard)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be > 0; use 1.0 for the raw policy.")
    start, end = _shard_range(logits.shape[-1])
    scaled = logits.float() / temperature
    if end > vocab_size:  # this shard holds padding columns
        padding = torch.arange(start, end, device=logits.device) >= vocab_size
        scaled = scaled.masked_fill(padding, float("-inf"))
    return scaled


def _all_max(x: Tensor) -> Tensor:
    x = x.detach().clone()  # the max only shifts for stability: no gradient through it
    torch.distributed.all_reduce(
        x, op=torch.distributed.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group()
    )
    return x


def log_probs_and_entropy(
    logits: Tensor,
    labels: Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """log p(labels) [...] and optionally the entropy [...] of softmax(logits / temperature).

    logits: [..., V/tp], this rank's vocab shard (megatron's parallel_output); labels: [...]
    token ids < vocab_size. Differentiable; gradients flow into every shard.
    ``entropy_grad=False`` returns a detached entropy (a metric only: no backward through it).
    """
    scaled = masked_scaled_logits(logits, vocab_size, temperature)
    start, end = _shard_range(scaled.shape[-1])
    shift = _all_max(scaled.max(dim=-1).values)
    shifted = scaled - shift.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
    log_z = sum_exp.log()
    in_shard = (labels >= start) & (labels < end)
    local = (labels - start).clamp(0, end - start - 1)
    picked = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1)
    # where(), not a product: a shard made only of padding columns holds -inf, and -inf * 0 = nan
    picked = torch.where(in_shard, picked, torch.zeros_like(picked))
    log_prob = reduce_from_tensor_model_parallel_region(picked) - log_z
    if not with_entropy:
        return log_prob, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        # H = log Z - E_p[shifted]; padding columns have exp = 0: mask before multiplying -inf
        weighted = (exp * shifted.masked_fill(exp == 0, 0.0)).sum(dim=-1)
        expected = reduce_from_tensor_model_parallel_region(weighted) / sum_exp
        entropy = log_z - expected
    return log_prob, entropy if entropy_grad else entropy.detach()
