"""Checkpoint crash soak: the main job (launch/run.sh, tiny GRPO demo, TP=2 on 2 processes,
save_freq=1, max_ckpt_to_keep=2) is SIGKILLed >= N times at random moments -- the whole job
(torchrun and every descendant at once) or one rank -- and rerun with the same command.

After every kill: the tracker is absent or names a complete step; every complete step is whole
(files as the marker lists them, every torch_dist tensor and object readable in one process,
metadata through the restricted unpickler); no complete step vanished unless retention was due
(``keep`` newer complete steps exist); no process of the killed run is left (checked by a tag in
the environment every descendant inherits, so re-parented orphans are found too). The next run
must say it resumed from the newest complete step. A final uninterrupted rerun must finish with
metrics.jsonl equal to a straight run's (but for time_s). Prints the figures; exit code 1 on any
failure.

    PYTHONPATH=$PWD python benchmarks/ckpt_fault_soak.py --kills 20 --out /tmp/soak
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TAG_ENV = "MCORE_RL_SOAK_TAG"
TRACKER = "latest_checkpointed_iteration.txt"


def command(out: str, steps: int, keep: int) -> list[str]:
    return ["bash", "launch/run.sh", "2", "configs/grpo_demo.yaml", f"steps={steps}", f"output_dir={out}",
            "progress_bar=false", "checkpoint.save_freq=1", f"checkpoint.max_ckpt_to_keep={keep}",
            f"actor_optim.total_steps={steps}", "rollout.prompts_per_step=4",
            "actor.micro_batch_size=16", "actor.ppo_mini_batch_size=16"]


def tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment carries ``TAG_ENV=tag`` (any parent)."""
    found, needle = [], f"{TAG_ENV}={tag}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{name}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env and state != "Z":
            found.append(int(name))
    return found


def cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(f"{pid}: " + open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:120])
        except OSError:
            pass
    return out


def workers(tag: str, torchrun_pid: int) -> list[int]:
    """The ranks: tagged processes running launch/train.py (not torchrun, not helpers)."""
    return [p for p in tagged(tag) if p != torchrun_pid and any("launch/train.py" in c for c in cmdlines([p]))
            and "multiprocessing" not in " ".join(cmdlines([p]))]


def start(out: str, steps: int, keep: int, log_path: str) -> tuple[subprocess.Popen, str, object]:
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": ROOT, TAG_ENV: tag,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    env.pop("MCORE_RL_CKPT_FAULT", None)
    log = open(log_path, "w+")
    proc = subprocess.Popen(command(out, steps, keep), cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    return proc, tag, log


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def state(out: str) -> tuple[int | None, list[int], list[int]]:
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return None, [], []
    path = os.path.join(root, TRACKER)
    text = open(path).read().strip() if os.path.exists(path) else None
    tracker = int(text) if text is not None and text.isdigit() else (-1 if text is not None else None)
    dirs = sorted(int(d.split("_")[-1]) for d in os.listdir(root) if d.startswith("global_step_"))
    marked = [s for s in dirs if os.path.isfile(os.path.join(root, f"global_step_{s}", "COMPLETE"))]
    return tracker, dirs, marked


def phase_of(out: str, before: tuple, after: tuple, keep: int, text: str) -> str:
    """Where the kill landed, read from the log (resumed yet?) and what is on disk (the newest
    step dir, tracker, retention)."""
    tracker, dirs, marked = after
    if (before[2] and "resumed from" not in text) or after == before:
        return "startup"
    new = [s for s in dirs if s not in before[1] or s not in before[2]]
    torn = [s for s in dirs if s not in marked]
    if torn and max(torn) >= max(marked, default=0):
        d = os.path.join(out, "checkpoints", f"global_step_{max(torn)}", "actor", "dist_ckpt")
        names = os.listdir(d) if os.path.isdir(d) else []
        if ".metadata" in names:
            return "after-metadata/before-marker"
        return "shards" if any(n.endswith(".distcp") for n in names) else "before-shards"
    if marked and tracker is not None and tracker < marked[-1]:
        return "marker-before-tracker"
    if len(marked) > keep:
        return "retention"
    return "between-saves" if new else "startup"


def check_step(step_dir: str) -> str | None:
    """None when the complete step is whole: marker's files with their sizes, torch_dist readable."""
    import torch  # noqa: F401  (heavy: only in the checks)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from mcore_rl.checkpoint.safe_load import restricted_unpickling

    marker = json.load(open(os.path.join(step_dir, "COMPLETE")))
    for rel, size in marker["files"].items():
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            return f"{path}: marker says {size} bytes, found {os.path.getsize(path) if os.path.isfile(path) else 'none'}"
    for role in marker["roles"]:
        with restricted_unpickling():
            loaded = _load_state_dict_from_keys(checkpoint_id=os.path.join(step_dir, role, "dist_ckpt"))
        if not loaded:
            return f"{step_dir}/{role}: torch_dist checkpoint read back empty"
    return None


def check_after_kill(out: str, before: tuple, after: tuple, keep: int) -> list[str]:
    tracker, _, marked = after
    bad = []
    if tracker is not None and tracker not in marked:
        bad.append(f"tracker names {tracker}, complete steps {marked}")
    for s in before[2]:
        if s not in marked and sum(m > s for m in marked) < keep:
            bad.append(f"complete step {s} deleted with only {sum(m > s for m in marked)} newer complete")
    for s in marked:
        problem = check_step(os.path.join(out, "checkpoints", f"global_step_{s}"))
        if problem:
            bad.append(problem)
    return bad


def one_kill(out: str, i: int, args, rng: random.Random) -> tuple[dict, list[str]]:
    before = state(out)
    mode = rng.choice(["job", "rank0", "rank1"])
    delay = rng.uniform(args.min_delay, args.max_delay)
    proc, tag, log = start(out, args.steps, args.keep, os.path.join(args.out, f"kill{i:02d}.log"))
    t0, killed = time.time(), False
    while time.time() - t0 < delay and proc.poll() is None:
        time.sleep(0.05)
    if proc.poll() is None:
        ranks = sorted(workers(tag, proc.pid))
        if mode == "job" or len(ranks) < 2:
            kill_all([proc.pid, *tagged(tag)])  # torchrun and every descendant at once
        else:
            kill_all([ranks[int(mode[-1])]])
        killed = True
    try:
        proc.wait(timeout=120)  # after a rank kill torchrun tears the other rank down itself
    except subprocess.TimeoutExpired:
        kill_all([proc.pid])
        proc.wait()
    time.sleep(2)  # orphans of the killed rank would still be here
    left = tagged(tag)
    log.seek(0)
    text = log.read()
    log.close()
    kill_all(left)  # leftovers are reported, then removed so they cannot touch the next run
    after = state(out)
    row = {"i": i, "mode": mode, "delay_s": round(delay, 1), "killed": killed, "rc": proc.returncode,
           "resumed_from": _resumed_from(text), "phase": phase_of(out, before, after, args.keep, text) if killed
           else "finished", "left": cmdlines(left)}
    bad = check_after_kill(out, before, after, args.keep)
    newest = before[2][-1] if before[2] else None
    if (row["resumed_from"] is not None or not killed) and row["resumed_from"] != newest:
        bad.append(f"run {i} resumed from {row['resumed_from']}, newest complete step was {newest}")
    writers = [c for c in row["left"] if _is_writer(c)]
    if writers:  # a rank or one of its forked shard writers still running after the kill
        bad.append(f"run {i}: {len(writers)} rank/writer process(es) left after the kill: {writers}")
    return row, bad


def _is_writer(cmdline: str) -> bool:
    """A rank, torchrun, or a shard writer forked by a rank (forks keep the rank's command line)."""
    return "launch/train.py" in cmdline or "torchrun" in cmdline


def _resumed_from(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("resumed from step "):
            return int(line.split()[3])
    return None


def lines(out: str) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k != "time_s"} for x in open(os.path.join(out, "metrics.jsonl"))]


def finish(out: str, args, log_name: str) -> tuple[int, str, list[str]]:
    proc, tag, log = start(out, args.steps, args.keep, os.path.join(args.out, log_name))
    proc.wait()
    time.sleep(1)
    left = tagged(tag)
    kill_all(left)
    log.seek(0)
    text = log.read()
    log.close()
    return proc.returncode, text, cmdlines(left)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=40, help="the run's total steps (high: kills land before the end)")
    p.add_argument("--keep", type=int, default=2, help="checkpoint.max_ckpt_to_keep")
    p.add_argument("--min-delay", type=float, default=6.0)
    p.add_argument("--max-delay", type=float, default=30.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/ckpt_fault_soak")
    args = p.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    out, rng, t0 = os.path.join(args.out, "job"), random.Random(args.seed), time.time()
    rows, failures, i = [], [], 0
    while sum(r["killed"] for r in rows) < args.kills and i < 3 * args.kills:
        row, bad = one_kill(out, i, args, rng)
        rows.append(row)
        failures += bad
        print(json.dumps(row), *(f"  FAIL {b}" for b in bad), sep="\n", flush=True)
        i += 1
        if row["phase"] == "finished":  # the run got to the end before the kill: start over
            shutil.rmtree(out)
    code, text, left = finish(out, args, "final.log")
    if code != 0 or left:
        failures.append(f"final rerun: exit {code}, left {left}\n{text[-2000:]}")
    code, _, left = finish(os.path.join(args.out, "straight"), args, "straight.log")
    if code != 0 or left:
        failures.append(f"straight run: exit {code}, left {left}")
    elif lines(out) != lines(os.path.join(args.out, "straight")):
        failures.append("final metrics.jsonl differs from the straight run's")
    killed = [r for r in rows if r["killed"]]
    left_all = [c for r in rows for c in r["left"]]
    figures = {"kills": len(killed), "by_mode": dict(Counter(r["mode"] for r in killed)),
               "phases": dict(Counter(r["phase"] for r in killed)),
               "resumes": sum(r["resumed_from"] is not None for r in rows) + ("resumed from" in text),
               "runs_finished_before_kill": len(rows) - len(killed),
               "writers_left_after_kills": sum(map(_is_writer, left_all)),
               # megatron's spawned results-queue Manager (+ resource tracker) of a SIGKILLed rank:
               # idle, it never exits by itself; reported here and reaped by this script
               "other_processes_left_after_kills": sum(not _is_writer(c) for c in left_all),
               "final_state": state(out), "failures": len(failures), "seconds": round(time.time() - t0)}
    print("FIGURES " + json.dumps(figures))
    for f in failures:
        print("FAILURE", f)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
