"""The main job through launch/run.sh as the checkpoint tests run it: the tiny GRPO demo (TP=2 over
2 processes; 4 prompts a step, one micro-batch; a 10-step LR schedule whatever ``steps`` is),
saving every 2 steps. One uninterrupted 10-step run (``straight_job`` in tests/conftest.py) is
the reference of every kill/resume test: tests/test_ckpt_faults.py (one node) and
tests/test_ckpt_two_nodes.py (two simulated nodes) compare their metrics with its prefix."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

from mcore_rl.fileio.faults import AT_ENV, ENV, RANK_ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRACKER = "latest_checkpointed_iteration.txt"
TAG_ENV = "MCORE_RL_TEST_JOB_TAG"  # marks every process of one job run, to reap its orphans
# what every run here shares (the metrics of equal steps are equal whatever the storage settings)
JOB_ARGS = ("progress_bar=false", "checkpoint.save_freq=2", "actor_optim.total_steps=10", "rollout.prompts_per_step=4",
            "actor.micro_batch_size=16", "actor.ppo_mini_batch_size=16")


def job_command(out, steps: int, *extra: str) -> list[str]:
    """launch/run.sh of the tiny GRPO demo (TP=2 on 2 processes) writing to ``out``, keeping the
    last 2 checkpoints."""
    return ["bash", "launch/run.sh", "2", "configs/grpo_demo.yaml", f"steps={steps}", f"output_dir={out}", *JOB_ARGS,
            "checkpoint.max_ckpt_to_keep=2", *extra]


def job_env(fault: str | None = None, rank: int | None = None, at: int | None = None) -> dict:
    """This environment, run.sh's torchrun on PATH, this checkout imported; the fault (if any)
    on ``rank`` (else every rank) at its ``at``-th arrival (else the first)."""
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": ROOT}
    for name in (ENV, RANK_ENV, AT_ENV, "CUDA_DEVICE_MAX_CONNECTIONS"):  # run.sh must set the last
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


def run_job(out, steps: int, fault: str | None = None, rank: int | None = None, at: int | None = None,
            extra: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """One launch (``job_command``) with the fault of ``job_env``; its output also in
    ``<out>.<fault or run><steps>.log``."""
    cmd, tag = job_command(out, steps, *extra), uuid.uuid4().hex
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


def metric_lines(path: str) -> list[dict]:
    """metrics.jsonl at ``path`` (a file, or the output dir holding it) without the wall-clock metrics."""
    from mcore_rl.job.loop import wall_clock

    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    with open(path) as f:
        return [{k: v for k, v in json.loads(line).items() if not wall_clock(k)} for line in f]


def key_orders(out) -> list[list[str]]:
    """Each metrics line's keys in the order written (a resume rewrites the lines up to its step)."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [list(json.loads(x)) for x in f]


def ckpt_state(out) -> tuple[int | None, list[int], list[int]]:
    """(tracker's step or None, step dirs, step dirs with a COMPLETE marker) under ``out``/checkpoints."""
    root = os.path.join(out, "checkpoints")
    path = os.path.join(root, TRACKER)
    tracker = int(open(path).read().strip()) if os.path.exists(path) else None
    steps = sorted(int(d.split("_")[-1]) for d in os.listdir(root) if d.startswith("global_step_"))
    marked = [s for s in steps if os.path.isfile(os.path.join(root, f"global_step_{s}", "COMPLETE"))]
    return tracker, steps, marked


def straight_run(out) -> str:
    """The uninterrupted 10-step run into ``out`` (with the progress bar: its output, in
    ``<out>.run10.log``, is also what test_job.py shows a user sees), checked: exit 0, 10 metrics
    lines, the checkpoint root logged as shared, retention kept steps 8 and 10 (sync saves).
    Returns ``out``."""
    done = run_job(out, 10, extra=("progress_bar=true",))
    assert done.returncode == 0, done.stdout[-3000:]
    assert "shared by all 1 node(s)" in done.stdout, done.stdout[-3000:]  # the storage mode is logged
    assert [m["step"] for m in metric_lines(out)] == list(range(10))
    assert ckpt_state(out) == (10, [8, 10], [8, 10])  # max_ckpt_to_keep=2
    return str(out)
