"""Which record vouches for a model directory's bytes, and the check that its files are them.

A model directory (``dist_ckpt/``, ``huggingface/``, ``mcore_rl.json``) is vouched for by:

* a checkpoint manager's step ``global_step_<N>/<role>``: the step's ``COMPLETE`` marker (its
  ``step`` must be ``N``, its roles must hold ``<role>``), the same record a resume checks;
* a role part of a step not sealed yet (verl's newest step): the part's ``<role>/PART`` record;
* a converter output: its ``RECORD`` (``write_record``: every file with size and CRC-32, the
  marker's file list shape), written last before the output is renamed into place.

A directory without any of them (a torn step, a copy taken out of its step, an output of an old
converter) is refused: nothing says its files are complete. Readers verify every recorded file's
size and CRC-32 before they read any, and every file they read must be recorded. No megatron
import (the merge runs without it).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from mcore_rl.checkpoint import storage
from mcore_rl.checkpoint.inventory import MARKER, PART, PARTS_KIND, parse_step_name, read_marker
from mcore_rl.checkpoint.role_parts import read_part
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.faults import io_fault
from mcore_rl.fileio.checksum import UnknownChecksumError, file_checksum, recorded_checksum
from mcore_rl.fileio.paths import contained

RECORD = "RECORD"  # a converter output's record: <model dir>/RECORD
RECORD_FORMAT = 1
SKIP_HINT = "or pass --skip_verify (verify=False) to read it unverified, at your own risk"

Files = dict[str, tuple[int, "str | None"]]  # path relative to the model dir -> (size, CRC-32 hex)


@dataclass(frozen=True)
class DirRecord:
    """The record that vouches for ``path``: where it is (``source``) and every file it lists,
    relative to ``path``, with size and CRC-32."""

    path: str
    source: str
    files: Files


def exists(path: str) -> bool:
    """Whether ``path`` exists; an error other than "not found" (EIO, ESTALE, EACCES) is a
    CheckpointError naming it, never "absent"."""
    try:
        io_fault("stat", path)
        os.stat(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise CheckpointError(f"cannot check {path} ({e.strerror or e}); the disk or the mount failed: "
                              "retry when it is readable.") from None
    return True


def write_record(model_dir: str, role: str) -> DirRecord:
    """Writes ``model_dir/RECORD``: every file under ``model_dir`` (read back once) with size and
    CRC-32. Call it when every file is written and durable, before the directory is published."""
    files: Files = {}
    for base, dirs, names in os.walk(model_dir):
        dirs.sort()
        for name in sorted(names):
            rel = os.path.relpath(os.path.join(base, name), model_dir)
            if rel != RECORD:
                files[rel] = file_checksum(os.path.join(base, name))
    payload = {"format": RECORD_FORMAT, "role": role,
               "files": {rel: {"size": s, "checksum": c} for rel, (s, c) in sorted(files.items())}}
    storage.write_json_atomic(os.path.join(model_dir, RECORD), payload)
    return DirRecord(model_dir, os.path.join(model_dir, RECORD), files)


def _read_record(path: str, model_dir: str) -> DirRecord:
    data = _guarded(storage.read_json, path)
    try:
        files = {str(rel): (int(e["size"]), recorded_checksum(e)) for rel, e in data["files"].items()}
    except UnknownChecksumError as e:
        raise UnknownChecksumError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a valid model directory record ({type(e).__name__}: {e}); "
                              f"the directory is damaged: convert the model again, {SKIP_HINT}.") from None
    return DirRecord(model_dir, path, files)


def _guarded(read: Callable, path: str):
    """``read(path)`` with an OS error (a directory, EIO) as a CheckpointError naming the file."""
    try:
        return read(path)
    except OSError as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}: {e}); the step is damaged: use "
                              f"another copy, {SKIP_HINT}.") from None


def find_record(model_dir: str) -> DirRecord:
    """The record vouching for ``model_dir`` (see the module doc); a CheckpointError naming the
    directory when none does, or when the step's marker is not this step's or role's."""
    model_dir = os.path.abspath(model_dir)
    if exists(os.path.join(model_dir, RECORD)):
        return _read_record(os.path.join(model_dir, RECORD), model_dir)
    step_dir, role = os.path.split(model_dir)
    step = parse_step_name(os.path.basename(step_dir))
    if step is None:
        raise CheckpointError(
            f"{model_dir} has no {RECORD} (a converter output's list of its files with checksums) and is "
            f"not a role of a checkpoint step (global_step_<N>/<role> with a {MARKER} marker): nothing says its "
            f"files are complete. Convert the model again with converters/hf_to_mcore.py, {SKIP_HINT}.")
    if exists(os.path.join(step_dir, MARKER)):
        return _from_marker(step_dir, step, role, model_dir)
    if exists(os.path.join(model_dir, PART)):
        return _from_part(os.path.join(model_dir, PART), step, role, model_dir)
    raise CheckpointError(
        f"{step_dir} is not a complete checkpoint: it has no {MARKER} marker (and {role}/ no {PART} "
        f"record): the save was interrupted or the copy is torn. Use a complete step, {SKIP_HINT}.")


def export_source(model_dir: str) -> DirRecord:
    """The record a background HF export of ``model_dir`` is taken from and names as its source:
    the role's ``PART`` record when the role has one (a role part stays its own record after the
    step is sealed), else ``find_record``'s."""
    model_dir = os.path.abspath(model_dir)
    part = os.path.join(model_dir, PART)
    step = parse_step_name(os.path.basename(os.path.dirname(model_dir)))
    if step is not None and exists(part):
        return _from_part(part, step, os.path.basename(model_dir), model_dir)
    return find_record(model_dir)


def _from_marker(step_dir: str, step: int, role: str, model_dir: str) -> DirRecord:
    path = os.path.join(step_dir, MARKER)
    marker = _guarded(read_marker, path)
    if marker.step != step:
        raise CheckpointError(f"{path} is the marker of step {marker.step}, not of step {step} (the directory's "
                              f"name): the step was copied or renamed; put it back under global_step_{marker.step}.")
    if role not in marker.roles:
        raise CheckpointError(f"{path} records roles {list(marker.roles)}, not {role!r}: {model_dir} is not a "
                              f"complete part of the step; use one of its roles.")
    if marker.kind == PARTS_KIND and not exists(os.path.join(model_dir, PART)):
        raise CheckpointError(f"{model_dir}: the {role} part was removed by retention (its {PART} record is "
                              "gone); use a step that still holds it.")
    prefix = role + "/"
    files = {rel[len(prefix):]: v for rel, v in marker.files.items() if rel.startswith(prefix)}
    return DirRecord(model_dir, path, files)


def _from_part(path: str, step: int, role: str, model_dir: str) -> DirRecord:
    part = _guarded(read_part, path)
    if part.step != step or part.role != role:
        raise CheckpointError(f"{path} records the {part.role} part of step {part.step}, not the {role} part of "
                              f"step {step}: the part was copied or renamed; put it back where it was written.")
    prefix = role + "/"
    return DirRecord(model_dir, path, {rel[len(prefix):]: v for rel, v in part.files.items() if rel.startswith(prefix)})


def verify(record: DirRecord, needed: list[str], crc_of: Callable[[str, str | None], tuple[int, str]] | None = None) -> None:
    """Every recorded file has its recorded size and checksum (read once; ``crc_of(rel, recorded)``
    may read it through a handle the caller holds), and every file of ``needed`` (those the reader will
    read) is recorded; one CheckpointError lists every file that is not."""
    bad = [f"{rel} is not in the record" for rel in sorted(set(needed) - set(record.files))]
    for rel, (size, crc) in sorted(record.files.items()):
        path = contained(record.path, rel, record.source)
        try:
            io_fault("open", path)
            got_size, got = crc_of(rel, crc) if crc_of is not None else file_checksum(path, like=crc)
        except FileNotFoundError:
            bad.append(f"{rel} is missing")
            continue
        except OSError as e:
            bad.append(f"{rel} is unreadable ({e.strerror or e})")
            continue
        if got_size != size:
            bad.append(f"{rel} has {got_size} bytes, the record says {size}")
        elif crc is not None and got != crc:
            bad.append(f"{rel} has checksum {got}, the record says {crc}")
    if bad:
        raise CheckpointError(f"{record.path} is damaged (checked against {record.source}): {'; '.join(bad[:8])}"
                              f"{f' (+{len(bad) - 8} more)' if len(bad) > 8 else ''}; restore the files or use "
                              f"another copy, {SKIP_HINT}.")


def listed(directory: str, base: str) -> list[str]:
    """Every file under ``directory``, relative to ``base`` (what a reader will read there)."""
    out = []
    for root, dirs, names in os.walk(directory):
        dirs.sort()
        out += [os.path.relpath(os.path.join(root, n), base) for n in sorted(names)]
    return out


__all__ = ["DirRecord", "RECORD", "SKIP_HINT", "exists", "export_source", "find_record", "listed", "verify",
           "write_record"]
