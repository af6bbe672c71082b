"""The main job through torchrun (launch/run.sh) killed with SIGKILL at every save phase
(MCORE_RL_CKPT_FAULT=shards|metadata|marker|swap|tracker|retention, one rank via
MCORE_RL_CKPT_FAULT_RANK, the n-th save via MCORE_RL_CKPT_FAULT_AT), saving every 2 steps with
max_ckpt_to_keep=2. After every kill the tracker names a complete step, no complete step is gone
(a replaced step sits beside its root until the next start finishes the swap), and the next run
of the same command resumes from the step the tracker names; every run's metrics.jsonl equals the
prefix of one uninterrupted 10-step run (``straight_job``, tests/job_runs.py; lines identical but
for the wall-clock metrics, keys in the order written). One shared sequence of runs keeps the suite small: each kill run is itself
the resume check of the kill before it, and the first and last runs save asynchronously (the
first run's step 2, saved while steps 2-3 train, is the step the next two runs resume from)."""
from __future__ import annotations

import os

from tests.job_runs import ckpt_state, key_orders, metric_lines, run_job


def _killed(out, steps: int, fault: str, rank: int, before: list[int], straight: list[dict], at: int | None = None,
            extra: tuple[str, ...] = ()):
    """Runs with the fault, checks the run died at it (after resuming and training like the
    straight run) and that no complete step was lost; returns the state after the kill."""
    run = run_job(out, steps, fault, rank, at, extra)
    assert run.returncode != 0, f"{fault}: the run was not killed\n{run.stdout[-3000:]}"
    assert "exitcode  : -9" in run.stdout or "Signal 9" in run.stdout, run.stdout[-3000:]
    tracker, dirs, marked = ckpt_state(out)
    assert tracker in marked, f"{fault}: tracker names {tracker}, complete steps {marked}"
    assert set(before) <= set(marked), f"{fault}: complete steps {before} -> {marked}"
    assert metric_lines(out) == straight[:steps], f"{fault}: metrics differ from the straight run"
    return tracker, dirs, marked


def _side_dirs(out) -> list[str]:
    root = os.path.join(out, "checkpoints")
    return sorted(d for d in os.listdir(root) if d.startswith(".global_step_"))


ASYNC = ("checkpoint.async_save=true",)


def test_job_resumes_through_kills(straight_job, tmp_path):
    out = tmp_path / "resumed"
    reference = metric_lines(straight_job)  # the uninterrupted 10-step run (tests/job_runs.py)

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
    done = run_job(out, 10, extra=ASYNC)
    assert done.returncode == 0, done.stdout[-3000:]
    assert "resumed from step 6" in done.stdout
    assert metric_lines(out) == reference
    assert key_orders(out) == key_orders(straight_job)  # rewritten lines keep their key order
    assert ckpt_state(out) == (10, [8, 10], [8, 10])  # retention caught up: max_ckpt_to_keep=2
    assert _side_dirs(out) == []
