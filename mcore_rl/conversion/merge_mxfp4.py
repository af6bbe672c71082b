"""What a ``merge --dtype mxfp4`` writes for each HF tensor: MXFP4 blocks + scales, or a plain dtype.

The published gpt-oss checkpoints store the experts' ``gate_up_proj`` [E, H, 2I] and
``down_proj`` [E, I, H] as MXFP4 (``mapping/mxfp4_format.py``: ``X_blocks`` uint8 [E, rows,
cols / 32, 16] and ``X_scales`` uint8 [E, rows, cols / 32] of a parameter ``X`` [E, cols, rows])
and everything else as bf16 (attention and its sinks, the router, embeddings, lm_head, norms,
the experts' biases). The export gives back exactly that:
- with the converter's record of the source (``mcore_rl.json`` ``hf_stored_dtypes``, written
  for a quantized import) the tensors recorded as MXFP4 are quantized and every other one is
  written in the dtype the source stored it in;
- without a record (a model converted from bf16 weights) the tensors the published checkpoints
  quantize (``is_mxfp4``) are, every other one is written as bf16.
``quantization_config`` says ``quant_method: mxfp4`` with ``modules_to_not_convert`` as the
published config spells it, plus every experts module written unquantized. The values:
``mapping.mxfp4.quantize_mxfp4`` (its rule; a NaN or inf is an error naming the tensor and the
block, and nothing is written: the merge stages its output). No megatron import.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch

from mcore_rl.fileio.safetensors_write import TensorSpec
from mcore_rl.mapping.mxfp4 import MXFP4Error, quantize_mxfp4
from mcore_rl.mapping.mxfp4_format import BLOCK, BLOCKS_SUFFIX, BYTES_PER_BLOCK, SCALES_SUFFIX
from mcore_rl.mapping.mxfp4_import import STORED_MXFP4 as MXFP4_STORED  # noqa: F401 - the record's word (re-exported)
from mcore_rl.mapping.mxfp4_formats import (  # noqa: F401 - re-exported: callers import them from here
    MXFP4_ARCHS, PUBLISHED_NOT_CONVERTED, Mxfp4ExportError, check_arch, mxfp4_formats, quantization_config,
)
from mcore_rl.mapping.mxfp4_quant import mxfp4_specs

def out_specs(specs: Iterable[TensorSpec], formats: Mapping[str, torch.dtype | None]) -> list[TensorSpec]:
    """The tensors written, in order: each in its format, an MXFP4 one as its blocks and scales."""
    out = []
    for spec in specs:
        fmt = formats[spec.name]
        out += mxfp4_specs(spec) if fmt is None else [TensorSpec(spec.name, spec.shape, fmt)]
    return out


# A merge reads a layer's routed experts one at a time; gpt-oss stores them stacked ([E, cols,
# rows]), so the fused view holds every expert's parts until the last arrives. Quantized, each
# part takes 4.25 of its 16 bits: ``pack_experts`` quantizes every per-expert part of an MXFP4
# stack as it arrives and ``unpack`` splits the fused result. A part P [r, c] holds the slice's
# rows r (gpt-oss: gate/up [I, H] are the rows 2j / 2j + 1 of ``gate_up_proj``'s [H, 2I] slice,
# down [H, I] the rows of ``down_proj``'s [I, H]), each row quantized along its c values, so the
# packed rows [r, c/32 * 16 + c/32] (blocks, then scales) fuse by the layout's own join, rows as
# the slice's columns, and give the stack's blocks and scales byte for byte.
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(.+)$")


def pack_experts(tensors: Iterator[tuple[str, torch.Tensor]], layout,
                 formats: Mapping[str, torch.dtype | None]) -> Iterator[tuple[str, torch.Tensor]]:
    """``tensors`` with each per-expert part of a stack written as MXFP4 (``formats``: the fused
    name -> None) replaced by its packed rows, uint8 [r, c/32 * 17]."""
    for name, tensor in tensors:
        m = _PER_EXPERT.match(name)
        kind = layout.kind_of_part(m[3]) if m is not None else None
        if kind is None or formats.get(f"{m[1]}.{kind}", torch.bfloat16) is not None or tensor.dim() != 2:
            yield name, tensor
            continue
        _check_part(tensor, f"{m[1]}.{kind}", int(m[2]), m[3], layout.kinds[kind])
        blocks, scales = quantize_mxfp4(tensor.t(), f"{m[1]}.{kind} (expert {m[2]}, {m[3]})")
        yield name, torch.cat([blocks.flatten(-2), scales], dim=-1)


def _check_part(part: torch.Tensor, fused: str, expert: int, which: str, kind) -> None:
    """NaN/inf in the part [r, c]: an MXFP4Error naming the stack and the block [expert, row,
    group] of its ``_scales`` (the row found by joining row indices as the layout joins parts)."""
    bad = ~torch.isfinite(part)
    if not bool(bad.any()):
        return
    j, c = (int(v) for v in bad.nonzero()[0])
    rows = part.shape[0]
    probes = [torch.arange(rows).unsqueeze(-1) + k * rows for k in range(len(kind.parts))]  # host: indices
    row = int((kind.join(probes).reshape(-1) == kind.parts.index(which) * rows + j).nonzero()[0])
    raise MXFP4Error(f"{fused}: {int(bad.sum())} NaN/inf value(s) in expert {expert}'s {which}, the first "
                     f"{part[j, c].item()} in block [{expert}, {row}, {c // BLOCK}] of {fused}{SCALES_SUFFIX} "
                     f"(the weight's [{expert}, {c}, {row}]); MXFP4 cannot hold them: fix the checkpoint (a diverged "
                     "run?) or merge without --dtype mxfp4.")


def unpack(name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """A fused stack of packed rows uint8 [E, c/32 * 17, rows] (``pack_experts`` fused by the
    layout) -> [(``name_blocks``, [E, rows, c/32, 16]), (``name_scales``, [E, rows, c/32])]."""
    rows = tensor.transpose(-1, -2)
    groups = rows.shape[-1] // (BYTES_PER_BLOCK + 1)
    blocks = rows[..., :groups * BYTES_PER_BLOCK].unflatten(-1, (groups, BYTES_PER_BLOCK)).contiguous()
    return [(name + BLOCKS_SUFFIX, blocks), (name + SCALES_SUFFIX, rows[..., groups * BYTES_PER_BLOCK:].contiguous())]
