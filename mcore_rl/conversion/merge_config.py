"""config.json of a merged model: the one computation ``merge`` writes and the background export
writes at the save (``checkpoint/hf_export.write_export_config``), so the two are the same bytes.

The config is the model directory's ``huggingface/config.json`` with ``architectures`` the class
``merge_io.hf_class`` picks (a critic: one label), ``dtype``/``torch_dtype`` the dtype the
weights are written in, no ``quantization_config`` of the source unless the weights written
are quantized (block FP8: the format's; MXFP4: the experts written as MXFP4). It is written as
``json.dump(config, indent=2, sort_keys=True)``. No megatron import.
"""
from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from mcore_rl.conversion import merge_mxfp4
from mcore_rl.conversion.convert_input import HF_DTYPE_NAMES
from mcore_rl.conversion.merge_fp8 import STORED_KEY
from mcore_rl.conversion.merge_io import MergeError, ModelInfo, _hf_config
from mcore_rl.fileio.safetensors_write import TensorSpec
from mcore_rl.mapping.fp8_quant import BlockFp8


def resolve_dtype(dtype: str | None, fp8: BlockFp8 | None) -> tuple[str | None, BlockFp8 | None, bool]:
    """merge's ``dtype``/``fp8`` options -> (the plain dtype name of the unquantized tensors or
    None: the checkpoint's, the block-FP8 format or None, MXFP4 or not). ``fp8`` without
    ``dtype="fp8"``, or a dtype merge does not write, is a MergeError naming it."""
    if fp8 is not None and dtype != "fp8":
        raise MergeError(f"an fp8 format ({fp8}) was given with dtype={dtype!r}; pass dtype='fp8' (--dtype fp8).")
    if dtype == "fp8":
        return None, fp8 or BlockFp8(), False
    if dtype == "mxfp4":  # config.json's dtype: that of the published checkpoints' other tensors
        return "bf16", None, True
    if dtype is not None and dtype not in HF_DTYPE_NAMES:
        raise MergeError(f"dtype={dtype!r}; use one of {sorted(HF_DTYPE_NAMES) + ['fp8', 'mxfp4']} "
                         "(or none: the checkpoint's).")
    return dtype, None, False


def named_dtype(dtype: str) -> torch.dtype:
    """``fp32``/``bf16``/``fp16`` -> the torch dtype; anything else is a MergeError naming it."""
    if dtype not in HF_DTYPE_NAMES:
        raise MergeError(f"dtype={dtype!r}; use one of {sorted(HF_DTYPE_NAMES)} (or none: the checkpoint's).")
    return getattr(torch, HF_DTYPE_NAMES[dtype])


def merged_config(model: ModelInfo, cls: str, out_dtype: torch.dtype, fp8: BlockFp8 | None = None,
                  mxfp4_formats: Mapping[str, torch.dtype | None] | None = None) -> dict:
    """The merged model's config.json (see the module doc). ``mxfp4_formats``: HF name -> the
    dtype written (None: MXFP4), given for an MXFP4 merge."""
    config = _hf_config(model, cls)
    config["dtype"] = config["torch_dtype"] = str(out_dtype).removeprefix("torch.")  # as transformers names it
    config.pop("quantization_config", None)  # a quantized source's: the weights written are not quantized
    if fp8 is not None:
        config["quantization_config"] = fp8.quantization_config()
    if mxfp4_formats is not None:
        config["quantization_config"] = merge_mxfp4.quantization_config(mxfp4_formats)
    return config


def config_text(config: dict) -> str:
    """config.json's text as merge writes it."""
    return json.dumps(config, indent=2, sort_keys=True)


def expert_formats(model: ModelInfo) -> dict[str, torch.dtype | None]:
    """The MXFP4 formats of the experts' stacks of a gpt-oss model directory from its config and
    ``mcore_rl.json`` alone (no weights read): ``merge_mxfp4.mxfp4_formats`` of the specs merge
    plans for them (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H] per layer), with the
    converter's ``hf_stored_dtypes`` record when there is one. What ``quantization_config`` reads
    of a merge's formats: the experts' tensors."""
    args = model.args
    merge_mxfp4.check_arch(args.arch.model_type, model.path)
    if args.moe is None:
        raise MergeError(f"{model.path}: a gpt-oss config without experts; the config is damaged.")
    experts, hidden, ffn = args.moe.num_experts, args.hidden_size, args.moe.ffn_hidden_size
    specs = []
    for layer in range(args.num_layers):
        if not args.moe.moe_layers[layer]:
            continue
        prefix = f"model.layers.{layer}.mlp.experts."
        specs += [TensorSpec(prefix + "gate_up_proj", (experts, hidden, 2 * ffn), torch.bfloat16),
                  TensorSpec(prefix + "down_proj", (experts, ffn, hidden), torch.bfloat16)]
    stored = model.meta.get(STORED_KEY)
    if isinstance(stored, Mapping):
        stored = {s.name: stored.get(s.name) for s in specs}
    return merge_mxfp4.mxfp4_formats(specs, stored)
