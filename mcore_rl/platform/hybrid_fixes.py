"""Platform fixes for hybrid models (Qwen3-Next, Qwen3.5). The first two let megatron-core's ``GatedDeltaNet`` run without
flash-linear-attention and without a GPU (registered in :mod:`mcore_rl.platform.fixes` as
``gdn_torch_kernels`` and ``gdn_conv1d_on_host``). Each patches globals of megatron's
``gated_delta_net`` module only and returns the undo."""
from __future__ import annotations

from typing import Any, Callable

import torch

from mcore_rl.platform import gdn_kernels
from mcore_rl.platform.fix_spec import Fix
from mcore_rl.platform.patching import run_uncompiled, wrap_method
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


def gate_follows_query_heads() -> Callable[[], None]:
    """With ``attention_output_gate`` and fewer KV heads than TP ranks, ``SelfAttention.
    get_query_key_value_tensors`` all-gathers the fused qkv, slices the rank's KV group and
    narrows ``query`` to the rank's share of that group's heads, but returns ``gate`` with all
    of the group's heads: ``_apply_output_gate`` cannot view it as the attention output. The
    gate is narrowed as the query is (same rank index, same head count)."""
    from megatron.core.transformer import attention

    def make(original):
        def get_query_key_value_tensors(self, hidden_states, key_value_states=None,
                                        output_gate=False, split_qkv=True):
            out = original(self, hidden_states, key_value_states, output_gate, split_qkv)
            sharing = self.world_size // self.config.num_query_groups  # ranks per KV head
            if not output_gate or sharing <= 1:
                return out
            query, key, value, gate = out  # gate [sq, b, heads of the group, hn]
            size = self.num_attention_heads_per_partition // sharing
            idx = attention.get_tensor_model_parallel_rank() % sharing
            return query, key, value, gate[:, :, idx * size : (idx + 1) * size, :]

        return get_query_key_value_tensors

    return wrap_method(attention.SelfAttention, "get_query_key_value_tensors", make)


def gated_output_eager() -> Callable[[], None]:
    """``Attention._apply_output_gate`` (x * sigmoid(gate) in fp32) is decorated with megatron's
    ``jit_fuser`` (torch.compile): on the CPU its first call compiles it with inductor (2.6 s
    measured, 4.4 s under load, again for every new shape). The same Python function, uncompiled,
    computes the same values (inductor fuses it, nothing more)."""
    from megatron.core.transformer.attention import Attention

    return run_uncompiled(Attention, "_apply_output_gate")


HYBRID_FIXES: tuple[Fix, ...] = (
    Fix(
        name="gated_attention_gate_follows_query",
        defect="attention_output_gate with num_query_groups < TP: the gate keeps all heads of the "
        "shared KV group while the query is narrowed to the rank's (RuntimeError in "
        "_apply_output_gate's view)",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=gate_follows_query_heads,
    ),
    Fix(
        name="gdn_torch_kernels",
        defect="GatedDeltaNet raises ImportError without flash-linear-attention (a Triton/GPU "
        "package) and its forward calls FLA's l2norm and chunk_gated_delta_rule",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=False,
        apply=install_torch_kernels,
    ),
    Fix(
        name="gdn_conv1d_on_host",
        defect="GatedDeltaNet builds nn.Conv1d(device=torch.cuda.current_device()): a CPU-only "
        "torch raises (RuntimeError: Cannot access accelerator device)",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=True,
        apply=conv1d_on_host,
    ),
    Fix(
        name="gated_output_eager_on_cpu",
        defect="Attention._apply_output_gate (gated attention) is a jit_fuser (torch.compile) function: "
        "its first call compiles it with inductor, 2.6-4.4 s per CPU process and again per new shape",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=True,
        apply=gated_output_eager,
    ),
)
