"""Platform fix for routed experts with biases (gpt-oss), registered in :mod:`mcore_rl.platform.fixes`
as ``expert_fc2_bias_in_place_on_view``."""
from __future__ import annotations

from typing import Callable

from mcore_rl.platform.patching import wrap_method


def expert_fc2_output_not_a_view() -> Callable[[], None]:
    """megatron's MLP adds an expert's fc2 bias, scaled by the routing probability, in place
    (``output += output_bias * per_token_scale``). With expert-tensor and expert-parallel sizes
    1 the expert's RowParallelLinear returns its output through an identity all-reduce (an
    autograd Function returning its input), a view that autograd forbids to modify in place
    (RuntimeError). The patched forward returns such an output as a copy (same values)."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    def make(original: Callable) -> Callable:
        def forward(self, *args, **kwargs):
            output, bias = original(self, *args, **kwargs)
            if self.is_expert and bias is not None and output._is_view():
                output = output.clone()
            return output, bias

        return forward

    return wrap_method(RowParallelLinear, "forward", make)
