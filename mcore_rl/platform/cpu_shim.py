"""Lets megatron-core's CUDA-assuming code run unchanged on a CPU-only torch build.

Three pieces, installed together by :func:`activate` (called only from
``mcore_rl.platform.setup_platform``, never at import):

1. ``CudaToCpuMode``: a TorchFunctionMode that rewrites CUDA devices in tensor factories,
   ``Tensor.cuda()``/``Tensor.to(cuda)`` and drops ``pin_memory`` so that megatron's
   ``device=torch.cuda.current_device()`` allocations land on the CPU.
2. ``torch.cuda`` stand-ins: ``current_device`` (0, remapped by the mode), ``synchronize``,
   streams and events as no-ops, since on CPU every op is already synchronous.
3. The CUDA RNG is the CPU generator: megatron's RNG tracker forks/restores the "cuda" state
   around tensor-parallel regions; on CPU that state is ``torch.get_rng_state()``.

``torch.cuda.is_available()`` stays False so code that branches on it keeps its CPU path.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")


def _cpu_if_cuda(device: Any) -> Any:
    """Maps any CUDA device spelling (int ordinal, 'cuda[:n]', torch.device) to CPU."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return _CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return _CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return _CPU
    return device


class CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA placements to CPU for every torch call made while the mode is active."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.record_stream:
            return None
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], _cpu_if_cuda(args[1]), *args[2:])
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return func(*args, **kwargs)


class _NoOpEvent:
    """CUDA event stand-in: CPU work is complete when the call returns."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _NoOpStream:
    """CUDA stream stand-in: one implicit in-order CPU stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _NoOpEvent:
        return event or _NoOpEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "_NoOpStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_DEFAULT_STREAM = _NoOpStream()


def _cpu_manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    torch.set_rng_state(new_state)


# name -> CPU stand-in for attributes of torch.cuda that megatron-core calls unconditionally.
_TORCH_CUDA_STANDINS = {
    "current_device": lambda: 0,
    "set_device": lambda device: None,
    "synchronize": lambda device=None: None,
    "Stream": _NoOpStream,
    "Event": _NoOpEvent,
    "current_stream": lambda device=None: _DEFAULT_STREAM,
    "default_stream": lambda device=None: _DEFAULT_STREAM,
    "set_stream": lambda stream: None,
    "stream": lambda stream=None: contextlib.nullcontext(stream),
    "manual_seed": _cpu_manual_seed,
    "manual_seed_all": _cpu_manual_seed,
    "get_rng_state": _cpu_get_rng_state,
    "set_rng_state": _cpu_set_rng_state,
    "empty_cache": lambda: None,
    "memory_allocated": lambda device=None: 0,
    "max_memory_allocated": lambda device=None: 0,
    "memory_reserved": lambda device=None: 0,
}


class CpuShim:
    """Holds what :func:`activate` replaced so tests can undo it (``deactivate``)."""

    def __init__(self) -> None:
        self.mode = CudaToCpuMode()
        self.saved: list[tuple[Any, str, Any]] = []

    def _replace(self, owner: Any, name: str, value: Any) -> None:
        self.saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def activate(self) -> None:
        import megatron.core.tensor_parallel.random as mrandom

        for name, value in _TORCH_CUDA_STANDINS.items():
            self._replace(torch.cuda, name, value)
        self._replace(torch.cuda.random, "get_rng_state", _cpu_get_rng_state)
        self._replace(torch.cuda.random, "set_rng_state", _cpu_set_rng_state)
        # megatron's tracker reads/writes the CUDA generator through these two module functions.
        self._replace(mrandom, "_get_cuda_rng_state", _cpu_get_rng_state)
        self._replace(mrandom, "_set_cuda_rng_state", _cpu_set_rng_state)
        self.mode.__enter__()

    def deactivate(self) -> None:
        self.mode.__exit__(None, None, None)
        for owner, name, value in reversed(self.saved):
            setattr(owner, name, value)
        self.saved.clear()
