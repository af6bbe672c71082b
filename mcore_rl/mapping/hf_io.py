"""Lazy reads of HF safetensors checkpoints (the Hub's on-disk format).

Every file's header is checked before the safetensors library opens it
(``fileio.safetensors_header.check_safetensors``: length within the library's 100 MB cap and the
file, a JSON object of tensor entries whose bytes match dtype and shape and tile the data). A
damaged file, index or header is a ``SafetensorsFormatError`` naming the file.
"""
from __future__ import annotations

import json
import os
from typing import Iterator, Mapping

import torch
from safetensors import SafetensorError, safe_open

from mcore_rl.errors import CheckpointError, McoreRLError
from mcore_rl.fileio.paths import contained
from mcore_rl.fileio.safetensors_header import check_safetensors
from mcore_rl.mapping.fp8_dequant import dequantize
from mcore_rl.mapping.mxfp4 import dequantize_mxfp4
from mcore_rl.mapping.mxfp4_import import STORED_MXFP4, plan_quantized

class HFWeightsError(McoreRLError, FileNotFoundError):
    """A HF directory without readable safetensors weights."""


class SafetensorsFormatError(McoreRLError, ValueError):
    """A safetensors file, header or index that is damaged or not safetensors."""


def read_header(path: str) -> dict[str, dict]:
    """The tensor entries (name -> {dtype, shape, data_offsets}) of the safetensors file ``path``,
    checked as the library checks them (``fileio.safetensors_header``); a SafetensorsFormatError
    naming the file otherwise."""
    try:
        return check_safetensors(path)
    except CheckpointError as e:
        raise SafetensorsFormatError(str(e)) from None
    except OSError as e:
        raise SafetensorsFormatError(f"{path} is unreadable ({e.strerror or e}).") from None


class SafetensorsReader(Mapping[str, torch.Tensor]):
    """Maps tensor names to tensors of a HF directory; each tensor is read only when asked for.

    Reads ``model.safetensors.index.json`` when present, else every ``*.safetensors`` file. Every
    file name (the index's ``weight_map`` values, the listing) must stay inside the directory
    (``paths.contained``: no ``..``, no absolute path, no symlink leaving it); every file's
    header is checked (``read_header``) and the index may name only tensors its file holds.

    FP8 checkpoints (``mapping.fp8_dequant``): an FP8 weight is read dequantized with its scale,
    in fp32, rounded once to ``dequant_dtype`` [same shape]; scales and activation scales are not
    among the keys; the config's quantization method and every scale's shape are checked here.
    MXFP4 checkpoints (``mapping.mxfp4_import``): ``X_blocks`` + ``X_scales`` read as ``X``
    [*lead, cols, rows], dequantized in fp32 and rounded once to ``dequant_dtype``; the parts
    are not among the keys; ``stored_dtypes`` records ``X`` as ``"MXFP4"``.
    """

    def __init__(self, directory: str | os.PathLike, dequant_dtype: torch.dtype = torch.float32) -> None:
        self.directory = os.fspath(directory)
        self.dequant_dtype = dequant_dtype
        entries: dict[str, dict] = {}
        index = os.path.join(self.directory, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = read_weight_map(index)
            paths = {v: contained(self.directory, v, index, hub_cache=True) for v in set(weight_map.values())}
            held = {v: read_header(p) for v, p in paths.items()}
            entries = {k: held[v][k] for k, v in weight_map.items() if k in held[v]}
            absent = sorted(k for k, v in weight_map.items() if k not in held[v])
            if absent:
                raise SafetensorsFormatError(f"{index} maps {absent[:4]} to files that do not hold them; the index "
                                             "does not belong to these files: copy the model again.")
            self._files = {k: paths[v] for k, v in weight_map.items()}
        else:
            self._files = {}
            names = sorted(os.listdir(self.directory)) if os.path.isdir(self.directory) else []
            for name in names:
                if name.endswith(".safetensors"):
                    path = contained(self.directory, name, f"the listing of {self.directory}", hub_cache=True)
                    header = read_header(path)
                    entries.update(header)
                    self._files.update({k: path for k in header})
        if not self._files:
            raise HFWeightsError(
                f"no *.safetensors weights in {self.directory!r}; save the HF model with "
                "save_pretrained(..., safe_serialization=True)."
            )
        self.fp8, self.mxfp4 = plan_quantized(entries, self.directory)
        of_blocks, hidden = {b: x for x, (b, _) in self.mxfp4.tensors.items()}, self.fp8.hidden | self.mxfp4.hidden
        self._keys = [of_blocks.get(k, k) for k in self._files  # an MXFP4 parameter in its blocks' place
                      if k in of_blocks or k not in hidden]
        # safetensors names, as on disk; an MXFP4 parameter "MXFP4"
        self.stored_dtypes = {k: STORED_MXFP4 if k in self.mxfp4.tensors else entries[k]["dtype"] for k in self._keys}
        self.shapes = {k: self.mxfp4.shapes.get(k) or tuple(entries[k]["shape"]) for k in self._keys}

    @property
    def quantized(self) -> bool:
        """Whether config.json declares FP8 or MXFP4 (the converter then records ``stored_dtypes``)."""
        return self.fp8.scheme is not None or self.mxfp4.active

    def read_part(self, key: str, index: int) -> torch.Tensor:
        """``self[key][index]`` reading only that slice (an FP8 weight: dequantized whole; an
        MXFP4 one: the blocks and scales of that index of its leading dimension)."""
        if key in self.fp8.scales or (key in self.mxfp4.tensors and len(self.shapes[key]) < 3):
            return self[key][index]
        if key in self.mxfp4.tensors:
            blocks, scales = self.mxfp4.tensors[key]
            return dequantize_mxfp4(self._read_part(blocks, index), self._read_part(scales, index),
                                    self.dequant_dtype, f"{key!r}[{index}]")
        return self._read_part(key, index)

    def _read_part(self, key: str, index: int) -> torch.Tensor:
        """``key``'s slice ``index`` of its first dimension, as stored."""
        path = self._files[key]
        try:
            with safe_open(path, framework="pt") as f:
                return f.get_slice(key)[index]
        except (SafetensorError, OSError, ValueError, RuntimeError, MemoryError) as e:
            raise SafetensorsFormatError(f"{path}: tensor {key!r} is unreadable ({type(e).__name__}: "
                                         f"{' '.join(str(e).split())[:200]}); copy the file again.") from None

    def __getitem__(self, key: str) -> torch.Tensor:
        if key in self.fp8.hidden or key in self.mxfp4.hidden:
            raise KeyError(key)
        if key in self.mxfp4.tensors:
            blocks, scales = self.mxfp4.tensors[key]
            return dequantize_mxfp4(self._read(blocks), self._read(scales), self.dequant_dtype, repr(key))
        scale = self.fp8.scales.get(key)
        if scale is None:
            return self._read(key)
        return dequantize(self._read(key), self._read(scale), self.fp8.scheme, self.dequant_dtype, repr(key))

    def _read(self, key: str) -> torch.Tensor:
        """The tensor ``key`` as stored."""
        path = self._files[key]
        try:
            with safe_open(path, framework="pt") as f:
                return f.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError, MemoryError) as e:
            raise SafetensorsFormatError(f"{path}: tensor {key!r} is unreadable ({type(e).__name__}: "
                                         f"{' '.join(str(e).split())[:200]}); copy the file again.") from None

    def __contains__(self, key: object) -> bool:
        return key in self.shapes  # without reading (Mapping's would read and dequantize)

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)


def read_weight_map(index: str) -> dict[str, str]:
    """The ``weight_map`` of a HF index file (tensor name -> file name), checked."""
    try:
        with open(index, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise SafetensorsFormatError(f"{index} is not readable JSON ({type(e).__name__}: {e}); copy the model "
                                     "again.") from None
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise SafetensorsFormatError(f"{index} holds no weight_map of tensor names to file names (got "
                                     f"{type(weight_map).__name__}); the index is damaged: copy the model again.")
    bad = next(((k, v) for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
    if bad is not None:
        raise SafetensorsFormatError(f"{index}: weight_map maps {bad[0]!r} to {bad[1]!r}, not a file name; the "
                                     "index is damaged: copy the model again.")
    return weight_map
