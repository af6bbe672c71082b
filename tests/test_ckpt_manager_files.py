"""What CheckpointManager.save writes and what manager.resume refuses, on one TP=2 save (world 2):

- ``hf_model`` in save_contents with ``async_save``: the save writes no HF weights; once the step
  is complete, rank 0's background exporter (held here after its merge) writes them while
  training goes on. ``actor/huggingface/`` then holds safetensors shards of at most
  ``hf_max_shard_size`` (a larger tensor alone) with an index and the export's record, holding
  exactly the HF model's names and full (TP-gathered) shapes and the engine's exported values at
  the save, equal to ``mcore_to_hf.py merge`` of the step byte for byte, and loads with
  ``AutoModelForCausalLM.from_pretrained`` without missing or unexpected keys into a model whose
  log-probs equal the engine's at the save (<= 1e-5, fp32). The next step's exporter, SIGKILLed
  after its first weight file moved, is one error on both ranks at the next save and leaves a
  partial export (reruns: tests/test_ckpt_hf_export.py). ``hf_model`` in load_contents is
  refused; the export keys' values are checked.
- planted pickles (``os.system`` through ``__reduce__``) in the saved ``.metadata``, in the RNG
  ShardedObject payloads and in ``common.pt`` of a manager checkpoint make ``manager.resume``
  raise UnsafeCheckpointError naming the file and the refused global; the planted command never
  runs (its marker files do not exist). After planting, the step's COMPLETE marker is rewritten
  to the planted files' sizes and checksums (an attacker who rewrote the marker too), so the
  manager's own file checks pass and the unpickler is what refuses.
- ``layout=VERL_V2`` (verl's trainers): the same engine saved into ``actor/model/dist_ckpt/`` +
  ``actor/model/huggingface/`` with verl's ``ckpt_contents.json`` (schema 2, every path present),
  ``mcore_rl.json`` saying so (schema 3); ``manager.resume`` (content verified item by item) and
  ``load_model_dir`` bring the engine back bit for bit after another update.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import time

import pytest
import torch

from tests.ckpt_bodies import error_of
from tests.ckpt_util import engine, reseal, train_step, writer_processes_allowed
from tests.dist import run_ranks
from tests.test_ckpt_safe_load import PLANTS
from tests.tiny import hf_log_probs, rl_batch

SAVE = ("model", "optimizer", "extra", "hf_model")
TRACKER = "latest_checkpointed_iteration.txt"
SHARD = 40_000  # bytes: the tiny model's HF weights span several shards


def _config():
    from tests.tiny import tiny_config

    return tiny_config("llama", num_hidden_layers=2)  # what tests.ckpt_util.engine builds


def _manager(root: str, exports=None, **kw):
    from mcore_rl.checkpoint.config import CheckpointConfig
    from mcore_rl.checkpoint.manager import CheckpointManager

    layout = kw.pop("layout", None)
    return CheckpointManager(CheckpointConfig(root=root, **kw), hf_sources={"actor": _config()}, exports=exports,
                             **({"layout": layout} if layout else {}))


def _resume_planted(eng, base: str, step_dir: str, name: str) -> dict:
    """A copy of the saved step under its own root with ``name`` planted; manager.resume of it."""
    root, marker = os.path.join(base, f"planted_{name}"), os.path.join(base, f"ran_{name}")
    if torch.distributed.get_rank() == 0:
        shutil.copytree(step_dir, os.path.join(root, "global_step_1"))
        shutil.copy(os.path.join(os.path.dirname(step_dir), TRACKER), root)
        PLANTS[name](os.path.join(root, "global_step_1", "actor", "dist_ckpt"), marker)
        reseal(os.path.join(root, "global_step_1"))  # the marker agrees: the unpickler must refuse
    torch.distributed.barrier()
    if name == "common":  # torch's own weights_only default is off: only the guard may refuse
        os.environ["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        _manager(root).resume({"actor": eng})
        error = None
    except BaseException as e:  # torch wraps rank failures in CheckpointException (BaseException)
        error = f"{type(e).__name__}: {e}"
    finally:
        os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    torch.distributed.barrier()
    return {"error": error, "ran": sorted(os.path.basename(p) for p in glob.glob(marker + ".*"))}


def _export_in_background(eng, base: str) -> dict:
    """Async save of step 1 with hf_model, its exporter held after the merge while a training step
    runs; step 2's exporter killed after its first file moved; a fresh manager's resume."""
    from mcore_rl.checkpoint.export_queue import ExportQueue, worker_command
    from mcore_rl.fileio.faults import ENV, HOLD_ENV
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.rl.actor import Actor, ActorConfig

    rank0, root, hold = torch.distributed.get_rank() == 0, os.path.join(base, "ckpt"), os.path.join(base, "hold")
    env = [f"{HOLD_ENV}={hold}"]  # the exporter's alone (the async writers are not held)
    queue = ExportQueue(command=lambda t, n: ["env", *env, *worker_command(t, n)])
    mgr = _manager(root, queue, save_contents=SAVE, hf_max_shard_size=SHARD, async_save=True)
    out = {"log_probs": Actor(eng, ActorConfig(micro_batch_size=2)).compute_log_prob(rl_batch(200))["log_probs"],
           "tp_local": {n: tuple(p.shape) for n, p in eng.model[0].named_parameters()}}
    exported = export_hf(eng.model, eng.args, "actor")
    if rank0:
        out["exported"] = {k: v.detach().clone() for k, v in exported.items()}
    out["step_dir"] = mgr.save(1, {"actor": eng}, {"step": 1})
    mgr.wait()  # the step is complete: marker, tracker; its export starts now
    hf_dir = os.path.join(out["step_dir"], "actor", "huggingface")
    while rank0 and not any(n.startswith("hf_export_merge.") for n in os.listdir(hold)):
        time.sleep(0.02)
    torch.distributed.barrier()
    out["in_flight"] = {"complete": mgr.complete_steps(), "hf": sorted(os.listdir(hf_dir)),
                        "running": sorted(queue.running_steps())}
    train_step(eng, 1)  # training goes on while the export runs
    torch.distributed.barrier()
    if rank0:
        open(os.path.join(hold, "release"), "w").close()
    mgr.wait_exports()
    env[:] = [f"{ENV}=hf_export_move"]
    mgr.save(2, {"actor": eng}, {"step": 2})
    mgr.wait()
    while queue.busy():
        time.sleep(0.02)
    torch.distributed.barrier()
    out["raised"] = error_of(lambda: mgr.save(3, {"actor": eng}, {"step": 3}))
    out["closed"] = error_of(mgr.close)
    from mcore_rl.checkpoint.hf_export_record import export_state

    out["step2"] = export_state(os.path.join(root, "global_step_2", "actor"))  # reruns: tests/test_ckpt_hf_export.py
    return out


def _save_then_attack(base: str) -> dict:
    eng = engine(dict(tp=2))
    train_step(eng, 0)  # values away from the init: an export of stale weights would differ
    with writer_processes_allowed():
        out = _export_in_background(eng, base)
        for name in PLANTS:
            out[name] = _resume_planted(eng, base, out["step_dir"], name)
        out["verl_v2"] = _verl_v2_roundtrip(eng, base)
    return out


def _state(eng, model_only: bool = False) -> list[torch.Tensor]:
    """This rank's parameters (and, unless ``model_only``, its optimizer state)."""
    from tests.ckpt_bodies import optimizer_fingerprint

    params = [p.detach().clone() for p in eng.model[0].parameters()]
    return params if model_only else params + list(optimizer_fingerprint(eng).values())


def _differ(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    assert len(a) == len(b)
    return sum(not torch.equal(x, y) for x, y in zip(a, b))


def _verl_v2_roundtrip(eng, base: str) -> dict:
    """Save in verl's layout, update, resume; update, load_model_dir: what differs each time."""
    from mcore_rl.checkpoint.contents_manifest import check
    from mcore_rl.checkpoint.inventory import read_marker
    from mcore_rl.checkpoint.model_dir import load_model_dir
    from mcore_rl.fileio.model_layout import VERL_V2, layout_of

    root = os.path.join(base, "verl_v2")
    manager = _manager(root, save_contents=("model", "optimizer", "extra"), layout=VERL_V2)
    role_dir = os.path.join(manager.save(1, {"actor": eng}, {"step": 1}), "actor")
    saved = _state(eng)
    out = {"entries": sorted(os.listdir(role_dir)), "model": sorted(os.listdir(os.path.join(role_dir, "model"))),
           "layout": layout_of(role_dir).name, "manifest": check(VERL_V2, role_dir)["contents"]}
    with open(os.path.join(role_dir, "mcore_rl.json")) as f:
        out["schema"] = json.load(f)["schema_version"]
    with open(os.path.join(os.path.dirname(role_dir), "COMPLETE")) as f:
        files = json.load(f)["files"]  # the marker vouches for the manifest and both trees
    out["recorded"] = sorted(rel for rel in files if "/model/" not in rel)
    out["inner"] = sorted({rel.split("/")[2] for rel in files if rel.startswith("actor/model/")})
    step_dir = os.path.dirname(role_dir)  # the resume checks the shards item by item as it reads them:
    in_read = _manager(root)._verify_content(step_dir, read_marker(os.path.join(step_dir, "COMPLETE")), ["actor"])
    out["in_read"] = in_read["actor"][2] if "actor" in in_read else None  # the dist dir it reads so
    train_step(eng, 1)
    moved = _differ(_state(eng), saved)
    _manager(root).resume({"actor": eng})  # verify_content (default): every item checked as it is read
    out["resumed"] = (moved, _differ(_state(eng), saved))
    train_step(eng, 2)
    load_model_dir(role_dir, eng)
    out["loaded"] = _differ(_state(eng, model_only=True), saved[:len(_state(eng, model_only=True))])
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("manager_files"))
    os.makedirs(os.path.join(base, "hold"))
    return run_ranks(2, _save_then_attack, base, daemon=False)


def test_hf_model_is_exported_in_the_background_and_equals_merge(saved, tmp_path):
    from tests.test_ckpt_hf_export import same_as_merge

    for rank, r in enumerate(saved):  # the step complete, the export held: no weights in the HF dir yet
        assert r["in_flight"] == {"complete": [1], "hf": ["config.json"], "running": [1] if rank == 0 else []}, r
    step_dir = saved[0]["step_dir"]
    assert same_as_merge(os.path.join(step_dir, "actor"), str(tmp_path / "merged"), max_shard_size=SHARD) == []
    record = json.load(open(os.path.join(step_dir, "actor", "huggingface", "mcore_rl_export.json")))
    assert (record["writer"], record["step"], record["role"]) == ("background export", 1, "actor"), record
    # step 2's exporter killed after its first weight file moved: one error, the same on both ranks
    raised = [r["raised"] for r in saved]
    assert raised[0] == raised[1] and raised[0] is not None, raised
    assert "the HF export of step 2 role actor on node 0 failed: the exporter was killed by signal 9" in raised[0]
    assert [r["closed"] for r in saved] == [None, None]  # raised once, at the save
    assert saved[0]["step2"] == "partial"  # what the killed exporter left is never taken as an export


def test_hf_model_safetensors_are_the_full_hf_state(saved):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf_dir = os.path.join(saved[0]["step_dir"], "actor", "huggingface")
    with open(os.path.join(hf_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n > 2 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert sorted(os.listdir(hf_dir)) == sorted(["config.json", "model.safetensors.index.json", *shards,
                                                 "mcore_rl_export.json"])
    written = {}
    for shard in shards:
        part = load_file(os.path.join(hf_dir, shard))
        sizes = [t.numel() * t.element_size() for t in part.values()]
        assert sum(sizes) <= SHARD or len(sizes) == 1, (shard, sizes)  # HF's rule: a big tensor alone
        assert {index["weight_map"][k] for k in part} == {shard}
        written.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(_config()).state_dict()
    assert sorted(written) == sorted(original)
    assert {k: tuple(v.shape) for k, v in written.items()} == {k: tuple(v.shape) for k, v in original.items()}
    # TP=2 really sharded the engine: a rank-local export would have half of these shapes
    local = saved[0]["tp_local"]
    fused = [n for n in local if n.endswith(("linear_fc1.weight", "linear_qkv.weight"))]
    assert fused and all(local[n][0] * 2 == _full_rows(n, written) for n in fused), local
    exported = saved[0]["exported"]
    mismatch = [k for k in written if not torch.equal(written[k], exported[k])]
    assert mismatch == [], mismatch
    model, info = AutoModelForCausalLM.from_pretrained(hf_dir, output_loading_info=True)
    assert info["missing_keys"] in ([], set()) and info["unexpected_keys"] in ([], set()), info
    loaded = model.state_dict()
    assert all(torch.equal(loaded[k], written[k]) for k in written)
    # independent of export_hf: the HF model from the file computes the engine's log-probs
    ours = saved[0]["log_probs"]
    theirs, _ = hf_log_probs(model.eval(), rl_batch(200))
    assert ours.abs().max() > 1.0  # real log-probs, not an all-masked batch
    diff = float((ours - theirs).abs().max())
    assert diff <= 1e-5, f"log-probs of the HF model from model.safetensors differ by {diff}"


def _full_rows(name: str, written: dict) -> int:
    """Rows of the full (all TP ranks) megatron tensor ``name`` from the HF tensors it maps to."""
    layer = name.split("layers.")[1].split(".")[0]
    prefix = f"model.layers.{layer}"
    if "linear_fc1" in name:  # gate and up, fused
        return sum(written[f"{prefix}.mlp.{p}_proj.weight"].shape[0] for p in ("gate", "up"))
    return sum(written[f"{prefix}.self_attn.{p}_proj.weight"].shape[0] for p in ("q", "k", "v"))


def test_load_contents_may_not_hold_hf_model():
    from mcore_rl.checkpoint.config import CheckpointConfig
    from mcore_rl.errors import CheckpointError

    with pytest.raises(CheckpointError, match=r"load_contents may not hold 'hf_model'.*load 'model' instead"):
        CheckpointConfig(load_contents=("model", "hf_model"))
    assert "hf_model" in CheckpointConfig(save_contents=SAVE).save_contents  # fine for saving


@pytest.mark.parametrize("override,error", [
    ("hf_dtype=int8", "checkpoint.hf_dtype='int8'; use one of ['fp32', 'bf16', 'fp16', 'fp8', 'mxfp4'] or null"),
    ("hf_export_threads=0", "checkpoint.hf_export_threads=0 must be an integer >= 1"),
    ("hf_export_supersede=maybe", "checkpoint.hf_export_supersede: expected bool, got 'maybe'"),
    ("hf_export_wait_at_close=soon", "checkpoint.hf_export_wait_at_close: expected bool, got 'soon'"),
])
def test_export_keys_in_the_job_config(override, error):
    from mcore_rl.checkpoint.config import CheckpointConfig
    from mcore_rl.config_loader import ConfigError, load_config
    from mcore_rl.errors import CheckpointError
    from mcore_rl.job.schema import JobConfig

    cfg = load_config(JobConfig, "configs/grpo_demo.yaml", ["checkpoint.hf_dtype=fp8", "checkpoint.hf_export_threads=3",
                                                            "checkpoint.hf_export_supersede=false",
                                                            "checkpoint.hf_export_wait_at_close=false"])
    c = cfg.checkpoint
    assert (c.hf_dtype, c.hf_export_threads, c.hf_export_supersede, c.hf_export_wait_at_close) == ("fp8", 3, False, False)
    with pytest.raises(ConfigError) as raised:
        load_config(JobConfig, "configs/grpo_demo.yaml", [f"checkpoint.{override}"])
    assert error in str(raised.value), str(raised.value)
    with pytest.raises(CheckpointError, match="hf_export_wait_at_close=None must be true or false"):
        CheckpointConfig(hf_export_wait_at_close=None)  # built in code, not through the loader


@pytest.mark.parametrize("name,file", [("metadata", ".metadata"), ("payload", ".distcp"),
                                       ("common", "common.pt")])
def test_manager_resume_refuses_planted_pickles(saved, name, file):
    for rank, r in enumerate(saved):
        assert r[name]["ran"] == [], (rank, r[name])  # the planted command never ran
        error = r[name]["error"]
        assert error is not None and error.startswith("UnsafeCheckpointError"), (rank, error)
        assert file in error and "'posix.system'" in error and "not run" in error, (rank, error)
    if name == "payload":  # refused before any engine is loaded, the same error on every rank
        assert "rng_state/shard_0_2" in saved[0][name]["error"], saved[0][name]["error"]
        assert saved[0][name]["error"] == saved[1][name]["error"]


def test_verl_v2_layout_saves_resumes_and_loads(saved):
    for rank, r in enumerate(saved):
        v2 = r["verl_v2"]
        assert v2["entries"] == ["ckpt_contents.json", "mcore_rl.json", "model"] and v2["model"] == [
            "dist_ckpt", "huggingface"], (rank, v2)
        assert (v2["layout"], v2["schema"]) == ("verl_v2", 3)
        assert v2["recorded"] == ["actor/ckpt_contents.json", "actor/mcore_rl.json", "trainer_state.json"], v2
        assert v2["inner"] == ["dist_ckpt", "huggingface"], v2["inner"]
        assert v2["in_read"] == "actor/model/dist_ckpt", v2["in_read"]
        assert {k: e["path"] for k, e in v2["manifest"].items()} == {
            "model": "model/dist_ckpt", "optimizer": "model/dist_ckpt", "lr_scheduler": "model/dist_ckpt",
            "rng_state": "model/dist_ckpt", "hf_config": "model/huggingface"}, v2["manifest"]
        moved, after_resume = v2["resumed"]
        assert moved > 0 and after_resume == 0, (rank, v2["resumed"])  # the update moved them; resume restored all
        assert v2["loaded"] == 0, (rank, v2["loaded"])  # load_model_dir: the model weights
