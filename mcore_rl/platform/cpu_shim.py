"""Lets megatron-core's CUDA-assuming code run unchanged on a CPU-only torch build, and nothing else.

Only megatron-core's code sees the CPU stand-ins (:mod:`mcore_rl.platform.cpu_standins`); a
trainer's own torch code in the same process (a HF reward or reference model, its collectives)
sees torch exactly as without the shim. Two mechanisms, installed by :meth:`CpuShim.activate`
(called only from ``mcore_rl.platform``, never at import) and undone by :meth:`CpuShim.deactivate`:

1. Namespace proxies. Every ``megatron.*`` module whose globals hold ``torch``, ``torch.cuda``
   or ``torch.distributed`` (``import torch.distributed as dist``) gets a proxy module in their
   place: its tensor factories remap CUDA devices to the CPU, its ``cuda`` has the stand-ins,
   its ``distributed`` has gloo's uneven ``all_gather``/``reduce_scatter``; every other name is
   read from the real module at each access. megatron modules imported later are patched by an
   import hook. The torch module itself is never modified, so e.g. torch's device-context
   constructor table (which transformers' meta-device loading relies on) stays intact.
   Proxies are globals, not a TorchFunctionMode: a mode is popped while its handler runs and is
   thread-local, so allocations inside megatron's custom autograd backward would escape it.
2. Caller-gated methods. ``Tensor.to/.cuda/.new_*/.type/.pin_memory/.record_stream`` and
   ``Module.to/.cuda`` are methods of shared classes; their wrappers apply the CPU behaviour only
   when the calling frame belongs to a ``megatron.`` module and otherwise call the original with
   the same arguments.

``torch.cuda.is_available()`` stays False everywhere, so code that branches on it keeps its CPU
path.
"""
from __future__ import annotations

import functools
import logging
import sys
import types
from typing import Any, Callable

import torch

from mcore_rl.platform import cpu_standins as cs
from mcore_rl.platform.import_hook import AfterImport

_SHIMMED_PREFIX = "megatron."  # modules whose code sees the CPU view of torch
# megatron's RNG tracker warns when the CPU generator moves inside a CUDA fork; here the "CUDA"
# generator is the CPU one (restored when the fork exits), so every dropout would log it
_RNG_LOGGER = "megatron.core.tensor_parallel.random"
_RNG_NOTICE = "CPU RNG state changed within GPU RNG context"


_INHERITED = object()  # saved value of an attribute that was not in the class's own __dict__


class _DropSharedRngNotice(logging.Filter):
    """Drops megatron's CPU-RNG-changed notice (a false positive when both RNGs are one)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != _RNG_NOTICE


def _is_shimmed(module_name: str) -> bool:
    return module_name == "megatron" or module_name.startswith(_SHIMMED_PREFIX)


class NamespaceProxy(types.ModuleType):
    """Stands in for a module (``torch``, ``torch.cuda``, ``torch.distributed``) in megatron's
    globals: its overrides first, every other attribute read from the real module on access."""

    def __init__(self, target: types.ModuleType, overrides: dict[str, Any]) -> None:
        super().__init__(target.__name__, target.__doc__)
        for dunder in ("__package__", "__loader__", "__spec__"):
            del self.__dict__[dunder]  # read from the target instead of None
        self.__dict__.update(overrides)
        self.__dict__["_mcore_rl_target"] = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_mcore_rl_target"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.__dict__["_mcore_rl_target"], name, value)  # writes reach the real module

    def __dir__(self) -> list[str]:
        return sorted(set(dir(self.__dict__["_mcore_rl_target"])) | set(self.__dict__))

    def __repr__(self) -> str:
        return f"<mcore_rl CPU view of module {self.__name__!r}>"


def _build_proxies() -> list[tuple[types.ModuleType, NamespaceProxy]]:
    """(real module, proxy) for torch.cuda, torch.distributed and torch."""
    dist = torch.distributed
    cuda = NamespaceProxy(torch.cuda, dict(cs.TORCH_CUDA_STANDINS))
    dist_proxy = NamespaceProxy(dist, {
        "all_gather": cs.uneven_all_gather(dist.all_gather),
        "reduce_scatter": cs.uneven_reduce_scatter(dist.all_reduce, dist.reduce_scatter),
    })
    torch_overrides: dict[str, Any] = {name: cs.remap_factory(getattr(torch, name)) for name in cs.FACTORIES}
    torch_overrides.update(cuda=cuda, distributed=dist_proxy)
    return [(torch.cuda, cuda), (dist, dist_proxy), (torch, NamespaceProxy(torch, torch_overrides))]


def _gated(original: Callable, for_megatron: Callable) -> Callable:
    """A method that runs ``for_megatron(original, self, ...)`` for calls from megatron's code
    and ``original(self, ...)`` for everyone else."""

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        # inlined (user code pays this on every call): frame 1 is the code calling the method
        if (sys._getframe(1).f_globals.get("__name__") or "").startswith(_SHIMMED_PREFIX):
            return for_megatron(original, self, *args, **kwargs)
        return original(self, *args, **kwargs)

    return method


def _to_cpu(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    args, kwargs = cs.remap_to_args(args, kwargs)
    return original(self, *args, **kwargs)


def _new_on_cpu(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    return original(self, *args, **cs.remap_factory_kwargs(kwargs))


def _stay(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    return self


def _skip(original: Callable, self: Any, *args: Any, **kwargs: Any) -> None:
    return None


def _cuda_type(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    name = original(self, *args, **kwargs)
    return cs.cuda_type_name(name, self) if not args and not kwargs else name


def _method_patches() -> list[tuple[type, str, Callable]]:
    """(class, method name, megatron behaviour) for the methods megatron calls with CUDA intent."""
    patches: list[tuple[type, str, Callable]] = [
        (torch.Tensor, "to", _to_cpu), (torch.nn.Module, "to", _to_cpu),
        (torch.Tensor, "cuda", _stay), (torch.nn.Module, "cuda", _stay),
        (torch.Tensor, "pin_memory", _stay), (torch.Tensor, "type", _cuda_type),
        (torch.Tensor, "record_stream", _skip),
    ]
    patches += [(torch.Tensor, name, _new_on_cpu) for name in cs.TENSOR_FACTORIES]
    return patches


class CpuShim:
    """Installs the CPU view of torch for megatron-core; ``deactivate`` restores every object."""

    def __init__(self) -> None:
        self.saved: list[tuple[Any, str, Any]] = []
        self._proxies: list[tuple[types.ModuleType, NamespaceProxy]] = []
        self._hook: AfterImport | None = None
        self._log_filter = _DropSharedRngNotice()

    @property
    def active(self) -> bool:
        return self._hook is not None

    def _replace(self, owner: Any, name: str, value: Any) -> None:
        # a class that inherits the attribute (Tensor.to lives on TensorBase) gets it deleted back
        inherited = isinstance(owner, type) and name not in vars(owner)
        self.saved.append((owner, name, _INHERITED if inherited else getattr(owner, name)))
        setattr(owner, name, value)

    def patch_module(self, module: types.ModuleType) -> None:
        """Replaces torch / torch.cuda / torch.distributed in a megatron module's globals."""
        namespace = getattr(module, "__dict__", None)
        if not self.active or not isinstance(namespace, dict):
            return
        for name, value in list(namespace.items()):
            for real, proxy in self._proxies:
                if value is real:
                    self._replace(module, name, proxy)

    def activate(self) -> None:
        """Gives megatron's loaded and future modules the CPU view; gates the shared methods."""
        if self.active:
            return
        import megatron.core.tensor_parallel.random as mrandom

        self._proxies = _build_proxies()
        self._hook = AfterImport(_is_shimmed, self.patch_module)
        self._hook.install()
        for module_name, module in list(sys.modules.items()):
            if _is_shimmed(module_name) and module is not None:
                self.patch_module(module)
        # megatron's RNG tracker reads/writes the CUDA generator through these two functions.
        self._replace(mrandom, "_get_cuda_rng_state", cs.cpu_get_rng_state)
        self._replace(mrandom, "_set_cuda_rng_state", cs.cpu_set_rng_state)
        for owner, name, for_megatron in _method_patches():
            self._replace(owner, name, _gated(getattr(owner, name), for_megatron))
        logging.getLogger(_RNG_LOGGER).addFilter(self._log_filter)

    def deactivate(self) -> None:
        """Restores every replaced object and removes the import hook."""
        if self._hook is not None:
            self._hook.remove()
        self._hook = None
        for owner, name, value in reversed(self.saved):
            if value is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
        self.saved.clear()
        self._proxies = []
        logging.getLogger(_RNG_LOGGER).removeFilter(self._log_filter)
