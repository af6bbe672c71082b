"""verl's Megatron engine keys (``<section>.megatron.*``: verl's ``McoreEngineConfig``,
``trainer/config/engine/megatron.yaml``) read into mcore_rl's engine config, so that a verl
Megatron script runs with ``model_engine=mcore_rl`` and its overrides unchanged.

Every field of verl's ``McoreEngineConfig`` is in exactly one table below:
- ``MAPPED``: same meaning in ``McoreRLEngineConfig`` (same name); merged.
- ``RECOMPUTE``: ``override_transformer_config.recompute_*``, read into mcore_rl's recompute.
- ``CONVERTED``: a verl key read into another mcore_rl field: ``dist_ckpt_optim_fully_reshardable``
  (an optimizer checkpoint that resumes at any layout) selects ``optimizer_sharding=model_space``,
  mcore_rl's gather-free format with that property (megatron's ``fully_reshardable`` gathers the
  data-parallel group's optimizer state at every save).
- ``SET_BY_VERL``: verl's worker overwrites them from the actor / ref / critic config (as for
  verl's own engine): accepted whatever they say.
- ``INERT``: no meaning in mcore_rl; verl's default is accepted, another value refused (naming
  the key and why).
A key counts as set when its value differs from verl's default (megatron.yaml, else the
dataclass's). A key set under both ``mcore_rl.`` and ``megatron.`` to different values is an
error naming both.
"""
from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Mapping

from verl.workers.config import McoreEngineConfig

from mcore_rl.integrations.verl.engine_config import McoreRLEngineSettings, VerlConfigError


MAPPED = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
          "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
          "use_distributed_optimizer", "param_offload", "optimizer_offload", "seed", "dtype", "forward_only",
          "router_replay")
RECOMPUTE = ("recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules")
SET_BY_VERL = ("use_remove_padding", "use_dynamic_bsz", "max_token_len_per_gpu", "micro_batch_size_per_gpu",
               "infer_max_token_len_per_gpu", "infer_micro_batch_size_per_gpu", "use_fused_kernels", "strategy",
               "_target_")
_CHECKPOINT = "the mcore_rl engine starts from model.path (a HF directory, or a mcore_rl model directory: " \
              "converters/hf_to_mcore.py) and writes its own resharding checkpoints"
INERT = {
    "use_mbridge": "the mcore_rl engine converts HF weights itself",
    "vanilla_mbridge": "the mcore_rl engine converts HF weights itself",
    "use_megatron_fsdp": "the mcore_rl engine runs megatron's DDP with its distributed optimizer",
    "use_dist_checkpointing": _CHECKPOINT, "dist_checkpointing_path": _CHECKPOINT,
    "dist_checkpointing_prefix": _CHECKPOINT,
    "distrib_optim_fully_reshardable_mem_efficient": "mcore_rl's any-layout optimizer checkpoints (model_space) "
                                                     "gather nothing",
    "dynamic_context_parallel": "dynamic context parallelism is not implemented in mcore_rl",
    "max_seqlen_per_dp_cp_rank": "dynamic context parallelism is not implemented in mcore_rl",
    "entropy_from_logits_with_chunking": "mcore_rl computes the entropy its own way",
    "entropy_from_logits_chunk_size": "mcore_rl computes the entropy its own way",
    "pad_bshd_to_minibatch_max": "mcore_rl pads micro-batches its own way",
    "pad_to_length": "mcore_rl pads micro-batches its own way",
    "pad_to_length_bucket": "mcore_rl pads micro-batches its own way",
    "override_ddp_config": "mcore_rl builds its own DDP config",
    "override_mcore_model_config": "mcore_rl builds the model config from the HF config",
    "override_transformer_config": "mcore_rl builds the transformer config from the HF config",
    "qat": "quantization-aware training is not implemented in mcore_rl",
    "full_determinism": "not implemented in mcore_rl",
}
# verl key -> (mcore_rl engine field, value per verl value)
CONVERTED = {"dist_ckpt_optim_fully_reshardable": ("optimizer_sharding", {True: "model_space", False: "dp_reshardable"})}
# under router_replay: verl 0.9.1 reads neither (accepted whatever they say, as there)
ROUTER_REPLAY_UNREAD = ("record_file", "replay_file")


@functools.cache
def verl_defaults() -> dict[str, Any]:
    """verl's megatron.yaml (what Hydra composes under ``megatron``), as plain containers."""
    from omegaconf import OmegaConf

    import verl.trainer.config as verl_config

    path = os.path.join(os.path.dirname(verl_config.__file__), "engine", "megatron.yaml")
    return OmegaConf.to_container(OmegaConf.load(path), resolve=True)


def _plain(value: Any) -> Any:
    """A nested config (a verl BaseConfig or mapping) as a dict without ``_target_``."""
    if isinstance(value, Mapping):
        return {k: _plain(v) for k, v in value.items() if k != "_target_"}
    if isinstance(value, tuple):
        return list(value)
    return value


def _default(name: str) -> Any:
    defaults = verl_defaults()
    if name in defaults:
        return _plain(defaults[name])
    field = {f.name: f for f in dataclasses.fields(McoreEngineConfig)}[name]
    return _plain(field.default if field.default is not dataclasses.MISSING else field.default_factory())


def set_keys(megatron) -> dict[str, Any]:
    """``{key: value}`` of the keys that differ from verl's defaults (nested keys dotted, e.g.
    ``override_transformer_config.recompute_granularity``, ``qat.enable``)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(McoreEngineConfig):
        value, default = _plain(getattr(megatron, f.name)), _default(f.name)
        if isinstance(value, dict) and isinstance(default, dict):
            for key in sorted(set(value) | set(default)):
                if value.get(key, default.get(key)) != default.get(key):
                    out[f"{f.name}.{key}"] = value.get(key)
        elif value != default:
            out[f.name] = value
    return out


def _refusal(key: str, value: Any, where: str) -> VerlConfigError:
    top, _, sub = key.partition(".")
    default = _default(top)
    if sub:
        default = default.get(sub) if isinstance(default, dict) else None
    return VerlConfigError(f"{where}.megatron.{key}={value!r}: the mcore_rl engine has no such setting "
                           f"({INERT.get(top, 'verl reads it for its own engine only')}); remove it (verl's default: "
                           f"{default!r}).")


def _recompute(otc: dict[str, Any], where: str) -> dict[str, Any]:
    """``override_transformer_config.recompute_*`` -> mcore_rl's recompute (full: whole layers,
    uniform; selective: core attention)."""
    key = f"{where}.megatron.override_transformer_config"
    granularity, method = otc.get("recompute_granularity"), otc.get("recompute_method")
    layers, modules = otc.get("recompute_num_layers"), otc.get("recompute_modules", ["core_attn"])
    if granularity not in (None, "full", "selective"):
        raise VerlConfigError(f"{key}.recompute_granularity={granularity!r}; choose full, selective or null.")
    if granularity == "full" and method not in (None, "uniform"):
        raise VerlConfigError(f"{key}.recompute_method={method!r}: mcore_rl recomputes full layers uniformly; set "
                              "it to uniform.")
    if granularity == "selective" and (list(modules or []) != ["core_attn"] or layers is not None):
        raise VerlConfigError(f"{key}: selective recompute in mcore_rl recomputes core attention only; got "
                              f"recompute_modules={modules!r}, recompute_num_layers={layers!r} (use "
                              "['core_attn'] and null).")
    if granularity is None and (method is not None or layers is not None):
        raise VerlConfigError(f"{key}: recompute_method={method!r} / recompute_num_layers={layers!r} act only with "
                              "recompute_granularity, which is null; set it or remove them.")
    out = {"recompute_granularity": granularity} if granularity else {}
    if layers is not None:
        out["recompute_num_layers"] = int(layers)
    return out


def _requested(megatron, where: str) -> dict[str, Any]:
    """The values the megatron section asks of mcore_rl's engine config; refuses what has no
    meaning here."""
    asked: dict[str, Any] = {}
    for key, value in set_keys(megatron).items():
        top, _, sub = key.partition(".")
        if top in MAPPED and top != "router_replay":
            asked[top] = value
        elif top == "router_replay":
            if sub == "mode":
                asked["router_replay"] = megatron.router_replay
            elif sub not in ROUTER_REPLAY_UNREAD:
                raise _refusal(key, value, where)
        elif top == "override_transformer_config" and sub in RECOMPUTE:
            continue  # below, all four together
        elif top in CONVERTED:
            field, values = CONVERTED[top]
            asked[field] = values[bool(value)]
        elif top in INERT:
            raise _refusal(key, value, where)
        elif top not in SET_BY_VERL:
            raise VerlConfigError(f"{where}.megatron.{key}={value!r}: a key of verl's McoreEngineConfig this "
                                  "mcore_rl release has not classified; remove it.")
    if asked.get("dtype") in ("float16", "fp16"):
        raise VerlConfigError(f"{where}.megatron.dtype={asked['dtype']!r}: the mcore_rl engine runs bfloat16 or "
                              "float32 (float16 needs loss scaling, not wired).")
    otc = dict(_plain(megatron.override_transformer_config) or {})
    return {**asked, **_recompute(otc, where)}


def _unset(engine: McoreRLEngineSettings, key: str) -> bool:
    """The mcore_rl side leaves ``key`` at its default (sequence parallelism switched off because
    TP is 1 counts as the default)."""
    field = {f.name: f for f in dataclasses.fields(McoreRLEngineSettings)}[key]
    default = field.default if field.default is not dataclasses.MISSING else field.default_factory()
    value = getattr(engine, key)
    if key == "router_replay":
        return value.mode == default.mode
    if key == "sequence_parallel" and engine.tensor_model_parallel_size == 1:
        return True
    return value == default


def merge(engine: McoreRLEngineSettings, megatron, where: str) -> McoreRLEngineSettings:
    """``engine`` with the values the megatron section sets (see the module doc); errors name
    ``<where>.megatron.<key>`` (and ``<where>.mcore_rl.<key>`` for a conflict)."""
    if megatron is None:
        return engine
    asked = _requested(megatron, where)
    updates = {}
    for key, value in asked.items():
        mine = getattr(engine, key)
        same = mine.mode == value.mode if key == "router_replay" else mine == value
        if not same and not _unset(engine, key):
            shown = (lambda v: v.mode) if key == "router_replay" else (lambda v: v)
            verl_key = next((k for k, (f, _) in CONVERTED.items() if f == key), None)
            theirs = f"{where}.megatron.{key}={shown(value)!r}" if verl_key is None else \
                f"{where}.megatron.{verl_key} (-> {shown(value)!r})"
            raise VerlConfigError(f"{where}.mcore_rl.{key}={shown(mine)!r} and {theirs} disagree; set one of them (the megatron keys are read for "
                                  "scripts written for verl's Megatron engine).")
        updates[key] = value
    if not updates:
        return engine
    if "sequence_parallel" not in updates and _unset(engine, "sequence_parallel"):
        updates["sequence_parallel"] = bool(megatron.sequence_parallel)  # verl's rule once TP is known
    try:
        return dataclasses.replace(engine, **updates)
    except VerlConfigError as e:
        raise VerlConfigError(f"{where}.megatron, read into the engine config: {e}") from e
