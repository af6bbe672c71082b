"""Which tensors an MXFP4 export (``merge --dtype mxfp4``, the background export of a step) writes
as MXFP4 and the ``quantization_config`` it says so with (see ``conversion/merge_mxfp4``): from the
converter's ``hf_stored_dtypes`` record, else the published checkpoints' rule (``is_mxfp4``). Below
the checkpoint code, which writes a step's config.json at the save. No megatron import.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from mcore_rl.errors import CheckpointError, McoreRLError
from mcore_rl.fileio.files import STORED_KEY
from mcore_rl.fileio.safetensors_write import TensorSpec, dtype_of_name
from mcore_rl.mapping.mxfp4_format import BLOCK
from mcore_rl.mapping.mxfp4_import import STORED_MXFP4 as MXFP4_STORED
from mcore_rl.mapping.mxfp4_quant import QUANTIZED, is_mxfp4

# the published ``modules_to_not_convert`` (openai/gpt-oss-20b and -120b config.json)
PUBLISHED_NOT_CONVERTED = ("model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head")
MXFP4_ARCHS = ("gpt_oss",)  # the architectures transformers and vLLM read MXFP4 experts of


class Mxfp4ExportError(McoreRLError, ValueError):
    """A model ``merge --dtype mxfp4`` cannot write as MXFP4."""


def check_arch(model_type: str, where: str) -> None:
    """``--dtype mxfp4`` is for gpt-oss: other architectures have no MXFP4 reader to go to."""
    if model_type not in MXFP4_ARCHS:
        raise Mxfp4ExportError(f"{where}: merge --dtype mxfp4 writes gpt-oss experts (model_type {MXFP4_ARCHS}); "
                               f"this model is {model_type!r}, which transformers and vLLM do not read as MXFP4: "
                               "merge with --dtype bf16 or --dtype fp8.")


def mxfp4_formats(specs: Iterable[TensorSpec], stored: Mapping[str, str] | None,
                  default: torch.dtype = torch.bfloat16) -> dict[str, torch.dtype | None]:
    """HF name -> the dtype written, ``None`` for MXFP4. ``stored``: the source's stored dtypes
    (``STORED_KEY``) or None (then ``is_mxfp4`` picks, the rest is ``default``); a record that
    does not cover a tensor, names an unknown dtype or MXFP4 for a tensor that cannot be, is a
    CheckpointError naming it."""
    if stored is not None and not isinstance(stored, Mapping):
        raise CheckpointError(f"{STORED_KEY} in mcore_rl.json is a JSON {type(stored).__name__}, not an object; "
                              "the record is damaged: convert the model again.")
    formats: dict[str, torch.dtype | None] = {}
    for spec in specs:
        if stored is None:
            formats[spec.name] = None if is_mxfp4(spec.name, spec.shape) else default
            continue
        said = stored.get(spec.name)
        if not isinstance(said, str):
            raise CheckpointError(f"{STORED_KEY} in mcore_rl.json does not record {spec.name!r} (got {said!r}); "
                                  "the record is damaged: convert the model again.")
        if said != MXFP4_STORED:
            formats[spec.name] = dtype_of_name(said, f"{STORED_KEY}[{spec.name!r}]")
        elif len(spec.shape) < 2 or spec.shape[-2] % BLOCK:
            raise CheckpointError(f"{STORED_KEY} in mcore_rl.json records {spec.name!r} as MXFP4, but its shape "
                                  f"{list(spec.shape)} has no whole blocks of {BLOCK} along dim -2; the record does "
                                  "not belong to this model: convert the model again.")
        else:
            formats[spec.name] = None
    return formats


def quantization_config(formats: Mapping[str, torch.dtype | None]) -> dict:
    """config.json's ``quantization_config``: the published ``modules_to_not_convert`` plus each
    experts module (``model.layers.N.mlp.experts``) none of whose weights is written as MXFP4."""
    experts: dict[str, bool] = {}
    for name, fmt in formats.items():
        m = QUANTIZED.match(name)
        if m is not None:
            module = name.rsplit(".", 1)[0]
            experts[module] = experts.get(module, False) or fmt is None
    plain = sorted((m for m, quantized in experts.items() if not quantized), key=_layer_order)
    return {"modules_to_not_convert": [*PUBLISHED_NOT_CONVERTED, *plain], "quant_method": "mxfp4"}


def _layer_order(module: str) -> int:
    return int(module.split(".")[2])
