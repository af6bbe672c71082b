"""What a ``merge --dtype fp8`` writes for each HF tensor: block FP8 + scale, or a plain dtype.

With the converter's record of the source's stored dtypes (``mcore_rl.json``
``hf_stored_dtypes``, written for an FP8 import), exactly the tensors the source stored as FP8
are quantized and every other one is written in the dtype the source stored it in (DeepSeek's
F32 ``e_score_correction_bias``, its BF16 router and norms). Without a record (a checkpoint
trained from bf16 weights), ``fp8_quant.is_quantized`` picks the linear weights and every other
tensor takes the merge's dtype. No megatron import.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.files import STORED_KEY  # noqa: F401 - mcore_rl.json: HF name -> the source's stored dtype
from mcore_rl.fileio.safetensors_write import TensorSpec, dtype_of_name
from mcore_rl.mapping.fp8_quant import FP8_DTYPE, SCALE_SUFFIX, BlockFp8, is_quantized

FP8_STORED = "F8_E4M3"


def tensor_formats(specs: Iterable[TensorSpec], dtype: torch.dtype, fp8: BlockFp8 | None,
                   stored: Mapping[str, str] | None) -> dict[str, torch.dtype | None]:
    """HF name -> the dtype written, ``None`` for block FP8 (+ its float32 scale). ``stored``:
    the source's stored dtypes (``STORED_KEY``), or None; a record that does not cover a tensor,
    or names a dtype safetensors does not know, is a CheckpointError naming it."""
    if stored is not None and not isinstance(stored, Mapping):
        raise CheckpointError(f"{STORED_KEY} in mcore_rl.json is a JSON {type(stored).__name__}, not an object; "
                              "the record is damaged: convert the model again.")
    formats: dict[str, torch.dtype | None] = {}
    for spec in specs:
        if fp8 is None:
            formats[spec.name] = dtype
        elif stored is None:
            formats[spec.name] = None if is_quantized(spec.name, spec.shape) else dtype
        elif spec.name not in stored or not isinstance(stored[spec.name], str):
            raise CheckpointError(f"{STORED_KEY} in mcore_rl.json does not record {spec.name!r} "
                                  f"(got {stored.get(spec.name)!r}); the record is damaged: convert the model again.")
        elif stored[spec.name] == FP8_STORED and len(spec.shape) == 2:
            formats[spec.name] = None
        else:
            formats[spec.name] = dtype_of_name(stored[spec.name], f"{STORED_KEY}[{spec.name!r}]")
    return formats


def out_specs(specs: Iterable[TensorSpec], formats: Mapping[str, torch.dtype | None],
              fp8: BlockFp8 | None) -> list[TensorSpec]:
    """The tensors written, in order: each HF tensor in its format; a block-FP8 one as
    float8_e4m3fn followed by its float32 ``<name>_scale_inv`` [ceil(R/b0), ceil(C/b1)]."""
    out = []
    for spec in specs:
        fmt = formats[spec.name]
        if fmt is None:
            assert fp8 is not None
            out += [TensorSpec(spec.name, spec.shape, FP8_DTYPE),
                    TensorSpec(spec.name + SCALE_SUFFIX, fp8.scale_shape(spec.shape), torch.float32)]
        else:
            out.append(TensorSpec(spec.name, spec.shape, fmt))
    return out
