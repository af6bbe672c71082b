"""Recovery of replacements a crash cut short, decided once from every node's inventory.

A complete step N is replaced by writing ``.global_step_N.incoming``, marking it, then on every
writer: ``global_step_N`` -> ``.global_step_N.outgoing``, ``.incoming`` -> ``global_step_N``;
retention removes the outgoing copy. A crash can stop each node at a different point of that
sequence (node 0 swapped, node 1 not started). Deciding per node would keep the new copy on one
node and the old on the other, and the step would be complete nowhere. So the decision is taken
from the agreed ``Survey`` (the same on every rank): per step, the one version (its marker's
CRC-32) every node ends up with —

- a version every node holds (at its name or in a side dir) is kept; when both are held
  everywhere, the new one if any node had started the swap (its marker was agreed on every node
  before any swap began), else the old one;
- no version with a marker held anywhere: side dirs without a marker are removed (positively
  observed unmarked, an unfinished replacement); the step's own dirs are left alone;
- a marked side dir but no version on every node: refused (nothing is touched; the error names
  what each node holds).

Each writer then moves the kept version to the step's name on its disk and removes the rest,
re-checking the kept copy's marker first (nothing is removed on a stale or failed observation).
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

from mcore_rl.checkpoint import inventory, step_dirs, storage
from mcore_rl.checkpoint.inventory import Survey
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.faults import fault_point

log = logging.getLogger("mcore_rl.checkpoint")
_PLACES = ("final", "incoming", "outgoing")


@dataclass(frozen=True)
class Fix:
    """One step's agreed recovery: ``keep`` is the marker CRC-32 of the version every node ends
    with (None: no marked version; only unmarked side dirs are removed)."""

    step: int
    keep: str | None


def _copies(found: Survey, step: int) -> dict[int, dict[str, str | None]]:
    """node -> place -> marker CRC (None: present without a valid marker) of step ``step``."""
    out: dict[int, dict[str, str | None]] = {n: {} for n in found.nodes}
    st = found.steps.get(step)
    for node in (st.present if st else ()):
        out[node]["final"] = st.crcs.get(node)
    for place in ("incoming", "outgoing"):
        name = inventory.incoming_name(step) if place == "incoming" else inventory.outgoing_name(step)
        for node, crc in found.side.get(name, {}).items():
            out[node][place] = crc
    return out


def plan(found: Survey) -> list[Fix]:
    """The agreed recoveries of ``found`` (every step with a side dir on some node); raises a
    CheckpointError when a replacement cannot be resolved without losing a marked copy."""
    steps = sorted({side[0] for name in found.side if (side := inventory.side_dir(name))})
    fixes = []
    for step in steps:
        copies = _copies(found, step)
        held = [{c for c in places.values() if c is not None} for places in copies.values()]
        everywhere = set.intersection(*held) if held else set()
        started = any("outgoing" in places for places in copies.values())
        new = {p.get("incoming") for p in copies.values()} | \
              {p.get("final") for p in copies.values() if "outgoing" in p}
        old = {p.get("outgoing") for p in copies.values()} | \
              {p.get("final") for p in copies.values() if "incoming" in p}
        preferred = (everywhere & new if started else everywhere & old) or everywhere
        if preferred:
            fixes.append(Fix(step, sorted(preferred)[0]))
            continue
        marked_side = any(p.get(k) is not None for p in copies.values() for k in ("incoming", "outgoing"))
        if marked_side:
            raise CheckpointError(
                f"{os.path.join(found.root, inventory.step_name(step))}: an interrupted replacement left "
                f"copies no version of which every node holds (node: place -> marker CRC) {copies}; nothing "
                "was removed. Restore the step on every node (or remove its .global_step_*.incoming/"
                ".outgoing dirs by hand once you know which copy to keep).")
        fixes.append(Fix(step, None))
    return fixes


def describe(found: Survey, fixes: list[Fix]) -> list[str]:
    """One line per fix (rank 0 logs them)."""
    out = []
    for fix in fixes:
        copies = _copies(found, fix.step)
        if fix.keep is None:
            out.append(f"removing unfinished replacements of step {fix.step} (no marker): {copies}")
            continue
        moved = any(p.get("final") != fix.keep for p in copies.values())
        routine = all(set(p) <= {"final", "outgoing"} and p.get("final") == fix.keep for p in copies.values())
        if not routine:
            out.append(f"{'finishing' if moved else 'undoing'} an interrupted replacement of step {fix.step} "
                       f"on every node (node: place -> marker CRC {copies}; keeping {fix.keep})")
    return out


def apply(root: str, fixes: list[Fix]) -> None:
    """A writer's part of ``fixes`` on its disk: the kept copy takes the step's name, the others
    are removed (marker first); each step re-checked before anything moves."""
    for fix in fixes:
        final = os.path.join(root, inventory.step_name(fix.step))
        paths = {"final": final, "incoming": os.path.join(root, inventory.incoming_name(fix.step)),
                 "outgoing": os.path.join(root, inventory.outgoing_name(fix.step))}
        here = {place: path for place, path in paths.items() if step_dirs.real_dir(path)}
        if fix.keep is None:
            for place in ("incoming", "outgoing"):
                if place in here and inventory.marker_crc(os.path.join(here[place], inventory.MARKER)) is None:
                    step_dirs.remove_step_dir(here[place])
            continue
        crcs = {place: inventory.marker_crc(os.path.join(path, inventory.MARKER)) for place, path in here.items()}
        kept = next((place for place in _PLACES if crcs.get(place) == fix.keep), None)
        if kept is None:
            raise CheckpointError(f"{final}: the copy to keep (marker CRC {fix.keep}) is no longer on this node "
                                  f"(found {crcs}); nothing was removed: rerun, the survey will be retaken.")
        if kept != "final":
            if "final" in here:
                aside = "outgoing" if kept == "incoming" else "incoming"
                if aside in here:
                    step_dirs.remove_step_dir(final)  # a third copy; the kept one is whole beside it
                else:
                    step_dirs.rename(final, paths[aside])
                    here[aside] = paths[aside]
                fault_point("recover")  # the name is free: the next start finishes the same way
            step_dirs.rename(here[kept], final)
            del here[kept]
        for place in ("incoming", "outgoing"):
            if place in here:
                step_dirs.remove_step_dir(paths[place])
        storage.fsync_path(root)
