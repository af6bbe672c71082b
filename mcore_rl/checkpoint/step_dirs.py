"""What a writer rank does to the step directories on its disk (rank 0 on a shared root, each
node's leader on node-local disks): markers and tracker, removal marker-first, the swap that
replaces a complete step, the recovery of a swap a crash cut short, retention's removals. Links
are never followed; the fault hooks sit where a crash or a failing disk matters."""
from __future__ import annotations

import logging
import os
import shutil

from mcore_rl.checkpoint import inventory, storage
from mcore_rl.fileio.faults import fault_point, io_fault
from mcore_rl.checkpoint.inventory import MARKER, TRACKER, Marker
from mcore_rl.fileio.paths import is_real_dir

log = logging.getLogger("mcore_rl.checkpoint")


def write_marker(path: str, marker: Marker) -> None:
    fault_point("marker")
    io_fault("marker", path)
    storage.write_json_atomic(path, marker.payload())


def write_tracker(root: str, step: int) -> None:
    fault_point("tracker")
    path = os.path.join(root, TRACKER)
    io_fault("tracker", path)
    storage.write_json_atomic(path, step)


def remove_file(path: str) -> None:
    os.remove(path)
    storage.fsync_path(os.path.dirname(path))


def remove_step_dir(path: str) -> None:
    """Marker first (a crash part-way leaves debris, never a "complete" step missing files),
    then the tree; a link is never followed, a missing dir is fine."""
    if not is_real_dir(path):
        return
    if os.path.isfile(os.path.join(path, MARKER)):
        remove_file(os.path.join(path, MARKER))
    shutil.rmtree(path)


def swap_in(incoming: str, final: str) -> None:
    """The old complete step steps aside, the new one takes its name (a crash in between is
    finished by ``recover_side_dirs``); the old copy is removed at retention."""
    root = os.path.dirname(final)
    step, _ = inventory.side_dir(os.path.basename(incoming))
    os.rename(final, os.path.join(root, inventory.outgoing_name(step)))
    storage.fsync_path(root)
    fault_point("swap")  # the step's name is free: the next start finishes the swap
    os.rename(incoming, final)
    storage.fsync_path(root)


def swap_out(incoming: str, final: str) -> None:
    """Undoes ``swap_in`` on a writer that did it when another failed."""
    root = os.path.dirname(final)
    step, _ = inventory.side_dir(os.path.basename(incoming))
    outgoing = os.path.join(root, inventory.outgoing_name(step))
    if os.path.isdir(outgoing):
        if os.path.isdir(final):
            os.rename(final, incoming)
        os.rename(outgoing, final)
        storage.fsync_path(root)


def recover_side_dirs(root: str) -> None:
    """Per side dir on this disk: the step's dir exists -> the side dir is left over (removed);
    else an incoming copy with a marker takes the name (the swap was cut after its first
    rename), or the outgoing copy goes back; an incoming copy without marker is removed."""
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):  # .incoming sorts before .outgoing
        found, path = inventory.side_dir(name), os.path.join(root, name)
        if found is None or not is_real_dir(path):
            continue
        final = os.path.join(root, inventory.step_name(found[0]))
        if os.path.lexists(final):  # the old copy after a finished swap is routine; anything else is not
            (log.info if found[1] == "outgoing" else log.warning)(
                "removing %s, left over from a replacement of %s", path, final)
            remove_step_dir(path)
        elif found[1] == "outgoing" or os.path.isfile(os.path.join(path, MARKER)):
            log.warning("finishing an interrupted replacement: %s -> %s", path, final)
            os.rename(path, final)
            storage.fsync_path(root)
        else:
            log.warning("removing %s, an unfinished replacement of %s", path, final)
            remove_step_dir(path)


def clean(root: str, dirs: list[str]) -> None:
    """Retention and debris on this disk: each dir marker-first; replacements' leftovers."""
    fault_point("retention")
    io_fault("cleanup", root)
    for path in dirs:
        remove_step_dir(path)
    recover_side_dirs(root)
