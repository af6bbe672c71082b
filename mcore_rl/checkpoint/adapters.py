"""Adapter-only checkpoints of LoRA engines: what part of the model a save writes and a load
reads, the ``lora`` record of ``mcore_rl.json`` (the LoRA settings and the base the adapters were
trained on) and the checks that refuse a resume onto another base or with other LoRA settings.

A LoRA engine's step holds its adapters (every ``.lora.`` parameter), a critic's value head
(trained in full), the router state buffers training moves (``mapping.weights.STATE_BUFFERS``),
the optimizer (which holds only those parameters), RNG and scheduler: never the frozen base. A
save checks that every parameter with ``requires_grad`` is among them.

Model parts (``LoadPlan.model_part``): ``all`` (a full model), ``adapters`` (the above), ``base``
(everything but the adapters: a full model directory loaded under a LoRA engine's adapters).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal

import torch

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.base_identity import describe, differences, warn_if_sampled_only
from mcore_rl.mapping.weights import STATE_BUFFERS, unwrap

log = logging.getLogger("mcore_rl.checkpoint")

ModelPart = Literal["all", "adapters", "base"]
ADAPTER_MARK = ".lora."
# settings that define what the saved adapters compute; the others (init methods, seed,
# adapter_path, merge) only matter before the first step or for weight sync
DEFINING = ("type", "rank", "alpha", "dropout", "dropout_position", "dtype", "target_modules", "exclude_modules")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def is_lora(engine) -> bool:
    """The engine was built with LoRA adapters (the same answer on every rank, unlike
    ``has_adapters`` on a pipeline stage that holds no targeted layer)."""
    config = getattr(engine, "lora_config", None)
    return config is not None and config.enabled


def save_part(engine) -> ModelPart:
    return "adapters" if is_lora(engine) else "all"


def lora_record(engine) -> dict[str, Any] | None:
    """``mcore_rl.json``'s ``lora`` entry: adapter-only, every LoRA setting, the base identity."""
    if not is_lora(engine):
        return None
    config = {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(engine.lora_config).items()}
    return {"adapter_only": True, "config": config, "base": engine.base,
            "saved": "parameters with requires_grad (adapters; a critic's value head) and router state buffers"}


def _in_part(key: str, part: ModelPart, role: str) -> bool:
    adapter = ADAPTER_MARK in key
    if part == "all":
        return True
    if part == "base":
        return not adapter
    return adapter or (role == "critic" and key.startswith("output_layer.")) or \
        any(key.endswith(b) for b in STATE_BUFFERS)


def select(engine, chunk_index: int, state: dict, part: ModelPart) -> dict:
    """The entries of one chunk's sharded state dict that ``part`` holds. For ``adapters`` every
    parameter with ``requires_grad`` must be among them (else nothing would save its training)."""
    if part == "all":
        return state
    kept = {k: v for k, v in state.items() if _in_part(k, part, engine.role)}
    if part == "adapters":
        trainable = [n for n, p in unwrap(engine.model[chunk_index]).named_parameters() if p.requires_grad]
        lost = [n for n in trainable if n not in kept]
        if lost:
            raise CheckpointError(f"the LoRA engine trains {lost[:4]}, which an adapter-only checkpoint does not hold "
                                  f"(it holds {ADAPTER_MARK} parameters, a critic's output_layer and router state "
                                  "buffers); freeze them, or save without lora (report this if unexpected).")
    return kept


def load_chunk(chunk: torch.nn.Module, loaded: dict, part: ModelPart, where: str) -> None:
    """Copies a loaded part into a chunk: strictly for ``all``; else every loaded key must be a
    key of the chunk and every other key keeps its value."""
    if part == "all":
        chunk.load_state_dict(loaded, strict=True)
        return
    result = chunk.load_state_dict(loaded, strict=False)
    bad = sorted(set(result.unexpected_keys) | (set(result.missing_keys) & set(loaded)))
    if bad:
        raise CheckpointError(f"{where}: the {part} part did not load into the model: {bad[:6]}; "
                              "the checkpoint does not match this model (report this).")


def plan_part(meta: dict, engine, where: str, base_load: bool) -> ModelPart:
    """Which model part a load reads, after the LoRA checks (raises before any state moves).
    ``base_load``: a model directory loaded as an engine's start (a full one under a LoRA
    engine's adapters is its base), else a resume."""
    record = meta.get("lora")
    saved_adapters = bool(record and record.get("adapter_only"))
    if not is_lora(engine):
        if saved_adapters:
            raise CheckpointError(
                f"{where} holds LoRA adapters only (rank {record['config'].get('rank')}, trained on "
                f"{describe(record.get('base'))}), but the engine has no LoRA adapters: build it with the saved "
                f"LoRA settings {_defining(record['config'])} (and that base) to resume.")
        return "all"
    if not saved_adapters:
        if base_load:
            return "base"
        raise CheckpointError(
            f"{where} holds a full model (no LoRA adapters), but the engine has LoRA adapters (rank "
            f"{engine.lora_config.rank}): a LoRA run resumes adapter-only steps. To start LoRA from this "
            f"step's weights pass {where} as the model directory (model.mcore_dir); to resume full "
            "fine-tuning build the engine without lora.")
    check_config(record["config"], engine.lora_config, where)
    check_base(record.get("base"), engine.base, where)
    return "adapters"


def _normal(key: str, value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    if key == "dtype":
        return _DTYPE_ALIASES.get(value, value)
    if key in ("alpha", "dropout") and isinstance(value, (int, float)):
        return float(value)
    return value


def _defining(config: dict) -> dict:
    return {k: config.get(k) for k in DEFINING}


def check_config(saved: dict, config, where: str) -> None:
    """The saved LoRA settings that define the adapters equal ``config``'s; else one error
    naming every difference."""
    current = dataclasses.asdict(config)
    keys = [k for k in DEFINING if _normal(k, saved.get(k)) != _normal(k, current[k])]
    if keys:
        diffs = "; ".join(f"lora.{k}: saved {saved.get(k)!r}, now {current[k]!r}" for k in keys)
        raise CheckpointError(
            f"{where} holds LoRA adapters of other settings ({diffs}); resume with the saved LoRA settings "
            f"({', '.join(f'lora.{k}={saved.get(k)!r}' for k in keys)}), or start a new run "
            "(checkpoint.resume_mode=disable, or another checkpoint.root).")


def _restart_hint(saved: dict) -> str:
    """How to start from the saved base again (the job's keys; verl: model.path)."""
    kind, path = saved.get("kind"), saved.get("path")
    if kind == "hf":
        return f"build the engine from {path} again (model.hf_dir={path})"
    if kind == "mcore":
        return f"load {path} into the engine again (model.mcore_dir={path})"
    return f"start from {describe(saved)} again"


def check_base(saved: dict | None, current: dict | None, where: str) -> None:
    """The base the adapters were trained on is the engine's (content identity, path aside)."""
    if saved is None or current is None:
        raise CheckpointError(f"{where}: the base of the LoRA adapters is not recorded (saved {saved!r}, engine "
                              f"{current!r}); this checkpoint cannot be verified: report this.")
    diffs = differences(saved, current)
    if diffs:
        shown = "; ".join(diffs[:6]) + (f" (+{len(diffs) - 6} more)" if len(diffs) > 6 else "")
        raise CheckpointError(
            f"{where}: the LoRA adapters were trained on {describe(saved)}, but this engine's base is "
            f"{describe(current)}, which differs ({shown}). Adapters resume only onto the base they were trained "
            f"on: {_restart_hint(saved)}, or start a new run (checkpoint.resume_mode=disable, or another "
            "checkpoint.root).")
    warn_if_sampled_only(saved, where)
    if saved.get("kind") == "none":
        log.warning("%s: the LoRA adapters were trained on a randomly initialised base, which cannot be "
                    "verified; it is the same only when the model was built with the same seed.", where)
    elif saved.get("path") != current.get("path"):
        log.info("%s: the base moved (%s -> %s), same content", where, saved.get("path"), current.get("path"))
