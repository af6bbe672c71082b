"""megatron's torch_dist load with every shard item checked in the same pass as it is read.

``VerifiedLoadStrategy`` is megatron's ``TorchDistLoadShardedStrategy`` with its own reader:
``VerifyingReader`` reads each stored item once, compares its checksum with the one its writer
recorded (``fileio/item_sums.py``; the item-checksum file itself is checked against the marker)
and views it as its tensor, and every rank reports what it found (one collective: DCP calls
``read_data`` once on every rank). Then either (``fresh=False``) the items, held until every
rank found every item intact, are copied into their targets — the engine's own tensors, as in
megatron's load — or (``fresh=True``) the targets are fresh host buffers the caller applies to
the engine later (a step of several roles: all but the last role are read that way, so no role
changes before every role's items are checked). So a damaged, torn or stale shard is refused on
every rank with no engine tensor changed, and no file is read twice.
"""
from __future__ import annotations

import io
import os
from torch.futures import Future
from typing import Any

import torch
from megatron.core.dist_checkpointing.strategies.torch import (
    MCoreLoadPlanner, TorchDistLoadShardedStrategy, _replace_sharded_keys_with_state_dict_keys,
    _replace_state_dict_keys_with_sharded_keys, _restore_dict_types, _unwrap_pyt_sharded_tensor,
    mcore_to_pyt_state_dict)
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.planner import LoadItemType

from mcore_rl.checkpoint.collective import gather_errors
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio import item_sums
from mcore_rl.fileio.checksum import checksum
from mcore_rl.fileio.faults import io_fault
from mcore_rl.fileio.paths import contained
from mcore_rl.fileio.saved_tensor import tensor_view

Recorded = dict[str, tuple[int, str | None]]  # file name in the dist dir -> (size, checksum)


def has_item_sums(recorded: Recorded, shards: list[str]) -> bool:
    """Whether every shard of ``shards`` has an item-checksum file in the record (steps written
    before item checksums have none: they are checked by a whole-file pass instead)."""
    return bool(shards) and all(item_sums.sums_name(s) in recorded for s in shards)


class VerifyingReader(FileSystemReader):
    """A DCP ``FileSystemReader`` that checks every item against its recorded checksum and
    defers the copies into the targets until every rank has checked its reads (see module doc).
    ``recorded``: the marker's (size, checksum) of the dist dir's files; ``step``, ``label``: the
    step directory and the dist dir relative to it, as error messages name them."""

    def __init__(self, path: str, recorded: Recorded, step: str, label: str, hold: bool) -> None:
        super().__init__(path)
        self.recorded, self.step, self.label, self.hold = recorded, step, label, hold
        self.failure: str | None = None
        self._held: list[tuple[Any, Any]] = []  # (read item, value) while ``hold``

    def _sums(self, shard: str) -> item_sums.ItemSums:
        name = item_sums.sums_name(shard)
        if name not in self.recorded:
            raise CheckpointError(f"checkpoint {self.step}: {self.label}/{shard} has no recorded item checksums ({name}).")
        return item_sums.read(contained(str(self.path), name, os.path.join(str(self.path), ".metadata")),
                              self.recorded[name])

    def _read_item(self, f, shard: str, sums: item_sums.ItemSums, offset: int, length: int) -> torch.Tensor:
        """The item's bytes (uint8 [length], not zero-filled first), checked against its record."""
        f.seek(offset)
        data = torch.empty(length, dtype=torch.uint8)  # host: the file's bytes, read into host memory
        n = f.readinto(memoryview(data.numpy()))
        recorded = sums.items.get(offset)
        if recorded is None or recorded[0] != length or n != length:
            raise CheckpointError(f"checkpoint {self.step} is damaged: {self.label}/{shard} has no item of {length} bytes at "
                                  f"byte {offset} (its item checksums record {recorded}); restore the files, or "
                                  "resume another step with checkpoint.resume_mode=path.")
        got = checksum(memoryview(data.numpy()), like=recorded[1])
        if got != recorded[1]:
            raise CheckpointError(f"checkpoint {self.step} holds other bytes than were saved: {self.label}/{shard} "
                                  f"(checksum {got} of the item at byte {offset}, its writer recorded "
                                  f"{recorded[1]}); the files are damaged or stale: restore them from another "
                                  "node or copy, or resume another step with checkpoint.resume_mode=path.")
        return data

    def _read_into(self, plan, planner) -> None:
        """Reads and checks every item of ``plan`` (each stored item once, files in offset
        order) and copies it into its target (the load's own fresh buffers, see the strategy)."""
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index].relative_path, []).append(req)
        for shard, reqs in sorted(per_file.items()):
            sums = self._sums(shard)
            path = contained(str(self.path), shard, os.path.join(str(self.path), ".metadata"))
            io_fault("open", path)
            with open(path, "rb") as f:
                last: tuple[int, Any] = (-1, None)  # one stored item may serve several read items
                for req in sorted(reqs, key=lambda r: self.storage_data[r.storage_index].offset):
                    info = self.storage_data[req.storage_index]
                    if info.transform_descriptors:
                        raise CheckpointError(f"{self.step}/{self.label}/{shard}: item at byte {info.offset} was "
                                              f"written with storage transforms {info.transform_descriptors}; "
                                              "mcore_rl's writer writes none: this file was not written by it.")
                    if last[0] != info.offset:
                        data = self._read_item(f, shard, sums, info.offset, info.length)
                        last = (info.offset, data if req.type == LoadItemType.BYTE_IO else
                                self._tensor(data, req, planner))
                    if self.hold:
                        self._held.append((req, last[1]))
                    else:
                        self._deliver(req, last[1], planner)

    @staticmethod
    def _tensor(data: torch.Tensor, req, planner) -> torch.Tensor:
        """The stored tensor: a view of ``data`` when DCP's metadata gives its dtype and shape
        (``saved_tensor``), else ``torch.load`` (weights only)."""
        meta = planner.metadata.state_dict_metadata.get(req.storage_index.fqn)
        chunk = next((c for c in getattr(meta, "chunks", ()) if tuple(c.offsets) == tuple(req.storage_index.offset)), None)
        if chunk is not None:
            view = tensor_view(data, meta.properties.dtype, tuple(chunk.sizes))
            if view is not None:
                return view
        return torch.load(io.BytesIO(data.numpy().tobytes()), map_location="cpu", weights_only=True)

    def _deliver(self, req, value, planner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(value.numpy().tobytes()))
            return
        value = narrow_tensor_by_index(value, req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != value.size():
            raise CheckpointError(f"{self.step}/{self.label}: item {req.storage_index.fqn} has shape "
                                  f"{tuple(value.shape)}, the load expects {tuple(target.shape)}.")
        target.copy_(value)
        planner.commit_tensor(req, target)

    def read_data(self, plan, planner) -> Future:
        error = None
        try:
            self._read_into(plan, planner)
        except CheckpointError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - reported on every rank below
            error = f"reading {self.step}/{self.label}: {type(e).__name__}: {e}"
        failures = gather_errors(error)  # DCP calls read_data once on every rank
        held, self._held = self._held, []
        if failures:
            self.failure = "; ".join(f"rank {r}: {text}" for r, text in sorted(failures.items()))
            raise CheckpointError(self.failure)
        for req, value in held:  # every rank found every item intact
            self._deliver(req, value, planner)
        done: Future = Future()
        done.set_result(None)
        return done


class VerifiedLoadStrategy(TorchDistLoadShardedStrategy):
    """megatron's torch_dist load through ``VerifyingReader`` (same planner, same key handling)."""

    def __init__(self, recorded: Recorded, step: str, label: str, fresh: bool = False) -> None:
        super().__init__()
        self.recorded, self.step, self.label, self.fresh = recorded, step, label, fresh

    def load(self, sharded_state_dict, checkpoint_dir) -> dict:
        strict_shapes = [t for t in nested_values(sharded_state_dict)
                         if isinstance(t, ShardedTensor) and not t.allow_shape_mismatch]
        loose_shapes = {t.key: t for t in nested_values(sharded_state_dict)
                        if isinstance(t, ShardedTensor) and t.allow_shape_mismatch}
        original = sharded_state_dict
        for t in nested_values(sharded_state_dict):  # fresh host buffers: the engine's tensors stay as
            # they are (megatron zeroes a shape-mismatch tensor before reading it: never the engine's)
            if isinstance(t, ShardedTensor) and t.data is not None and (self.fresh or t.allow_shape_mismatch):
                t.data = torch.empty(t.data.shape, dtype=t.data.dtype, device="cpu")
        keyed, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict)
        pyt_state = mcore_to_pyt_state_dict(keyed, True)
        reader = VerifyingReader(str(checkpoint_dir), self.recorded, self.step, self.label, hold=not self.fresh)
        planner = MCoreLoadPlanner(shapes_validation_sharded_tensors=strict_shapes,
                                   allow_shape_mismatch_sharded_tensors=loose_shapes)
        try:
            torch.distributed.checkpoint.load(pyt_state, storage_reader=reader, planner=planner)
        except (Exception, CheckpointException):  # DCP's CheckpointException is a BaseException
            if reader.failure is not None:  # DCP wraps it; the reader's own words are the error
                raise CheckpointError(reader.failure) from None
            raise
        loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt_state.items()}
        loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
        _restore_dict_types(loaded, original)
        return loaded
