"""Runs model chunks through megatron-core's pipeline schedules on a list of micro-batches.

A micro-batch (``models/micro_batch.py``; a plain dict is a padded one) has ``input_ids``
[b, s] and ``attention_mask`` [b, s] (1 = token, 0 = padding), plus whatever ``loss_fn`` reads.
``loss_fn(batch, output)`` gets the last stage's output ([b, s, vocab/tp] logits for the actor,
[b, s, 1] values for the critic) and returns ``(loss, metrics_dict)``; the schedule
backpropagates ``loss / num_microbatches``.
"""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Mapping, Protocol

import torch
from megatron.core.pipeline_parallel import get_forward_backward_func

from mcore_rl.models.context_parallel import cp_rank_size, split_for_cp
from mcore_rl.models.micro_batch import MicroBatch, as_micro_batch
from mcore_rl.models.packing import cp_stream_columns, packed_params, stream_positions

Tensor = torch.Tensor
LossFn = Callable[[MicroBatch, Tensor], tuple[Tensor, dict]]


class ForwardHooks(Protocol):
    """Called around each chunk's forward of each micro-batch (e.g. models.routing.EngineRouting)."""

    def before_forward(self, chunk: int, mb: MicroBatch) -> None: ...

    def after_forward(self, chunk: int, mb: MicroBatch) -> None: ...


def padding_mask(attention_mask: Tensor) -> Tensor:
    """[b, s] with 1 = token -> bool [b, 1, 1, s] with True = padding (megatron's convention)."""
    return (attention_mask == 0).reshape(attention_mask.shape[0], 1, 1, -1)


def chunk_forward(chunk: torch.nn.Module, batch: MicroBatch | Mapping[str, Tensor]) -> Tensor:
    """One chunk's forward (a plain dict: a padded micro-batch). RoPE positions are the sequence
    index (GPTModel ignores position_ids). With context parallelism each rank feeds its s/cp
    columns (``split_for_cp``; megatron's RoPE follows the same split) and gets outputs
    [b, s/cp, ...] for them; the padding mask stays whole (attention sees every key)."""
    batch = as_micro_batch(batch)
    if batch.packed is not None:  # one stream [1, T] of the rows' real tokens (models/packing.py)
        cu = batch.packed.cu_seqlens
        ids, positions = batch.packed.ids, stream_positions(cu)
        rank, size = cp_rank_size()
        if size > 1:  # two chunks of every sequence; megatron's THD RoPE follows the same split
            cols = cp_stream_columns(cu, rank, size)
            ids, positions = ids[:, cols], positions[:, cols]
        return chunk(ids, positions, attention_mask=None, packed_seq_params=packed_params(cu))
    input_ids = batch["input_ids"]
    positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return chunk(split_for_cp(input_ids), split_for_cp(positions),
                 attention_mask=padding_mask(batch["attention_mask"]))


def run_schedule(
    chunks: list[torch.nn.Module],
    micro_batches: list[MicroBatch | Mapping[str, Tensor]],
    loss_fn: LossFn,
    forward_only: bool,
    hooks: ForwardHooks | None = None,
) -> list[dict]:
    """Forward (and backward unless ``forward_only``) over all micro-batches with megatron's
    schedule for the current PP/VPP layout; returns loss_fn's metrics on the last stage, [] else.

    All micro-batches must share one shape [b, s] (packed: one stream length [1, T]).
    """
    micro_batches = [as_micro_batch(mb) for mb in micro_batches]
    b, s = micro_batches[0].shape

    def forward_step(data_iterator, model):
        batch = next(data_iterator)
        if hooks is None:
            return chunk_forward(model, batch), partial(loss_fn, batch)
        chunk = next(i for i, c in enumerate(chunks) if c is model)
        hooks.before_forward(chunk, batch)
        output = chunk_forward(model, batch)
        hooks.after_forward(chunk, batch)
        return output, partial(loss_fn, batch)

    iterators: Any = [iter(micro_batches) for _ in chunks]
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iterators if len(chunks) > 1 else iterators[0],
        model=chunks if len(chunks) > 1 else chunks[0],
        num_microbatches=len(micro_batches),
        seq_length=s,
        micro_batch_size=b,
        forward_only=forward_only,
    )
