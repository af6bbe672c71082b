"""Attention arithmetic shared by the padded, packed and context-parallel paths of the CPU core
attention: which (query, key) pairs a window allows, and softmax attention with an optional
per-head sink logit (gpt-oss).

A window of W tokens (HF's ``sliding_window``) lets a query at position i see keys at positions
j with 0 <= i - j <= W - 1 (itself included); megatron spells it ``window_size=(W - 1, 0)`` and
this module takes that left extent, ``left = W - 1`` (None: no window).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def allowed_pairs(q_pos: Tensor, k_pos: Tensor, left: Optional[int]) -> Tensor:
    """bool [len(q_pos), len(k_pos)]: causal by position, and within ``left`` positions back."""
    gap = q_pos[:, None] - k_pos[None, :]
    ok = gap >= 0
    if left is not None:
        ok &= gap <= left
    return ok


def causal_window(s_q: int, s_k: int, left: Optional[int], device) -> Tensor:
    """bool [s_q, s_k] for queries that are the last ``s_q`` of ``s_k`` positions."""
    q_pos = torch.arange(s_k - s_q, s_k, device=device)
    return allowed_pairs(q_pos, torch.arange(s_k, device=device), left)


def attend(q: Tensor, k: Tensor, v: Tensor, allowed: Optional[Tensor], scale: float, dropout: float,
           sink: Optional[Tensor] = None) -> Tensor:
    """softmax(q k^T * scale) v over the ``allowed`` pairs (None: causal, square).

    q [b, heads, s_q, d], k/v [b, groups, s_k, d] (each group serves heads / groups consecutive
    query heads), allowed bool broadcastable to [b, heads, s_q, s_k]. ``sink`` [heads]: one more
    logit per head in each softmax, whose probability is dropped (a key with a zero value), as
    transformers' gpt-oss eager attention; softmax in fp32 at least. Returns [b, heads, s_q, d]."""
    heads, groups = q.shape[1], k.shape[1]
    if sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scale,
                                              is_causal=allowed is None, enable_gqa=heads != groups)
    if heads != groups:
        k, v = (x.repeat_interleave(heads // groups, dim=1) for x in (k, v))
    wide = torch.promote_types(q.dtype, torch.float32)  # bf16 inputs: the softmax in fp32
    logits = torch.matmul(q, k.transpose(-1, -2)).to(wide) * scale
    if allowed is None:
        allowed = causal_window(q.shape[2], k.shape[2], None, q.device)
    logits = logits.masked_fill(~allowed, float("-inf"))
    extra = sink.to(wide).reshape(1, heads, 1, 1).expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, extra], dim=-1), dim=-1)[..., :-1].to(v.dtype)
    if dropout > 0:
        probs = F.dropout(probs, p=dropout)
    return torch.matmul(probs, v)
