"""Named, version-gated workarounds for defects in megatron-core.

Each fix names the defect, the megatron-core versions known to have it, and whether it matters on
the current platform. ``apply_fixes`` applies those that match the installed version and records
them; a version outside every range gets none of them, so an upgrade surfaces a defect (through the
test that proves each fix) instead of hiding it under a stale patch.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from packaging.version import Version

from mcore_rl.errors import McoreRLError


class FixError(McoreRLError, LookupError):
    """A fix was named that is not applied."""


@dataclass(frozen=True)
class Fix:
    """One workaround: ``apply()`` patches megatron-core when ``min_version <= v <= max_version``
    and returns a callable that undoes the patch (used by the test that proves the fix)."""

    name: str
    defect: str
    min_version: str
    max_version: str
    cpu_only: bool
    apply: Callable[[], Callable[[], None]]

    def matches(self, megatron_version: str, on_cpu: bool) -> bool:
        v = Version(megatron_version)
        in_range = Version(self.min_version) <= v <= Version(self.max_version)
        return in_range and (on_cpu or not self.cpu_only)


def _define_te_general_gemm() -> Callable[[], None]:
    """moe_utils imports ``te_general_gemm`` only inside ``try: import transformer_engine`` and
    never defines it otherwise, so RouterGatingLinearFunction raises NameError without TE.
    Defining it as None selects the function's own torch.mm branch."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return lambda: None
    moe_utils.te_general_gemm = None
    return lambda: delattr(moe_utils, "te_general_gemm")


def _cpu_splits_as_numpy() -> Callable[[], None]:
    """``maybe_move_tensor_to_cpu(t, as_numpy=True)`` converts only CUDA tensors, so a tensor
    already on the CPU comes back as a tensor and the alltoall dispatcher hands it to
    ``all_to_all_single`` as split sizes (TypeError). This version honours ``as_numpy`` always."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    @functools.wraps(original)
    def fixed(tensor, as_numpy: bool = False, record_stream: bool = False):
        out = original(tensor, as_numpy=as_numpy, record_stream=record_stream)
        if as_numpy and torch.is_tensor(out) and out.device.type == "cpu":
            out = out.numpy()
        return out

    moe_utils.maybe_move_tensor_to_cpu = fixed
    token_dispatcher.maybe_move_tensor_to_cpu = fixed  # imported by name there

    def undo() -> None:
        moe_utils.maybe_move_tensor_to_cpu = original
        token_dispatcher.maybe_move_tensor_to_cpu = original

    return undo


def _experts_reduce_over_expert_dp() -> Callable[[], None]:
    """Every expert class sets its own ``allreduce`` flag as ``not (is_expert and ep > 1)``
    (local ``ColumnParallelLinear``/``RowParallelLinear`` in ``SequentialMLP``, ``GroupedMLP``'s
    weights, TE's grouped linears in ``TEGroupedMLP``): with ep == 1 their grads go to the dense
    DP group even when etp != tp gives experts another data-parallel group, so DDP averages grads
    of different expert shards (tp=1/etp=2) or skips the expert-DP sum (tp=2/etp=1). Fixed where
    all expert specs meet: after ``MoELayer`` builds its experts module, every parameter of the
    routed experts belongs to the expert-DP group (``allreduce=False``); shared experts and the
    router stay dense."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    original = MoELayer.__dict__["__init__"]

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for param in self.experts.parameters():
            param.allreduce = False

    MoELayer.__init__ = __init__
    return lambda: setattr(MoELayer, "__init__", original)


FIXES: list[Fix] = [
    Fix(
        name="moe_te_general_gemm_undefined",
        defect="NameError: te_general_gemm in RouterGatingLinearFunction without Transformer Engine",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=_define_te_general_gemm,
    ),
    Fix(
        name="moe_cpu_splits_as_numpy",
        defect="maybe_move_tensor_to_cpu(as_numpy=True) returns a tensor for CPU input",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=True,
        apply=_cpu_splits_as_numpy,
    ),
    Fix(
        name="moe_expert_grads_use_expert_dp",
        defect="with ep=1 and etp != tp expert grads are reduced over the dense DP group",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=_experts_reduce_over_expert_dp,
    ),
]
_undo: dict[str, Callable[[], None]] = {}


def megatron_version() -> str:
    from megatron.core.package_info import __version__

    return __version__


def apply_fixes(on_cpu: bool, only: set[str] | None = None) -> list[str]:
    """Applies every matching fix (or only those named in ``only``); returns the names applied."""
    version = megatron_version()
    applied: list[str] = []
    try:
        for fix in FIXES:
            if only is not None and fix.name not in only:
                continue
            if fix.matches(version, on_cpu) and fix.name not in _undo:
                _undo[fix.name] = fix.apply() or (lambda: None)
                applied.append(fix.name)
    except BaseException:  # all or nothing: a failed setup leaves megatron as it was
        revert_fixes(applied)
        raise
    return applied


def revert_fix(name: str) -> None:
    """Undoes an applied fix in this process (tests use it to show the defect comes back)."""
    if name not in _undo:
        raise FixError(f"fix {name!r} is not applied in this process (applied: {sorted(_undo)})")
    _undo.pop(name)()


def revert_fixes(names: Iterable[str]) -> None:
    """Undoes those of ``names`` that are still applied (teardown; a test may have reverted one)."""
    for name in reversed(list(names)):
        if name in _undo:
            _undo.pop(name)()

