"""Reading a model directory for a merge (``mcore_to_hf.py merge``/``test``, the LoRA merge):
open and verify it, and plan its reads (``plan_units``: every dist key and leading index with the
HF tensors its mapping transform gives), the merged model's class and config, and the target's
checks. The module both merges build on (``merge`` and ``merge_lora``), so neither imports the
other's caller. No megatron import.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import torch

from mcore_rl.checkpoint import model_record
from mcore_rl.checkpoint.export_config import (  # noqa: F401 - re-exported: the merges import them from here
    MergeError, ModelClass, ModelInfo, hf_class, model_info,
)
from mcore_rl.checkpoint.export_config import adapter_only as _adapter_only  # noqa: F401
from mcore_rl.checkpoint.export_config import hf_config as _hf_config  # noqa: F401
from mcore_rl.fileio.checksum import file_checksum
from mcore_rl.fileio.files import META
from mcore_rl.fileio.model_layout import layout_of
from mcore_rl.fileio.output_dir import WEIGHT_FILE, check_replaceable, input_overlap, refuse_file, settle_output
from mcore_rl.fileio.output_dir import is_export_file as export_file
from mcore_rl.fileio.safetensors_write import TensorSpec
from mcore_rl.fileio.torch_dist_read import TorchDistReader
from mcore_rl.mapping.transforms import Dims, Transform
from mcore_rl.mapping.mtp import mtp_dist_key, mtp_rules, with_copies
from mcore_rl.models.hf_config import ModelArgs

_EXPERT_DIST = ("mlp.experts.local_experts.{expert}.", "mlp.experts.experts.")  # canonical -> on-disk
_NOT_WEIGHTS = re.compile(r"^(optimizer\.|chained_\d+\.|rng_state)|\._extra_state(/|$)")
_WEIGHT_FILE = WEIGHT_FILE


@dataclass(frozen=True)
class Unit:
    """One read: dist ``key`` at leading ``index`` -> HF tensors ``specs`` via ``transform``."""

    canonical: str
    key: str
    index: tuple[int, ...]
    transform: Transform
    specs: tuple[TensorSpec, ...]
    pieces: tuple[str, ...] = ()  # on disk as ``key.<piece>`` keys, concatenated along dim 0

    @property
    def keys(self) -> tuple[str, ...]:
        """The on-disk keys read for this unit."""
        return tuple(f"{self.key}.{p}" for p in self.pieces) or (self.key,)


# parameters megatron's sharded state splits into one key per piece (GatedDeltaNet): the
# pieces, concatenated in this order along dim 0, are the parameter's TP=1 layout
SPLIT_KEYS = {
    "self_attention.in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
    "self_attention.in_proj.lora.B": ("query", "key", "value", "z", "beta", "alpha"),  # its rows: the weight's
    "self_attention.conv1d.weight": ("query", "key", "value"),
}


def read_located(reader: TorchDistReader, key: str, index: tuple[int, ...], pieces: tuple[str, ...] = ()) -> torch.Tensor:
    """The tensor at ``key`` (and leading ``index``), or its ``pieces`` concatenated along dim 0."""
    if not pieces:
        return reader.read(key, index)
    return torch.cat([reader.read(f"{key}.{p}", index) for p in pieces], dim=0)


def read_unit(reader: TorchDistReader, unit: Unit) -> torch.Tensor:
    """The unit's tensor (its pieces concatenated)."""
    return read_located(reader, unit.key, unit.index, unit.pieces)


@dataclass(frozen=True)
class ModelDir(ModelInfo):
    """A validated model directory: ``ModelInfo`` and its dist reader."""

    reader: TorchDistReader


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
    layout = layout_of(local_dir)
    reader = TorchDistReader(layout.dist_dir(local_dir),
                             before_parse=None if record is None else partial(_verify_all, record, layout.dist))
    try:
        if record is not None:
            _check_recorded(record, reader, local_dir)
        info = model_info(local_dir)
        same_dir(local_dir, reader)
    except BaseException:
        reader.close()
        raise
    return ModelDir(info.path, info.role, info.args, info.hf_dir, info.meta, reader)


def _verify_all(record: model_record.DirRecord, dist: str, reader: TorchDistReader) -> None:
    """Every recorded file's size and checksum; the files of the megatron checkpoint (``dist``,
    relative to the model dir) read through ``reader``'s handle (the bytes it will read), before
    its ``.metadata`` is parsed."""
    def crc_of(rel: str, like: str | None) -> tuple[int, str]:
        if rel.startswith(dist + "/"):
            return reader.checksum(rel[len(dist) + 1:], like)
        return file_checksum(os.path.join(record.path, rel), like)

    model_record.verify(record, [], crc_of)


def _check_recorded(record: model_record.DirRecord, reader: TorchDistReader, local_dir: str) -> None:
    """Every file the merge reads (those ``.metadata`` names, mcore_rl.json, the HF dir) is recorded.
    The HF dir's weight files and export record are not read (``export_file``): an export of the
    step beside its files, complete or cut short, is not the step's."""
    layout = layout_of(local_dir)
    needed = [META] + [layout.dist_rel(rel) for rel in reader.files()]
    needed += [rel for rel in model_record.listed(layout.hf_dir(local_dir), local_dir)
               if not export_file(os.path.basename(rel))]
    missing = sorted(set(needed) - set(record.files))
    if missing:
        raise MergeError(f"{local_dir}: {missing[:8]} {'is' if len(missing) == 1 else 'are'} not in its record "
                         f"{record.source}: the files were added or renamed after it was written; restore the "
                         f"directory, {model_record.SKIP_HINT}.")


def same_dir(local_dir: str, reader: TorchDistReader) -> None:
    """``local_dir``'s megatron checkpoint dir is still the directory ``reader`` holds: the step
    was not replaced (a save of the same step, a copy) since it was opened; else a CheckpointError."""
    try:
        st = os.stat(layout_of(local_dir).dist_dir(local_dir))
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
        return mtp_dist_key(canonical) or (canonical, ())
    layer = () if stacked else (m[1],)
    prefix = ".".join(("decoder.layers",) + layer)
    e = re.match(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$", m[2])
    lead = (int(m[1]),) if stacked else ()
    if e:
        return f"{prefix}.{_EXPERT_DIST[1]}{e[2]}", lead + (int(e[1]),)
    return f"{prefix}.{m[2]}", lead


def _locate(reader: TorchDistReader, canonical: str) -> tuple[str, tuple[int, ...], tuple[str, ...]] | None:
    """Where ``canonical`` is on disk (stacked or per-layer key, whole or in pieces), or None."""
    pieces = next((p for suffix, p in SPLIT_KEYS.items() if canonical.endswith(suffix)), ())
    for stacked in (True, False):
        key, index = dist_key(canonical, stacked)
        if key in reader.tensors and reader.covers(key, index):
            return key, index, ()
        if pieces and all(f"{key}.{p}" in reader.tensors and reader.covers(f"{key}.{p}", index) for p in pieces):
            return key, index, pieces
    return None


def canonical_rules(args: ModelArgs, role: str) -> Iterator[tuple[str, list[str], Transform]]:
    """(canonical name, HF names, transform) of every HF tensor group of ``args`` as ``role``,
    in file order: embedding, layer by layer (table order, experts inner), final norm, head.
    Tied embeddings (actor): no lm_head."""
    table = args.arch.table
    rows = args.hf_rows(role)
    tied = args.tie_embeddings and role == "actor"
    mtp = args.mtp_built if role == "actor" else 0
    if mtp:  # the MTP layers' HF copies of the embedding and head come with those rows
        rows = with_copies(rows, table.mtp, args.num_layers, mtp, args.tie_embeddings)
    kinds = args.moe.moe_layers if args.moe else (False,) * args.num_layers
    linear = args.hybrid.linear_layers if args.hybrid else (False,) * args.num_layers
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
            gdn_row, attention_row = template in table.linear_attention, args.hybrid and template in table.attention
            if (gdn_row and not linear[layer]) or (attention_row and linear[layer]):
                continue
            for e in experts if "{expert}" in template else [None]:
                yield (template.format(layer=layer, expert=e),
                       [t.format(layer=layer, expert=e) for t in hf_templates], transform)
    for template in last:
        yield template, list(rows[template][0]), rows[template][1]
    if mtp:
        yield from mtp_rules(rows, table.mtp, args.num_layers, mtp, bool(args.moe and kinds[-1]),
                             frozenset(table.moe_mlp), frozenset(table.dense_mlp), len(experts),
                             frozenset(table.linear_attention), table.mtp_layer_prefix)


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
        key, index, pieces = found
        unit_keys = tuple(f"{key}.{p}" for p in pieces) or (key,)
        used.update(unit_keys)
        transform = transform.bind(dims)
        infos = [reader.tensors[k] for k in unit_keys]
        info = infos[0]
        probe = torch.cat([torch.empty(i.shape[len(index):], dtype=i.dtype, device="meta") for i in infos])
        try:
            outs = transform.to_hf(probe, dims)
        except (RuntimeError, ValueError, TypeError, IndexError, ZeroDivisionError) as e:
            raise MergeError(f"{model.path}: {key!r} of shape {tuple(info.shape)} does not fit huggingface/config.json "
                             f"({type(e).__name__}: {' '.join(str(e).split())[:200]}); merge the checkpoint with "
                             "the config it was saved with.") from None
        specs = tuple(TensorSpec(n, tuple(t.shape), info.dtype) for n, t in zip(hf_names, outs))
        units.append(Unit(canonical, key, index, transform, specs, pieces))
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
