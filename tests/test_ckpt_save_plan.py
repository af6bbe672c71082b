"""The torch_dist save plan kept between saves (checkpoint/save_plan.py): a save of an unchanged
structure reuses the validated plan and writes the new values; a structure changed on one rank
only, or on every rank, is validated and planned afresh on every rank; each checkpoint loads
back (megatron's own loader) with the values of its save."""
from __future__ import annotations

import os

import torch

from tests.dist import run_ranks


def _state(rows: int, value: float, rank_one_extra: bool) -> dict:
    """``w``: (2 * rows, 3) split by rows over the 2 ranks; ``only1``: a tensor rank 1 alone
    holds (when ``rank_one_extra``); ``step``: common state (``common.pt``)."""
    from megatron.core.dist_checkpointing import ShardedTensor

    rank = torch.distributed.get_rank()
    w = torch.arange(rows * 3, dtype=torch.float32).reshape(rows, 3) + 100 * value + 10 * rank
    state = {"w": ShardedTensor.from_rank_offsets("w", w, (0, rank, 2)), "step": int(value)}
    if rank_one_extra and rank == 1:
        state["only1"] = ShardedTensor.from_rank_offsets("only1", torch.full((5,), value))
    return state


def _saves_and_loads(root: str) -> dict:
    from megatron.core import dist_checkpointing

    from mcore_rl.checkpoint.save_plan import SaveStructure
    from mcore_rl.checkpoint.writer import ItemSaveStrategy, plan_item_save

    structure, plans, ok = SaveStructure(), [], []
    cases = [(2, 1.0, False), (2, 2.0, False), (2, 3.0, True), (3, 4.0, False)]
    for n, (rows, value, extra) in enumerate(cases):
        path = os.path.join(root, str(n))
        if torch.distributed.get_rank() == 0:
            os.makedirs(path)
        torch.distributed.barrier()
        plan_item_save(_state(rows, value, extra), path, ItemSaveStrategy(structure=structure)).execute_sync()
        plans.append(structure.central_plan)
    for n, (rows, value, extra) in enumerate(cases):
        expected = _state(rows, value, extra)
        template = _state(rows, -1.0, extra)
        loaded = dist_checkpointing.load(template, os.path.join(root, str(n)))
        ok.append(torch.equal(loaded["w"], expected["w"].data) and loaded["step"] == int(value)
                  and (not ("only1" in expected) or torch.equal(loaded["only1"], expected["only1"].data)))
    # which saves reused the plan of the save before (the same central plan object)
    reused = [plans[n] is plans[n - 1] for n in range(1, len(plans))]
    return {"ok": ok, "reused": reused}


def test_plan_reused_while_unchanged_and_redone_when_any_rank_changes(tmp_path):
    out = run_ranks(2, _saves_and_loads, str(tmp_path), daemon=False, timeout_s=180)
    for rank in out:
        assert rank["ok"] == [True] * 4  # every checkpoint holds the values of its own save
        # save 2 reused save 1's plan; save 3 changed on rank 1 only: both ranks replanned;
        # save 4 changed the shape everywhere
        assert rank["reused"] == [True, False, False]
