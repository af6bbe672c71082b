"""Merge a model directory (``dist_ckpt/`` + ``huggingface/`` + ``mcore_rl.json``) into a HF model
directory, tensor by tensor, without megatron or torch.distributed.

On disk every model key is the TP=1 layout of the parameter with the global layer (and expert)
index turned into leading dims, e.g. ``decoder.layers.self_attention.linear_qkv.weight`` [L, rows,
H] and ``decoder.layers.mlp.experts.experts.linear_fc1.weight`` [L, E, 2F, H]; VPP chunks write
their layers' rows of the same keys. So one HF tensor group = read one (layer[, expert]) part,
apply the mapping table's ``transform.to_hf``. Rows come from the one table per architecture
(``args.arch.table``), enumerated as ``WeightMap.rule``/``hf_keys`` do for TP=1 (the test checks
they agree: ``mapping/weights.py`` imports megatron, which this path must not).
"""
from __future__ import annotations

import math
import os
import re
import shutil
import time
import warnings
from typing import Iterator

import torch

from mcore_rl.conversion.convert_input import HF_DTYPE_NAMES
from mcore_rl.conversion.merge_fp8 import STORED_KEY, out_specs, tensor_formats
from mcore_rl.conversion import merge_mxfp4
from mcore_rl.conversion.merge_io import (  # noqa: F401 - re-exported: callers import them from here
    _WEIGHT_FILE, MergeError, MergeSummary, ModelClass, ModelDir, Unit, _adapter_only, _hf_config,
    check_target, export_file, hf_class, open_model_dir, plan_units, read_unit, same_dir,
)
from mcore_rl.checkpoint.export_config import config_text, merged_config, named_dtype, resolve_dtype
from mcore_rl.conversion.merge_layout import SourceLayout
from mcore_rl.conversion.merge_lora import merge_adapter_step
from mcore_rl.fileio.files import META, peak_rss_mb
from mcore_rl.fileio.output_dir import write_export_record
from mcore_rl.fileio.paths import contained
from mcore_rl.fileio.safetensors_write import ShardedSafetensorsWriter
from mcore_rl.fileio.staging import Staging
from mcore_rl.mapping.casts import NonFiniteWarning, cast_checked, describe_nonfinite, first_nonfinite, wider_dtypes
from mcore_rl.mapping.fp8_quant import SCALE_SUFFIX, BlockFp8, quantize_block_fp8
from mcore_rl.mapping.mxfp4_quant import as_mxfp4
from mcore_rl.mapping.transforms import Dims
from mcore_rl.models.hf_layout import CARRIED_FILE, expert_layout


def iter_hf_tensors(model: ModelDir, units: list[Unit], dims: Dims,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) in plan order, cast to ``dtype`` when given (a finite value it cannot
    hold is a CastOverflowError naming the tensor: ``casts.cast_checked``); one unit's part in
    memory at a time."""
    for unit in units:
        part = read_unit(model.reader, unit)
        for spec, tensor in zip(unit.specs, unit.transform.to_hf(part, dims)):
            yield spec.name, tensor if dtype is None else cast_checked(tensor, dtype, spec.name, wider_dtypes(dtype))
        del part


def written_dtype(model: ModelDir, units: list[Unit], dtype: str | None = None) -> torch.dtype:
    """The one dtype of the merged model: ``dtype`` (fp32, bf16, fp16) when given, else the dtype
    the checkpoint stores its model parameters in (a bf16 run's model keys are bf16 whatever its
    optimizer's fp32 main parameters), else mcore_rl.json's ``params_dtype``."""
    if dtype is not None:
        return named_dtype(dtype)
    stored = {model.reader.tensors[k].dtype for u in units for k in u.keys}
    if len(stored) == 1:
        return stored.pop()
    named = str(model.meta.get("params_dtype", "")).removeprefix("torch.")
    if named not in HF_DTYPE_NAMES.values():
        raise MergeError(f"{model.path}: the model tensors are stored in {sorted(map(str, stored))} and "
                         f"{META} names no params_dtype; pass --dtype fp32|bf16|fp16.")
    return getattr(torch, named)


def head_units(model: ModelDir, units: list[Unit], cls: str) -> list[Unit]:
    """The units of ``cls``: a ``*ForSequenceClassification`` head has no bias, so the critic's
    value-head bias is left out when it is zero (a converted reward model's is) and refused
    otherwise (the class cannot hold it)."""
    if not cls.endswith("ForSequenceClassification"):
        return units
    kept = []
    for unit in units:
        if [spec.name for spec in unit.specs] != ["score.bias"]:
            kept.append(unit)
            continue
        bias = read_unit(model.reader, unit)
        if bool((bias != 0).any()):
            raise MergeError(f"{model.path}: the value head's bias is {bias.flatten().tolist()}, not 0: {cls} "
                             "has no score bias to hold it; merge with --model_class token_classification.")
    return kept


def _formats(model: ModelDir, layout: SourceLayout, hf_specs: list, dtype: torch.dtype, fp8: BlockFp8 | None,
             mxfp4: bool) -> tuple[dict[str, torch.dtype | None], list]:
    """HF name -> the dtype written (None: quantized) and the specs of every tensor written."""
    stored = model.meta.get(STORED_KEY) if fp8 is not None or mxfp4 else None
    if mxfp4:
        formats = merge_mxfp4.mxfp4_formats(hf_specs, stored)
    else:
        formats = tensor_formats(hf_specs, dtype, fp8, stored)
    if fp8 is not None or mxfp4:  # the vision tower is not quantized: as the converter stored it
        formats.update({s.name: s.dtype for s in layout.carried})
    return formats, merge_mxfp4.out_specs(hf_specs, formats) if mxfp4 else out_specs(hf_specs, formats, fp8)


def _write_model(model: ModelDir, units: list[Unit], dims: Dims, dtype: torch.dtype, directory: str,
                 max_shard_size: int | str, progress: bool, fp8: BlockFp8 | None = None,
                 mxfp4: bool = False) -> tuple[ShardedSafetensorsWriter, dict]:
    """Streams the HF tensors into ``directory`` (``fp8``: the quantized ones as block FP8 +
    scales, see ``out_specs``; ``mxfp4``: as MXFP4 blocks + scales, see ``merge_mxfp4``) and
    copies the non-weight HF files (tokenizer, generation config) of the model directory (no
    file that leaves it: symlinks are checked). A wrapper's carried tensors come last, fused
    experts as the source stored them (``merge_layout``). Returns the writer and the formats."""
    layout = SourceLayout(model)
    if layout.fused and fp8 is not None:
        raise MergeError(f"{model.path}: the source stored its experts fused (gate_up_proj [E, 2I, H]); merge "
                         "--dtype fp8 writes per-matrix block scales: merge without --dtype fp8.")
    hf_specs = layout.specs([s for u in units for s in u.specs])
    formats, written = _formats(model, layout, hf_specs, dtype, fp8, mxfp4)
    writer = ShardedSafetensorsWriter(directory, written, max_shard_size)
    quantized = fp8 is not None or mxfp4
    tensors = iter_hf_tensors(model, units, dims, None if quantized else dtype)
    if mxfp4 and layout.fused:  # each expert quantized as it comes: a layer's stack is held packed
        tensors = merge_mxfp4.pack_experts(tensors, expert_layout(model.args), formats)
    tensors = layout.tensors(tensors, None if quantized else dtype)
    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, total=sum(len(u.specs) for u in units), unit="tensor", desc="merge")
    nonfinite: dict[str, tuple[int, tuple[int, ...], float]] = {}
    for name, tensor in tensors:
        fmt = formats[name]
        if fmt is None and mxfp4:  # refuses NaN/inf naming the block
            packed = merge_mxfp4.unpack(name, tensor) if tensor.dtype == torch.uint8 else as_mxfp4(name, tensor)
            for part, data in packed:
                writer.write(part, data)
            continue
        if fmt is None:
            q, scale = quantize_block_fp8(tensor, fp8, name)  # refuses NaN/inf itself
            writer.write(name, q)
            writer.write(name + SCALE_SUFFIX, scale)
            continue
        tensor = cast_checked(tensor, fmt, name, f"merge without --dtype {'mxfp4' if mxfp4 else 'fp8'} "
                              "(the checkpoint's dtype)")
        found = first_nonfinite(tensor)
        if found is not None:
            nonfinite[name] = found
        writer.write(name, tensor)
    writer.close()
    if nonfinite:  # written as they are: a diverged run's step can still be merged and inspected
        warnings.warn(describe_nonfinite(nonfinite, model.path), NonFiniteWarning, stacklevel=3)
    for name in sorted(os.listdir(model.hf_dir)):
        src = contained(model.hf_dir, name, f"the listing of {model.hf_dir}")
        if os.path.isfile(src) and not export_file(name) and name not in ("config.json", CARRIED_FILE):
            shutil.copyfile(src, os.path.join(directory, name))
    return writer, formats


def merge(local_dir: str, target_dir: str, max_shard_size: int | str = "5GB",
          model_class: ModelClass | None = None, overwrite: bool = False,
          progress: bool = False, dtype: str | None = None, verify: bool = True,
          fp8: BlockFp8 | None = None) -> MergeSummary:
    """Writes the HF model of ``local_dir`` into ``target_dir``: safetensors shards of at most
    ``max_shard_size`` (+ index), config.json (the class ``hf_class`` picks; a critic: one label;
    ``dtype``/``torch_dtype``: the dtype written, see ``written_dtype``) and the tokenizer /
    generation files of ``local_dir/huggingface``. Written into a staging directory beside
    ``target_dir`` and renamed into place when complete: a failure leaves nothing new and an
    old ``target_dir`` (``overwrite``) as it was. ``verify``: see ``open_model_dir``; a directory
    replaced while it is merged is an error (nothing is written). ``dtype="fp8"``: the linear
    weights as block FP8 in format ``fp8`` (default ``BlockFp8()``: 128x128, float32 scales),
    every other tensor in the checkpoint's dtype, config.json with ``quantization_config``;
    ``dtype="mxfp4"`` (gpt-oss): the tensors the source stored as MXFP4 (or, converted from bf16,
    the experts' weights) as MXFP4 blocks + scales, the rest as the source stored it (bf16), see
    ``merge_mxfp4``; any other dtype drops a ``quantization_config`` the source config.json carries.
    An adapter-only LoRA step merges with its base (``merge_lora``: ``dtype`` fp32|bf16|fp16 or
    none, never quantized; shards of at most ``max_shard_size`` and at most 1 GiB)."""
    start = time.monotonic()
    asked = dtype
    dtype, fp8, mxfp4 = resolve_dtype(dtype, fp8)
    model = open_model_dir(local_dir, verify)
    try:
        if _adapter_only(model):
            if fp8 is not None or mxfp4:
                raise MergeError(f"{local_dir} holds LoRA adapters: its merge (base + adapters) is not quantized; "
                                 f"drop --dtype {asked} (or pass --dtype fp32|bf16|fp16).")
            return merge_adapter_step(model, target_dir, overwrite, verify, dtype, max_shard_size)
        if mxfp4:
            merge_mxfp4.check_arch(model.args.arch.model_type, local_dir)
        return _merge_open(model, start, target_dir, max_shard_size, model_class, overwrite, progress, dtype, fp8,
                           mxfp4)
    finally:
        model.reader.close()


def _merge_open(model: ModelDir, start: float, target_dir: str, max_shard_size: int | str,
                model_class: ModelClass | None, overwrite: bool, progress: bool, dtype: str | None,
                fp8: BlockFp8 | None = None, mxfp4: bool = False) -> MergeSummary:
    check_target(target_dir, model.path, overwrite)
    cls = hf_class(model, model_class or "auto")
    units, dims = plan_units(model)
    units = head_units(model, units, cls)
    out_dtype = written_dtype(model, units, dtype)
    stage = Staging.create(target_dir)
    try:
        writer, formats = _write_model(model, units, dims, out_dtype, stage.path, max_shard_size, progress, fp8,
                                       mxfp4)
        config = merged_config(model, cls, out_dtype, fp8, formats if mxfp4 else None)
        with open(os.path.join(stage.path, "config.json"), "w") as f:
            f.write(config_text(config))
        write_export_record(stage.path, "mcore_to_hf merge")
        same_dir(model.path, model.reader)  # the side files above came from the directory the shards did
        stage.commit(replace=overwrite)
    except BaseException:
        stage.discard()
        raise
    written = config["dtype"] if fp8 is None else f"float8_e4m3fn {fp8.block[0]}x{fp8.block[1]} + {config['dtype']}"
    if mxfp4:
        written = f"mxfp4 ({sum(f is None for f in formats.values())} tensors) + {config['dtype']}"
    return MergeSummary(sum(map(len, writer.shards)), writer.bytes_written, len(writer.files), time.monotonic() - start,
                        peak_rss_mb(), written)


def tensor_class(name: str) -> str:
    """``model.layers.3.mlp.experts.1.w1.weight`` -> ``model.layers.*.mlp.experts.*.w1.weight``."""
    return re.sub(r"\.\d+\.", ".*.", re.sub(r"\.\d+\.", ".*.", name))


def compare(local_dir: str, test_hf_dir: str, verify: bool = True) -> tuple[dict[str, float], list[str]]:
    """Merges ``local_dir`` in memory (tensor by tensor) against the HF dir ``test_hf_dir``:
    max abs diff per tensor class, and problems (missing/extra names, shape or dtype mismatch, a
    NaN or inf on either side: such a tensor's class gets diff inf, it never matches)."""
    from mcore_rl.mapping.hf_io import SafetensorsReader

    model = open_model_dir(local_dir, verify)
    try:
        if _adapter_only(model):
            raise MergeError(f"{local_dir} holds LoRA adapters only: merge it with its base first "
                             "(mcore_to_hf.py merge), then compare the merged directory.")
        return _compare_open(model, SafetensorsReader(test_hf_dir), test_hf_dir)
    finally:
        model.reader.close()


def _compare_open(model: ModelDir, ref, test_hf_dir: str) -> tuple[dict[str, float], list[str]]:
    units, dims = plan_units(model)
    units = head_units(model, units, hf_class(model))  # a reward model: compared without its zero bias
    diffs: dict[str, float] = {}
    problems, seen = [], set()
    for name, tensor in SourceLayout(model).tensors(iter_hf_tensors(model, units, dims), None):
        seen.add(name)
        if name not in ref:
            problems.append(f"{name}: not in {test_hf_dir}")
            continue
        other = ref[name]
        if other.shape != tensor.shape or other.dtype != tensor.dtype:
            problems.append(f"{name}: merged {tuple(tensor.shape)} {tensor.dtype}, reference "
                            f"{tuple(other.shape)} {other.dtype}")
            continue
        diff = (tensor.double() - other.double()).abs().max().item() if tensor.numel() else 0.0
        cls = tensor_class(name)
        if not math.isfinite(diff):  # max(x, nan) would hide it
            sides = [side for side, t in (("merged", tensor), ("reference", other)) if not torch.isfinite(t).all()]
            problems.append(f"{name}: non-finite values (NaN or inf) in the {' and '.join(sides) or 'difference'}")
            diff = math.inf
        diffs[cls] = max(diffs.get(cls, 0.0), diff)
    problems += [f"{n}: in {test_hf_dir} but not merged" for n in sorted(set(ref) - seen)]
    same_dir(model.path, model.reader)
    return diffs, problems
