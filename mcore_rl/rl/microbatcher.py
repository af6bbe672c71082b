"""The one micro-batcher: this rank's rows -> micro-batches for megatron's schedule, and the
per-micro-batch results -> [rows, R] in the original row order.

Grouping
  fixed    consecutive pieces of ``micro_batch_size`` rows, all columns (row order kept).
  dynamic  (``max_tokens`` set) rows sorted by their real length and grouped greedily while
           rows x padded width <= max_tokens; each group keeps only the columns some row uses
           (leading prompt padding and trailing response padding are trimmed).
Collate
  padding  rows keep their own padding; the sequence is left-padded with empty columns to a
           multiple of ``seq_multiple`` (TP with sequence parallel; context parallelism will
           need 2 * cp * tp) through ``pad_sequence_to_multiple``. Left padding moves every
           position by the same amount, which RoPE (relative) does not see, and the response
           columns stay the last ones, so results need no stripping.
  packed   each micro-batch's real tokens in one stream [1, T] (models/packing.py), T the same
           for all (the largest group's tokens); dynamic grouping then packs rows by real
           tokens up to ``max_tokens`` (first fit, longest first).
Pipeline rules: with ``uniform_shape`` (PP > 1: variable_seq_lengths is off; MoE's allgather
dispatcher across DP ranks) every micro-batch gets one [b, s] (at least min_rows x min_width,
agreed across DP ranks for the allgather dispatcher); the count is raised to ``min_count`` (agreed across DP ranks, so MoE's
collectives see equal numbers of forward passes) and to a multiple of ``count_multiple`` (the
interleaved schedule's PP rule). Filler rows (attention all 0) fill shapes and are dropped.
Each micro-batch (``models.micro_batch.MicroBatch``) also carries ``token_id`` [b, s]: the flat
index row * S + column of each of its tokens in the rows given (routing replay reads it).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import torch

from mcore_rl.models.micro_batch import MicroBatch
from mcore_rl.models.packing import pack, padded_lengths
from mcore_rl.rl.batch import SEQ_KEYS, BatchError

Tensor = torch.Tensor


@dataclass(frozen=True)
class MicroBatchSpec:
    """How to cut one rank's rows; built by the caller from its config and the engine layout."""

    micro_batch_size: int = 4  # rows per micro-batch (fixed grouping)
    max_tokens: int | None = None  # token budget per micro-batch (dynamic grouping)
    seq_multiple: int = 1  # padded sequence length multiple (tp with sequence parallel)
    uniform_shape: bool = False  # all micro-batches one [b, s] (PP > 1)
    count_multiple: int = 1  # micro-batch count multiple (interleaved schedule: PP)
    min_count: int = 1  # at least this many micro-batches (agreed over DP)
    min_rows: int = 1  # uniform_shape: at least this many rows (agreed over DP for MoE allgather)
    min_width: int = 1  # uniform_shape: at least this many columns (likewise)
    collate: Literal["padding", "packed"] = "padding"
    pack_multiple: int = 1  # packed: each sequence's stream length multiple (2 * cp under CP)


@dataclass
class MicroBatches:
    """Micro-batches plus where their rows came from."""

    batches: list[MicroBatch]
    rows: list[list[int]]  # per micro-batch: the source row of each real row (fillers come after)
    num_rows: int
    response_len: int

    def restore(self, results: list[Tensor]) -> Tensor:
        """Per-micro-batch results [b_i, R_i, ...] -> [num_rows, R, ...] in source row order;
        zeros at trimmed columns."""
        first = results[0]
        out = first.new_zeros(self.num_rows, self.response_len, *first.shape[2:])
        for rows, res in zip(self.rows, results):
            if rows:
                index = torch.tensor(rows, device=res.device)
                out[index, : res.shape[1]] = res[: len(rows)]
        return out


def pad_sequence_to_multiple(batch: dict, multiple: int) -> dict:
    """Left-pads the [B, S] keys with empty columns (id 0, attention 0) so S divides by
    ``multiple``; [B, R] keys are unchanged (responses stay the last R columns)."""
    return _left_pad_to(batch, _round(batch["input_ids"].shape[1], multiple))


def _left_pad_to(batch: dict, width: int) -> dict:
    extra = width - batch["input_ids"].shape[1]
    if extra <= 0:
        return batch
    out = dict(batch)
    for key in SEQ_KEYS:
        if key in batch:
            out[key] = _left_pad(batch[key], extra)
    return out


def _left_pad(v: Tensor, extra: int) -> Tensor:
    return torch.cat([v.new_zeros(v.shape[0], extra), v], dim=1) if extra > 0 else v


def plan_micro_batches(batch: dict, spec: MicroBatchSpec) -> MicroBatches:
    """Cuts ``batch`` (this rank's rows) into micro-batches following ``spec`` (module doc)."""
    if spec.collate == "packed":
        return _plan_packed(batch, spec)
    if spec.collate != "padding":
        raise BatchError(f"collate={spec.collate!r} is not a mode; use 'padding' or 'packed'.")
    b, s = batch["input_ids"].shape
    r = batch["responses"].shape[1]
    if spec.max_tokens:
        groups, cols = _dynamic_groups(batch, spec)
    else:
        groups, cols = _fixed_groups(b, s, r, spec), None
    groups = _meet_count(groups, spec)
    if cols is None:
        spans = [(0, s - 1)] * len(groups)
    elif spec.uniform_shape:  # one [b, s] and one R for all: the columns any row uses
        spans = [_span(cols, list(range(b)), s, r)] * len(groups)
    else:
        spans = [_span(cols, g, s, r) for g in groups]
    rows_per = width = None
    if spec.uniform_shape:
        rows_per = max(max(len(g) for g in groups), spec.min_rows)
        width = max(max(_round(hi - lo + 1, spec.seq_multiple) for lo, hi in spans), _round(spec.min_width, spec.seq_multiple))
    batches = [_collate(batch, g, lo, hi, rows_per, width, spec.seq_multiple) for g, (lo, hi) in zip(groups, spans)]
    return MicroBatches(batches, groups, b, r)


def _round(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _fixed_groups(b: int, s: int, r: int, spec: MicroBatchSpec) -> list[list[int]]:
    size = min(spec.micro_batch_size, b)
    if size < 1 or b % size != 0:
        raise BatchError(
            f"a batch of {b} rows does not split into micro-batches of {size}; choose a "
            f"micro_batch_size dividing {b}, or set max_tokens_per_micro_batch."
        )
    return [list(range(i, i + size)) for i in range(0, b, size)]


def _row_columns(batch: dict) -> tuple[list[int], list[int]]:
    """First and last real column of each row (an empty row: (S, -1))."""
    mask = batch["attention_mask"].bool()
    s = mask.shape[1]
    cols = torch.arange(s, device=mask.device)
    first = torch.where(mask, cols, s).min(dim=1).values
    last = torch.where(mask, cols, -1).max(dim=1).values
    return first.tolist(), last.tolist()


def _span(cols: tuple[list[int], list[int]], group: list[int], s: int, r: int) -> tuple[int, int]:
    """Columns [lo, hi] a group needs: its real tokens, the column predicting the first
    response token and at least one response column."""
    first, last = cols
    lo = min([first[i] for i in group] + [s - r - 1])
    hi = max([last[i] for i in group] + [s - r])
    return lo, hi


def _dynamic_groups(batch: dict, spec: MicroBatchSpec) -> tuple[list[list[int]], tuple]:
    b, s = batch["input_ids"].shape
    r = batch["responses"].shape[1]
    cols = _row_columns(batch)
    budget = spec.max_tokens
    widths = [_round(hi - lo + 1, spec.seq_multiple) for lo, hi in (_span(cols, [i], s, r) for i in range(b))]
    if max(widths) > budget:
        raise BatchError(
            f"max_tokens_per_micro_batch={budget} is below one row's padded length ({max(widths)} "
            f"tokens, row {widths.index(max(widths))}); raise it."
        )
    order = sorted(range(b), key=lambda i: -widths[i])  # stable: equal lengths keep their order
    if spec.uniform_shape:  # one shape for all: the columns any row uses, as many rows as fit
        lo, hi = _span(cols, list(range(b)), s, r)
        per = max(1, budget // _round(hi - lo + 1, spec.seq_multiple))
        return [order[i : i + per] for i in range(0, b, per)], cols
    groups: list[list[int]] = [[]]
    for i in order:
        trial = groups[-1] + [i]
        lo, hi = _span(cols, trial, s, r)
        if groups[-1] and len(trial) * _round(hi - lo + 1, spec.seq_multiple) > budget:
            groups.append([i])
        else:
            groups[-1] = trial
    return groups, cols


def _meet_count(groups: list[list[int]], spec: MicroBatchSpec) -> list[list[int]]:
    """Splits the largest groups (or adds empty ones) up to min_count and count_multiple."""
    target = max(len(groups), spec.min_count)
    target = _round(target, spec.count_multiple)
    groups = [list(g) for g in groups]
    while len(groups) < target:
        largest = max(range(len(groups)), key=lambda k: len(groups[k]))
        g = groups[largest]
        if len(g) > 1:
            groups[largest : largest + 1] = [g[: len(g) // 2], g[len(g) // 2 :]]
        else:
            groups.append([])  # a micro-batch of one filler row
    return groups


def _collate(batch: dict, rows: list[int], lo: int, hi: int, rows_per: int | None,
             width: int | None, multiple: int) -> MicroBatch:
    """Rows ``rows`` and columns [lo, hi] of ``batch``, padded with filler rows to ``rows_per``
    and left-padded to ``width`` columns (or to a multiple of ``multiple``)."""
    b, s = batch["input_ids"].shape
    r = batch["responses"].shape[1]
    keep_r = hi - (s - r) + 1  # response columns kept
    index = torch.tensor(rows, dtype=torch.long, device=batch["input_ids"].device)
    fill = max((rows_per or 1) - len(rows), 0) if rows_per or not rows else 0
    piece = {}
    for key, v in batch.items():
        v = v.index_select(0, index)
        if key in SEQ_KEYS:
            v = v[:, lo : hi + 1]
        elif v.dim() >= 2:
            v = v[:, :keep_r]
        if fill:
            v = torch.cat([v, v.new_zeros(fill, *v.shape[1:])])
        piece[key] = v
    # padding ids never reach the embedding: -100 or ids past the vocab there are harmless
    piece["input_ids"] = piece["input_ids"].masked_fill(piece["attention_mask"] == 0, 0)
    # responses' padding too (the contract fixes only real tokens): the labels must be ids
    piece["responses"] = piece["responses"].masked_fill(piece["attention_mask"][:, -keep_r:] == 0, 0)
    piece.pop("position_ids", None)  # validated already; RoPE uses the sequence index
    token_id = index[:, None] * s + torch.arange(lo, hi + 1, device=index.device)[None]
    if fill:
        token_id = torch.cat([token_id, token_id.new_zeros(fill, token_id.shape[1])])
    piece = _left_pad_to(piece, width) if width else pad_sequence_to_multiple(piece, multiple)
    return MicroBatch(piece, token_id=_left_pad(token_id, piece["input_ids"].shape[1] - token_id.shape[1]))


def _plan_packed(batch: dict, spec: MicroBatchSpec) -> MicroBatches:
    """Packed collate: groups of rows (fixed, or by real tokens up to ``max_tokens``), each
    trimmed to its columns and packed into one stream; all streams one length T (the largest
    group's tokens, at least ``min_width``, a multiple of ``seq_multiple``)."""
    b, s = batch["input_ids"].shape
    r = batch["responses"].shape[1]
    cols = _row_columns(batch)
    groups = _packed_groups(batch, spec) if spec.max_tokens else _fixed_groups(b, s, r, spec)
    groups = _meet_count(groups, spec)
    pieces = [_collate(batch, g, *_span(cols, g, s, r), None, None, 1) for g in groups]
    tokens = max(int(padded_lengths(p["attention_mask"], spec.pack_multiple).sum()) for p in pieces)
    length = _round(max(tokens, spec.min_width, 1), spec.seq_multiple)
    pieces = [replace(p, packed=pack(p["input_ids"], p["attention_mask"], length, spec.pack_multiple))
              for p in pieces]
    return MicroBatches(pieces, groups, b, r)


def _packed_groups(batch: dict, spec: MicroBatchSpec) -> list[list[int]]:
    """Rows sorted by real length, longest first, each into the first group it fits in
    (at most ``max_tokens`` stream places per group: real tokens, each row's rounded up to
    ``pack_multiple``)."""
    # the places pack() gives each row, so the budget and the streams count the same tokens
    lengths = padded_lengths(batch["attention_mask"], spec.pack_multiple).tolist()
    budget = spec.max_tokens
    if max(lengths) > budget:
        raise BatchError(f"max_tokens_per_micro_batch={budget} is below one row's length ({max(lengths)} "
                         f"tokens, row {lengths.index(max(lengths))}); raise it.")
    groups: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        k = next((k for k, free in enumerate(room) if free >= lengths[i]), None)
        if k is None:
            groups.append([])
            room.append(budget)
            k = len(groups) - 1
        groups[k].append(i)
        room[k] -= lengths[i]
    return groups
