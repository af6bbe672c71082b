"""The main job through torchrun (launch/run.sh) killed with SIGKILL at every save phase
(MCORE_RL_CKPT_FAULT=shards|metadata|marker|swap|tracker|retention, one rank via
MCORE_RL_CKPT_FAULT_RANK, the n-th save via MCORE_RL_CKPT_FAULT_AT), saving every 2 steps with
max_ckpt_to_keep=2. After every kill the tracker names a complete step, no complete step is gone
(a replaced step sits beside its root until the next start finishes the swap), and the next run
of the same command resumes from the step the tracker names; every run's metrics.jsonl equals the
prefix of one uninterrupted 10-step run (lines identical but for the wall-clock metrics, keys in
the order written). One shared sequence of runs keeps the suite small: each kill run is itself
the resume check of the kill before it, and the first and last runs save asynchronously (the
first run's step 2, saved while steps 2-3 train, is the step the next two runs resume from)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

from mcore_rl.fileio.faults import AT_ENV, ENV, RANK_ENV
from tests.test_job import ROOT

TRACKER = "latest_checkpointed_iteration.txt"
TAG_ENV = "MCORE_RL_TEST_JOB_TAG"  # marks every process of one job run, to reap its orphans


def job_command(out, steps: int, keep: int | None = 2, save_freq: int = 2, *extra: str) -> list[str]:
    """launch/run.sh of the tiny GRPO demo (TP=2 on 2 processes) writing to ``out``."""
    return ["bash", "launch/run.sh", "2", "configs/grpo_demo.yaml", f"steps={steps}", f"output_dir={out}",
            "progress_bar=false", f"checkpoint.save_freq={save_freq}", "actor_optim.total_steps=10",
            f"checkpoint.max_ckpt_to_keep={'null' if keep is None else keep}",
            "rollout.prompts_per_step=4", "actor.micro_batch_size=16", "actor.ppo_mini_batch_size=16", *extra]


def job_env(fault: str | None = None, rank: int | None = None, at: int | None = None) -> dict:
    """This environment, run.sh's torchrun on PATH, this checkout imported; the fault (if any)
    on ``rank`` (else every rank) at its ``at``-th arrival (else the first)."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": ROOT}
    for name in (ENV, RANK_ENV, AT_ENV):
        env.pop(name, None)
    if fault:
        env[ENV] = fault
        if rank is not None:
            env[RANK_ENV] = str(rank)
        if at is not None:
            env[AT_ENV] = str(at)
    return env


def tagged(tag: str) -> list[int]:
    """Live processes whose environment holds ``TAG_ENV=tag``: a run's every descendant, also
    re-parented orphans in sessions of their own (torchrun starts each rank in a new session)."""
    found, needle = [], f"{TAG_ENV}={tag}".encode()
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(name))
        except OSError:
            continue
    return found


def _job(out, steps: int, fault: str | None = None, rank: int | None = None, at: int | None = None,
         extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    cmd, tag = job_command(out, steps, 2, 2, *extra), uuid.uuid4().hex
    # files, not pipes: a SIGKILLed rank leaves megatron's results-queue manager (a spawned
    # process) behind, holding pipes open; every tagged process is killed after the run
    with open(f"{out}.{fault or 'run'}{steps}.log", "w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env={**job_env(fault, rank, at), TAG_ENV: tag}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=300)
        finally:
            time.sleep(1)  # let late children start before they are looked for
            for pid in tagged(tag):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        log.seek(0)
        return subprocess.CompletedProcess(cmd, code, log.read(), "")


def _lines(out) -> list[dict]:
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    from mcore_rl.job.loop import wall_clock

    return [{k: v for k, v in m.items() if not wall_clock(k)} for m in lines]


def _key_orders(out) -> list[list[str]]:
    """Each metrics line's keys in the order written (a resume rewrites the lines up to its step)."""
    return [list(json.loads(x)) for x in open(os.path.join(out, "metrics.jsonl"))]


def _state(out) -> tuple[int | None, list[int], list[int]]:
    """(tracker's step or None, step dirs, step dirs with a COMPLETE marker)."""
    root = os.path.join(out, "checkpoints")
    path = os.path.join(root, TRACKER)
    tracker = int(open(path).read().strip()) if os.path.exists(path) else None
    steps = sorted(int(d.split("_")[-1]) for d in os.listdir(root) if d.startswith("global_step_"))
    marked = [s for s in steps if os.path.isfile(os.path.join(root, f"global_step_{s}", "COMPLETE"))]
    return tracker, steps, marked


def _killed(out, steps: int, fault: str, rank: int, before: list[int], straight: list[dict], at: int | None = None,
            extra: tuple[str, ...] = ()):
    """Runs with the fault, checks the run died at it (after resuming and training like the
    straight run) and that no complete step was lost; returns the state after the kill."""
    run = _job(out, steps, fault, rank, at, extra)
    assert run.returncode != 0, f"{fault}: the run was not killed\n{run.stdout[-3000:]}"
    assert "exitcode  : -9" in run.stdout or "Signal 9" in run.stdout, run.stdout[-3000:]
    tracker, dirs, marked = _state(out)
    assert tracker in marked, f"{fault}: tracker names {tracker}, complete steps {marked}"
    assert set(before) <= set(marked), f"{fault}: complete steps {before} -> {marked}"
    assert _lines(out) == straight[:steps], f"{fault}: metrics differ from the straight run"
    return tracker, dirs, marked


def _side_dirs(out) -> list[str]:
    root = os.path.join(out, "checkpoints")
    return sorted(d for d in os.listdir(root) if d.startswith(".global_step_"))


ASYNC = ("checkpoint.async_save=true",)


def test_job_resumes_through_kills(tmp_path):
    straight, out = tmp_path / "straight", tmp_path / "resumed"
    done = _job(straight, 10)
    assert done.returncode == 0, done.stdout[-3000:]
    reference = _lines(straight)
    assert len(reference) == 10
    assert _state(straight) == (10, [8, 10], [8, 10])  # sync saves' retention: max_ckpt_to_keep=2

    # step 4's save torn at each phase before the marker: the step stays incomplete, tracker 2.
    # The first run starts fresh with async saves: step 2 is written while steps 2-3 train and
    # finalized by step 4's save, which rank 1 dies in (its 2nd arrival at the shards phase).
    for fault, rank, at, extra in (("shards", 1, 2, ASYNC), ("metadata", 0, None, ()), ("marker", 0, None, ())):
        assert _killed(out, 4, fault, rank, [], reference, at, extra) == (2, [2, 4], [2]), fault
        root4 = os.path.join(out, "checkpoints", "global_step_4", "actor", "dist_ckpt")
        names = os.listdir(root4)
        if fault in ("shards", "metadata"):  # torn inside megatron's save: no metadata written
            assert ".metadata" not in names and "metadata.json" not in names, (fault, names)
        if fault == "metadata":  # killed after every rank's shards (a barrier), before any metadata
            assert sum(n.endswith(".distcp") for n in names) >= 2, names
    for fault in ("metadata", "marker"):  # each resumed the async-saved step 2 over the torn step 4
        assert "resumed from step 2" in open(f"{out}.{fault}4.log").read(), fault

    # the same command continues from step 2, cuts metrics.jsonl there and saves step 4 over the
    # torn one (complete, tracked); then step 6's marker is written, the tracker not yet (its 2nd
    # arrival at the tracker phase): the tracker (authoritative) still names 4
    assert _killed(out, 6, "tracker", 0, [2], reference, 2) == (4, [2, 4, 6], [2, 4, 6])
    assert "resumed from step 2" in open(f"{out}.tracker6.log").read()
    # the same command resumes from 4 and saves step 6 again: the complete step 6 is replaced,
    # killed between the two renames of the swap (the old copy set aside, the new one not yet in)
    assert _killed(out, 6, "swap", 0, [2, 4], reference) == (4, [2, 4], [2, 4])
    assert "resumed from step 4" in open(f"{out}.swap6.log").read()
    assert _side_dirs(out) == [".global_step_6.incoming", ".global_step_6.outgoing"]
    # the next run finishes the swap, resumes the tracked step 4 (warning that step 6 completed
    # later) and replaces step 6 once more, killed before its retention: nothing gone
    assert _killed(out, 6, "retention", 0, [2, 4], reference) == (6, [2, 4, 6], [2, 4, 6])
    log = open(f"{out}.retention6.log").read()
    assert "finishing an interrupted replacement" in log and "resumed from step 4" in log, log[-3000:]
    assert "steps [6] completed after the tracked step 4" in log, log[-3000:]
    assert _side_dirs(out) == [".global_step_6.outgoing"]  # the replaced copy, removed at retention

    # the last run saves asynchronously (step 8 written while steps 8-9 train, then step 10)
    done = _job(out, 10, extra=ASYNC)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "resumed from step 6" in done.stdout
    assert _lines(out) == reference
    assert _key_orders(out) == _key_orders(straight)  # rewritten lines keep their key order
    assert _state(out) == (10, [8, 10], [8, 10])  # retention caught up: max_ckpt_to_keep=2
    assert _side_dirs(out) == []
