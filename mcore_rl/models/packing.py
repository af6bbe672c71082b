"""Padding-free micro-batches: the real tokens of several rows packed into one stream (THD).

A packed micro-batch keeps its [b, s] tensors (labels and masks are read from them) and gets a
``PackedStream`` (``models/micro_batch.py``): the stream [1, T] (row after row, each row's real
tokens, then filler up to the fixed token budget T), its sequence boundaries and where each
(row, column) token sits in it. The model sees only the stream: megatron's RoPE restarts positions at
every boundary (``PackedSeqParams`` with qkv_format 'thd') and ``packed_attention`` attends
within each sequence only.
"""
from __future__ import annotations

from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams

from mcore_rl.models.attention_ops import allowed_pairs, attend, causal_window
from mcore_rl.models.context_parallel import cp_columns, cp_rank_size
from mcore_rl.models.micro_batch import PackedStream

Tensor = torch.Tensor


def padded_lengths(attention_mask: Tensor, multiple: int = 1) -> Tensor:
    """[b] stream length of each row: its real tokens rounded up to ``multiple`` (2 * cp under
    context parallelism: every sequence splits into 2 * cp chunks)."""
    return -(-attention_mask.sum(dim=1) // multiple) * multiple


def pack(input_ids: Tensor, attention_mask: Tensor, budget: int, multiple: int = 1) -> PackedStream:
    """The packed stream of rows ``input_ids`` [b, s] (real tokens where ``attention_mask`` is 1,
    contiguous in each row) in a stream of ``budget`` tokens; each row takes
    ``padded_lengths(mask, multiple)`` places (real tokens first: causal attention keeps the
    padding after them out of their results)."""
    real = attention_mask.bool()
    lengths = padded_lengths(attention_mask, multiple)
    total = int(lengths.sum())
    if total > budget:
        raise ValueError(f"{total} packed tokens do not fit a stream of {budget}")
    starts = torch.cumsum(lengths, 0) - lengths
    offset = torch.cumsum(real.long(), dim=1) - 1  # a real token's place in its row's tokens
    where = (starts[:, None] + offset)[real]
    stream = input_ids.new_zeros(1, budget)
    stream[0, where] = input_ids[real]
    index = torch.full(input_ids.shape, -1, dtype=torch.long, device=input_ids.device)
    index[real] = where
    bounds = [0] + torch.cumsum(lengths, 0).tolist() + ([budget] if budget > total else [])
    cu = torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
    return PackedStream(stream, cu, index)


def cp_stream_columns(cu_seqlens: Tensor, rank: int, size: int) -> Tensor:
    """Stream positions held by CP ``rank`` of ``size``: of every sequence (each a multiple of
    2 * size long) its chunks rank and 2 * size - 1 - rank, sequence after sequence."""
    parts = []
    for lo, hi in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        c = (hi - lo) // (2 * size)
        first = torch.arange(lo + rank * c, lo + (rank + 1) * c, device=cu_seqlens.device)
        parts += [first, first + (2 * size - 1 - 2 * rank) * c]
    return torch.cat(parts)


def packed_params(cu_seqlens: Tensor) -> PackedSeqParams:
    """megatron's description of a packed stream (qkv_format 'thd', self-attention)."""
    longest = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)


def stream_positions(cu_seqlens: Tensor) -> Tensor:
    """[1, T] position of each stream token within its own sequence."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths.long())
    return (torch.arange(starts.numel(), device=cu_seqlens.device) - starts)[None]


def packed_attention(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float,
                     dropout: float, left: Optional[int] = None, sink: Optional[Tensor] = None) -> Tensor:
    """Causal attention inside each packed sequence, never across a boundary; ``left``: the
    window's left extent (W - 1; None: none), ``sink`` [heads]: gpt-oss sink logits
    (``attention_ops.attend``). query [t, heads, d], key/value [t, groups, d] -> [t, heads * d]."""
    t, heads, d = query.shape
    out = query.new_empty(t, heads, d)
    bounds = cu_seqlens.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        q, k, v = (x[lo:hi].transpose(0, 1)[None] for x in (query, key, value))  # [1, h, n, d]
        allowed = None if left is None else causal_window(hi - lo, hi - lo, left, query.device)
        out[lo:hi] = attend(q, k, v, allowed, scale, dropout, sink)[0].transpose(0, 1)
    return out.reshape(t, heads * d)


def packed_attention_cp(query: Tensor, key: Tensor, value: Tensor, cu_seqlens: Tensor, scale: float,
                        dropout: float, gather, left: Optional[int] = None,
                        sink: Optional[Tensor] = None) -> Tensor:
    """``packed_attention`` under context parallelism: this rank holds two chunks of every
    sequence (``cp_stream_columns``); ``gather`` all-gathers K/V over the CP group (rank order,
    differentiable); the window by in-sequence position. query [t/cp, heads, d], key/value
    [t/cp, groups, d] -> [t/cp, heads * d]."""
    rank, size = cp_rank_size()
    t, heads, d = query.shape
    keys, values = (gather(x).reshape(size, t, *x.shape[1:]) for x in (key, value))
    out = query.new_empty(t, heads, d)
    bounds = cu_seqlens.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        c, a = (hi - lo) // (2 * size), lo // size  # chunk length; the sequence's local offset
        pos = [cp_columns(2 * size * c, r, size, query.device) for r in range(size)]  # in-sequence positions
        allowed = allowed_pairs(pos[rank], torch.cat(pos), left)
        q = query[a : a + 2 * c].transpose(0, 1)[None]
        k, v = (x[:, a : a + 2 * c].reshape(size * 2 * c, *x.shape[2:]).transpose(0, 1)[None] for x in (keys, values))
        out[a : a + 2 * c] = attend(q, k, v, allowed, scale, dropout, sink)[0].transpose(0, 1)
    return out.reshape(t, heads * d)
