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

import json
import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from functools import partial
from typing import Iterator, Literal

import torch

from mcore_rl.checkpoint import model_record, storage
from mcore_rl.conversion.convert_input import HF_DTYPE_NAMES
from mcore_rl.errors import CheckpointError, McoreRLError
from mcore_rl.fileio.checksum import file_checksum
from mcore_rl.fileio.files import META, peak_rss_mb
from mcore_rl.fileio.paths import contained
from mcore_rl.fileio.safetensors_write import ShardedSafetensorsWriter, TensorSpec
from mcore_rl.fileio.output_dir import (check_replaceable, input_overlap, refuse_file, settle_output,
                                         write_export_record)
from mcore_rl.fileio.staging import Staging
from mcore_rl.fileio.torch_dist_read import TorchDistReader
from mcore_rl.conversion.merge_fp8 import STORED_KEY, out_specs, tensor_formats
from mcore_rl.mapping.fp8_quant import SCALE_SUFFIX, BlockFp8, quantize_block_fp8
from mcore_rl.mapping.transforms import Dims, Transform
from mcore_rl.models.hf_config import ModelArgs, model_args_from_hf

ModelClass = Literal["auto", "causal_lm", "token_classification", "sequence_classification"]
# --model_class -> the suffix of the transformers class name, and the role it fits
_CLASS_SUFFIX = {"causal_lm": ("ForCausalLM", "actor"), "token_classification": ("ForTokenClassification", "critic"),
                 "sequence_classification": ("ForSequenceClassification", "critic")}
_EXPERT_DIST = ("mlp.experts.local_experts.{expert}.", "mlp.experts.experts.")  # canonical -> on-disk
_NOT_WEIGHTS = re.compile(r"^(optimizer\.|chained_\d+\.|rng_state)|\._extra_state(/|$)")
_WEIGHT_FILE = re.compile(r"^(model.*\.safetensors|model\.safetensors\.index\.json|pytorch_model.*\.bin)$")


class MergeError(CheckpointError):
    """A model directory that cannot be merged as asked."""


@dataclass(frozen=True)
class Unit:
    """One read: dist ``key`` at leading ``index`` -> HF tensors ``specs`` via ``transform``."""

    canonical: str
    key: str
    index: tuple[int, ...]
    transform: Transform
    specs: tuple[TensorSpec, ...]


@dataclass(frozen=True)
class ModelDir:
    """A validated model directory: role, ModelArgs, its dist reader and huggingface dir."""

    path: str
    role: str
    args: ModelArgs
    reader: TorchDistReader
    hf_dir: str
    meta: dict


@dataclass(frozen=True)
class MergeSummary:
    """What a merge wrote."""

    tensors: int
    bytes: int
    shards: int
    seconds: float
    peak_rss_mb: float
    dtype: str = "float32"

    def line(self) -> str:
        """The CLI's summary line."""
        return (f"merged {self.tensors} tensors ({self.dtype}), {self.bytes / 2**20:.1f} MiB in {self.shards} "
                f"shard(s), {self.seconds:.1f} s, peak RSS {self.peak_rss_mb:.0f} MiB")


def open_model_dir(local_dir: str, verify: bool = True) -> ModelDir:
    """Validates ``local_dir`` (``global_step_N/<role>`` or a converter output) and opens it.
    ``verify``: first every file is checked against the record that vouches for the directory
    (the step's marker, a part's record, a converter's ``RECORD``: size and CRC-32), and every
    file the merge reads must be recorded; ``verify=False`` skips that (``--skip_verify``)."""
    local_dir = os.path.abspath(local_dir)
    meta_path = os.path.join(local_dir, META)
    if not os.path.isfile(meta_path):
        roles = sorted(d for d in os.listdir(local_dir) if os.path.isfile(os.path.join(local_dir, d, META))) \
            if os.path.isdir(local_dir) else []
        hint = (f"it holds model dirs {roles}: pass one of them, e.g. {os.path.join(local_dir, roles[0])}"
                if roles else "pass a model dir (global_step_<N>/actor or a converter output)")
        raise MergeError(f"{local_dir} is not a model directory: no {META}; {hint}.")
    record = model_record.find_record(local_dir) if verify else None
    reader = TorchDistReader(os.path.join(local_dir, "dist_ckpt"),
                             before_parse=None if record is None else partial(_verify_all, record))
    try:
        if record is not None:
            _check_recorded(record, reader, local_dir)
        meta = storage.read_json(meta_path)
        contents, role = meta.get("contents"), meta.get("role")
        if not isinstance(contents, list) or "model" not in contents:
            raise MergeError(f"{local_dir}: {META} contents {contents!r} hold no 'model' weights (saved without "
                             "'model' in checkpoint.save_contents, or the file is damaged); nothing to merge.")
        if role not in ("actor", "critic"):
            raise MergeError(f"{meta_path}: role {role!r}; expected 'actor' or 'critic'.")
        hf_dir = _config_dir(local_dir, meta)
        args = _model_args(hf_dir)
        same_dir(local_dir, reader)
    except BaseException:
        reader.close()
        raise
    return ModelDir(local_dir, role, args, reader, hf_dir, meta)


def _config_dir(local_dir: str, meta: dict) -> str:
    """Where the model's config.json is: its ``huggingface/``; an adapter-only LoRA step saved
    without it takes its base's (a HF directory, or a model directory's ``huggingface/``)."""
    own = os.path.join(local_dir, "huggingface")
    lora = meta.get("lora") if isinstance(meta.get("lora"), dict) else {}
    base = lora.get("base") if isinstance(lora.get("base"), dict) else {}
    if os.path.isfile(os.path.join(own, "config.json")) or not lora.get("adapter_only") or not base.get("path"):
        return own
    return base["path"] if base.get("kind") == "hf" else os.path.join(base["path"], "huggingface")


def _adapter_only(model: ModelDir) -> bool:
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


def _verify_all(record: model_record.DirRecord, reader: TorchDistReader) -> None:
    """Every recorded file's size and checksum; ``dist_ckpt/`` files read through ``reader``'s handle
    (the bytes it will read), before its ``.metadata`` is parsed."""
    def crc_of(rel: str, like: str | None) -> tuple[int, str]:
        if rel.startswith("dist_ckpt/"):
            return reader.checksum(rel[len("dist_ckpt/"):], like)
        return file_checksum(os.path.join(record.path, rel), like)

    model_record.verify(record, [], crc_of)


def _check_recorded(record: model_record.DirRecord, reader: TorchDistReader, local_dir: str) -> None:
    """Every file the merge reads (those ``.metadata`` names, mcore_rl.json, huggingface/) is recorded."""
    needed = [META] + [f"dist_ckpt/{rel}" for rel in reader.files()]
    needed += model_record.listed(os.path.join(local_dir, "huggingface"), local_dir)
    missing = sorted(set(needed) - set(record.files))
    if missing:
        raise MergeError(f"{local_dir}: {missing[:8]} {'is' if len(missing) == 1 else 'are'} not in its record "
                         f"{record.source}: the files were added or renamed after it was written; restore the "
                         f"directory, {model_record.SKIP_HINT}.")


def same_dir(local_dir: str, reader: TorchDistReader) -> None:
    """``local_dir/dist_ckpt`` is still the directory ``reader`` holds: the step was not replaced
    (a save of the same step, a copy) since it was opened; else a CheckpointError."""
    path = os.path.join(local_dir, "dist_ckpt")
    try:
        st = os.stat(path)
        now = (st.st_dev, st.st_ino)
    except OSError as e:
        now = (-1, -1)
        why = e.strerror or str(e)
    else:
        why = "another directory is there now"
    if now != reader.identity():
        raise MergeError(f"{local_dir} was replaced or removed while it was read ({why}): a save of the same step "
                         "or a copy changed it; nothing was written: run again when it is done.")


def dist_key(canonical: str, stacked: bool = True) -> tuple[str, tuple[int, ...]]:
    """Canonical megatron name -> (on-disk key, leading index). ``stacked`` (layers all of one
    kind): the layer (and expert) index become leading dims, e.g.
    ``decoder.layers.3.mlp.experts.local_experts.1.linear_fc2.weight`` ->
    (``decoder.layers.mlp.experts.experts.linear_fc2.weight``, (3, 1)); dense layers mixed with
    MoE layers keep the layer in the key: (``decoder.layers.3.mlp.experts.experts.linear_fc2.weight``, (1,))."""
    m = re.match(r"^decoder\.layers\.(\d+)\.(.*)$", canonical)
    if m is None:
        return canonical, ()
    layer = () if stacked else (m[1],)
    prefix = ".".join(("decoder.layers",) + layer)
    e = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$", m[2])
    lead = (int(m[1]),) if stacked else ()
    if e:
        return f"{prefix}.{_EXPERT_DIST[1]}{e[2]}", lead + (int(e[1]),)
    return f"{prefix}.{m[2]}", lead


def _locate(reader: TorchDistReader, canonical: str) -> tuple[str, tuple[int, ...]] | None:
    """Where ``canonical`` is on disk (stacked or per-layer key), or None."""
    for stacked in (True, False):
        key, index = dist_key(canonical, stacked)
        if key in reader.tensors and reader.covers(key, index):
            return key, index
    return None


def canonical_rules(args: ModelArgs, role: str) -> Iterator[tuple[str, list[str], Transform]]:
    """(canonical name, HF names, transform) of every HF tensor group of ``args`` as ``role``,
    in file order: embedding, layer by layer (table order, experts inner), final norm, head.
    Tied embeddings (actor): no lm_head."""
    table = args.arch.table
    rows = table.rows(role, args.features)
    tied = args.tie_embeddings and role == "actor"
    kinds = args.moe.moe_layers if args.moe else (False,) * args.num_layers
    experts = range(args.moe.num_experts) if args.moe else range(0)
    layered = {t: r for t, r in rows.items() if "{layer}" in t}
    first = [t for t in rows if "{layer}" not in t and t.startswith("embedding.")]
    last = [t for t in rows if "{layer}" not in t and t not in first
            and not (tied and t in table.lm_head)]
    for template in first:
        yield template, list(rows[template][0]), rows[template][1]
    for layer in range(args.num_layers):
        for template, (hf_templates, transform) in layered.items():
            if (template in table.moe_mlp and not kinds[layer]) or (template in table.dense_mlp and kinds[layer]):
                continue
            for e in experts if "{expert}" in template else [None]:
                yield (template.format(layer=layer, expert=e),
                       [t.format(layer=layer, expert=e) for t in hf_templates], transform)
    for template in last:
        yield template, list(rows[template][0]), rows[template][1]


def plan_units(model: ModelDir) -> tuple[list[Unit], Dims]:
    """Every read with its HF tensors (shapes from the on-disk metadata, no data read); an error
    names expected tensors the checkpoint lacks and model keys nothing consumes."""
    reader, args = model.reader, model.args
    embed = reader.tensors.get("embedding.word_embeddings.weight")
    dims = args.mapping_dims(embed.shape[0] if embed else args.vocab_size)
    units, missing, used = [], [], set()
    for canonical, hf_names, transform in canonical_rules(args, model.role):
        found = _locate(reader, canonical)
        if found is None:
            key, index = dist_key(canonical)
            missing.append(f"{canonical} (key {key!r}, index {index}) for {hf_names}")
            continue
        key, index = found
        used.add(key)
        info = reader.tensors[key]
        probe = torch.empty(info.shape[len(index):], dtype=info.dtype, device="meta")
        try:
            outs = transform.to_hf(probe, dims)
        except (RuntimeError, ValueError, TypeError, IndexError, ZeroDivisionError) as e:
            raise MergeError(f"{model.path}: {key!r} of shape {tuple(info.shape)} does not fit huggingface/config.json "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); merge the checkpoint with "
                             "the config it was saved with.") from None
        specs = tuple(TensorSpec(n, tuple(t.shape), info.dtype) for n, t in zip(hf_names, outs))
        units.append(Unit(canonical, key, index, transform, specs))
    if args.tie_embeddings and model.role == "actor":
        used.add("output_layer.weight")  # the last stage's copy of the tied embedding, if saved
    unused = sorted(k for k in reader.tensors if k not in used and not _NOT_WEIGHTS.search(k))
    unused += sorted(k for k in reader.objects if not _NOT_WEIGHTS.search(k))
    if missing or unused:
        raise MergeError(
            f"{model.path}: the checkpoint does not match huggingface/config.json "
            f"({args.arch.model_type}, role {model.role}): "
            + (f"{len(missing)} expected tensors missing: {missing[:6]}; " if missing else "")
            + (f"{len(unused)} checkpoint keys no mapping row consumes: {unused[:6]}; " if unused else "")
            + "merge the checkpoint with the config it was saved with.")
    return units, dims


def iter_hf_tensors(model: ModelDir, units: list[Unit], dims: Dims,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) in plan order, cast to ``dtype`` when given; one unit's part in memory
    at a time."""
    for unit in units:
        part = model.reader.read(unit.key, unit.index)
        for spec, tensor in zip(unit.specs, unit.transform.to_hf(part, dims)):
            yield spec.name, tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)
        del part


def written_dtype(model: ModelDir, units: list[Unit], dtype: str | None = None) -> torch.dtype:
    """The one dtype of the merged model: ``dtype`` (fp32, bf16, fp16) when given, else the dtype
    the checkpoint stores its model parameters in (a bf16 run's model keys are bf16 whatever its
    optimizer's fp32 main parameters), else mcore_rl.json's ``params_dtype``."""
    if dtype is not None:
        if dtype not in HF_DTYPE_NAMES:
            raise MergeError(f"dtype={dtype!r}; use one of {sorted(HF_DTYPE_NAMES)} (or none: the checkpoint's).")
        return getattr(torch, HF_DTYPE_NAMES[dtype])
    stored = {model.reader.tensors[u.key].dtype for u in units}
    if len(stored) == 1:
        return stored.pop()
    named = str(model.meta.get("params_dtype", "")).removeprefix("torch.")
    if named not in HF_DTYPE_NAMES.values():
        raise MergeError(f"{model.path}: the model tensors are stored in {sorted(map(str, stored))} and "
                         f"{META} names no params_dtype; pass --dtype fp32|bf16|fp16.")
    return getattr(torch, named)


def hf_class(model: ModelDir, model_class: ModelClass = "auto") -> str:
    """The transformers class the merged model is: ``auto`` keeps the class its
    ``huggingface/config.json`` records (the converter's or the run's input: a reward model's
    ``*ForSequenceClassification`` comes back as one) when it fits the role, else the role's
    default (actor: causal LM, critic: token classification with one label)."""
    arch = model.args.arch
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


def _hf_config(model: ModelDir, cls: str) -> dict:
    """config.json of the merged model: architectures [cls] (and one label for a critic)."""
    with open(contained(model.hf_dir, "config.json", model.hf_dir)) as f:
        config = json.load(f)
    config["architectures"] = [cls]
    if model.role == "critic":
        config.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return config


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
        bias = model.reader.read(unit.key, unit.index)
        if bool((bias != 0).any()):
            raise MergeError(f"{model.path}: the value head's bias is {bias.flatten().tolist()}, not 0: {cls} "
                             "has no score bias to hold it; merge with --model_class token_classification.")
    return kept


def check_target(target_dir: str, local_dir: str, overwrite: bool) -> None:
    """Settles what an interrupted merge left beside ``target_dir``, then refuses a file, a
    target that overlaps the model directory on resolved paths (links under it included; even
    with ``overwrite``), a non-empty directory unless ``overwrite``, and with it anything but
    an earlier HF export of this project (``fileio.output_dir``)."""
    settle_output(target_dir, MergeError)
    refuse_file(target_dir, f"target_dir {target_dir}", MergeError)
    via = input_overlap(target_dir, local_dir)
    if via is not None:
        raise MergeError(f"target_dir {target_dir} overlaps the model directory {local_dir}{via} (the same "
                         "directory, or one inside the other); write the HF model outside it.")
    check_replaceable(target_dir, overwrite, "hf_export", f"target_dir {target_dir}", MergeError)


def _write_model(model: ModelDir, units: list[Unit], dims: Dims, dtype: torch.dtype, directory: str,
                 max_shard_size: int | str, progress: bool, fp8: BlockFp8 | None = None) -> ShardedSafetensorsWriter:
    """Streams the HF tensors into ``directory`` (``fp8``: the quantized ones as block FP8 +
    scales, see ``out_specs``) and copies the non-weight HF files (tokenizer, generation config)
    of the model directory (no file that leaves it: symlinks are checked)."""
    hf_specs = [s for u in units for s in u.specs]
    formats = tensor_formats(hf_specs, dtype, fp8, model.meta.get(STORED_KEY) if fp8 is not None else None)
    writer = ShardedSafetensorsWriter(directory, out_specs(hf_specs, formats, fp8), max_shard_size)
    tensors = iter_hf_tensors(model, units, dims, None if fp8 is not None else dtype)
    if progress:
        from tqdm import tqdm

        tensors = tqdm(tensors, total=sum(len(u.specs) for u in units), unit="tensor", desc="merge")
    for name, tensor in tensors:
        fmt = formats[name]
        if fmt is None:
            q, scale = quantize_block_fp8(tensor, fp8, name)
            writer.write(name, q)
            writer.write(name + SCALE_SUFFIX, scale)
        else:
            writer.write(name, tensor if tensor.dtype == fmt else tensor.to(fmt))
    writer.close()
    for name in sorted(os.listdir(model.hf_dir)):
        src = contained(model.hf_dir, name, f"the listing of {model.hf_dir}")
        if os.path.isfile(src) and not _WEIGHT_FILE.match(name) and name != "config.json":
            shutil.copyfile(src, os.path.join(directory, name))
    return writer


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
    every other tensor in the checkpoint's dtype, config.json with ``quantization_config``; any
    other dtype drops a ``quantization_config`` the source config.json carries."""
    start = time.monotonic()
    if fp8 is not None and dtype != "fp8":
        raise MergeError(f"an fp8 format ({fp8}) was given with dtype={dtype!r}; pass dtype='fp8' (--dtype fp8).")
    if dtype == "fp8":
        fp8, dtype = fp8 or BlockFp8(), None
    model = open_model_dir(local_dir, verify)
    try:
        if _adapter_only(model):
            if fp8 is not None or dtype is not None:
                raise MergeError(f"{local_dir} holds LoRA adapters: its merge writes the base's dtype; drop --dtype.")
            from mcore_rl.conversion.merge_lora import merge_adapter_step  # it builds on this module

            return merge_adapter_step(model, target_dir, overwrite, verify)
        return _merge_open(model, start, target_dir, max_shard_size, model_class, overwrite, progress, dtype, fp8)
    finally:
        model.reader.close()


def _merge_open(model: ModelDir, start: float, target_dir: str, max_shard_size: int | str,
                model_class: ModelClass | None, overwrite: bool, progress: bool, dtype: str | None,
                fp8: BlockFp8 | None = None) -> MergeSummary:
    check_target(target_dir, model.path, overwrite)
    cls = hf_class(model, model_class or "auto")
    config = _hf_config(model, cls)
    units, dims = plan_units(model)
    units = head_units(model, units, cls)
    out_dtype = written_dtype(model, units, dtype)
    config["dtype"] = config["torch_dtype"] = str(out_dtype).removeprefix("torch.")  # as transformers names it
    config.pop("quantization_config", None)  # an FP8 source's: the weights written are not quantized
    if fp8 is not None:
        config["quantization_config"] = fp8.quantization_config()
    stage = Staging.create(target_dir)
    try:
        writer = _write_model(model, units, dims, out_dtype, stage.path, max_shard_size, progress, fp8)
        with open(os.path.join(stage.path, "config.json"), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
        write_export_record(stage.path, "mcore_to_hf merge")
        same_dir(model.path, model.reader)  # the side files above came from the directory the shards did
        stage.commit(replace=overwrite)
    except BaseException:
        stage.discard()
        raise
    written = config["dtype"] if fp8 is None else f"float8_e4m3fn {fp8.block[0]}x{fp8.block[1]} + {config['dtype']}"
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
    for name, tensor in iter_hf_tensors(model, units, dims):
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
