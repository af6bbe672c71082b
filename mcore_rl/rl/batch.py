"""The batch contract between a trainer and mcore_rl, and row-level batch helpers.

A batch is a dict of tensors (see ``dispatch`` in the actor/critic configs for whose rows):
  input_ids [B, S]        prompt (left-padded) followed by response (right-padded)
  attention_mask [B, S]   1 = token, 0 = padding; a row's tokens are one contiguous span
                          (no padding between them) or none at all (a filler row)
  responses [B, R]        the last R columns of input_ids (R < S), equal on real tokens
  response_mask [B, R]    optional loss mask (verl's name): 1 = token in the loss and metrics;
                          default = attention_mask[:, -R:]; must be 0 where attention is 0
  position_ids [B, S]     optional; must be index + constant over each row's tokens
  per-token update inputs [B, R]: old_log_probs, advantages, ref_log_prob, values, returns
Outputs are [B, R] over response positions, zero at attention padding (tokens outside the loss
mask but inside the attention mask get their real value).
"""
from __future__ import annotations

from typing import Iterable, Mapping

import torch
from mcore_rl.errors import McoreRLError
from mcore_rl.models.micro_batch import MicroBatch

Tensor = torch.Tensor
BASE_KEYS = ("input_ids", "attention_mask", "responses")
SEQ_KEYS = ("input_ids", "attention_mask", "position_ids")  # [B, S]; every other token key is [B, R]


class BatchError(McoreRLError, ValueError):
    """A batch that breaks the contract above; the message names the key and the fix."""


def validate_batch(batch: dict, required: Iterable[str] = (), vocab_size: int | None = None) -> None:
    """Checks keys, shapes, that each row's real tokens are one contiguous span, token ids (in
    [0, vocab_size) on real tokens), that responses are the tail of input_ids, the loss mask and
    position ids; raises BatchError naming the row, the value and the fix."""
    missing = [k for k in (*BASE_KEYS, *required) if k not in batch]
    if missing:
        raise BatchError(f"batch is missing keys {missing}; it has {sorted(batch)}.")
    ids, mask, resp = batch["input_ids"], batch["attention_mask"], batch["responses"]
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise BatchError(
            f"input_ids {tuple(ids.shape)} and attention_mask {tuple(mask.shape)} must both be [B, S]."
        )
    if ids.is_floating_point() or resp.is_floating_point():
        raise BatchError(f"input_ids ({ids.dtype}) and responses ({resp.dtype}) must hold integer token ids.")
    _check_mask_values(mask)
    b, s = ids.shape
    if resp.dim() != 2 or resp.shape[0] != b:
        raise BatchError(f"responses {tuple(resp.shape)} must be [B={b}, R].")
    if resp.shape[1] >= s:
        raise BatchError(
            f"responses are {resp.shape[1]} tokens but sequences are {s}: a response must be "
            "shorter than the sequence (it follows a prompt of at least one token)."
        )
    r = resp.shape[1]
    for key in (*required, *(("response_mask",) if "response_mask" in batch else ())):
        if batch[key].shape != (b, r):
            raise BatchError(f"{key} has shape {tuple(batch[key].shape)}; expected [B, R] = [{b}, {r}].")
    real = mask.bool()
    _check_contiguous(real, r)
    _check_token_ids(ids, real, vocab_size)
    _check_responses_are_tail(ids, real, resp)
    _check_prompts(real, r)
    if "response_mask" in batch:
        _check_loss_mask(batch["response_mask"], mask[:, -r:])
    if "position_ids" in batch:
        _check_positions(batch["position_ids"], mask)


def _check_contiguous(real: Tensor, r: int) -> None:
    # padded rows place token k at column lo + k, packed rows at stream place k: only without
    # holes do the two give every token the same RoPE position (and the same scored columns)
    runs = torch.count_nonzero(real[:, 1:] > real[:, :-1], dim=1) + real[:, 0]  # runs of real tokens
    gapped = runs > 1
    if not bool(gapped.any()):
        return
    row = int(gapped.nonzero()[0])
    s = real.shape[1]
    cols = real[row].nonzero().squeeze(-1)
    first, last = int(cols[0]), int(cols[-1])
    hole = (~real[row, first : last + 1]).nonzero().squeeze(-1) + first
    lo = int(hole[0])
    hi = lo + int(real[row, lo:].int().argmax()) - 1  # the hole ends before the next real token
    boundary = s - r  # the first response column
    if hi < boundary - 1:
        where = "inside the prompt"
        fix = "drop the hole from the prompt (shift its earlier tokens right) so it stays left-padded"
    elif lo > boundary:
        where = "inside the response"
        fix = ("a response is right-padded after its last token only; to keep tokens in context "
               "but out of the loss (e.g. tool outputs) set response_mask to 0 there, not attention_mask")
    else:
        where = "between the prompt and the response"
        fix = (f"left-pad the prompt so it ends at column {boundary - 1} and start the response at "
               f"column {boundary} (right-pad it)")
    raise BatchError(
        f"row {row} has padding between its tokens: attention_mask[{row}, {lo}:{hi + 1}] is 0 "
        f"({where}; real tokens span columns {first}..{last}), so padded and packed micro-batches "
        "would give its tokens different positions. Remove the padding inside the row: real tokens "
        f"must be contiguous (left-padded prompt, then right-padded response); {fix}."
    )


def _check_mask_values(mask: Tensor) -> None:
    # sequence lengths and packed streams are sums of the mask: only 0 and 1 count tokens
    if mask.is_floating_point() or mask.is_complex():
        raise BatchError(f"attention_mask has dtype {mask.dtype}; pass integer or bool 0/1 values "
                         "(e.g. attention_mask.long()).")
    bad = (mask != 0) & (mask != 1)
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise BatchError(f"attention_mask[{row}, {col}] = {int(mask[row, col])}; the mask holds 1 for a "
                         "token and 0 for padding, nothing else: pass (mask != 0).long().")


def _check_token_ids(ids: Tensor, real: Tensor, vocab_size: int | None) -> None:
    # an id outside the vocab gives -inf log-probs (NaN after masking) or an embedding fault
    bad = real & (ids < 0)
    if vocab_size is not None:
        bad |= real & (ids >= vocab_size)
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        limit = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
        raise BatchError(
            f"input_ids[{row}, {col}] = {int(ids[row, col])} is a real token (attention_mask 1) "
            f"outside the model's vocabulary {limit}; use the model's tokenizer, or set "
            "attention_mask to 0 at that position if it is padding."
        )


def _check_responses_are_tail(ids: Tensor, real: Tensor, resp: Tensor) -> None:
    r = resp.shape[1]
    bad = real[:, -r:] & (ids[:, -r:] != resp)
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise BatchError(
            f"responses[{row}, {col}] = {int(resp[row, col])} but input_ids[{row}, "
            f"{ids.shape[1] - r + col}] = {int(ids[row, ids.shape[1] - r + col])}: responses must "
            "equal the last R columns of input_ids on real tokens; pass responses = input_ids[:, -R:]."
        )


def _check_prompts(real: Tensor, r: int) -> None:
    # the first response token is predicted from the last prompt position: without a prompt
    # token that position is padding and its log-prob/value is meaningless
    orphan = real[:, -r:].any(dim=1) & ~real[:, :-r].any(dim=1)
    if bool(orphan.any()):
        row = int(orphan.nonzero()[0])
        raise BatchError(
            f"row {row} has response tokens but no prompt token (attention_mask[{row}, :S-R] is all "
            "0): nothing predicts its first response token; give every response at least one "
            "prompt token (e.g. BOS) or drop the row."
        )


def _check_loss_mask(loss_mask: Tensor, attention: Tensor) -> None:
    bad = loss_mask.bool() & ~attention.bool()
    if bool(bad.any()):
        row, col = (int(x) for x in bad.nonzero()[0])
        raise BatchError(
            f"response_mask[{row}, {col}] is 1 but that position is padding (attention_mask 0): "
            "the loss mask must be a subset of attention_mask[:, -R:]; zero it there."
        )


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


def attended_responses(batch: Mapping[str, Tensor]) -> Tensor:
    """[B, R] attention mask of the response positions (1 = real token); a context-parallel
    view (rl/cp_view.py) carries its own share."""
    if isinstance(batch, MicroBatch) and batch.cp is not None:
        return batch.cp.attended
    r = batch["responses"].shape[1]
    return batch["attention_mask"][:, -r:]


def row_tokens(mb: MicroBatch) -> Tensor | None:
    """[b] loss tokens of each whole row under context parallelism (its view scores a share of
    them); None otherwise."""
    return mb.cp.row_tokens if mb.cp is not None else None


def response_mask(batch: Mapping[str, Tensor]) -> Tensor:
    """[B, R] loss mask: ``batch['response_mask']`` when given, else the attended responses."""
    if "response_mask" in batch:
        return batch["response_mask"]
    return attended_responses(batch)


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
