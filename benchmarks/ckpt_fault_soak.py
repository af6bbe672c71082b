"""Checkpoint crash soak: the main job (launch/run.sh, tiny GRPO demo, TP=2 on 2 processes,
save_freq=1, max_ckpt_to_keep=2; ``--async``: checkpoint.async_save=true) is SIGKILLed >= N
times -- the whole job (torchrun and every descendant at once) or one rank -- and rerun with the
same command.

Kill moments: most are scaled to the run (once it has written two metrics lines after its
start-up, their spacing is the step period, training plus save; the kill falls uniformly within
the next ``--window`` periods, so kills land in the save phases as well as in training); a
``--random-fraction`` of them fall at a random moment from the process start, start-up included.
Each kill's phase is read from disk afterwards (start-up, before-shards, shards-writing,
shards-written-no-metadata -- with async, the step in flight whose finalize waits for the next
save --, metadata-no-marker, marker-no-tracker, retention-or-debris, between-saves).

After every kill: the tracker is absent or names a complete step; every complete step is whole
(files as the marker lists them, every torch_dist tensor and object readable in one process,
metadata through the restricted unpickler); no complete step vanished unless retention was due
(``keep`` newer complete steps exist); no torchrun, rank or forked async shard writer of the
killed run is left (found by a tag in the environment every descendant inherits, so re-parented
orphans are found too; a writer is a process forked by a rank: it keeps the rank's command line
and environment). The next run must say it resumed from the step the tracker names when it is
complete, else the step completed last (a replacement cut short between its renames counts:
the next start finishes it). A final
uninterrupted rerun must finish with metrics.jsonl equal to a straight run's (but for time_s).
Prints the figures; exit code 1 on any failure.

    PYTHONPATH=$PWD python benchmarks/ckpt_fault_soak.py --kills 20 --out /tmp/soak [--async]
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


def command(out: str, steps: int, keep: int, async_save: bool) -> list[str]:
    return ["bash", "launch/run.sh", "2", "configs/grpo_demo.yaml", f"steps={steps}", f"output_dir={out}",
            "progress_bar=false", "checkpoint.save_freq=1", f"checkpoint.max_ckpt_to_keep={keep}",
            f"checkpoint.async_save={'true' if async_save else 'false'}",
            f"actor_optim.total_steps={steps}", "rollout.prompts_per_step=4",
            "actor.micro_batch_size=16", "actor.ppo_mini_batch_size=16"]


def _read_proc(pid: int) -> tuple[bytes, list[bytes], str, int] | None:
    """(cmdline, environ entries, state, ppid) of a live process, or None."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ")
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read().split(b"\0")
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return cmd, env, fields[0], int(fields[1])


def tagged(tag: str) -> list[int]:
    """Pids of live processes whose environment carries ``TAG_ENV=tag`` (any parent)."""
    found, needle = [], f"{TAG_ENV}={tag}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        info = _read_proc(int(name))
        if info is not None and needle in info[1] and info[2] != "Z":
            found.append(int(name))
    return found


def cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        info = _read_proc(pid)
        if info is not None:
            out.append(f"{pid}: " + info[0].decode(errors="replace")[:120])
    return out


def roles(tag: str, torchrun_pid: int) -> dict[int, str]:
    """The run's process tree by role: ``torchrun``; ``rank<R>`` (torchrun's children running
    launch/train.py, R from their RANK env); ``writer<R>`` (a process forked by rank R: the async
    shard writer keeps the rank's command line and environment); ``helper`` (anything else, e.g.
    megatron's spawned results-queue Manager)."""
    infos = {p: _read_proc(p) for p in tagged(tag)}
    infos = {p: i for p, i in infos.items() if i is not None}
    ranks = {p for p, (cmd, _, _, ppid) in infos.items() if ppid == torchrun_pid and b"launch/train.py" in cmd}
    out = {}
    for p, (cmd, env, _, ppid) in infos.items():
        rank = next((e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"RANK=")), "?")
        if p == torchrun_pid:
            out[p] = "torchrun"
        elif p in ranks:
            out[p] = f"rank{rank}"
        elif ppid in ranks and b"launch/train.py" in cmd:
            out[p] = f"writer{rank}"
        else:
            out[p] = "helper"
    return out


def start(out: str, args, log_path: str) -> tuple[subprocess.Popen, str, object]:
    tag = uuid.uuid4().hex
    env = {**os.environ, "PYTHONPATH": ROOT, TAG_ENV: tag,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    env.pop("MCORE_RL_CKPT_FAULT", None)
    log = open(log_path, "w+")
    # run.sh execs torchrun: proc.pid is torchrun's pid
    proc = subprocess.Popen(command(out, args.steps, args.keep, args.async_save), cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, tag, log


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _order(step_dir: str, step: int) -> tuple[int, int] | None:
    """Completion order of a step dir with a valid marker (recorded order after unrecorded ones)."""
    try:
        marker = json.load(open(os.path.join(step_dir, "COMPLETE")))
    except (OSError, ValueError):
        return None
    return (1, marker["completed"]) if marker.get("completed") is not None else (0, step)


def complete_steps(root: str) -> dict[int, tuple[int, int]]:
    """step -> completion order of every complete step, counting a replacement a kill cut short
    between its renames (``.global_step_N.incoming``/``.outgoing`` while ``global_step_N`` is
    missing): the next start finishes it, so such a step is not lost."""
    found = {}
    names = sorted(os.listdir(root)) if os.path.isdir(root) else []
    for name in names:
        if name.startswith("global_step_") and not os.path.islink(os.path.join(root, name)):
            step = int(name.split("_")[-1])
            order = _order(os.path.join(root, name), step)
            if order is not None:
                found[step] = order
    for kind in ("incoming", "outgoing"):  # an incoming copy with a marker wins the name
        for name in names:
            if name.startswith(".global_step_") and name.endswith("." + kind):
                step = int(name.split(".")[1].split("_")[-1])
                order = _order(os.path.join(root, name), step)
                if step not in found and not os.path.isdir(os.path.join(root, f"global_step_{step}")) and order:
                    found[step] = order
    return found


def state(out: str) -> tuple[int | None, list[int], list[int]]:
    """(tracker, step dirs, complete steps incl. a replacement cut short)."""
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return None, [], []
    path = os.path.join(root, TRACKER)
    text = open(path).read().strip() if os.path.exists(path) else None
    tracker = int(text) if text is not None and text.isdigit() else (-1 if text is not None else None)
    dirs = sorted(int(d.split("_")[-1]) for d in os.listdir(root) if d.startswith("global_step_"))
    return tracker, dirs, sorted(complete_steps(root))


def expected_resume(out: str) -> int | None:
    """The step ``auto`` must resume: the tracked one when complete, else the one completed last."""
    root = os.path.join(out, "checkpoints")
    found = complete_steps(root)
    tracker = state(out)[0]
    if tracker in found:
        return tracker
    return max(found, key=found.get) if found else None


def metrics_lines(out: str, since: float) -> int | None:
    """Lines of metrics.jsonl once this run has rewritten it (rank 0 does so right after resume:
    mtime >= ``since``), else None (still in start-up). stat before read: a rewrite between the
    two then shows as an old mtime, never as old content under a new mtime."""
    path = os.path.join(out, "metrics.jsonl")
    try:
        if os.stat(path).st_mtime < since:
            return None
        with open(path, "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return None


def wait_lines(out: str, since: float, n: int, proc: subprocess.Popen, timeout: float) -> float | None:
    """Waits until metrics.jsonl (rewritten by this run) holds ``n`` lines; returns the moment
    seen, or None if the run ended or ``timeout`` passed."""
    t0 = time.time()
    while proc.poll() is None and time.time() - t0 < timeout:
        count = metrics_lines(out, since)
        if count is not None and count >= n:
            return time.time()
        time.sleep(0.02)
    return None


def shard_sizes(out: str, marked: list[int]) -> dict[str, int]:
    """Sizes of the actor's shard files in the newest complete step (as its marker lists them)."""
    if not marked:
        return {}
    path = os.path.join(out, "checkpoints", f"global_step_{marked[-1]}", "COMPLETE")
    if not os.path.isfile(path):  # a replacement cut short: its sizes are not at the usual place
        return {}
    marker = json.load(open(path))
    prefix = os.path.join("actor", "dist_ckpt", "")
    return {k[len(prefix):]: _size(v) for k, v in marker["files"].items() if k.startswith(prefix) and k.endswith(".distcp")}


def _size(entry) -> int:
    return entry if isinstance(entry, int) else entry["size"]  # markers before / after checksums


def phase_of(out: str, after: tuple, keep: int, started: bool, ref: dict[str, int]) -> str:
    """Where the kill landed, read from what this run left (start-up = metrics.jsonl not yet
    rewritten by it) and what is on disk for the newest step. ``ref``: shard file sizes of a
    complete step (the same model and optimizer: the same sizes), to tell a shard file being
    written from a written one. Async: the step in flight has shard files, no ``.metadata``
    until the next save's ``wait()`` finalizes it; training goes on meanwhile."""
    if not started:
        return "startup"
    tracker, dirs, marked = after
    torn = [s for s in dirs if s not in marked]
    if torn and max(torn) > max(marked, default=-1):
        d = os.path.join(out, "checkpoints", f"global_step_{max(torn)}", "actor", "dist_ckpt")
        names = os.listdir(d) if os.path.isdir(d) else []
        if ".metadata" in names:
            return "metadata-no-marker"
        shards = {n: os.path.getsize(os.path.join(d, n)) for n in names if n.endswith(".distcp")}
        if not shards:
            return "before-shards"
        if not ref:
            return "shards-unknown-size"
        whole = set(shards) == set(ref) and all(shards[n] >= ref[n] for n in ref)
        return "shards-written-no-metadata" if whole else "shards-writing"
    side = [d for d in os.listdir(os.path.join(out, "checkpoints")) if d.startswith(".global_step_")]
    if side:
        return "replacing"
    if marked and (tracker is None or tracker < marked[-1]):
        return "marker-no-tracker"
    if len(marked) > keep or any(s < max(marked, default=-1) for s in torn):
        return "retention-or-debris"
    return "between-saves"


def check_step(step_dir: str) -> str | None:
    """None when the complete step is whole: marker's files with their sizes, torch_dist readable."""
    import torch  # noqa: F401  (heavy: only in the checks)
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from mcore_rl.fileio.safe_load import restricted_unpickling

    if not os.path.isfile(os.path.join(step_dir, "COMPLETE")):
        return None  # a replacement cut short between its renames: finished by the next start
    marker = json.load(open(os.path.join(step_dir, "COMPLETE")))
    for rel, entry in marker["files"].items():
        path, size = os.path.join(step_dir, rel), _size(entry)
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


def kill_moment(out: str, t0: float, resume_step: int, proc: subprocess.Popen, args,
                rng: random.Random, scaled: bool) -> tuple[float | None, float | None]:
    """(when to kill, measured step period). Scaled: once this run has written two new metrics
    lines (past start-up and its first step), the step period is their spacing (training plus
    the save: save_freq=1), and the kill falls uniformly within the next ``window`` periods.
    Otherwise a uniformly random moment from the process start, start-up included. None: the
    run ended first."""
    if not scaled:
        return t0 + rng.uniform(0.0, args.max_delay), None
    t1 = wait_lines(out, t0, resume_step + 1, proc, args.timeout)
    t2 = wait_lines(out, t0, resume_step + 2, proc, args.timeout) if t1 is not None else None
    if t2 is None:
        return None, None
    period = t2 - t1
    return t2 + rng.uniform(0.0, args.window * period), period


def one_kill(out: str, i: int, args, rng: random.Random, ref: dict[str, int]) -> tuple[dict, list[str]]:
    before, expected = state(out), expected_resume(out)
    mode = rng.choice(["job", "rank0", "rank1"])
    scaled = rng.random() >= args.random_fraction
    proc, tag, log = start(out, args, os.path.join(args.out, f"kill{i:02d}.log"))
    t0 = time.time()
    at, period = kill_moment(out, t0, before[2][-1] if before[2] else 0, proc, args, rng, scaled)
    while at is not None and time.time() < at and proc.poll() is None:
        time.sleep(0.01)
    killed, tree = False, {}
    if at is not None and proc.poll() is None:
        tree = roles(tag, proc.pid)
        ranks = {r: p for p, r in tree.items() if r.startswith("rank")}
        if mode != "job" and mode not in ranks:
            mode = "job"  # start-up: the ranks are not there yet
        kill_all([proc.pid, *tagged(tag)] if mode == "job" else [ranks[mode]])  # whole job: all at once
        killed = True
    started = metrics_lines(out, t0) is not None
    try:
        proc.wait(timeout=120)  # after a rank kill torchrun tears the other rank down itself
    except subprocess.TimeoutExpired:
        kill_all([proc.pid])
        proc.wait()
    time.sleep(2)  # orphans of the killed rank would still be here
    left = tagged(tag)
    left_roles = {p: tree.get(p, "new:" + _role_of_cmdline(c)) for p, c in zip(left, cmdlines(left))}
    log.seek(0)
    text = log.read()
    log.close()
    kill_all(left)  # leftovers are reported, then removed so they cannot touch the next run
    after = state(out)
    row = {"i": i, "mode": mode, "moment": "scaled" if scaled else "random", "at_s": round((at or t0) - t0, 1),
           "period_s": round(period, 2) if period else None, "killed": killed, "rc": proc.returncode,
           "resumed_from": _resumed_from(text),
           "phase": phase_of(out, after, args.keep, started, ref) if killed else "finished",
           "writers_at_kill": sorted(r for r in tree.values() if r.startswith("writer")),
           "left": [f"{left_roles[p]} {c}" for p, c in zip(left, cmdlines(left))]}
    bad = check_after_kill(out, before, after, args.keep)
    if (row["resumed_from"] is not None or not killed) and row["resumed_from"] != expected:
        bad.append(f"run {i} resumed from {row['resumed_from']}, the tracked (or last completed) step was {expected}")
    if not killed and proc.returncode != 0:
        bad.append(f"run {i} exited {proc.returncode} without being killed:\n{text[-3000:]}")
    stray = [f"{r} {p}" for p, r in left_roles.items() if _is_writer(r)]
    if stray:  # torchrun, a rank or one of its forked shard writers still running after the kill
        bad.append(f"run {i}: {len(stray)} torchrun/rank/writer process(es) left after the kill: {row['left']}")
    ref.update(shard_sizes(out, after[2]))
    return row, bad


def _role_of_cmdline(cmdline: str) -> str:
    """Role of a process first seen after the kill snapshot (by command line)."""
    return "train.py" if "launch/train.py" in cmdline else "helper"


def _is_writer(role: str) -> bool:
    """torchrun, a rank, or a shard writer forked by a rank (also one born after the snapshot)."""
    return role.split(":")[-1] != "helper"


def _resumed_from(text: str) -> int | None:
    for line in text.splitlines():
        if line.startswith("resumed from step "):
            return int(line.split()[3])
    return None


def lines(out: str) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if k != "time_s"} for x in open(os.path.join(out, "metrics.jsonl"))]


def finish(out: str, args, log_name: str) -> tuple[int, str, list[str]]:
    proc, tag, log = start(out, args, os.path.join(args.out, log_name))
    proc.wait()
    time.sleep(1)
    left = tagged(tag)
    kill_all(left)
    log.seek(0)
    text = log.read()
    log.close()
    return proc.returncode, text, cmdlines(left)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--steps", type=int, default=40, help="the run's total steps (high: kills land before the end)")
    p.add_argument("--keep", type=int, default=2, help="checkpoint.max_ckpt_to_keep")
    p.add_argument("--async", dest="async_save", action="store_true", help="checkpoint.async_save=true")
    p.add_argument("--random-fraction", type=float, default=0.15,
                   help="share of kills at a random moment from the process start (start-up included)")
    p.add_argument("--max-delay", type=float, default=30.0, help="random kills: latest moment (s)")
    p.add_argument("--window", type=float, default=2.5, help="scaled kills: within this many step periods")
    p.add_argument("--timeout", type=float, default=300.0, help="longest wait for one metrics line (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/ckpt_fault_soak")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    out, rng, t0 = os.path.join(args.out, "job"), random.Random(args.seed), time.time()
    rows, failures, i, ref = [], [], 0, {}
    while sum(r["killed"] for r in rows) < args.kills and i < 3 * args.kills:
        row, bad = one_kill(out, i, args, rng, ref)
        rows.append(row)
        failures += bad
        print(json.dumps(row), *(f"  FAIL {b}" for b in bad), sep="\n", flush=True)
        i += 1
        if row["phase"] == "finished":  # the run got to the end before the kill: start over
            shutil.rmtree(out)
    code, text, left = finish(out, args, "final.log")
    if code != 0 or left:
        failures.append(f"final rerun: exit {code}, left {left}\n{text[-2000:]}")
    code, _, left_straight = finish(os.path.join(args.out, "straight"), args, "straight.log")
    if code != 0 or left_straight:
        failures.append(f"straight run: exit {code}, left {left_straight}")
    elif lines(out) != lines(os.path.join(args.out, "straight")):
        failures.append("final metrics.jsonl differs from the straight run's")
    print("FIGURES " + json.dumps(figures(args, rows, text, out, failures, t0)))
    for f in failures:
        print("FAILURE", f)
    return 1 if failures else 0


def figures(args, rows: list[dict], final_text: str, out: str, failures: list[str], t0: float) -> dict:
    killed = [r for r in rows if r["killed"]]
    left_all = [c for r in rows for c in r["left"]]
    periods = sorted(r["period_s"] for r in killed if r["period_s"])
    return {"async_save": args.async_save, "kills": len(killed), "by_mode": dict(Counter(r["mode"] for r in killed)),
            "by_moment": dict(Counter(r["moment"] for r in killed)),
            "phases": dict(Counter(r["phase"] for r in killed)),
            "step_period_s_median": periods[len(periods) // 2] if periods else None,
            "kills_with_writer_alive": sum(bool(r["writers_at_kill"]) for r in killed),
            "resumes": sum(r["resumed_from"] is not None for r in rows) + ("resumed from" in final_text),
            "runs_finished_before_kill": len(rows) - len(killed),
            "writers_left_after_kills": sum(_is_writer(c.split()[0]) for c in left_all),
            # megatron's spawned results-queue Manager (+ resource tracker) of a SIGKILLed rank:
            # idle, it never exits by itself; reported here and reaped by this script
            "other_processes_left_after_kills": sum(not _is_writer(c.split()[0]) for c in left_all),
            "final_state": state(out), "failures": len(failures), "seconds": round(time.time() - t0)}


if __name__ == "__main__":
    sys.exit(main())
