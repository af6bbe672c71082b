"""Bad checkpoint inputs are clear CheckpointErrors with nothing deleted: tracker with garbage,
tracker naming a missing step, missing shard, truncated shard, another architecture, contents
that were not saved, hf_model asked of a load, root not writable, ranks given different roots.
Retention, crash-debris cleanup and skipping incomplete steps. (Reshards and the refusal of a
dp_reshardable checkpoint at another TP/PP/EP: tests/test_ckpt_reshard.py.)"""
from __future__ import annotations

import os
import shutil

import torch

from tests.ckpt_bodies import build_engine, hf_dir_for, manager, train
from tests.dist import run_ranks


def _listing(root: str) -> dict[str, int]:
    return {os.path.relpath(os.path.join(d, f), root): os.path.getsize(os.path.join(d, f))
            for d, _, fs in os.walk(root) for f in fs}


def _error_of(fn) -> str:
    from mcore_rl.errors import CheckpointError

    try:
        fn()
    except CheckpointError as e:
        return str(e)
    return "NO ERROR"


def _bad_inputs(hf_dir: str, other_hf: str, tmp: str) -> dict:
    rank0 = torch.distributed.get_rank() == 0
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    train(model, range(1))
    pristine = os.path.join(tmp, "pristine")
    manager(pristine, save_contents=("model",)).save(1, {"actor": engine}, {"step": 1})
    manager(pristine).save(2, {"actor": engine}, {"step": 2})
    shard = sorted(f for f in os.listdir(os.path.join(pristine, "global_step_2/actor/dist_ckpt")) if f.endswith(".distcp"))[0]
    cases = {
        "garbage_tracker": lambda r: open(os.path.join(r, "latest_checkpointed_iteration.txt"), "w").write("12abc"),
        "tracker_missing_step": lambda r: open(os.path.join(r, "latest_checkpointed_iteration.txt"), "w").write("7"),
        "missing_shard": lambda r: os.remove(os.path.join(r, "global_step_2/actor/dist_ckpt", shard)),
        "truncated_shard": lambda r: os.truncate(os.path.join(r, "global_step_2/actor/dist_ckpt", shard), 100),
    }
    out = {}
    for name, mutate in cases.items():
        root = os.path.join(tmp, name)
        if rank0:
            shutil.copytree(pristine, root)
            mutate(root)
        torch.distributed.barrier()
        before = _listing(root)
        out[name] = _error_of(lambda: manager(root).resume({"actor": engine}))
        out[name + "/kept"] = _listing(root) == before
        torch.distributed.barrier()
    from mcore_rl.parallel.layout import destroy_parallel_state

    destroy_parallel_state()
    other, _ = build_engine(other_hf, {}, "actor", False, seed=1)
    out["architecture"] = _error_of(lambda: manager(pristine).resume({"actor": other}))
    step1 = os.path.join(pristine, "global_step_1")
    out["contents"] = _error_of(lambda: manager(pristine, resume_mode="path", resume_path=step1).resume({"actor": engine}))
    step2 = os.path.join(pristine, "global_step_2")
    out["hf_model"] = _error_of(lambda: manager(pristine).load(step2, {"actor": engine}, ("model", "hf_model")))
    blocker = os.path.join(tmp, "a_file")
    open(blocker, "w").close()
    out["not_writable"] = _error_of(lambda: manager(os.path.join(blocker, "ckpt")).save(3, {"actor": engine}, {}))
    out["roots"] = _error_of(lambda: manager(os.path.join(tmp, f"root_of_rank{torch.distributed.get_rank()}")))
    out["pristine_kept"] = sorted(d for d in os.listdir(pristine) if not d.startswith("."))
    return out


def test_bad_inputs_are_clear_errors(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    other = str(tmp_path / "other")
    from tests.tiny import tiny_config, tiny_hf_model

    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(other)
    out = run_ranks(2, _bad_inputs, hf_dir, other, str(tmp_path), daemon=False)[0]
    assert "holds '12abc', not a step number" in out["garbage_tracker"]
    assert "Complete steps under" in out["garbage_tracker"] and "[1, 2]" in out["garbage_tracker"]
    assert out["tracker_missing_step"] == "NO ERROR"  # resumes the step completed last (tests/test_ckpt_rollback.py)
    assert ".distcp missing" in out["missing_shard"]
    assert ".distcp has 100 bytes, the marker records " in out["truncated_shard"]
    assert "another architecture (num_layers: checkpoint 4 vs model 2)" in out["architecture"]
    assert "asks for ['optimizer', 'extra'] but the checkpoint holds only ['model']" in out["contents"]
    assert "hold 'hf_model', an export that is never loaded; load 'model' instead" in out["hf_model"]
    assert "a_file/ckpt' is not writable (NotADirectoryError" in out["not_writable"]
    assert "rank 0 " in out["roots"] and "root_of_rank0" in out["roots"] and "root_of_rank1" in out["roots"]
    for name in ("garbage_tracker", "tracker_missing_step", "missing_shard", "truncated_shard"):
        assert out[name + "/kept"], name
    assert out["pristine_kept"] == ["global_step_1", "global_step_2", "latest_checkpointed_iteration.txt"]


def _retention(hf_dir: str, root: str) -> dict:
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    mgr = manager(root, max_ckpt_to_keep=2)
    if torch.distributed.get_rank() == 0:  # crash debris (older) and a torn newer step
        os.makedirs(os.path.join(root, "global_step_1/actor"))
        os.makedirs(os.path.join(root, "global_step_9/actor"))
        os.makedirs(os.path.join(root, "not_a_step"))
    torch.distributed.barrier()
    seen = []
    for step in (2, 3, 4):
        train(model, range(step - 1, step))
        mgr.save(step, {"actor": engine}, {"step": step})
        seen.append(mgr.complete_steps())
    state = mgr.resume({"actor": engine})
    return {"seen": seen, "dirs": sorted(d for d in os.listdir(root) if not d.startswith(".")), "state": state}


def test_retention_debris_and_incomplete_steps(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    out = run_ranks(1, _retention, hf_dir, str(tmp_path / "ckpt"), daemon=False)[0]
    assert out["seen"] == [[2], [2, 3], [3, 4]]
    assert out["dirs"] == ["global_step_3", "global_step_4", "global_step_9",
                           "latest_checkpointed_iteration.txt", "not_a_step"]
    assert out["state"] == {"step": 4}  # the torn step 9 is skipped
