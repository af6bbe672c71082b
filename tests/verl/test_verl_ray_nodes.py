"""Node identity of verl's Ray workers for mcore_rl's checkpoints: Ray's node ids become
MCORE_RL_NODE_RANK / MCORE_RL_LOCAL_RANK (verl leaves LOCAL_RANK unset on CPU workers, so every
rank would claim to lead node 0; the main_ppo tests save through it under Ray)."""
from __future__ import annotations

import os

import pytest

from tests.dist import run_ranks

pytest.importorskip("verl")


def test_node_ranks_from_node_ids():
    from mcore_rl.integrations.verl.ray_nodes import node_ranks

    ids = ["node-b", "node-a", "node-b", "node-a", "node-c"]
    assert [node_ranks(ids, r) for r in range(5)] == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0)]


def _leaders(identity: dict | None) -> dict:
    from mcore_rl.checkpoint import storage

    os.environ.pop("GROUP_RANK", None)
    os.environ.pop("LOCAL_RANK", None)  # as under Ray: no torchrun variables
    if identity is not None:
        rank = __import__("torch").distributed.get_rank()
        os.environ[storage.NODE_ENV], os.environ[storage.LOCAL_ENV] = (str(v) for v in identity[rank])
    try:
        return {"leaders": storage.node_leaders()}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": str(e)}


def test_checkpoint_nodes_follow_the_exported_identity():
    two_nodes = run_ranks(2, _leaders, {0: (0, 0), 1: (1, 0)})
    assert two_nodes[0] == {"leaders": {0: 0, 1: 1}}
    one_node = run_ranks(2, _leaders, {0: (0, 0), 1: (0, 1)})
    assert one_node[0] == {"leaders": {0: 0}}
    unset = run_ranks(2, _leaders, None)  # what the first verl save under Ray met before
    assert "exactly one process with LOCAL_RANK=0" in unset[0]["error"]
