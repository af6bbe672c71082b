"""What a context-parallel rank computes of a micro-batch's response tokens.

Under CP a rank's outputs cover its s/cp columns only (``models.context_parallel``). Output
column p predicts token p+1, so response token j (column s-r+j) is scored at column s-r-1+j,
which may sit in another chunk (another CP rank) than the token itself; the labels come from
the full ``responses`` every rank has. ``cp_view`` gives the loss function the owned response
tokens as [b, R_local] tensors (every [b, R] key sliced; ``MicroBatch.cp`` holds the index into
the local output);
each response token is owned by exactly one CP rank, so per-token results are scattered back to
[b, R] and summed over the CP group, and loss sums over DP x CP give the whole batch's loss.
Packed micro-batches (models/packing.py) split every sequence of the stream the same way; which
tokens a rank scores then differs per row, so their view keeps [b, R] with masks cut to them.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from mcore_rl.models.context_parallel import cp_columns, cp_rank_size
from mcore_rl.models.forward import LossFn
from mcore_rl.models.micro_batch import CPView, MicroBatch
from mcore_rl.models.packing import cp_stream_columns
from mcore_rl.rl.batch import SEQ_KEYS, attended_responses, response_mask

Tensor = torch.Tensor


def cp_view(mb: MicroBatch) -> MicroBatch:
    """``mb`` as this CP rank sees it: [b, R] tensors -> [b, R_local] (the responses it scores)
    and ``mb.cp`` (their local output columns, the loss tokens of each whole row for
    per-sequence means); ``mb`` itself when cp = 1."""
    rank, size = cp_rank_size()
    if size == 1:
        return mb
    if mb.packed is not None:
        return _packed_view(mb, rank, size)
    ids = mb["input_ids"]
    s, r = ids.shape[1], mb["responses"].shape[1]
    cols = cp_columns(s, rank, size, ids.device)
    local_of = torch.full((s,), -1, dtype=torch.long, device=ids.device)
    local_of[cols] = torch.arange(cols.numel(), device=ids.device)
    scored_at = local_of[torch.arange(s - r - 1, s - 1, device=ids.device)]
    resp = (scored_at >= 0).nonzero().squeeze(-1)
    rows = {k: v if k in SEQ_KEYS or v.dim() < 2 or v.shape[1] != r else v[:, resp] for k, v in mb.items()}
    view = CPView(attended_responses(mb)[:, resp], response_mask(mb).sum(-1), out_index=scored_at[resp],
                  resp_index=resp)
    return replace(mb, rows=rows, cp=view)


def _packed_view(mb: MicroBatch, rank: int, size: int) -> MicroBatch:
    """``cp_view`` of a packed micro-batch: ownership differs per row, so [b, R] stays and the
    masks are cut to the tokens scored here; ``cp.packed_out`` [b, R] indexes the local stream."""
    stream = mb.packed.index
    s, r = stream.shape[1], mb["responses"].shape[1]
    local_of = torch.full((mb.packed.ids.shape[1],), -1, dtype=torch.long, device=stream.device)
    cols = cp_stream_columns(mb.packed.cu_seqlens, rank, size)
    local_of[cols] = torch.arange(cols.numel(), device=stream.device)
    at = stream[:, s - r - 1 : s - 1]
    scored = torch.where(at >= 0, local_of[at.clamp(min=0)], -1)
    owned = (scored >= 0).to(mb["attention_mask"].dtype)
    rows = dict(mb.rows)
    if "response_mask" in mb:
        rows["response_mask"] = mb["response_mask"] * owned.to(mb["response_mask"].dtype)
    view = CPView(attended_responses(mb) * owned, response_mask(mb).sum(-1), packed_out=scored.clamp(min=0))
    return replace(mb, rows=rows, cp=view)


def local_column(s: int, column: int) -> int | None:
    """Where global ``column`` (of s) sits in this CP rank's outputs; None when another CP rank
    holds it (always the column itself when cp = 1)."""
    rank, size = cp_rank_size()
    if size == 1:
        return column
    hit = (cp_columns(s, rank, size) == column).nonzero()
    return int(hit[0, 0]) if hit.numel() else None


def cp_loss_fn(loss_fn: LossFn) -> LossFn:
    """``loss_fn`` run on ``cp_view(mb)``; its [b, R_local] results come back as [b, R] with zeros
    at the tokens other CP ranks own (sum over the CP group to complete them)."""
    if cp_rank_size()[1] == 1:
        return loss_fn

    def wrapped(mb: MicroBatch, output: Tensor):
        view = cp_view(mb)
        loss, stats = loss_fn(view, output)
        resp = view.cp.resp_index
        if resp is None:  # packed: results are [b, R] already, zero where not scored here
            return loss, stats
        r = mb["responses"].shape[1]
        return loss, {k: _scatter(v, resp, r) if v.dim() == 2 else v for k, v in stats.items()}

    return wrapped


def _scatter(value: Tensor, resp: Tensor, r: int) -> Tensor:
    out = value.new_zeros(value.shape[0], r)
    out[:, resp] = value
    return out


def all_reduce_cp(value: Tensor) -> Tensor:
    """Sum over the context-parallel group (completes per-token results of ``cp_loss_fn``)."""
    from megatron.core import parallel_state

    if cp_rank_size()[1] > 1:
        value = value.clone()
        torch.distributed.all_reduce(value, group=parallel_state.get_context_parallel_group())
    return value
