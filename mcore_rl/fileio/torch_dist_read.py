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

import collections
import io
import math
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.faults import io_fault
from mcore_rl.fileio.checksum import fileobj_checksum
from mcore_rl.fileio.paths import contained
from mcore_rl.fileio.safe_load import load_payload, restricted_pickle_load

METADATA_FILE = ".metadata"
MAX_CHUNKS = 1 << 16  # chunks of one key (a save writes one per rank that holds a part of it)
MAX_CELLS = 1 << 22  # cells of the grid a tiling check builds (bounds its time and memory)
MAX_OPEN = 256  # shard files held open at once


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

    def __init__(self, dist_dir: str | os.PathLike,
                 before_parse: Callable[["TorchDistReader"], None] | None = None) -> None:
        """``before_parse(self)`` runs once the directory is open, before ``.metadata`` is
        unpickled (e.g. to check every file's checksum through ``checksum``)."""
        self.path = os.fspath(dist_dir)
        meta_path = os.path.join(self.path, METADATA_FILE)
        try:  # every file is opened relative to this handle: a step renamed away (replaced) stays ours
            self._dir_fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise TorchDistReadError(
                f"{self.path} is not a torch_dist checkpoint ({e.strerror or e}). Pass the dist_ckpt/ "
                "directory of a model dir written by CheckpointManager or a converter.") from None
        self._files: collections.OrderedDict[str, Any] = collections.OrderedDict()  # rel -> open file
        try:
            if before_parse is not None:
                before_parse(self)
            with self._open(METADATA_FILE) as f:
                self._meta = restricted_pickle_load(f, source=meta_path)
            self._index_metadata(meta_path)
        except FileNotFoundError:
            self.close()
            raise TorchDistReadError(
                f"{self.path} is not a torch_dist checkpoint: {meta_path} does not exist. Pass the "
                "dist_ckpt/ directory of a model dir written by CheckpointManager or a converter.") from None
        except CheckpointError:
            self.close()
            raise
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, KeyError,
                IndexError, MemoryError, RecursionError, OverflowError) as e:
            self.close()
            raise TorchDistReadError(f"{meta_path} is not a readable torch_dist .metadata ({type(e).__name__}: "
                                     f"{_short(e)}); the file is truncated or damaged: use another copy of "
                                     "the checkpoint.") from None

    def _index_metadata(self, meta_path: str) -> None:
        """``tensors``, ``objects`` and the storage index from the unpickled ``.metadata``; any
        entry of the wrong type is an error naming the file."""
        sdm, storage = getattr(self._meta, "state_dict_metadata", None), getattr(self._meta, "storage_data", None)
        if not isinstance(sdm, dict) or not isinstance(storage, dict):
            raise TorchDistReadError(f"{meta_path} holds a {type(self._meta).__name__}, not torch.distributed."
                                     "checkpoint Metadata; the file is damaged: use another copy.")
        self.tensors: dict[str, TensorInfo] = {}
        self.objects: list[str] = []
        for key, md in sdm.items():
            if hasattr(md, "chunks"):
                if len(md.chunks) > MAX_CHUNKS:
                    raise TorchDistReadError(f"{meta_path} gives {key!r} {len(md.chunks)} chunks, more than "
                                             f"{MAX_CHUNKS} (no save writes that many); the file is damaged.")
                chunks = tuple((_ints(c.offsets), _ints(c.sizes)) for c in md.chunks)
                dtype = md.properties.dtype
                if not isinstance(dtype, torch.dtype):
                    raise TypeError(f"dtype {dtype!r} of {key!r}")
                self.tensors[key] = TensorInfo(key, _ints(md.size), dtype, chunks)
            else:
                self.objects.append(key)
        self._storage = {(idx.fqn, _ints(idx.offset) if idx.offset is not None else None): info
                         for idx, info in storage.items()}

    def _open(self, rel: str):
        """``rel`` (inside ``self.path``) opened for reading relative to the directory handle."""
        io_fault("open", os.path.join(self.path, rel))
        return os.fdopen(os.open(rel, os.O_RDONLY, dir_fd=self._dir_fd), "rb")

    def _file(self, rel: str):
        """The open file ``rel`` (kept open: a replaced step's files stay readable)."""
        f = self._files.get(rel)
        if f is None:
            if len(self._files) >= MAX_OPEN:
                self._files.popitem(last=False)[1].close()
            f = self._files[rel] = self._open(rel)
        else:
            self._files.move_to_end(rel)
        return f

    def identity(self) -> tuple[int, int]:
        """(device, inode) of the directory this reader reads (held open since it was created)."""
        st = os.fstat(self._dir_fd)
        return st.st_dev, st.st_ino

    def checksum(self, rel: str, like: str | None = None) -> tuple[int, str]:
        """(size, checksum in the algorithm of the recorded ``like``) of the file ``rel`` of this
        directory, read through the reader's handle."""
        f = self._file(rel)
        f.seek(0)
        return fileobj_checksum(f, like)

    def close(self) -> None:
        """Closes the directory handle and every open file."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        if getattr(self, "_dir_fd", None) is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

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
        check_tiling(self.path, key, index, info.shape, chunks)
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

    def check_key(self, key: str) -> None:
        """``key``'s written chunks tile its whole global shape (``check_tiling``): what a load
        by overlap (torch.distributed.checkpoint's) needs so no element is left unread."""
        info = self.info(key)
        check_tiling(self.path, key, (), info.shape, list(info.chunks))

    def read_object(self, key: str) -> Any:
        """A ShardedObject payload (e.g. ``rng_state/shard_0_2``), unpickled only with torch's
        weights_only unpickler, its allowlist cut to torch's own entries (``safe_load.load_payload``)."""
        if key not in self.objects:
            raise TorchDistReadError(f"{self.path}: no ShardedObject key {key!r} in the checkpoint.")
        data = self._read_bytes(key, None)
        return load_payload(data, f"ShardedObject payload {key!r} in {self._locate(key, None)[0][0]}")

    def _load_chunk(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """One chunk, checked to be the tensor ``.metadata`` promises (shape and dtype)."""
        file, info = self._locate(key, offsets)
        want = self.tensors[key].dtype
        if math.prod(sizes) * want.itemsize > info.length:
            raise TorchDistReadError(f"{file}: the chunk of {key!r} at {offsets} ({tuple(sizes)} {want}) does not "
                                     f"fit its {info.length} bytes; the .metadata file is damaged.")
        try:  # torch reads the record straight into the tensor's storage
            chunk = torch.load(_Span(self._file(file[1]), info.offset, info.length), map_location="cpu",
                               weights_only=True)
        except CheckpointError:
            raise
        except (OSError, pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, KeyError,
                AttributeError, IndexError, MemoryError, RecursionError, OverflowError) as e:
            raise TorchDistReadError(f"{file[0]}: the chunk of {key!r} at {offsets} is unreadable ({type(e).__name__}: "
                                     f"{_short(e)}); the checkpoint is damaged: use another copy.") from None
        if not torch.is_tensor(chunk) or tuple(chunk.shape) != tuple(sizes) or chunk.dtype != want:
            got = f"{tuple(chunk.shape)} {chunk.dtype}" if torch.is_tensor(chunk) else type(chunk).__name__
            raise TorchDistReadError(f"{file[0]}: the chunk of {key!r} at {offsets} holds {got}, .metadata promises "
                                     f"{tuple(sizes)} {want}; the checkpoint is damaged: use another one.")
        return chunk

    def _read_bytes(self, key: str, offsets: tuple[int, ...] | None) -> bytes:
        (_, rel), info = self._locate(key, offsets)
        f = self._file(rel)
        f.seek(info.offset)
        return f.read(info.length)

    def _locate(self, key: str, offsets: tuple[int, ...] | None) -> tuple[tuple[str, str], Any]:
        """((file, its name relative to this directory), storage info) of one item; errors name a
        damaged .metadata, a missing or a truncated file."""
        info = self._storage.get((key, offsets))
        if info is None:
            raise TorchDistReadError(f"{self.path}: .metadata lists {key!r} (chunk at {offsets}) but "
                                     "no storage entry for it; the .metadata file is damaged.")
        if getattr(info, "transform_descriptors", None):
            raise TorchDistReadError(
                f"{self.path}: {key!r} is stored with transforms {info.transform_descriptors} "
                "(e.g. compression), which this reader does not support; save without them.")
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in (offset, length)):
            raise TorchDistReadError(f"{self.path}: .metadata stores {key!r} at offset {offset!r}, length "
                                     f"{length!r}; the .metadata file is damaged.")
        rel = getattr(info, "relative_path", None)
        file = contained(self.path, rel, os.path.join(self.path, METADATA_FILE))
        try:
            size = os.fstat(self._file(rel).fileno()).st_size
        except FileNotFoundError:
            raise TorchDistReadError(
                f"{file} is missing: it holds {key!r}; the checkpoint is incomplete (copy the whole "
                "dist_ckpt/ directory), or it was replaced or removed while being read.") from None
        except OSError as e:
            raise TorchDistReadError(f"{file} is unreadable ({e.strerror or e}): it holds {key!r}.") from None
        if size < offset + length:
            raise TorchDistReadError(
                f"{file} is truncated: {key!r} needs bytes {offset}..{offset + length}, "
                f"the file has {size} bytes; copy the checkpoint again.")
        return (file, rel), info

    def files(self) -> list[str]:
        """Every file ``.metadata`` names (relative to this directory), and ``.metadata``."""
        return sorted({METADATA_FILE} | {str(getattr(info, "relative_path", "")) for info in self._storage.values()})


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


def check_tiling(where: str, key: str, index: tuple[int, ...], shape: tuple[int, ...],
                 chunks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
    """The chunks' boxes, restricted to the part at ``index``, lie inside the shape, are pairwise
    disjoint and their volumes add up to the part's: every element is written exactly once.
    Checked on the grid of the boxes' edges (each box marks its cells, a cell marked twice is
    an overlap): time and memory grow with the grid's cells, at most ``MAX_CELLS``. ``where``: the
    checkpoint directory, for messages. The merge's reads and the manager's loads use it."""
    part = shape[len(index):]
    boxes = []
    for offsets, sizes in chunks:
        if len(offsets) != len(shape) or len(sizes) != len(shape) or any(
                off < 0 or size < 0 or off + size > n for off, size, n in zip(offsets, sizes, shape)):
            raise TorchDistReadError(f"{where}: .metadata gives {key!r} a chunk at {offsets} of size "
                                     f"{sizes} outside its shape {shape}; the .metadata file is damaged.")
        boxes.append((offsets[len(index):], sizes[len(index):]))
    covered = sum(math.prod(sizes) for _, sizes in boxes)
    clash = _first_clash(boxes, part) if covered == math.prod(part) else None
    if clash == "cells":
        raise TorchDistReadError(f"{where}: {key!r} at index {index}: its {len(boxes)} chunks cut the part "
                                 f"into more than {MAX_CELLS} cells (no save does that); the .metadata file "
                                 "is damaged: use another checkpoint.")
    if clash is not None or covered != math.prod(part):
        what = (f"chunks at {clash[0]} and {clash[1]} overlap" if clash is not None
                else f"its chunks cover {covered} of the {math.prod(part)} elements")
        raise TorchDistReadError(
            f"{where}: {key!r} at index {index}: {what}; the checkpoint is incomplete (a rank's shard "
            "was not written) or its .metadata is damaged: use another checkpoint.")


def _overlap(index: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...]) -> bool:
    return all(off <= i < off + size for i, off, size in zip(index, offsets, sizes))


def _ints(values) -> tuple[int, ...]:
    """A tuple of ints (a torch.Size, list or tuple of them); TypeError for anything else."""
    out = tuple(values)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in out):
        raise TypeError(f"{values!r} is not a sequence of integers")
    return out


def _short(error: BaseException) -> str:
    return " ".join(str(error).split())[:200]


def _first_clash(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], part: tuple[int, ...]):
    """The first two boxes (offsets, sizes) that share an element, None when they are disjoint,
    or ``"cells"`` when the grid of their edges has more than ``MAX_CELLS`` cells."""
    if len(boxes) < 2:
        return None
    edges = [sorted({0, n} | {o[d] for o, _ in boxes} | {o[d] + s[d] for o, s in boxes}) for d, n in enumerate(part)]
    if math.prod(max(len(e) - 1, 1) for e in edges) > MAX_CELLS:
        return "cells"
    owner = torch.full([max(len(e) - 1, 1) for e in edges], -1, dtype=torch.int32)  # host: file format
    where = [{v: i for i, v in enumerate(e)} for e in edges]
    for b, (offsets, sizes) in enumerate(boxes):
        if 0 in sizes:
            continue
        cells = owner[tuple(slice(where[d][o], where[d][o + s]) for d, (o, s) in enumerate(zip(offsets, sizes)))]
        taken = cells[cells >= 0]
        if taken.numel():
            return boxes[int(taken[0])][0], offsets
        cells.fill_(b)
    return None
