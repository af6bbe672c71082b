"""Faults a kill cannot show, injected at the system call by the test-only hook
``MCORE_RL_CKPT_IO_FAULT=<point>:<ERRNO>`` (optionally on one rank): a background flush that
fails with EIO (sync and async saves), a disk that fills up (ENOSPC) in the middle of a shard,
and one rank failing alone at the marker, the tracker and the cleanup. Each save fails on every
rank with a clear error naming the failure, nobody hangs (the world has a short timeout), the
previous checkpoint is unchanged and still loads. And each rank fsyncs what it wrote, once."""
from __future__ import annotations

import hashlib
import os
import shutil

import torch

from mcore_rl.fileio.faults import IO_ENV, RANK_ENV
from tests.ckpt_bodies import build_engine, hf_dir_for, manager, train
from tests.dist import run_ranks

CASES = {  # name: (fault, the one failing rank or None for all, async save)
    "flush_eio": ("flush:EIO", 1, False),
    "flush_eio_async": ("flush:EIO", None, True),
    "enospc_mid_shard": ("write:ENOSPC", 1, False),
    "marker_alone": ("marker:EIO", 0, False),
    "tracker_alone": ("tracker:EIO", 0, False),
    "cleanup_alone": ("cleanup:EIO", 0, False),
}


def _digests(path: str) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), path): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, fs in os.walk(path) for f in fs}


def _faults(hf_dir: str, base: str) -> dict:
    from mcore_rl.errors import CheckpointError

    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    rank = torch.distributed.get_rank()
    train(model, range(1))
    pristine = os.path.join(base, "pristine")
    manager(pristine).save(1, {"actor": engine}, {"step": 1})
    train(model, range(1, 2))
    out = {}
    for name, (fault, only, is_async) in CASES.items():
        root = os.path.join(base, name)
        if rank == 0:
            shutil.copytree(pristine, root)
        torch.distributed.barrier()
        before = _digests(os.path.join(root, "global_step_1"))
        os.environ[IO_ENV] = fault
        if only is not None:
            os.environ[RANK_ENV] = str(only)
        mgr = manager(root, async_save=is_async, max_ckpt_to_keep=1)
        try:
            mgr.save(2, {"actor": engine}, {"step": 2})
            mgr.wait()
            error = "NO ERROR"
        except CheckpointError as e:
            error = str(e)
        finally:
            os.environ.pop(IO_ENV)
            os.environ.pop(RANK_ENV, None)
        step1 = os.path.join(root, "global_step_1")
        unchanged = os.path.isdir(step1) and _digests(step1) == before
        loaded = manager(root).load(step1, {"actor": engine}, ("model", "optimizer", "extra")) if unchanged else None
        resumed = manager(root).resume({"actor": engine})
        out[name] = {"error": error, "unchanged": unchanged, "loaded": loaded, "resumed": resumed}
    return out


def test_disk_faults_fail_the_save_on_every_rank(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    results = run_ranks(2, _faults, hf_dir, str(tmp_path), timeout_s=240, daemon=False)
    expect = {
        "flush_eio": "background flush of", "flush_eio_async": "background flush of",
        "enospc_mid_shard": "No space left on device", "marker_alone": "writing the COMPLETE marker",
        "tracker_alone": "writing latest_checkpointed_iteration.txt", "cleanup_alone": "removing old checkpoints",
    }
    for name, text in expect.items():
        errors = [r[name]["error"] for r in results]
        assert errors[0] == errors[1], (name, errors)  # the same refusal on both ranks
        assert text in errors[0] and f"injected by {IO_ENV}" in errors[0], (name, errors[0])
        for r in results:
            assert r[name]["unchanged"] and r[name]["loaded"] == {"step": 1}, (name, r[name])
    # until the marker the step is not complete: resume takes step 1; a failed tracker or cleanup
    # comes after a complete step 2 (the tracker, if written, names it)
    for name in ("flush_eio", "flush_eio_async", "enospc_mid_shard", "marker_alone", "tracker_alone"):
        assert results[0][name]["resumed"] == {"step": 1}, (name, results[0][name])
    assert results[0]["cleanup_alone"]["resumed"] == {"step": 2}
    assert "rank 1" in results[0]["flush_eio"]["error"] and "rank 0" in results[0]["marker_alone"]["error"]


def _fsyncs(hf_dir: str, root: str) -> dict:
    """Paths each rank fsyncs during one save (files only; directories are the writer's)."""
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    train(model, range(1))
    seen: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isfile(path):
            seen.append(path)
        real(fd)

    os.fsync = spy
    try:
        manager(root).save(1, {"actor": engine}, {"step": 1})
    finally:
        os.fsync = real
    return {"seen": seen, "root": root}


def test_each_rank_fsyncs_what_it_wrote_once(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    root = str(tmp_path / "ckpt")
    r0, r1 = (r["seen"] for r in run_ranks(2, _fsyncs, hf_dir, root, daemon=False))
    rel1 = [os.path.relpath(p, root) for p in r1]
    shard = [r for r in rel1 if r.endswith(".distcp")]  # its shard and the shard's item checksums
    assert len(shard) == 1 and shard[0].startswith("global_step_1/actor/dist_ckpt/__1_"), rel1
    assert sorted(rel1) == sorted(shard + [shard[0] + ".sums.json"]), rel1
    assert len(r0 + r1) == len(set(r0 + r1)), sorted(r0 + r1)  # no file fsynced twice
    names = {os.path.basename(p) for p in r0}
    assert {"common.pt", ".metadata", "metadata.json"} <= names, names  # megatron's own files too
