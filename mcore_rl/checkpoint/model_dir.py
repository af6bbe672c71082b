"""Loading one model directory (``dist_ckpt/``, ``huggingface/``, ``mcore_rl.json``: a role of a
CheckpointManager step, or a converter's output) into an engine at any layout."""
from __future__ import annotations

import os

from megatron.core import dist_checkpointing

from mcore_rl.checkpoint import storage
from mcore_rl.checkpoint.collective import agreed
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.files import META
from mcore_rl.checkpoint.state import LoadPlan, _safe_loading, apply_loaded, plan_load, sharded_state
from mcore_rl.mapping.weights import unwrap


def read_plan(model_dir: str, engine, role: str, contents: tuple[str, ...]) -> LoadPlan:
    """Validates ``model_dir``'s metadata against ``engine`` (raises before any state is touched)."""
    meta_path = os.path.join(model_dir, META)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{model_dir} has no {META}; it is not a model directory written by "
                              "mcore_rl (convert a HF model with converters/hf_to_mcore.py).")
    return plan_load(storage.read_json(meta_path), engine, role, tuple(contents), model_dir)


def load_planned(model_dir: str, engine, plan: LoadPlan, keep_prefix: str | None = None) -> None:
    """Reads ``plan.contents`` from ``model_dir/dist_ckpt`` into ``engine`` (collective).
    Model keys starting with ``keep_prefix`` are not read: those parameters keep their values."""
    dist_dir = os.path.join(model_dir, "dist_ckpt")
    agreed(lambda: storage.check_files(dist_dir, storage.expected_files(dist_dir)),  # every file there, none
           f"checking {dist_dir}")                                                   # outside it, on every node
    state = sharded_state(engine, plan.contents, plan.sharding, is_loading=True, rng=plan.restore_rng)
    kept = _split_off(engine, state, keep_prefix) if keep_prefix else {}
    with _safe_loading():
        loaded = dist_checkpointing.load(state, dist_dir, sharded_strategy=("torch_dist", 1))
    for key, tensors in kept.items():
        loaded[key].update(tensors)
    apply_loaded(engine, loaded, plan, model_dir)


def _split_off(engine, state: dict, prefix: str) -> dict[str, dict]:
    """Removes the model keys under ``prefix`` from ``state``; returns the engine's own current
    tensors for them (per ``model{i}``), which the strict load then writes back unchanged."""
    kept = {}
    for i, chunk in enumerate(engine.model):
        part = state.get(f"model{i}", {})
        current = unwrap(chunk).state_dict()
        names = [k for k in part if k.startswith(prefix)]
        kept[f"model{i}"] = {k: current[k] for k in names}
        for k in names:
            del part[k]
    return kept


def load_model_dir(model_dir: str, engine, init_value_head: bool = False) -> None:
    """Loads the ``model`` contents of ``model_dir`` into ``engine`` at any TP/PP/EP layout
    (collective over the engine's world). The engine's role must be the directory's, except with
    ``init_value_head=True``: a critic engine takes the trunk of an actor directory (its LM head
    is not read) and keeps its value head's initialisation, as ``load_hf`` does for a causal LM."""
    if init_value_head and engine.role != "critic":
        raise CheckpointError(f"init_value_head=True loads an actor's trunk into a critic; the engine is "
                              f"a {engine.role!r}: drop init_value_head.")
    role = "actor" if init_value_head else engine.role
    plan = agreed(lambda: read_plan(model_dir, engine, role, ("model",)), f"checking {model_dir}")
    load_planned(model_dir, engine, plan, keep_prefix="output_layer." if init_value_head else None)
