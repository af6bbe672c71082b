"""Async save: training steps complete while the write is provably in flight (the writer is held
by the test-only hook MCORE_RL_CKPT_HOLD, not by timing), each checkpoint equals the state at its
save call although training changed the weights in place since, a new save, an offload and a
load each wait for the one in flight, and a killed rank leaves no writer behind."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from mcore_rl.fileio.faults import HOLD_ENV
from tests.ckpt_bodies import build_engine, hf_dir_for, hf_params, manager, optimizer_fingerprint, train
from tests.dist import run_ranks


def _state(engine) -> dict[str, torch.Tensor]:
    return {**{f"hf.{k}": v for k, v in hf_params(engine).items()},
            **{f"opt.{k}": v for k, v in optimizer_fingerprint(engine).items()}}


def _held(hold: str) -> list[int]:
    return sorted(int(n.split(".")[1]) for n in os.listdir(hold) if n.startswith("writer."))


def _save_while_training(hf_dir: str, root: str, hold: str) -> dict:
    """DP=2 (different batches per rank): async save at steps 2 and 3 with training between."""
    os.environ[HOLD_ENV] = hold
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    train(model, range(2))
    mgr = manager(root, async_save=True)
    snaps = {2: _state(engine)}
    mgr.save(2, {"actor": engine}, {"step": 2})
    while len(_held(hold)) < 2:  # both ranks' writers started and wait at the hold point
        time.sleep(0.01)
    assert mgr.poll() is None  # in flight: nothing finalized
    metrics = train(model, range(2, 3))  # a training step completes while the write is held
    in_flight = {"marker": os.path.exists(os.path.join(mgr.step_dir(2), "COMPLETE")),
                 "metadata": os.path.exists(os.path.join(mgr.step_dir(2), "actor", "dist_ckpt", ".metadata")),
                 "changed": any(not torch.equal(v, _state(engine)[k]) for k, v in snaps[2].items())}
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0:
        open(os.path.join(hold, "release"), "w").close()
    snaps[3] = _state(engine)
    mgr.save(3, {"actor": engine}, {"step": 3})  # waits for step 2, then starts step 3
    step2_done = mgr.complete_steps()
    train(model, range(3, 4))
    assert mgr.wait() == 3
    return {"snaps": snaps, "in_flight": in_flight, "step2_done": step2_done,
            "complete": mgr.complete_steps(), "metrics": metrics}


def _load_each(hf_dir: str, root: str) -> dict:
    engine, _ = build_engine(hf_dir, {}, "actor", False, seed=77)
    mgr = manager(root)
    out = {}
    for step in (2, 3):
        mgr.load(mgr.step_dir(step), {"actor": engine}, ("model", "optimizer", "extra"))
        out[step] = _state(engine)
    return out


def test_async_save_holds_the_state_of_its_call(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    root, hold = str(tmp_path / "ckpt"), str(tmp_path / "hold")
    os.makedirs(hold)
    saved = run_ranks(2, _save_while_training, hf_dir, root, hold, daemon=False)
    loaded = run_ranks(2, _load_each, hf_dir, root, daemon=False)
    for r in range(2):
        s = saved[r]
        assert s["in_flight"] == {"marker": False, "metadata": False, "changed": True}, s["in_flight"]
        assert s["step2_done"] == [2] and s["complete"] == [2, 3]
        for step in (2, 3):
            want, got = s["snaps"][step], loaded[r][step]
            assert want.keys() == got.keys() and len(want) > 10
            bad = [k for k in want if not torch.equal(want[k], got[k])]
            assert not bad, f"rank {r} step {step}: checkpoint differs from the state at its save call: {bad[:5]}"
    # control: the two snapshots differ, so equality above tells the steps apart
    assert any(not torch.equal(v, saved[0]["snaps"][3][k]) for k, v in saved[0]["snaps"][2].items())


def _killed_while_writing(hf_dir: str, root: str, hold: str) -> None:
    os.environ[HOLD_ENV] = hold
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    train(model, range(1))
    manager(root, async_save=True).save(1, {"actor": engine}, {"step": 1})
    while not _held(hold):
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie has died
    except FileNotFoundError:
        return False


def test_writer_dies_with_its_rank(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    root, hold = str(tmp_path / "ckpt"), str(tmp_path / "hold")
    os.makedirs(hold)
    with pytest.raises(AssertionError):
        run_ranks(1, _killed_while_writing, hf_dir, root, hold, daemon=False, timeout_s=120)
    writers = _held(hold)
    assert len(writers) == 1
    deadline = time.time() + 10  # the kernel delivers the death signal promptly; 10 s is a bound
    while _alive(writers[0]) and time.time() < deadline:
        time.sleep(0.05)
    alive = _alive(writers[0])
    if alive:  # do not leave it waiting forever
        os.kill(writers[0], signal.SIGKILL)
    assert not alive, f"writer {writers[0]} outlived its killed rank"
    assert not os.path.exists(os.path.join(root, "latest_checkpointed_iteration.txt"))
    assert not os.path.exists(os.path.join(root, "global_step_1", "COMPLETE"))


def _moves_and_loads_wait(hf_dir: str, root: str, hold: str) -> dict:
    """An offload and a load, each started while a held async write is in flight (a timer
    releases the writer): each returns only after the step is complete."""
    import threading

    from mcore_rl.rl.offload import Offloader

    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    train(model, range(1))
    mgr, out = manager(root, async_save=True), {}
    for step, action in ((1, "offload"), (2, "load")):
        gate = os.path.join(hold, str(step))
        os.makedirs(gate)
        os.environ[HOLD_ENV] = gate
        mgr.save(step, {"actor": engine}, {"step": step})
        while not _held(gate):
            time.sleep(0.01)
        threading.Timer(0.3, lambda g=gate: open(os.path.join(g, "release"), "w").close()).start()
        if action == "offload":
            offloader = Offloader(engine)
            offloader.offload()
            out[action] = mgr.complete_steps()
            offloader.onload()
        else:
            mgr.load(mgr.step_dir(1), {"actor": engine}, ("model", "optimizer", "extra"))
            out[action] = mgr.complete_steps()
    return out


def test_offload_and_load_wait_for_the_write(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    root, hold = str(tmp_path / "ckpt"), str(tmp_path / "hold")
    out = run_ranks(1, _moves_and_loads_wait, hf_dir, root, hold, daemon=False)[0]
    assert out == {"offload": [1], "load": [1, 2]}, out


def _shared_memory_snapshot(hf_dir: str, root: str, hold: str) -> dict:
    """Weights in shared memory (a trainer that shares them with worker processes): a fork's
    copy-on-write image does not freeze them, so the async save must copy them at its call."""
    os.environ[HOLD_ENV] = hold
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    train(model, range(1))
    params = list(engine.model[0].parameters())
    for p in params:
        p.data.share_memory_()  # moves DDP's whole parameter buffer to shared memory
    shared = all(p.untyped_storage().is_shared() for p in params)
    snap = [p.detach().clone() for p in params]
    mgr = manager(root, async_save=True, save_contents=("model",), load_contents=("model",))
    mgr.save(1, {"actor": engine}, {"step": 1})
    while not _held(hold):
        time.sleep(0.01)
    with torch.no_grad():  # changed in place while the write is held
        for p in params:
            p.fill_(7.0)
    open(os.path.join(hold, "release"), "w").close()
    mgr.wait()
    mgr.load(mgr.step_dir(1), {"actor": engine}, ("model",))
    return {"shared": shared, "equal": [torch.equal(p, s) for p, s in zip(params, snap)]}


def test_async_save_copies_weights_in_shared_memory(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    root, hold = str(tmp_path / "ckpt"), str(tmp_path / "hold")
    os.makedirs(hold)
    out = run_ranks(1, _shared_memory_snapshot, hf_dir, root, hold, daemon=False)[0]
    assert out["shared"], "the weights were not in shared memory: the test would prove nothing"
    assert all(out["equal"]), "the checkpoint holds values written after its save call"


def _slow_writer_and_background_retention(hf_dir: str, root: str, hold: str) -> dict:
    """max_ckpt_to_keep=1. Step 2: rank 1's writer is held after rank 0's finished: no poll
    finalizes on either rank until it is released, then one poll does on both; retention deletes
    step 1 on a thread (its rmtree blocks until the poll has returned). Step 3: the deletion
    fails on rank 0; the next call raises it on every rank."""
    import shutil
    import threading

    from mcore_rl.errors import CheckpointError

    rank, real_rmtree, gate = torch.distributed.get_rank(), shutil.rmtree, threading.Event()
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    train(model, range(1))
    mgr, out = manager(root, async_save=True, max_ckpt_to_keep=1), {}
    mgr.save(1, {"actor": engine}, {"step": 1})
    mgr.wait()

    def held_rmtree(path, *args, **kwargs):  # the writer's deletion waits for the test
        out["rmtree_released"] = gate.wait(timeout=30)
        real_rmtree(path, *args, **kwargs)

    shutil.rmtree = held_rmtree
    if rank == 1:
        os.environ[HOLD_ENV] = hold
    mgr.save(2, {"actor": engine}, {"step": 2})
    os.environ.pop(HOLD_ENV, None)
    deadline = time.time() + 30
    while rank == 0 and mgr._async.writers_running() and time.time() < deadline:
        time.sleep(0.01)
    out["rank0_writer_done"] = rank != 0 or not mgr._async.writers_running()
    out["held_polls"] = []
    for _ in range(5):
        torch.distributed.barrier()
        out["held_polls"].append(mgr.poll())
        time.sleep(0.05)
    if rank == 1:
        open(os.path.join(hold, "release"), "w").close()
    for n in range(1000):
        torch.distributed.barrier()
        if mgr.poll() is not None:
            out["finalized_at_poll"] = n
            break
        time.sleep(0.02)
    gate.set()  # only now may the deletion of step 1 go on
    out["after_2"] = mgr.complete_steps()  # joins the deletion
    out["dirs_2"] = sorted(d for d in os.listdir(root) if d.startswith("global_step_"))

    def failing_rmtree(path, *args, **kwargs):
        raise OSError(f"disk gone while removing {path}")

    shutil.rmtree = failing_rmtree
    try:
        mgr.save(3, {"actor": engine}, {"step": 3})
        out["poll_3"] = None
        while out["poll_3"] is None:  # the deletion fails behind the poll, which does not raise it
            torch.distributed.barrier()
            out["poll_3"] = mgr.poll()
            time.sleep(0.02)
        try:
            mgr.complete_steps()
            out["raised"] = None
        except CheckpointError as e:
            out["raised"] = str(e)
    finally:
        shutil.rmtree = real_rmtree
    out["after_3"] = (mgr.complete_steps(), mgr.incomplete_steps())
    mgr.close()
    return out


def test_poll_finalizes_after_the_slowest_writer_and_retention_runs_behind(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    root, hold = str(tmp_path / "ckpt"), str(tmp_path / "hold")
    os.makedirs(hold)
    out = run_ranks(2, _slow_writer_and_background_retention, hf_dir, root, hold, daemon=False, timeout_s=240)
    assert out[0]["rank0_writer_done"], "rank 0's writer still ran: the held polls would prove nothing"
    for r in out:
        assert r["held_polls"] == [None] * 5  # rank 1's writer held: nobody finalizes
        assert r["after_2"] == [2] and r["dirs_2"] == ["global_step_2"], r
        assert r["poll_3"] == 3 and "removing old checkpoints" in r["raised"] and "disk gone" in r["raised"], r
        assert r["after_3"] == ([3], [2])  # step 2 lost its marker first: debris, never "complete"
    assert out[0]["finalized_at_poll"] == out[1]["finalized_at_poll"]  # the same poll on both ranks
    assert out[0]["rmtree_released"], "the poll waited for retention's deletion"
