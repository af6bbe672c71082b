"""Padding-free micro-batches: the real tokens of several rows packed into one stream (THD).

A packed micro-batch keeps its [b, s] keys (labels and masks are read from them) and adds
``PACKED_IDS`` [1, T] (row after row, each row's real tokens, then filler up to the fixed
token budget T), ``CU_SEQLENS`` int32 [n + 1] (sequence boundaries; the filler tail is a
sequence of its own) and ``STREAM_INDEX`` [b, s] (where each (row, column) token sits in the
stream; -1 for padding). The model sees only the stream: megatron's RoPE restarts positions at
every boundary (``PackedSeqParams`` with qkv_format 'thd') and ``packed_attention`` attends
within each sequence only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams

Tensor = torch.Tensor
PACKED_IDS, CU_SEQLENS, STREAM_INDEX = "_packed_ids", "_cu_seqlens", "_stream_index"


def packed_tokens(attention_mask: Tensor) -> int:
    """Real tokens of a [b, s] micro-batch (what its stream holds before the filler)."""
    return int(attention_mask.sum())


def pack(input_ids: Tensor, attention_mask: Tensor, budget: int) -> dict[str, Tensor]:
    """The packed keys of rows ``input_ids`` [b, s] (real tokens where ``attention_mask`` is 1,
    contiguous in each row) in a stream of ``budget`` tokens."""
    real = attention_mask.bool()
    lengths = real.sum(dim=1)
    total = int(lengths.sum())
    if total > budget:
        raise ValueError(f"{total} real tokens do not fit a packed stream of {budget}")
    stream = input_ids.new_zeros(1, budget)
    stream[0, :total] = input_ids[real]  # row-major: each row's tokens in order, row after row
    index = torch.full(input_ids.shape, -1, dtype=torch.long, device=input_ids.device)
    index[real] = torch.arange(total, device=input_ids.device)
    bounds = [0] + torch.cumsum(lengths, 0).tolist() + ([budget] if budget > total else [])
    cu = torch.tensor(bounds, dtype=torch.int32, device=input_ids.device)
    return {PACKED_IDS: stream, CU_SEQLENS: cu, STREAM_INDEX: index}


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
                     dropout: float) -> Tensor:
    """Causal attention inside each packed sequence, never across a boundary.
    query [t, heads, d], key/value [t, groups, d] -> [t, heads * d]."""
    t, heads, d = query.shape
    out = query.new_empty(t, heads, d)
    bounds = cu_seqlens.tolist()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi == lo:
            continue
        q, k, v = (x[lo:hi].transpose(0, 1)[None] for x in (query, key, value))  # [1, h, n, d]
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scale,
                                           enable_gqa=heads != k.shape[1])
        out[lo:hi] = o[0].transpose(0, 1)
    return out.reshape(t, heads * d)
