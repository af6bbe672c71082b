"""Router replay in verl's layout: ``routed_experts`` as verl's Megatron engine has it, a jagged
[b, j, MoE layers, top_k] (every token of ``input_ids``), recorded by ``compute_log_prob`` (R2)
or given by the rollout (R3), replayed whenever a batch carries it.

All micro-batches of one ``forward_backward_batch`` share one route table: micro-batch i's tokens
follow those of micro-batches 0..i-1 (``input_ids.values()`` order within each), and every model
input gets a ``token_id`` pointing into it (``models.routing``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Literal

import torch
from tensordict import TensorDict

from mcore_rl.models.micro_batch import MicroBatch
from mcore_rl.models.routing import ROUTED_EXPERTS, EngineRouting
from mcore_rl.rl.batch import BatchError

Tensor = torch.Tensor
Action = Literal["record", "replay"] | None


def action(mode: str, data: TensorDict, forward_only: bool, enabled: bool | None) -> Action:
    """What this batch does with routing: R2 records in a forward-only pass over a batch without
    routes; any active mode replays the routes a batch carries (R2's update, R3's rollout routes).
    ``enabled``: verl's ``enable_routing_replay`` flag when its worker sets one (False: the
    reference policy's pass)."""
    if mode == "disabled" or enabled is False:
        return None
    has_routes = ROUTED_EXPERTS in data.keys()
    if forward_only and mode == "R2" and not has_routes:
        return "record"
    if has_routes:
        return "replay"
    if not forward_only:
        raise BatchError(f"router_replay.mode={mode!r}: the update batch has no {ROUTED_EXPERTS!r} "
                         "(R2: from compute_log_prob's output; R3: from the rollout).")
    return None


def _token_counts(micro: list[TensorDict]) -> list[int]:
    return [int(mb["input_ids"].offsets()[-1]) for mb in micro]


def attach_token_ids(inputs: list[MicroBatch], micro: list[TensorDict]) -> tuple[list[MicroBatch], int]:
    """Every model input with its ``token_id`` [b, s] (rows right-padded in input order, as
    ``verl_batches.model_inputs`` lays them out), and the tokens of all micro-batches."""
    base, out = 0, []
    for inp, mb, count in zip(inputs, micro, _token_counts(micro)):
        ids = inp["input_ids"]
        starts = mb["input_ids"].offsets()[:-1].to(ids.device)
        first = torch.zeros(ids.shape[0], dtype=torch.long, device=ids.device)
        first[: starts.numel()] = starts + base  # filler rows: masked, any index
        out.append(replace(inp, token_id=first[:, None] + torch.arange(ids.shape[1], device=ids.device)[None]))
        base += count
    return out, base


def begin(routing: EngineRouting, act: Action, micro: list[TensorDict], total: int) -> None:
    """Starts recording or replaying over the ``total`` tokens of ``micro``."""
    if act == "record":
        routing.begin("record", 1, total)
    elif act == "replay":
        routes = torch.cat([mb[ROUTED_EXPERTS].values() for mb in micro])
        routing.begin("replay", 1, total, routes.reshape(1, total, *routes.shape[1:]))


def per_micro_batch(routes: Tensor, micro: list[TensorDict]) -> list[Tensor]:
    """Recorded routes [total, layers, top_k] -> one jagged [b, j, layers, top_k] per micro-batch."""
    out, base = [], 0
    for mb, count in zip(micro, _token_counts(micro)):
        offsets = mb["input_ids"].offsets()
        out.append(torch.nested.nested_tensor_from_jagged(routes[base:base + count].to(offsets.device), offsets=offsets))
        base += count
    return out
