"""Two simulated nodes with node-local checkpoint storage.

Two torchrun agents on this machine (``--nnodes 2``, one process each, c10d rendezvous on
127.0.0.1), each started in its own mount namespace with a private tmpfs at the same checkpoint
root path, so each node sees only the files its own processes wrote. The agents run
tests/two_node_ckpt_script.py (storage level). ``test_main_job_two_nodes_node_local_disks_resume``
runs the main job itself (launch/run.sh's multi-node mode, 2 nodes x 1 process) with each node's
own directory bind-mounted at one path, so the node-local disks outlive a run: a 4-step run
saves, the same command with steps=6 resumes on both nodes. These tests fail (never skip) when unshare or mount
do not work: the issue requires the node-local path to be exercised.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import uuid

from mcore_rl.fileio.faults import ENV, RANK_ENV
from tests.job_runs import JOB_ARGS, metric_lines
from tests.two_node_ckpt_script import file_digests  # one hashing helper for both

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_private_node(node: int, port: int, root: str, target: str, log: str) -> subprocess.Popen:
    """One simulated node: a torchrun agent (``--nnodes 2``, one process) running ``target`` (a
    script or ``-m module`` with its arguments) in its own mount namespace with a private tmpfs at
    ``root``."""
    torchrun = (
        f"{sys.executable} -m torch.distributed.run --nnodes 2 --node_rank {node} "
        f"--nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:{port} "
        f"--max_restarts 0 {target}"
    )
    env = {**os.environ, "PYTHONPATH": ROOT_DIR, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "w") as f:
        return subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs none {root} && exec {torchrun}"],
            cwd=ROOT_DIR, env=env, stdout=f, stderr=subprocess.STDOUT,
        )


def wait_nodes(procs: list[subprocess.Popen], logs: list[str], timeout_s: float) -> tuple[list, str]:
    """Exit codes (``"timeout"`` for a node killed after ``timeout_s``) and the logs' tails."""
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout_s))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append("timeout")
    return codes, "\n".join(f"--- node {n} ---\n{open(log).read()[-6000:]}" for n, log in enumerate(logs))


def test_two_nodes_node_local_root(tmp_path):
    root, out = str(tmp_path / "ckpt_root"), str(tmp_path / "out")
    os.makedirs(root)
    port = _free_port()
    logs = [str(tmp_path / f"node{n}.log") for n in range(2)]
    procs = [start_private_node(n, port, root, f"tests/two_node_ckpt_script.py --root {root} --out {out}", logs[n])
             for n in range(2)]
    codes, text = wait_nodes(procs, logs, 400)
    assert codes == [0, 0], f"exit codes {codes}\n{text}"
    assert os.listdir(root) == [], "the private tmpfs leaked files to the host's root"
    res = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    assert "node-local on 2 nodes" in text, text  # the mode is logged once
    for r in res:
        assert r["tmpfs_root"], r  # each node really had its own tmpfs at the root
        assert r["mode"] == "node_local", r
        assert r["check_after_sync"] == "ok", r
        assert r["load"]["own_slice_equal"] and r["load"]["whole_equal_across_nodes"], r["load"]
        assert r["load"]["tp_sharded_keys"] > 0, r["load"]  # the load needed both nodes' shards
    by_node = {r["node"]: r for r in res}
    assert by_node[1]["planted_stale"] and not by_node[0]["planted_stale"], res  # replaced by the sync
    # node 1 lacked rank 0's files before the sync (rank 0 writes .metadata and common.pt)
    assert by_node[1]["check_before_sync"].startswith("CheckpointError"), by_node[1]
    assert ".metadata does not exist" in by_node[1]["check_before_sync"], by_node[1]
    assert by_node[0]["step1"] == by_node[1]["step1"], "nodes hold different step 1 files"
    assert by_node[0]["step2"] == by_node[1]["step2"], "nodes hold different step 2 files"
    files = set(by_node[0]["step1"])
    assert {"trainer_state.json", "actor/dist_ckpt/.metadata", "actor/dist_ckpt/common.pt",
            "actor/dist_ckpt/metadata.json"} <= files, files
    assert sum(f.endswith(".distcp") and f.startswith("actor/dist_ckpt/__1_") for f in files) >= 1
    assert set(by_node[0]["step2"]) == {"node1_only/state.json"}, by_node[0]["step2"]


def _run_sh_env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")}
    path = f"{os.path.dirname(sys.executable)}:{env.get('PATH', '')}"  # run.sh's torchrun
    return {**env, "PATH": path, "PYTHONPATH": ROOT_DIR, **extra}


def test_run_sh_partial_multinode_env_is_an_error():
    r = subprocess.run(["bash", "launch/run.sh", "1", "configs/grpo_demo.yaml"], cwd=ROOT_DIR,
                       env=_run_sh_env(NNODES="2", NODE_RANK="0"), capture_output=True, text=True)
    assert r.returncode == 2, r
    assert "missing: MASTER_ADDR MASTER_PORT" in r.stderr, r.stderr


# ---- the main job on two simulated nodes with node-local disks ---------------------------------

def _job_args(steps: int, base: str) -> list[str]:
    """The tiny GRPO demo of tests/job_runs.py (TP=2 over the two processes, the straight run's
    settings), outputs and checkpoints under ``base``."""
    return ["configs/grpo_demo.yaml", f"steps={steps}", f"output_dir={base}/out",
            f"checkpoint.root={base}/ckpt", "checkpoint.save_contents=[model,optimizer,extra,hf_model]", *JOB_ARGS]


def _wait_all(procs: list[subprocess.Popen], tag: str, timeout: float) -> list:
    """Exit codes (or "timeout"); every process of the run (tagged env) is killed afterwards:
    a rank that died leaves its peer blocked in a collective."""
    from tests.job_runs import tagged

    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            codes.append("timeout")
            for pid in tagged(tag):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    for pid in tagged(tag):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return codes


def _two_node_job(tmp_path, steps: int, shared: str, disks: list[str],
                  extra_env: dict | None = None) -> tuple[list, list[str]]:
    """launch/run.sh on 2 nodes x 1 process. Node n runs in its own mount namespace where its own
    disk ``disks[n]`` is bind-mounted at the same path ``shared``: each node sees only the files
    its process wrote there, and the disks outlive the run (the second run resumes from them)."""
    from tests.job_runs import TAG_ENV

    port, tag = str(_free_port()), uuid.uuid4().hex
    job = " ".join(["exec bash launch/run.sh 1", *_job_args(steps, shared)])
    procs, logs = [], []
    for n, disk in enumerate(disks):
        logs.append(str(tmp_path / f"run{steps}{'_fault' if extra_env else ''}_node{n}.log"))
        env = _run_sh_env(NNODES="2", NODE_RANK=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                          **{TAG_ENV: tag}, **(extra_env or {}))
        with open(logs[-1], "w") as f:
            procs.append(subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                 f"mount --bind {disk} {shared} && {job}"],
                cwd=ROOT_DIR, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True))
    codes = _wait_all(procs, tag, timeout=150)
    return codes, [open(p).read() for p in logs]


def _disk_state(disk: str) -> dict:
    """What one node holds: tracker, complete steps, per-step trainer state and file digests."""
    root = os.path.join(disk, "ckpt")
    tracker_path = os.path.join(root, "latest_checkpointed_iteration.txt")
    steps = sorted(int(d.split("_")[-1]) for d in os.listdir(root) if d.startswith("global_step_"))
    step_dirs = {s: os.path.join(root, f"global_step_{s}") for s in steps}
    return {
        "tracker": open(tracker_path).read().strip() if os.path.exists(tracker_path) else None,
        "complete": [s for s in steps if os.path.isfile(os.path.join(step_dirs[s], "COMPLETE"))],
        "trainer_step": {s: json.load(open(os.path.join(d, "trainer_state.json")))["step"]
                         for s, d in step_dirs.items() if os.path.isfile(os.path.join(d, "trainer_state.json"))},
        "files": {s: file_digests(d) for s, d in step_dirs.items()},
        "metrics": os.path.isfile(os.path.join(disk, "out", "metrics.jsonl")),
    }


def _check_full_on_both(disks: list[str], steps: list[int], text: str) -> list[dict]:
    """Both nodes hold every step complete (marker, tracker, trainer state) with the same files."""
    states = [_disk_state(d) for d in disks]
    for n, s in enumerate(states):
        assert s["tracker"] == str(steps[-1]) and s["complete"] == steps, (n, s["tracker"], s["complete"], text)
        assert s["trainer_step"] == {k: k for k in steps}, (n, s["trainer_step"])
    for k in steps:
        files = states[0]["files"][k]
        assert {"COMPLETE", "trainer_state.json", "actor/mcore_rl.json", "actor/huggingface/config.json",
                "actor/dist_ckpt/.metadata", "actor/dist_ckpt/common.pt"} <= set(files), sorted(files)
        assert sum(f.endswith(".distcp") for f in files) >= 2, sorted(files)  # both ranks' shards
        # hf_model: each node's leader exported its own copy in the background (close waited)
        assert {"actor/huggingface/model.safetensors", "actor/huggingface/mcore_rl_export.json"} <= set(files), k
        assert states[1]["files"][k] == files, f"step {k}: the nodes hold different files"
    from mcore_rl.checkpoint.hf_export_record import export_state

    for n, disk in enumerate(disks):
        assert [export_state(os.path.join(disk, "ckpt", f"global_step_{k}", "actor")) for k in steps] == \
            ["complete"] * len(steps), (n, text)
    return states


def test_main_job_two_nodes_node_local_disks_resume(straight_job, tmp_path):
    """The main job on 2 nodes x 1 process with node-local checkpoint disks, launched by run.sh's
    multi-node mode (two torchrun agents form one world of 2): a 4-step run saves steps 2 and 4
    complete on BOTH nodes (the node without rank 0 receives rank 0's files, trainer_state.json
    included, and writes its own marker and tracker). The same command with steps=6 is killed
    between the two nodes' markers of step 6 (rank 1 dies before its node's marker; rank 0's node
    has one), and the node without the marker is also given an earlier run's copy of rank 0's
    shard (same size, other bytes) in step 6. The rerun resumes step 4 on both nodes (step 6 is
    complete on one node only), removes step 6 on both before writing it again, and ends with
    identical files on both disks and the metrics of the straight run (one node, tests/job_runs.py).
    ``hf_model`` is saved: each node's leader exports its own copy of every step in the background
    (node-local: no node waits for another's export), so every step's HF export is complete on both
    disks with the same bytes (the job's view agreed), the killed run's step 6 included."""
    reference = metric_lines(straight_job)[:6]
    shared = str(tmp_path / "node_path")  # the one path both nodes are given
    disks = [str(tmp_path / f"disk{n}") for n in range(2)]
    for d in (shared, *disks):
        os.makedirs(d)
    codes, logs = _two_node_job(tmp_path, 4, shared, disks)
    text = "\n".join(f"--- node {n} ---\n{log[-5000:]}" for n, log in enumerate(logs))
    assert codes == [0, 0], f"exit codes {codes}\n{text}"
    assert all(f"launch/run.sh: node {n} of 2" in log for n, log in enumerate(logs)), text
    assert os.listdir(shared) == [], "the host's path got files: the nodes did not have own disks"
    states = _check_full_on_both(disks, [2, 4], text)
    # rank 0's node holds metrics.jsonl (written by rank 0 only); the other node holds the step
    # dirs and trainer_state.json all the same, received from rank 0's node after each save
    first = [s["metrics"] for s in states].index(True)
    assert [s["metrics"] for s in states] == [n == first for n in range(2)], states
    assert "checkpoint root" in logs[first] and "node-local on 2 nodes" in logs[first], text
    assert "world_size=2" in logs[first], text  # one world across both agents
    assert "received" in logs[1 - first], text  # the node without rank 0 got files from its peer

    codes, logs = _two_node_job(tmp_path, 6, shared, disks, {ENV: "marker", RANK_ENV: "1"})
    text = "\n".join(f"--- node {n} ---\n{log[-5000:]}" for n, log in enumerate(logs))
    assert 0 not in codes, f"the run was not killed: {codes}\n{text}"
    marked = [os.path.isfile(os.path.join(d, "ckpt", "global_step_6", "COMPLETE")) for d in disks]
    assert sorted(marked) == [False, True], (marked, text)  # killed between the two nodes' markers
    bare = disks[marked.index(False)]
    old, stale = (os.path.join(bare, "ckpt", f"global_step_{s}", "actor", "dist_ckpt", "__0_0.distcp") for s in (4, 6))
    with open(old, "rb") as a, open(stale, "rb") as b:  # the same size, other bytes
        assert os.path.getsize(old) == os.path.getsize(stale) and a.read() != b.read()
    shutil.copyfile(old, stale)

    codes, logs = _two_node_job(tmp_path, 6, shared, disks)
    text = "\n".join(f"--- node {n} ---\n{log[-5000:]}" for n, log in enumerate(logs))
    assert codes == [0, 0], f"exit codes {codes}\n{text}"
    lead = [n for n, log in enumerate(logs) if "grpo (fp32):" in log]  # rank 0 may change nodes
    assert len(lead) == 1 and "resumed from step 4" in logs[lead[0]], text
    assert "skipping incomplete checkpoint" in logs[lead[0]] and "marker only on node(s)" in logs[lead[0]], text
    assert "node-local on 2 nodes" in logs[lead[0]], text
    _check_full_on_both(disks, [2, 4, 6], text)  # the stale shard is gone: both disks hold the same files
    # the resumed run's metrics.jsonl (cut after step 4) equals the straight run's, steps 5-6 too
    assert metric_lines(os.path.join(disks[lead[0]], "out")) == reference
