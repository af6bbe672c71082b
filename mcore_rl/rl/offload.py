"""Offload a ModelEngine's parameters, gradients and optimizer state to host memory between
phases (e.g. while a rollout engine needs the GPU), and bring them back unchanged.

Works on storages, not tensors: megatron's parameters, ``main_grad`` and optimizer shards are
often views into DDP's contiguous buffers (or of each other), so copying each distinct storage
once and shrinking it to zero bytes frees the device memory and keeps every view valid once the
storage is restored. What is covered, for both optimizer kinds (distributed or not), fp32 and
bf16, trainable and frozen engines:

- every model parameter (its own storage, or DDP's ``param_data`` buffer under the distributed
  optimizer), DDP's grad buffers and every ``main_grad`` / ``grad``;
- the fp32 main parameters of bf16 training (``param.main_param``, the optimizer's fp32 groups)
  and their ``.grad``;
- every tensor in the torch optimizer's state (Adam moments, ``step``).

On GPU the host copy is pinned and the freed blocks go back to the driver (``empty_cache``); on
CPU the same mechanism runs (its test checks that the storages really reach 0 bytes).

``Offloader`` moves a fixed selection at once; ``PartOffloader`` tracks each part (``PARTS``:
parameters, gradients, optimizer state) on its own, for callers that move parts in any order
(verl's engine contexts). A storage two parts share belongs to the first in ``PARTS``.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch
from megatron.core.distributed import DistributedDataParallel as DDP

from mcore_rl.errors import McoreRLError
from mcore_rl.rl.engine import ModelEngine

Tensor = torch.Tensor


class OffloadError(McoreRLError, RuntimeError):
    """offload() called while the engine's state is already on the host."""

# megatron optimizer attributes holding lists (per param group) of main / shard tensors
_OPTIMIZER_GROUPS = (
    "fp32_from_float16_groups",  # Float16OptimizerWithFloat16Params: fp32 copies of bf16 params
    "fp32_from_fp32_groups",
    "shard_fp32_from_float16_groups",  # DistributedOptimizer: fp32 main shards of bf16 params
    "shard_fp32_groups",
    "shard_float16_groups",
)


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _with_grad(tensors: Iterable[Tensor | None]) -> Iterator[Tensor]:
    for t in tensors:
        if t is not None:
            yield t
            if t.grad is not None:
                yield t.grad


def _param_tensors(engine: ModelEngine, params: bool, grads: bool) -> Iterator[Tensor]:
    for chunk in engine.model:
        # a frozen engine's chunks are plain GPTModels (nn.Module.buffers is a method there)
        ddp_buffers = chunk.buffers + chunk.expert_parallel_buffers if isinstance(chunk, DDP) else []
        for buffer in ddp_buffers:
            if params and buffer.param_data is not None:
                yield buffer.param_data
            if grads and buffer.grad_data is not None:
                yield buffer.grad_data
        for p in chunk.parameters():
            if params:
                yield p
            if grads:
                yield from (g for g in (getattr(p, "main_grad", None), p.grad) if g is not None)


def _optimizer_tensors(optimizer) -> Iterator[Tensor]:
    """Main params (fp32 copies/shards) with their grads, and all optimizer state tensors."""
    for opt in _optimizers(optimizer):
        for group in opt.optimizer.param_groups:
            yield from _with_grad(group["params"])
        for state in opt.optimizer.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v))
        for attr in _OPTIMIZER_GROUPS:
            for group in getattr(opt, attr, None) or []:
                yield from _with_grad(group)


def _main_params(engine: ModelEngine) -> Iterator[Tensor]:
    # megatron keeps a handle to each bf16 param's fp32 copy on the param itself
    for chunk in engine.model:
        for p in chunk.parameters():
            yield from _with_grad([getattr(p, "main_param", None)])


def engine_tensors(engine: ModelEngine, params: bool = True, grads: bool = True, optimizer: bool = True) -> list[Tensor]:
    """Every tensor holding the engine's parameters, gradients and optimizer state (many share a
    storage)."""
    tensors = list(_param_tensors(engine, params, grads))
    if optimizer and engine.optimizer is not None:
        tensors.extend(_optimizer_tensors(engine.optimizer))
        tensors.extend(_main_params(engine))
    return tensors


def _distinct(tensors: Iterable[Tensor]) -> dict[int, torch.UntypedStorage]:
    """data pointer -> storage, for the non-empty storages behind ``tensors`` (an empty storage
    has no address to tell it apart; it is offloaded already, or holds nothing)."""
    unique: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() > 0:
            unique.setdefault(storage.data_ptr(), storage)
    return unique


def _to_host(storages: Iterable[torch.UntypedStorage]) -> tuple[list[tuple[torch.UntypedStorage, Tensor]], int]:
    """Copies each storage to host memory and shrinks it to 0 bytes: ((storage, host copy)
    pairs, bytes freed)."""
    moved, freed, on_cuda = [], 0, False
    for storage in storages:
        on_cuda |= storage.device.type == "cuda"
        device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
        host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")  # host: the offload copy
        host.copy_(device_bytes)
        freed += storage.nbytes()
        storage.resize_(0)
        moved.append((storage, host))
    if on_cuda:  # the caching allocator would otherwise keep the freed blocks
        torch.cuda.empty_cache()
    return moved, freed


def _to_device(moved: list[tuple[torch.UntypedStorage, Tensor]]) -> None:
    """Gives every storage its bytes back (same storages: all views stay valid)."""
    for storage, host in moved:
        storage.resize_(host.numel())
        torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host)


class Offloader:
    """``offload()`` moves the engine's state to host memory and frees its storage;
    ``onload()`` restores it bit for bit. Trainable (either optimizer kind) or frozen engines."""

    def __init__(self, engine: ModelEngine, params: bool = True, grads: bool = True, optimizer: bool = True):
        self.engine, self.parts = engine, (params, grads, optimizer)
        self._host: list[tuple[torch.UntypedStorage, Tensor]] = []

    def storages(self) -> list[torch.UntypedStorage]:
        """The distinct non-empty storages behind the engine's state (what offload frees)."""
        return list(_distinct(engine_tensors(self.engine, *self.parts)).values())

    @torch.no_grad()
    def offload(self) -> int:
        """Copies every storage to host memory and shrinks it to 0 bytes; returns bytes freed."""
        for hook in self.engine.before_state_moves:  # e.g. an async checkpoint write in flight
            hook()
        if self._host:
            raise OffloadError("offload() called twice: the engine's state is already on the host "
                               "(its device storages are empty); call onload() first.")
        self._host, freed = _to_host(self.storages())
        return freed

    @torch.no_grad()
    def onload(self) -> None:
        """Gives every storage its bytes back (same storages: all views stay valid)."""
        for hook in self.engine.before_state_moves:
            hook()
        _to_device(self._host)
        self._host = []

    @property
    def offloaded(self) -> bool:
        return bool(self._host)


PARTS = ("params", "grads", "optimizer")  # a storage shared by two parts belongs to the first


def part_tensors(engine: ModelEngine, part: str) -> list[Tensor]:
    """The tensors of one part: ``params`` (parameters, DDP's param buffers), ``grads``
    (``main_grad`` / ``grad``, DDP's grad buffers), ``optimizer`` (fp32 main parameters with
    their grads, optimizer state). Views of another part's storage may be among them."""
    if part not in PARTS:
        raise OffloadError(f"part={part!r}; the engine's state parts are {list(PARTS)}.")
    return engine_tensors(engine, params=part == "params", grads=part == "grads", optimizer=part == "optimizer")


class PartOffloader:
    """Offload per part: ``offload(parts)`` moves those of ``parts`` that are on the device,
    ``onload(parts)`` those that are on the host; the others stay where they are. A part's
    storages are the non-empty ones of its tensors that no earlier part in ``PARTS`` holds (the
    fp32 parameters of a distributed optimizer are views of the parameter buffer: they move with
    the parameters), taken when the part is offloaded."""

    def __init__(self, engine: ModelEngine):
        self.engine = engine
        self._host: dict[str, list[tuple[torch.UntypedStorage, Tensor]]] = {}

    @property
    def offloaded(self) -> frozenset[str]:
        """The parts on the host."""
        return frozenset(self._host)

    def part_storages(self, part: str) -> list[torch.UntypedStorage]:
        """The distinct non-empty storages ``offload([part])`` would move now."""
        earlier = set()
        for before in PARTS[: PARTS.index(part)]:
            earlier |= set(_distinct(part_tensors(self.engine, before)))
        return [s for ptr, s in _distinct(part_tensors(self.engine, part)).items() if ptr not in earlier]

    @torch.no_grad()
    def offload(self, parts: Iterable[str]) -> int:
        """Moves the named parts that are on the device to host memory; returns bytes freed."""
        todo = [p for p in PARTS if p in set(parts) - set(self._host)]
        if not todo:
            return 0
        for hook in self.engine.before_state_moves:  # e.g. an async checkpoint write in flight
            hook()
        freed = 0
        for part in todo:  # one part at a time: a later part's exclusions see the earlier ones
            self._host[part], moved = _to_host(self.part_storages(part))
            freed += moved
        return freed

    @torch.no_grad()
    def onload(self, parts: Iterable[str]) -> None:
        """Brings the named parts that are on the host back (bit for bit)."""
        todo = [p for p in PARTS if p in set(parts) & set(self._host)]
        if not todo:
            return
        for hook in self.engine.before_state_moves:
            hook()
        for part in todo:
            _to_device(self._host.pop(part))
