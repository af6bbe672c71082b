"""What a background HF export of a step writes, and the config.json the save writes for it.

``ExportSpec`` is what an export writes (dtype as ``merge --dtype``, shard size, block-FP8 format).
``write_export_config`` (the save, rank 0, with ``hf_model`` in ``save_contents``) writes the role's
HF dir ``config.json`` already as ``mcore_to_hf.py merge`` of the step will write it
(``export_config.merged_config``, the merge's own computation), so the export
(``conversion/hf_export_step.export_step``, run by ``python -m mcore_rl.conversion.hf_export_worker``)
never changes a file the step records. No megatron import.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from mcore_rl.checkpoint import hf_export_record as rec
from mcore_rl.checkpoint.export_config import (ModelInfo, adapter_merge_dtype, adapter_only, config_text,
                                               expert_formats, hf_class, merged_config, model_info, named_dtype,
                                               resolve_dtype)
from mcore_rl.checkpoint.inventory import parse_step_name
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.safetensors_write import parse_size
from mcore_rl.mapping.fp8_quant import BlockFp8

class ExportError(CheckpointError):
    """A step the background export cannot export as asked (or whose export failed a check)."""


@dataclass(frozen=True)
class ExportSpec:
    """What an export writes: ``dtype`` as ``merge --dtype`` (fp32|bf16|fp16|fp8|mxfp4; None: the
    checkpoint's), shards of at most ``max_shard_size``, the block-FP8 format (``dtype="fp8"``)."""

    dtype: str | None = None
    max_shard_size: int | str = "5GB"
    fp8: BlockFp8 | None = None

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype, self.fp8)  # a bad dtype / fp8 combination: MergeError naming it
        parse_size(self.max_shard_size)


def refuse_quantized_adapters(info: ModelInfo, spec: ExportSpec) -> None:
    """An adapter-only LoRA step exports unquantized (its merge, base + adapters, is): ``spec``
    with dtype fp8/mxfp4 is an ExportError naming the step and the fix."""
    if adapter_only(info) and spec.dtype in ("fp8", "mxfp4"):
        raise ExportError(f"{info.path} holds LoRA adapters: their export (base + adapters, as mcore_to_hf.py merge "
                          f"writes it) is not quantized, but checkpoint.hf_dtype is {spec.dtype!r}; set "
                          "checkpoint.hf_dtype to fp32, bf16, fp16 or null (the run's params dtype).")


def export_config(info: ModelInfo, spec: ExportSpec, params_dtype: torch.dtype) -> dict:
    """The config.json ``merge(info.path, ..., dtype=spec.dtype, fp8=spec.fp8)`` writes, from the
    model directory's config and ``mcore_rl.json`` alone (no weights): the written dtype is
    ``spec.dtype``'s, else ``params_dtype`` (what the step stores its model parameters in: the
    engine's params dtype); MXFP4's ``quantization_config`` from ``merge_config.expert_formats``.
    An adapter-only LoRA step: merge's (``merge_lora``: ``adapter_merge_dtype``, never quantized)."""
    refuse_quantized_adapters(info, spec)
    plain, fp8, mxfp4 = resolve_dtype(spec.dtype, spec.fp8)
    if adapter_only(info):
        return merged_config(info, hf_class(info, "auto"), adapter_merge_dtype(info, plain))
    out_dtype = named_dtype(plain) if plain is not None else params_dtype
    return merged_config(info, hf_class(info, "auto"), out_dtype, fp8, expert_formats(info) if mxfp4 else None)


def write_export_config(role_dir: str, role: str, spec: ExportSpec, params_dtype: torch.dtype) -> None:
    """Rewrites ``role_dir``'s HF dir config.json (written there by the save: the run's config)
    into the config.json the export of this step will have: byte for byte what ``merge`` of the
    step with ``spec``'s dtype writes (``export_config``). Idempotent; atomic (temp + rename).
    Call it before the step's files are recorded (the record's digest fsyncs the file, so it is
    not fsynced here: it counts only once recorded); ``role_dir``'s ``mcore_rl.json`` must be written."""
    info = model_info(role_dir)
    if info.role != role:
        raise ExportError(f"{role_dir}: its mcore_rl.json says role {info.role!r}, not {role!r}; pass its role dir.")
    if info.hf_dir != rec.hf_dir_of(role_dir):
        raise ExportError(f"{role_dir} has no config.json of its own (the save had no HF source for role {role!r}; "
                          "an adapter-only step takes its base's): give the save the role's HF dir (hf_sources) "
                          "to export it.")
    text = config_text(export_config(info, spec, params_dtype))
    path = os.path.join(info.hf_dir, "config.json")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def check_role_dir(role_dir: str, step: int) -> None:
    """``role_dir`` is a directory ``global_step_<step>/<role>``; else an ExportError naming it."""
    if not os.path.isdir(role_dir):
        raise ExportError(f"{role_dir} is not a directory; pass a role dir of a step (global_step_<N>/<role>).")
    named = parse_step_name(os.path.basename(os.path.dirname(os.path.abspath(role_dir))))
    if named != step:
        raise ExportError(f"{role_dir} is not a role dir of step {step} (global_step_{step}/<role>); pass the step's "
                          "role dir.")


