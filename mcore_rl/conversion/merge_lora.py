"""Merging an adapter-only LoRA step with its base into a HF model (``mcore_to_hf.py merge``).

The step's ``mcore_rl.json`` names its base (a HF directory or a model directory) and that
base's identity (fileio/base_identity.py): the base is found there and checked, then every HF
tensor of the model is written as the base's, plus ``s B A`` for each adapted linear (the step's
full factors and its ``scale`` buffer, through the weight's transform into the HF pieces), and a
tensor the step itself holds (a critic's trained value head, a router's moved bias) replaces the
base's. One mapping-table row in memory at a time; written into a staging directory and renamed
into place as any merge. config.json is ``export_config.merged_config`` with the dtype
``export_config.adapter_merge_dtype`` names (known at the step's save: a background HF export of
the step writes the same bytes); the side files (tokenizer, generation config) are the step's own
HF dir's when it has one (saved with ``hf_model``), else its base's.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Iterator, Mapping

import torch

from mcore_rl.checkpoint import model_record
from mcore_rl.checkpoint.export_config import adapter_merge_dtype, config_text, merged_config
from mcore_rl.conversion.merge_io import (
    MergeError, MergeSummary, ModelDir, _locate, canonical_rules, check_target, export_file, hf_class,
    open_model_dir, plan_units, read_located, read_unit,
)
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.base_identity import (describe, differences, hf_dir_identity, model_dir_identity,
                                           warn_if_sampled_only)
from mcore_rl.fileio.files import peak_rss_mb
from mcore_rl.fileio.output_dir import write_export_record
from mcore_rl.fileio.paths import contained
from mcore_rl.fileio.safetensors_write import parse_size, write_bucket_shards
from mcore_rl.fileio.staging import Staging
from mcore_rl.mapping.casts import cast_checked, wider_dtypes
from mcore_rl.mapping.hf_io import SafetensorsReader
from mcore_rl.mapping.transforms import Dims

Tensor = torch.Tensor
BUCKET_BYTES = 1 << 30


def _base_source(step: ModelDir, verify: bool) -> tuple[Mapping[str, Tensor], object]:
    """(HF name -> tensor of the base, something to close)."""
    base = step.meta["lora"].get("base") or {}
    kind, path = base.get("kind"), base.get("path")
    if kind not in ("hf", "mcore") or not path:
        raise MergeError(f"{step.path} holds LoRA adapters trained on {describe(base)}: no base directory to merge "
                         "them into; export merged weights from the live engine (conversion/lora_export.py).")
    if not os.path.isdir(path):
        raise MergeError(f"{step.path}: its base {path} does not exist here; copy the base there (or merge where it "
                         "is).")
    if kind == "hf":
        current = hf_dir_identity(path)
    else:
        try:
            record = model_record.find_record(path)
            current = model_dir_identity(path, record.source, record.files)
        except CheckpointError:
            current = model_dir_identity(path, None, None)
    changed = differences(base, current)
    if changed:
        raise MergeError(f"{step.path}: its base {path} is not the one the adapters were trained on "
                         f"({'; '.join(changed[:4])}); merge with the original base.")
    warn_if_sampled_only(base, step.path)
    if kind == "hf":
        return SafetensorsReader(path), None
    model = open_model_dir(path, verify)
    return _UnitReader(model), model.reader


class _UnitReader(Mapping[str, Tensor]):
    """HF tensors of a model directory by name, read one mapping row at a time (cached)."""

    def __init__(self, model: ModelDir) -> None:
        self.model = model
        self.units, self.dims = plan_units(model)
        self.of = {spec.name: u for u in self.units for spec in u.specs}
        self.cached: tuple[str, dict[str, Tensor]] | None = None

    def __getitem__(self, name: str) -> Tensor:
        unit = self.of[name]
        if self.cached is None or self.cached[0] != unit.canonical:
            part = read_unit(self.model.reader, unit)
            self.cached = (unit.canonical, {s.name: t for s, t in zip(unit.specs, unit.transform.to_hf(part, self.dims))})
        return self.cached[1][name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.of)

    def __len__(self) -> int:
        return len(self.of)


def step_tensor(step: ModelDir, canonical: str) -> Tensor | None:
    """The tensor ``canonical`` (megatron name, e.g. ``decoder.layers.0.mlp.linear_fc1.lora.A``)
    as the step holds it (full, unsharded), or None when the step does not hold it."""
    found = _locate(step.reader, canonical)
    return None if found is None else read_located(step.reader, *found)


def _merged_rows(step: ModelDir, base: Mapping[str, Tensor], dims: Dims,
                 dtype: torch.dtype | None = None) -> Iterator[tuple[str, Tensor]]:
    """(HF name, merged tensor) for every row of the model's table, in file order; cast to
    ``dtype`` when given (a finite value it cannot hold: a CastOverflowError naming the tensor)."""
    for name, tensor in _rows(step, base, dims):
        yield name, tensor if dtype is None else cast_checked(tensor, dtype, name, wider_dtypes(dtype))


def _rows(step: ModelDir, base: Mapping[str, Tensor], dims: Dims) -> Iterator[tuple[str, Tensor]]:
    """(HF name, merged tensor) as read: the base's dtype, a tensor the step holds in its own."""
    for canonical, hf_names, transform in canonical_rules(step.args, step.role):
        transform = transform.bind(dims)
        own = step_tensor(step, canonical)  # trained in full (value head) or a moved buffer
        if own is not None:
            yield from zip(hf_names, transform.to_hf(own, dims))
            continue
        pieces = [base[n] for n in hf_names]
        linear = canonical.removesuffix(".weight")
        a = step_tensor(step, linear + ".lora.A") if linear != canonical else None
        if a is not None:
            b, scale = step_tensor(step, linear + ".lora.B"), step_tensor(step, linear + ".lora.scale")
            if b is None or scale is None:
                raise MergeError(f"{step.path}: {linear} has lora.A but no lora.B or lora.scale; the step is damaged.")
            delta = (b.double() @ a.double()) * float(scale.reshape(-1)[0])
            pieces = [cast_checked(p.double() + d, p.dtype, f"{n} (base + adapters)",
                                   f"the adapters move it beyond the base's {p.dtype}: merge into a wider base")
                      for n, p, d in zip(hf_names, pieces, transform.to_hf(delta, dims))]
        yield from zip(hf_names, pieces)


def merge_adapter_step(step: ModelDir, target_dir: str, overwrite: bool, verify: bool,
                       dtype: str | None = None, max_shard_size: int | str = BUCKET_BYTES) -> MergeSummary:
    """Writes base + adapters of the adapter-only step ``step`` as a HF model in ``target_dir``
    (``dtype``: fp32|bf16|fp16, every tensor cast to it; None: each as merged, see the module doc)
    in shards of at most ``max_shard_size`` and at most 1 GiB (``BUCKET_BYTES``: a shard is built
    in memory; a larger tensor is a shard of its own)."""
    start = time.monotonic()
    if step.args.wrapper is not None:
        raise MergeError(f"{step.path}: merging LoRA adapters into a {step.args.wrapper.hf_class} (vision-language) "
                         "base is not supported; save the run with checkpoint.save_contents including 'model' "
                         "(full weights) and merge that step.")
    check_target(target_dir, step.path, overwrite)
    limit = min(parse_size(max_shard_size), BUCKET_BYTES)
    out_dtype = adapter_merge_dtype(step, dtype)
    config = merged_config(step, hf_class(step, "auto"), out_dtype)
    base, closer = _base_source(step, verify)
    try:
        dims = step.args.mapping_dims(step.args.vocab_size)
        cast = None if dtype is None else out_dtype
        stage = Staging.create(target_dir)
        try:
            counts = {"tensors": 0, "bytes": 0}
            files = write_bucket_shards(stage.path, _buckets(_merged_rows(step, base, dims, cast), counts, limit))
            with open(os.path.join(stage.path, "config.json"), "w") as f:
                f.write(config_text(config))
            for name in sorted(os.listdir(step.hf_dir)):  # its own HF dir's (hf_model), else its base's
                src = contained(step.hf_dir, name, f"the listing of {step.hf_dir}")
                if os.path.isfile(src) and not export_file(name) and name != "config.json" \
                        and not name.endswith(".safetensors"):
                    shutil.copyfile(src, os.path.join(stage.path, name))
            write_export_record(stage.path, "mcore_to_hf merge (LoRA adapters + base)")
            stage.commit(replace=overwrite)
        except BaseException:
            stage.discard()
            raise
    finally:
        if closer is not None:
            closer.close()
    return MergeSummary(counts["tensors"], counts["bytes"], len(files), time.monotonic() - start, peak_rss_mb(),
                        config["dtype"])


def _buckets(rows: Iterator[tuple[str, Tensor]], counts: dict, limit: int) -> Iterator[list[tuple[str, Tensor]]]:
    """``rows`` grouped in order into buckets of at most ``limit`` bytes (HF's greedy rule)."""
    bucket, filled = [], 0
    for name, tensor in rows:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and filled + nbytes > limit:
            yield bucket
            bucket, filled = [], 0
        bucket.append((name, tensor))
        filled += nbytes
        counts["tensors"] += 1
        counts["bytes"] += nbytes
    if bucket:
        yield bucket
