"""CPU stand-ins for the CUDA-only pieces of torch that megatron-core calls unconditionally.

Nothing here patches anything: :mod:`mcore_rl.platform.cpu_shim` hands these objects to
megatron-core's own module namespaces (and to method calls made from megatron-core's code), so
code running beside megatron sees torch unchanged.

- Device remap: ``device=torch.cuda.current_device()`` (0), ``'cuda[:n]'`` and CUDA
  ``torch.device`` targets land on the CPU; ``pin_memory`` is dropped (no CUDA on this build).
- ``torch.cuda`` stand-ins: ``current_device`` (0), ``synchronize``, streams and events as no-ops
  (on CPU every op is complete when it returns); ``Tensor.type()`` reports CUDA type names, which
  megatron's optimizers check.
- The CUDA RNG is the CPU generator: megatron's RNG tracker forks/restores the "cuda" state around
  tensor-parallel regions; on CPU that state is ``torch.get_rng_state()``.
- gloo collectives: megatron's MoE dispatchers call list-form ``all_gather``/``reduce_scatter``
  with uneven pieces, which NCCL accepts and gloo refuses; these pad/reduce instead.
"""
from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable

import torch

_CPU = torch.device("cpu")

# torch factories megatron-core calls with device=torch.cuda.current_device() or 'cuda'.
FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "range", "linspace",
    "logspace", "eye", "rand", "randn", "randint", "randperm", "empty_like", "zeros_like",
    "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "empty_strided",
    "scalar_tensor",
)
TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def cpu_if_cuda(device: Any) -> Any:
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


def remap_factory_kwargs(kwargs: dict) -> dict:
    """``device=<cuda>`` becomes the CPU and ``pin_memory=True`` is dropped (in place)."""
    if "device" in kwargs:
        kwargs["device"] = cpu_if_cuda(kwargs["device"])
    if kwargs.get("pin_memory"):
        kwargs["pin_memory"] = False
    return kwargs


def remap_factory(fn: Callable) -> Callable:
    """A tensor factory whose ``device=<cuda>`` lands on the CPU and pin_memory is dropped."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **remap_factory_kwargs(kwargs))

    return wrapper


def remap_to_args(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Arguments of ``Tensor.to``/``Module.to``/``.cuda()``: a CUDA target becomes the CPU."""
    if args:
        args = (cpu_if_cuda(args[0]), *args[1:])
    if "device" in kwargs:
        kwargs["device"] = cpu_if_cuda(kwargs["device"])
    return args, kwargs


def cuda_type_name(name: Any, tensor: torch.Tensor) -> Any:
    """'torch.FloatTensor' of a CPU tensor reads 'torch.cuda.FloatTensor' (megatron's optimizers
    check ``param.type() == 'torch.cuda.FloatTensor'``)."""
    if isinstance(name, str) and name.startswith("torch.") and not name.startswith("torch.cuda.") \
            and tensor.device.type == "cpu":
        return "torch.cuda." + name[len("torch."):]
    return name


class NoOpEvent:
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


class NoOpStream:
    """CUDA stream stand-in: one implicit in-order CPU stream."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> NoOpEvent:
        return event or NoOpEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "NoOpStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_DEFAULT_STREAM = NoOpStream()


def uneven_all_gather(original: Callable) -> Callable:
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


def uneven_reduce_scatter(all_reduce: Callable, original: Callable) -> Callable:
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


def cpu_manual_seed(seed: int) -> None:
    """``torch.cuda.manual_seed`` for megatron: seeds the CPU generator (the "CUDA" one here)."""
    torch.default_generator.manual_seed(int(seed))


def cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False):
    """megatron's ``_get_cuda_rng_state``: the CPU generator's state (ByteTensor)."""
    return torch.get_rng_state()


def cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False):
    """megatron's ``_set_cuda_rng_state``: restores the CPU generator's state."""
    torch.set_rng_state(new_state)


# name -> CPU stand-in for attributes of torch.cuda that megatron-core calls unconditionally.
TORCH_CUDA_STANDINS: dict[str, Any] = {
    "current_device": lambda: 0,
    "set_device": lambda device: None,
    "synchronize": lambda device=None: None,
    "Stream": NoOpStream,
    "Event": NoOpEvent,
    "current_stream": lambda device=None: _DEFAULT_STREAM,
    "default_stream": lambda device=None: _DEFAULT_STREAM,
    "set_stream": lambda stream: None,
    "stream": lambda stream=None: contextlib.nullcontext(stream),
    "manual_seed": cpu_manual_seed,
    "manual_seed_all": cpu_manual_seed,
    "get_rng_state": cpu_get_rng_state,
    "set_rng_state": cpu_set_rng_state,
    "empty_cache": lambda: None,
    "memory_allocated": lambda device=None: 0,
    "max_memory_allocated": lambda device=None: 0,
    "memory_reserved": lambda device=None: 0,
}
