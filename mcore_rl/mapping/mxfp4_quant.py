"""MXFP4 export: which HF tensors are quantized, and the quantizer with its checks (NaN/inf, shapes).

The published gpt-oss checkpoints store the experts' ``gate_up_proj`` [E, H, 2I] and
``down_proj`` [E, I, H] as MXFP4 (``mxfp4_format``: ``X_blocks`` uint8 [E, rows, cols / 32, 16]
and ``X_scales`` uint8 [E, rows, cols / 32] of a parameter ``X`` [E, cols, rows]); ``is_mxfp4``
names them. The values come from ``mxfp4.quantize_mxfp4`` (its docstring states the scale rule);
a NaN or inf is refused first, naming the tensor, the value's index and its block. Used by
``merge --dtype mxfp4`` (``conversion/merge_mxfp4``) and the bucketed weight sync.
"""
from __future__ import annotations

import math
import re

import torch

from mcore_rl.errors import McoreRLError
from mcore_rl.fileio.safetensors_write import TensorSpec
from mcore_rl.mapping.mxfp4 import quantize_mxfp4
from mcore_rl.mapping.mxfp4_format import BLOCK, BLOCKS_SUFFIX, BYTES_PER_BLOCK, SCALES_SUFFIX

# the tensors the published gpt-oss checkpoints quantize: the experts' two weight stacks
QUANTIZED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


class Mxfp4ExportError(McoreRLError, ValueError):
    """A tensor that cannot be written as MXFP4 (NaN/inf, a shape that is not whole blocks)."""


def is_mxfp4(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the HF tensor ``name`` of ``shape`` is one the published checkpoints store as
    MXFP4 (an experts stack [E, cols, rows] whose ``cols`` are whole blocks of 32)."""
    return len(shape) == 3 and shape[1] % BLOCK == 0 and QUANTIZED.match(name) is not None


def mxfp4_specs(spec: TensorSpec) -> list[TensorSpec]:
    """``X`` [*lead, cols, rows] -> ``X_blocks`` uint8 [*lead, rows, cols/32, 16] and
    ``X_scales`` uint8 [*lead, rows, cols/32]."""
    *lead, cols, rows = spec.shape
    groups = cols // BLOCK
    return [TensorSpec(spec.name + BLOCKS_SUFFIX, (*lead, rows, groups, BYTES_PER_BLOCK), torch.uint8),
            TensorSpec(spec.name + SCALES_SUFFIX, (*lead, rows, groups), torch.uint8)]


def check_finite(weight: torch.Tensor, name: str, first: int = 0) -> None:
    """NaN/inf in ``weight`` [*lead, cols, rows] (``first``: where ``weight`` starts along dim 0
    of the tensor ``name``): Mxfp4ExportError naming the first value, its index and its block
    (the index into ``X_scales``: [*lead, row, col // 32])."""
    bad = ~torch.isfinite(weight)
    if not bool(bad.any()):
        return
    at = [int(i) for i in bad.nonzero()[0]]
    value = weight[tuple(at)].item()
    where = [at[0] + first, *at[1:]] if weight.dim() > 2 else at
    *lead, col, row = where
    part = f"[{first}:{first + weight.shape[0]}]" if first or weight.dim() > 2 else ""
    raise Mxfp4ExportError(
        f"{name}: {int(bad.sum())} NaN/inf value(s) in {name}{part}, the first {value} at {where} in block "
        f"{[*lead, row, col // BLOCK]} of {name}{SCALES_SUFFIX}; MXFP4 cannot hold them: fix the checkpoint "
        "(a diverged run?) or merge without --dtype mxfp4.")


def quantize_checked(weight: torch.Tensor, name: str, chunk_elements: int = 1 << 24) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [*lead, cols, rows] -> (blocks uint8 [*lead, rows, cols/32, 16], scales uint8
    [*lead, rows, cols/32]) by ``mapping.mxfp4.quantize_mxfp4``, refusing NaN/inf first. A stack
    ([E, cols, rows]) is quantized ``chunk_elements`` at a time along its first dim, so the fp32
    temporaries stay bounded whatever the tensor's size."""
    if weight.dim() < 2 or weight.shape[-2] % BLOCK:
        raise Mxfp4ExportError(f"{name}: shape {list(weight.shape)} is not [*lead, cols, rows] with cols a multiple "
                               f"of {BLOCK}; MXFP4 stores whole blocks of {BLOCK}: merge without --dtype mxfp4.")
    if weight.dim() == 2 or weight.numel() <= chunk_elements:
        check_finite(weight, name)
        return quantize_mxfp4(weight)
    spec = mxfp4_specs(TensorSpec(name, tuple(weight.shape), weight.dtype))
    blocks = torch.empty(spec[0].shape, dtype=torch.uint8)  # host: file format
    scales = torch.empty(spec[1].shape, dtype=torch.uint8)  # host: file format
    step = max(1, chunk_elements // math.prod(weight.shape[1:]))
    for i in range(0, weight.shape[0], step):
        part = weight[i:i + step]
        check_finite(part, name, first=i)
        blocks[i:i + step], scales[i:i + step] = quantize_mxfp4(part)
    return blocks, scales
