"""Where a model directory keeps its megatron checkpoint and its HF files: one reader for the
two layouts mcore_rl writes.

- ``mcore_rl`` (the main job, converter outputs, every step written before layouts were
  recorded): ``<dir>/dist_ckpt/`` and ``<dir>/huggingface/``.
- ``verl_v2`` (steps written under verl, verl 0.9.1's Megatron layout, schema 2):
  ``<dir>/model/dist_ckpt/`` and ``<dir>/model/huggingface/``, plus verl's ``ckpt_contents.json``
  manifest. mcore_rl's one megatron checkpoint (model, optimizer, RNG, LR scheduler) lives in
  ``model/dist_ckpt/``; the manifest says where each content is.

A directory's layout is recorded in its ``mcore_rl.json`` (``"model_layout"``; ``"layout"`` there
is the parallel layout the model was saved at); a record without the key is the ``mcore_rl``
layout. No torch or megatron import.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.files import META

LAYOUT_KEY = "model_layout"  # mcore_rl.json: the layout name; absent = "mcore_rl"
CONTENTS_MANIFEST = "ckpt_contents.json"  # verl's manifest of a verl_v2 directory (schema 2)


@dataclass(frozen=True)
class ModelLayout:
    """Paths inside a model directory, relative to it (``/``-separated)."""

    name: str
    dist: str  # the megatron torch_dist checkpoint
    hf: str  # HF config, tokenizer (and exported weights)
    manifest: str | None = None  # a file naming where each content is (verl's ckpt_contents.json)

    def dist_dir(self, model_dir: str) -> str:
        return os.path.join(model_dir, *self.dist.split("/"))

    def hf_dir(self, model_dir: str) -> str:
        return os.path.join(model_dir, *self.hf.split("/"))

    def top_dirs(self) -> frozenset[str]:
        """The entries this layout puts directly in a model directory (besides its files)."""
        return frozenset({self.dist.split("/")[0], self.hf.split("/")[0]})

    def entries(self) -> frozenset[str]:
        """Everything this layout puts directly in a model directory besides ``mcore_rl.json``."""
        return self.top_dirs() | ({self.manifest} if self.manifest else set())

    def dist_rel(self, rel: str) -> str:
        """``rel`` (a path inside the dist checkpoint) relative to the model directory."""
        return f"{self.dist}/{rel}"


MCORE_RL = ModelLayout("mcore_rl", "dist_ckpt", "huggingface")
VERL_V2 = ModelLayout("verl_v2", "model/dist_ckpt", "model/huggingface", CONTENTS_MANIFEST)
LAYOUTS = {layout.name: layout for layout in (MCORE_RL, VERL_V2)}


def layout_named(name: object, where: str) -> ModelLayout:
    """The layout ``name`` (a recorded value) refers to; anything else is an error naming it."""
    if name is None:
        return MCORE_RL
    if not isinstance(name, str) or name not in LAYOUTS:
        raise CheckpointError(f"{where}: {LAYOUT_KEY}={name!r} is not a layout this build reads "
                              f"({sorted(LAYOUTS)}); read it with the mcore_rl version that wrote it.")
    return LAYOUTS[name]


def layout_of(model_dir: str, meta: dict | None = None) -> ModelLayout:
    """The layout of ``model_dir`` from its ``mcore_rl.json`` (``meta``: that file, already
    read). A directory without the file is read as the ``mcore_rl`` layout."""
    if meta is None:
        path = os.path.join(model_dir, META)
        try:
            with open(path) as f:
                meta = json.load(f)
        except FileNotFoundError:
            return MCORE_RL
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); restore the file.") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{os.path.join(model_dir, META)} is not a JSON object; restore the file.")
    return layout_named(meta.get(LAYOUT_KEY), os.path.join(model_dir, META))
