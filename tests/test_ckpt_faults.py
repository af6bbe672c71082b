"""The main job through torchrun (launch/run.sh): a run of 4 steps straight equals 2 steps then
the same command with steps=4 (continues from the checkpoint; metrics.jsonl lines identical but
for time_s) -- with a kill -9 of rank 0 at the 'marker' phase in between (the torn step is
skipped, the tracker still names step 2) and, after, at the 'tracker' phase (the marker-complete
step counts, the tracker still names the one before)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from mcore_rl.checkpoint.faults import ENV, RANK_ENV
from tests.test_job import ROOT

TRACKER = "latest_checkpointed_iteration.txt"


def _job(out, steps: int, fault: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"],
           "PYTHONPATH": ROOT}
    env.pop(ENV, None)
    if fault:
        env.update({ENV: fault, RANK_ENV: "0"})
    cmd = ["bash", "launch/run.sh", "2", "configs/grpo_demo.yaml", f"steps={steps}", f"output_dir={out}",
           "progress_bar=false", "checkpoint.save_freq=2", "actor_optim.total_steps=8",
           "rollout.prompts_per_step=4", "actor.micro_batch_size=16", "actor.ppo_mini_batch_size=16"]
    # files, not pipes, and a session of its own: a SIGKILLed rank leaves megatron's writer-queue
    # manager process behind (it would hold pipes open); the group is killed after the run
    with open(out.parent / f"{out.name}.log", "w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=300)
        finally:
            time.sleep(1)  # let late children join the group before it is killed
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.seek(0)
        return subprocess.CompletedProcess(cmd, code, log.read(), "")


def _lines(out) -> list[dict]:
    lines = [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl"))]
    return [{k: v for k, v in m.items() if k != "time_s"} for m in lines]


def _state(out) -> tuple[str, list[str]]:
    root = os.path.join(out, "checkpoints")
    tracker = open(os.path.join(root, TRACKER)).read().strip()
    steps = sorted(d for d in os.listdir(root) if d.startswith("global_step_"))
    marked = [d for d in steps if os.path.isfile(os.path.join(root, d, "COMPLETE"))]
    return tracker, steps, marked


def test_job_resumes_through_kills(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    done = _job(straight, 4)
    assert done.returncode == 0, done.stdout[-3000:]
    done = _job(resumed, 2)
    assert done.returncode == 0, done.stdout[-3000:]
    assert _state(resumed) == ("2", ["global_step_2"], ["global_step_2"])

    killed = _job(resumed, 4, fault="marker")  # rank 0 dies after every rank's files, before the marker
    assert killed.returncode != 0
    assert _state(resumed) == ("2", ["global_step_2", "global_step_4"], ["global_step_2"])
    assert len(_lines(resumed)) == 4  # steps 3 and 4 were logged before the kill

    done = _job(resumed, 4)  # the same command: continues from step 2, cuts metrics.jsonl there
    assert done.returncode == 0, done.stdout[-3000:]
    assert "resumed from step 2" in done.stdout
    assert _lines(resumed) == _lines(straight)
    assert _state(resumed) == ("4", ["global_step_2", "global_step_4"], ["global_step_2", "global_step_4"])

    killed = _job(resumed, 6, fault="tracker")  # marker written, tracker not yet
    assert killed.returncode != 0
    tracker, _, marked = _state(resumed)
    assert tracker == "4" and marked == ["global_step_2", "global_step_4", "global_step_6"]
