"""Fix ``moe_expert_grads_use_expert_dp`` at MoELayer depth: every routed-expert parameter belongs to
the expert-DP group (``allreduce=False``) whatever the expert class, the shared experts and the
router stay dense; megatron DDP then puts expert grads in its expert-DP buffers.

Expert classes buildable here: the local ``SequentialMLP`` and megatron's ``GroupedMLP`` (built, not
run: its forward needs the grouped_gemm package). ``TEGroupedMLP`` needs Transformer Engine, which
this CPU machine does not have; the fix acts on ``MoELayer.experts`` whatever its class.
"""
from __future__ import annotations

import pytest

from tests.dist import run_ranks
from tests.tiny import tiny_config

LAYOUTS = {  # name -> (world size, layout)
    "ep1_tp1_etp2": (2, dict(etp=2)),
    "ep1_tp2_etp1": (2, dict(tp=2, etp=1, sequence_parallel=True)),
    "ep2": (2, dict(ep=2)),
}


def _moe_layer(layout_kwargs: dict, experts: type):
    """A qwen2_moe MoELayer (router, routed experts of class ``experts``, shared expert)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from mcore_rl.models.builder import BuildOptions, transformer_config
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.specs import LOCAL_LINEARS, _local_moe
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout)
    args = model_args_from_hf(tiny_config("qwen2_moe", num_hidden_layers=1))
    config = transformer_config(args, layout, BuildOptions(), active_platform())
    local = _local_moe(LOCAL_LINEARS).submodules
    spec = local.experts if experts is None else ModuleSpec(module=experts)
    return MoELayer(config, MoESubmodules(experts=spec, shared_experts=local.shared_experts))


def _flags(layer) -> dict:
    """parameter name -> allreduce flag (megatron's default when unset: True, dense)."""
    return {name: getattr(p, "allreduce", True) for name, p in layer.named_parameters()}


def _sequential_flags_and_buffers(layout_kwargs: dict, revert: bool) -> dict:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    if revert:
        from mcore_rl.platform.fixes import revert_fix

        revert_fix("moe_expert_grads_use_expert_dp")
    layer = _moe_layer(layout_kwargs, None)
    flags = _flags(layer)
    ddp = DistributedDataParallel(layer.config, DistributedDataParallelConfig(), layer)
    in_expert_buffers = {id(p) for b in ddp.expert_parallel_buffers for p in b.params}
    buffers = {name: id(p) in in_expert_buffers for name, p in layer.named_parameters()}
    return {"flags": flags, "expert_buffer": buffers}


def _assert_expert_dp(flags: dict) -> None:
    routed = {k for k in flags if k.startswith("experts.")}
    assert routed and any(k.startswith("shared_experts.") for k in flags) and any(k.startswith("router.") for k in flags)
    wrong = {k: v for k, v in flags.items() if v != (k not in routed)}
    assert not wrong, f"routed experts must have allreduce=False, the rest True; wrong: {wrong}"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_sequential_mlp_experts_reduce_over_expert_dp(layout):
    world, layout_kwargs = LAYOUTS[layout]
    for result in run_ranks(world, _sequential_flags_and_buffers, layout_kwargs, False):
        _assert_expert_dp(result["flags"])
        # what the flag decides: DDP reduces exactly these grads over the expert-DP group
        assert result["expert_buffer"] == {k: not v for k, v in result["flags"].items()}


@pytest.mark.parametrize("layout", ["ep1_tp1_etp2", "ep1_tp2_etp1"])
def test_without_fix_experts_reduce_over_dense_dp(layout):
    world, layout_kwargs = LAYOUTS[layout]
    for result in run_ranks(world, _sequential_flags_and_buffers, layout_kwargs, True):
        routed = [k for k in result["flags"] if k.startswith("experts.")]
        assert all(result["flags"][k] for k in routed), result["flags"]  # the defect: dense DP
        assert not any(result["expert_buffer"].values())


def _grouped_mlp_flags(layout_kwargs: dict) -> dict:
    from megatron.core.transformer.moe import grouped_gemm_util
    from megatron.core.transformer.moe.experts import GroupedMLP

    if not grouped_gemm_util.grouped_gemm_is_available():
        # GroupedMLP asserts the grouped_gemm package in __init__ although only its forward
        # uses it; the flags are set in __init__, so build it past that check (never run it)
        grouped_gemm_util.assert_grouped_gemm_is_available = lambda: None
    return _flags(_moe_layer(layout_kwargs, GroupedMLP))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_mlp_experts_reduce_over_expert_dp(layout):
    world, layout_kwargs = LAYOUTS[layout]
    for flags in run_ranks(world, _grouped_mlp_flags, layout_kwargs):
        assert {"experts.weight1", "experts.weight2"} <= flags.keys(), flags
        _assert_expert_dp(flags)
