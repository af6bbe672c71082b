"""Which HF tensors an MXFP4 export quantizes without a record of the source, and what they become.

The published gpt-oss checkpoints store the experts' ``gate_up_proj`` [E, H, 2I] and
``down_proj`` [E, I, H] as MXFP4 (``mxfp4_format``: ``X_blocks`` uint8 [E, rows, cols / 32, 16]
and ``X_scales`` uint8 [E, rows, cols / 32] of a parameter ``X`` [E, cols, rows]) and every
other tensor as bf16; ``is_mxfp4`` names those two. The values come from
``mxfp4.quantize_mxfp4`` (its docstring states the scale rule; it refuses NaN/inf naming the
tensor and the block). Used by ``merge --dtype mxfp4`` and the bucketed weight sync.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

from mcore_rl.fileio.safetensors_write import TensorSpec
from mcore_rl.mapping.mxfp4 import packed_shapes, quantize_mxfp4
from mcore_rl.mapping.mxfp4_format import BLOCK, BLOCKS_SUFFIX, SCALES_SUFFIX

# the tensors the published gpt-oss checkpoints quantize: the experts' two weight stacks
QUANTIZED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


def is_mxfp4(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the HF tensor ``name`` of ``shape`` is one the published checkpoints store as
    MXFP4 (an experts stack [E, cols, rows] whose ``cols`` are whole blocks of 32)."""
    return len(shape) == 3 and shape[1] % BLOCK == 0 and QUANTIZED.match(name) is not None


def mxfp4_specs(spec: TensorSpec) -> list[TensorSpec]:
    """``X`` [*lead, cols, rows] -> ``X_blocks`` uint8 [*lead, rows, cols/32, 16] and
    ``X_scales`` uint8 [*lead, rows, cols/32]."""
    blocks, scales = packed_shapes(spec.shape)
    return [TensorSpec(spec.name + BLOCKS_SUFFIX, blocks, torch.uint8),
            TensorSpec(spec.name + SCALES_SUFFIX, scales, torch.uint8)]


def as_mxfp4(name: str, weight: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """[(``name_blocks``, blocks), (``name_scales``, scales)] of ``weight`` [*lead, cols, rows]
    (``quantize_mxfp4``: NaN/inf is an MXFP4Error naming ``name`` and the block)."""
    blocks, scales = quantize_mxfp4(weight, name)
    return [(name + BLOCKS_SUFFIX, blocks), (name + SCALES_SUFFIX, scales)]


def mxfp4_buckets(buckets: Iterable[list[tuple[str, torch.Tensor]]]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """``buckets`` of HF tensors with every tensor ``is_mxfp4`` names replaced in place by its
    blocks and scales (``as_mxfp4``; a bucket only shrinks, so its bound still holds)."""
    for bucket in buckets:
        out: list[tuple[str, torch.Tensor]] = []
        for name, tensor in bucket:
            out += as_mxfp4(name, tensor) if is_mxfp4(name, tuple(tensor.shape)) else [(name, tensor)]
        del bucket
        yield out
