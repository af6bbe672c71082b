"""Named, version-gated workarounds for defects in megatron-core.

Each fix names the defect, the megatron-core versions known to have it, and whether it matters on
the current platform. ``apply_fixes`` applies those that match the installed version and records
them; a version outside every range gets none of them, so an upgrade surfaces a defect (through the
test that proves each fix) instead of hiding it under a stale patch.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
from typing import Callable, Iterable, Iterator

import torch

from mcore_rl.errors import McoreRLError
from mcore_rl.platform.patching import wrap_method as _wrap_method
from mcore_rl.platform.activation_fixes import ACTIVATION_FIXES
from mcore_rl.platform.attention_fixes import ATTENTION_FIXES
from mcore_rl.platform.fix_spec import Fix
from mcore_rl.platform.hybrid_fixes import HYBRID_FIXES
from mcore_rl.platform.moe_bias_fixes import MOE_BIAS_FIXES


class FixError(McoreRLError, LookupError):
    """A fix was named that is not applied."""


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


def _distopt_load_under_no_grad() -> Callable[[], None]:
    """``DistributedOptimizer.load_state_dict`` (dp_reshardable) copies the loaded main params into
    the main params, which for fp32 params are views of the model params: an in-place op on a
    view of a leaf that requires grad, so autograd raises unless the caller holds
    ``torch.no_grad()``. Loading is not differentiable: run it under no_grad."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def make(original):
        def load_state_dict(self, state_dict):
            with torch.no_grad():
                return original(self, state_dict)

        return load_state_dict

    return _wrap_method(DistributedOptimizer, "load_state_dict", make)


def _distopt_reshardable_keeps_adam_step() -> Callable[[], None]:
    """With torch's Adam (no apex/TE) every main param's state holds a ``step`` tensor, which
    ``load_state_dict`` has already set from the checkpoint's param groups before the param
    state is loaded. Then ``_set_main_param_and_optimizer_states`` copies every destination key
    from the source: fully_reshardable sources skip ``step`` (KeyError 'step'); dp_reshardable
    sources carry ``step`` as a LocalNonpersistentObject, i.e. the *loading* optimizer's own
    step at template time (0 for a fresh one), which overwrites the loaded step. The step set
    from the param groups is kept in both cases."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def make(original):
        def _set_main_param_and_optimizer_states(self, model_param, tensors):
            if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                group_index, group_order = self.model_param_group_index_map[model_param]
                main_param = self.optimizer.param_groups[group_index]["params"][group_order]
                state = self.optimizer.state[main_param]
                if "step" in state:
                    tensors = {**tensors, "step": state["step"]}
            return original(self, model_param, tensors)

        return _set_main_param_and_optimizer_states

    return _wrap_method(DistributedOptimizer, "_set_main_param_and_optimizer_states", make)


def _distopt_unshare_loaded_adam_step() -> Callable[[], None]:
    """Without apex/TE, ``load_state_dict`` gives every param's Adam state the same ``step``
    tensor object and torch's Adam keeps it shared, so each update adds 1 once per parameter
    (step 2 becomes 2 + n_params): the bias correction of every resumed run is wrong. Each
    param gets its own copy after loading."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def make(original):
        def load_state_dict(self, state_dict):
            out = original(self, state_dict)
            for state in self.optimizer.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].detach().clone()
            return out

        return load_state_dict

    return _wrap_method(DistributedOptimizer, "load_state_dict", make)


def _distopt_state_dict_before_first_step() -> Callable[[], None]:
    """Without apex/TE, ``DistributedOptimizer.state_dict`` reads the one ``step`` of torch's
    Adam state (``assert len(steps) == 1``), so a fresh optimizer, which has no state yet, cannot
    even build the template to load a checkpoint into (``sharded_state_dict(is_loading=True)``).
    The state is first allocated as megatron's own ``init_state_fn`` does, plus a zero ``step``
    per param (what torch's Adam holds after its first step, minus one)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    def make(original):
        def state_dict(self):
            inner = self.optimizer
            if isinstance(inner, torch.optim.Adam) and len(inner.state) == 0:
                self.init_state_fn(inner, self.config)
                for group in inner.param_groups:
                    for p in group["params"]:
                        inner.state[p].setdefault("step", torch.zeros((), dtype=torch.float32))  # host: torch Adam keeps step on the CPU
            return original(self)

        return state_dict

    return _wrap_method(DistributedOptimizer, "state_dict", make)


def _scheduler_load_sets_step_count() -> Callable[[], None]:
    """``OptimizerParamScheduler.load_state_dict`` calls ``self.step(increment=saved_steps)``,
    which adds the saved count to the scheduler's own: loading into a scheduler that has stepped
    (a second resume in one process, a rollback) leaves it at own + saved steps, i.e. a wrong LR.
    The count is zeroed first, so the loaded count is the count."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    def make(original):
        def load_state_dict(self, state_dict):
            self.num_steps = 0
            return original(self, state_dict)

        return load_state_dict

    return _wrap_method(OptimizerParamScheduler, "load_state_dict", make)


class _CompileOnFirstCall:
    """``torch.compile(fn, **options)`` made on the first call instead of at decoration: the same
    compiled function, without importing torch._dynamo / torch._inductor before it is needed."""

    def __init__(self, compile_fn: Callable, fn: Callable, options: dict) -> None:
        self._compile, self._fn, self._options = compile_fn, fn, options
        self._compiled: Callable | None = None
        self._lock = threading.Lock()
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if self._compiled is None:
            with self._lock:
                if self._compiled is None:
                    self._compiled = self._compile(self._fn, **self._options)
        return self._compiled(*args, **kwargs)


def _defer_import_time_compile() -> Callable[[], None]:
    """``megatron.core.jit`` binds ``jit_fuser = torch.compile`` and ~40 functions (fusions, MoE
    router and dispatcher, norms) are decorated with it at import: every process that imports
    megatron-core imports torch._dynamo and torch._inductor (2-3 s on 2 cores), even one that
    never calls them (the converter). While megatron-core is imported, ``torch.compile`` on a
    plain function returns a wrapper that compiles it with the same options on its first call;
    ``jit_fuser`` keeps that wrapper, so what those functions compute is unchanged."""
    original = torch.compile

    def deferred(model=None, **options):
        if model is None:  # decorator with options: @torch.compile(...)
            return lambda fn: deferred(fn, **options)
        if not inspect.isfunction(model):  # modules keep torch.compile's own object
            return original(model, **options)
        return _CompileOnFirstCall(original, model, options)

    torch.compile = deferred
    return lambda: setattr(torch, "compile", original)


def _mla_without_te_stand_ins() -> Callable[[], None]:
    """megatron.core.extensions.transformer_engine never raises ImportError without TE (it binds
    MagicMock stand-ins), so multi_latent_attention's ``HAVE_TE`` is True and its
    ``isinstance(self.linear_proj, TELinear)`` raises TypeError (TELinear is no class)."""
    import importlib.util

    from megatron.core.transformer import multi_latent_attention as mla

    if importlib.util.find_spec("transformer_engine") is not None or not mla.HAVE_TE:
        return lambda: None
    mla.HAVE_TE = False
    return lambda: setattr(mla, "HAVE_TE", True)


def _mla_yarn_on_host() -> Callable[[], None]:
    """MLA builds YarnRotaryEmbedding without ``use_cpu_initialization``, so its __init__ enters
    ``torch.device(torch.cuda.current_device())``, which a CPU-only torch refuses."""
    from megatron.core.transformer import multi_latent_attention as mla

    original = mla.YarnRotaryEmbedding

    class HostYarnRotaryEmbedding(original):
        def __init__(self, *args, **kwargs):
            kwargs["use_cpu_initialization"] = True
            super().__init__(*args, **kwargs)

    mla.YarnRotaryEmbedding = HostYarnRotaryEmbedding
    return lambda: setattr(mla, "YarnRotaryEmbedding", original)


def _frozen_linear_dgrad_folded() -> Callable[[], None]:
    """``LinearWithFrozenWeight.backward`` computes ``grad_output.matmul(weight)``. GPTModel gives
    its output layer the gradient of ``logits.transpose(0, 1)``: a non-contiguous [s, b, V] view,
    which ``torch.matmul`` cannot fold into one [s*b, V] x [V, h] product, so it runs a batched
    product over the s positions against the weight expanded s times. On the CPU that is ~5x
    slower (a frozen LM head, LoRA on SmolLM2-135M: 1.4 s instead of 0.25 s per micro-batch
    pair, a quarter of the update). A contiguous gradient gives the folded product."""
    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight

    def make(original):
        def backward(ctx, grad_output):
            return original(ctx, grad_output.contiguous())

        return backward

    return _wrap_method(LinearWithFrozenWeight, "backward", make)


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
        name="distopt_load_under_no_grad",
        defect="DistributedOptimizer.load_state_dict (dp_reshardable, fp32 params): in-place copy "
        "into a view of a leaf that requires grad (RuntimeError) unless under torch.no_grad()",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=_distopt_load_under_no_grad,
    ),
    Fix(
        name="distopt_reshardable_keeps_adam_step",
        defect="torch Adam step on load: fully_reshardable KeyError 'step' in "
        "_set_main_param_and_optimizer_states; dp_reshardable overwrites it with the template's",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=_distopt_reshardable_keeps_adam_step,
    ),
    Fix(
        name="distopt_unshare_loaded_adam_step",
        defect="after DistributedOptimizer.load_state_dict with torch Adam all params share one "
        "step tensor: each update adds n_params to it",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=_distopt_unshare_loaded_adam_step,
    ),
    Fix(
        name="distopt_state_dict_before_first_step",
        defect="DistributedOptimizer.state_dict (and sharded_state_dict(is_loading=True)) of a "
        "torch Adam that has not stepped: AssertionError (no step)",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=_distopt_state_dict_before_first_step,
    ),
    Fix(
        name="scheduler_load_sets_step_count",
        defect="OptimizerParamScheduler.load_state_dict adds the saved num_steps to the current "
        "count instead of setting it (a stepped scheduler ends at own + saved steps)",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=_scheduler_load_sets_step_count,
    ),
    Fix(
        name="mla_without_te_stand_ins",
        defect="without Transformer Engine, MLASelfAttention raises TypeError in isinstance(..., "
        "TELinear): its HAVE_TE is True because the TE extension binds MagicMock stand-ins",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=_mla_without_te_stand_ins,
    ),
    Fix(
        name="mla_yarn_on_host",
        defect="MLA's YarnRotaryEmbedding is built on torch.device(current_device()): a CPU-only "
        "torch refuses it (RuntimeError: Cannot access accelerator device)",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=True,
        apply=_mla_yarn_on_host,
    ),
    Fix(
        name="frozen_linear_dgrad_folded",
        defect="LinearWithFrozenWeight's dgrad of GPTModel's transposed logits gradient runs as a "
        "batched matmul against the weight expanded per position (~5x slower on the CPU)",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=True,
        apply=_frozen_linear_dgrad_folded,
    ),
    Fix(
        name="jit_fuser_compiles_at_import",
        defect="importing megatron-core runs torch.compile on ~40 jit_fuser functions, importing "
        "torch._dynamo and torch._inductor (2-3 s) in processes that never call them",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=_defer_import_time_compile,
        before_import=True,
    ),
    *HYBRID_FIXES,
    *MOE_BIAS_FIXES,
    *ATTENTION_FIXES,
    *ACTIVATION_FIXES,
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
            if (only is not None and fix.name not in only) or fix.before_import:
                continue
            if fix.matches(version, on_cpu) and fix.name not in _undo:
                _undo[fix.name] = fix.apply() or (lambda: None)
                applied.append(fix.name)
    except BaseException:  # all or nothing: a failed setup leaves megatron as it was
        revert_fixes(applied)
        raise
    return applied


@contextlib.contextmanager
def megatron_import_fixes(on_cpu: bool) -> Iterator[list[str]]:
    """Context for the first import of megatron-core in a process: applies the ``before_import``
    fixes that match the installed version (read from the package metadata: importing megatron
    to ask would be too late) and reverts them on exit. Yields the names applied; none when
    megatron-core is already imported (they could no longer act)."""
    from importlib.metadata import version

    applied: list[str] = []
    if "megatron.core" not in sys.modules:
        installed = version("megatron-core")
        for fix in FIXES:
            if fix.before_import and fix.matches(installed, on_cpu) and fix.name not in _undo:
                _undo[fix.name] = fix.apply() or (lambda: None)
                applied.append(fix.name)
    try:
        yield applied
    finally:
        revert_fixes(applied)


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

