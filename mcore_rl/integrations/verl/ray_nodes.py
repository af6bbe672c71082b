"""Which ranks share a node when verl's workers are Ray actors.

mcore_rl's checkpoints need each rank's node and its rank within the node (one writer per
node-local disk; see ``mcore_rl.checkpoint.storage``). torchrun states them (``GROUP_RANK``,
``LOCAL_RANK``); Ray does not, and verl leaves ``LOCAL_RANK`` unset (every CPU worker would claim
to lead node 0) or sets it per GPU. ``set_node_identity()`` takes them from Ray's node ids and
exports them as ``MCORE_RL_NODE_RANK`` / ``MCORE_RL_LOCAL_RANK``, variables only mcore_rl reads
(verl's own ``LOCAL_RANK`` stays untouched: it picks the GPU).
"""
from __future__ import annotations

import os

from mcore_rl.checkpoint.collective import all_gather_bytes
from mcore_rl.checkpoint.storage import LOCAL_ENV, NODE_ENV


def node_ranks(node_of_rank: list[str], rank: int) -> tuple[int, int]:
    """(node index, rank within the node) of ``rank``; nodes are numbered in the order of their
    lowest global rank."""
    order = list(dict.fromkeys(node_of_rank))
    node = node_of_rank[rank]
    return order.index(node), [r for r, n in enumerate(node_of_rank) if n == node].index(rank)


def set_node_identity() -> bool:
    """Collective over the world: when this process is a Ray worker launched without torchrun's
    ``GROUP_RANK``, exports its node and local rank from Ray's node ids; returns whether it did."""
    import torch

    ray_worker = "GROUP_RANK" not in os.environ and _ray_node_id() is not None
    flags = all_gather_bytes(b"1" if ray_worker else b"0")
    if set(flags) != {b"1"}:  # decided alike on every rank (the gathers below are collective)
        return False
    ids = [raw.decode() for raw in all_gather_bytes(_ray_node_id().encode())]
    node, local = node_ranks(ids, torch.distributed.get_rank())
    os.environ[NODE_ENV], os.environ[LOCAL_ENV] = str(node), str(local)
    return True


def _ray_node_id() -> str | None:
    try:
        import ray
    except ImportError:
        return None
    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
