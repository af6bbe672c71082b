"""The torch_dist save strategy of mcore_rl: megatron's own plan, metadata and finalize, with a
file writer that writes item by item.

megatron's ``FileSystemWriterAsync`` clones every CPU tensor that views a larger storage before
it starts (DDP parameters, optimizer shards: nearly the whole state) and forks two writer
processes per rank; on CPU its async path also shares the live tensors with the writer. Here
each rank writes one file, one item at a time: a view is copied only while it is written (the
extra memory is the largest item), a device tensor is copied to the host only while it is
written (sync) or staged to host memory at the save call (async). An async save runs the same
writer in the process megatron's ``TemporalAsyncCaller`` forks: the fork is a copy-on-write
snapshot of the host state at the save call, so training may change the weights in place while
the file is written. The writer dies with its parent (``PR_SET_PDEATHSIG``), so a killed rank
leaves no writer racing the rerun. Results come back through shared memory, not pickles.
"""
from __future__ import annotations

import gc
import mmap
import os
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np
import torch
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from torch.distributed.checkpoint.filesystem import SerializationFormat, _StorageInfo, _write_item
from torch.distributed.checkpoint.planner import WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.checkpoint.api import _wrap_exception
from torch.distributed.checkpoint.utils import _get_failure_dict

from mcore_rl.checkpoint.child_process import die_with_parent
from mcore_rl.checkpoint.collective import agreed, gather_errors, raise_if_any
from mcore_rl.checkpoint.save_plan import (LocalPlan, SaveStructure, clean_common, local_plan, plan_save,
                                           unchanged_everywhere, validate)

from mcore_rl.fileio.faults import hold_point, io_fault
from mcore_rl.fileio import item_sums
from mcore_rl.fileio.files import ChecksumStream, Writeback

_ERROR_BYTES = 4096
_PENDING, _DONE, _FAILED = 0, 1, 2


class LazyResolver(Protocol):
    """Supplies item data at write time (a converter saves a meta-device model's sharded state).

    ``plan`` gets every tensor item's data (e.g. meta tensors: detached views of parameters, which
    share the parameter's storage) in write order before anything is written; ``__call__`` returns
    the real tensor for one of them, same size and dtype, just before it is written."""

    def plan(self, tensors: list[torch.Tensor]) -> None: ...

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor: ...


class _SharedResults:
    """Per-item (offset, length) of the written bytes, the sizes and checksums of the shard and
    of its item-checksum file, a status word and an error text, in an anonymous shared mapping:
    a forked writer fills it, the rank reads it (nothing unpickled)."""

    _HEAD = 3  # status, shard size, item-checksum file size
    _TEXT = 64  # bytes per recorded checksum string

    def __init__(self, n_items: int) -> None:
        self.n_items = n_items
        self._words = self._HEAD + 2 * n_items
        self._text_at = 8 * self._words + _ERROR_BYTES
        self._buf = mmap.mmap(-1, self._text_at + 2 * self._TEXT)  # MAP_SHARED | MAP_ANONYMOUS
        self.words = np.frombuffer(self._buf, dtype=np.int64, count=self._words)

    def record(self, i: int, offset: int, length: int) -> None:
        at = self._HEAD + 2 * i
        self.words[at: at + 2] = (offset, length)

    def finish(self, error: str | None, shard: tuple[int, str] = (0, ""), sums: tuple[int, str] = (0, "")) -> None:
        if error is not None:
            raw = error.encode()[: _ERROR_BYTES - 1]
            start = 8 * self._words
            self._buf[start: start + len(raw)] = raw
        for slot, (_, value) in enumerate((shard, sums)):
            raw = value.encode()[: self._TEXT]
            at = self._text_at + slot * self._TEXT
            self._buf[at: at + len(raw)] = raw
        self.words[1:3] = (shard[0], sums[0])
        self.words[0] = _DONE if error is None else _FAILED

    def status(self) -> tuple[int, str]:
        start = 8 * self._words
        text = bytes(self._buf[start: start + _ERROR_BYTES]).split(b"\0", 1)[0].decode(errors="replace")
        return int(self.words[0]), text

    def digests(self) -> tuple[tuple[int, str], tuple[int, str]]:
        """((size, checksum) of the shard, (size, checksum) of its item-checksum file)."""
        text = [bytes(self._buf[self._text_at + k * self._TEXT: self._text_at + (k + 1) * self._TEXT])
                .split(b"\0", 1)[0].decode() for k in (0, 1)]
        return (int(self.words[1]), text[0]), (int(self.words[2]), text[1])

    def span(self, i: int) -> tuple[int, int]:
        at = self._HEAD + 2 * i
        return int(self.words[at]), int(self.words[at + 1])


def _host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor as a compact host tensor: torch.save writes a view's whole storage."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        return tensor.to("cpu")
    compact = tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    return tensor if compact else tensor.clone()


def write_rank_file(parent_pid: int, transforms, rank: int, buckets: list, results: _SharedResults,
                    resolve: LazyResolver | None = None) -> None:
    """Writes this rank's items into one file (fsynced) and records each item's byte span.
    Runs in the rank (sync save) or in the process megatron forks (async save). ``resolve``
    turns each tensor item's data into the tensor to write, just before it is written;
    ``transforms``: the writer's torch storage transforms (none by default)."""
    forked = os.getpid() != parent_pid
    if forked:
        die_with_parent(parent_pid)  # SIGKILL when the rank dies
        gc.disable()  # a collection here could free the parent's device tensors (CUDA after fork)
        torch.set_num_threads(1)  # the parent's OpenMP pool does not exist in a forked child
    error, shard, sums = None, (0, ""), (0, "")
    try:
        hold_point("writer")
        (path, storage_key, items), = buckets
        spans: dict[int, tuple[int, str]] = {}
        with open(path, "wb") as raw:
            stream, writeback = ChecksumStream(raw), Writeback(raw)
            try:
                for i, (item, data) in enumerate(items):
                    if i:
                        io_fault("write", path)  # test-only: a disk that fills up mid-file
                    if item.type != WriteItemType.BYTE_IO:
                        data = _host_copy(resolve(data) if resolve is not None else data)
                    stream.begin_item()
                    result = _write_item(transforms, stream, data, item, storage_key,
                                         serialization_format=SerializationFormat.TORCH_SAVE)
                    offset, length = result.storage_data.offset, result.storage_data.length
                    spans[offset] = (length, stream.end_item())
                    results.record(i, offset, length)
                    del data
                    writeback.poke()
            except BaseException:
                writeback.stop()
                raise
            writeback.close()  # flush + fsync; raises if any background flush failed
            shard = (stream.size, stream.checksum())
        sums = item_sums.write(item_sums.sums_name(path), item_sums.ItemSums(storage_key, stream.size, spans))
    except BaseException as e:  # reported to the rank at finalize, which raises it
        error = f"rank {rank} writer: {type(e).__name__}: {e}"
    results.finish(error, shard, sums)
    if forked:
        os._exit(0 if error is None else 1)


class ItemWriter(FileSystemWriterAsync):
    """A ``FileSystemWriterAsync`` that writes one file per rank item by item (see module doc).
    ``stage_device_tensors``: copy device tensors to host memory at the save call (async save)."""

    def __init__(self, path: str | Path, stage_device_tensors: bool,
                 resolve: LazyResolver | None = None) -> None:
        super().__init__(path, thread_count=1)
        self.stage, self.resolve = stage_device_tensors, resolve
        self.results: _SharedResults | None = None

    def prepare_write_data(self, plan, planner) -> None:
        """Keeps references to the items (no clone); a device tensor is staged when async."""
        items = []
        for item in sorted(plan.items, key=lambda it: it.type != WriteItemType.BYTE_IO):
            data = planner.resolve_data(item)
            if item.type != WriteItemType.BYTE_IO:
                data = data.detach()
                if self.stage and data.device.type != "cpu":
                    data = data.to("cpu")
                elif self.stage and data.untyped_storage().is_shared():
                    # the forked writer's copy-on-write snapshot does not cover shared memory:
                    # such a tensor would be written live, so it is copied at the save call
                    data = data.clone()
            items.append((item, data))
        name = f"{plan.storage_data.prefix}0.distcp"
        self.write_buckets = [(os.path.join(self.checkpoint_dir, name), name, items)] if items else []
        self.results = _SharedResults(len(items)) if items else None
        if self.resolve is not None:
            self.resolve.plan([d for it, d in items if it.type != WriteItemType.BYTE_IO])

    def get_save_function_and_args(self):
        if not self.write_buckets:
            return None, None, []
        fn = partial(write_rank_file, os.getpid(), self.transforms, resolve=self.resolve)
        return fn, None, [torch.distributed.get_rank(), self.write_buckets, self.results]

    def retrieve_write_results(self):
        if not self.write_buckets:
            return []
        status, error = self.results.status()
        if status != _DONE:  # wrapped, as megatron does: every rank still joins the results gather
            problem = RuntimeError(error or f"the checkpoint writer of rank {torch.distributed.get_rank()} "
                                   "ended without writing its file (killed?)")
            return _wrap_exception(problem)
        _, storage_key, items = self.write_buckets[0]
        out = []
        for i, (item, _) in enumerate(items):
            offset, length = self.results.span(i)
            out.append(WriteResult(index=item.index, size_in_bytes=length,
                                   storage_data=_StorageInfo(storage_key, offset, length)))
        return out

    def written_files(self) -> dict[str, tuple[int, str]]:
        """File name -> (size, checksum) of what this rank's writer wrote (after it finished):
        its shard and the shard's item-checksum file."""
        if not self.write_buckets or self.results.status()[0] != _DONE:
            return {}
        shard, sums = self.results.digests()
        name = self.write_buckets[0][1]
        return {name: shard, item_sums.sums_name(name): sums}


class ItemSaveStrategy(TorchDistSaveShardedStrategy):
    """torch_dist format (readable by megatron's own loader) written by ``ItemWriter``.
    ``resolve``: a ``LazyResolver`` that supplies tensor data at write time (run the request with
    ``execute_sync``: the resolver's state lives in this process)."""

    def __init__(self, stage_device_tensors: bool = False, resolve: LazyResolver | None = None,
                 structure: SaveStructure | None = None) -> None:
        super().__init__("torch_dist", 1, thread_count=1)
        self.stage, self.resolve, self.structure = stage_device_tensors, resolve, structure
        self.writer: ItemWriter | None = None

    def async_save(self, sharded_state_dict, checkpoint_dir: Path) -> AsyncRequest:
        """megatron's entry point (plans afresh; ``plan_item_save`` reuses an unchanged structure)."""
        return self.planned_save(local_plan(sharded_state_dict, self.keep_only_main_replica), checkpoint_dir, False)

    def planned_save(self, local: LocalPlan, checkpoint_dir: Path, reuse: bool) -> AsyncRequest:
        """The request of ``local``'s save (``reuse``: ``self.structure``'s plan, see ``save_plan``)."""
        writer = ItemWriter(checkpoint_dir, self.stage, self.resolve)
        self.writer = writer  # what it wrote (file digests) is read after the request ran
        return self._get_save_and_finalize_callbacks(writer, plan_save(local, writer, self.structure, reuse))

    def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret) -> AsyncRequest:
        save_fn, preload_fn, save_args = writer.get_save_function_and_args()
        return AsyncRequest(save_fn, save_args, [partial(_finalize_agreed, *save_state_dict_ret)],
                            preload_fn=preload_fn)


def _finalize_agreed(storage_writer, global_metadata, dist_wrapper) -> None:
    """megatron's finalize (gather every rank's write results; the coordinator writes
    ``.metadata``), except that an error of the coordinator's own write reaches every rank:
    megatron's raises it on the coordinator alone, leaving the others in the next collective."""
    all_results = dist_wrapper.gather_object(storage_writer.retrieve_write_results())
    error = None
    if dist_wrapper.is_coordinator:
        failures = _get_failure_dict(all_results)
        if failures:
            error = "; ".join(f"rank {r}: {failure[0]}" for r, failure in sorted(failures.items()))
        else:
            try:
                storage_writer.finish(global_metadata, all_results)
            except Exception as e:  # noqa: BLE001 - reported on every rank
                error = f"writing .metadata: {type(e).__name__}: {e}"
    raise_if_any(gather_errors(error), "writing the checkpoint shards")


def plan_item_save(state: dict, checkpoint_dir: str, strategy: ItemSaveStrategy) -> AsyncRequest:
    """megatron's ``dist_checkpointing.save(..., async_sharded_save=True)`` for an
    ``ItemSaveStrategy``, with every step that runs on rank 0 alone (``common.pt``,
    ``.metadata``, ``metadata.json``) agreed: a failure there fails the save on every rank
    instead of leaving the others waiting. The sharding is validated and the save planned
    afresh unless ``strategy.structure`` holds this structure on every rank (``save_plan``).
    Returns the unscheduled request (plan done, ``common.pt`` written); its finalize writes the
    metadata files."""
    sharded, common = save_preprocess(state, False, None)
    clean_common(common)
    local = local_plan(sharded, strategy.keep_only_main_replica)
    reuse = unchanged_everywhere(local, strategy.structure)
    if not reuse:
        validate(local, common)
    rank0 = torch.distributed.get_rank() == 0
    common_path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    agreed((lambda: torch.save(common, common_path)) if rank0 else None, f"writing {common_path}")
    request = strategy.planned_save(local, Path(checkpoint_dir), reuse)
    config = CheckpointingConfig(strategy.backend, strategy.version)
    request.finalize_fns.append(lambda: agreed((lambda: save_config(config, checkpoint_dir)) if rank0 else None,
                                               f"writing {checkpoint_dir}/metadata.json"))
    return request
