"""verl's PPO checkpoint sequence against two real mcore_rl engines (verl's TrainingWorker, an
actor and a critic, DP=2 on 2 gloo ranks): each save writes its role part into one
``global_step_<N>``, verl's "driver" (rank 0 here) then writes ``data.pt`` and its tracker, as
``RayPPOTrainer._save_checkpoint`` does; a resume finds the step with verl's own
``find_latest_ckpt_path`` and loads both roles.

One sequence of three worlds (each kill ends a world; the next one is the resume check):
W1 saves step 1, then step 2's actor part and dies (before the critic's save); W2 resumes step 1
bit-exactly, saves step 2 (clearing W1's leftover first), then step 3's two parts and dies
before verl's data.pt/tracker; W3 resumes step 2, finds step 3's leftovers stale, saves 3 and 4
and checks per-role retention (actor 2, critic 1) and the refusal to overwrite a sealed step.
``test_two_nodes_node_local`` runs one world on two simulated nodes with node-local disks (each node's
leader exports its own copy of the actor part, ``hf_model``).
``test_hf_export_failure_raised_at_next_save_and_retention_waits`` saves an actor with
``hf_model`` (background exports, ``verl_exports``): a killed exporter's failure at the next save,
the resume re-exporting it, retention waiting for a running export, exports equal to
``mcore_to_hf.py merge``.
"""
from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time

import pytest
import torch

pytest.importorskip("verl")

from tests.dist import run_ranks  # noqa: E402
from tests.verl.verl_fixtures import save_tiny_model  # noqa: E402

TRACKER = "latest_checkpointed_iteration.txt"
KEEP = {"actor": 2, "critic": 1}  # verl's trainer.max_actor_ckpt_to_keep / max_critic_ckpt_to_keep


# ---- rank bodies -----------------------------------------------------------------------------------
def _workers(actor_dir: str, critic_dir: str) -> dict:
    """verl's TrainingWorkers (strategy mcore_rl) for the actor and the critic, in one process."""
    from tests.verl import rl_bodies as B

    B._env()
    return {"actor": B._verl_worker("language_model", actor_dir, {}, False, 10),
            "critic": B._verl_worker("value_model", critic_dir, {}, False, 10)}


def _train(workers: dict, step: int) -> None:
    """One optimizer step of each engine on other rows per DP rank and step (Adam state moves)."""
    from megatron.core import parallel_state

    from tests.steps import _output_loss
    from tests.tiny import rl_batch

    for n, w in enumerate(workers.values()):
        eng = w.engine.engine
        b = rl_batch(eng.args.vocab_size, batch=2, seed=1000 * step + 10 * parallel_state.get_data_parallel_rank() + n)
        eng.run([{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}],
                _output_loss(eng.role, eng.args.vocab_size), forward_only=False)
        eng.step()


def _fingerprint(workers: dict) -> dict[str, torch.Tensor]:
    """Every parameter, fp32 main copy and Adam moment/step of both engines on this rank."""
    from tests.ckpt_bodies import optimizer_fingerprint

    out = {}
    for role, w in workers.items():
        eng = w.engine.engine
        out.update({f"{role}.opt.{k}": v for k, v in optimizer_fingerprint(eng).items()})
        out.update({f"{role}.param.{i}": p.detach().clone() for i, p in enumerate(
            p for chunk in eng.model for p in chunk.parameters())})
        out[f"{role}.lr_steps"] = torch.tensor(eng.scheduler.num_steps)
    return out


def _equal(a: dict, b: dict) -> list[str]:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return [k for k in a if not torch.equal(a[k], b[k])]


def _read(path: str) -> str | None:
    return open(path).read() if os.path.exists(path) else None


def _save_step(workers: dict, root: str, step: int, driver: bool = True, kill_after: str | None = None) -> dict:
    """verl's ``_save_checkpoint``: the actor's part, the critic's, then (the driver, rank 0)
    data.pt and the tracker. Returns what rank 0 saw between the calls; ``kill_after``: this
    process dies (SIGKILL, every rank) right after that role's save, as a killed trainer would."""
    step_dir, rank = os.path.join(root, f"global_step_{step}"), torch.distributed.get_rank()
    seen = {"tracker_before": _read(os.path.join(root, TRACKER))}
    for role in ("actor", "critic"):
        workers[role].save_checkpoint(os.path.join(step_dir, role), None, step, max_ckpt_to_keep=KEEP[role])
        if rank == 0:
            seen[f"after_{role}"] = {"tracker": _read(os.path.join(root, TRACKER)), "files": _files(step_dir)}
        if kill_after == role:
            torch.distributed.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    if driver and rank == 0:
        torch.save({"dataloader_step": step}, os.path.join(step_dir, "data.pt"))
        with open(os.path.join(root, TRACKER), "w") as f:  # verl: plain open/write, not atomic
            f.write(str(step))
    torch.distributed.barrier()  # verl's driver waits for its workers' calls
    return seen


def _files(base: str) -> dict[str, str]:
    """relpath -> sha256 of every file under ``base``."""
    out = {}
    for d, _, names in os.walk(base):
        for n in names:
            with open(os.path.join(d, n), "rb") as f:
                out[os.path.relpath(os.path.join(d, n), base)] = hashlib.sha256(f.read()).hexdigest()
    return out


def _resume(workers: dict, root: str) -> int:
    """verl's ``_load_checkpoint`` (resume_mode=auto): the tracker's step, both roles."""
    from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

    folder = find_latest_ckpt_path(root)
    for role, w in workers.items():
        w.load_checkpoint(os.path.join(folder, role), None, del_local_after_load=True)
    return int(folder.rsplit("_", 1)[1])


def _error(fn) -> str:
    from mcore_rl.errors import CheckpointError

    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "no error"


def world1(actor_dir: str, critic_dir: str, root: str, out: str) -> None:
    workers = _workers(actor_dir, critic_dir)
    _train(workers, 1)
    seen = _save_step(workers, root, 1)
    torch.save(_fingerprint(workers), os.path.join(out, f"fp1_rank{torch.distributed.get_rank()}.pt"))
    if torch.distributed.get_rank() == 0:
        with open(os.path.join(out, "w1.json"), "w") as f:
            json.dump(seen, f)
    _train(workers, 2)
    _save_step(workers, root, 2, kill_after="actor")


def world2(actor_dir: str, critic_dir: str, root: str, out: str) -> dict:
    workers = _workers(actor_dir, critic_dir)
    rank = torch.distributed.get_rank()
    refused = _error(lambda: workers["actor"].load_checkpoint(os.path.join(root, "global_step_2", "actor")))
    resumed = _resume(workers, root)
    fp1 = torch.load(os.path.join(out, f"fp1_rank{rank}.pt"), weights_only=True)
    differs = _equal(_fingerprint(workers), fp1)
    _train(workers, 2)
    seen2 = _save_step(workers, root, 2)
    torch.save(_fingerprint(workers), os.path.join(out, f"fp2_rank{rank}.pt"))
    if rank == 0:
        with open(os.path.join(out, "w2.json"), "w") as f:
            json.dump({"refused": refused, "resumed": resumed, "differs": differs, "seen2": seen2}, f)
    _train(workers, 3)
    _save_step(workers, root, 3, kill_after="critic")


def world3(actor_dir: str, critic_dir: str, root: str, out: str) -> dict:
    from mcore_rl.checkpoint import role_parts
    from mcore_rl.checkpoint.role_steps import _since

    workers = _workers(actor_dir, critic_dir)
    rank = torch.distributed.get_rank()
    step3 = os.path.join(root, "global_step_3")
    since = _since()  # collective: when this run's processes started
    stale_critic = role_parts.continues(step3, "critic", since) if rank == 0 else None
    # step 1 lost its critic part to retention: its actor part still loads, as it was saved
    workers["actor"].load_checkpoint(os.path.join(root, "global_step_1", "actor"), None, True)
    fp1 = torch.load(os.path.join(out, f"fp1_rank{rank}.pt"), weights_only=True)
    actor1 = _equal({k: v for k, v in _fingerprint(workers).items() if k.startswith("actor.")},
                    {k: v for k, v in fp1.items() if k.startswith("actor.")})
    resumed = _resume(workers, root)
    differs = _equal(_fingerprint(workers), torch.load(os.path.join(out, f"fp2_rank{rank}.pt"), weights_only=True))
    pruned = _error(lambda: workers["critic"].load_checkpoint(os.path.join(root, "global_step_1", "critic")))
    _train(workers, 3)
    seen3 = _save_step(workers, root, 3)
    _train(workers, 4)
    _save_step(workers, root, 4)
    before = _files(step3) if rank == 0 else None
    rollback = _error(lambda: workers["actor"].save_checkpoint(os.path.join(step3, "actor"), None, 3, 2))
    return {"stale_critic_continues": stale_critic, "actor1": actor1, "resumed": resumed, "differs": differs,
            "pruned": pruned, "seen3": seen3, "rollback": rollback,
            "step3_unchanged": _files(step3) == before if rank == 0 else None}


# ---- the test ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("roles_models")
    return save_tiny_model(str(d / "actor"), seed=1), save_tiny_model(str(d / "critic"), role="critic", seed=2)


def _marker(step_dir: str) -> dict:
    with open(os.path.join(step_dir, "COMPLETE")) as f:
        return json.load(f)


def _parts(step_dir: str) -> list[str]:
    return sorted(r for r in ("actor", "critic") if os.path.isfile(os.path.join(step_dir, r, "PART")))


def test_verl_save_sequence_kills_resume_retention(models, tmp_path):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    os.makedirs(out)
    step = lambda n: os.path.join(root, f"global_step_{n}")  # noqa: E731

    with pytest.raises(AssertionError, match="died with exit code -9"):
        run_ranks(2, world1, *models, root, out)
    w1 = json.load(open(os.path.join(out, "w1.json")))
    # both roles went into one step; our saves never wrote the tracker (verl's driver did)
    assert w1["tracker_before"] is None and w1["after_actor"]["tracker"] is None
    assert w1["after_critic"]["tracker"] is None
    assert "actor/PART" in w1["after_actor"]["files"] and "COMPLETE" not in w1["after_critic"]["files"]
    assert {"actor/PART", "critic/PART"} <= set(w1["after_critic"]["files"])
    # killed after step 2's actor part: step 1 (sealed by that save) is what the tracker names
    assert _read(os.path.join(root, TRACKER)) == "1"
    marker = _marker(step(1))
    assert marker["kind"] == "parts" and marker["roles"] == ["actor", "critic"], marker["roles"]
    assert {"data.pt", "actor/PART", "critic/PART", "actor/mcore_rl.json"} <= set(marker["files"])
    assert _parts(step(2)) == ["actor"] and not os.path.exists(os.path.join(step(2), "COMPLETE"))

    with pytest.raises(AssertionError, match="died with exit code -9"):
        run_ranks(2, world2, *models, root, out)
    w2 = json.load(open(os.path.join(out, "w2.json")))
    assert "is not complete" in w2["refused"] and "names step 1" in w2["refused"], w2["refused"]
    assert w2["resumed"] == 1 and w2["differs"] == [], w2["differs"]  # bit-exact: params, Adam, LR steps
    after_actor, after_critic = w2["seen2"]["after_actor"], w2["seen2"]["after_critic"]
    assert after_actor["tracker"] == after_critic["tracker"] == "1"  # still verl's, not ours
    actor_files = {k: v for k, v in after_actor["files"].items() if k.startswith("actor/")}
    assert {k: after_critic["files"][k] for k in actor_files} == actor_files  # the critic kept the fresh actor part
    # killed after step 3's two parts, before verl's data.pt and tracker: step 3 is not complete
    assert _read(os.path.join(root, TRACKER)) == "2"
    assert _parts(step(3)) == ["actor", "critic"] and not os.path.exists(os.path.join(step(3), "COMPLETE"))
    assert not os.path.exists(os.path.join(step(3), "data.pt"))
    assert _marker(step(2))["roles"] == ["actor", "critic"] and "data.pt" in _marker(step(2))["files"]
    assert _parts(step(1)) == ["actor"] and not os.path.exists(os.path.join(step(1), "critic"))  # critic: keep 1

    w3 = run_ranks(2, world3, *models, root, out)
    r0 = w3[0]
    assert r0["stale_critic_continues"] is False  # W2's actor part predates this run
    assert r0["resumed"] == 2 and all(r["differs"] == [] for r in w3), [r["differs"] for r in w3]
    assert all(r["actor1"] == [] for r in w3), [r["actor1"] for r in w3]
    assert "critic part was removed by retention" in r0["pruned"], r0["pruned"]
    assert "critic/PART" not in r0["seen3"]["after_actor"]["files"]  # the stale step 3 was cleared first
    assert "data.pt" not in r0["seen3"]["after_actor"]["files"]
    # retention (actor 2, critic 1): every role in its newest sealed steps + the newest step
    assert sorted(os.listdir(root)) == ["global_step_2", "global_step_3", "global_step_4", TRACKER]
    assert _parts(step(2)) == ["actor"] and _parts(step(3)) == ["actor", "critic"] == _parts(step(4))
    assert os.path.isfile(os.path.join(step(3), "COMPLETE")) and not os.path.exists(os.path.join(step(4), "COMPLETE"))
    assert sorted(os.listdir(step(2))) == ["COMPLETE", "actor", "data.pt"]
    assert "global_step_3 is a complete checkpoint" in r0["rollback"] and "overwrite" in r0["rollback"], r0["rollback"]
    assert r0["step3_unchanged"]


def test_async_save_is_refused():
    """verl skips its tracker when the actor's checkpoint.async_save is set: steps would never seal."""
    from verl.trainer.config.config import CheckpointConfig

    from mcore_rl.integrations.verl.config import VerlConfigError
    from mcore_rl.integrations.verl.verl_checkpoints import check_checkpoint_config

    check_checkpoint_config(CheckpointConfig())
    with pytest.raises(VerlConfigError, match="async_save=True"):
        check_checkpoint_config(CheckpointConfig(async_save=True))


# ---- hf_model: the background export of a role part -------------------------------------------------
def _drained(timeout_s: float = 120.0) -> None:
    """Waits until this process's export queue is idle, leaving its failures to the next save."""
    import time

    from mcore_rl.integrations.verl import verl_exports

    queue, deadline = verl_exports.existing_queue(), time.monotonic() + timeout_s
    while queue is not None and queue.busy() and time.monotonic() < deadline:
        time.sleep(0.1)
    torch.distributed.barrier()


def _exporter(hold: str):
    """The worker's command line; the first export of step 1 killed at its merge phase (the fault
    point), step 3's held there until ``<hold>/release`` exists (the hold point): env of that
    exporter only."""
    from mcore_rl.checkpoint.export_queue import worker_command

    killed: list[int] = []

    def command(task, threads: int) -> list[str]:
        env = []
        if task.step == 1 and not killed:
            killed.append(1)
            env = ["MCORE_RL_CKPT_FAULT=hf_export_merge"]
        elif task.step == 3:
            env = [f"MCORE_RL_CKPT_HOLD={hold}"]
        return ["env", *env, *worker_command(task, threads)]

    return command


def export_world(actor_dir: str, root: str, hold: str) -> dict:
    """An actor with ``hf_model`` (DP=2, shared root: rank 0 exports), verl's save sequence:
    step 1's exporter is killed: step 2's first save raises that on every rank before it writes
    anything; the resume of step 1 cleans its partial export and exports it again; step 3's export
    is held while steps 4 and 5 are saved with max_ckpt_to_keep=1: retention keeps step 3 while
    its export runs and removes it at step 6's save (``hold``: the test's hold-point directory)."""
    from verl.trainer.config.config import CheckpointConfig

    from mcore_rl.checkpoint import hf_export_record
    from mcore_rl.checkpoint.export_queue import ExportQueue
    from mcore_rl.integrations.verl import verl_exports
    from tests.verl import rl_bodies as B

    B._env()
    actor = B._verl_worker("language_model", actor_dir, {}, False, 10)
    actor.engine.checkpoint_config = CheckpointConfig(save_contents=["model", "optimizer", "extra", "hf_model"])
    verl_exports._PROCESS.queue = ExportQueue(1, True, command=_exporter(hold))  # the process's queue, faulted
    step = lambda n: os.path.join(root, f"global_step_{n}")  # noqa: E731
    rank, out = torch.distributed.get_rank(), {}

    def save(n: int, keep: int | None = 1) -> None:
        _train({"actor": actor}, n)
        actor.save_checkpoint(os.path.join(step(n), "actor"), None, n, max_ckpt_to_keep=keep)

    def driver(n: int) -> None:
        if rank == 0:
            torch.save({"dataloader_step": n}, os.path.join(step(n), "data.pt"))
            with open(os.path.join(root, TRACKER), "w") as f:
                f.write(str(n))
        torch.distributed.barrier()

    save(1, None)
    driver(1)
    _drained()
    out["state1"] = hf_export_record.export_state(os.path.join(step(1), "actor"))
    out["failed"] = _error(lambda: save(2, None))
    out["step2_after_failure"] = os.path.exists(step(2))
    save(2, None)  # seals step 1
    driver(2)
    _drained()
    actor.load_checkpoint(os.path.join(step(1), "actor"), None, False)  # a resume: step 1 lacks its export
    _drained()
    out["state1_resumed"] = hf_export_record.export_state(os.path.join(step(1), "actor"), verify=True)
    save(3, None)
    driver(3)
    while rank == 0 and not any(n.startswith("hf_export_merge.") for n in os.listdir(hold)):
        time.sleep(0.05)  # step 3's exporter is provably running (held)
    for n in (4, 5):
        save(n)
        driver(n)
    out["running"] = sorted(verl_exports.existing_queue().running_steps())
    out["after5"] = sorted(os.listdir(root))
    open(os.path.join(hold, "release"), "w").close()
    _drained()
    out["state3"] = hf_export_record.export_state(os.path.join(step(3), "actor"), verify=True)
    save(6)
    driver(6)
    _drained()
    out["after6"] = sorted(os.listdir(root))
    return out


def test_hf_export_failure_raised_at_next_save_and_retention_waits(models, tmp_path):
    from tests.verl.export_checks import assert_exported

    root, hold = str(tmp_path / "ckpt"), str(tmp_path / "hold")
    os.makedirs(hold)
    res = run_ranks(2, export_world, models[0], root, hold, daemon=False)
    for r in res:  # every rank: the step, the role, the node and the exporter's fate, before step 2 is written
        assert "HF export of step 1 role actor on node 0 failed" in r["failed"], r["failed"]
        assert "killed by signal 9" in r["failed"], r["failed"]
        assert r["step2_after_failure"] is False
    r0 = res[0]
    assert r0["state1"] == "partial"  # its staging dir: ignored by every reader
    assert r0["state1_resumed"] == "complete"  # cleaned and exported again by the resume
    # keep 1: steps 1 and 2 went at step 4's save; step 3 stayed at step 5's while its export ran,
    # and went (with step 4) at step 6's once it was done
    assert r0["running"] == [3] and r0["after5"] == ["global_step_3", "global_step_4", "global_step_5", TRACKER], r0
    assert r0["state3"] == "complete"
    assert r0["after6"] == ["global_step_5", "global_step_6", TRACKER], r0["after6"]
    assert sorted(os.listdir(os.path.join(root, "global_step_6"))) == ["actor", "data.pt"]  # no staging left
    assert_exported(os.path.join(root, "global_step_6", "actor"), 6)


_AT_EXIT = """
import sys
from mcore_rl.integrations.verl import verl_exports
queue = verl_exports.process_queue(1, False)  # no superseding: both run, in order
queue._command = lambda task, threads: ["sh", "-c", f"sleep 1; touch {task.role_dir}; exit {task.step}"]
queue.submit(0, {"actor": sys.argv[1] + "/done0"}, None)
queue.submit(2, {"actor": sys.argv[1] + "/done2"}, None)
"""


def test_a_worker_process_waits_for_its_exports_at_exit(tmp_path):
    """A process that ends right after its last save (the SFT trainer under torchrun) lets its
    queued exports finish (the exit hook ``verl_exports.process_queue`` registers; an exporter
    dies with the process that started it) and prints a failure it found as one error line."""
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    proc = subprocess.run([sys.executable, "-c", _AT_EXIT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(os.listdir(tmp_path)) == ["done0", "done2"]  # step 2 ran after step 0, both finished
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "HF export of step 2 role actor" in errors[0] and "exited with code 2" in errors[0], \
        proc.stderr[-2000:]


# ---- two simulated nodes with node-local disks -----------------------------------------------------
def node_world(actor_dir: str, critic_dir: str, root: str, out: str) -> None:
    """One rank per node, each node a private tmpfs at ``root``: step 1's parts reach both nodes
    at the saves, verl's data.pt and tracker only rank 0's node; the actor saves ``hf_model``:
    each node's leader exports its own copy; step 2's actor save seals step 1, which copies
    data.pt to the other node first; both nodes then load step 1."""
    from verl.trainer.config.config import CheckpointConfig

    from mcore_rl.checkpoint import hf_export_record

    workers = _workers(actor_dir, critic_dir)
    workers["actor"].engine.checkpoint_config = CheckpointConfig(save_contents=["model", "optimizer", "extra",
                                                                                "hf_model"])
    step1 = os.path.join(root, "global_step_1")
    _train(workers, 1)
    _save_step(workers, root, 1)
    _drained()  # both nodes' exports of step 1 done
    saved, before = _fingerprint(workers), _files(step1)
    _train(workers, 2)
    workers["actor"].save_checkpoint(os.path.join(root, "global_step_2", "actor"), None, 2, KEEP["actor"])
    after = _files(step1)
    for role, w in workers.items():  # verl's driver passes the step it read from its tracker
        w.load_checkpoint(os.path.join(step1, role), None, False)
    result = {"node": int(os.environ["GROUP_RANK"]), "before": before, "after": after,
              "tracker": _read(os.path.join(root, TRACKER)), "differs": _equal(_fingerprint(workers), saved),
              "export": hf_export_record.export_state(os.path.join(step1, "actor"), verify=True),
              "tmpfs": any(line.split()[1] == root and line.split()[2] == "tmpfs" for line in open("/proc/mounts"))}
    with open(os.path.join(out, f"rank{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump(result, f)


def _node_main(root: str, out: str, actor_dir: str, critic_dir: str) -> None:
    import logging

    from mcore_rl.platform import init_distributed, setup_platform

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("mcore_rl").setLevel(logging.INFO)  # the storage mode and the copies are logged
    torch.set_num_threads(1)
    init_distributed(setup_platform("cpu"))  # env:// as torchrun sets it
    node_world(actor_dir, critic_dir, root, out)
    torch.distributed.destroy_process_group()


def test_two_nodes_node_local(models, tmp_path):
    """As tests/test_ckpt_two_nodes.py: two torchrun agents (--nnodes 2, one process each), each in
    its own mount namespace with a private tmpfs at the same root path."""
    from tests.test_ckpt_two_nodes import _free_port, start_private_node, wait_nodes

    root, out = str(tmp_path / "root"), str(tmp_path / "out")
    os.makedirs(root)
    os.makedirs(out)
    port = _free_port()
    logs = [str(tmp_path / f"node{node}.log") for node in range(2)]
    target = f"-m tests.verl.test_verl_ckpt_roles {root} {out} {' '.join(models)}"
    procs = [start_private_node(node, port, root, target, logs[node]) for node in range(2)]
    codes, text = wait_nodes(procs, logs, 300)
    assert codes == [0, 0], f"exit codes {codes}\n{text}"
    assert os.listdir(root) == [], "the nodes did not have their own disks"
    res = {r["node"]: r for r in (json.load(open(os.path.join(out, f"rank{k}.json"))) for k in range(2))}
    assert res[0]["tmpfs"] and res[1]["tmpfs"] and "node-local on 2 nodes" in text, text
    # hf_model: each node's leader exported its own copy of the actor part: complete on both, alike
    assert res[0]["export"] == res[1]["export"] == "complete", (res[0]["export"], res[1]["export"])
    assert "actor/model/huggingface/model.safetensors" in res[1]["before"]
    # before the seal: both parts whole on both nodes (copied at the saves), verl's files on node 0 only
    for role in ("actor", "critic"):
        part = {k: v for k, v in res[0]["before"].items() if k.startswith(f"{role}/")}
        assert f"{role}/PART" in part and {k: res[1]["before"].get(k) for k in part} == part, role
    assert "data.pt" in res[0]["before"] and "data.pt" not in res[1]["before"]
    assert res[0]["tracker"] == "1" and res[1]["tracker"] is None  # verl's tracker: its node only, never ours
    # sealed on both nodes: the same files, data.pt copied, the same marker
    assert res[0]["after"] == res[1]["after"] and {"COMPLETE", "data.pt"} <= set(res[1]["after"]), text
    assert res[0]["differs"] == [] and res[1]["differs"] == [], (res[0]["differs"], res[1]["differs"])


if __name__ == "__main__":  # a node of test_two_nodes_node_local (run by torchrun)
    _node_main(*sys.argv[1:5])
