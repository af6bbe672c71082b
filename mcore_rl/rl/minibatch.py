"""Batch plumbing shared by actor, critic and sampler: which rows this rank computes
(dispatch), micro-batches through the one micro-batcher, response-aligned outputs, and the
ppo_epochs x mini-batches update loop.

Dispatch modes (``config.dispatch``):
  global   every rank passes the same global batch [B, ...]; each DP rank computes its
           contiguous slice and results come back as [B, R] on every rank.
  sharded  each DP rank passes only its own rows (TP/PP peers of one DP rank pass the same
           rows) and gets only its own results [B_local, R]. How verl and NeMo-RL dispatch.
Batch sizes stay global in both: ``ppo_mini_batch_size`` is rows of the global batch; in
sharded mode each DP rank takes ppo_mini_batch_size / DP of its rows per mini-batch.
Results are returned on the device of the batch the caller passed (CPU batch -> CPU results).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable, Iterator, Protocol

import torch
from megatron.core import parallel_state

from mcore_rl.models.forward import LossFn
from mcore_rl.models.micro_batch import MicroBatch, as_micro_batch
from mcore_rl.models.routing import ROUTED_EXPERTS, without_routes
from mcore_rl.rl.batch import BatchError, response_mask, select_rows, split_rows
from mcore_rl.rl.cp_view import all_reduce_cp, cp_loss_fn
from mcore_rl.rl.engine import ModelEngine, all_reduce_dp, dp_rank_size, gather_dp
from mcore_rl.rl.microbatcher import MicroBatches, MicroBatchSpec, plan_micro_batches

Tensor = torch.Tensor


class BatchingConfig(Protocol):
    micro_batch_size: int
    max_tokens_per_micro_batch: int | None
    ppo_mini_batch_size: int
    ppo_epochs: int
    loss_agg_mode: str
    dispatch: str
    use_remove_padding: bool


class BatchMismatchError(BatchError):
    """Ranks that must pass the same rows passed different ones."""


def local_rows(batch: dict) -> dict:
    """This DP rank's contiguous slice of the global batch."""
    rank, size = dp_rank_size()
    b = batch["input_ids"].shape[0]
    if b % size != 0:
        raise BatchError(
            f"batch of {b} rows does not divide over {size} data-parallel ranks; pass a multiple of "
            f"{size} rows (add empty rows with attention_mask 0) or use dispatch='sharded'."
        )
    per = b // size
    return select_rows(batch, slice(rank * per, (rank + 1) * per))


def _checksum(batch: dict) -> Tensor:
    """[keys, B, S, R, weighted sum of every value] as float64 (host): equal batches, equal sums."""
    stats = [float(len(batch)), *batch["input_ids"].shape, float(batch["responses"].shape[1])]
    total = 0.0
    for k in sorted(batch):
        v = torch.nan_to_num(batch[k].double().flatten())  # NaN at padding must not mismatch
        weights = torch.arange(1, v.numel() + 1, dtype=torch.float64, device=v.device).remainder_(9973)
        total += float((v * (weights + 1)).sum()) * (1 + len(k))
    return torch.tensor([*stats, total], dtype=torch.float64)  # host: moved to the device by the caller


def check_same_rows(batch: dict, group, what: str) -> None:
    """Raises BatchMismatchError unless every rank of ``group`` passed the same batch."""
    if torch.distributed.get_world_size(group) == 1:
        return
    mine = _checksum(batch).to(active_device())
    both = torch.cat([mine, -mine])
    torch.distributed.all_reduce(both, op=torch.distributed.ReduceOp.MAX, group=group)
    n = mine.numel()
    if not torch.equal(both[:n], -both[n:]):
        raise BatchMismatchError(
            f"ranks of one {what} passed different batches (shape or checksum differ: this rank "
            f"{mine.tolist()}); {what} peers must pass the same rows. With dispatch='sharded' give "
            "the TP/PP peers of a DP rank the same rows; with dispatch='global' give every rank "
            "the whole batch."
        )


def active_device() -> torch.device:
    from mcore_rl.platform import active_platform

    return active_platform().device()


def dispatch_rows(batch: dict, config: BatchingConfig) -> dict:
    """This rank's rows per ``config.dispatch`` (module doc), after the same-rows check."""
    if config.dispatch == "global":
        check_same_rows(batch, None, "world (dispatch='global')")
        return local_rows(batch)
    if config.dispatch != "sharded":
        raise BatchError(f"dispatch={config.dispatch!r} is not a mode; use 'global' or 'sharded'.")
    check_same_rows(batch, parallel_state.get_model_parallel_group(), "model-parallel group")
    return batch


def spec_for(config: BatchingConfig, engine: ModelEngine) -> MicroBatchSpec:
    """The micro-batcher's settings for this engine's layout."""
    layout = engine.layout
    packed = config.use_remove_padding
    return MicroBatchSpec(
        collate="packed" if packed else "padding",
        pack_multiple=2 * layout.cp if layout.cp > 1 else 1,
        micro_batch_size=config.micro_batch_size,
        max_tokens=config.max_tokens_per_micro_batch,
        seq_multiple=engine.seq_multiple,
        uniform_shape=layout.pp > 1 or engine.needs_equal_tokens_over_dp,
        count_multiple=layout.pp if layout.vpp else 1,
    )


def micro_batch_plan(batch: dict, config: BatchingConfig, engine: ModelEngine) -> MicroBatches:
    """This rank's rows cut into micro-batches (see mcore_rl.rl.microbatcher)."""
    spec = spec_for(config, engine)
    plan = plan_micro_batches(batch, spec)
    # counts differ between DP ranks with dynamic batching or sharded rows; MoE layers whose
    # expert group spans DP ranks run collectives in every forward (allgather: equal shapes too)
    if dp_rank_size()[1] == 1 or not (config.max_tokens_per_micro_batch or engine.experts_span_dp):
        return plan
    first = plan.batches[0]  # uniform_shape: every piece has this shape (packed: this stream length)
    b, s = first["input_ids"].shape[0], first.shape[1]
    agreed = all_reduce_dp(torch.tensor([len(plan.batches), b, s], device=active_device()),
                           torch.distributed.ReduceOp.MAX).tolist()
    new = replace(spec, min_count=agreed[0])
    if engine.needs_equal_tokens_over_dp:
        new = replace(new, min_rows=agreed[1], min_width=agreed[2])
    if (agreed[0], agreed[1], agreed[2]) != (len(plan.batches), b, s):
        plan = plan_micro_batches(batch, new)
    return plan


def micro_batches(batch: dict, config: BatchingConfig, engine: ModelEngine) -> list[MicroBatch]:
    """The micro-batches alone (the demo sampler's entry point; row order kept when all rows
    have one length). Prefer micro_batch_plan, whose restore() puts rows back in order."""
    return micro_batch_plan(batch, config, engine).batches


def forward_rows(engine: ModelEngine, batch: dict, config: BatchingConfig, loss_fn: LossFn,
                 keys: tuple[str, ...], record_routing: bool = False,
                 replay_routing: bool = False) -> dict[str, Tensor]:
    """Forward-only over this rank's rows; results ``keys`` ([b, R] per micro-batch) as
    [B, R] (global dispatch) or [B_local, R] (sharded), on the batch's device.
    ``record_routing`` (MoE): also ``ROUTED_EXPERTS`` [B(_local), S, MoE layers, top_k], every
    MoE layer's experts for each real token (-1 at padding). ``replay_routing``: route every
    token to ``batch[ROUTED_EXPERTS]`` instead."""
    engine.train(False)
    local = dispatch_rows(batch if replay_routing else without_routes(batch), config)
    if record_routing:  # micro-batches index their tokens into local's rows (MicroBatch.token_id)
        engine.routing.begin("record", *local["input_ids"].shape)
    elif replay_routing:
        routes = local[ROUTED_EXPERTS]
        local = without_routes(local)
        engine.routing.begin("replay", *local["input_ids"].shape, routes.to(local["input_ids"].device))
    try:
        plan = micro_batch_plan(local, config, engine)
        results = engine.run(plan.batches, cp_loss_fn(loss_fn), True)
    except BaseException:
        if record_routing or replay_routing:
            engine.routing.end(combine=False)
        raise
    if replay_routing:
        engine.routing.end(combine=False)
    out = {}
    for key in keys:
        value = all_reduce_cp(plan.restore([r[key] for r in results]))  # each CP rank: its tokens
        if config.dispatch == "global":
            value = gather_dp(value)
        out[key] = value.to(batch["input_ids"].device)
    if record_routing:
        routes = engine.routing.end().view(*local["input_ids"].shape, engine.routing.num_layers, -1)
        out[ROUTED_EXPERTS] = (gather_dp(routes) if config.dispatch == "global" else routes).to(
            batch["input_ids"].device)
    return out


def response_logits(output: Tensor, batch: MicroBatch | dict) -> Tensor:
    """Outputs [b, R, ...] at the positions that predict the R response tokens (p predicts p+1);
    for a context-parallel view, the local output columns that score its R_local tokens."""
    batch = as_micro_batch(batch)
    cp = batch.cp
    if cp is not None and cp.out_index is not None:
        return output.index_select(1, cp.out_index)
    if cp is not None and cp.packed_out is not None:  # packed under CP: local stream places (rl/cp_view.py)
        return output[0][cp.packed_out]
    s, r = batch["input_ids"].shape[1], batch["responses"].shape[1]
    if batch.packed is not None:  # output [1, T, ...]; padding positions read token 0 (masked later)
        return output[0][batch.packed.index[:, s - r - 1 : s - 1].clamp(min=0)]
    return output[:, s - r - 1 : s - 1]


# make_loss(denominator, scale) -> loss_fn; loss_fn returns (loss * scale, stats) where stats has
# 'tokens', token-weighted sums named '*_sum' (reported as means) and plain sums (reported as is)
LossMaker = Callable[[float, int], LossFn]


def _local_minis(batch: dict, config: BatchingConfig) -> Iterator[dict]:
    """This rank's rows of each mini-batch of ppo_mini_batch_size global rows."""
    dp = dp_rank_size()[1]
    if config.dispatch == "global":
        rows = batch["input_ids"].shape[0]
        for mini in split_rows(batch, min(config.ppo_mini_batch_size, rows)):
            yield local_rows(mini)
        return
    rows = batch["input_ids"].shape[0]
    if config.ppo_mini_batch_size % dp != 0:
        raise BatchError(
            f"ppo_mini_batch_size={config.ppo_mini_batch_size} global rows does not divide over "
            f"{dp} data-parallel ranks; choose a multiple of {dp}."
        )
    yield from split_rows(batch, min(config.ppo_mini_batch_size // dp, rows))


def ppo_update(engine: ModelEngine, batch: dict, config: BatchingConfig, make_loss: LossMaker, prefix: str,
               replay_routing: bool = False) -> dict:
    """ppo_epochs x mini-batches of ppo_mini_batch_size global rows, one optimizer step each;
    returns metrics averaged over the steps (same on every rank), keys prefixed '{prefix}/'.
    ``replay_routing`` (MoE): every MoE layer routes each token to ``batch[ROUTED_EXPERTS]``."""
    if not replay_routing:
        batch = without_routes(batch)
    if config.dispatch == "sharded":
        batch = dispatch_rows(batch, config)
        _check_equal_rows_over_dp(batch)
    else:
        check_same_rows(batch, None, "world (dispatch='global')")
    engine.train(True)
    steps = []
    for _ in range(config.ppo_epochs):
        for mini in _local_minis(batch, config):
            steps.append(_mini_batch_step(engine, mini, config, make_loss, prefix, replay_routing))
    return {k: sum(s[k] for s in steps) / len(steps) for k in steps[0]}


def _check_equal_rows_over_dp(batch: dict) -> None:
    # every DP rank must take the same number of optimizer steps
    rows = torch.tensor([batch["input_ids"].shape[0]] * 2, device=active_device())
    rows[1] = -rows[1]
    rows = all_reduce_dp(rows, torch.distributed.ReduceOp.MAX)
    if int(rows[0]) != -int(rows[1]):
        raise BatchMismatchError(
            f"data-parallel ranks passed between {-int(rows[1])} and {int(rows[0])} rows to an "
            "update with dispatch='sharded'; give every DP rank the same number of rows."
        )


def _denominator(mask: Tensor, agg_mode: str) -> float:
    """The mini-batch's global token count (token-mean) or non-empty row count (seq-mean-*)."""
    local = mask.sum() if agg_mode == "token-mean" else (mask.sum(-1) > 0).sum()
    return float(all_reduce_dp(local.to(active_device()).double()).clamp(min=1))


def _mini_batch_step(engine: ModelEngine, mini: dict, config: BatchingConfig, make_loss: LossMaker, prefix: str,
                     replay_routing: bool) -> dict:
    denominator = _denominator(response_mask(mini), config.loss_agg_mode)
    if replay_routing:
        routes = mini[ROUTED_EXPERTS]
        mini = without_routes(mini)
        engine.routing.begin("replay", *mini["input_ids"].shape, routes.to(mini["input_ids"].device))
    pieces = micro_batch_plan(mini, config, engine).batches
    # megatron divides each micro-batch loss by the micro-batch count (and multiplies it by CP)
    # and DDP averages over DP x CP; with a global denominator the sum over all of them is the
    # mini-batch loss (each CP rank's loss covers the tokens it scores)
    scale = len(pieces) * dp_rank_size()[1]
    try:
        stats = engine.run(pieces, cp_loss_fn(make_loss(denominator, scale)), False)
    finally:
        if replay_routing:
            engine.routing.end(combine=False)
    step = engine.step()
    totals = {k: all_reduce_cp(all_reduce_dp(sum(s[k] for s in stats))) for k in stats[0]}
    tokens = totals.pop("tokens").clamp(min=1)
    metrics = {k.removesuffix("_sum"): float(v / tokens) for k, v in totals.items() if k.endswith("_sum")}
    metrics.update({k: float(v) for k, v in totals.items() if not k.endswith("_sum")})
    return {f"{prefix}/{k}": v for k, v in {**metrics, **step}.items()}
