"""What a load checks before it touches any engine: the marker and every role's metadata and
layout, the trainer state, every file's size against the marker, every file ``.metadata`` names
being one the marker lists (and inside the step), every pickled part read through the
allowlists once, and every tensor key's chunks tiling its shape. A refusal in any role is a refusal before the first role is loaded.
"""
from __future__ import annotations

import os
from typing import Any, Callable

import torch

from mcore_rl.checkpoint import integrity, storage
from mcore_rl.checkpoint.collective import agreed
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.files import META
from mcore_rl.fileio.model_layout import layout_of
from mcore_rl.checkpoint.inventory import (MARKER, PART, PARTS_KIND, TRAINER_STATE, Marker, parse_step_name,
                                          read_marker)
from mcore_rl.fileio.safe_load import restricted_unpickling
from mcore_rl.checkpoint.state import LoadPlan, plan_load
from mcore_rl.fileio.torch_dist_read import TorchDistReader


def check_step(step_dir: str, engines: dict[str, Any], contents: tuple[str, ...],
               choices: Callable[[], str]) -> tuple[dict[str, LoadPlan], dict, Marker]:
    """This rank's view of ``step_dir`` checked for loading ``contents`` into ``engines``:
    (load plan per role, trainer state, marker). ``choices()`` tells the user the alternatives."""
    marker_path = os.path.join(step_dir, MARKER)
    if not os.path.isfile(marker_path):
        raise CheckpointError(f"{step_dir} is not a complete checkpoint (no {MARKER}); {choices()}")
    marker = read_marker(marker_path)
    check_step_number(step_dir, marker)
    integrity.check_sizes(step_dir, _files_to_check(step_dir, marker, list(engines)))  # all named at once
    plans, layouts = {}, {}
    for role, engine in engines.items():
        if role not in marker.roles:
            raise CheckpointError(f"{step_dir} holds roles {list(marker.roles)}, not {role!r}; "
                                  "load only the roles it saved.")
        meta = storage.read_json(os.path.join(step_dir, role, META))
        plans[role] = plan_load(meta, engine, role, tuple(contents), os.path.join(step_dir, role))
        layouts[role] = layout_of(os.path.join(step_dir, role), meta)
    # a step of role parts holds no trainer state of ours (the trainer keeps its own files there)
    trainer_state = {} if marker.kind == PARTS_KIND else storage.read_json(os.path.join(step_dir, TRAINER_STATE))
    for role in engines:
        dist_dir = layouts[role].dist_dir(os.path.join(step_dir, role))
        for rel, size in storage.expected_files(dist_dir).items():
            recorded = marker.files.get(f"{role}/{layouts[role].dist_rel(rel)}")
            if recorded is None or recorded[0] < size:
                raise CheckpointError(
                    f"{dist_dir}/.metadata names {rel} ({size} bytes or more), which the {MARKER} marker "
                    f"{'does not list' if recorded is None else f'records with {recorded[0]} bytes'}; the "
                    "checkpoint is damaged or was tampered with: resume another step.")
    return plans, trainer_state, marker


def check_step_number(step_dir: str, marker: Marker) -> None:
    """A step directory named ``global_step_<N>`` holds the marker of step N: a step copied or
    renamed under another number must not load as that number (its trainer state, its tracker)."""
    named = parse_step_name(os.path.basename(os.path.normpath(step_dir)))
    if named is not None and named != marker.step:
        raise CheckpointError(f"{os.path.join(step_dir, MARKER)} is the marker of step {marker.step}, but the "
                              f"directory is named for step {named}: it was copied or renamed; put it back under "
                              f"global_step_{marker.step} (or load it from a directory not named for a step).")


def _files_to_check(step_dir: str, marker: Marker, roles: list[str]) -> dict[str, tuple[int, str | None]]:
    """The marker's files a load needs present: all of them for a step written whole; for a
    sealed step of role parts (whose older roles retention may have removed), the loaded roles'
    parts and every file outside the parts (the trainer's)."""
    if marker.kind != PARTS_KIND:
        return marker.files
    for role in (r for r in roles if r in marker.roles):
        if not os.path.isfile(os.path.join(step_dir, role, PART)):
            raise CheckpointError(f"{step_dir}: the {role} part was removed by retention (its {role}/{PART} "
                                  f"record is gone; the step still holds {_held(step_dir, marker)}); resume a "
                                  "step that holds it, or raise the trainer's max_ckpt_to_keep for this role.")
    return {rel: v for rel, v in marker.files.items()
            if rel.split("/")[0] in roles or rel.split("/")[0] not in marker.roles}


def _held(step_dir: str, marker: Marker) -> list[str]:
    return [r for r in marker.roles if os.path.isfile(os.path.join(step_dir, r, PART))]


def preread_pickles(step_dir: str, roles: list[str]) -> None:
    """Collective: every pickled part of the roles' checkpoints (``common.pt``, the ShardedObject
    payloads) read once through the allowlists, and every tensor key's chunks checked to tile
    its shape (``check_dist_dirs``), the work split over the ranks; a refusal is an error on every
    rank, before any engine is loaded."""
    dirs = [os.path.join(step_dir, role) for role in roles]
    check_dist_dirs([layout_of(d).dist_dir(d) for d in dirs], pickles=True)


def check_dist_dirs(dist_dirs: list[str], pickles: bool) -> None:
    """Collective: in each torch_dist directory every tensor key's saved chunks tile its global
    shape (``torch_dist_read.check_tiling``, the merge's check: a load by overlap leaves
    uninitialised memory where a chunk is missing when it reads into fresh buffers, as
    ``optimizer_space`` and the verified load do, the old values when it reads in place), and
    (``pickles``) every pickled part read through the allowlists; split over the ranks."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    agreed(lambda: _read(dist_dirs, pickles, rank, world), f"checking the parts of {', '.join(dist_dirs)}")


def _read(dist_dirs: list[str], pickles: bool, rank: int, world: int) -> None:
    """This rank's share of the checks (the same list on every rank)."""
    readers = {}
    parts: list[tuple[str, str, str | None]] = []
    for dist_dir in dist_dirs:
        readers[dist_dir] = TorchDistReader(dist_dir)
        if pickles:
            parts += [(dist_dir, "common", None)] + [(dist_dir, "object", key) for key in readers[dist_dir].objects]
        parts += [(dist_dir, "tensor", key) for key in sorted(readers[dist_dir].tensors)]
    for dist_dir, kind, key in parts[rank::world]:
        if kind == "common":
            with restricted_unpickling():  # torch.load forced to weights_only, this file named
                torch.load(os.path.join(dist_dir, "common.pt"), map_location="cpu")
        elif kind == "object":
            readers[dist_dir].read_object(key)
        else:
            readers[dist_dir].check_key(key)
