"""A step's HF weights exported in the background, from the saved step, by the merge path.

``write_export_config`` (the save, rank 0, with ``hf_model`` in ``save_contents``) writes the
role's HF dir ``config.json`` already as ``mcore_to_hf.py merge`` of the step will write it
(``conversion/merge_config.merged_config``), so the export never changes a file the step records.
``export_step`` (the exporter, after the step is complete) merges the step into a staging dir
beside the role dir on the same filesystem, checks that the staged config.json and side files
are the step's bytes, moves the weight files into the HF dir (shards first, the index last),
fsyncs, writes the export's record atomically (``hf_export_record``) and removes the staging dir.
A kill at any point leaves the export partial or absent (``export_state``), never complete with a
file missing; transformers finds no weights before the index (or a single ``model.safetensors``)
is in place. No megatron import.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

import torch

from mcore_rl.checkpoint import hf_export_record as rec
from mcore_rl.checkpoint import model_record
from mcore_rl.checkpoint.inventory import parse_step_name
from mcore_rl.conversion.merge import merge
from mcore_rl.conversion.merge_config import config_text, expert_formats, merged_config, named_dtype, resolve_dtype
from mcore_rl.conversion.merge_io import ModelInfo, _adapter_only, export_file, hf_class, model_info
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.faults import fault_point, hold_point
from mcore_rl.fileio.files import fsync_path, peak_rss_mb
from mcore_rl.fileio.output_dir import EXPORT_RECORD
from mcore_rl.fileio.safetensors_write import parse_size
from mcore_rl.mapping.fp8_quant import BlockFp8
from mcore_rl.models.hf_layout import CARRIED_FILE


class ExportError(CheckpointError):
    """A step the background export cannot export as asked (or whose export failed a check)."""


@dataclass(frozen=True)
class ExportSpec:
    """What an export writes: ``dtype`` as ``merge --dtype`` (fp32|bf16|fp16|fp8|mxfp4; None: the
    checkpoint's), shards of at most ``max_shard_size``, the block-FP8 format (``dtype="fp8"``)."""

    dtype: str | None = None
    max_shard_size: str = "5GB"
    fp8: BlockFp8 | None = None

    def __post_init__(self) -> None:
        resolve_dtype(self.dtype, self.fp8)  # a bad dtype / fp8 combination: MergeError naming it
        parse_size(self.max_shard_size)


@dataclass(frozen=True)
class ExportResult:
    """What an export wrote: the weight files (names in the HF dir) and their bytes, the seconds,
    the exporter's peak RSS and the size of the step's files it read (``dist_ckpt/``)."""

    step: int
    role: str
    files: tuple[str, ...]
    bytes: int
    seconds: float
    peak_rss_mb: float
    step_bytes: int
    skipped: bool = False  # the export was complete already: nothing written

    def line(self) -> str:
        """One summary line (the worker prints it)."""
        if self.skipped:
            return f"step {self.step} {self.role}: the HF export is complete already; nothing written"
        step_mib = self.step_bytes / 2**20
        ratio = f" ({self.peak_rss_mb / step_mib:.2f}x the step's {step_mib:.1f} MiB)" if step_mib else ""
        return (f"exported step {self.step} {self.role}: {len(self.files)} file(s), {self.bytes / 2**20:.1f} MiB in "
                f"{self.seconds:.1f} s, peak RSS {self.peak_rss_mb:.0f} MiB{ratio}")


def _refuse_adapter_only(info: ModelInfo) -> None:
    if _adapter_only(info):
        raise ExportError(f"{info.path} holds LoRA adapters only: its HF weights are base + adapters, merged where "
                          "the base is (mcore_to_hf.py merge); the background export does not write them. Save "
                          "'model' with full weights (lora.save_adapter_only=false), or drop 'hf_model' from "
                          "checkpoint.save_contents and merge the step yourself.")


def export_config(info: ModelInfo, spec: ExportSpec, params_dtype: torch.dtype) -> dict:
    """The config.json ``merge(info.path, ..., dtype=spec.dtype, fp8=spec.fp8)`` writes, from the
    model directory's config and ``mcore_rl.json`` alone (no weights): the written dtype is
    ``spec.dtype``'s, else ``params_dtype`` (what the step stores its model parameters in: the
    engine's params dtype); MXFP4's ``quantization_config`` from ``merge_config.expert_formats``."""
    _refuse_adapter_only(info)
    plain, fp8, mxfp4 = resolve_dtype(spec.dtype, spec.fp8)
    out_dtype = named_dtype(plain) if plain is not None else params_dtype
    return merged_config(info, hf_class(info, "auto"), out_dtype, fp8, expert_formats(info) if mxfp4 else None)


def write_export_config(role_dir: str, role: str, spec: ExportSpec, params_dtype: torch.dtype) -> None:
    """Rewrites ``role_dir``'s HF dir config.json (written there by the save: the run's config)
    into the config.json the export of this step will have: byte for byte what ``merge`` of the
    step with ``spec``'s dtype writes (``export_config``). Idempotent; atomic (temp + rename).
    Call it before the step's files are recorded; ``role_dir``'s ``mcore_rl.json`` must be written."""
    info = model_info(role_dir)
    if info.role != role:
        raise ExportError(f"{role_dir}: its mcore_rl.json says role {info.role!r}, not {role!r}; pass its role dir.")
    if info.hf_dir != rec.hf_dir_of(role_dir):
        raise ExportError(f"{role_dir} has no config.json of its own (an adapter-only step takes its base's); "
                          "nothing to export there.")
    text = config_text(export_config(info, spec, params_dtype))
    path = os.path.join(info.hf_dir, "config.json")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(info.hf_dir)


def check_role_dir(role_dir: str, step: int) -> None:
    """``role_dir`` is a directory ``global_step_<step>/<role>``; else an ExportError naming it."""
    if not os.path.isdir(role_dir):
        raise ExportError(f"{role_dir} is not a directory; pass a role dir of a step (global_step_<N>/<role>).")
    named = parse_step_name(os.path.basename(os.path.dirname(os.path.abspath(role_dir))))
    if named != step:
        raise ExportError(f"{role_dir} is not a role dir of step {step} (global_step_{step}/<role>); pass the step's "
                          "role dir.")


def _check_step(role_dir: str, step: int) -> tuple[ModelInfo, rec.Survey]:
    check_role_dir(role_dir, step)
    info = model_info(role_dir)
    _refuse_adapter_only(info)
    return info, rec.survey(role_dir)


def export_step(role_dir: str, spec: ExportSpec, step: int) -> ExportResult:
    """Exports complete step ``step``'s role ``role_dir`` into its HF dir (see the module doc).
    Already complete: nothing written (``skipped``). Inline HF weights, a partial export (run
    ``clean_partial`` first) or a staged config.json / side file that differs from the step's
    (the save did not write the export's config: ``write_export_config``) are ExportErrors."""
    start = time.monotonic()
    role_dir = os.path.abspath(role_dir)
    info, found = _check_step(role_dir, step)
    role = os.path.basename(role_dir)
    if found.state == "complete":
        return ExportResult(step, role, (), 0, time.monotonic() - start, peak_rss_mb(), 0, skipped=True)
    if found.state != "absent":
        what = list(found.uncovered) + ([EXPORT_RECORD] if found.record_present else []) + list(found.staged)
        raise ExportError(f"{role_dir}: the HF export of step {step} is {found.state} ({what[:6]}): "
                          + ("the step holds its HF weights itself; nothing to export." if found.state == "inline"
                             else "clean_partial() removes what an interrupted export left; then export again."))
    target = rec.staging_dir(role_dir)
    merge(role_dir, target, max_shard_size=spec.max_shard_size, dtype=spec.dtype, fp8=spec.fp8, verify=True)
    _phase("hf_export_merge")
    try:
        weights = _check_staged(target, found)
    except ExportError:
        shutil.rmtree(target)  # nothing was moved: the step is as it was
        raise
    moved = _move(target, found.hf_dir, weights)
    rec.write_record(role_dir, step, spec.dtype, found.source, found.source_file)
    shutil.rmtree(target)
    fsync_path(os.path.dirname(role_dir))
    step_bytes = sum(size for rel, (size, _) in model_record.export_source(role_dir).files.items()
                     if not rel.startswith(os.path.relpath(info.hf_dir, role_dir) + os.sep))
    nbytes = sum(os.path.getsize(os.path.join(found.hf_dir, n)) for n in moved)
    return ExportResult(step, role, tuple(moved), nbytes, time.monotonic() - start, peak_rss_mb(), step_bytes)


def _phase(name: str) -> None:
    hold_point(name)
    fault_point(name)


def _check_staged(target: str, found: rec.Survey) -> list[str]:
    """The staged weight files; every other staged file (config.json, side files; not merge's own
    record) must be in the HF dir with the same bytes, and every HF dir file the step records
    must be staged (a vision-language step's carried tensors excepted: the merge writes them into
    the shards), else an ExportError naming the files."""
    names = sorted(os.listdir(target))
    weights = [n for n in names if export_file(n) and n != EXPORT_RECORD]
    side = [n for n in names if not export_file(n)]
    differ = [n for n in side if not _same_bytes(os.path.join(target, n), os.path.join(found.hf_dir, n))]
    unstaged = sorted(n for n in found.step_files if n not in names and n != CARRIED_FILE and not export_file(n))
    if differ or unstaged:
        raise ExportError(
            f"{found.hf_dir}: the merge of the step writes {differ} differently from the step's files"
            f"{f' and does not write {unstaged}' if unstaged else ''}: the step's config.json was not written "
            "for this export (the save calls write_export_config with the same checkpoint.hf_dtype), or the "
            "files changed after the save; nothing was moved. Merge the step with mcore_to_hf.py merge instead.")
    if not weights:
        raise ExportError(f"{target}: the merge wrote no weight files; nothing was moved.")
    return weights


def _same_bytes(a: str, b: str) -> bool:
    if not os.path.isfile(b) or os.path.getsize(a) != os.path.getsize(b):
        return False
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def _move(target: str, hf_dir: str, weights: list[str]) -> list[str]:
    """Renames the weight files into ``hf_dir``: the shards, then the index (transformers reads
    none of them before the index, or a lone ``model.safetensors``, is there); fsyncs ``hf_dir``."""
    order = sorted(weights, key=lambda n: n == rec.INDEX)
    for i, name in enumerate(order):
        if os.path.lexists(os.path.join(hf_dir, name)):
            raise ExportError(f"{os.path.join(hf_dir, name)} appeared while the step was exported (another "
                              "exporter?); nothing of it was replaced: run one export per role at a time.")
        os.rename(os.path.join(target, name), os.path.join(hf_dir, name))
        if i == 0:
            _phase("hf_export_move")
    fsync_path(hf_dir)
    fsync_path(target)
    _phase("hf_export_record")
    return order
