"""What a checkpoint root holds, surveyed once from every node and agreed by all ranks.

Every decision that depends on the disk — the step to resume, whether a step is complete, what
retention deletes — is taken from one ``Survey``: each node's leader scans its view of the root
(on node-local disks every node has its own), the scans are exchanged over torch.distributed,
and every rank merges them the same way. A step is complete only when its marker is valid on
every node. On a shared root all scans agree.

Completion order: each marker records ``completed``, a sequence number one above every number
already on disk, so a rollback's new steps rank after the abandoned branch whatever their step
numbers. Markers written before it was recorded rank by step number, below all recorded ones.
The tracker (``latest_checkpointed_iteration.txt``) is authoritative for ``auto`` resume, as in
Megatron-LM and verl.
"""
from __future__ import annotations

import errno
import json
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Any

from mcore_rl.checkpoint import storage
from mcore_rl.checkpoint.collective import all_gather_bytes, distributed
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.faults import io_fault
from mcore_rl.fileio.checksum import UnknownChecksumError, checksum, recorded_checksum

MARKER = "COMPLETE"
TRACKER = "latest_checkpointed_iteration.txt"
TRAINER_STATE = "trainer_state.json"
PART = "PART"  # a role part's record (role_parts.py): <step>/<role>/PART
PARTS_KIND = "parts"  # a marker that seals a step of role parts (role_parts.py)
MARKER_FORMAT = 3  # 1: files with sizes; 2: + CRC-32 per file and the completion order; 3: XXH3-128
_STEP_DIR = re.compile(r"^global_step_(\d{1,18})$")
_SIDE_DIR = re.compile(r"^\.global_step_(\d{1,18})\.(incoming|outgoing)$")
_TRACKER_TEXT = re.compile(rb"^[0-9]{1,18}$")  # ASCII digits only; at most 18 fit in int64


def step_name(step: int) -> str:
    return f"global_step_{step}"


def parse_step_name(name: str) -> int | None:
    """N for a ``global_step_<N>`` name, else None."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def incoming_name(step: int) -> str:
    """A replacement of a complete step, written beside it and swapped in after its marker."""
    return f".global_step_{step}.incoming"


def outgoing_name(step: int) -> str:
    """The replaced step during the swap (restored if the swap was cut short)."""
    return f".global_step_{step}.outgoing"


def side_dir(name: str) -> tuple[int, str] | None:
    """(step, ``incoming`` | ``outgoing``) for a replacement's side dir name, else None."""
    m = _SIDE_DIR.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


# ---- markers -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Marker:
    """A step's completion marker: its roles, completion order and every file it holds with the
    size and checksum recorded when it was written (format 1: sizes only; 2: CRC-32; 3: XXH3-128). ``kind``: None for a step
    one manager wrote whole; ``"parts"`` for a step of role parts sealed later (role_parts.py)."""

    step: int
    roles: tuple[str, ...]
    order: int | None
    files: dict[str, tuple[int, str | None]]
    kind: str | None = None

    def payload(self) -> dict[str, Any]:
        out = {"format": MARKER_FORMAT, "step": self.step, "roles": list(self.roles), "completed": self.order,
               "files": {rel: {"size": size, "checksum": crc} for rel, (size, crc) in sorted(self.files.items())}}
        if self.kind is not None:
            out["kind"] = self.kind
        return out


def read_marker(path: str) -> Marker:
    """The marker at ``path``; a CheckpointError naming the file when it is damaged."""
    return _marker_from(storage.read_json(path), path)


def parse_marker(raw: bytes, path: str) -> Marker:
    """The marker in ``raw`` (the bytes of ``path``); a CheckpointError naming the file when damaged."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the step is damaged: resume another "
                              "complete step.") from None
    return _marker_from(data, path)


def _marker_from(data: Any, path: str) -> Marker:
    try:
        files = {}
        for rel, entry in data["files"].items():
            if isinstance(entry, int):  # format 1: the size only
                files[str(rel)] = (entry, None)
            else:
                files[str(rel)] = (int(entry["size"]), recorded_checksum(entry))
        order = data.get("completed")
        if order is not None and (not isinstance(order, int) or isinstance(order, bool) or order < 0):
            raise ValueError(f"completed={order!r}")
        kind = data.get("kind")
        if kind not in (None, PARTS_KIND):
            raise ValueError(f"kind={kind!r}")
        return Marker(int(data["step"]), tuple(str(r) for r in data["roles"]), order, files, kind)
    except UnknownChecksumError as e:
        raise UnknownChecksumError(f"{path}: {e}") from None
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{path} is not a valid completion marker ({type(e).__name__}: {e}); "
                              "the step is damaged: resume another complete step.") from None


def parse_tracker(raw: bytes, where: str) -> int:
    """The step number in a tracker's bytes: ASCII digits (surrounding whitespace allowed)."""
    text = raw.strip(b" \t\r\n")
    if not _TRACKER_TEXT.fullmatch(text):
        shown = raw[:60].decode("utf-8", errors="backslashreplace")
        raise CheckpointError(
            f"{where} holds {shown!r}, not a step number (ASCII digits, at most 18); it was not "
            "written by a checkpoint save: remove it, or write the step to resume into it.")
    return int(text)


# ---- one node's scan ---------------------------------------------------------------------------
# Every stat, open and listing of a scan goes through these three: "absent" is only ENOENT (or
# ENOTDIR); any other error (EIO, ESTALE, EACCES, ...) is a refusal, never "no marker", so no
# decision that deletes is ever taken from a failed observation.
def _refusal(path: str, e: OSError, what: str) -> CheckpointError:
    code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno else type(e).__name__
    return CheckpointError(f"cannot {what} {path} ({code}: {e.strerror or e}) while surveying the checkpoint "
                           "root; nothing was decided or deleted from it: retry once the storage is healthy.")


def lstat(path: str, follow: bool = False) -> os.stat_result | None:
    """``os.lstat(path)`` (``follow``: ``os.stat``), None when absent (ENOENT/ENOTDIR); any other
    error is a CheckpointError."""
    try:
        io_fault("stat", path)
        return os.stat(path) if follow else os.lstat(path)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return None
        raise _refusal(path, e, "stat") from None


def _read(path: str, limit: int | None = None, follow: bool = False) -> bytes:
    """The bytes of a file the scan saw (up to ``limit``); every error is a refusal."""
    try:
        io_fault("open", path)
        fd = os.open(path, os.O_RDONLY | (0 if follow else getattr(os, "O_NOFOLLOW", 0)))
        with os.fdopen(fd, "rb") as f:
            return f.read() if limit is None else f.read(limit)
    except OSError as e:
        raise _refusal(path, e, "read") from None


def _listdir(path: str) -> list[str]:
    try:
        io_fault("open", path)
        return sorted(os.listdir(path))
    except OSError as e:
        raise _refusal(path, e, "list") from None


def marker_crc(path: str) -> str | None:
    """The CRC-32 of the valid marker at ``path`` (a step dir's ``COMPLETE``), None when there is
    none or it is damaged; an error observing it is a CheckpointError (recovery re-checks with it)."""
    state = _marker_state(path, None)
    return state["crc"] if state["marker"] == "ok" else None


def scan_root(root: str) -> dict[str, Any]:
    """This node's view of ``root`` as JSON-able data: step dirs with their marker state and
    order, symlinked step entries, side dirs of replacements (with their marker state) and links
    at side dir names, the tracker's bytes (hex). Raises CheckpointError when anything cannot be
    observed (``survey`` agrees it on every rank)."""
    out: dict[str, Any] = {"steps": {}, "links": [], "side": {}, "side_links": [], "tracker": None}
    top = lstat(root, follow=True)  # the root itself may be a link (a mount elsewhere)
    if top is None or not stat.S_ISDIR(top.st_mode):
        return out
    for name in _listdir(root):
        m, side = _STEP_DIR.match(name), _SIDE_DIR.match(name)
        if not (m or side or name == TRACKER):
            continue
        path = os.path.join(root, name)
        st = lstat(path)
        if st is None:
            continue  # removed since the listing: nothing to decide about it
        if name == TRACKER:  # read through a link as before; the writer replaces it atomically
            out["tracker"] = _read(path, 4096, follow=True).hex() if not stat.S_ISDIR(st.st_mode) else None
        elif stat.S_ISLNK(st.st_mode):
            (out["links"] if m else out["side_links"]).append(int(m.group(1)) if m else name)
        elif m and stat.S_ISDIR(st.st_mode):
            step = int(m.group(1))
            out["steps"][m.group(1)] = {**_marker_state(os.path.join(path, MARKER), step), **_contents(path)}
        elif side and stat.S_ISDIR(st.st_mode):
            out["side"][name] = _marker_state(os.path.join(path, MARKER), int(side.group(1)))
    return out


def _marker_state(path: str, step: int | None) -> dict[str, Any]:
    """``none`` (positively absent), ``bad`` (damaged, a link, or naming another step than its
    directory's ``step``; ``why`` says which) or ``ok`` with its order, CRC-32, roles, kind."""
    st = lstat(path)
    if st is None:
        return {"marker": "none", "order": None, "crc": None}
    if not stat.S_ISREG(st.st_mode):
        return {"marker": "bad", "order": None, "crc": None, "why": f"{MARKER} is not a regular file"}
    raw = _read(path)
    try:
        marker = parse_marker(raw, path)
    except UnknownChecksumError:
        raise  # written by another version: not "damaged" (never skipped, never cleaned up)
    except CheckpointError as e:
        return {"marker": "bad", "order": None, "crc": None, "why": str(e)}
    if step is not None and marker.step != step:
        return {"marker": "bad", "order": None, "crc": None,
                "why": f"its {MARKER} marker records step {marker.step}, not {step} (a copied or renamed step)"}
    return {"marker": "ok", "order": marker.order, "crc": checksum(raw),  # nodes may hold other versions
            "roles": list(marker.roles), "kind": marker.kind}


def _contents(step_dir: str) -> dict[str, Any]:
    """A step dir's entries (names) and its role parts' records: role -> CRC-32 of ``<role>/PART``."""
    entries = _listdir(step_dir)
    parts = {}
    for name in entries:
        sub = lstat(os.path.join(step_dir, name))
        if sub is None or not stat.S_ISDIR(sub.st_mode):
            continue
        record = os.path.join(step_dir, name, PART)
        rec = lstat(record)
        if rec is not None and stat.S_ISREG(rec.st_mode):
            parts[name] = checksum(_read(record))
    return {"entries": entries, "parts": parts}


# ---- the agreed survey -------------------------------------------------------------------------
@dataclass(frozen=True)
class StepState:
    """One step across nodes: which nodes hold its dir, which a valid marker, its order."""

    step: int
    present: tuple[int, ...]
    marked: tuple[int, ...]
    damaged: tuple[int, ...]
    order: int | None
    versions: int = 1  # distinct markers among the nodes (2: a replacement cut between nodes)
    roles: tuple[str, ...] = ()  # the roles a valid marker names
    kind: str | None = None  # the marker's kind (``"parts"``: a sealed step of role parts)
    parts: dict[str, tuple[int, ...]] = field(default_factory=dict)  # role -> nodes holding its PART record
    part_versions: dict[str, int] = field(default_factory=dict)  # role -> distinct PART records among nodes
    entries: dict[int, tuple[str, ...]] = field(default_factory=dict)  # node -> names in the step dir
    crcs: dict[int, str | None] = field(default_factory=dict)  # node -> CRC-32 of its valid marker (None: none)
    why: str | None = None  # why a damaged marker is damaged (the first node's reason)

    def state(self, nodes: tuple[int, ...]) -> str:
        """``complete`` (the same valid marker on every node), ``torn`` (no marker anywhere) or
        ``partial`` (a marker on some nodes only, a damaged one, or different ones)."""
        if set(self.marked) == set(nodes) and not self.damaged and self.versions == 1:
            return "complete"
        return "torn" if not self.marked and not self.damaged else "partial"


@dataclass(frozen=True)
class Survey:
    """The agreed view of a root (the same on every rank)."""

    root: str
    nodes: tuple[int, ...]
    steps: dict[int, StepState]
    trackers: dict[int, bytes | None]
    links: tuple[int, ...] = ()
    side: dict[str, dict[int, str | None]] = field(default_factory=dict)  # side dir -> node -> its valid marker's CRC
    side_links: tuple[str, ...] = ()  # side dir names that are links (on some node): never used or removed

    def in_state(self, state: str) -> list[int]:
        return sorted(s for s, st in self.steps.items() if st.state(self.nodes) == state)

    def rank_key(self, step: int) -> tuple[int, int]:
        """Completion order: recorded orders after all unrecorded ones (those by step number)."""
        order = self.steps[step].order
        return (0, step) if order is None else (1, order)

    def complete(self) -> list[int]:
        """Complete steps, oldest completion first."""
        return sorted(self.in_state("complete"), key=self.rank_key)

    def next_order(self) -> int:
        """The completion order of the next marker: above every order on disk."""
        orders = [st.order for st in self.steps.values() if st.order is not None]
        return max(orders, default=0) + 1

    def tracked(self, notes: list[str] | None = None) -> int | None:
        """The step the trackers name (garbage is an error). Nodes that disagree (a save cut
        between two nodes' trackers): the named complete step completed last."""
        named: dict[int, list[int]] = {}
        for node, raw in sorted(self.trackers.items()):
            if raw is not None:
                where = os.path.join(self.root, TRACKER) + (f" (node {node})" if len(self.nodes) > 1 else "")
                try:
                    named.setdefault(parse_tracker(raw, where), []).append(node)
                except CheckpointError as e:
                    raise CheckpointError(f"{e} {self.choices()}") from None
        if len(named) <= 1:
            return next(iter(named), None)
        done = [s for s in named if s in self.in_state("complete")]
        choice = max(done, key=self.rank_key) if done else max(named)
        if notes is not None:
            notes.append(f"the nodes' trackers name different steps (step: nodes) {named}; using step "
                         f"{choice}, the one completed last")
        return choice

    def resume_step(self) -> tuple[int | None, list[str]]:
        """``auto``: the tracked step when complete; else the step completed last, with a note
        naming both; None when nothing was ever completed. Returns (step, notes to log)."""
        notes = [f"{os.path.join(self.root, step_name(s))} is a symlink: auto resume and retention skip "
                 "linked steps (resume it with resume_mode=path)" for s in self.links]
        notes += [f"skipping incomplete checkpoint {os.path.join(self.root, step_name(s))} ({self._why_incomplete(s)})"
                  for s in self.in_state("torn") + self.in_state("partial")]
        tracked, complete = self.tracked(notes), self.complete()
        if tracked is not None and tracked in complete:
            later = [s for s in complete if self.rank_key(s) > self.rank_key(tracked)]
            if later:
                notes.append(f"steps {later} completed after the tracked step {tracked}, but the tracker "
                             f"names {tracked} (the tracker is authoritative); resume one of them with "
                             "checkpoint.resume_mode=path")
            return tracked, notes
        if not complete:
            if tracked is not None:
                raise CheckpointError(
                    f"{os.path.join(self.root, TRACKER)} names step {tracked}, but there is no complete "
                    f"checkpoint under {self.root}; restore the checkpoints, or start fresh with "
                    "checkpoint.resume_mode=disable (or another checkpoint.root).")
            return None, notes
        chosen = complete[-1]
        if tracked is not None:
            state = self.steps[tracked].state(self.nodes) if tracked in self.steps else "missing"
            notes.append(f"the tracker names step {tracked}, which is {state}; resuming step {chosen}, the "
                         "step completed last")
        return chosen, notes

    def retention(self, newest: int, keep: int | None) -> tuple[list[int], list[int], list[int]]:
        """After ``newest`` was saved: (complete steps beyond ``keep`` by completion order, never
        ``newest``; torn steps numbered below ``newest``, crash debris; complete steps numbered
        above ``newest``, an abandoned branch, which retention ranks by completion like any)."""
        complete = self.complete()
        old = [s for s in complete[:-keep] if s != newest] if keep is not None and len(complete) > keep else []
        debris = [s for s in self.in_state("torn") if s < newest]
        return old, debris, [s for s in complete if s > newest]

    def choices(self) -> str:
        """The complete steps and how to pick one (for error messages)."""
        steps = sorted(self.in_state("complete"))
        if not steps:
            return f"There is no complete checkpoint under {self.root}."
        return (f"Complete steps under {self.root}: {steps}; pick one with checkpoint.resume_mode=path "
                f"checkpoint.resume_path={os.path.join(self.root, step_name(steps[-1]))}")

    def _why_incomplete(self, step: int) -> str:
        st = self.steps[step]
        if st.damaged:
            return f"damaged {MARKER} marker on node(s) {list(st.damaged)}" + (f": {st.why}" if st.why else "")
        if st.versions > 1:
            return f"the nodes hold {st.versions} different versions of it"
        if st.marked:
            return f"{MARKER} marker only on node(s) {list(st.marked)} of {list(self.nodes)}"
        return f"no {MARKER} marker"


def survey(root: str) -> Survey:
    """Collective: every node leader scans ``root``; every rank merges the scans alike. A scan
    that fails on any node (an error observing a file: never taken as "absent") is one
    CheckpointError on every rank, raised at once (nobody is left waiting in a collective)."""
    if not distributed():
        return merge_scans(root, {0: scan_root(root)})
    leaders = storage.node_leaders()
    mine = b""
    if storage.node_leader():
        try:
            mine = json.dumps(scan_root(root)).encode()
        except Exception as e:  # noqa: BLE001 - carried to every rank, raised there alike
            mine = json.dumps({"error": str(e) if isinstance(e, CheckpointError)
                               else f"{type(e).__name__}: {e}"}).encode()
    payloads = all_gather_bytes(mine)
    scans = {node: json.loads(payloads[rank]) for node, rank in leaders.items()}
    failed = {node: scan["error"] for node, scan in scans.items() if "error" in scan}
    if failed:
        first = min(failed)
        others = f" (also on nodes {sorted(failed)[1:]})" if len(failed) > 1 else ""
        raise CheckpointError(f"surveying {root} failed on node {first} (rank {leaders[first]}){others}: "
                              f"{failed[first]}")
    return merge_scans(root, scans)


def merge_scans(root: str, scans: dict[int, dict[str, Any]]) -> Survey:
    """The Survey of per-node scans (``scan_root`` outputs)."""
    nodes = tuple(sorted(scans))
    steps: dict[int, StepState] = {}
    for step in sorted({int(s) for scan in scans.values() for s in scan["steps"]}):
        views = {n: scan["steps"].get(str(step)) for n, scan in scans.items()}
        ok = [v for v in views.values() if v and v["marker"] == "ok"]
        orders = [v["order"] for v in ok if v["order"] is not None]
        held = {n: v for n, v in views.items() if v}
        parts: dict[str, list[tuple[int, str]]] = {}
        for n, v in held.items():
            for role, crc in v.get("parts", {}).items():
                parts.setdefault(role, []).append((n, crc))
        steps[step] = StepState(
            step, tuple(held), tuple(n for n, v in held.items() if v["marker"] == "ok"),
            tuple(n for n, v in held.items() if v["marker"] == "bad"), max(orders, default=None),
            max(len({v["crc"] for v in ok}), 1), roles=tuple(ok[0].get("roles", ())) if ok else (),
            kind=ok[0].get("kind") if ok else None, parts={r: tuple(n for n, _ in p) for r, p in parts.items()},
            part_versions={r: len({c for _, c in p}) for r, p in parts.items()},
            entries={n: tuple(v.get("entries", ())) for n, v in held.items()},
            crcs={n: v["crc"] if v["marker"] == "ok" else None for n, v in held.items()},
            why=next((v["why"] for v in held.values() if v["marker"] == "bad" and v.get("why")), None))
    trackers = {n: bytes.fromhex(scan["tracker"]) if scan["tracker"] is not None else None for n, scan in scans.items()}
    links = tuple(sorted({s for scan in scans.values() for s in scan["links"]}))
    side: dict[str, dict[int, str | None]] = {}
    for n, scan in scans.items():
        for name, state in scan["side"].items():
            side.setdefault(name, {})[n] = state["crc"] if state["marker"] == "ok" else None
    side_links = tuple(sorted({name for scan in scans.values() for name in scan.get("side_links", ())}))
    return Survey(root, nodes, steps, trackers, links, side, side_links)
