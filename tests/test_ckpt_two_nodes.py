"""Two simulated nodes with node-local checkpoint storage.

Two torchrun agents on this machine (``--nnodes 2``, one process each, c10d rendezvous on
127.0.0.1), each started in its own mount namespace with a private tmpfs at the same checkpoint
root path, so each node sees only the files its own processes wrote. The agents run
tests/two_node_ckpt_script.py. This test fails (never skips) when unshare or mount do not work:
the issue requires the node-local path to be exercised.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_node(node: int, port: int, root: str, out: str, log: str) -> subprocess.Popen:
    torchrun = (
        f"{sys.executable} -m torch.distributed.run --nnodes 2 --node_rank {node} "
        f"--nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:{port} "
        f"--max_restarts 0 tests/two_node_ckpt_script.py --root {root} --out {out}"
    )
    env = {**os.environ, "PYTHONPATH": ROOT_DIR, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        return subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             f"mount -t tmpfs none {root} && exec {torchrun}"],
            cwd=ROOT_DIR, env=env, stdout=f, stderr=subprocess.STDOUT,
        )


def test_two_nodes_node_local_root(tmp_path):
    root, out = str(tmp_path / "ckpt_root"), str(tmp_path / "out")
    os.makedirs(root)
    port = _free_port()
    logs = [str(tmp_path / f"node{n}.log") for n in range(2)]
    procs = [_start_node(n, port, root, out, logs[n]) for n in range(2)]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=400))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append("timeout")
    text = "\n".join(f"--- node {n} ---\n{open(logs[n]).read()[-6000:]}" for n in range(2))
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


def test_run_sh_two_nodes(tmp_path):
    """launch/run.sh's multi-node mode: two agents (one process each) form one world of 2."""
    port, out = str(_free_port()), str(tmp_path / "out")
    cmd = ["bash", "launch/run.sh", "1", "configs/grpo_demo.yaml", "steps=1", f"output_dir={out}"]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=_run_sh_env(NNODES="2", NODE_RANK=str(n), MASTER_ADDR="127.0.0.1",
                                         MASTER_PORT=port))
        for n in range(2)
    ]
    logs = [p.communicate(timeout=400)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)[-6000:]
    text = "\n".join(logs)
    assert "node 0 of 2" in text and "node 1 of 2" in text, text[-3000:]
    assert "world_size=2" in text, text[-3000:]  # one world across both agents
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert len(f.readlines()) == 1
