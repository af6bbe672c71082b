"""Reads a megatron ``torch_dist`` checkpoint directory without megatron or torch.distributed.

The directory holds ``.metadata`` (a pickle of torch.distributed.checkpoint's ``Metadata``: per key
the global shape, dtype and the chunks (offsets, sizes) that were written, and per chunk the file,
byte offset and length) and ``__<rank>_<n>.distcp`` files (each chunk a ``torch.save`` payload).
``.metadata`` is read only through ``safe_load``'s allowlist unpickler, tensor chunks only with
``torch.load(weights_only=True)``, ShardedObject payloads (bytes items) through torch's weights_only
unpickler cut to torch's own allowlist (``safe_load.load_payload``). A read assembles only the chunks overlapping the
requested part, so memory per read is that part (plus one chunk in flight).
"""
from __future__ import annotations

import io
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.paths import contained
from mcore_rl.fileio.safe_load import load_payload, restricted_pickle_load

METADATA_FILE = ".metadata"


class TorchDistReadError(CheckpointError):
    """A torch_dist directory that cannot be read as asked (missing/truncated file, unknown key)."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor key: global shape and dtype, and the written chunks as (offsets, sizes)."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


class TorchDistReader:
    """Lazy reader of one torch_dist directory (``<model dir>/dist_ckpt``).

    ``tensors``: key -> TensorInfo; ``objects``: keys of ShardedObject (bytes) items.
    ``read(key, index)``: the global tensor, or its part at leading indices ``index``
    (e.g. ``(layer,)`` or ``(layer, expert)``) with those dims removed.
    """

    def __init__(self, dist_dir: str | os.PathLike) -> None:
        self.path = os.fspath(dist_dir)
        meta_path = os.path.join(self.path, METADATA_FILE)
        if not os.path.isfile(meta_path):
            raise TorchDistReadError(
                f"{self.path} is not a torch_dist checkpoint: {meta_path} does not exist. Pass the "
                "dist_ckpt/ directory of a model dir written by CheckpointManager or a converter.")
        with open(meta_path, "rb") as f:
            self._meta = restricted_pickle_load(f, source=meta_path)
        self.tensors: dict[str, TensorInfo] = {}
        self.objects: list[str] = []
        for key, md in self._meta.state_dict_metadata.items():
            if hasattr(md, "chunks"):
                chunks = tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
                self.tensors[key] = TensorInfo(key, tuple(md.size), md.properties.dtype, chunks)
            else:
                self.objects.append(key)
        self._storage = {(idx.fqn, tuple(idx.offset) if idx.offset is not None else None): info
                         for idx, info in self._meta.storage_data.items()}

    def keys(self) -> list[str]:
        """Every key: tensors, then ShardedObjects."""
        return list(self.tensors) + list(self.objects)

    def info(self, key: str) -> TensorInfo:
        if key not in self.tensors:
            raise TorchDistReadError(f"{self.path}: no tensor key {key!r} in the checkpoint "
                                     f"({len(self.tensors)} tensor keys, e.g. {sorted(self.tensors)[:3]}).")
        return self.tensors[key]

    def part_shape(self, key: str, index: tuple[int, ...] = ()) -> tuple[int, ...]:
        """Shape of ``read(key, index)`` without reading: the global shape less ``len(index)`` dims."""
        return self.info(key).shape[len(index):]

    def covers(self, key: str, index: tuple[int, ...]) -> bool:
        """True when some written chunk overlaps the part at ``index`` (e.g. layer i exists)."""
        return any(_overlap(index, off, size) for off, size in self.info(key).chunks)

    def read(self, key: str, index: tuple[int, ...] = ()) -> torch.Tensor:
        """The part of ``key`` at leading indices ``index`` ([*shape[len(index):]]), assembled from
        the chunks that overlap it; an error names the key when the chunks do not cover every
        element of the part exactly once (a gap, an overlap, a chunk outside the shape)."""
        info = self.info(key)
        if len(index) > len(info.shape) or any(not 0 <= i < n for i, n in zip(index, info.shape)):
            raise TorchDistReadError(f"{self.path}: index {index} is outside {key!r} of shape {info.shape}.")
        chunks = [c for c in info.chunks if _overlap(index, *c)]
        self._check_tiling(key, index, info.shape, chunks)
        if len(chunks) == 1:  # one chunk holds the whole part: a view of it, no assembly copy
            chunk = self._load_chunk(key, *chunks[0])
            return chunk[tuple(i - off for i, off in zip(index, chunks[0][0]))]
        out = torch.empty(info.shape[len(index):], dtype=info.dtype)  # host: the merge reads on the CPU
        for offsets, sizes in chunks:
            chunk = self._load_chunk(key, offsets, sizes)
            src, dst = [], []  # slices of the chunk and of ``out`` that meet
            for d, (off, size) in enumerate(zip(offsets, sizes)):
                if d < len(index):
                    src.append(slice(index[d] - off, index[d] - off + 1))
                else:
                    src.append(slice(0, size))
                    dst.append(slice(off, off + size))
            out[tuple(dst)] = chunk[tuple(src)].reshape(out[tuple(dst)].shape)
            del chunk
        return out

    def _check_tiling(self, key: str, index: tuple[int, ...], shape: tuple[int, ...],
                      chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        """The chunks' boxes, restricted to the part at ``index``, lie inside the shape, are pairwise
        disjoint and their volumes add up to the part's: every element is written exactly once."""
        part = shape[len(index):]
        boxes = []
        for offsets, sizes in chunks:
            if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                    off < 0 or size < 0 or off + size > n for off, size, n in zip(offsets, sizes, shape)):
                raise TorchDistReadError(f"{self.path}: .metadata gives {key!r} a chunk at {offsets} of size "
                                         f"{sizes} outside its shape {shape}; the .metadata file is damaged.")
            boxes.append((offsets[len(index):], sizes[len(index):]))
        covered = sum(math.prod(sizes) for _, sizes in boxes)
        clash = next(((a[0], b[0]) for i, a in enumerate(boxes) for b in boxes[i + 1:] if _boxes_meet(a, b)), None)
        if clash is not None or covered != math.prod(part):
            what = (f"chunks at {clash[0]} and {clash[1]} overlap" if clash is not None
                    else f"its chunks cover {covered} of the {math.prod(part)} elements")
            raise TorchDistReadError(
                f"{self.path}: {key!r} at index {index}: {what}; the checkpoint is incomplete (a rank's shard "
                "was not written) or its .metadata is damaged: use another checkpoint.")

    def read_object(self, key: str) -> Any:
        """A ShardedObject payload (e.g. ``rng_state/shard_0_2``), unpickled only with torch's
        weights_only unpickler, its allowlist cut to torch's own entries (``safe_load.load_payload``)."""
        if key not in self.objects:
            raise TorchDistReadError(f"{self.path}: no ShardedObject key {key!r} in the checkpoint.")
        data = self._read_bytes(key, None)
        return load_payload(data, f"ShardedObject payload {key!r} in {self._locate(key, None)[0]}")

    def _load_chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """One chunk, checked to be the tensor ``.metadata`` promises (shape and dtype)."""
        file, info = self._locate(key, offsets)
        with open(file, "rb") as f:  # torch reads the record straight into the tensor's storage
            chunk = torch.load(_Span(f, info.offset, info.length), map_location="cpu", weights_only=True)
        want = self.tensors[key].dtype
        if not torch.is_tensor(chunk) or tuple(chunk.shape) != tuple(sizes) or chunk.dtype != want:
            got = f"{tuple(chunk.shape)} {chunk.dtype}" if torch.is_tensor(chunk) else type(chunk).__name__
            raise TorchDistReadError(f"{file}: the chunk of {key!r} at {offsets} holds {got}, .metadata promises "
                                     f"{tuple(sizes)} {want}; the checkpoint is damaged: use another one.")
        return chunk

    def _read_bytes(self, key: str, offsets: tuple[int, ...] | None) -> bytes:
        file, info = self._locate(key, offsets)
        with open(file, "rb") as f:
            f.seek(info.offset)
            return f.read(info.length)

    def _locate(self, key: str, offsets: tuple[int, ...] | None) -> tuple[str, Any]:
        """(file, storage info) of one item; errors name a damaged .metadata, a missing or a
        truncated file."""
        info = self._storage.get((key, offsets))
        if info is None:
            raise TorchDistReadError(f"{self.path}: .metadata lists {key!r} (chunk at {offsets}) but "
                                     "no storage entry for it; the .metadata file is damaged.")
        if getattr(info, "transform_descriptors", None):
            raise TorchDistReadError(
                f"{self.path}: {key!r} is stored with transforms {info.transform_descriptors} "
                "(e.g. compression), which this reader does not support; save without them.")
        file = contained(self.path, info.relative_path, os.path.join(self.path, METADATA_FILE))
        if not os.path.isfile(file):
            raise TorchDistReadError(
                f"{file} is missing: it holds {key!r}; the checkpoint is incomplete (copy the whole "
                "dist_ckpt/ directory).")
        if os.path.getsize(file) < info.offset + info.length:
            raise TorchDistReadError(
                f"{file} is truncated: {key!r} needs bytes {info.offset}..{info.offset + info.length}, "
                f"the file has {os.path.getsize(file)} bytes; copy the checkpoint again.")
        return file, info


class _Span(io.RawIOBase):
    """Bytes [offset, offset + length) of an open file as a file of their own, so that
    ``torch.load`` reads a record straight into its tensor (``readinto``), with no bytes copy."""

    def __init__(self, f, offset: int, length: int) -> None:
        super().__init__()
        self._f, self._offset, self._length, self._pos = f, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + pos)
        return self._pos

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self._length - self._pos)
        if n <= 0:
            return 0
        self._f.seek(self._offset + self._pos)
        got = self._f.readinto(memoryview(buffer).cast("B")[:n])
        self._pos += got
        return got


def _boxes_meet(a: tuple[tuple[int, ...], tuple[int, ...]], b: tuple[tuple[int, ...], tuple[int, ...]]) -> bool:
    """True when boxes (offsets, sizes) share an element (they overlap in every dimension)."""
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))


def _overlap(index: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    return all(off <= i < off + size for i, off, size in zip(index, offsets, sizes))
