"""A checkpoint of an actor and a critic, damaged or tampered with in each way below, then
resumed: every case is a clear error (message checked) before any engine is touched (both
engines' weights and optimizer states compared), and no file changes. For the tampering cases
the attacker also rewrites the marker to the new files (``reseal``), so the checks behind it —
path containment, the unpickler's allowlists — are what must refuse.

Also: retention never follows a ``global_step_N`` symlink out of the root.
"""
from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import shutil

import pytest
import torch

from tests.ckpt_bodies import build_engine, engine_settings, hf_dir_for, manager, optimizer_fingerprint, train
from tests.ckpt_util import replace_rng_payloads, reseal
from tests.dist import run_ranks

ACTOR, CRITIC = "global_step_1/actor/dist_ckpt", "global_step_1/critic/dist_ckpt"


class _Run:
    """Pickles as ``os.system(cmd)``: what an attacker plants."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _metadata(dist_dir: str):
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(dist_dir).read_metadata()


def _dump(dist_dir: str, md) -> None:
    with open(os.path.join(dist_dir, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _repoint(dist_dir: str, target: str) -> None:
    """Every item of the first shard file re-pointed at ``target`` (a relative or absolute name)
    whose bytes are a copy of that shard: a reader that follows it gets well-formed weights."""
    md = _metadata(dist_dir)
    first = sorted({info.relative_path for info in md.storage_data.values()})[0]
    shutil.copyfile(os.path.join(dist_dir, first), os.path.normpath(os.path.join(dist_dir, target)))
    for index, info in list(md.storage_data.items()):
        if info.relative_path == first:
            md.storage_data[index] = dataclasses.replace(info, relative_path=target)
    _dump(dist_dir, md)


def _flip_middle(path: str) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def _shard(root: str, dist: str) -> str:
    return os.path.join(root, dist, sorted(n for n in os.listdir(os.path.join(root, dist)) if n.endswith(".distcp"))[0])


def _mutations(base: str) -> dict:
    """name -> (mutation of a copy at ``root``, whether the attacker reseals the marker)."""
    import pathlib

    import numpy as np

    def symlinked_shard(root):
        shard = _shard(root, CRITIC)
        outside = os.path.join(base, "outside_copy.distcp")
        shutil.copyfile(shard, outside)
        os.remove(shard)
        os.symlink(outside, shard)

    def marker_path(root):
        import json

        path = os.path.join(root, "global_step_1", "COMPLETE")
        marker = json.load(open(path))
        marker["files"]["../../outside.txt"] = {"size": 1, "crc32": "00000000"}
        json.dump(marker, open(path, "w"))

    return {
        "metadata_dotdot": (lambda r: _repoint(os.path.join(r, ACTOR), "../x.distcp"), True),
        "metadata_absolute": (lambda r: _repoint(os.path.join(r, ACTOR), os.path.join(base, "abs.distcp")), True),
        "symlinked_shard": (symlinked_shard, True),
        "marker_names_outside": (marker_path, False),
        "same_size_other_bytes": (lambda r: _flip_middle(_shard(r, ACTOR)), False),
        # the last role's damage: found while the actor (read first) waits in host buffers
        "critic_same_size_other_bytes": (lambda r: _flip_middle(_shard(r, CRITIC)), False),
        "missing_shard_with_marker": (lambda r: os.remove(_shard(r, CRITIC)), False),
        "critic_planted_pickle": (lambda r: replace_rng_payloads(os.path.join(r, CRITIC), [_Run(f"touch {base}/ran")]), True),
        "critic_numpy_payload": (lambda r: replace_rng_payloads(os.path.join(r, CRITIC), [np.zeros(2)]), True),
        "critic_path_payload": (lambda r: replace_rng_payloads(os.path.join(r, CRITIC), [pathlib.PosixPath("/etc")]), True),
        "critic_common_truncated": (lambda r: os.truncate(os.path.join(r, CRITIC, "common.pt"), 40), True),
        "no_trainer_state": (lambda r: os.remove(os.path.join(r, "global_step_1", "trainer_state.json")), False),
        "no_hf_config": (lambda r: os.remove(os.path.join(r, "global_step_1/actor/huggingface/config.json")), False),
    }


def _engines(hf_actor: str, hf_critic: str):
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.critic import Critic, CriticConfig
    from mcore_rl.rl.engine import ModelEngine

    actor, actor_model = build_engine(hf_actor, {}, "actor", False, seed=1)  # sets up the parallel state
    critic = ModelEngine(model_args_from_hf(hf_critic), actor.layout, "critic", active_platform(),
                         *engine_settings(False), hf_critic)
    return {"actor": actor, "critic": critic}, actor_model, Critic(critic, CriticConfig(micro_batch_size=2,
                                                                                         ppo_mini_batch_size=4))


def _fingerprint(engines: dict) -> dict[str, torch.Tensor]:
    out = {}
    for role, engine in engines.items():
        out.update({f"{role}.{n}": p.detach().clone() for n, p in engine.model[0].named_parameters()})
        out.update({f"{role}.opt.{k}": v for k, v in optimizer_fingerprint(engine).items()})
    return out


def _digests(root: str) -> dict[str, str]:
    return {os.path.relpath(os.path.join(d, f), root): hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, fs in os.walk(root) for f in fs}


def _attacks(hf_actor: str, hf_critic: str, base: str) -> dict:
    from mcore_rl.checkpoint.config import CheckpointConfig
    from mcore_rl.checkpoint.manager import CheckpointManager

    engines, actor, critic = _engines(hf_actor, hf_critic)
    train(actor, range(1))
    train(critic, range(1))
    pristine = os.path.join(base, "pristine")
    sources = {"actor": hf_actor, "critic": hf_critic}
    CheckpointManager(CheckpointConfig(root=pristine), hf_sources=sources).save(1, engines, {"step": 1})
    train(actor, range(1, 2))  # the engines now differ from the checkpoint: a load would show
    train(critic, range(1, 2))
    out = {}
    for name, (mutate, sealed) in _mutations(base).items():
        root = os.path.join(base, name)
        shutil.copytree(pristine, root, symlinks=True)
        mutate(root)
        if sealed:
            reseal(os.path.join(root, "global_step_1"))
        before, files = _fingerprint(engines), _digests(root)
        try:
            manager(root).resume(engines)
            error = "NO ERROR"
        except Exception as e:  # noqa: BLE001 - the test checks type and message
            error = f"{type(e).__name__}: {e}"
        after = _fingerprint(engines)
        out[name] = {"error": error, "engines_kept": all(torch.equal(before[k], after[k]) for k in before),
                     "files_kept": _digests(root) == files, "ran": os.path.exists(os.path.join(base, "ran"))}
    # the same damaged shard with verify_content off: sizes alone pass it (the knob is what checks)
    manager(os.path.join(base, "same_size_other_bytes"), verify_content=False).resume(engines)
    out["unverified_loads"] = True
    from mcore_rl.checkpoint.model_dir import load_model_dir

    try:  # the same model directory as a job's start (model.mcore_dir): also refused
        load_model_dir(os.path.join(base, "metadata_dotdot", "global_step_1", "actor"), engines["actor"])
        out["model_dir_dotdot"] = "NO ERROR"
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        out["model_dir_dotdot"] = f"{type(e).__name__}: {e}"
    return out


@pytest.fixture(scope="module")
def attacked(tmp_path_factory):
    base = str(tmp_path_factory.mktemp("adversarial"))
    return run_ranks(1, _attacks, hf_dir_for(base, "llama", "actor"), hf_dir_for(base, "llama", "critic"), base,
                     daemon=False)[0]


EXPECT = {
    "metadata_dotdot": "names the file '../x.distcp', which leaves",
    "metadata_absolute": "abs.distcp', which leaves",
    "symlinked_shard": "(a symlink leaves the directory)",
    "marker_names_outside": "names the file '../../outside.txt', which leaves",
    "same_size_other_bytes": "holds other bytes than were saved: actor/dist_ckpt/__0_0.distcp (checksum",
    "critic_same_size_other_bytes": "holds other bytes than were saved: critic/dist_ckpt/__0_0.distcp (checksum",
    "missing_shard_with_marker": "critic/dist_ckpt/__0_0.distcp missing",
    "critic_planted_pickle": "UnsafeCheckpointError: refused to load ShardedObject payload 'rng_state/shard_0_1' in",
    "critic_numpy_payload": "it needs the Python global 'numpy",
    "critic_path_payload": "it needs the Python global 'pathlib.PosixPath'",
    "critic_common_truncated": "critic/dist_ckpt/common.pt cannot be read",
    "no_trainer_state": "trainer_state.json missing",
    "no_hf_config": "actor/huggingface/config.json missing",
}


def test_verify_content_off_checks_sizes_only(attacked):
    assert attacked["unverified_loads"]


def test_a_model_directory_naming_files_outside_is_refused(attacked):
    assert attacked["model_dir_dotdot"].startswith("CheckpointError: "), attacked["model_dir_dotdot"]
    assert "names the file '../x.distcp', which leaves" in attacked["model_dir_dotdot"]


@pytest.mark.parametrize("name", sorted(EXPECT))
def test_damage_and_tampering_are_refused_before_any_state_moves(attacked, name):
    case = attacked[name]
    assert EXPECT[name] in case["error"], case["error"]
    assert "may be malicious" not in case["error"] or "payload" in name or "pickle" in name, case["error"]
    assert case["engines_kept"], f"{name}: an engine was changed before the refusal"
    assert case["files_kept"], f"{name}: a file changed"
    assert not case["ran"], "the planted command ran"


def _linked_step(hf_dir: str, base: str) -> dict:
    engine, model = build_engine(hf_dir, {}, "actor", False, seed=1)
    outside = os.path.join(base, "outside")
    manager(outside).save(1, {"actor": engine}, {"step": 1})  # a complete checkpoint elsewhere
    root = os.path.join(base, "root")
    os.makedirs(root)
    os.symlink(os.path.join(outside, "global_step_1"), os.path.join(root, "global_step_1"))
    before = _digests(outside)
    mgr = manager(root, max_ckpt_to_keep=1)
    for step in (2, 3):
        train(model, range(step - 1, step))
        mgr.save(step, {"actor": engine}, {"step": step})
    return {"outside_kept": _digests(outside) == before, "link": os.path.islink(os.path.join(root, "global_step_1")),
            "dirs": sorted(os.listdir(root)), "resumed": manager(root).resume({"actor": engine})}


def test_retention_never_follows_a_linked_step(tmp_path):
    hf_dir = hf_dir_for(str(tmp_path), "llama", "actor")
    out = run_ranks(1, _linked_step, hf_dir, str(tmp_path), daemon=False)[0]
    assert out["outside_kept"] and out["link"], out
    assert out["dirs"] == ["global_step_1", "global_step_3", "latest_checkpointed_iteration.txt"], out
    assert out["resumed"] == {"step": 3}
