"""Loading one model directory (``mcore_rl.json`` and, in its ``fileio.model_layout``, the megatron
checkpoint and the HF files: a role of a CheckpointManager step, verl's ``model/dist_ckpt/``
included, or a converter's output) into an engine at any parallel layout."""
from __future__ import annotations

import os
from functools import partial
from typing import Callable

import torch

from megatron.core import dist_checkpointing

from mcore_rl.checkpoint import integrity, model_record, storage
from mcore_rl.checkpoint.collective import agreed
from mcore_rl.checkpoint.load_checks import check_dist_dirs
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.base_identity import model_dir_identity
from mcore_rl.fileio.files import META
from mcore_rl.fileio.model_layout import layout_of
from mcore_rl.checkpoint.state import LoadPlan, _safe_loading, apply_loaded, plan_load, sharded_state
from mcore_rl.checkpoint.verified_read import Recorded, VerifiedLoadStrategy
from mcore_rl.mapping.weights import unwrap


def read_plan(model_dir: str, engine, role: str, contents: tuple[str, ...], base_load: bool = False) -> LoadPlan:
    """Validates ``model_dir``'s metadata against ``engine`` (raises before any state is touched);
    ``base_load``: see ``state.plan_load``."""
    meta_path = os.path.join(model_dir, META)
    if not os.path.isfile(meta_path):
        raise CheckpointError(f"{model_dir} has no {META}; it is not a model directory written by "
                              "mcore_rl (convert a HF model with converters/hf_to_mcore.py).")
    return plan_load(storage.read_json(meta_path), engine, role, tuple(contents), model_dir, base_load)


def verify_model_dir(model_dir: str) -> tuple[int, int]:
    """Collective: ``model_dir``'s record (``model_record.find_record``: the step's marker, a
    part's record or a converter's RECORD) found on every rank, every file ``.metadata`` names and
    mcore_rl.json recorded, and every recorded file's size and CRC-32 checked on every node, the
    work split by size over the node's ranks. Returns the (device, inode) of its megatron
    checkpoint dir, to check after the load that the directory was not replaced meanwhile
    (``same_identity``)."""
    def find() -> tuple[model_record.DirRecord, tuple[int, int]]:
        layout = layout_of(model_dir)
        dist_dir = layout.dist_dir(model_dir)
        ident = _identity(dist_dir)
        record = model_record.find_record(model_dir)
        needed = [META] + [layout.dist_rel(rel) for rel in storage.expected_files(dist_dir)]
        missing = sorted(set(needed) - set(record.files))
        if missing:
            raise CheckpointError(f"{model_dir}: {missing[:8]} not in its record {record.source}: the files were "
                                  "added or renamed after it was written; restore the directory.")
        return record, ident

    record, ident = agreed(find, f"checking the record of {model_dir}")
    group = storage.node_ranks()
    sizes = {rel: size for rel, (size, _) in record.files.items()}
    mine = integrity.share(sorted(sizes), sizes, group.index(torch.distributed.get_rank()), len(group))
    part = model_record.DirRecord(record.path, record.source, {rel: record.files[rel] for rel in mine})
    agreed(lambda: model_record.verify(part, []), f"verifying the content of {model_dir}")
    return ident


def same_identity(model_dir: str, ident: tuple[int, int]) -> None:
    """Collective: ``model_dir``'s megatron checkpoint dir is still the one ``verify_model_dir`` checked."""
    def check() -> None:
        if _identity(layout_of(model_dir).dist_dir(model_dir)) != ident:
            raise CheckpointError(f"{model_dir} was replaced while it was loaded (a save of the same step or a "
                                  "copy changed it); the engine may hold a mix of two saves: load it again.")
    agreed(check, f"checking {model_dir} after the load")


def _identity(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e}); the model directory is incomplete or "
                              "was removed.") from None
    return st.st_dev, st.st_ino


def load_planned(model_dir: str, engine, plan: LoadPlan, keep_prefix: str | None = None,
                 verified: tuple[Recorded, str, str] | None = None, later: bool = False) -> Callable[[], None]:
    """Reads ``plan.contents`` from ``model_dir``'s megatron checkpoint (``dist_ckpt/``, verl's
    ``model/dist_ckpt/``) into ``engine`` (collective).
    Model keys starting with ``keep_prefix`` are not read: those parameters keep their values.
    ``verified``: (the record of the dist dir's files, the step dir and the dist dir's name in
    it): every shard item is checked against its recorded checksum while it is read
    (``verified_read``). ``later``: read (when ``verified``) into fresh host buffers and return the function that
    applies them to the engine (else applied before this returns; the returned function then
    does nothing)."""
    dist_dir = agreed(lambda: layout_of(model_dir).dist_dir(model_dir), f"reading {os.path.join(model_dir, META)}")
    agreed(lambda: storage.check_files(dist_dir, storage.expected_files(dist_dir)),  # every file there, none
           f"checking {dist_dir}")                                                   # outside it, on every node
    state = sharded_state(engine, plan.contents, plan.sharding, is_loading=True, rng=plan.restore_rng,
                          part=plan.model_part)
    kept = _split_off(engine, state, keep_prefix) if keep_prefix else {}
    with _safe_loading():
        strategy = VerifiedLoadStrategy(*verified, fresh=later) if verified is not None else ("torch_dist", 1)
        loaded = dist_checkpointing.load(state, dist_dir, sharded_strategy=strategy)
    for key, tensors in kept.items():
        loaded[key].update(tensors)
    apply = partial(apply_loaded, engine, loaded, plan, model_dir)
    if later:
        return apply
    apply()
    return lambda: None


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


def load_model_dir(model_dir: str, engine, init_value_head: bool = False, verify: bool = True) -> None:
    """Loads the ``model`` contents of ``model_dir`` into ``engine`` at any TP/PP/EP layout
    (collective over the engine's world). The engine's role must be the directory's, except with
    ``init_value_head=True``: a critic engine takes the trunk of an actor directory (its LM head
    is not read) and keeps its value head's initialisation, as ``load_hf`` does for a causal LM.
    ``verify``: first every file is checked against the directory's record (``verify_model_dir``).
    A LoRA engine takes a full directory as its base (its adapters keep their values; ``engine.base``
    becomes the directory's identity, which adapter-only checkpoints record), or an adapter-only
    directory of the same LoRA settings trained on its base."""
    if init_value_head and engine.role != "critic":
        raise CheckpointError(f"init_value_head=True loads an actor's trunk into a critic; the engine is "
                              f"a {engine.role!r}: drop init_value_head.")
    role = "actor" if init_value_head else engine.role
    model_dir = os.path.abspath(model_dir)
    ident = verify_model_dir(model_dir) if verify else None
    plan = agreed(lambda: read_plan(model_dir, engine, role, ("model",), base_load=True), f"checking {model_dir}")
    dist_dir = agreed(lambda: layout_of(model_dir).dist_dir(model_dir), f"reading {os.path.join(model_dir, META)}")
    check_dist_dirs([dist_dir], pickles=False)  # its chunks tile every tensor
    base = agreed(lambda: _base_identity(model_dir), f"identifying {model_dir}") if plan.model_part == "base" else None
    load_planned(model_dir, engine, plan, keep_prefix="output_layer." if init_value_head else None)
    if ident is not None:
        same_identity(model_dir, ident)
    if base is not None:
        engine.base = base


def _base_identity(model_dir: str) -> dict:
    """``model_dir``'s identity as a LoRA base: from the record that vouches for it (read, not
    re-verified), else from its files."""
    try:
        record = model_record.find_record(model_dir)
    except CheckpointError:  # verify=False on a directory without a record
        return model_dir_identity(model_dir, None, None)
    return model_dir_identity(model_dir, record.source, record.files)
