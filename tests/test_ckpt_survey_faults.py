"""The checkpoint manager's survey, retention and recovery under faults (issue #29, defects 2, 3,
8, 9 and the marker/step check of 14).

- Every stat, open and listing of a root's survey, made to fail with EIO or ESTALE at the system
  call (the fault hook ``MCORE_RL_CKPT_IO_FAULT=stat|open:<ERRNO>@<suffix>``, one file at a time):
  the scan is either the fault-free one or a refusal naming the file, never "absent".
- On a shared root (2 ranks): a failing ``stat`` of a complete step's marker never deletes it (as
  crash debris, or before a re-save of it); a marker rank 0 cannot read is one refusal on both
  ranks, at once; a link planted at ``.global_step_N.incoming`` is refused, nothing written through.
- Two simulated nodes (each rank its own node, its own disk bind-mounted at the root in a private
  mount namespace): every combination of the points where a kill can stop each node's step
  replacement, then a resume: both nodes end with the same copy, no side dir is left, and the
  resumed step is the agreed one; a survey error on one node is a refusal on both.
"""
from __future__ import annotations

import builtins
import contextlib
import ctypes
import errno
import hashlib
import json
import os
import shutil

import pytest
import torch

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.faults import ENV, IO_ENV, RANK_ENV
from tests.ckpt_bodies import build_engine, hf_dir_for, manager, train
from tests.ckpt_util import reseal
from tests.dist import run_ranks

STEP1 = "global_step_1"


def _digests(path: str) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), path): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, fs in os.walk(path) for f in fs}


# ---- one node's scan, fault by fault -------------------------------------------------------------
def _plant_root(root: str) -> None:
    """A root holding every kind of entry a scan reads: a complete step with a role part's record,
    a replacement's side dir with its marker, the tracker."""
    from mcore_rl.checkpoint import step_dirs
    from mcore_rl.checkpoint.inventory import Marker

    for step_dir in (os.path.join(root, STEP1), os.path.join(root, ".global_step_1.incoming")):
        os.makedirs(os.path.join(step_dir, "actor"))
        with open(os.path.join(step_dir, "actor", "PART"), "w") as f:
            f.write("{}")
        step_dirs.write_marker(os.path.join(step_dir, "COMPLETE"), Marker(1, ("actor",), 1, {"actor/PART": (2, None)}))
    step_dirs.write_tracker(root, 1)


SCANNED = ["", STEP1, f"{STEP1}/COMPLETE", f"{STEP1}/actor", f"{STEP1}/actor/PART",
           "latest_checkpointed_iteration.txt", ".global_step_1.incoming", ".global_step_1.incoming/COMPLETE"]


def test_scan_is_fault_free_or_a_refusal(tmp_path, monkeypatch):
    from mcore_rl.checkpoint.inventory import scan_root

    root = str(tmp_path / "root")
    _plant_root(root)
    clean = scan_root(root)
    assert clean["steps"]["1"]["marker"] == "ok" and clean["side"][".global_step_1.incoming"]["marker"] == "ok"
    refused = []
    for suffix in SCANNED:
        path = os.path.join(root, suffix) if suffix else root
        for point in ("stat", "open"):
            for code in ("EIO", "ESTALE"):
                monkeypatch.setenv(IO_ENV, f"{point}:{code}@{path}")
                try:
                    seen = scan_root(root)
                except CheckpointError as e:
                    assert path.rstrip("/") in str(e) and code in str(e), (suffix, point, str(e))
                    refused.append((suffix, point))
                    continue
                assert seen == clean, (suffix, point, code)  # this call does not read that entry
    monkeypatch.delenv(IO_ENV)
    assert {s for s, p in refused if p == "stat"} == set(SCANNED)  # every entry is stat'ed ...
    opened = {s for s, p in refused if p == "open"}  # ... every file and listed dir opened
    assert opened == {"", STEP1, f"{STEP1}/COMPLETE", f"{STEP1}/actor/PART", "latest_checkpointed_iteration.txt",
                      ".global_step_1.incoming/COMPLETE"}, opened


def test_a_marker_naming_another_step_is_damaged(tmp_path):
    """A step copied under another number does not resume as that number (defect 14)."""
    from mcore_rl.checkpoint.inventory import merge_scans, scan_root

    root = str(tmp_path / "root")
    _plant_root(root)
    shutil.copytree(os.path.join(root, STEP1), os.path.join(root, "global_step_5"))
    with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("5")
    scan = scan_root(root)
    assert scan["steps"]["5"]["marker"] == "bad" and "records step 1, not 5" in scan["steps"]["5"]["why"], scan
    step, notes = merge_scans(root, {0: scan}).resume_step()
    assert step == 1 and any("records step 1, not 5" in n for n in notes), (step, notes)


# ---- a shared root, two ranks --------------------------------------------------------------------
@contextlib.contextmanager
def failing(suffix: str, code: int, calls: tuple[str, ...]):
    """The system calls ``calls`` (``os.stat``, ``os.lstat``, ``os.open``, ``builtins.open``) fail
    with ``code`` for paths ending in ``suffix``, as a flaky disk would (below the code under test
    and its hooks)."""
    owners = {"os": os, "builtins": builtins}
    real = {call: getattr(owners[call.split(".")[0]], call.split(".")[1]) for call in calls}

    def wrap(call):
        def fn(path, *args, **kwargs):
            if isinstance(path, (str, bytes, os.PathLike)) and os.fsdecode(path).endswith(suffix):
                raise OSError(code, os.strerror(code), os.fsdecode(path))
            return real[call](path, *args, **kwargs)
        return fn

    for call in calls:
        setattr(owners[call.split(".")[0]], call.split(".")[1], wrap(call))
    try:
        yield
    finally:
        for call, fn in real.items():
            setattr(owners[call.split(".")[0]], call.split(".")[1], fn)


def _attempt(fn) -> str:
    try:
        fn()
        return "NO ERROR"
    except CheckpointError as e:
        return str(e)


def _shared(hf_dir: str, base: str) -> dict:
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    rank, out = torch.distributed.get_rank(), {}
    train(model, range(1))
    pristine = os.path.join(base, "pristine")
    manager(pristine).save(1, {"actor": engine}, {"step": 1})
    train(model, range(1, 2))

    def fresh(name: str) -> tuple[str, dict]:
        root = os.path.join(base, name)
        if rank == 0:
            shutil.copytree(pristine, root)
        torch.distributed.barrier()
        return root, _digests(os.path.join(root, STEP1))

    def after(root: str, before: dict) -> dict:
        torch.distributed.barrier()
        step1 = os.path.join(root, STEP1)
        try:
            resumed = manager(root).resume({"actor": engine})
        except CheckpointError as e:
            resumed = str(e)
        return {"kept": os.path.isdir(step1) and _digests(step1) == before, "resumed": resumed}

    marker = f"{STEP1}/COMPLETE"
    # defect 2: a marker whose stat fails while saving step 2 (retention, max_ckpt_to_keep unset)
    root, before = fresh("retention")
    with failing(marker, errno.EIO, ("os.stat", "os.lstat")):
        out["retention"] = {"error": _attempt(lambda: manager(root).save(2, {"actor": engine}, {"step": 2}))}
    out["retention"].update(after(root, before))
    # ... and while re-saving the tracked step 1 (the old copy must stay until the new one is whole)
    root, before = fresh("resave")
    with failing(marker, errno.ESTALE, ("os.stat", "os.lstat")):
        out["resave"] = {"error": _attempt(lambda: manager(root).save(1, {"actor": engine}, {"step": 9}))}
    out["resave"].update(after(root, before))
    # defect 8: a link planted at the incoming side dir of a re-save
    root, before = fresh("link")
    outside = os.path.join(base, "outside")
    if rank == 0:
        os.makedirs(outside)
        os.symlink(outside, os.path.join(root, ".global_step_1.incoming"))
    torch.distributed.barrier()
    out["link"] = {"error": _attempt(lambda: manager(root).save(1, {"actor": engine}, {"step": 9})),
                   "outside": os.listdir(outside)}
    out["link"].update(after(root, before))
    # a fault-free replacement of step 1: swapped in, its old copy removed at retention
    root, _ = fresh("replace")
    out["replace"] = {"error": _attempt(lambda: manager(root).save(1, {"actor": engine}, {"step": 9})),
                      "left": sorted(os.listdir(root)), "resumed": manager(root).resume({"actor": engine})}
    # defect 9: a marker rank 0 alone cannot open (last: the unfixed code hangs rank 1 here)
    root, before = fresh("rank0")
    with failing(marker, errno.EIO, ("os.open", "builtins.open")) if rank == 0 else contextlib.nullcontext():
        out["rank0"] = {"error": _attempt(lambda: manager(root).resume({"actor": engine}))}
    out["rank0"].update(after(root, before))
    return out


def test_survey_errors_never_delete_and_are_agreed(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    r0, r1 = run_ranks(2, _shared, hf_dir, str(tmp_path), timeout_s=150, daemon=False)
    for name, text in {"retention": "cannot stat", "resave": "cannot stat", "rank0": "cannot read",
                       "link": ".global_step_1.incoming is a symlink mcore_rl did not create"}.items():
        assert r0[name]["error"] == r1[name]["error"], (name, r0[name], r1[name])  # one refusal, both ranks
        assert text in r0[name]["error"] and STEP1 in r0[name]["error"], (name, r0[name]["error"])
        for r in (r0, r1):  # step 1 untouched, still resumed
            assert r[name]["kept"] and r[name]["resumed"] == {"step": 1}, (name, r[name])
    assert r0["link"]["outside"] == [], r0["link"]  # nothing written through the link
    assert r0["replace"] == {"error": "NO ERROR", "resumed": {"step": 9},
                             "left": [STEP1, "latest_checkpointed_iteration.txt"]}, r0["replace"]
    assert "EIO" in r0["retention"]["error"] and "ESTALE" in r0["resave"]["error"]


# ---- two simulated nodes: recovery of an interrupted replacement ---------------------------------
def _own_disk(node_dir: str, root: str) -> None:
    """This process gets a private mount namespace with ``node_dir`` bind-mounted at ``root``."""
    libc = ctypes.CDLL(None, use_errno=True)
    for call in (lambda: libc.unshare(0x00020000),  # CLONE_NEWNS
                 lambda: libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None),  # MS_REC | MS_PRIVATE
                 lambda: libc.mount(node_dir.encode(), root.encode(), None, 0x1000, None)):  # MS_BIND
        if call() != 0:
            raise OSError(ctypes.get_errno(), f"mount namespace: {os.strerror(ctypes.get_errno())}")


# where a kill can stop one node's replacement of step 2 (v1 -> v2), as its disk shows it
STATES = {
    "unmarked": {"final": "v1", "incoming": "v2-"},  # killed before the new copy's marker
    "not_started": {"final": "v1", "incoming": "v2"},  # marker written, no rename yet
    "first": {"outgoing": "v1", "incoming": "v2"},  # killed between the two renames
    "swapped": {"final": "v2", "outgoing": "v1"},  # both renames done, old copy not yet removed
    "cleaning": {"final": "v2", "outgoing": "v1-"},  # killed removing the old copy (marker first)
}
STARTED = ("first", "swapped", "cleaning")
COMBOS = [(a, b) for a in STATES for b in STATES if "unmarked" not in (a, b) or not {a, b} & set(STARTED)]
PLACES = {"final": "global_step_2", "incoming": ".global_step_2.incoming", "outgoing": ".global_step_2.outgoing"}


def _layout(root: str, stash: str, state: str) -> None:
    for name in PLACES.values():
        if os.path.isdir(os.path.join(root, name)):
            shutil.rmtree(os.path.join(root, name))
    for place, version in STATES[state].items():
        dst = os.path.join(root, PLACES[place])
        shutil.copytree(os.path.join(stash, version.rstrip("-")), dst)
        if version.endswith("-"):
            os.remove(os.path.join(dst, "COMPLETE"))


def _two_nodes(hf_dir: str, base: str) -> dict:
    rank = torch.distributed.get_rank()
    root, stash = os.path.join(base, "ckpt"), os.path.join(base, f"stash{rank}")
    os.environ.update({"MCORE_RL_NODE_RANK": str(rank), "MCORE_RL_LOCAL_RANK": "0"})
    _own_disk(os.path.join(base, f"node{rank}"), root)
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    train(model, range(1))
    manager(root).save(2, {"actor": engine}, {"step": 2, "v": 1})
    shutil.copytree(os.path.join(root, PLACES["final"]), os.path.join(stash, "v1"))
    shutil.copytree(os.path.join(root, PLACES["final"]), os.path.join(stash, "v2"))
    with open(os.path.join(stash, "v2", "trainer_state.json"), "w") as f:
        json.dump({"step": 2, "v": 2}, f)
    reseal(os.path.join(stash, "v2"))
    out: dict = {"mode": manager(root).complete_steps()}
    for combo in COMBOS:
        _layout(root, stash, combo[rank])
        torch.distributed.barrier()
        try:
            resumed = manager(root).resume({"actor": engine})
        except CheckpointError as e:
            resumed = str(e)
        out[combo] = {"resumed": resumed, "left": sorted(os.listdir(root)),
                      "final": _digests(os.path.join(root, PLACES["final"]))}
    # a survey error on node 1 alone: a refusal on both, nothing changed on either
    _layout(root, stash, ("swapped", "not_started")[rank])
    before = {name: _digests(os.path.join(root, name)) for name in sorted(os.listdir(root))}
    os.environ.update({IO_ENV: "stat:ESTALE@.global_step_2.incoming/COMPLETE", RANK_ENV: "1"})
    out["fault"] = _attempt(lambda: manager(root).resume({"actor": engine}))
    os.environ.pop(IO_ENV), os.environ.pop(RANK_ENV)
    out["unchanged"] = before == {name: _digests(os.path.join(root, name)) for name in sorted(os.listdir(root))}
    # a rename of node 1's recovery fails: one refusal on both; node 0 may have finished its part
    os.environ.update({IO_ENV: "rename:EIO@global_step_2", RANK_ENV: "1"})
    out["rename"] = _attempt(lambda: manager(root).resume({"actor": engine}))
    os.environ.pop(IO_ENV), os.environ.pop(RANK_ENV)
    try:
        out["rerun"] = manager(root).resume({"actor": engine})
    except CheckpointError as e:
        out["rerun"] = str(e)
    return out


def test_two_nodes_agree_on_interrupted_replacements(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    for name in ("ckpt", "node0", "node1"):
        os.makedirs(tmp_path / name)
    r0, r1 = run_ranks(2, _two_nodes, hf_dir, str(tmp_path), timeout_s=300, daemon=False)
    assert os.listdir(tmp_path / "ckpt") == [], "the nodes' disks leaked to the shared path"
    assert r0["mode"] == [2], r0["mode"]
    for combo in COMBOS:
        # the new copy wins when a node began swapping (its marker was agreed on every node first)
        version = 2 if set(combo) & set(STARTED) else 1
        for r in (r0, r1):
            assert r[combo]["resumed"] == {"step": 2, "v": version}, (combo, r[combo])
            assert r[combo]["left"] == ["global_step_2", "latest_checkpointed_iteration.txt"], (combo, r[combo])
        assert r0[combo]["final"] == r1[combo]["final"], combo  # both nodes hold the same copy
    assert r0["fault"] == r1["fault"] and "surveying" in r0["fault"] and "failed on node 1" in r0["fault"], r0
    assert "ESTALE" in r0["fault"] and r0["unchanged"] and r1["unchanged"], (r0["fault"], r1["fault"])
    assert r0["rename"] == r1["rename"] and "finishing interrupted replacements" in r0["rename"], r0["rename"]
    assert "failed on rank 1" in r0["rename"] and f"injected by {IO_ENV}" in r0["rename"], r0["rename"]
    assert r0["rerun"] == r1["rerun"] == {"step": 2, "v": 2}


# ---- two simulated nodes: real kills at the renames of a replacement, then reruns ----------------
def _node_run(hf_dir: str, base: str, act: str) -> dict:
    """One run of both nodes (each rank its own disk at the root): ``save`` saves step 2 (v1),
    then saves it again (v2) with the kill the environment names; ``resume`` resumes; ``recover``
    lays out node 0 swapped, node 1 not started, then resumes (the kill lands in the recovery)."""
    rank = torch.distributed.get_rank()
    root = os.path.join(base, "ckpt")
    os.environ.update({"MCORE_RL_NODE_RANK": str(rank), "MCORE_RL_LOCAL_RANK": "0"})
    _own_disk(os.path.join(base, f"node{rank}"), root)
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    kill = {k: os.environ.pop(k) for k in (ENV, RANK_ENV) if k in os.environ}  # only for the act itself
    if act == "save":
        manager(root).save(2, {"actor": engine}, {"step": 2, "v": 1})
        os.environ.update(kill)
        manager(root).save(2, {"actor": engine}, {"step": 2, "v": 2})
    if act == "recover":
        stash = os.path.join(base, f"stash{rank}")
        shutil.copytree(os.path.join(root, PLACES["final"]), os.path.join(stash, "v2"))
        shutil.copytree(os.path.join(root, PLACES["final"]), os.path.join(stash, "v1"))
        with open(os.path.join(stash, "v1", "trainer_state.json"), "w") as f:
            json.dump({"step": 2, "v": 1}, f)
        reseal(os.path.join(stash, "v1"))
        _layout(root, stash, ("swapped", "not_started")[rank])
        torch.distributed.barrier()
        os.environ.update(kill)
    resumed = manager(root).resume({"actor": engine})
    return {"resumed": resumed, "left": sorted(os.listdir(root)),
            "final": _digests(os.path.join(root, PLACES["final"]))}


def test_two_nodes_killed_at_each_rename_then_rerun(tmp_path, monkeypatch):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    for name in ("ckpt", "node0", "node1"):
        os.makedirs(tmp_path / name)
    for act, phase, node in (("save", "swap", 0), ("recover", "recover", 1)):
        monkeypatch.setenv(ENV, phase)
        monkeypatch.setenv(RANK_ENV, str(node))
        with pytest.raises(AssertionError, match=r"failed ranks: \[0, 1\]"):  # the killed node, its peer
            run_ranks(2, _node_run, hf_dir, str(tmp_path), act, timeout_s=120, daemon=False)
        monkeypatch.delenv(ENV)
        monkeypatch.delenv(RANK_ENV)
        sides = [sorted(n for n in os.listdir(tmp_path / f"node{r}") if "global_step_2" in n) for r in (0, 1)]
        # the killed node stopped between two renames: its step's name is free
        assert sides[node] == [".global_step_2.incoming", ".global_step_2.outgoing"], (act, sides)
        r0, r1 = run_ranks(2, _node_run, hf_dir, str(tmp_path), "resume", timeout_s=120, daemon=False)
        for r in (r0, r1):  # the new copy (its marker agreed on both nodes before the kill)
            assert r["resumed"] == {"step": 2, "v": 2}, (act, sides, r)
            assert r["left"] == ["global_step_2", "latest_checkpointed_iteration.txt"], (act, sides, r)
        assert r0["final"] == r1["final"], (act, sides)


def test_a_linked_root_is_scanned_through_its_link(tmp_path):
    """The root itself may be a link (a mount elsewhere): its steps are seen, not "no root"."""
    from mcore_rl.checkpoint.inventory import scan_root

    _plant_root(str(tmp_path / "real"))
    os.symlink(tmp_path / "real", tmp_path / "root")
    assert scan_root(str(tmp_path / "root")) == scan_root(str(tmp_path / "real"))
    assert scan_root(str(tmp_path / "root"))["steps"]["1"]["marker"] == "ok"
