"""The two platform fixes that let megatron-core's ``GatedDeltaNet`` run without
flash-linear-attention and without a GPU (registered in :mod:`mcore_rl.platform.fixes` as
``gdn_torch_kernels`` and ``gdn_conv1d_on_host``). Each patches globals of megatron's
``gated_delta_net`` module only and returns the undo."""
from __future__ import annotations

from typing import Any, Callable

import torch

from mcore_rl.platform import gdn_kernels
from mcore_rl.platform.cpu_shim import NamespaceProxy
from mcore_rl.platform.cpu_standins import cpu_if_cuda

_MISSING = object()  # saved value of a module global that did not exist


def _set_globals(module: Any, values: dict[str, Any]) -> Callable[[], None]:
    """Sets module globals; the undo restores (or deletes) each."""
    saved = {name: module.__dict__.get(name, _MISSING) for name in values}
    for name, value in values.items():
        setattr(module, name, value)

    def undo() -> None:
        for name, value in saved.items():
            if value is _MISSING:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, value)

    return undo


def install_torch_kernels() -> Callable[[], None]:
    """Without flash-linear-attention, points ``gated_delta_net``'s ``HAVE_FLA`` (its
    constructor raises ImportError when False), ``l2norm``, ``chunk_gated_delta_rule`` and, when
    the ``causal_conv1d`` package is absent too, ``causal_conv1d_fn`` at
    :mod:`mcore_rl.platform.gdn_kernels`. No fake ``fla`` package enters sys.modules, so other
    libraries (transformers) keep their own kernel choice. A no-op when FLA is importable."""
    from megatron.core.ssm import gated_delta_net as gdn

    if gdn.HAVE_FLA:
        return lambda: None
    values: dict[str, Any] = {
        "HAVE_FLA": True,
        "l2norm": gdn_kernels.l2norm,
        "chunk_gated_delta_rule": gdn_kernels.chunk_gated_delta_rule,
    }
    if gdn.causal_conv1d_fn is None:
        values["causal_conv1d_fn"] = gdn_kernels.causal_conv1d_fn
    return _set_globals(gdn, values)


def _host_conv1d(*args: Any, device: Any = None, **kwargs: Any) -> torch.nn.Conv1d:
    """``torch.nn.Conv1d`` with a CUDA ``device`` argument mapped to the CPU."""
    return torch.nn.Conv1d(*args, device=cpu_if_cuda(device), **kwargs)


def conv1d_on_host() -> Callable[[], None]:
    """``GatedDeltaNet.__init__`` builds ``nn.Conv1d(device=torch.cuda.current_device())``:
    ``torch.nn`` is outside the CPU shim's reach (it remaps torch's tensor factories, not module
    constructors), so a CPU-only torch raises. The module's ``nn`` global becomes a view of
    ``torch.nn`` whose ``Conv1d`` builds the same layer on the CPU."""
    from megatron.core.ssm import gated_delta_net as gdn

    return _set_globals(gdn, {"nn": NamespaceProxy(torch.nn, {"Conv1d": _host_conv1d})})
