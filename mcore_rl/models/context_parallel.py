"""Context parallelism (CP) on padded batches, for any backend (exact, no approximation).

Layout (megatron's load-balanced split, which its RoPE expects): a sequence of s tokens (s a
multiple of 2*cp) is cut into 2*cp chunks of c = s/(2*cp); CP rank i holds chunks i and
2*cp-1-i, in that order, so every rank gets the same share of causal-attention work. Hidden
states of a rank cover its s/cp tokens only; attention all-gathers K and V over the CP group
(backward: all-reduce of the gathered grads, then this rank's slice: gloo has no
reduce-scatter) and masks by GLOBAL positions, so no key order needs restoring.
"""
from __future__ import annotations

import torch
from megatron.core import parallel_state

from mcore_rl.models.attention_ops import allowed_pairs

Tensor = torch.Tensor


def cp_rank_size() -> tuple[int, int]:
    """(rank, size) of this process in its context-parallel group."""
    return parallel_state.get_context_parallel_rank(), parallel_state.get_context_parallel_world_size()


def cp_columns(s: int, rank: int, size: int, device=None) -> Tensor:
    """[s/size] global columns held by CP ``rank`` of ``size`` (chunk rank, then chunk 2*size-1-rank)."""
    if s % (2 * size):
        raise ValueError(f"sequence length {s} is not a multiple of 2 * cp = {2 * size}")
    c = s // (2 * size)
    first = torch.arange(rank * c, (rank + 1) * c, device=device)
    return torch.cat([first, first + (2 * size - 1 - 2 * rank) * c])


def split_for_cp(tensor: Tensor, dim: int = 1) -> Tensor:
    """This CP rank's columns of ``tensor`` along ``dim`` (the whole tensor when cp = 1)."""
    rank, size = cp_rank_size()
    if size == 1:
        return tensor
    return tensor.index_select(dim, cp_columns(tensor.shape[dim], rank, size, tensor.device))


class _GatherCP(torch.autograd.Function):
    """[s_local, ...] on every CP rank -> [cp * s_local, ...] in CP-rank order."""

    @staticmethod
    def forward(ctx, x: Tensor, group) -> Tensor:
        ctx.group = group
        ctx.rank = torch.distributed.get_rank(group)
        ctx.size = torch.distributed.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(ctx.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()  # every rank's queries used this rank's keys: sum their grads
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad.chunk(ctx.size, dim=0)[ctx.rank], None


def gather_cp(x: Tensor) -> Tensor:
    """All CP ranks' [s_local, ...] pieces concatenated in rank order, differentiable."""
    return _GatherCP.apply(x, parallel_state.get_context_parallel_group())


def cp_attention_mask(s_local: int, padding: Tensor | None, device, left: int | None = None) -> Tensor:
    """bool [b or 1, 1, s_local, s] of allowed (query, key) pairs for this CP rank, keys in
    CP-rank gather order: causal by global position and within a window of ``left`` positions
    back (W - 1; None: no window), padding keys masked (``padding`` [b,1,1,s] True = padding, in
    global column order); a query always sees itself (no empty row)."""
    rank, size = cp_rank_size()
    s = s_local * size
    q_pos = cp_columns(s, rank, size, device)
    k_pos = torch.cat([cp_columns(s, r, size, device) for r in range(size)])
    causal = allowed_pairs(q_pos, k_pos, left)
    itself = k_pos[None, :] == q_pos[:, None]
    if padding is None:
        return causal[None, None]
    keys_ok = ~padding.reshape(padding.shape[0], 1, 1, s)[..., k_pos]
    return (causal[None, None] & keys_ok) | itself[None, None]
