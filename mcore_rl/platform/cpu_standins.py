"""Lets megatron-core's CUDA-assuming code run unchanged on a CPU-only torch build.

Three pieces, installed together by :func:`activate` (called only from
``mcore_rl.platform.setup_platform``, never at import):

1. Device remap: torch's tensor factories, ``Tensor.new_*``, ``Tensor.to``/``Module.to`` and
   ``.cuda()`` are wrapped so that megatron's ``device=torch.cuda.current_device()`` (0) and
   ``'cuda'`` placements land on the CPU. Plain patches rather than a TorchFunctionMode: a mode
   is popped while its handler runs, so code inside ``torch.autograd.backward`` (megatron's
   custom backward functions allocate there) would escape it; it is also thread-local.
2. ``torch.cuda`` stand-ins: ``current_device`` (0, remapped by the mode), ``synchronize``,
   streams and events as no-ops, since on CPU every op is already synchronous.
   ``Tensor.type()`` reports CUDA type names, which megatron's optimizers check.
3. gloo collectives: megatron's MoE dispatchers call list-form ``all_gather``/``reduce_scatter``
   with uneven pieces, which NCCL accepts and gloo refuses; these are done by padding/reducing.
4. The CUDA RNG is the CPU generator: megatron's RNG tracker forks/restores the "cuda" state
   around tensor-parallel regions; on CPU that state is ``torch.get_rng_state()``.

``torch.cuda.is_available()`` stays False so code that branches on it keeps its CPU path.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

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


def _remap_device(fn: Callable) -> Callable:
    """Wraps a tensor factory so ``device=<cuda>`` lands on the CPU and pin_memory is dropped."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return wrapper


def _remap_to(fn: Callable) -> Callable:
    """Tensor.to / Module.to: a CUDA target (positional or keyword) becomes the CPU."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        if args:
            args = (_cpu_if_cuda(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _cpu_if_cuda(kwargs["device"])
        return fn(self, *args, **kwargs)

    return wrapper


def _cuda_type_names(original: Callable) -> Callable:
    """``Tensor.type()`` with no argument reports CPU tensors under their CUDA type names:
    megatron's optimizers check ``param.type() == 'torch.cuda.FloatTensor'``."""

    @functools.wraps(original)
    def type_(self: Any, *args: Any, **kwargs: Any) -> Any:
        name = original(self, *args, **kwargs)
        if not args and not kwargs and isinstance(name, str) and name.startswith("torch.") \
                and not name.startswith("torch.cuda.") and self.device.type == "cpu":
            return "torch.cuda." + name[len("torch."):]
        return name

    return type_


def _identity(self: Any, *args: Any, **kwargs: Any) -> Any:
    return self


def _no_op(*args: Any, **kwargs: Any) -> None:
    return None


# torch factories megatron-core calls with device=torch.cuda.current_device() or 'cuda'.
_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_like", "zeros_like",
    "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "empty_strided",
    "scalar_tensor",
)
_TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


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


def _uneven_all_gather(original: Callable) -> Callable:
    """gloo's all_gather needs equal sizes; megatron's MoE dispatchers gather uneven token counts
    (NCCL allows it). Pads to the largest piece, gathers, and copies each piece out."""

    @functools.wraps(original)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        sizes = [t.shape[0] for t in tensor_list]
        if len(set(sizes)) == 1 or async_op or tensor.dim() == 0:
            return original(tensor_list, tensor, group=group, async_op=async_op)
        longest = max(sizes)
        padded = tensor.new_zeros(longest, *tensor.shape[1:])
        padded[: tensor.shape[0]] = tensor
        pieces = [torch.empty_like(padded) for _ in sizes]
        original(pieces, padded, group=group)
        for out, piece, n in zip(tensor_list, pieces, sizes):
            out.copy_(piece[:n])
        return None

    return all_gather


def _uneven_reduce_scatter(all_reduce: Callable, original: Callable) -> Callable:
    """gloo has no list-form reduce_scatter; megatron's MoE combine uses it with uneven pieces.
    Reduces the concatenation and keeps this rank's piece."""

    @functools.wraps(original)
    def reduce_scatter(output, input_list, op=None, group=None, async_op=False):
        if async_op:
            return original(output, input_list, op=op, group=group, async_op=async_op)
        full = torch.cat(list(input_list))
        kwargs = {"group": group} if op is None else {"group": group, "op": op}
        all_reduce(full, **kwargs)
        rank = torch.distributed.get_rank(group)
        start = sum(t.shape[0] for t in input_list[:rank])
        output.copy_(full[start : start + input_list[rank].shape[0]])
        return None

    return reduce_scatter


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
        for name in _FACTORIES:
            self._replace(torch, name, _remap_device(getattr(torch, name)))
        for name in _TENSOR_FACTORIES:
            self._replace(torch.Tensor, name, _remap_device(getattr(torch.Tensor, name)))
        self._replace(torch.Tensor, "to", _remap_to(torch.Tensor.to))
        self._replace(torch.nn.Module, "to", _remap_to(torch.nn.Module.to))
        for owner in (torch.Tensor, torch.nn.Module):
            self._replace(owner, "cuda", _identity)
        self._replace(torch.Tensor, "pin_memory", _identity)
        self._replace(torch.Tensor, "type", _cuda_type_names(torch.Tensor.type))
        self._replace(torch.Tensor, "record_stream", _no_op)
        dist = torch.distributed
        self._replace(dist, "all_gather", _uneven_all_gather(dist.all_gather))
        self._replace(dist, "reduce_scatter", _uneven_reduce_scatter(dist.all_reduce, dist.reduce_scatter))

    def deactivate(self) -> None:
        for owner, name, value in reversed(self.saved):
            setattr(owner, name, value)
        self.saved.clear()
