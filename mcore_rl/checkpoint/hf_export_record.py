"""The completeness record of a background HF export, and what an export left in a role's HF dir.

A background export (``conversion/hf_export_step.export_step``) adds the HF weight files (``model*.safetensors``
and the index) to a role's HF dir (``model_layout.layout_of(role_dir).hf_dir``) and, last,
``mcore_rl_export.json``::

    {"written_by": "mcore_rl", "writer": "background export", "step": N, "role": "actor",
     "source": "<checksum of the record the step was exported from>", "source_file": "COMPLETE",
     "dtype": "bf16" | null, "files": {"config.json": [size, "xxh3_128:..."], ...}}

``files`` lists EVERY file of the HF dir (the step's recorded ones too); ``source`` is the
checksum of the role's ``PART`` record when it has one, else of the step's ``COMPLETE`` marker
(``model_record.export_source``). The export counts as present only when the record parses,
names this step, role and source, and every listed file is there with its size (and checksum,
when verified), and no weight file in the HF dir is left uncovered. Weight files neither the
step nor a valid record covers, an invalid record, or the staging directory beside the role dir
are a partial export: ``clean_partial`` removes them (never a file the step records). No megatron
import.
"""
from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from typing import Literal

from mcore_rl.checkpoint import model_record, storage
from mcore_rl.checkpoint.inventory import parse_step_name
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.checksum import UnknownChecksumError, file_checksum
from mcore_rl.fileio.files import fsync_path
from mcore_rl.fileio.model_layout import layout_of
from mcore_rl.fileio.output_dir import EXPORT_RECORD
from mcore_rl.fileio.output_dir import is_export_file as export_file
from mcore_rl.fileio.staging import settle

WRITER = "background export"
INDEX = "model.safetensors.index.json"
State = Literal["complete", "partial", "absent", "inline"]


def hf_dir_of(role_dir: str) -> str:
    """The role's HF dir in its layout (``huggingface/`` or ``model/huggingface/``)."""
    return layout_of(role_dir).hf_dir(role_dir)


def staging_dir(role_dir: str) -> str:
    """Where the export stages the merge: ``<step dir>/.<role>.hf_export`` (beside the role dir,
    on its filesystem, so the weight files move into the HF dir by rename)."""
    role_dir = os.path.abspath(role_dir)
    return os.path.join(os.path.dirname(role_dir), f".{os.path.basename(role_dir)}.hf_export")


@dataclass(frozen=True)
class Survey:
    """What a role's HF dir holds: the step's record of it, the export record (valid or not)
    and the weight files neither covers."""

    hf_dir: str
    step_files: frozenset[str]  # names in the HF dir the step's marker/PART records
    source: str  # the checksum of the record the step is vouched for by
    source_file: str  # that record's path relative to the step dir
    record: dict | None  # the export record when it is valid for this step (see ``survey``)
    record_present: bool
    uncovered: tuple[str, ...]  # weight files covered by neither
    staged: tuple[str, ...]  # staging leftovers beside the role dir (names in the step dir)

    @property
    def state(self) -> State:
        if any(export_file(n) and n != EXPORT_RECORD for n in self.step_files):
            return "inline"
        if self.record is not None and not self.uncovered:
            return "complete"
        return "partial" if self.uncovered or self.record_present or self.staged else "absent"


def survey(role_dir: str, verify: bool = False) -> Survey:
    """Surveys ``role_dir``'s HF dir against the step's record (``model_record.export_source``;
    a role dir no record vouches for is a CheckpointError naming it) and the export record
    (``verify``: every listed file's checksum too)."""
    role_dir = os.path.abspath(role_dir)
    layout = layout_of(role_dir)
    hf_dir = layout.hf_dir(role_dir)
    step = model_record.export_source(role_dir)
    prefix = layout.hf + "/"
    step_files = frozenset(rel[len(prefix):] for rel in step.files if rel.startswith(prefix))
    source = file_checksum(step.source)[1]
    source_file = os.path.relpath(step.source, os.path.dirname(role_dir))
    names = sorted(os.listdir(hf_dir)) if os.path.isdir(hf_dir) else []
    present = EXPORT_RECORD in names
    record = _valid_record(role_dir, hf_dir, source, verify) if present else None
    covered = step_files | set(record["files"] if record else ())
    uncovered = tuple(n for n in names if export_file(n) and n != EXPORT_RECORD and n not in covered)
    return Survey(hf_dir, step_files, source, source_file, record, present, uncovered, _staged(role_dir))


def _valid_record(role_dir: str, hf_dir: str, source: str, verify: bool) -> dict | None:
    """The export record when it parses, names this step, role and source, and every file it
    lists is in the HF dir with its size (``verify``: and checksum); else None."""
    try:
        record = storage.read_json(os.path.join(hf_dir, EXPORT_RECORD))
    except CheckpointError:
        return None
    step = parse_step_name(os.path.basename(os.path.dirname(role_dir)))
    files = record.get("files")
    if (record.get("written_by") != "mcore_rl" or record.get("writer") != WRITER or record.get("source") != source
            or record.get("step") != step or record.get("role") != os.path.basename(role_dir)
            or not isinstance(files, dict) or not files):
        return None
    for name, entry in files.items():
        if not _file_matches(hf_dir, name, entry, verify):
            return None
    return record


def _file_matches(hf_dir: str, name: str, entry: object, verify: bool) -> bool:
    if (not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], int)
            or not isinstance(entry[1], str) or os.sep in name or name in ("", ".", "..", EXPORT_RECORD)):
        return False
    path = os.path.join(hf_dir, name)
    try:
        st = os.lstat(path)
        if not os.path.isfile(path) or os.path.islink(path) or st.st_size != entry[0]:
            return False
        return not verify or file_checksum(path, like=entry[1]) == (entry[0], entry[1])
    except UnknownChecksumError:
        return False
    except OSError:
        return False


def _staged(role_dir: str) -> tuple[str, ...]:
    """Names in the step dir of the export's staging directory and the merge's own staging
    leftovers beside it."""
    target = staging_dir(role_dir)
    parent, name = os.path.split(target)
    return tuple(sorted(n for n in os.listdir(parent) if n == name or n.startswith(f".{name}.")))


def export_state(role_dir: str, verify: bool = False) -> State:
    """``complete``: a valid export record covers every weight file in the HF dir; ``inline``: the
    step itself records HF weights (saved before background exports); ``partial``: weight files
    or a record no valid record covers, or staging leftovers; ``absent``: none of it.
    ``verify``: a complete export's files are checksummed too (a damaged one is ``partial``)."""
    return survey(role_dir, verify).state


def write_record(role_dir: str, step: int, dtype: str | None, source: str, source_file: str) -> dict:
    """Writes the export record (atomically, fsynced) listing every file now in the HF dir with
    size and XXH3-128; returns it. Call it last, once every weight file is in place and durable."""
    hf_dir = hf_dir_of(role_dir)
    files = {}
    for name in sorted(os.listdir(hf_dir)):
        path = os.path.join(hf_dir, name)
        if name != EXPORT_RECORD and os.path.isfile(path):
            files[name] = list(file_checksum(path))
    record = {"written_by": "mcore_rl", "writer": WRITER, "step": step, "role": os.path.basename(role_dir),
              "source": source, "source_file": source_file, "dtype": dtype, "files": files}
    storage.write_json_atomic(os.path.join(hf_dir, EXPORT_RECORD), record)
    return record


def clean_partial(role_dir: str, verify: bool = False) -> list[str]:
    """Removes what a partial export left: an export record that is not valid (first), the
    weight files neither the step nor a valid record covers (the index before the shards, so
    transformers never takes a half-removed set), then the staging leftovers beside the role dir
    (a merge's staging dir whose owner is alive is kept, with a warning). Never a file the
    step's marker/PART records. Returns what was removed, relative to the step dir. The caller
    makes sure no export of this role runs meanwhile."""
    role_dir = os.path.abspath(role_dir)
    found = survey(role_dir, verify)
    step_dir = os.path.dirname(role_dir)
    doomed = []
    if found.record_present and found.record is None and EXPORT_RECORD not in found.step_files:
        doomed.append(EXPORT_RECORD)
    weights = [n for n in found.uncovered if n not in found.step_files]
    doomed += sorted(weights, key=lambda n: n != INDEX)
    removed = []
    for name in doomed:
        os.remove(os.path.join(found.hf_dir, name))
        removed.append(os.path.relpath(os.path.join(found.hf_dir, name), step_dir))
    if doomed:
        fsync_path(found.hf_dir)
    if found.staged:
        target = staging_dir(role_dir)
        settle(target)  # a merge killed mid-commit: its leftovers beside the target
        if os.path.isdir(target):
            shutil.rmtree(target)
        removed += [n for n in found.staged if not os.path.exists(os.path.join(step_dir, n))]
        fsync_path(step_dir)
    return removed
