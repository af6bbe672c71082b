"""Checkpoint storage layer: atomic JSON, torch_dist inventory, storage detection on one machine.

The two-node, node-local case (private tmpfs per simulated node) is tests/test_ckpt_two_nodes.py.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import resource
import shutil
import signal

import pytest
import torch

from mcore_rl.errors import CheckpointError
from mcore_rl.checkpoint.integrity import FileEntry, gather_manifest
from mcore_rl.checkpoint.peer_sync import sync_step_to_all_nodes, transfer_plan
from mcore_rl.checkpoint.storage import (
    TMP_SUFFIX, check_files, detect_storage, expected_files, fsync_dirs, read_json, write_json_atomic,
)
from mcore_rl.errors import McoreRLError
from tests.dist import run_ranks


# ----------------------------------------------------------------------------- JSON files


def _write_killed_midway(path: str, obj: dict, limit: int) -> None:
    """Child: the kernel kills it (SIGXFSZ) once a file it writes passes ``limit`` bytes."""
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; a real kill is wanted
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    write_json_atomic(path, obj)
    os._exit(0)


def test_atomic_write_killed_mid_write_keeps_old_file(tmp_path):
    path = str(tmp_path / "sub" / "trainer_state.json")
    write_json_atomic(path, {"step": 1})  # makes the missing parent dir
    assert read_json(path) == {"step": 1}
    big = {f"key_{i}": "x" * 100 for i in range(2000)}  # ~220 KB: the kill lands mid-write
    child = mp.get_context("fork").Process(target=_write_killed_midway, args=(path, big, 4096))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGXFSZ, child.exitcode  # it really died while writing
    assert read_json(path) == {"step": 1}  # the target is untouched, not a truncated new file
    debris = [n for n in os.listdir(tmp_path / "sub") if n.endswith(TMP_SUFFIX)]
    assert len(debris) == 1 and os.path.getsize(tmp_path / "sub" / debris[0]) == 4096, debris
    write_json_atomic(path, big)  # a later write goes through
    assert read_json(path) == big


def test_read_json_errors_name_the_file(tmp_path):
    missing = str(tmp_path / "nope.json")
    with pytest.raises(CheckpointError, match="nope.json does not exist"):
        read_json(missing)
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b'{"step": 3')
    with pytest.raises(CheckpointError, match="garbage.json is not valid JSON"):
        read_json(str(garbage))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="list.json holds a JSON list"):
        read_json(str(listed))
    with pytest.raises(CheckpointError, match="not JSON-able"):
        write_json_atomic(str(tmp_path / "bad.json"), {"t": torch.zeros(1)})
    assert not (tmp_path / "bad.json").exists()
    assert issubclass(CheckpointError, McoreRLError)


def test_fsync_dirs_walks_nested_dirs_and_skips_files_and_links(tmp_path, monkeypatch):
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "x.distcp").write_bytes(b"123")  # its writer fsyncs it: not again
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "a" / "link").symlink_to(tmp_path / "elsewhere")  # must not be followed
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    fsync_dirs(str(tmp_path / "a"))
    a = str(tmp_path / "a")
    assert synced == [f"{a}/b", a], synced  # dirs bottom-up, once each


# ----------------------------------------------------------------------------- torch_dist inventory


def _save_sharded(ckpt_dir: str) -> None:
    """Rank: saves a plain sharded state dict (different data on each rank) with megatron."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    # megatron's writer starts helper processes; tests/dist.py ranks are daemonic, which forbids that
    mp.current_process()._config["daemon"] = False
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(rank)
    sd = {
        "small": ShardedTensor.from_rank_offsets("small", torch.randn(4, 8, generator=g), (1, rank, world)),
        "big": ShardedTensor.from_rank_offsets("big", torch.randn(64, 32, generator=g), (0, rank, world)),
        "rng": ShardedObject("rng_state", {"rank": rank}, (world,), (rank,), replica_id=0),
        "step": 3,  # common state: common.pt
    }
    dist_checkpointing.save(sd, ckpt_dir)
    _stop_writer_manager()


def _stop_writer_manager() -> None:
    """Shuts down the manager process megatron's writer spawned: forked ranks end with os._exit,
    which would leave it (and its resource tracker) running after the test."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    queue = filesystem_async._results_queue
    manager = getattr(queue, "_manager", None)
    if manager is not None:
        manager.shutdown()
    filesystem_async._results_queue = None


@pytest.fixture(scope="module")
def saved_ckpt(tmp_path_factory) -> str:
    ckpt = str(tmp_path_factory.mktemp("dist") / "dist_ckpt")
    os.makedirs(ckpt)
    run_ranks(2, _save_sharded, ckpt)
    return ckpt


def _on_disk(base: str) -> dict[str, int]:
    return {
        os.path.relpath(os.path.join(d, n), base): os.path.getsize(os.path.join(d, n))
        for d, _, names in os.walk(base) for n in names
    }


def test_expected_files_match_disk(saved_ckpt):
    expected, disk = expected_files(saved_ckpt), _on_disk(saved_ckpt)
    assert set(expected) == set(disk), (expected, disk)
    shards = [r for r in expected if r.endswith(".distcp")]
    assert len(shards) >= 2, shards  # one per rank at least
    for rel in shards:  # the last item ends exactly where the shard file ends
        assert expected[rel] == disk[rel], (rel, expected[rel], disk[rel])
    assert all(disk[r] >= expected[r] > 0 for r in expected)
    check_files(saved_ckpt, expected)  # the intact checkpoint passes


def test_check_files_names_truncated_and_missing_shards(saved_ckpt, tmp_path):
    expected = expected_files(saved_ckpt)
    shard = sorted(r for r in expected if r.endswith(".distcp"))[-1]
    truncated = str(tmp_path / "truncated")
    shutil.copytree(saved_ckpt, truncated)
    with open(os.path.join(truncated, shard), "r+b") as f:
        f.truncate(expected[shard] - 1)  # one byte short
    with pytest.raises(CheckpointError, match=rf"truncated: {shard} \("):
        check_files(truncated, expected_files(truncated))
    deleted = str(tmp_path / "deleted")
    shutil.copytree(saved_ckpt, deleted)
    os.remove(os.path.join(deleted, shard))
    os.remove(os.path.join(deleted, "common.pt"))
    with pytest.raises(CheckpointError, match=rf"missing: {shard}, common.pt|missing: common.pt, {shard}"):
        check_files(deleted, expected_files(deleted))
    no_meta = str(tmp_path / "no_meta")
    shutil.copytree(saved_ckpt, no_meta)
    with open(os.path.join(no_meta, ".metadata"), "r+b") as f:
        f.truncate(10)  # a damaged pickle is a clear error, not an EOFError
    with pytest.raises(CheckpointError, match=r"\.metadata cannot be read"):
        expected_files(no_meta)
    os.remove(os.path.join(no_meta, ".metadata"))
    with pytest.raises(CheckpointError, match=r"\.metadata does not exist"):
        expected_files(no_meta)


# ----------------------------------------------------------------------------- storage detection


def _shared_root_two_nodes(root: str, nodes: list[tuple[int, int]]) -> dict:
    """Rank r plays (node, local rank) ``nodes[r]`` on one shared file system: detect + sync must
    see 'shared' and move nothing."""
    from mcore_rl.fileio.checksum import file_checksum

    rank = torch.distributed.get_rank()
    os.environ.update(GROUP_RANK=str(nodes[rank][0]), LOCAL_RANK=str(nodes[rank][1]))
    mode = detect_storage(root)
    step = os.path.join(root, "global_step_1")
    rel = f"from_node{rank}/state.json"
    write_json_atomic(os.path.join(step, rel), {"node": rank})
    manifest = gather_manifest({rel: file_checksum(os.path.join(step, rel))}, step)
    before = {rel: os.stat(os.path.join(step, rel)).st_ino for rel in _on_disk(step)}
    sync_step_to_all_nodes(step, manifest, chunk_bytes=7)
    after = {rel: os.stat(os.path.join(step, rel)).st_ino for rel in _on_disk(step)}
    return {"mode": mode, "before": before, "after": after, "left": sorted(os.listdir(root))}


@pytest.mark.parametrize("nodes", [[(0, 0), (1, 0)], [(0, 0), (0, 1), (1, 0)]], ids=["1+1", "2+1"])
def test_detect_storage_shared_root(tmp_path, nodes):
    root = str(tmp_path / "ckpts")  # does not exist yet: the node leaders make it
    results = run_ranks(len(nodes), _shared_root_two_nodes, root, nodes)
    for r in results:
        assert r["mode"] == "shared", r
        assert r["before"] == r["after"], r  # no file rewritten on a shared root
        assert set(r["after"]) == {f"from_node{i}/state.json" for i in range(len(nodes))}, r
        assert r["left"] == ["global_step_1"], r  # probes removed


def test_transfer_plan():
    manifest = {"a.distcp": FileEntry(10, "0000000a", 0), "b.distcp": FileEntry(7, "0000000b", 1),
                "common.pt": FileEntry(5, "0000000c", 0)}
    needs = {0: ["b.distcp"], 1: ["a.distcp", "common.pt"], 2: ["b.distcp", "common.pt"]}
    assert transfer_plan(manifest, needs) == [
        ("a.distcp", 10, 0, [1]), ("b.distcp", 7, 1, [0, 2]), ("common.pt", 5, 0, [1, 2])]
    assert transfer_plan(manifest, {0: [], 1: []}) == []  # a shared root moves nothing
    with pytest.raises(CheckpointError, match="its writing node 0 lacks it"):
        transfer_plan(manifest, {0: ["a.distcp"], 1: []})


def _report_same_name(crcs: list[str]) -> str:
    try:
        gather_manifest({"actor/x.distcp": (3, crcs[torch.distributed.get_rank()])}, "/ckpt/global_step_1")
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_manifest_refuses_one_file_written_twice_differently():
    for msg in run_ranks(2, _report_same_name, ["00000001", "00000002"]):  # every rank refuses
        assert "global_step_1/actor/x.distcp was written twice with different content" in msg, msg
    assert run_ranks(2, _report_same_name, ["00000001", "00000001"]) == ["no error"] * 2


def _detect_expect_error(root: str, env: dict) -> str:
    os.environ.pop("GROUP_RANK", None)
    os.environ.update(env)
    try:
        detect_storage(root)
    except CheckpointError as e:
        return str(e)
    return "no error"


def test_detect_storage_errors(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    msgs = run_ranks(2, _detect_expect_error, str(blocker / "ckpts"), {})
    for m in msgs:  # every rank raises, none hangs in a collective
        assert "a_file/ckpts is not writable on node(s) [0]" in m, m
    msgs = run_ranks(2, _detect_expect_error, str(tmp_path / "ok"), {"LOCAL_RANK": "0"})
    for m in msgs:  # two processes claim to lead node 0 (no GROUP_RANK): refused
        assert "exactly one process with LOCAL_RANK=0" in m and "{0: [0, 1]}" in m, m


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_inventory_reads_metadata_without_running_planted_code(tmp_path):
    # .metadata is a pickle: the inventory reads it through the restricted unpickler
    import pickle

    from mcore_rl.fileio.safe_load import UnsafeCheckpointError
    from mcore_rl.checkpoint.storage import expected_files

    marker = tmp_path / "ran"
    (tmp_path / ".metadata").write_bytes(pickle.dumps(_Planted(str(marker))))
    with pytest.raises(UnsafeCheckpointError, match="posix.system"):
        expected_files(str(tmp_path))
    assert not marker.exists()
