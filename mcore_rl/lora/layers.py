"""LoRA adapters inside megatron-core's parallel linears: ``y = W x + s * B (A x)``, s = alpha / r.

The layer specs place ``LoraColumnParallelLinear``/``LoraRowParallelLinear``/``LoraReplicatedLinear``
(megatron's classes with an optional ``lora`` child) when LoRA is on; ``attach_adapters`` gives
the targeted ones their adapter while the model is built. Each factor is sharded as the base
weight's matching dimension: B like W's rows, A like W's columns. So the merged local weight
is always ``W_local + s * B_local A_local`` and the communication follows the base:

- column-parallel (W rows split): A replicated, B row-split. ``A x`` is copied into the TP region
  (backward all-reduce) or, with sequence parallel, all-gathered along the sequence (A flagged
  ``sequence_parallel``: its grads are partial per sequence chunk, finalize sums them over TP).
- row-parallel (W columns split): A column-split, ``A_i x_i`` all-reduced (reduce-scattered with
  SP, B flagged ``sequence_parallel``), B replicated.
- replicated (MLA down-projections): both replicated, flags copied from the weight.
- routed experts with explicit expert communication (EP > 1 or expert-TP > 1): no communication
  inside the adapter (tokens are already gathered over expert-TP; fc2's output is a partial sum
  the dispatcher adds); the replicated factor's gradient is summed over the expert-TP group in
  backward (megatron's finalize never does that for expert parameters).
Every factor reduces over the data-parallel group of its weight (``allreduce`` copied: routed
experts' adapters go to the expert-DP group). Split factors carry megatron's TP attributes so
the grad norm counts every shard.
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Iterator

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.multi_latent_attention import MLASelfAttention
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

from mcore_rl.lora.config import LoraConfig, LoraConfigError

Tensor = torch.Tensor
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class _SumGradOver(torch.autograd.Function):
    """Identity forward; backward all-reduces the gradient over ``group`` (a replicated factor
    whose ranks each see part of the gradient)."""

    @staticmethod
    def forward(ctx, weight: Tensor, group) -> Tensor:
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.contiguous()
        torch.distributed.all_reduce(grad, group=ctx.group)
        return grad, None


class LoraAdapter(torch.nn.Module):
    """The two factors of one linear's adapter: A [R, in_local], B [out_local, R] (R = rank, or
    rank * adapted parts for canonical LoRA, whose B keeps zeros outside each part's block:
    ``mask``). ``split``: 'column', 'row' or None (replicated linear); ``explicit``: expert linear
    without its own communication. forward(x [..., in_local]) -> s * B A x [..., out_local]."""

    def __init__(self, base: torch.nn.Module, rank: int, scaling: float, config: LoraConfig, split: str | None,
                 mask: Tensor | None, dtype: torch.dtype) -> None:
        super().__init__()
        out_local, in_local = base.weight.shape
        device = base.weight.device
        self.A = torch.nn.Parameter(torch.zeros(rank, in_local, dtype=dtype, device=device))
        self.B = torch.nn.Parameter(torch.zeros(out_local, rank, dtype=dtype, device=device))
        self.register_buffer("mask", None if mask is None else mask.to(device, dtype), persistent=False)
        self.split, self.enabled = split, True
        # s = alpha / r of this adapter (an imported PEFT adapter's may differ per linear): a
        # checkpointed buffer, so an offline merge of an adapter-only step knows it
        self.register_buffer("scale", torch.tensor([scaling], dtype=torch.float32, device=device))
        self.tp_group = getattr(base, "tp_group", None)
        self.explicit = bool(getattr(base, "explicit_expert_comm", False))
        # expert factors never take the dense TP sum (they reduce over the expert-DP group)
        self.is_expert = bool(getattr(base, "is_expert", False))
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False)) and not self.is_expert
        self.dropout = torch.nn.Dropout(config.dropout) if config.dropout > 0 else None
        self.dropout_position = config.dropout_position
        self.site = None  # its layout for export (mapping.peft.AdapterSite), set by lora.build
        self._mark(base.weight)

    def _mark(self, weight: Tensor) -> None:
        for p in (self.A, self.B):
            p.allreduce = getattr(weight, "allreduce", True)
        split_factor = {"column": self.B, "row": self.A}.get(self.split)
        if split_factor is not None:
            split_factor.tensor_model_parallel = True
            split_factor.partition_dim = 0 if self.split == "column" else 1
            split_factor.partition_stride = 1
        replicated = [p for p in (self.A, self.B) if p is not split_factor]
        if self.is_expert:
            self._mark_expert_replicated(replicated)
            return
        for p in replicated:
            # dense factors whose grads are partial per sequence chunk: finalize sums them over TP
            if self.split is None:
                p.sequence_parallel = getattr(weight, "sequence_parallel", False)
            else:
                p.sequence_parallel = self.sequence_parallel

    def _mark_expert_replicated(self, replicated: list[Tensor]) -> None:
        """megatron's grad norm counts a parameter without TP attributes on dense TP rank 0 only
        (its expert optimizer filters duplicates with the dense TP group). A replicated expert
        factor is unique on each rank when expert-TP is 1 (then it is marked as TP-split, so
        every rank counts it), and a copy per expert-TP rank otherwise, counted once only when
        the expert-TP group is the TP group."""
        etp = self.tp_group.size() if self.tp_group is not None else 1
        tp = parallel_state.get_tensor_model_parallel_world_size()
        if etp == 1:
            for p in replicated:
                p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        elif etp != tp:
            raise LoraConfigError(
                f"LoRA on routed experts with etp({etp}) != tp({tp}) and etp > 1: megatron's grad norm "
                "would count the experts' replicated adapter factors on the wrong ranks; use etp=1 or "
                f"etp=tp({tp}), or leave the experts out of lora.target_modules.")

    @property
    def weight_B(self) -> Tensor:
        return self.B if self.mask is None else self.B * self.mask

    def delta_weight(self) -> Tensor:
        """s * B A [out_local, in_local]: what merging adds to the local weight shard."""
        return (self.weight_B @ self.A) * self.scale.to(self.A.dtype)

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.to(self.A.dtype)
        if self.dropout is not None and self.dropout_position == "pre":
            h = self.dropout(h)
        a, b = self.A, self.weight_B
        group_size = self.tp_group.size() if self.tp_group is not None else 1
        if self.explicit and group_size > 1:  # the replicated factor sees part of the gradient
            if self.split == "column":
                a = _SumGradOver.apply(a, self.tp_group)
            elif self.split == "row":
                b = _SumGradOver.apply(b, self.tp_group)
        z = F.linear(h, a)
        z = self._communicate(z)
        if self.dropout is not None and self.dropout_position == "post":
            z = self.dropout(z)
        return (F.linear(z, b) * self.scale.to(b.dtype)).to(dtype)

    def _communicate(self, z: Tensor) -> Tensor:
        if self.split is None or self.explicit:
            return z
        group = self.tp_group
        if self.split == "column":
            if self.sequence_parallel:
                return gather_from_sequence_parallel_region(z, tensor_parallel_output_grad=True, group=group)
            return copy_to_tensor_model_parallel_region(z, group=group)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(z, group=group)
        return reduce_from_tensor_model_parallel_region(z, group=group)


def _with_adapter(module: torch.nn.Module, x: Tensor, out: Tensor) -> Tensor:
    lora = module.lora
    if lora is None or not lora.enabled:
        return out
    return out + lora(x)


class LoraColumnParallelLinear(ColumnParallelLinear):
    """megatron's ColumnParallelLinear with an optional adapter (``lora``, set by attach_adapters);
    forward(x) -> (W x + s B A x, bias) as the base returns it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lora: LoraAdapter | None = None
        self.lora_glu_rows = False  # a gated MLP's fc1: B's rows are [gate_i; up_i] per shard

    def forward(self, input_: Tensor, weight: Tensor | None = None, runtime_gather_output=None):
        out, bias = super().forward(input_, weight, runtime_gather_output)
        if self.lora is not None and (self.gather_output or runtime_gather_output):
            raise NotImplementedError("LoRA on a ColumnParallelLinear that gathers its output")
        return _with_adapter(self, input_, out), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base's sharding, plus B split along its rows like the weight (fc1: swiglu halves)."""
        sd = make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0, "bias": 0, "lora.B": 0},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )
        key = f"{prefix}lora.B"
        if self.lora_glu_rows and key in sd:
            singleton = (metadata or {}).get("singleton_local_shards", False)
            sd[key] = apply_swiglu_sharded_factory(sd[key], sharded_offsets, singleton)
        return sd


class LoraRowParallelLinear(RowParallelLinear):
    """megatron's RowParallelLinear with an optional adapter; forward(x) -> (W x + s B A x, bias)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lora: LoraAdapter | None = None

    def forward(self, input_: Tensor):
        out, bias = super().forward(input_)
        return _with_adapter(self, input_, out), bias

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        """The base's sharding, plus A split along its columns like the weight."""
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 1, "lora.A": 1},
            sharded_offsets, tp_group=self.tp_group, dp_cp_group=metadata["dp_cp_group"],
        )


class LoraReplicatedLinear(ReplicatedLinear):
    """The TP-replicated linear (MLA down-projections) with an optional adapter."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lora: LoraAdapter | None = None

    def forward(self, x: Tensor):
        out = super().forward(x)
        if isinstance(out, tuple):
            return _with_adapter(self, x, out[0]), out[1]
        return _with_adapter(self, x, out)


LORA_LINEARS = (LoraColumnParallelLinear, LoraRowParallelLinear, LoraReplicatedLinear)


class LoraMLASelfAttention(MLASelfAttention):
    """megatron's MLA attention with LoRA-capable down-projections. Its constructor accepts only
    megatron's own classes there (an exact-type check), so they are built as megatron's
    replicated ``Linear`` and then given its LoRA subclass, which adds no state but the empty
    ``lora`` slot (same parameters, same checkpoint keys)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        for name in ("linear_q_down_proj", "linear_kv_down_proj"):
            module = getattr(self, name, None)
            if type(module) is ReplicatedLinear:
                module.__class__ = LoraReplicatedLinear
                module.lora = None


def lora_modules(chunks: list[torch.nn.Module]) -> Iterator[torch.nn.Module]:
    """Every LoRA-capable linear of the chunks that has an adapter."""
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, LORA_LINEARS) and module.lora is not None:
                yield module


@contextlib.contextmanager
def adapters_disabled(chunks: list[torch.nn.Module]):
    """The frozen base model: every adapter switched off inside the block (the reference policy)."""
    modules = list(lora_modules(chunks))
    before = [m.lora.enabled for m in modules]
    for m in modules:
        m.lora.enabled = False
    try:
        yield
    finally:
        for m, flag in zip(modules, before):
            m.lora.enabled = flag


def merged_tensor_of(chunks: list[torch.nn.Module]):
    """tensor_of for weight export: a base weight with an adapter -> W + s B A (local shard,
    same layout as W), every other parameter as it is."""
    deltas = {id(m.weight): m for m in lora_modules(chunks)}

    def tensor_of(param: Tensor) -> Tensor:
        module = deltas.get(id(param))
        if module is None:
            return param.data
        return (param.data + module.lora.delta_weight().to(param.dtype)).detach()

    return tensor_of


def adapter_dtype(config: LoraConfig, params_dtype: torch.dtype) -> torch.dtype:
    return _DTYPES[config.dtype] if config.dtype else params_dtype


def init_full(method: str, shape: tuple[int, int], key: str, seed: int) -> Tensor:
    """A full (unsharded) factor drawn from a generator seeded by ``seed`` and ``key``: the same
    values at every layout. fp32 [rows, cols]."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(key.encode())) & ((1 << 62) - 1))  # host: layout-independent init
    rows, cols = shape
    if method == "zero":
        return torch.zeros(shape)  # host: a full factor, sharded and copied to the device
    if method == "normal":
        return torch.randn(shape, generator=g) * 0.02  # host: a full factor
    if method == "xavier":  # xavier normal: std = sqrt(2 / (fan_in + fan_out))
        return torch.randn(shape, generator=g) * math.sqrt(2.0 / (rows + cols))  # host: a full factor
    bound = 1.0 / math.sqrt(cols)  # kaiming_uniform with a=sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    return (torch.rand(shape, generator=g) * 2 - 1) * bound  # host: a full factor


def expert_tp_rank_size(expert: bool) -> tuple[int, int]:
    """This rank's index and size in the group a weight is split over (TP, or ETP for experts)."""
    if expert:
        return (parallel_state.get_expert_tensor_parallel_rank(),
                parallel_state.get_expert_tensor_parallel_world_size())
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
