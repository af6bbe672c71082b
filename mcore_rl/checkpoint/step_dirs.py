"""What a writer rank does to the step directories on its disk (rank 0 on a shared root, each
node's leader on node-local disks): markers and tracker, removal marker-first, the swap that
replaces a complete step, retention's removals (recovery.py decides, agreed, what a crash
cut short). Links
are never followed; the fault hooks sit where a crash or a failing disk matters."""
from __future__ import annotations

import logging
import os
import shutil
import stat
import threading
from typing import Callable

from mcore_rl.checkpoint import inventory, storage
from mcore_rl.fileio.faults import fault_point, io_fault
from mcore_rl.checkpoint.inventory import MARKER, TRACKER, Marker
from mcore_rl.errors import CheckpointError

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


def real_dir(path: str) -> bool:
    """A directory that is not a link, observed without error (an error is a CheckpointError)."""
    st = inventory.lstat(path)
    return st is not None and stat.S_ISDIR(st.st_mode)


def rename(src: str, dst: str) -> None:
    io_fault("rename", src)
    os.rename(src, dst)
    storage.fsync_path(os.path.dirname(dst))


def remove_step_dir(path: str) -> None:
    """Marker first (a crash part-way leaves debris, never a "complete" step missing files),
    then the tree; a link is never followed, a missing dir is fine, an error observing either
    is raised (never taken as "absent"), as is any error removing them."""
    if not real_dir(path):
        return
    marker = inventory.lstat(os.path.join(path, MARKER))
    if marker is not None and not stat.S_ISDIR(marker.st_mode):
        remove_file(os.path.join(path, MARKER))
    shutil.rmtree(path)


def make_step_dir(path: str) -> None:
    """Creates the directory a save writes into: nothing may exist at ``path`` (a link or a dir
    this save did not create is refused; mcore_rl never writes through a link it did not make)."""
    st = inventory.lstat(path)
    if st is not None:
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "a directory" if stat.S_ISDIR(st.st_mode) else "a file"
        raise CheckpointError(f"{path} exists and is {kind} this save did not create; mcore_rl never writes "
                              "through links or into others' directories: remove it (or save to another "
                              "checkpoint.root).")
    os.mkdir(path)
    storage.fsync_path(os.path.dirname(path))


def swap_in(incoming: str, final: str) -> None:
    """The old complete step steps aside, the new one takes its name (a crash in between is
    finished by ``recovery``, agreed across nodes); the old copy is removed at retention."""
    root = os.path.dirname(final)
    step, _ = inventory.side_dir(os.path.basename(incoming))
    rename(final, os.path.join(root, inventory.outgoing_name(step)))
    fault_point("swap")  # the step's name is free: the next start finishes the swap
    rename(incoming, final)


def swap_out(incoming: str, final: str) -> None:
    """Undoes ``swap_in`` on a writer that did it when another failed."""
    root = os.path.dirname(final)
    step, _ = inventory.side_dir(os.path.basename(incoming))
    outgoing = os.path.join(root, inventory.outgoing_name(step))
    if real_dir(outgoing):
        if real_dir(final):
            rename(final, incoming)
        rename(outgoing, final)


def clean(root: str, dirs: list[str], finish: Callable[[], None] | None = None) -> None:
    """Retention and debris on this disk: each dir marker-first, then ``finish`` (the agreed
    recovery's removal of finished replacements' old copies)."""
    fault_point("retention")
    io_fault("cleanup", root)
    for path in dirs:
        remove_step_dir(path)
    if finish is not None:
        finish()


class BackgroundClean:
    """``clean`` on a thread of this writer (an async save's retention, started once the tracker
    names the new step, so training goes on while old steps are deleted); ``join`` waits and
    raises what it raised. A crash part-way leaves what ``clean`` leaves: debris, marker first."""

    def __init__(self, root: str, dirs: list[str], finish: Callable[[], None] | None = None) -> None:
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(root, dirs, finish),
                                        name="mcore_rl-checkpoint-retention", daemon=True)
        self._thread.start()

    def _run(self, root: str, dirs: list[str], finish: Callable[[], None] | None) -> None:
        try:
            clean(root, dirs, finish)
        except BaseException as e:  # noqa: BLE001 - raised by join, on the caller's thread
            self._error = e

    def join(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
