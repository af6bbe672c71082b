"""One engine's checkpoint state: the sharded state dict (model per VPP chunk, optimizer with an
explicit sharding type, one RNG ShardedObject per global rank, LR scheduler), the ``mcore_rl.json``
metadata, and the layout comparison that decides RNG restore / reshard / error before any state
is touched."""
from __future__ import annotations

import functools
import random
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.dist_checkpointing import ShardedObject

from mcore_rl.checkpoint import adapters, optimizer_space
from mcore_rl.checkpoint.adapters import ModelPart
from mcore_rl.checkpoint.config import SHARDING_TYPES
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.model_layout import LAYOUT_KEY, MCORE_RL, ModelLayout
from mcore_rl.fileio.safe_load import restricted_unpickling
from mcore_rl.mapping.weights import unwrap

SCHEMA_VERSION = 1
ADAPTER_SCHEMA_VERSION = 2  # adapter-only (LoRA) steps: no base weights, a ``lora`` record
# a directory in another layout than ``mcore_rl`` (``model_layout.LAYOUT_KEY``: verl_v2 keeps the
# checkpoint in ``model/dist_ckpt/``): builds before it read ``dist_ckpt/`` only, and refuse it by
# the version; LoRA or not, the ``lora`` record says (as for schema 2)
LAYOUT_SCHEMA_VERSION = 3
READABLE_SCHEMAS = (SCHEMA_VERSION, ADAPTER_SCHEMA_VERSION, LAYOUT_SCHEMA_VERSION)
# layout sizes a dp_reshardable optimizer state is tied to (only DP may change)
_DP_RESHARDABLE_FIXED = ("tp", "pp", "vpp", "ep", "etp")  # CP is not: the optimizer shards over DP x CP


def _safe_loading():
    """Context for every dist_checkpointing.load: pickled parts go through the allowlists of
    ``safe_load`` (a planted pickle is refused, never run)."""
    return restricted_unpickling()


# ---- facts recorded in mcore_rl.json ------------------------------------------------------------
def layout_facts(engine) -> dict[str, Any]:
    """Parallel sizes of the world that saves/loads: tp, pp, vpp, cp, ep, etp, dp, world_size."""
    lay = engine.layout
    world = torch.distributed.get_world_size()
    return {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "cp": lay.cp, "ep": lay.ep,
            "etp": lay.expert_tp, "dp": lay.dp(world), "world_size": world}


def arch_facts(args) -> dict[str, Any]:
    """The HF-config facts that must match for a checkpoint to load (sizes, MoE shape)."""
    moe = None
    if args.moe is not None:
        moe = {"num_experts": args.moe.num_experts, "ffn_hidden_size": args.moe.ffn_hidden_size,
               "top_k": args.moe.top_k, "shared_expert_ffn": args.moe.shared_expert_ffn,
               "moe_layers": list(args.moe.moe_layers)}
    return {"model_type": args.arch.model_type, "vocab_size": args.vocab_size,
            "hidden_size": args.hidden_size, "ffn_hidden_size": args.ffn_hidden_size,
            "num_layers": args.num_layers, "num_heads": args.num_heads, "num_kv_heads": args.num_kv_heads,
            "head_dim": args.head_dim, "tie_embeddings": args.tie_embeddings, "moe": moe}


@functools.lru_cache(maxsize=1)  # the installed versions do not change within a process
def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for pkg in ("mcore_rl", "megatron-core", "torch"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def build_metadata(engine, role: str, contents: tuple[str, ...], sharding: str,
                   layout: ModelLayout = MCORE_RL) -> dict[str, Any]:
    """What ``mcore_rl.json`` holds for one engine's checkpoint (a LoRA engine's: schema 2, with
    the ``lora`` record of ``adapters.lora_record``; a directory in another ``layout`` than
    ``mcore_rl``: schema 3, with the layout's name)."""
    meta = {"schema_version": SCHEMA_VERSION, "role": role, "model_type": engine.args.arch.model_type,
            "arch": arch_facts(engine.args), "layout": layout_facts(engine),
            "params_dtype": str(engine.config.params_dtype), "contents": sorted(contents),
            "optimizer_sharding": sharding if "optimizer" in contents else None,
            "versions": dict(versions())}
    record = adapters.lora_record(engine)
    if record is not None:  # older readers refuse it by the version instead of missing the base weights
        meta.update(schema_version=ADAPTER_SCHEMA_VERSION, lora=record)
    if layout != MCORE_RL:
        meta.update({"schema_version": LAYOUT_SCHEMA_VERSION, LAYOUT_KEY: layout.name})
    return meta


@dataclass(frozen=True)
class LoadPlan:
    """What a load does: which contents, whether RNG is restored (same layout only)."""

    contents: tuple[str, ...]
    restore_rng: bool
    sharding: str | None
    model_part: ModelPart = "all"  # adapters.py: all / adapters (LoRA step) / base (under adapters)


def plan_load(meta: dict, engine, role: str, contents: tuple[str, ...], where: str,
              base_load: bool = False) -> LoadPlan:
    """Validates a checkpoint against ``engine`` and decides the load; raises CheckpointError
    before any state is touched (other architecture, contents not saved, impossible reshard,
    LoRA adapters of other settings or on another base). ``base_load``: the engine's start (a
    model directory), where a full model may load under a LoRA engine's adapters."""
    if meta.get("schema_version") not in READABLE_SCHEMAS:
        raise CheckpointError(f"{where}: schema_version={meta.get('schema_version')!r}, this build reads "
                              f"{list(READABLE_SCHEMAS)}; load it with the mcore_rl version that wrote it.")
    if meta.get("role") != role:
        raise CheckpointError(f"{where}: holds role {meta.get('role')!r}, asked for {role!r}; "
                              "pass the engine under the role it was saved as.")
    want = arch_facts(engine.args)
    diffs = [f"{k}: checkpoint {meta['arch'].get(k)!r} vs model {v!r}"
             for k, v in want.items() if meta["arch"].get(k) != v]
    if diffs:
        raise CheckpointError(f"{where}: another architecture ({'; '.join(diffs)}); load a checkpoint "
                              "of this model or build the model from the checkpoint's huggingface/config.json.")
    if "hf_model" in contents:
        raise CheckpointError(f"{where}: contents {list(contents)} hold 'hf_model', an export that is never "
                              "loaded; load 'model' instead, or build a model from the huggingface/ dir.")
    missing = [c for c in contents if c not in meta["contents"]]
    if missing:
        raise CheckpointError(f"{where}: load_contents asks for {missing} but the checkpoint holds only "
                              f"{meta['contents']}; drop them from checkpoint.load_contents.")
    if "optimizer" in contents and engine.optimizer is None:
        raise CheckpointError(f"{where}: 'optimizer' requested for a frozen {role} engine (no optimizer).")
    old, new = meta["layout"], layout_facts(engine)
    sharding = meta.get("optimizer_sharding")
    changed = [k for k in _DP_RESHARDABLE_FIXED if old.get(k) != new[k]]
    if "optimizer" in contents and sharding not in SHARDING_TYPES:
        raise CheckpointError(f"{where}: optimizer_sharding={sharding!r} is not one this build reads "
                              f"{list(SHARDING_TYPES)}; load it with the mcore_rl version that wrote it, or drop "
                              "'optimizer' from checkpoint.load_contents (fresh optimizer).")
    if "optimizer" in contents and sharding == "dp_reshardable" and changed:
        raise CheckpointError(
            f"{where}: the optimizer state is dp_reshardable, which reshards over DP only, but "
            f"{', '.join(f'{k} {old.get(k)} -> {new[k]}' for k in changed)}; resume with the saved "
            f"{', '.join(f'{k}={old.get(k)}' for k in changed)}, or drop 'optimizer' from "
            "checkpoint.load_contents (fresh optimizer), or save with optimizer_sharding=model_space (or "
            "fully_reshardable).")
    part = adapters.plan_part(meta, engine, where, base_load)
    same = old == new
    if "extra" in contents and not same:
        warnings.warn(f"{where}: layout changed ({_layout_str(old)} -> {_layout_str(new)}); model and "
                      "optimizer are resharded, the RNG state is NOT restored (it is per rank).", stacklevel=2)
    return LoadPlan(tuple(contents), "extra" in contents and same, sharding, part)


def _layout_str(facts: dict) -> str:
    return ",".join(f"{k}={facts.get(k)}" for k in ("tp", "pp", "vpp", "cp", "ep", "etp", "dp"))


# ---- RNG --------------------------------------------------------------------------------------
def _coords() -> dict[str, int]:
    ps = parallel_state
    return {"rank": torch.distributed.get_rank(), "tp": ps.get_tensor_model_parallel_rank(),
            "pp": ps.get_pipeline_model_parallel_rank(), "cp": ps.get_context_parallel_rank(),
            "ep": ps.get_expert_model_parallel_rank(), "dp": ps.get_data_parallel_rank()}


def rng_payload() -> dict[str, Any]:
    """This rank's RNG states as plain tensors/ints (no numpy or python objects to unpickle)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),  # host: saved RNG state
                       "gauss": gauss},
            "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)},
            "torch": torch.get_rng_state(), "cuda": cuda,
            "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
            "coords": _coords()}


def restore_rng(payload: dict[str, Any], where: str) -> None:
    """Sets every RNG from ``payload``; the saved coordinates must be this rank's."""
    if payload["coords"] != _coords():
        raise CheckpointError(f"{where}: RNG state saved at {payload['coords']}, this rank is {_coords()}; "
                              "the layout check should have skipped RNG restore (report this).")
    py = payload["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    npy = payload["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"],
                         npy["has_gauss"], npy["cached"]))
    torch.set_rng_state(payload["torch"])
    if payload["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(payload["cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(payload["tracker"])


# ---- sharded state dict -----------------------------------------------------------------------
def model_state(engine, part: ModelPart = "all") -> dict[str, Any]:
    """``model0..model{V-1}``: each chunk's unwrapped GPTModel sharded state dict, the entries
    of ``part`` (``adapters.select``)."""
    return {f"model{i}": adapters.select(engine, i, unwrap(chunk).sharded_state_dict(), part)
            for i, chunk in enumerate(engine.model)}


def sharded_state(engine, contents: tuple[str, ...], sharding: str | None, is_loading: bool,
                  rng: bool = True, part: ModelPart = "all") -> dict:
    """The torch_dist state dict of ``contents`` (model, optimizer, extra) for one engine;
    ``rng=False`` leaves the per-rank RNG out (a load into another layout); ``part``: the model
    entries (a LoRA engine's step: ``adapters``)."""
    models = model_state(engine, part)
    state: dict[str, Any] = {}
    if "model" in contents:
        state.update(models)
    if "optimizer" in contents:
        if engine.optimizer is None:
            raise CheckpointError("'optimizer' in contents for an engine without an optimizer.")
        with torch.no_grad():  # loading re-initialises state in place on leaf params
            if sharding == optimizer_space.SHARDING:
                state["optimizer"] = optimizer_space.sharded_state_dict(engine.optimizer, models, is_loading)
            else:
                state["optimizer"] = engine.optimizer.sharded_state_dict(
                    models, is_loading=is_loading, metadata={"distrib_optim_sharding_type": sharding})
    if "extra" in contents:
        world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
        if rng:
            state["rng_state"] = ShardedObject("rng_state", rng_payload(), (world,), (rank,), replica_id=0)
        if engine.scheduler is not None:
            state["lr_scheduler"] = engine.scheduler.state_dict()
    return state


def apply_loaded(engine, loaded: dict, plan: LoadPlan, where: str) -> None:
    """Copies a loaded state dict into the engine: model, then optimizer (under no_grad), then
    the scheduler (checkpoint wins, one warning per differing value) and RNG when planned."""
    if "model" in plan.contents:
        for i, chunk in enumerate(engine.model):
            adapters.load_chunk(unwrap(chunk), loaded[f"model{i}"], plan.model_part, where)
    if "optimizer" in plan.contents:
        optimizer = loaded["optimizer"]
        if plan.sharding == optimizer_space.SHARDING:
            optimizer = optimizer_space.loaded_state_dict(engine.optimizer, optimizer)
        with torch.no_grad():
            engine.optimizer.load_state_dict(optimizer)
    elif "model" in plan.contents:
        engine.refresh_optimizer_params()  # fp32 main copies follow the loaded weights
    if "extra" in plan.contents:
        if engine.scheduler is not None and "lr_scheduler" in loaded:
            load_scheduler(engine.scheduler, loaded["lr_scheduler"], where)
        if plan.restore_rng:
            restore_rng(loaded["rng_state"], where)


def load_scheduler(scheduler, saved: dict, where: str) -> None:
    """The checkpoint's scheduler values win; each value that differs from the config warns once."""
    current = scheduler.state_dict()
    for key in sorted(set(current) & set(saved)):
        if key != "num_steps" and current[key] != saved[key]:
            warnings.warn(f"{where}: lr scheduler {key}: config {current[key]!r}, checkpoint "
                          f"{saved[key]!r}; using the checkpoint's value.", stacklevel=2)
    scheduler.use_checkpoint_opt_param_scheduler, scheduler.override_opt_param_scheduler = True, False
    scheduler.load_state_dict(saved)
