"""What a merged model's config.json is, from a model directory's config and ``mcore_rl.json``
alone (no weights read): the one computation ``conversion/merge`` writes and the save writes for
a background HF export (``checkpoint/hf_export.write_export_config``), so the two are the same
bytes. Below the merge (which imports it) and beside the checkpoint manager (which calls it).

The config is the model directory's HF dir ``config.json`` with ``architectures`` the class
``hf_class`` picks (a critic: one label), ``dtype``/``torch_dtype`` the dtype the weights are
written in, no ``quantization_config`` of the source unless the weights written are quantized
(block FP8: the format's; MXFP4: the experts written as MXFP4), written as
``json.dump(config, indent=2, sort_keys=True)``. No megatron import.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

import torch

from mcore_rl.checkpoint import storage
from mcore_rl.errors import CheckpointError, McoreRLError
from mcore_rl.fileio.files import META, STORED_KEY
from mcore_rl.fileio.model_layout import layout_of
from mcore_rl.fileio.paths import contained
from mcore_rl.fileio.safetensors_write import HF_DTYPE_NAMES, TensorSpec
from mcore_rl.mapping import mxfp4_formats as mxfp4
from mcore_rl.mapping.fp8_quant import BlockFp8
from mcore_rl.models.hf_config import ModelArgs, model_args_from_hf

ModelClass = Literal["auto", "causal_lm", "token_classification", "sequence_classification"]
# --model_class -> the suffix of the transformers class name, and the role it fits
_CLASS_SUFFIX = {"causal_lm": ("ForCausalLM", "actor"), "token_classification": ("ForTokenClassification", "critic"),
                 "sequence_classification": ("ForSequenceClassification", "critic")}


class MergeError(CheckpointError):
    """A model directory that cannot be merged as asked."""


@dataclass(frozen=True)
class ModelInfo:
    """What a model directory says of its model without its weights: role, ModelArgs (from the
    HF dir's config.json), the HF dir and ``mcore_rl.json``."""

    path: str
    role: str
    args: ModelArgs
    hf_dir: str
    meta: dict


def model_info(local_dir: str) -> ModelInfo:
    """``local_dir``'s ``mcore_rl.json`` (contents must hold ``model``, role actor or critic) and
    its model config; reads no weights (the step's ``dist_ckpt/`` need not exist yet)."""
    local_dir = os.path.abspath(local_dir)
    meta_path = os.path.join(local_dir, META)
    meta = storage.read_json(meta_path)
    contents, role = meta.get("contents"), meta.get("role")
    if not isinstance(contents, list) or "model" not in contents:
        raise MergeError(f"{local_dir}: {META} contents {contents!r} hold no 'model' weights (saved without "
                         "'model' in checkpoint.save_contents, or the file is damaged); nothing to merge.")
    if role not in ("actor", "critic"):
        raise MergeError(f"{meta_path}: role {role!r}; expected 'actor' or 'critic'.")
    hf_dir = _config_dir(local_dir, meta)
    return ModelInfo(local_dir, role, _model_args(hf_dir), hf_dir, meta)


def _config_dir(local_dir: str, meta: dict) -> str:
    """Where the model's config.json is: its HF dir (``huggingface/``; verl's layout:
    ``model/huggingface/``); an adapter-only LoRA step saved without it takes its base's (a HF
    directory, or a model directory's HF dir)."""
    own = layout_of(local_dir, meta).hf_dir(local_dir)
    lora = meta.get("lora") if isinstance(meta.get("lora"), dict) else {}
    base = lora.get("base") if isinstance(lora.get("base"), dict) else {}
    if os.path.isfile(os.path.join(own, "config.json")) or not lora.get("adapter_only") or not base.get("path"):
        return own
    return base["path"] if base.get("kind") == "hf" else layout_of(base["path"]).hf_dir(base["path"])


def adapter_only(model: ModelInfo) -> bool:
    lora = model.meta.get("lora")
    return isinstance(lora, dict) and bool(lora.get("adapter_only"))


def _model_args(hf_dir: str) -> ModelArgs:
    """ModelArgs of ``hf_dir/config.json``; a value of the wrong type is a MergeError naming the file."""
    try:
        return model_args_from_hf(hf_dir)
    except McoreRLError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        raise MergeError(f"{os.path.join(hf_dir, 'config.json')} is not a usable model config ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:200]}); the file is damaged: use the config the checkpoint "
                         "was saved with.") from None


def hf_class(model: ModelInfo, model_class: ModelClass = "auto") -> str:
    """The transformers class the merged model is: ``auto`` keeps the class its
    ``huggingface/config.json`` records (the converter's or the run's input: a reward model's
    ``*ForSequenceClassification`` comes back as one) when it fits the role, else the role's
    default (actor: causal LM, critic: token classification with one label)."""
    arch, wrapper = model.args.arch, model.args.wrapper
    if wrapper is not None:  # a vision-language checkpoint goes back as its class (actor only)
        if model_class not in ("auto", "causal_lm") or model.role != "actor":
            raise MergeError(f"{model.path}: a {wrapper.model_type!r} checkpoint is a {wrapper.hf_class} (an actor); "
                             f"model_class={model_class!r} does not fit it: use --model_class auto.")
        return wrapper.hf_class
    with open(contained(model.hf_dir, "config.json", model.hf_dir)) as f:
        recorded = json.load(f).get("architectures")
    recorded = [a for a in recorded if isinstance(a, str)] if isinstance(recorded, list) else []
    if model_class == "auto":
        fits = [a for a in recorded for suffix, role in _CLASS_SUFFIX.values()
                if a.endswith(suffix) and role == model.role]
        return fits[0] if fits else (arch.hf_causal_lm if model.role == "actor" else arch.hf_token_classification)
    suffix, role = _CLASS_SUFFIX[model_class]
    if role != model.role:
        why = ("a critic has a value head (score: hidden -> 1) and no LM head, so it is not a causal LM"
               if model.role == "critic" else "an actor has an LM head, not a value head")
        want = "token_classification or sequence_classification" if model.role == "critic" else "causal_lm"
        raise MergeError(f"{model.path}: model_class={model_class!r} for a {model.role}: {why}; "
                         f"use --model_class {want} (or auto).")
    named = [a for a in recorded if a.endswith(suffix)]
    return named[0] if named else arch.hf_token_classification.removesuffix("ForTokenClassification") + suffix


def hf_config(model: ModelInfo, cls: str) -> dict:
    """config.json of the merged model: architectures [cls] (and one label for a critic)."""
    with open(contained(model.hf_dir, "config.json", model.hf_dir)) as f:
        config = json.load(f)
    config["architectures"] = [cls]
    if model.role == "critic":
        config.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return config


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
    config = hf_config(model, cls)
    config["dtype"] = config["torch_dtype"] = str(out_dtype).removeprefix("torch.")  # as transformers names it
    config.pop("quantization_config", None)  # a quantized source's: the weights written are not quantized
    if fp8 is not None:
        config["quantization_config"] = fp8.quantization_config()
    if mxfp4_formats is not None:
        config["quantization_config"] = mxfp4.quantization_config(mxfp4_formats)
    return config


def config_text(config: dict) -> str:
    """config.json's text as merge writes it."""
    return json.dumps(config, indent=2, sort_keys=True)


def expert_formats(model: ModelInfo) -> dict[str, torch.dtype | None]:
    """The MXFP4 formats of the experts' stacks of a gpt-oss model directory from its config and
    ``mcore_rl.json`` alone (no weights read): ``mapping.mxfp4_formats.mxfp4_formats`` of the specs merge
    plans for them (``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H] per layer), with the
    converter's ``hf_stored_dtypes`` record when there is one. What ``quantization_config`` reads
    of a merge's formats: the experts' tensors."""
    args = model.args
    mxfp4.check_arch(args.arch.model_type, model.path)
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
    return mxfp4.mxfp4_formats(specs, stored)
