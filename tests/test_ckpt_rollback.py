"""Rollbacks and restarts into a used root never lose the new steps, and ``auto`` resumes them.

- ``resume_mode: path`` to an earlier step, then saves: the just-written step survives retention
  (completion order, not step numbers), a step number of the abandoned branch is replaced
  atomically (its new content, not refused), and ``auto`` resumes the new branch.
- ``resume_mode: disable`` into a root holding a later branch: the same.
- The tracker is authoritative: it names a missing or torn step -> the step completed last, with
  a warning naming both; no tracker -> the step completed last; garbage in the tracker (text,
  bytes, huge and negative numbers, non-ASCII digits) is a clear error that changes nothing.
"""
from __future__ import annotations

import logging
import os
import shutil

import torch

from tests.ckpt_bodies import build_engine, hf_dir_for, manager
from tests.dist import run_ranks

CONTENTS = dict(save_contents=("model",), load_contents=("model",))


class _Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _bump(engine, value: float) -> None:
    """Marks the weights: every parameter set to ``value`` (each save holds distinct weights)."""
    with torch.no_grad():
        for p in engine.model[0].parameters():
            p.fill_(value)


def _weight(engine) -> float:
    return float(next(engine.model[0].parameters()).flatten()[0])


def _steps(root: str) -> list[str]:
    return sorted(d for d in os.listdir(root) if "global_step_" in d)


def _rollbacks(hf_dir: str, base: str) -> dict:
    engine, _ = build_engine(hf_dir, {}, "actor", False, seed=1)
    logged = _Logged()
    logging.getLogger("mcore_rl").addHandler(logged)
    out: dict = {}
    # branch A: steps 2..10, all kept, tracker 10
    root = os.path.join(base, "path")
    for step in (2, 4, 6, 8, 10):
        _bump(engine, step)
        manager(root, **CONTENTS).save(step, {"actor": engine}, {"branch": "A", "step": step})
    back = manager(root, max_ckpt_to_keep=2, resume_mode="path", resume_path=os.path.join(root, "global_step_6"),
                   **CONTENTS)
    out["rolled_back_to"] = back.resume({"actor": engine})
    _bump(engine, 107)
    back.save(7, {"actor": engine}, {"branch": "B", "step": 7})  # two complete steps numbered above it
    out["after_7"] = (back.complete_steps(), _steps(root))
    out["auto_after_7"] = manager(root, **CONTENTS).resume({"actor": engine})
    _bump(engine, 110)
    back.save(10, {"actor": engine}, {"branch": "B", "step": 10})  # exists complete in branch A
    out["after_10"] = (back.complete_steps(), _steps(root))
    _bump(engine, 0)
    out["auto_after_10"] = manager(root, **CONTENTS).resume({"actor": engine})
    out["weight_after_10"] = _weight(engine)  # the replaced step holds branch B's weights

    # a fresh run (resume_mode disable) into a root holding branch A's steps 8 and 10
    used = os.path.join(base, "disable")
    shutil.copytree(os.path.join(base, "template"), used)
    fresh = manager(used, max_ckpt_to_keep=2, resume_mode="disable", **CONTENTS)
    out["disable_resume"] = fresh.resume({"actor": engine})
    for step in (2, 4):
        _bump(engine, 200 + step)
        fresh.save(step, {"actor": engine}, {"branch": "C", "step": step})
        out[f"disable_after_{step}"] = (fresh.complete_steps(), _steps(used))
        out[f"disable_auto_{step}"] = manager(used, **CONTENTS).resume({"actor": engine})
    out["log"] = logged.lines
    return out


def _template(hf_dir: str, base: str) -> None:
    engine, _ = build_engine(hf_dir, {}, "actor", False, seed=1)
    root = os.path.join(base, "template")
    for step in (8, 10):
        _bump(engine, step)
        manager(root, max_ckpt_to_keep=2, **CONTENTS).save(step, {"actor": engine}, {"branch": "A", "step": step})


def test_rollback_and_restart_keep_the_new_branch(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    run_ranks(1, _template, hf_dir, str(tmp_path), daemon=False)
    out = run_ranks(1, _rollbacks, hf_dir, str(tmp_path), daemon=False)[0]
    assert out["rolled_back_to"] == {"branch": "A", "step": 6}
    # completion order 2, 4, 6, 8, 10 (A), then 7 (B): keep 2 keeps 10 and 7, never drops the
    # step just written (by step numbers it would keep 8 and 10)
    assert out["after_7"] == ([7, 10], ["global_step_10", "global_step_7"]), out["after_7"]
    assert out["auto_after_7"] == {"branch": "B", "step": 7}
    assert out["after_10"] == ([7, 10], ["global_step_10", "global_step_7"]), out["after_10"]
    assert out["auto_after_10"] == {"branch": "B", "step": 10}
    assert out["weight_after_10"] == 110.0
    assert any("steps [8, 10] are numbered above the step just saved (7)" in line for line in out["log"]), out["log"]
    assert any("global_step_10 exists (complete): the new save is written beside it" in line
               for line in out["log"]), out["log"]
    assert out["disable_resume"] is None
    assert out["disable_after_2"] == ([2, 10], ["global_step_10", "global_step_2"])
    assert out["disable_auto_2"] == {"branch": "C", "step": 2}
    assert out["disable_after_4"] == ([2, 4], ["global_step_2", "global_step_4"])
    assert out["disable_auto_4"] == {"branch": "C", "step": 4}


def _trackers(hf_dir: str, base: str) -> dict:
    from mcore_rl.errors import CheckpointError

    engine, _ = build_engine(hf_dir, {}, "actor", False, seed=1)
    logged = _Logged()
    logging.getLogger("mcore_rl").addHandler(logged)
    pristine = os.path.join(base, "pristine")
    for step in (1, 3, 2):  # completion order 1, 3, 2: "completed last" is 2, not the highest number
        _bump(engine, step)
        manager(pristine, **CONTENTS).save(step, {"actor": engine}, {"step": step})
    tracker = "latest_checkpointed_iteration.txt"
    cases = {
        "missing_step": b"7", "torn_step": b"5", "no_tracker": None,
        "text": b"12abc", "bytes": b"\xff\xfe\x00", "huge": b"99999999999999999999", "negative": b"-3",
        "arabic_digits": "\u0661\u0662".encode(), "superscript": "\u00b2".encode(), "empty": b"",
    }
    out = {}
    for name, content in cases.items():
        root = os.path.join(base, name)
        shutil.copytree(pristine, root)
        if name == "torn_step":
            os.makedirs(os.path.join(root, "global_step_5", "actor"))
        if content is None:
            os.remove(os.path.join(root, tracker))
        else:
            with open(os.path.join(root, tracker), "wb") as f:
                f.write(content)
        before = {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                  for d, _, fs in os.walk(root) for f in fs}
        logged.lines.clear()
        try:
            state = manager(root, **CONTENTS).resume({"actor": engine})
            out[name] = {"state": state, "log": list(logged.lines)}
        except CheckpointError as e:
            out[name] = {"error": str(e)}
        after = {os.path.relpath(os.path.join(d, f), root): open(os.path.join(d, f), "rb").read()
                 for d, _, fs in os.walk(root) for f in fs}
        out[name]["unchanged"] = before == after
    return out


def test_tracker_is_authoritative_and_garbage_is_a_clear_error(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    out = run_ranks(1, _trackers, hf_dir, str(tmp_path), daemon=False)[0]
    for name in ("missing_step", "torn_step", "no_tracker"):
        assert out[name].get("state") == {"step": 2}, (name, out[name])  # completed last
    assert any("the tracker names step 7, which is missing; resuming step 2, the step completed last" in line
               for line in out["missing_step"]["log"]), out["missing_step"]
    assert any("the tracker names step 5, which is torn; resuming step 2" in line
               for line in out["torn_step"]["log"]), out["torn_step"]
    shown = {"text": "'12abc'", "bytes": "'\\\\xff\\\\xfe\\x00'", "huge": "'99999999999999999999'",
             "negative": "'-3'", "arabic_digits": "'\u0661\u0662'", "superscript": "'\u00b2'", "empty": "''"}
    for name, text in shown.items():
        error = out[name].get("error", "NO ERROR")
        assert f"latest_checkpointed_iteration.txt holds {text}, not a step number" in error, (name, error)
        assert "Complete steps under" in error and "[1, 2, 3]" in error, (name, error)
    for name in out:
        assert out[name]["unchanged"], name  # an error or a resume changes no file
