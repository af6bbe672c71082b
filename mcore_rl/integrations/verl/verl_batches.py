"""verl micro-batches (TensorDicts, jagged ``input_ids`` [b, j]) <-> mcore_rl model inputs and
outputs.

Inputs: every micro-batch of one ``forward_backward_batch`` gets one shape, as megatron's
pipeline schedule needs: padded ([b_max, s_max], rows right-padded, filler rows empty) or, with
``use_remove_padding``, packed (one stream [1, T_max] of the rows' tokens, ``models.packing``).
Outputs: per token of ``input_ids``, as verl's Megatron engine returns them: position t of a
sequence holds log p(token t + 1) (the label is the next token of the flattened batch, as
verl's), entropy and values at t; as jagged tensors with ``input_ids``' offsets.

Context parallelism: the model splits every padded row (``models.context_parallel``) or every
packed sequence (rounded up to 2 * cp tokens, ``models.packing``) over the CP ranks as mcore_rl's
own actor does; each rank computes log-probs / entropy / values at the real tokens it holds and
the CP group completes them (``whole``), as verl's Megatron engine does: every CP rank gets the
whole tensors, gradients flow through the rank's own tokens only (megatron's schedule multiplies
the loss by cp and DDP averages over DP x CP, so the gradient is the whole batch's).
"""
from __future__ import annotations

from typing import Any

import torch
from tensordict import TensorDict

from megatron.core import parallel_state

from mcore_rl.models.context_parallel import cp_columns, cp_rank_size
from mcore_rl.models.micro_batch import MicroBatch
from mcore_rl.models.packing import cp_stream_columns, pack, padded_lengths
from mcore_rl.rl.batch import BatchError
from mcore_rl.rl.engine import ModelEngine, all_reduce_dp
from mcore_rl.rl.logprob import log_probs_and_entropy

Tensor = torch.Tensor


def _lengths(mb: TensorDict) -> Tensor:
    ids = mb["input_ids"]
    if not ids.is_nested:
        raise BatchError("verl's input_ids must be a jagged tensor (data.pad_mode=no_padding, as verl's "
                         "engines take them); got a padded tensor.")
    return ids.offsets().diff()


def _check_positions(mb: TensorDict, lengths: Tensor) -> None:
    """RoPE positions are each sequence's index (mcore_rl's model ignores position_ids): refuse
    position ids that are not index + a constant per sequence."""
    if "position_ids" not in mb.keys():
        return
    pos = mb["position_ids"]
    values = pos.values() if pos.is_nested else pos.reshape(-1)
    if values.dim() != 1 or values.numel() != int(lengths.sum()):
        raise BatchError(f"position_ids of shape {tuple(values.shape)} per token (multimodal/3-D positions) are "
                         "not supported by the mcore_rl engine; pass 1-D positions.")
    offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    row = torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths)
    first = offsets[row]
    index = torch.arange(values.numel(), device=values.device) - first
    bad = (values - values[first]) != index
    if bool(bad.any()):
        r = int(row[bad.nonzero()[0, 0]])
        raise BatchError(f"position_ids of row {r} are not consecutive (index + constant); the mcore_rl engine "
                         "places RoPE by token index: pass positions 0..len-1 per sequence.")


def _padded(mb: TensorDict, lengths: Tensor) -> tuple[Tensor, Tensor]:
    ids = mb["input_ids"].to_padded_tensor(0)
    mask = (torch.arange(ids.shape[1], device=ids.device)[None] < lengths[:, None]).long()
    return ids, mask


# what verl's multimodal datasets add to a batch (images / videos for a vision tower)
MULTIMODAL_KEYS = ("multi_modal_inputs", "multi_modal_data", "pixel_values", "pixel_values_videos", "image_grid_thw")


def _has_content(value: Any) -> bool:
    """Whether a batch entry holds any multimodal data: verl's text datasets still add
    ``multi_modal_inputs`` with an empty dict per row (agent loop, padding templates)."""
    if value is None:
        return False
    if torch.is_tensor(value):
        return value.numel() > 0
    if isinstance(value, dict):
        return any(_has_content(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_content(v) for v in value)
    tolist = getattr(value, "tolist", None)  # numpy object arrays, tensordict's NonTensorStack
    if callable(tolist):
        return _has_content(tolist())
    data = getattr(value, "data", None)  # tensordict's NonTensorData
    if data is not None and data is not value:
        return _has_content(data)
    return bool(value)


def _check_text_only(mb: TensorDict) -> None:
    """A batch with images or videos is refused: mcore_rl builds the language model of a
    vision-language checkpoint only (its vision tower is carried through, never run). Empty
    multimodal entries (what verl adds for text) pass."""
    found = [k for k in MULTIMODAL_KEYS if k in mb.keys() and _has_content(mb.get(k))]
    if found:
        raise BatchError(f"the batch carries multimodal inputs {found}: the mcore_rl engine runs and trains the "
                         "language model of a vision-language checkpoint only (its vision tower is neither run nor "
                         "trained); use a text-only dataset, or verl's FSDP/Megatron engine for multimodal training.")


def _round(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def model_inputs(micro: list[TensorDict], engine: ModelEngine, packed: bool) -> list[MicroBatch]:
    """One model input per micro-batch, all of one shape (see the module doc); the shape is
    also agreed over DP when MoE layers gather equal token blocks over DP ranks."""
    rows = []
    for mb in micro:
        _check_text_only(mb)
        lengths = _lengths(mb)
        _check_positions(mb, lengths)
        rows.append((*_padded(mb, lengths), lengths))
    multiple = engine.seq_multiple
    cp = engine.layout.cp
    per_sequence = 2 * cp if cp > 1 else 1  # packed: every sequence splits into 2 * cp chunks
    device = engine.platform.device()
    if packed:
        shape = torch.tensor([max(int(padded_lengths(m, per_sequence).sum()) for _, m, _ in rows), 1], device=device)
    else:
        shape = torch.tensor([max(ids.shape[1] for ids, *_ in rows), max(ids.shape[0] for ids, *_ in rows)],
                             device=device)
    if engine.needs_equal_tokens_over_dp:
        shape = all_reduce_dp(shape, torch.distributed.ReduceOp.MAX)
    width, height = _round(int(shape[0]), multiple), int(shape[1])
    out = []
    for ids, mask, _ in rows:
        if packed:
            out.append(MicroBatch({"input_ids": ids, "attention_mask": mask}, packed=pack(ids, mask, width, per_sequence)))
            continue
        pad_rows, pad_cols = height - ids.shape[0], width - ids.shape[1]
        ids = torch.nn.functional.pad(ids, (0, pad_cols, 0, pad_rows))
        mask = torch.nn.functional.pad(mask, (0, pad_cols, 0, pad_rows))
        out.append(MicroBatch({"input_ids": ids, "attention_mask": mask}))
    return out


def local_outputs(output: Tensor, inp: MicroBatch) -> tuple[Tensor, Tensor]:
    """This CP rank's model outputs at real tokens and which tokens they are: ([n, ...],
    token numbers [n] in ``input_ids.values()`` order), from [b, s/cp, ...] (padded rows) or
    [1, T/cp, ...] (packed stream); at cp = 1 every real token, in order."""
    rank, size = cp_rank_size()
    real = inp["attention_mask"].bool()
    if inp.packed is not None:  # stream places, rows first (filler: no token)
        stream = inp.packed.ids.shape[1]
        place_of = inp.packed.index[real]
        local = cp_stream_columns(inp.packed.cu_seqlens, rank, size) if size > 1 else \
            torch.arange(stream, device=output.device)
    else:  # row * s + column of the padded [b, s] rows
        b, s = real.shape
        stream = b * s
        place_of = real.reshape(-1).nonzero().squeeze(-1)
        cols = cp_columns(s, rank, size, output.device) if size > 1 else torch.arange(s, device=output.device)
        local = (torch.arange(b, device=output.device)[:, None] * s + cols[None]).reshape(-1)
    token_of = torch.full((stream,), -1, dtype=torch.long, device=output.device)
    token_of[place_of.to(output.device)] = torch.arange(place_of.numel(), device=output.device)
    tokens = token_of[local]
    keep = tokens >= 0
    return output.reshape(-1, *output.shape[2:])[keep], tokens[keep]


def whole(values: Tensor, tokens: Tensor, nnz: int) -> Tensor:
    """[nnz, ...] on every CP rank from each rank's ``values`` [n, ...] at its ``tokens`` [n]
    (each token held by one CP rank): the other ranks' values arrive detached, as in verl's
    Megatron engine, so gradients reach this rank's own tokens only."""
    out = values.new_zeros(nnz, *values.shape[1:]).index_put((tokens,), values)
    if cp_rank_size()[1] == 1:
        return out
    total = out.detach().clone()
    torch.distributed.all_reduce(total, group=parallel_state.get_context_parallel_group())
    owned = torch.zeros(nnz, dtype=torch.bool, device=out.device)
    owned[tokens] = True
    return torch.where(owned.reshape(nnz, *[1] * (values.dim() - 1)), out, total)


def _jagged(values: Tensor, mb: TensorDict) -> Tensor:
    return torch.nested.nested_tensor_from_jagged(values, offsets=mb["input_ids"].offsets())


def _temperature(mb: TensorDict, lengths: Tensor) -> float | Tensor:
    """verl's ``temperature``: a number, or one per row [b] (non-positive ones set to 1e-8, as
    verl does for padding rows); per token [nnz] when the rows differ."""
    if "temperature" not in mb.keys():
        raise BatchError("the batch has no 'temperature'; verl's trainers set it (a number or one per row).")
    t = mb["temperature"]
    if not isinstance(t, Tensor):
        return float(t)
    t = t.float().reshape(-1).clone()
    t[t <= 0] = 1e-8
    if t.numel() == 1 or bool((t == t[0]).all()):
        return float(t[0])
    return torch.repeat_interleave(t.to(lengths.device), lengths)


def lm_outputs(output: Tensor, inp: MicroBatch, mb: TensorDict, vocab_size: int, entropy: bool,
               forward_only: bool) -> dict[str, Tensor]:
    """{'log_probs' (+ 'entropy')}: jagged [b, j] fp32 from vocab-parallel logits."""
    logits, tokens = local_outputs(output, inp)
    ids = mb["input_ids"].values()
    labels = torch.roll(ids, -1)[tokens.to(ids.device)]
    temperature = _temperature(mb, _lengths(mb))
    if isinstance(temperature, Tensor):
        t = temperature.to(logits.device)[tokens]
        logits, temperature = logits.float() / t[:, None], 1.0
    lp, ent = log_probs_and_entropy(logits, labels, vocab_size, temperature, entropy, entropy_grad=not forward_only)
    if not entropy:
        return {"log_probs": _jagged(whole(lp, tokens, ids.numel()), mb)}
    both = whole(torch.stack([lp, ent], dim=-1), tokens, ids.numel())
    return {"log_probs": _jagged(both[:, 0].contiguous(), mb), "entropy": _jagged(both[:, 1].contiguous(), mb)}


def value_outputs(output: Tensor, inp: MicroBatch, mb: TensorDict) -> dict[str, Tensor]:
    """{'values'}: jagged [b, j] fp32 from the value head's [.., 1] output."""
    values, tokens = local_outputs(output, inp)
    return {"values": _jagged(whole(values[:, 0].float(), tokens, mb["input_ids"].values().numel()), mb)}
