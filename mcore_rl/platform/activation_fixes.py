"""Platform fixes for megatron-core's activation functions (registered in
:mod:`mcore_rl.platform.fixes`). Each patches one name and returns the undo."""
from __future__ import annotations

from typing import Callable

from mcore_rl.platform.fix_spec import Fix
from mcore_rl.platform.patching import run_uncompiled


def quick_gelu_eager() -> Callable[[], None]:
    """``fused_bias_geglu.quick_gelu`` (x * sigmoid(1.702 x), gpt-oss's activation) is decorated
    with megatron's ``jit_fuser`` (torch.compile): on the CPU its first call compiles it with
    inductor in every process (3.8-7 s measured in the main job). The builder reads the name from
    the module when it builds a config, so the same Python function, uncompiled, takes its place
    (inductor fuses it, nothing more). megatron compares its own imported name only on the fused
    bias-activation path, which mcore_rl never enables (it clamps before the bias)."""
    from megatron.core.fusions import fused_bias_geglu

    return run_uncompiled(fused_bias_geglu, "quick_gelu")


ACTIVATION_FIXES: tuple[Fix, ...] = (
    Fix(
        name="quick_gelu_eager_on_cpu",
        defect="fused_bias_geglu.quick_gelu (gpt-oss's activation) is a jit_fuser (torch.compile) "
        "function: its first call compiles it with inductor, 3.8-7 s per CPU process",
        min_version="0.16.0",
        max_version="0.16.1",
        cpu_only=True,
        apply=quick_gelu_eager,
    ),
)
