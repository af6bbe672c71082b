"""Platform fixes for megatron-core's attention modules (registered in
:mod:`mcore_rl.platform.fixes`). Each patches one class and returns the undo."""
from __future__ import annotations

from typing import Callable

import torch

from mcore_rl.platform.fix_spec import Fix
from mcore_rl.platform.patching import wrap_method


def _mark_softmax_offset(module: torch.nn.Module) -> None:
    """Marks ``module.softmax_offset`` (the learnable attention sink, [heads on this TP rank]) as
    split over tensor parallelism on axis 0, as megatron's parallel linears mark their weights.
    A buffer (``off-by-one``), None (``vanilla``) or an already marked parameter is left alone."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    offset = getattr(module, "softmax_offset", None)
    if not isinstance(offset, torch.nn.Parameter) or getattr(offset, "tensor_model_parallel", False):
        return
    for attribute in ("tensor_model_parallel", "partition_dim", "partition_stride"):
        if hasattr(offset, attribute):  # a partial marking: set_... asserts none is present
            delattr(offset, attribute)
    set_tensor_model_parallel_attributes(offset, True, 0, 1)


def _sink_classes() -> list[type]:
    """megatron's local ``DotProductAttention``, and ``TEDotProductAttention`` when Transformer
    Engine is importable (without it the class derives from a MagicMock stand-in: never built)."""
    from megatron.core.extensions import transformer_engine as te_ext
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    classes: list[type] = [DotProductAttention]
    if te_ext.HAVE_TE:
        classes.append(te_ext.TEDotProductAttention)
    return classes


def sinks_tensor_parallel() -> Callable[[], None]:
    """``softmax_type="learnable"``: megatron-core's ``DotProductAttention`` (and TE's, through
    ``TEDotProductAttention``) creates the per-head ``softmax_offset`` parameter holding only
    this TP rank's heads but without ``tensor_model_parallel``/``partition_dim``/
    ``partition_stride``, so ``param_is_not_tensor_parallel_duplicate`` is False on TP ranks
    other than 0 and the optimizer's grad norm (hence clipping) leaves their sink gradients out.
    After ``__init__`` the parameter is marked split on axis 0 (stride 1)."""
    undos = []

    def make(original):
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            _mark_softmax_offset(self)

        return __init__

    for cls in _sink_classes():
        undos.append(wrap_method(cls, "__init__", make))

    def undo() -> None:
        for one in reversed(undos):
            one()

    return undo


ATTENTION_FIXES: tuple[Fix, ...] = (
    Fix(
        name="attention_sinks_tensor_parallel",
        defect="softmax_type='learnable': DotProductAttention/TEDotProductAttention's softmax_offset "
        "(a TP rank's heads) is not marked tensor-parallel, so the grad norm drops the sink grads "
        "of TP ranks other than 0",
        min_version="0.16.1",
        max_version="0.16.1",
        cpu_only=False,
        apply=sinks_tensor_parallel,
    ),
)
