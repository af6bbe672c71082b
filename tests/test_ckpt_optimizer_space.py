"""optimizer_space's geometry, single process: ``flat_range_boxes`` against brute force (the
boxes cover exactly the flat range, in flat order, each contiguous, within the bound on their
count) and ``param_pieces`` on a swiglu factory (each piece's data is the param's elements at
its global offset)."""
from __future__ import annotations

import math
import random

import pytest
import torch

from mcore_rl.checkpoint.optimizer_space import flat_range_boxes, param_pieces


def _covered(shape: tuple[int, ...], boxes) -> list[list[int]]:
    """The flat indices of each box, in the box's own row-major order."""
    index = torch.arange(math.prod(shape)).view(shape) if shape else torch.arange(1).view(())
    out = []
    for offset, size in boxes:
        assert all(s > 0 for s in size) and len(offset) == len(shape) == len(size), (offset, size)
        part = index[tuple(slice(o, o + s) for o, s in zip(offset, size))]
        out.append(part.reshape(-1).tolist())
    return out


CASES = [((7,), 0, 7), ((7,), 2, 5), ((7,), 3, 3), ((4, 5), 0, 20), ((4, 5), 3, 17), ((4, 5), 5, 15),
         ((4, 5), 6, 8), ((3, 4, 5), 7, 53), ((3, 4, 5), 0, 60), ((3, 4, 5), 21, 22), ((2, 3, 4, 5), 1, 119),
         ((), 0, 1), ((6, 1), 1, 5), ((1, 9), 2, 8)]


def test_flat_range_boxes_against_brute_force():
    rng = random.Random(0)
    cases = list(CASES)
    for _ in range(400):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        numel = math.prod(shape)
        start = rng.randint(0, numel)
        cases.append((shape, start, rng.randint(start, numel)))
    kinds = set()
    for shape, start, stop in cases:
        boxes = flat_range_boxes(shape, start, stop)
        flat = _covered(shape, boxes)
        assert [i for box in flat for i in box] == list(range(start, stop)), (shape, start, stop, boxes)
        assert all(box == list(range(box[0], box[0] + len(box))) for box in flat)  # contiguous in flat order
        assert len(boxes) <= max(1, 2 * (len(shape) - 1) + 1), (shape, start, stop, boxes)
        kinds.add(len(boxes))
    assert {0, 1, 2, 3, 4, 5} <= kinds  # empty, whole, partial rows at either end, nested partial rows
    with pytest.raises(ValueError, match="outside a tensor of shape"):
        flat_range_boxes((4, 5), 3, 21)


def test_param_pieces_place_a_swiglu_factory_by_offset():
    """fc1 of TP rank 1 of 2 (local [gate; up] = 2 x [3, 4]) as megatron's swiglu factory splits
    it: the DP range [5, 19) crosses the gate/up boundary mid-row; each piece's elements sit
    at the global offset it names, up rows after all TP ranks' gate rows."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    param = torch.arange(24, dtype=torch.float32).view(6, 4)
    sh = ShardedTensor.from_rank_offsets("fc1", param, (0, 1, 2), replica_id=(0, 0, 1))
    factory = apply_swiglu_sharded_factory(sh, ())
    pieces = param_pieces(factory, param, 5, 19, instance=0, name="fc1")
    full = torch.full((12, 4), -1.0)  # global [gate0; gate1; up0; up1], each [3, 4]
    flat = param.view(-1)[5:19]
    for p in pieces:
        t = p.tensor("exp_avg", flat)
        assert t.replica_id == (0, 0, 0) and t.key == "optimizer.state.exp_avg.fc1"
        full[tuple(slice(o, o + s) for o, s in zip(t.global_offset, t.local_shape))] = t.data
    gate, up = param[:3].reshape(-1), param[3:].reshape(-1)
    assert full[3:6].reshape(-1)[5:].tolist() == gate[5:].tolist()  # rank 1's gate rows, from element 5
    assert full[9:12].reshape(-1)[:7].tolist() == up[:7].tolist()  # its up rows, to element 19
    assert int((full >= 0).sum()) == 14 and len(pieces) == 4


def test_param_pieces_refuse_a_factory_that_copies_or_repeats():
    """A factory whose tensors are copies, or that yields the same part twice, cannot be placed
    in the parameter: a CheckpointError names the key and the fix."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from mcore_rl.errors import CheckpointError

    param = torch.zeros(4, 3)
    for build, why in ((lambda t: [t.clone()], "not a contiguous view"), (lambda t: [t[:2], t[:2]], "once each")):
        def build_fn(key, t, replica_id, flattened_range, build=build):
            return [ShardedTensor.from_rank_offsets(key, part, replica_id=replica_id) for part in build(t)]

        factory = ShardedTensorFactory("w", param, build_fn, torch.cat, (0, 0, 0))
        with pytest.raises(CheckpointError, match=f"w\\): .*{why}.*optimizer_sharding=fully_reshardable"):
            param_pieces(factory, param, 0, 12, instance=0, name="layer.w")


def _halve_a_box(step_dir: str, prefix: str) -> tuple[str, int]:
    """Edits ``step_dir``'s actor ``.metadata`` so the single box of the first key under ``prefix``
    covers half of the tensor, then reseals the marker (only the tiling check is left to refuse
    it): (the key, its element count)."""
    import os
    import pickle

    from tests.ckpt_util import reseal

    path = os.path.join(step_dir, "actor", "dist_ckpt", ".metadata")
    with open(path, "rb") as f:
        meta = pickle.load(f)  # noqa: S301 - this test's own checkpoint
    key = next(k for k, v in sorted(meta.state_dict_metadata.items())
               if k.startswith(prefix) and len(getattr(v, "chunks", ())) == 1 and v.chunks[0].sizes[0] >= 2)
    chunk = meta.state_dict_metadata[key].chunks[0]
    half = torch.Size([chunk.sizes[0] // 2, *chunk.sizes[1:]])
    meta.state_dict_metadata[key].chunks = [type(chunk)(chunk.offsets, half)]
    with open(path, "wb") as f:
        pickle.dump(meta, f)
    reseal(step_dir)
    return key, math.prod(chunk.sizes)


def _save_then_halve_a_box(root: str) -> dict:
    """World 1: a model_space save of a trained tiny engine; in one copy an ``exp_avg`` box
    halved, resumed into a fresh engine; in another a model key's, loaded as a model directory:
    the errors and whether the state stayed as built."""
    import shutil

    from mcore_rl.checkpoint.model_dir import load_model_dir
    from mcore_rl.errors import CheckpointError
    from mcore_rl.parallel.layout import destroy_parallel_state
    from tests.ckpt_bodies import hf_params, manager, optimizer_fingerprint
    from tests.ckpt_util import engine, train_step, writer_processes_allowed

    eng = engine({})
    train_step(eng, 0)
    with writer_processes_allowed():
        manager(root, optimizer_sharding="model_space").save(1, {"actor": eng}, {"step": 1})
    destroy_parallel_state()
    shutil.copytree(f"{root}/global_step_1", f"{root}_model/global_step_1")
    out = {}
    for name, prefix, fingerprint, attempt in (
            ("resume", "optimizer.state.exp_avg.", optimizer_fingerprint,
             lambda e: manager(root, optimizer_sharding="model_space").resume({"actor": e})),
            ("model_dir", "decoder.", hf_params, lambda e: load_model_dir(f"{root}_model/global_step_1/actor", e))):
        key, numel = _halve_a_box(f"{root}_model/global_step_1" if name == "model_dir" else f"{root}/global_step_1",
                                  prefix)
        fresh = engine({})
        before = fingerprint(fresh)
        try:
            attempt(fresh)
            message = ""
        except CheckpointError as e:
            message = str(e)
        after = fingerprint(fresh)
        destroy_parallel_state()
        out[name] = {"key": key, "numel": numel, "message": message,
                     "untouched": before.keys() == after.keys() and all(torch.equal(v, after[k]) for k, v in before.items())}
    return out


def test_model_space_load_refuses_boxes_that_do_not_tile(tmp_path):
    """Issue #37 item 8: a ``.metadata`` whose box covers half of an ``exp_avg`` tensor loaded
    without error (half the state from uninitialised memory: optimizer_space reads into
    torch.empty). The load checks every key's chunks tile its shape, as the merge's reader does,
    and refuses naming the key, before any state moves; so does a model directory's load (a
    model key's box halved: its load in place kept half the engine's old values)."""
    from tests.dist import run_ranks

    results = run_ranks(1, _save_then_halve_a_box, str(tmp_path / "ckpt"), daemon=False)[0]
    for name, out in results.items():  # the manager's resume; a model directory's load (in place)
        assert f"'{out['key']}' at index (): its chunks cover {out['numel'] // 2} of the {out['numel']} elements" \
            in out["message"], (name, out)
        assert "its .metadata is damaged: use another checkpoint" in out["message"] and out["untouched"], name
