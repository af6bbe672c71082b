"""The batch contract between a trainer and mcore_rl, and how batches are split.

A batch is a dict of tensors, the same global batch on every rank:
  input_ids [B, S]        prompt (left-padded) followed by response (right-padded)
  attention_mask [B, S]   1 = token, 0 = padding
  responses [B, R]        the last R columns of input_ids (R < S)
  position_ids [B, S]     optional; must be index + constant over each row's tokens
  per-token update inputs [B, R]: old_log_probs, advantages, ref_log_prob, values, returns
Outputs are [B, R] over response positions, zero at padding.
"""
from __future__ import annotations

from typing import Iterable

import torch
from mcore_rl.errors import McoreRLError

Tensor = torch.Tensor
BASE_KEYS = ("input_ids", "attention_mask", "responses")


class BatchError(McoreRLError, ValueError):
    """A batch that breaks the contract above; the message names the key and the fix."""


def validate_batch(batch: dict, required: Iterable[str] = ()) -> None:
    """Checks keys, shapes and position ids; raises BatchError naming what is wrong."""
    missing = [k for k in (*BASE_KEYS, *required) if k not in batch]
    if missing:
        raise BatchError(f"batch is missing keys {missing}; it has {sorted(batch)}.")
    ids, mask, resp = batch["input_ids"], batch["attention_mask"], batch["responses"]
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise BatchError(
            f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must both be [B, S]."
        )
    b, s = ids.shape
    if resp.dim() != 2 or resp.shape[0] != b:
        raise BatchError(f"responses {tuple(resp.shape)} must be [B={b}, R].")
    if resp.shape[1] >= s:
        raise BatchError(
            f"responses are {resp.shape[1]} tokens but sequences are {s}: a response must be "
            "shorter than the sequence (it follows a prompt of at least one token)."
        )
    r = resp.shape[1]
    for key in required:
        if batch[key].shape != (b, r):
            raise BatchError(f"{key} has shape {tuple(batch[key].shape)}; expected [B, R] = [{b}, {r}].")
    if "position_ids" in batch:
        _check_positions(batch["position_ids"], mask)


def _check_positions(positions: Tensor, mask: Tensor) -> None:
    # RoPE here uses the sequence index; any position_ids that are index + constant over the
    # real tokens of a row give the same attention, anything else cannot be honoured
    if positions.shape != mask.shape:
        raise BatchError(f"position_ids {tuple(positions.shape)} must match attention_mask {tuple(mask.shape)}.")
    offset = positions - torch.arange(mask.shape[1], device=positions.device)
    real = mask.bool()
    for row in range(mask.shape[0]):
        values = offset[row][real[row]]
        if values.numel() and not torch.all(values == values[0]):
            raise BatchError(
                f"position_ids of row {row} are not consecutive over its tokens (packed or "
                "gapped positions); mcore_rl derives positions from the sequence index, so pass "
                "position_ids = cumsum(attention_mask) - 1 or omit them."
            )


def response_mask(batch: dict) -> Tensor:
    """[B, R] mask of real response tokens."""
    r = batch["responses"].shape[1]
    return batch["attention_mask"][:, -r:]


def select_rows(batch: dict, rows: Tensor | slice) -> dict:
    """The same rows of every [B, ...] tensor in the batch."""
    return {k: v[rows] for k, v in batch.items()}


def split_rows(batch: dict, size: int) -> list[dict]:
    """Consecutive pieces of ``size`` rows; the row count must divide evenly."""
    b = batch["input_ids"].shape[0]
    if size < 1 or b % size != 0:
        raise BatchError(
            f"a batch of {b} rows does not split into pieces of {size}; choose a size dividing {b}."
        )
    return [select_rows(batch, slice(i, i + size)) for i in range(0, b, size)]


def split_by_tokens(batch: dict, max_tokens: int, multiple_of: int = 1) -> list[dict]:
    """Dynamic micro-batches: as few pieces as keep each piece's padded tokens <= max_tokens,
    rounded up to a multiple of ``multiple_of`` (the interleaved pipeline schedule needs a
    multiple of PP). All pieces get the same shape (pipeline stages exchange fixed shapes): the
    last is topped up with all-padding rows, which concat_rows(..., rows=B) drops again."""
    b, s = batch["input_ids"].shape
    if max_tokens < s:
        raise BatchError(
            f"max_tokens_per_micro_batch={max_tokens} is below one sequence ({s} tokens); raise it."
        )
    pieces = -(-b // (max_tokens // s))
    pieces = -(-pieces // multiple_of) * multiple_of
    rows = -(-b // pieces)
    if rows * (pieces - 1) >= b:
        raise BatchError(
            f"{b} rows cannot fill {pieces} micro-batches (a multiple of {multiple_of}); send "
            "more rows per call or lower the multiple (pipeline size)."
        )
    padded = _pad_rows(batch, rows * pieces - b)
    return [select_rows(padded, slice(i, i + rows)) for i in range(0, rows * pieces, rows)]


def _pad_rows(batch: dict, count: int) -> dict:
    """Appends ``count`` rows of zeros (attention_mask 0: no token, no loss, no output)."""
    if count == 0:
        return batch
    return {k: torch.cat([v, v.new_zeros(count, *v.shape[1:])]) for k, v in batch.items()}


def concat_rows(pieces: list[dict], rows: int | None = None) -> dict:
    """Inverse of split_rows / split_by_tokens: the first ``rows`` rows of the pieces joined."""
    return {k: torch.cat([p[k] for p in pieces])[:rows] for k in pieces[0]}
