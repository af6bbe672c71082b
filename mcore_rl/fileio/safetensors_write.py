"""Streaming safetensors writer: shards planned up front, tensors appended one at a time.

Given the ordered (name, shape, dtype) of every tensor, ``plan_shards`` splits them as
transformers does (greedy, a tensor larger than the limit is a shard of its own); each file's
header is written when the file is opened, then each tensor's bytes as it is produced. Never more
than one tensor is held by the writer. Output: ``model.safetensors`` (one shard) or
``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``.
"""
from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.faults import io_fault
from mcore_rl.fileio.files import Writeback

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HF_DTYPE_NAMES: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # --dtype -> torch name
_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}


def dtype_of_name(name: str, where: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype name (``"BF16"`` -> torch.bfloat16); a
    CheckpointError naming ``where`` for a name this writer cannot write."""
    for dtype, text in _DTYPES.items():
        if text == name:
            return dtype
    raise CheckpointError(f"{where}: dtype {name!r} is not one of {sorted(_DTYPES.values())}; the record is "
                          "damaged: write it again.")


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class SafetensorsWriteError(CheckpointError):
    """Bad shard size, or tensors written out of the planned order or shape."""


def parse_size(size: int | str) -> int:
    """Bytes of ``size``: an int or a string like "5GB" (10^9) or "500MiB" (2^20), as HF reads it."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", str(size).upper())
        if m is None or m[2] not in _UNITS:
            raise SafetensorsWriteError(
                f"max_shard_size={size!r} is not a size; use bytes (an integer) or a string like "
                "'5GB', '500MB' or '2GiB'.")
        value = int(float(m[1]) * _UNITS[m[2]])
    if value <= 0:
        raise SafetensorsWriteError(f"max_shard_size={size!r} must be > 0 bytes.")
    return value


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its HF name, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()  # host: a 0-d probe for the element size


def plan_shards(specs: list[TensorSpec], max_shard_size: int | str) -> list[list[TensorSpec]]:
    """Tensors grouped into shards of at most ``max_shard_size`` bytes, in order (HF's greedy rule:
    a new shard when the next tensor would overflow the current one)."""
    limit = parse_size(max_shard_size)
    shards: list[list[TensorSpec]] = []
    current, size = [], 0
    for spec in specs:
        if current and size + spec.nbytes > limit:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        shards.append(current)
    return shards


def _header(shard: list[TensorSpec]) -> bytes:
    entries: dict = {"__metadata__": {"format": "pt"}}
    begin = 0
    for spec in shard:
        if spec.dtype not in _DTYPES:
            raise SafetensorsWriteError(f"{spec.name}: dtype {spec.dtype} has no safetensors code.")
        entries[spec.name] = {"dtype": _DTYPES[spec.dtype], "shape": list(spec.shape),
                              "data_offsets": [begin, begin + spec.nbytes]}
        begin += spec.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(text)) + text


class ShardedSafetensorsWriter:
    """Writes ``specs`` into ``directory`` as planned; call ``write(name, tensor)`` for every spec
    in order, then ``close()`` (writes the index when there is more than one shard)."""

    def __init__(self, directory: str, specs: list[TensorSpec], max_shard_size: int | str) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise SafetensorsWriteError(f"duplicate tensor names: {sorted({n for n in names if names.count(n) > 1})}")
        self.directory = directory
        self.shards = plan_shards(specs, max_shard_size)
        n = len(self.shards)
        self.files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self._order = [(i, spec) for i, shard in enumerate(self.shards) for spec in shard]
        self._next = 0
        self._file = None
        self._file_index = -1
        self.bytes_written = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Appends ``tensor`` (must be the next planned name, with its shape and dtype)."""
        if self._next >= len(self._order):
            raise SafetensorsWriteError(f"{name}: every planned tensor is already written.")
        shard, spec = self._order[self._next]
        if name != spec.name or tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise SafetensorsWriteError(
                f"got {name} {tuple(tensor.shape)} {tensor.dtype}, the plan's next tensor is "
                f"{spec.name} {spec.shape} {spec.dtype}.")
        if shard != self._file_index:
            self._open(shard)
        data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        if self._next:
            io_fault("write", self._file.name)  # test-only: a disk that fills up mid-model
        self._file.write(memoryview(data))
        self._writeback.poke()
        self.bytes_written += spec.nbytes
        self._next += 1

    def _open(self, shard: int) -> None:
        self._close_file()
        self._file = open(os.path.join(self.directory, self.files[shard]), "wb")
        self._writeback = Writeback(self._file)
        self._file.write(_header(self.shards[shard]))
        self._file_index = shard

    def _close_file(self) -> None:
        """Flushes, fsyncs (a merged model is durable once written) and closes the open shard."""
        if self._file is not None:
            self._writeback.close()
            self._file.close()
            self._file = None

    def close(self) -> None:
        """Closes the last shard and writes the index; errors if tensors are missing."""
        self._close_file()
        if self._next != len(self._order):
            missing = [s.name for _, s in self._order[self._next:]]
            raise SafetensorsWriteError(f"{len(missing)} planned tensors were never written: {missing[:8]}")
        if len(self.files) > 1:
            weight_map = {s.name: self.files[i] for i, s in self._order}
            total = sum(s.nbytes for _, s in self._order)
            with open(os.path.join(self.directory, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def write_bucket_shards(directory: str, buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> list[str]:
    """Writes each bucket of (HF name, full tensor) as one shard of ``directory`` (created), named
    and indexed as transformers does (``model.safetensors`` when there is one bucket); holds one
    bucket at a time. Returns the file names. Shards get their final names once all are written."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    parts: list[tuple[str, list[str]]] = []
    total = 0
    for i, bucket in enumerate(buckets):
        part = f".partial-{i:05d}.safetensors"
        save_file({n: t.detach().contiguous() for n, t in bucket}, os.path.join(directory, part),
                  metadata={"format": "pt"})
        parts.append((part, [n for n, _ in bucket]))
        total += sum(t.numel() * t.element_size() for _, t in bucket)
    n = len(parts)
    files = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for (part, names), name in zip(parts, files):
        os.replace(os.path.join(directory, part), os.path.join(directory, name))
        weight_map.update({k: name for k in names})
    if n > 1:
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files
