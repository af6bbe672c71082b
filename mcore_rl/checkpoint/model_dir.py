"""Loading one model directory (``dist_ckpt/``, ``huggingface/``, ``mcore_rl.json``: a role of a
CheckpointManager step, or a converter's output) into an engine at any layout."""
from __future__ import annotations

import os

from megatron.core import dist_checkpointing

from mcore_rl.checkpoint import storage
from mcore_rl.checkpoint.errors import CheckpointError
from mcore_rl.checkpoint.files import META
from mcore_rl.checkpoint.state import LoadPlan, _safe_loading, apply_loaded, plan_load, sharded_state


def read_plan(model_dir: str, engine, role: str, contents: tuple[str, ...]) -> LoadPlan:
    """Validates ``model_dir``'s metadata against ``engine`` (raises before any state is touched)."""
    meta_path = os.path.join(model_dir, META)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{model_dir} has no {META}; it is not a model directory written by "
                              "mcore_rl (convert a HF model with converters/hf_to_mcore.py).")
    return plan_load(storage.read_json(meta_path), engine, role, tuple(contents), model_dir)


def load_planned(model_dir: str, engine, plan: LoadPlan) -> None:
    """Reads ``plan.contents`` from ``model_dir/dist_ckpt`` into ``engine`` (collective)."""
    state = sharded_state(engine, plan.contents, plan.sharding, is_loading=True, rng=plan.restore_rng)
    with _safe_loading():
        loaded = dist_checkpointing.load(state, os.path.join(model_dir, "dist_ckpt"),
                                         sharded_strategy=("torch_dist", 1))
    apply_loaded(engine, loaded, plan, model_dir)


def load_model_dir(model_dir: str, engine) -> None:
    """Loads the ``model`` contents of ``model_dir`` into ``engine`` (any TP/PP/EP layout; the
    engine's role must be the directory's). Collective over the engine's world."""
    load_planned(model_dir, engine, read_plan(model_dir, engine, engine.role, ("model",)))
