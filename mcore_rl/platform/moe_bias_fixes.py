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


def expert_bias_grads_once() -> Callable[[], None]:
    """Two defects of an expert's fc2 bias (its RowParallelLinear's), fixed after ``MoELayer``
    builds its experts:

    * it is marked ``sequence_parallel`` like a dense layer's bias, so with sequence parallelism
      ``finalize_model_grads`` sums its grad over the TP group on top of the expert-data-parallel
      reduction every routed-expert parameter gets (the ``moe_expert_grads_use_expert_dp`` fix):
      with tp=2 and etp=1 the TP peers are in that expert-DP group and the grad is reduced twice;
    * it is not marked tensor-parallel, and megatron's grad norm counts an unmarked parameter on
      dense-TP rank 0 only, also in the expert optimizer, whose main grads the distributed
      optimizer shards over the expert-DP group (with etp=1 it holds the TP peers): the shards on
      TP rank 1 go uncounted (measured: a grad norm of 0.3934 for 0.3940). With expert-TP size 1
      every expert parameter is whole on its rank, i.e. split over a group of one: marked so.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe.moe_layer import MoELayer

    def make(original: Callable) -> Callable:
        def __init__(self, *args, **kwargs):
            original(self, *args, **kwargs)
            whole = parallel_state.get_expert_tensor_parallel_world_size() == 1
            for param in self.experts.parameters():
                if getattr(param, "sequence_parallel", False):
                    param.sequence_parallel = False
                if whole and not getattr(param, "tensor_model_parallel", False):
                    tensor_parallel.set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)

        return __init__

    return wrap_method(MoELayer, "__init__", make)
