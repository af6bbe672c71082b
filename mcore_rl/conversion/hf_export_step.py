"""A step's HF weights exported in the background, from the saved step, by the merge path
(the exporter process: ``python -m mcore_rl.conversion.hf_export_worker``).

``export_step`` merges the complete step into a staging dir beside the role dir on the same
filesystem (``merge``), checks that the staged config.json and side files are the step's bytes
(the save wrote config.json with ``checkpoint/hf_export.write_export_config``), moves the weight
files into the role's HF dir (shards first, the index last), fsyncs, writes the export's record
atomically (``checkpoint/hf_export_record``) and removes the staging dir. A kill at any point
leaves the export partial or absent (``export_state``), never complete with a file missing;
transformers finds no weights before the index (or a single ``model.safetensors``) is in place.
No megatron import.
"""
from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

from mcore_rl.checkpoint import hf_export_record as rec
from mcore_rl.checkpoint import model_record
from mcore_rl.checkpoint.export_config import ModelInfo, model_info
from mcore_rl.checkpoint.hf_export import ExportError, ExportSpec, check_role_dir, refuse_adapter_only
from mcore_rl.conversion.merge import merge
from mcore_rl.fileio.faults import fault_point, hold_point
from mcore_rl.fileio.files import fsync_path, peak_rss_mb
from mcore_rl.fileio.output_dir import EXPORT_RECORD, is_export_file
from mcore_rl.models.hf_layout import CARRIED_FILE


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


def _check_step(role_dir: str, step: int) -> tuple[ModelInfo, rec.Survey]:
    check_role_dir(role_dir, step)
    info = model_info(role_dir)
    refuse_adapter_only(info)
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
    _same_source(role_dir, found, target)
    moved = _move(target, found.hf_dir, weights)
    rec.write_record(role_dir, step, spec.dtype, found.source, found.source_file)
    shutil.rmtree(target)
    fsync_path(os.path.dirname(role_dir))
    step_bytes = sum(size for rel, (size, _) in model_record.export_source(role_dir).files.items()
                     if not rel.startswith(os.path.relpath(info.hf_dir, role_dir) + os.sep))
    nbytes = sum(os.path.getsize(os.path.join(found.hf_dir, n)) for n in moved)
    return ExportResult(step, role, tuple(moved), nbytes, time.monotonic() - start, peak_rss_mb(), step_bytes)


def _same_source(role_dir: str, found: rec.Survey, target: str) -> None:
    """The step is still the one the export started from (its marker / PART unchanged): a save
    that replaced the step meanwhile gets no weights of the old one (the staging dir is removed)."""
    now = rec.survey(role_dir)
    if now.source != found.source or now.uncovered or now.record_present:  # (its staging dir is there)
        shutil.rmtree(target)
        raise ExportError(f"{role_dir} changed while it was exported (its {found.source_file} or HF dir is not the one "
                          "the export started from: a save replaced the step, or another exporter ran); nothing was "
                          "moved: export the step again.")


def _phase(name: str) -> None:
    hold_point(name)
    fault_point(name)


def _check_staged(target: str, found: rec.Survey) -> list[str]:
    """The staged weight files; every other staged file (config.json, side files; not merge's own
    record) must be in the HF dir with the same bytes, and every HF dir file the step records
    must be staged (a vision-language step's carried tensors excepted: the merge writes them into
    the shards), else an ExportError naming the files."""
    names = sorted(os.listdir(target))
    weights = [n for n in names if is_export_file(n) and n != EXPORT_RECORD]
    side = [n for n in names if not is_export_file(n)]
    differ = [n for n in side if not _same_bytes(os.path.join(target, n), os.path.join(found.hf_dir, n))]
    unstaged = sorted(n for n in found.step_files if n not in names and n != CARRIED_FILE and not is_export_file(n))
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
