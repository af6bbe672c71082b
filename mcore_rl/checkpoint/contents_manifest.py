"""verl's ``ckpt_contents.json`` (its Megatron checkpoint manager's manifest, schema 2) for a role
directory written in the ``verl_v2`` layout (``fileio.model_layout.VERL_V2``).

verl 0.9.1 writes, per role, ``model/dist_ckpt/`` (model weights), ``optimizer/dist_ckpt/``
(optimizer + LR scheduler), ``extra/dist_ckpt/`` (RNG), ``model/huggingface/`` and this manifest,
which says where each content is. mcore_rl keeps ONE megatron checkpoint per role: everything the
step saved (model, and when saved the optimizer, the LR scheduler and the RNG) is in
``model/dist_ckpt/``, under the top-level keys the manifest names (``optimizer``,
``lr_scheduler``, ``rng_state``); there is no ``optimizer/`` or ``extra/`` tree. The manifest
says so field by field (verl's own fields, ``note`` where mcore_rl's content differs from verl's),
so verl's tools and users find every content; mcore_rl's own record of the role's files is its
``PART`` (or the step's ``COMPLETE``), which lists this file too. No torch or megatron import.
"""
from __future__ import annotations

import json
import os
from typing import Any

from mcore_rl.checkpoint import storage
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.model_layout import ModelLayout

SCHEMA_VERSION = 2  # verl's MegatronCheckpointManager.MANIFEST_SCHEMA_VERSION
_DIST = "megatron_dist_checkpoint"


def build(layout: ModelLayout, role: str, step: int, contents: tuple[str, ...], world_size: int,
          arch: str | None, scheduler: bool, lora: bool, tokenizer: bool, hf_files: bool = True) -> dict[str, Any]:
    """The manifest of a role directory in ``layout`` holding ``contents`` (mcore_rl's
    save_contents: model / optimizer / extra / hf_model) of ``step``; ``scheduler``: the engine
    has an LR scheduler (saved with ``extra``); ``tokenizer``: the HF dir holds one; ``hf_files``:
    the HF dir exists (a save without HF sources and without ``hf_model`` writes none)."""
    dist, hf = layout.dist, layout.hf
    entries: dict[str, dict] = {}
    if "model" in contents:
        entries["model"] = {"path": dist, "format": _DIST, "backend": "dist_checkpointing"}
        if lora:
            entries["model"]["note"] = "LoRA adapter weights only (mcore_rl.json records the base they train on)."
    if "optimizer" in contents:
        entries["optimizer"] = {"path": dist, "format": _DIST, "key": "optimizer",
                                "note": f"in the one megatron checkpoint of this role ({dist}/), beside the model"}
    if "extra" in contents:
        if scheduler:
            entries["lr_scheduler"] = {"path": dist, "format": _DIST, "key": "lr_scheduler",
                                       "note": f"saved with 'extra' in {dist}/ (verl keeps it with the optimizer)"}
        entries["rng_state"] = {"path": dist, "format": _DIST, "key": "rng_state",
                                "note": "mcore_rl's RNG payload, one object per global rank (not verl's rng format)"}
    if hf_files:
        entries["hf_config"] = {"path": hf, "format": "huggingface",
                                "note": "config.json, tokenizer, and optional generation_config.json"}
    if tokenizer and hf_files:
        entries["tokenizer"] = {"path": hf, "format": "huggingface"}
    if "hf_model" in contents and hf_files:
        entries["hf_model"] = {"path": hf, "format": "huggingface",
                               "note": f"HF export alongside Megatron model shards under {dist}/"}
    saved = [c for c in ("optimizer", "extra") if c in contents]
    directories = {dist: "Megatron dist_checkpointing shards (mcore_rl: one checkpoint per role) for the model "
                         f"weights{' and ' + ' and '.join(saved) + ' state' if saved else ''}, under the keys "
                         "'contents' names; there is no optimizer/ or extra/ tree."}
    if hf_files:
        directories[hf] = ("HuggingFace-format artifacts: config.json, tokenizer files, optional generation_config.json"
                           + (", and the HF weights" if "hf_model" in contents else "") + ".")
    return {"schema_version": SCHEMA_VERSION, "framework": "megatron", "role": role, "arch": arch,
            "global_step": int(step), "world_size": int(world_size),
            "backend": {"has_bridge": False, "use_dist_checkpointing": True, "peft": lora, "engine": "mcore_rl"},
            "save_contents": list(contents), "contents": entries, "directories": directories,
            "saved_any_dist_ckpt": True}


def write(layout: ModelLayout, role_dir: str, payload: dict[str, Any]) -> None:
    """Writes the manifest into ``role_dir`` atomically (before the part's record, which lists it)."""
    storage.write_json_atomic(os.path.join(role_dir, layout.manifest), payload)


def hf_arch(hf_dir: str) -> str | None:
    """``architectures[0]`` of ``hf_dir/config.json`` (verl's ``arch``); None without one."""
    try:
        with open(os.path.join(hf_dir, "config.json")) as f:
            archs = json.load(f).get("architectures")
    except (OSError, ValueError):
        return None
    return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None


def check(layout: ModelLayout, role_dir: str) -> dict[str, Any]:
    """The manifest of ``role_dir`` read and checked: verl's schema 2, this role, and every path
    it names present in the directory; a CheckpointError naming the file and what is wrong."""
    path = os.path.join(role_dir, layout.manifest)
    data = storage.read_json(path)
    problems = []
    if data.get("schema_version") != SCHEMA_VERSION or data.get("framework") != "megatron":
        problems.append(f"schema_version={data.get('schema_version')!r}, framework={data.get('framework')!r} "
                        f"(verl's schema {SCHEMA_VERSION}, megatron)")
    named = [e.get("path") for e in (data.get("contents") or {}).values() if isinstance(e, dict)]
    named += list(data.get("directories") or {})
    missing = sorted({p for p in named if not isinstance(p, str) or not os.path.isdir(os.path.join(role_dir, p))},
                     key=str)
    if missing:
        problems.append(f"it names {missing}, which {role_dir} does not hold")
    if problems:
        raise CheckpointError(f"{path}: {'; '.join(problems)}; the role directory is damaged: use another step.")
    return data
