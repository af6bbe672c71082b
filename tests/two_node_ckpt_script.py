"""Run by tests/test_ckpt_two_nodes.py: one rank per simulated node, each node with its own
private tmpfs at the same checkpoint root (node-local storage).

Saves a megatron dist-checkpoint of a tiny TP=2 GPTModel (each node's disk gets only its own
rank's shard; rank 0's node also gets .metadata, common.pt, metadata.json), writes a file only
node 0's leader writes and one into a step dir only node 1 creates, then detects the storage,
syncs and checks that every node holds the full checkpoint and can load all of it from its own
disk. Writes what it saw to ``<out>/rank<r>.json``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os


def file_digests(base: str) -> dict[str, str]:
    out = {}
    if not os.path.isdir(base):
        return out
    for d, _, names in os.walk(base):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), base)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _check(ckpt_dir: str) -> str:
    from mcore_rl.checkpoint.storage import check_files, expected_files

    try:
        check_files(ckpt_dir, expected_files(ckpt_dir))
        return "ok"
    except Exception as e:  # recorded: before the sync it must fail on the node lacking files
        return f"{type(e).__name__}: {e}"


def _load_full_and_compare(sd: dict, ckpt_dir: str) -> dict:
    """Loads every tensor WHOLE (both ranks' shards) from this node's disk; checks this rank's
    slice against what it saved and the whole tensor against the other node's load."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    saved = [v for v in nested_values(sd) if isinstance(v, ShardedTensor) and v.flattened_range is None]
    rank = torch.distributed.get_rank()
    request = {  # every rank asks for the whole tensor; rank 1's request is a replica
        sh.key: ShardedTensor.from_rank_offsets(
            sh.key, torch.zeros(sh.global_shape, dtype=sh.dtype), replica_id=rank)
        for sh in saved
    }
    loaded = dist_checkpointing.load(request, ckpt_dir)
    own_ok, sharded_keys = True, 0
    for sh in saved:
        full = loaded[sh.key]
        shape = tuple(sh.data.shape)  # megatron may or may not keep the layer axis in data
        shape = (1,) * (len(sh.global_shape) - len(shape)) + shape
        index = tuple(slice(o, o + n) for o, n in zip(sh.global_offset, shape))
        own_ok &= torch.equal(full[index].reshape(sh.data.shape), sh.data.detach())
        p = sh.prepend_axis_num  # count shards split by TP (not only by layer)
        sharded_keys += int(shape[p:] != tuple(sh.global_shape[p:]))
    flat = torch.cat([loaded[k].flatten() for k in sorted(request)])
    both = [torch.empty_like(flat) for _ in range(2)]
    torch.distributed.all_gather(both, flat)
    return {"own_slice_equal": bool(own_ok), "whole_equal_across_nodes": torch.equal(*both),
            "keys": len(request), "tp_sharded_keys": sharded_keys, "numel": flat.numel()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", required=True)
    parser.add_argument("--out", required=True)
    a = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")

    import torch
    from megatron.core import dist_checkpointing

    from mcore_rl.fileio.checksum import file_checksum
    from mcore_rl.checkpoint.integrity import gather_manifest
    from mcore_rl.checkpoint.peer_sync import sync_step_to_all_nodes
    from mcore_rl.checkpoint.storage import detect_storage, node_id, node_leader, write_json_atomic
    from mcore_rl.models.builder import build_model
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel.layout import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import init_distributed, setup_platform
    from tests.tiny import tiny_config

    platform = setup_platform("cpu")
    init_distributed(platform)
    rank = torch.distributed.get_rank()
    with open("/proc/self/mountinfo") as f:  # proof this node has its own tmpfs at the root
        tmpfs_root = any(line.split()[4] == a.root and " - tmpfs " in line for line in f)
    layout = ParallelLayout(tp=2)
    initialize_parallel_state(layout, seed=7)
    args = model_args_from_hf(tiny_config("llama", num_hidden_layers=2))
    model = build_model(args, layout, "actor", platform)[0]

    step = os.path.join(a.root, "global_step_1")
    ckpt_dir = os.path.join(step, "actor", "dist_ckpt")
    os.makedirs(ckpt_dir, exist_ok=True)  # every node makes its own dirs
    sd = model.sharded_state_dict()
    dist_checkpointing.save(sd, ckpt_dir)
    if node_leader() and node_id() == 0:
        write_json_atomic(os.path.join(step, "trainer_state.json"), {"step": 1, "seen": 64})
    step2 = os.path.join(a.root, "global_step_2")
    if node_leader() and node_id() == 1:  # a step dir only node 1 ever creates
        write_json_atomic(os.path.join(step2, "node1_only", "state.json"), {"node": 1})
    torch.distributed.barrier()

    mode = detect_storage(a.root)
    before = _check(ckpt_dir)
    manifests = []
    for d in (step, step2):  # each node's leader records what its node wrote
        written = {rel: file_checksum(os.path.join(d, rel)) for rel in file_digests(d)} if node_leader() else {}
        manifests.append(gather_manifest(written, d))
    stale = os.path.join(ckpt_dir, "__0_0.distcp")  # rank 0's shard: node 1 gets a stale copy of it
    planted = node_leader() and node_id() == 1 and not os.path.exists(stale)
    if planted:  # an earlier run's file of the same size: the sync must compare content, not size
        with open(stale, "wb") as f:
            f.write(b"\x5a" * manifests[0]["actor/dist_ckpt/__0_0.distcp"].size)
    sync_step_to_all_nodes(step, manifests[0], chunk_bytes=4096)  # small chunks: shards go in many pieces
    sync_step_to_all_nodes(step2, manifests[1], chunk_bytes=4096)
    after = _check(ckpt_dir)
    incomplete = torch.tensor([int(after != "ok")])
    torch.distributed.all_reduce(incomplete)  # a load on an incomplete node would crash, not report
    result = {
        "rank": rank, "node": node_id(), "tmpfs_root": tmpfs_root, "mode": mode, "planted_stale": planted,
        "check_before_sync": before, "check_after_sync": after,
        "step1": file_digests(step), "step2": file_digests(step2),
        "load": {} if incomplete.item() else _load_full_and_compare(sd, ckpt_dir),
    }
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f, indent=1)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":  # megatron's writer starts processes that re-import this module
    main()
