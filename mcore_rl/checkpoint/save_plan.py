"""The planning half of a torch_dist save, reused while the saved structure does not change.

megatron's save validates the sharding of every save (every rank's ShardedTensor metadata
gathered, rank 0 checks that the main replicas cover each tensor without overlap) and plans it
(every rank's local plan gathered, rank 0 builds the global metadata). Both depend only on the
structure: keys, shapes, offsets, replica ids, dtypes, not on the values. A ``SaveStructure``
kept between saves of one state dict holds this rank's validated sharding metadata and local
plan, the central plan and (rank 0) the global metadata; a save reuses them when every rank's
metadata and local plan equal the kept ones (one flag all-reduce), and validates and plans
afresh otherwise. The reuse goes through megatron-core's own cached-plan entry point
(``save_state_dict_async_plan(cached_ckpt_structure=...)``), but unlike megatron's
``cached_metadata`` mode (which trusts the structure to stay constant) every save compares.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.strategies.state_dict_saver import save_state_dict_async_plan
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
from megatron.core.dist_checkpointing.utils import _clean_metadata_for_serialization
from megatron.core.dist_checkpointing.validation import validate_sharding_integrity
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan

from mcore_rl.checkpoint.collective import agreed, all_ranks_ok


@dataclass
class SaveStructure:
    """What the last fully validated and planned save of one state dict left to reuse (this
    rank's view; ``global_metadata`` on the coordinator, rank 0, only). Empty: nothing yet."""

    sharding: list | None = None  # this rank's ShardedTensor/ShardedObject metadata, data stripped
    local_plan: SavePlan | None = None  # this rank's DCP local plan
    central_plan: SavePlan | None = None  # its plan after global planning
    global_metadata: Metadata | None = None  # the .metadata skeleton (rank 0)


class LocalPlan(NamedTuple):
    """A rank's part of a save before any collective: the DCP state dict, its set-up planner,
    its local plan and the sharding metadata it was derived from."""

    state: dict[str, Any]
    planner: MCoreSavePlanner
    plan: SavePlan
    sharding: list


def local_plan(sharded: dict, keep_only_main_replica: bool) -> LocalPlan:
    """This rank's local plan of ``sharded`` (a preprocessed sharded state dict; no collective)."""
    sharding = [item.without_data() for item in nested_values(sharded)]
    state, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, keep_only_main_replica)
    state = mcore_to_pyt_state_dict(state, False)
    planner = MCoreSavePlanner(dedup_replicated_tensors=not keep_only_main_replica, flatten_state_dict=False)
    planner.set_up_planner(state, is_coordinator=torch.distributed.get_rank() == 0)
    return LocalPlan(state, planner, planner.create_local_plan(), sharding)


def unchanged_everywhere(local: LocalPlan, structure: SaveStructure | None) -> bool:
    """Collective: whether every rank's sharding metadata and local plan equal ``structure``'s
    (``None`` on a rank: no reuse anywhere)."""
    same = (structure is not None and structure.local_plan is not None
            and structure.sharding == local.sharding and structure.local_plan == local.plan)
    return all_ranks_ok(same)


def validate(local: LocalPlan, common: dict) -> None:
    """Collective: megatron's sharding validation of ``save_preprocess`` (every rank's sharding
    metadata gathered; rank 0 checks coverage and overlaps; the common state compared with
    rank 0's), its refusal on rank 0 raised on every rank."""
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, local.sharding)
    agreed(lambda: validate_sharding_integrity(every, common_state_dict=common),
           "validating the sharding of the checkpoint (megatron's validate_sharding_integrity)")


def clean_common(common: dict) -> None:
    """What ``save_preprocess`` does to the common state before validating and saving it."""
    if "content_metadata" in common:
        common["content_metadata"] = _clean_metadata_for_serialization(common["content_metadata"])


def plan_save(local: LocalPlan, writer, structure: SaveStructure | None, reuse: bool) -> tuple:
    """Collective: megatron's save planning of ``local`` for ``writer``; ``reuse`` (agreed by
    ``unchanged_everywhere``): the central plan and global metadata of ``structure``, no
    gather. Records a fresh plan in ``structure``. Returns megatron's
    ``(writer, global_metadata, dist_wrapper)`` for the finalize."""
    cached = (structure.central_plan, local.plan, True) if reuse else (None, local.plan, False)
    planned = save_state_dict_async_plan(local.state, writer, None, 0, planner=local.planner,
                                         cached_ckpt_structure=cached)
    (writer, global_metadata, dist_wrapper), central_plan = planned[0], planned[1]
    if reuse:
        return writer, structure.global_metadata, dist_wrapper
    if structure is not None:
        structure.sharding, structure.local_plan = local.sharding, local.plan
        structure.central_plan, structure.global_metadata = central_plan, global_metadata
    return writer, global_metadata, dist_wrapper
