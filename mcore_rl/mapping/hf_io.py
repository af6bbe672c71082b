"""Lazy reads of HF safetensors checkpoints (the Hub's on-disk format)."""
from __future__ import annotations

import json
import os
from typing import Iterator, Mapping

import torch
from safetensors import safe_open

from mcore_rl.fileio.paths import contained
from mcore_rl.errors import McoreRLError


class HFWeightsError(McoreRLError, FileNotFoundError):
    """A HF directory without readable safetensors weights."""


class SafetensorsReader(Mapping[str, torch.Tensor]):
    """Maps tensor names to tensors of a HF directory; each tensor is read only when asked for.

    Reads ``model.safetensors.index.json`` when present, else every ``*.safetensors`` file. Every
    file name (the index's ``weight_map`` values, the listing) must stay inside the directory
    (``paths.contained``: no ``..``, no absolute path, no symlink leaving it).
    """

    def __init__(self, directory: str | os.PathLike) -> None:
        self.directory = os.fspath(directory)
        index = os.path.join(self.directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            paths = {v: contained(self.directory, v, index, hub_cache=True) for v in set(weight_map.values())}
            self._files = {k: paths[v] for k, v in weight_map.items()}
        else:
            self._files = {}
            for name in sorted(os.listdir(self.directory)):
                if name.endswith(".safetensors"):
                    path = contained(self.directory, name, f"the listing of {self.directory}", hub_cache=True)
                    with safe_open(path, framework="pt") as f:
                        self._files.update({k: path for k in f.keys()})
        if not self._files:
            raise HFWeightsError(
                f"no *.safetensors weights in {self.directory!r}; save the HF model with "
                "save_pretrained(..., safe_serialization=True)."
            )

    def __getitem__(self, key: str) -> torch.Tensor:
        path = self._files[key]
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(key)

    def __iter__(self) -> Iterator[str]:
        return iter(self._files)

    def __len__(self) -> int:
        return len(self._files)
