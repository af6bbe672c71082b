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


def _distopt_load_before_first_step() -> Callable[[], None]:
    """Without Transformer Engine/apex, ``DistributedOptimizer.state_dict()`` reads the per-param
    ``step`` of torch Adam and asserts there is exactly one value; an optimizer that has not
    stepped yet has no state at all, so ``sharded_state_dict(is_loading=True)`` -- what a resume
    into a fresh optimizer calls -- fails with a bare AssertionError. Before a load, the empty
    states are filled with what torch Adam would create (zeros, step 0); the load replaces them."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    original = dopt.DistributedOptimizer.sharded_state_dict

    @functools.wraps(original)
    def sharded_state_dict(self, model_sharded_state_dict={}, is_loading=False, *args, **kwargs):
        inner = self.optimizer
        if is_loading and not dopt.HAVE_APEX_OR_TE and isinstance(inner, torch.optim.Adam):
            for group in inner.param_groups:
                for p in group["params"]:
                    if not inner.state[p]:
                        inner.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                              step=torch.tensor(0.0))
        return original(self, model_sharded_state_dict, is_loading, *args, **kwargs)

    dopt.DistributedOptimizer.sharded_state_dict = sharded_state_dict
    return lambda: setattr(dopt.DistributedOptimizer, "sharded_state_dict", original)


def _distopt_keep_loaded_adam_step() -> Callable[[], None]:
    """Without Transformer Engine/apex, torch Adam keeps a per-param ``step``.
    ``DistributedOptimizer.load_state_dict`` sets it from the checkpoint's param groups, then
    ``_set_main_param_and_optimizer_states`` copies every destination key from the loaded
    param state: dp_reshardable carries ``step`` as a non-persistent object (the value from
    before the load), which silently resets Adam's step (bias correction differs after a
    resume); fully_reshardable carries none (``KeyError: 'step'``). Here the source's ``step`` is
    the step just loaded from the param groups, so the copy keeps it. And load_state_dict gives
    every param the SAME step tensor, which torch Adam then increments once per param per step:
    each param gets its own copy."""
    from megatron.core.optimizer import distrib_optimizer as dopt

    original = dopt.DistributedOptimizer._set_main_param_and_optimizer_states

    @functools.wraps(original)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not dopt.HAVE_APEX_OR_TE and not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:
                tensors = {**tensors, "step": step}
        return original(self, model_param, tensors)

    original_load = dopt.DistributedOptimizer.load_state_dict

    @functools.wraps(original_load)
    def load_state_dict(self, state_dict):
        original_load(self, state_dict)
        if not dopt.HAVE_APEX_OR_TE:  # one step tensor per param, as torch Adam keeps them
            for state in self.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()

    dopt.DistributedOptimizer._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    dopt.DistributedOptimizer.load_state_dict = load_state_dict

    def undo() -> None:
        dopt.DistributedOptimizer._set_main_param_and_optimizer_states = original
        dopt.DistributedOptimizer.load_state_dict = original_load

    return undo


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
    Fix(
        name="distopt_load_before_first_step",
        defect="DistributedOptimizer.sharded_state_dict(is_loading=True) asserts on a torch Adam "
        "that has not stepped (no per-param 'step')",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=_distopt_load_before_first_step,
    ),
    Fix(
        name="distopt_keep_loaded_adam_step",
        defect="DistributedOptimizer load with torch Adam resets 'step' (dp_reshardable), raises "
        "KeyError: 'step' (fully_reshardable) and shares one step tensor among all params",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=_distopt_keep_loaded_adam_step,
    ),
]
_undo: dict[str, Callable[[], None]] = {}


def megatron_version() -> str:
    from megatron.core.package_info import __version__

    return __version__


def apply_fixes(on_cpu: bool, only: set[str] | None = None) -> list[str]:
    """Applies every matching fix (or only those named in ``only``); returns the names applied."""
    version = megatron_version()
    applied = []
    for fix in FIXES:
        if only is not None and fix.name not in only:
            continue
        if fix.matches(version, on_cpu) and fix.name not in _undo:
            _undo[fix.name] = fix.apply() or (lambda: None)
            applied.append(fix.name)
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

