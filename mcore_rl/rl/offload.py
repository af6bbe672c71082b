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


class Offloader:
    """``offload()`` moves the engine's state to host memory and frees its storage;
    ``onload()`` restores it bit for bit. Trainable (either optimizer kind) or frozen engines."""

    def __init__(self, engine: ModelEngine, params: bool = True, grads: bool = True, optimizer: bool = True):
        self.engine, self.parts = engine, (params, grads, optimizer)
        self._host: list[tuple[torch.UntypedStorage, Tensor]] = []

    def storages(self) -> list[torch.UntypedStorage]:
        """The distinct non-empty storages behind the engine's state (what offload frees)."""
        unique: dict[int, torch.UntypedStorage] = {}
        for t in engine_tensors(self.engine, *self.parts):
            storage = t.untyped_storage()
            if storage.nbytes() > 0:  # an empty storage has no address to tell it apart
                unique.setdefault(storage.data_ptr(), storage)
        return list(unique.values())

    @torch.no_grad()
    def offload(self) -> int:
        """Copies every storage to host memory and shrinks it to 0 bytes; returns bytes freed."""
        for hook in self.engine.before_state_moves:  # e.g. an async checkpoint write in flight
            hook()
        if self._host:
            raise OffloadError("offload() called twice: the engine's state is already on the host "
                               "(its device storages are empty); call onload() first.")
        freed, on_cuda = 0, False
        for storage in self.storages():
            on_cuda |= storage.device.type == "cuda"
            device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=storage.device.type == "cuda")  # host: the offload copy
            host.copy_(device_bytes)
            freed += storage.nbytes()
            storage.resize_(0)
            self._host.append((storage, host))
        if on_cuda:  # the caching allocator would otherwise keep the freed blocks
            torch.cuda.empty_cache()
        return freed

    @torch.no_grad()
    def onload(self) -> None:
        """Gives every storage its bytes back (same storages: all views stay valid)."""
        for hook in self.engine.before_state_moves:
            hook()
        for storage, host in self._host:
            storage.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host)
        self._host.clear()

    @property
    def offloaded(self) -> bool:
        return bool(self._host)
