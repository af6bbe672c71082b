"""Fix ``attention_sinks_tensor_parallel``: megatron-core's own ``DotProductAttention`` with
``softmax_type="learnable"`` (the attention sink, one logit per head) at TP=2 on 2 gloo ranks.
Each rank's ``softmax_offset`` holds its own 2 of the 4 heads; with the fix it is marked
tensor-parallel, so megatron's optimizer grad norm counts both ranks' sink gradients and equals
the norm computed directly from them. Reverted, rank 1's parameter counts as a TP duplicate and
the grad norm is rank 0's share only."""
from __future__ import annotations

import math

import torch

from tests.dist import run_ranks

S, B, HEADS, GROUPS, D, TP = 6, 2, 4, 2, 4, 2
SINKS = torch.tensor([0.3, -0.2, 0.5, 0.1])  # per head of the whole model


def _sink_grad_and_norm() -> dict:
    """This rank's sink gradient [HEADS / TP], whether megatron counts the parameter, and the
    grad norm of megatron's FP32Optimizer over it (reduced over the model-parallel group)."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import FP32Optimizer
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    rank = torch.distributed.get_rank()
    config = TransformerConfig(
        num_layers=1, hidden_size=HEADS * D, num_attention_heads=HEADS, num_query_groups=GROUPS,
        kv_channels=D, softmax_type="learnable", tensor_model_parallel_size=TP,
        use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
    )
    attn = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    heads = slice(rank * HEADS // TP, (rank + 1) * HEADS // TP)  # this rank's query heads and KV groups
    groups = slice(rank * GROUPS // TP, (rank + 1) * GROUPS // TP)
    with torch.no_grad():
        attn.softmax_offset.copy_(SINKS[heads])
    g = torch.Generator().manual_seed(5)
    q, k, v, w = (torch.randn(S, B, n, D, generator=g) for n in (HEADS, GROUPS, GROUPS, HEADS))
    out = attn(q[:, :, heads], k[:, :, groups], v[:, :, groups], attention_mask=None)
    (out * w[:, :, heads].reshape(S, B, -1)).sum().backward()
    optimizer = FP32Optimizer(torch.optim.SGD([attn.softmax_offset], lr=0.1), OptimizerConfig(lr=0.1), lambda x: None)
    counted = param_is_not_tensor_parallel_duplicate(attn.softmax_offset)
    return {"grad": attn.softmax_offset.grad.clone(), "counted": counted, "norm": float(optimizer.get_grad_norm())}


def _with_and_without_fix() -> dict:
    from mcore_rl.parallel import ParallelLayout
    from mcore_rl.parallel.layout import destroy_parallel_state, initialize_parallel_state
    from mcore_rl.platform.fixes import revert_fix

    initialize_parallel_state(ParallelLayout(tp=TP))
    try:
        fixed = _sink_grad_and_norm()
        revert_fix("attention_sinks_tensor_parallel")
        return {"fixed": fixed, "unfixed": _sink_grad_and_norm()}
    finally:
        destroy_parallel_state()


def test_sink_grads_of_every_tp_rank_count_in_the_grad_norm():
    ranks = run_ranks(TP, _with_and_without_fix)
    grads = [r["fixed"]["grad"] for r in ranks]
    assert all(g.abs().min() > 1e-3 for g in grads), grads  # every head's sink gets a gradient
    direct = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))
    for rank, r in enumerate(ranks):
        assert r["fixed"]["counted"], f"rank {rank}: softmax_offset counted as a TP duplicate"
        assert abs(r["fixed"]["norm"] - direct) <= 1e-6 * direct, (rank, r["fixed"]["norm"], direct)
        # the defect the fix removes: only rank 0's sink gradients enter the norm
        assert torch.equal(r["unfixed"]["grad"], r["fixed"]["grad"])  # same model, same gradient
        assert r["unfixed"]["counted"] == (rank == 0)
        only_rank0 = float(grads[0].double().norm())
        assert abs(r["unfixed"]["norm"] - only_rank0) <= 1e-6 * only_rank0, (rank, r["unfixed"]["norm"], only_rank0)
        assert abs(r["unfixed"]["norm"] - direct) > 1e-3 * direct
