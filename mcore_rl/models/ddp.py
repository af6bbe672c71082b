"""Wraps model chunks in megatron-core's DistributedDataParallel (grad buffers, DP reduction)."""
from __future__ import annotations

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig


def wrap_with_ddp(
    chunks: list[torch.nn.Module],
    use_distributed_optimizer: bool = True,
    grad_reduce_in_fp32: bool = True,
) -> list[DistributedDataParallel]:
    """DDP-wrapped chunks; gradients accumulate in ``param.main_grad`` and are reduced by
    megatron's ``finalize_model_grads``. Only the first chunk uses bucketing, as in Megatron-LM."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    return [
        DistributedDataParallel(
            config=chunk.config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0
        )
        for i, chunk in enumerate(chunks)
    ]
