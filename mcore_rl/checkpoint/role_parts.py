"""Steps that several engines and a trainer fill together (verl's trainers): role parts, their
records, the seal that completes a step, and per-role retention. The collective orchestration
is ``role_steps.RoleStepManager``; this module holds what a writer does on its disk and the
decisions taken from the agreed ``inventory.Survey`` (pure functions).

A step ``<root>/global_step_<N>`` is written by several parties, one after the other: each
engine writes its *role part* ``<N>/<role>/`` (a model directory: ``mcore_rl.json`` and, in its
layout, the megatron checkpoint and the HF files: under verl ``model/dist_ckpt/``,
``model/huggingface/`` and verl's ``ckpt_contents.json``) and, last, the part's record ``<N>/<role>/PART`` (every file of the part with
size and CRC-32, written atomically on every node once the node holds the whole part); then the
trainer writes its own files into ``<N>/`` and, last, its tracker
``<root>/latest_checkpointed_iteration.txt``. mcore_rl never writes that tracker here: the
trainer's tracker naming step N is what says the trainer finished N.

Sealing: a step gets its ``COMPLETE`` marker (kind ``parts``: every part's files and records and
every other file of the step, the trainer's, with size and CRC-32) once the trainer's tracker
(on any node) names it and every part is whole on every node; on node-local disks the trainer's
files are first copied to the nodes that lack them. Only sealed steps load, count for retention
and may be removed.

Retention per role (``keep``, the trainer's max_ckpt_to_keep for that role): the role's part is
kept in the ``keep`` most recently sealed steps that hold it, and always in the step the tracker
names, the step being written and the sealed step it continues from (the newest sealed step
numbered below it, e.g. the step a rolled-back run resumed); other sealed steps lose the role's
part (record first, then its files); a step left without any part is removed whole (marker
first). At rest a role thus has ``keep`` sealed copies plus the newest step, which stays
unsealed until the next save or resume seals it.
"""
from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass

from mcore_rl.checkpoint import integrity, inventory, storage, step_dirs
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.faults import fault_point, io_fault
from mcore_rl.fileio.checksum import UnknownChecksumError, file_checksum, recorded_checksum
from mcore_rl.fileio.files import META
from mcore_rl.fileio.model_layout import LAYOUTS
from mcore_rl.checkpoint.inventory import MARKER, PART, PARTS_KIND, Survey, step_name
from mcore_rl.fileio.paths import is_real_dir

PART_FORMAT = 1
# a background HF export's staging dir beside a part (``hf_export_record.staging_dir``:
# ``.<role>.hf_export``) and merge's own staging/replaced dirs of it: never a part nor a
# trainer's file, removed with the part
_EXPORT_STAGING = re.compile(r"\.(?P<a>[^/.][^/]*?)\.hf_export"
                             r"|\.\.(?P<b>[^/.][^/]*?)\.hf_export\.(staging|replaced)-[0-9a-f-]+")


def export_staging(name: str, role: str | None = None) -> bool:
    """Whether ``name`` (an entry of a step dir) is an HF export's staging leftover (of ``role``)."""
    found = _EXPORT_STAGING.fullmatch(name)
    return found is not None and role in (None, found.group("a") or found.group("b"))
# the order a trainer saves the roles of one step in (verl: the actor, then the critic): a part
# of a role saves after the parts of the roles before it, so only those may already be there
ROLE_ORDER = ("actor", "critic")


@dataclass(frozen=True)
class PartRecord:
    """A role part's record: the step, the role, when the part was complete (rank 0's wall
    clock) and every file of the part (path relative to the step dir) with size and CRC-32."""

    step: int
    role: str
    written: float
    files: dict[str, tuple[int, str]]

    def payload(self) -> dict:
        return {"format": PART_FORMAT, "step": self.step, "role": self.role, "written": self.written,
                "files": {rel: {"size": s, "checksum": c} for rel, (s, c) in sorted(self.files.items())}}


def read_part(path: str) -> PartRecord:
    """The record at ``path``; a CheckpointError naming it when it is damaged."""
    data = storage.read_json(path)
    try:
        files = {str(rel): (int(e["size"]), recorded_checksum(e)) for rel, e in data["files"].items()}
        return PartRecord(int(data["step"]), str(data["role"]), float(data["written"]), files)
    except UnknownChecksumError as e:
        raise UnknownChecksumError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a valid part record ({type(e).__name__}: {e}); the part is "
                              "damaged: resume another step.") from None


def write_part(path: str, record: PartRecord) -> None:
    storage.write_json_atomic(path, record.payload())


def node_view(step_dir: str, step: int, roles: list[str]) -> dict:
    """This node's copy of a step to seal: each part's record (its files present with their
    sizes) and its record file's digest, and every file outside the parts (the trainer's) with
    size and CRC-32. Raises when a part is not whole here or a dir holds a part without record."""
    torn = [name for name in sorted(os.listdir(step_dir))
            if name not in roles and not export_staging(name) and _looks_like_part(step_dir, name)]
    if torn:
        raise CheckpointError(f"{step_dir}: {torn} hold a role part without its {PART} record (a save that did "
                              "not finish)")
    parts = {}
    for role in roles:
        path = os.path.join(step_dir, role, PART)
        record = read_part(path)
        if (record.step, record.role) != (step, role):
            raise CheckpointError(f"{path} records step {record.step}, role {record.role!r}: it is not this part's")
        if any(rel.split("/")[0] != role for rel in record.files):
            raise CheckpointError(f"{path} lists files outside {role}/")
        integrity.check_sizes(step_dir, record.files)
        parts[role] = [record.payload(), list(file_checksum(path))]
    return {"parts": parts, "others": trainer_files(step_dir, roles)}


def _looks_like_part(step_dir: str, name: str) -> bool:
    path = os.path.join(step_dir, name)
    return is_real_dir(path) and (os.path.exists(os.path.join(path, META)) or any(
        os.path.isdir(layout.dist_dir(path)) for layout in LAYOUTS.values()))


def trainer_files(step_dir: str, roles: list[str]) -> dict[str, tuple[int, str]]:
    """Every regular file of the step outside the role parts and the marker (links, temp files
    and HF exports' staging dirs skipped), fsynced and read back for its CRC-32."""
    rels = []
    for dirpath, dirnames, names in os.walk(step_dir):
        if dirpath == step_dir:
            dirnames[:] = [d for d in dirnames if d not in roles and not export_staging(d)]
        for name in names:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, step_dir)
            if rel != MARKER and not name.endswith(storage.TMP_SUFFIX) and not os.path.islink(path):
                rels.append(rel)
    return integrity.digest_files(step_dir, sorted(rels))


def seal_files(views: list[dict], step_dir: str) -> dict[str, tuple[int, str]]:
    """The part files of a seal (every record's files and the record files themselves) from the
    writers' ``node_view``s, which must hold the same records."""
    first = views[0]["parts"]
    for view in views[1:]:
        if view["parts"] != first:
            raise CheckpointError(f"{step_dir}: the nodes hold different part records; the step cannot be "
                                  "completed: resume another step.")
    files: dict[str, tuple[int, str]] = {}
    for role, (payload, (size, crc)) in first.items():
        files.update({rel: (e["size"], recorded_checksum(e)) for rel, e in payload["files"].items()})
        files[f"{role}/{PART}"] = (size, crc)
    return files


def continues(step_dir: str, role: str, since: float) -> bool:
    """Whether this node's ``step_dir`` holds only what a save of ``role`` may continue: parts of
    the roles saved before it (``ROLE_ORDER``), whole, written since ``since`` (this run), and
    perhaps a leftover of ``role`` itself. Anything else is an earlier run's."""
    if not step_dirs.real_dir(step_dir):  # an error observing it is raised, never "not a dir"
        return False
    earlier = ROLE_ORDER[:ROLE_ORDER.index(role)] if role in ROLE_ORDER else ()
    names = {n for n in os.listdir(step_dir) if n != role and not export_staging(n)}  # an export's staging: ours
    if not names or not names <= set(earlier):
        return False
    for name in names:
        path = os.path.join(step_dir, name, PART)
        try:
            record = read_part(path)
            integrity.check_sizes(step_dir, record.files)
        except CheckpointError:
            return False
        if record.written < since:
            return False
    return True


def remove_part(step_dir: str, role: str) -> None:
    """A role part: its record first (a crash part-way leaves a part without record, never a
    record naming missing files), then its files, then what an HF export of it staged beside
    it; a link is never followed. The caller makes sure no export of the part runs."""
    path = os.path.join(step_dir, role)
    if not step_dirs.real_dir(step_dir):
        return
    if step_dirs.real_dir(path):
        record = os.path.join(path, PART)
        found = inventory.lstat(record)  # an error observing the record is raised, never "absent"
        if found is not None and not stat.S_ISDIR(found.st_mode):
            step_dirs.remove_file(record)
        shutil.rmtree(path)
    staged = [n for n in os.listdir(step_dir) if export_staging(n, role) and is_real_dir(os.path.join(step_dir, n))]
    for name in staged:
        shutil.rmtree(os.path.join(step_dir, name))
    storage.fsync_path(step_dir)


def remove(root: str, parts: list[tuple[int, str]], steps: list[int]) -> None:
    """A writer's removals: role parts ``(step, role)``, then whole steps (marker first)."""
    fault_point("retention")
    io_fault("cleanup", root)
    for step, role in parts:
        remove_part(os.path.join(root, step_name(step)), role)
    for step in steps:
        step_dirs.remove_step_dir(os.path.join(root, step_name(step)))


# ---- decisions from the agreed survey ------------------------------------------------------------
def sealed(found: Survey) -> list[int]:
    """Sealed steps of role parts, oldest completion first."""
    return [s for s in found.complete() if found.steps[s].kind == PARTS_KIND]


def has(found: Survey, step: int, role: str) -> bool:
    """A sealed step has (some of) ``role``'s part: its marker names the role and a node holds its
    dir (a removal a crash cut short leaves the files without their record: retention finishes it)."""
    st = found.steps[step]
    return role in st.roles and any(role in names for names in st.entries.values())


def seal_problems(found: Survey, step: int) -> list[str]:
    """Why the step's parts cannot be sealed (empty: they can)."""
    st = found.steps[step]
    if not st.parts:
        return ["it holds no role part with a record"]
    out = []
    for role, nodes in sorted(st.parts.items()):
        lacking = sorted(set(found.nodes) - set(nodes))
        if lacking:
            out.append(f"the {role} part has no {PART} record on node(s) {lacking}")
        elif st.part_versions.get(role, 1) > 1:
            out.append(f"the nodes hold different {role} part records")
    absent = sorted(n for n in found.nodes if n not in st.present)
    if absent:
        out.append(f"node(s) {absent} hold no copy of it")
    return out


@dataclass(frozen=True)
class Removals:
    """What one role's retention removes: parts ``(step, role)``, whole steps, crash debris."""

    parts: list[tuple[int, str]]
    steps: list[int]
    debris: list[int]


def retention(found: Survey, role: str, keep: int | None, step: int, tracked: int | None) -> Removals:
    """Before a part of ``role`` is written into ``step`` (see the module doc); a removal a crash
    cut short counts as the part it was (and is finished). Also crash debris: steps without
    marker numbered below ``step``, when the tracker is visible and names none of them."""
    done = sealed(found)
    predecessor = max((s for s in done if s < step), default=None)
    protected = {tracked, step, predecessor}
    holding = [s for s in done if has(found, s, role)]
    parts, steps = [], []
    for s in (s for s in holding[:-keep] if s not in protected) if keep else ():
        if any(has(found, s, r) for r in found.steps[s].roles if r != role):
            parts.append((s, role))
        else:
            steps.append(s)
    debris = [s for s in found.in_state("torn") if s < step and s != tracked] if tracked is not None else []
    return Removals(parts, steps, debris)
