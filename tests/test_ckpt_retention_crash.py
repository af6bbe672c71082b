"""Retention interrupted half-way through deleting an old step (a crash inside its rmtree, as
the crash soak hit): the old step must not be left looking complete with files missing, and the
next successful save removes it as crash debris."""
from __future__ import annotations

import glob
import os
import shutil

from mcore_rl.errors import CheckpointError
from tests.ckpt_bodies import build_engine, hf_dir_for, manager, train
from tests.dist import run_ranks


def _crash_in_retention(hf_dir: str, root: str) -> dict:
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    mgr = manager(root, max_ckpt_to_keep=2)
    for step in (1, 2):
        train(model, range(step - 1, step))
        mgr.save(step, {"actor": engine}, {"step": step})
    real_rmtree = shutil.rmtree

    def crashing_rmtree(path, *args, **kwargs):  # deletes one shard, then the process "dies"
        os.remove(sorted(glob.glob(os.path.join(path, "actor", "dist_ckpt", "*.distcp")))[0])
        raise RuntimeError("crash inside retention's rmtree")

    shutil.rmtree = crashing_rmtree
    try:
        train(model, range(2, 3))
        mgr.save(3, {"actor": engine}, {"step": 3})
        raised = None
    except CheckpointError as e:  # agreed: every rank raises it, naming the failed rank's error
        raised = str(e)
    finally:
        shutil.rmtree = real_rmtree
    after_crash = (mgr.complete_steps(), mgr.incomplete_steps())
    train(model, range(3, 4))
    mgr.save(4, {"actor": engine}, {"step": 4})
    return {"raised": raised, "after_crash": after_crash,
            "dirs": sorted(d for d in os.listdir(root) if d.startswith("global_step_"))}


def test_crash_inside_retention_leaves_no_complete_step_with_missing_files(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    out = run_ranks(1, _crash_in_retention, hf_dir, str(tmp_path / "ckpt"), daemon=False)[0]
    assert "RuntimeError: crash inside retention's rmtree" in out["raised"]  # the crash happened mid-delete
    # step 1, half deleted, is no longer complete (it was: a marker naming a missing shard)
    assert out["after_crash"] == ([2, 3], [1])
    assert out["dirs"] == ["global_step_3", "global_step_4"]  # debris removed at the next save
