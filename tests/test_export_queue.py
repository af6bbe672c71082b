"""ExportQueue (mcore_rl/checkpoint/export_queue.py) with a stand-in exporter (a few lines of
Python, no torch): one export at a time in submission order, a newer step drops older queued
ones (superseding on) or not (off), what a failure reports (exit code + the exporter's error
line, killed by signal N), a cancel kills without a failure, the exporter's process settings
(parent-death signal, threads), that it dies with its parent and that starting it does not
fork the rank (no copy-on-write faults on the rank's memory afterwards)."""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import sys
import time

import pytest

from mcore_rl.checkpoint.export_queue import ExportQueue
from tests.ckpt_bodies import alive

# the stand-in: records how it was started, holds while <dir>/hold exists, fails when asked
FAKE = r"""
import ctypes, json, os, sys, time
d, step, threads = sys.argv[1], sys.argv[2], sys.argv[3]
libc = ctypes.CDLL(None)
sig = ctypes.c_int(-1)
libc.prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
info = {"pid": os.getpid(), "pdeathsig": sig.value, "threads": threads, "omp": os.environ.get("OMP_NUM_THREADS"),
        "start": time.time()}
open(os.path.join(d, f"started.{step}"), "w").write(json.dumps(info))
while os.path.exists(os.path.join(d, "hold")):
    time.sleep(0.01)
if os.path.exists(os.path.join(d, "fail")):
    print("merging ...")
    sys.stderr.write("Traceback: noise\nerror: step dir X: the marker is damaged; pick another step\nmore noise\n")
    sys.exit(2)
open(os.path.join(d, f"done.{step}"), "w").write(str(time.time()))
"""


def fake_command(task, threads: int) -> list[str]:
    return [sys.executable, "-S", "-c", FAKE, task.role_dir, str(task.step), str(threads)]


def _queue(**kw) -> ExportQueue:
    return ExportQueue(command=fake_command, **kw)


def _wait_for(path: str, timeout: float = 30.0) -> dict:
    deadline = time.time() + timeout
    while not os.path.exists(path):
        assert time.time() < deadline, f"{path} never appeared"
        time.sleep(0.01)
    time.sleep(0.05)  # written in one call; let it land
    return json.loads(open(path).read())


def _role(tmp_path, name: str, hold: bool = False, fail: bool = False) -> str:
    d = tmp_path / name
    d.mkdir()
    if hold:
        (d / "hold").touch()
    if fail:
        (d / "fail").touch()
    return str(d)


@pytest.mark.parametrize("supersede", [True, False])
def test_one_at_a_time_in_order_newer_supersedes(tmp_path, caplog, supersede):
    caplog.set_level(logging.WARNING, "mcore_rl")
    q = _queue(supersede=supersede)
    d = _role(tmp_path, "actor", hold=True)
    q.submit(1, {"actor": d}, _Spec())
    _wait_for(f"{d}/started.1")
    q.submit(2, {"actor": d}, _Spec())
    q.submit(3, {"actor": d}, _Spec())
    time.sleep(0.2)  # a second export would have started by now
    state = (q.running_steps(), q.queued_steps(), sorted(n for n in os.listdir(d) if n.startswith("started")))
    os.remove(f"{d}/hold")
    assert q.wait(timeout=60) == [] and not q.busy()
    q.close()
    if supersede:
        assert state == ({1}, [3], ["started.1"])
        assert sorted(n for n in os.listdir(d) if n.startswith("done")) == ["done.1", "done.3"]
        lines = [r.getMessage() for r in caplog.records if "superseded" in r.getMessage()]
        assert len(lines) == 1 and "step(s) [2]" in lines[0] and "by step 3" in lines[0], lines
    else:
        assert state == ({1}, [2, 3], ["started.1"])
        assert sorted(n for n in os.listdir(d) if n.startswith("done")) == ["done.1", "done.2", "done.3"]
        assert not [r for r in caplog.records if "superseded" in r.getMessage()]
    starts = {s: json.loads(open(f"{d}/started.{s}").read())["start"] for s in ((1, 3) if supersede else (1, 2, 3))}
    ends = {s: float(open(f"{d}/done.{s}").read()) for s in starts}
    order = sorted(starts, key=starts.get)
    assert order == sorted(starts)  # submission order
    assert all(starts[b] >= ends[a] for a, b in zip(order, order[1:])), (starts, ends)  # never two at once


def test_failures_name_step_role_node_and_the_error_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MCORE_RL_NODE_RANK", "3")
    q = _queue(supersede=False)
    q.submit(4, {"critic": _role(tmp_path, "critic", fail=True)}, _Spec())
    held = _role(tmp_path, "actor", hold=True)
    q.submit(5, {"actor": held}, _Spec())
    pid = _wait_for(f"{held}/started.5")["pid"]
    os.kill(pid, signal.SIGKILL)
    failures = q.wait(timeout=60)
    assert [(f.step, f.role, f.node) for f in failures] == [(4, "critic", 3), (5, "actor", 3)]
    assert failures[0].error == ("the exporter exited with code 2: error: step dir X: the marker is damaged; "
                                 "pick another step")
    assert failures[1].error == "the exporter was killed by signal 9 (SIGKILL)"
    assert failures[0].describe().startswith("the HF export of step 4 role critic on node 3 failed: the exporter")
    assert q.poll() == []  # reported once
    # a cancel kills the running export and drops the queued one of that step: no failure
    again = _role(tmp_path, "again", hold=True)
    q.submit(6, {"actor": again, "critic": again}, _Spec())
    _wait_for(f"{again}/started.6")
    assert q.queued_steps() == [6] and q.running_steps() == {6}
    assert q.cancel(6) and not q.busy() and q.poll() == []
    assert not q.cancel(6)
    q.close()


def test_exporter_process_settings(tmp_path):
    q = _queue(threads=3)
    d = _role(tmp_path, "actor")
    q.submit(1, {"actor": d}, _Spec())
    assert q.wait(timeout=60) == []
    info = json.loads(open(f"{d}/started.1").read())
    assert info["pdeathsig"] == signal.SIGKILL
    assert info["threads"] == "3" and info["omp"] == "3"  # (nice / I/O priority: the worker sets its own)
    q.close()


def test_starting_an_exporter_does_not_fork_the_rank(tmp_path):
    """A fork() of the rank (what a Popen ``preexec_fn`` forces) would write-protect all its
    memory: every later write to it faults (and the fork stalls the rank). Measured as the minor
    page faults of writing 256 MiB of the rank's memory once the exporter has started."""
    import resource

    import torch

    state = torch.ones(64 * 2**20)  # 256 MiB, touched
    q = _queue()
    d = _role(tmp_path, "actor", hold=True)
    q.submit(1, {"actor": d}, _Spec())
    _wait_for(f"{d}/started.1")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    state.add_(1.0)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    os.remove(f"{d}/hold")
    q.close()
    assert faults < 64 * 2**20 * 4 // 4096 // 4, f"{faults} page faults writing 256 MiB: the rank was forked"


def _parent_with_export(d: str, out) -> None:
    q = _queue()
    q.submit(1, {"actor": d}, _Spec())
    out.put(_wait_for(f"{d}/started.1")["pid"])
    time.sleep(600)


def test_exporter_dies_with_its_parent(tmp_path):
    d = _role(tmp_path, "actor", hold=True)
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    parent = ctx.Process(target=_parent_with_export, args=(d, out))
    parent.start()
    pid = out.get(timeout=60)
    assert alive(pid)
    os.kill(parent.pid, signal.SIGKILL)
    parent.join()
    deadline = time.time() + 10
    while alive(pid) and time.time() < deadline:
        time.sleep(0.02)
    survived = alive(pid)
    if survived:
        os.kill(pid, signal.SIGKILL)
    assert not survived, "the exporter outlived its killed parent"


class _Spec:
    dtype = None
    max_shard_size = "5GB"
