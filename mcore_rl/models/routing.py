"""MoE routing replay, scoped to one engine: record each MoE layer's expert choices per token in
one forward, force them in a later one.

megatron-core 0.16.1 gives every router a ``RouterReplay`` (``moe_enable_routing_replay``) and
also appends it to one process-global list that its static helpers drive. ``EngineRouting``
takes its own routers' instances out of that list and drives them itself, so an actor and a
frozen reference model in one process (or a trainer's own megatron model) never see each
other's routes.

Routes live outside the micro-batches as ``[rows, seq, moe_layers, top_k]`` int64 (the batch
key ``ROUTED_EXPERTS``, aligned with ``input_ids``). Each micro-batch carries ``token_id``
[b, s] (its tokens' flat index row * seq + column in the rows the routes cover); a router's
input rows are this rank's tokens in megatron's order (sequence-major, this CP rank's columns,
this SP rank's slice; packed: this rank's stream places), so ``router_tokens`` maps each router
row to its token, -1 for padding and filler (routed to experts 0..top_k-1 under replay).
"""
from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from mcore_rl.errors import McoreRLError
from mcore_rl.models.context_parallel import cp_rank_size, split_for_cp
from mcore_rl.models.micro_batch import MicroBatch
from mcore_rl.models.packing import cp_stream_columns

Tensor = torch.Tensor
ROUTED_EXPERTS = "routed_experts"  # batch key: int64 [B, S, num MoE layers, top_k]
Mode = Literal["record", "replay"]


class RoutingError(McoreRLError, ValueError):
    """Routes that do not fit the model or the batch; the message names the shapes and the fix."""


class _Slot(NamedTuple):
    chunk: int  # index of the model chunk (virtual pipeline stage) holding the router
    layer: int  # the MoE layer's ordinal among all MoE layers of the model
    replay: RouterReplay


def router_tokens(mb: MicroBatch, sequence_parallel: bool) -> Tensor:
    """[n] token of each router input row of this rank (flat index, -1 for padding/filler)."""
    if mb.token_id is None:
        raise RoutingError("routing replay needs each micro-batch's token_id (the micro-batcher sets it; "
                           "a hand-made MicroBatch must too).")
    ids = torch.where(mb["attention_mask"].bool(), mb.token_id, -1)
    packed = mb.packed
    if packed is not None:  # stream place p holds the token the stream index points to p from
        stream = torch.full((packed.ids.shape[1],), -1, dtype=torch.long, device=ids.device)
        placed = packed.index >= 0
        stream[packed.index[placed]] = ids[placed]
        rank, size = cp_rank_size()
        if size > 1:
            stream = stream[cp_stream_columns(packed.cu_seqlens, rank, size)]
        tokens = stream[:, None]  # [t, 1]: sequence-major like [s, b]
    else:
        tokens = split_for_cp(ids, dim=1).t()  # [s/cp, b]
    if sequence_parallel and parallel_state.get_tensor_model_parallel_world_size() > 1:
        size = parallel_state.get_tensor_model_parallel_world_size()
        tokens = tokens.chunk(size, dim=0)[parallel_state.get_tensor_model_parallel_rank()]
    return tokens.reshape(-1)


class EngineRouting:
    """The routers of one engine's chunks, recorded or replayed per micro-batch."""

    def __init__(self, chunks: list[torch.nn.Module], moe_layers: tuple[bool, ...], top_k: int,
                 num_experts: int, sequence_parallel: bool) -> None:
        ordinal = {layer: i for i, layer in enumerate(l for l, moe in enumerate(moe_layers) if moe)}
        self.num_layers, self.top_k, self.num_experts = len(ordinal), top_k, num_experts
        self.sequence_parallel = sequence_parallel
        self.slots: list[_Slot] = []
        mine = set()
        for c, chunk in enumerate(chunks):
            for module in chunk.modules():
                replay = getattr(module, "router_replay", None)
                if isinstance(replay, RouterReplay):
                    mine.add(id(replay))
                    if module.layer_number - 1 in ordinal:  # not an MTP layer's router (routes freely)
                        self.slots.append(_Slot(c, ordinal[module.layer_number - 1], replay))
        # scoping: megatron's static helpers (and other engines) no longer reach these routers
        RouterReplay.global_router_replay_instances[:] = [
            r for r in RouterReplay.global_router_replay_instances if id(r) not in mine
        ]
        self.mode: Mode | None = None
        self.routes: Tensor | None = None

    def begin(self, mode: Mode, rows: int, seq: int, routes: Tensor | None = None) -> None:
        """Start recording into, or replaying from, routes of ``rows`` x ``seq`` tokens."""
        shape = (rows, seq, self.num_layers, self.top_k)
        if mode == "replay":
            if routes is None or tuple(routes.shape) != shape:
                raise RoutingError(
                    f"{ROUTED_EXPERTS} has shape {None if routes is None else tuple(routes.shape)}; "
                    f"replay needs [rows, seq, MoE layers, top_k] = {list(shape)}: pass the routes "
                    "recorded by compute_log_prob (R2) or the rollout (R3) for these rows."
                )
            if routes.is_floating_point() or not bool(((routes >= -1) & (routes < self.num_experts)).all()):
                raise RoutingError(
                    f"{ROUTED_EXPERTS} must hold expert indices in [0, {self.num_experts}) (-1 at "
                    f"padding); got {routes.dtype} values in [{int(routes.min())}, {int(routes.max())}]."
                )
            self.routes = routes.reshape(rows * seq, self.num_layers, self.top_k).long()
        else:
            self.routes = torch.full((rows * seq, self.num_layers, self.top_k), -1, dtype=torch.long)  # host: small, filled from each micro-batch, moved to the device by end()
        action = RouterReplayAction.REPLAY_FORWARD if mode == "replay" else RouterReplayAction.RECORD
        for slot in self.slots:
            slot.replay.set_router_replay_action(action)
        self.mode = mode

    def before_forward(self, chunk: int, mb: MicroBatch) -> None:
        """Replay: give this chunk's routers the routes of ``mb``'s tokens."""
        if self.mode != "replay":
            return
        tokens = router_tokens(mb, self.sequence_parallel)
        routes = self.routes.to(tokens.device)
        fallback = torch.arange(self.top_k, device=tokens.device).expand(tokens.numel(), -1)
        for slot in self.slots:
            if slot.chunk == chunk:
                chosen = routes[tokens.clamp(min=0), slot.layer]
                slot.replay.clear_indices()  # only the current micro-batch's routes are kept
                slot.replay.set_target_indices(torch.where((tokens >= 0)[:, None], chosen, fallback))

    def after_forward(self, chunk: int, mb: MicroBatch) -> None:
        """Record: store what this chunk's routers chose for ``mb``'s tokens."""
        if self.mode != "record":
            return
        tokens = router_tokens(mb, self.sequence_parallel)
        real = tokens >= 0
        for slot in self.slots:
            if slot.chunk == chunk:
                chosen = slot.replay.get_recorded_indices()
                self.routes[tokens[real].cpu(), slot.layer] = chosen[real].long().cpu()

    def end(self, combine: bool = True) -> Tensor | None:
        """Stop; a recording returns the routes [rows * seq, layers, top_k] combined over the
        TP, CP and PP groups (each token's layers from the ranks that routed them; collective).
        ``combine=False`` (after an error) only resets the routers."""
        for slot in self.slots:
            slot.replay.clear_router_replay_action()
            slot.replay.clear_indices()
        mode, routes, self.mode, self.routes = self.mode, self.routes, None, None
        if mode != "record" or not combine:
            return None
        device = _device()
        routes = routes.to(device)
        for group in (parallel_state.get_tensor_model_parallel_group(),
                      parallel_state.get_context_parallel_group(),
                      parallel_state.get_pipeline_model_parallel_group()):
            if torch.distributed.get_world_size(group) > 1:
                torch.distributed.all_reduce(routes, op=torch.distributed.ReduceOp.MAX, group=group)
        return routes


def without_routes(batch: dict) -> dict:
    """``batch`` without ``ROUTED_EXPERTS`` (its [B, S, ...] shape fits no micro-batch key)."""
    return {k: v for k, v in batch.items() if k != ROUTED_EXPERTS}


def _device() -> torch.device:
    from mcore_rl.platform import active_platform

    return active_platform().device()
