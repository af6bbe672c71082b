"""Batch plumbing shared by actor, critic and sampler: this DP rank's rows, micro-batches,
response-aligned outputs, and the ppo_epochs x mini-batches update loop."""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from mcore_rl.models.forward import LossFn
from mcore_rl.rl import losses
from mcore_rl.rl.batch import BatchError, response_mask, select_rows, split_by_tokens, split_rows
from mcore_rl.rl.engine import ModelEngine, all_reduce_dp, dp_rank_size

Tensor = torch.Tensor


class BatchingConfig(Protocol):
    micro_batch_size: int
    max_tokens_per_micro_batch: int | None
    ppo_mini_batch_size: int
    ppo_epochs: int
    loss_agg_mode: str


def local_rows(batch: dict) -> dict:
    """This DP rank's contiguous slice of the global batch."""
    rank, size = dp_rank_size()
    b = batch["input_ids"].shape[0]
    if b % size != 0:
        raise BatchError(f"batch of {b} rows does not divide over {size} data-parallel ranks.")
    per = b // size
    return select_rows(batch, slice(rank * per, (rank + 1) * per))


def micro_batches(batch: dict, config: BatchingConfig, engine: ModelEngine) -> list[dict]:
    """Fixed-size micro-batches, or token-budget ones that keep the pipeline schedule's rules."""
    if config.max_tokens_per_micro_batch:
        multiple = engine.layout.pp if engine.layout.vpp else 1
        return split_by_tokens(batch, config.max_tokens_per_micro_batch, multiple)
    return split_rows(batch, min(config.micro_batch_size, batch["input_ids"].shape[0]))


def response_logits(output: Tensor, batch: dict) -> Tensor:
    """Outputs [b, R, ...] at the positions that predict the R response tokens (p predicts p+1)."""
    s, r = batch["input_ids"].shape[1], batch["responses"].shape[1]
    return output[:, s - r - 1 : s - 1]


# make_loss(denominator, scale) -> loss_fn; loss_fn returns (loss * scale, stats) where stats has
# 'tokens', token-weighted sums named '*_sum' (reported as means) and plain sums (reported as is)
LossMaker = Callable[[float, int], LossFn]


def ppo_update(engine: ModelEngine, batch: dict, config: BatchingConfig, make_loss: LossMaker, prefix: str) -> dict:
    """ppo_epochs x mini-batches of ppo_mini_batch_size global rows, one optimizer step each;
    returns metrics averaged over the steps (same on every rank), keys prefixed '{prefix}/'."""
    rows = batch["input_ids"].shape[0]
    engine.train(True)
    steps = []
    for _ in range(config.ppo_epochs):
        for mini in split_rows(batch, min(config.ppo_mini_batch_size, rows)):
            steps.append(_mini_batch_step(engine, mini, config, make_loss, prefix))
    return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}


def _mini_batch_step(engine: ModelEngine, mini: dict, config: BatchingConfig, make_loss: LossMaker, prefix: str) -> dict:
    denominator = losses.global_denominator(response_mask(mini), config.loss_agg_mode)
    pieces = micro_batches(local_rows(mini), config, engine)
    # megatron divides each micro-batch loss by the micro-batch count and DDP averages over DP;
    # with a global denominator the sum over all of them is the mini-batch loss
    scale = len(pieces) * dp_rank_size()[1]
    stats = engine.run(pieces, make_loss(denominator, scale), False)
    step = engine.step()
    totals = {k: all_reduce_dp(sum(s[k] for s in stats)) for k in stats[0]}
    tokens = totals.pop("tokens").clamp(min=1)
    metrics = {k.removesuffix("_sum"): float(v / tokens) for k, v in totals.items() if k.endswith("_sum")}
    metrics.update({k: float(v) for k, v in totals.items() if not k.endswith("_sum")})
    return {f"{prefix}/{k}": v for k, v in {**metrics, **step}.items()}
