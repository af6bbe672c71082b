"""Offload a ModelEngine's parameters, gradients and optimizer state to host memory between
phases (e.g. while a rollout engine needs the GPU), and bring them back unchanged.

Works on storages, not tensors: megatron's parameters and fp32 optimizer shards are views into
DDP's contiguous buffers, so copying each underlying storage once and shrinking it to zero bytes
frees the device memory and keeps every view valid once the storage is restored. On GPU the host
copy is pinned; on CPU the same mechanism runs (its test checks storages really reach 0 bytes).
"""
from __future__ import annotations

from typing import Iterable

import torch

from mcore_rl.rl.engine import ModelEngine

Tensor = torch.Tensor


def _optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


def _optimizer_tensors(optimizer) -> Iterable[Tensor]:
    for opt in _optimizers(optimizer):
        for state in opt.optimizer.state.values():
            yield from (v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        for group in getattr(opt, "shard_fp32_from_float16_groups", None) or []:
            yield from group


def _engine_tensors(engine: ModelEngine, params: bool, grads: bool, optimizer: bool) -> list[Tensor]:
    tensors: list[Tensor] = []
    for chunk in engine.model:
        for buffer in getattr(chunk, "buffers", []) + getattr(chunk, "expert_parallel_buffers", []):
            if params and buffer.param_data is not None:
                tensors.append(buffer.param_data)
            if grads:
                tensors.append(buffer.grad_data)
    if optimizer and engine.optimizer is not None:
        tensors.extend(_optimizer_tensors(engine.optimizer))
    return tensors


class Offloader:
    """``offload()`` moves the engine's state to host memory and frees its storage;
    ``onload()`` restores it bit for bit. Only for trainable (DDP-wrapped) engines."""

    def __init__(self, engine: ModelEngine, params: bool = True, grads: bool = True, optimizer: bool = True):
        if engine.optimizer is None:
            raise ValueError("Offloader needs a trainable engine (built with optim=...).")
        self.engine, self.parts = engine, (params, grads, optimizer)
        self._host: list[tuple[torch.UntypedStorage, Tensor]] = []

    def storages(self) -> list[torch.UntypedStorage]:
        """The distinct storages behind the engine's state (what offload frees)."""
        unique: dict[int, torch.UntypedStorage] = {}
        for t in _engine_tensors(self.engine, *self.parts):
            storage = t.untyped_storage()
            unique.setdefault(storage.data_ptr(), storage)
        return list(unique.values())

    @torch.no_grad()
    def offload(self) -> int:
        """Copies every storage to host memory and shrinks it to 0 bytes; returns bytes freed."""
        if self._host:
            raise RuntimeError("already offloaded; call onload() first.")
        freed = 0
        pin = torch.cuda.is_available()
        for storage in self.storages():
            device_bytes = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pin)
            host.copy_(device_bytes)
            freed += storage.nbytes()
            storage.resize_(0)
            self._host.append((storage, host))
        return freed

    @torch.no_grad()
    def onload(self) -> None:
        """Gives every storage its bytes back (same storages: all views stay valid)."""
        for storage, host in self._host:
            storage.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage).copy_(host)
        self._host.clear()

    @property
    def offloaded(self) -> bool:
        return bool(self._host)
