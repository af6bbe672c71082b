"""Output directories the converters write in full beside their destination and rename into
place at the end, so a failure never costs the old output and never leaves a partial one.

``Staging.create(final)`` makes ``<parent>/.<name>.staging-<id>``; ``commit()`` moves an
existing ``final`` aside to ``.<name>.replaced-<id>`` (the same ``<id>``), renames the staging
directory to ``final`` and only then deletes the old one — only with ``replace=True`` (``--overwrite``):
without it the commit is one rename that refuses a ``final`` another run wrote meanwhile;
``discard()`` removes the staging
directory (and the parents it had to create), or, once a commit has started, settles it.

Crash recovery: ``<id>`` is ``<pid>-<start ticks>-<host hash>-<random>``, naming the process
that owns both directories. ``settle(final)`` (run by ``Staging.create`` and by the converters'
output checks before they look at ``final``) finishes what a dead owner on this host left:

- ``.replaced-<id>`` with ``.staging-<id>`` and no ``final``: killed between the two renames; the
  staging copy is complete (the first rename only happens after it was written and fsynced):
  it is renamed into place, then the old copy removed;
- ``.replaced-<id>`` beside ``final`` and no ``.staging-<id>``: killed after the swap (or its
  removal failed): the old copy is removed; with no ``final`` either, it is put back;
- ``.staging-<id>`` alone: a run that never committed; removed.

A live owner, an owner on another host and a name of another format are never touched (a
warning names them). No torch or megatron import: the merge and the pre-flight checks use it.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import uuid
import warnings
import zlib
from dataclasses import dataclass, field

from mcore_rl.errors import CheckpointError, McoreRLError
from mcore_rl.fileio.faults import fault_point, io_fault
from mcore_rl.fileio.files import fsync_path


class StagingError(CheckpointError):
    """An output directory that cannot be staged beside its destination."""


class StagingWarning(McoreRLError, UserWarning):
    """Leftovers of an interrupted or failed commit that this run could not remove."""


def overlaps(a: str, b: str) -> bool:
    """True when ``a`` and ``b`` are the same directory or one lies inside the other (real paths,
    symlinks resolved)."""
    ra, rb = os.path.realpath(a), os.path.realpath(b)
    return ra == rb or ra.startswith(rb.rstrip(os.sep) + os.sep) or rb.startswith(ra.rstrip(os.sep) + os.sep)


def fsync_tree(directory: str) -> None:
    """fsyncs every file and directory under ``directory`` (files first, then dirs bottom-up), so
    the rename that publishes it never exposes unwritten pages after a crash."""
    for dirpath, _, files in os.walk(directory, topdown=False):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_path(path)
        fsync_path(dirpath)


def _make_parents(parent: str) -> list[str]:
    """Creates ``parent`` and its missing ancestors; returns those created, outermost first."""
    missing = []
    while parent and not os.path.isdir(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for path in reversed(missing):
        try:
            os.mkdir(path)
        except OSError as e:
            raise StagingError(f"cannot create the output's parent directory {path}: {e}; pass an "
                               "output path in a writable directory.") from e
    return list(reversed(missing))


# ---- owners: which process a staging / replaced directory belongs to ----

def _start_ticks(pid: int) -> int | None:
    """Start time of process ``pid`` in clock ticks since boot (``/proc``); None when it does not
    exist or has exited (a zombie). Raises OSError when it cannot be told (no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name: field 3 onwards
        return None if fields[0] in ("Z", "X") else int(fields[19])  # field 3: state, 22: starttime
    except FileNotFoundError:
        return None
    except (ValueError, IndexError) as e:
        raise OSError(f"/proc/{pid}/stat unreadable: {e}") from e


def _host() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def new_id() -> str:
    """``<pid>-<start ticks>-<host hash>-<random>``: this process as the owner of a staging."""
    try:
        ticks = _start_ticks(os.getpid()) or 0
    except OSError:
        ticks = 0
    return f"{os.getpid()}-{ticks}-{_host()}-{uuid.uuid4().hex[:8]}"


def owner_dead(ident: str) -> bool:
    """True only when the owner named in ``ident`` provably is gone: same host, and no process
    with that pid, or one started at another time (the pid was reused)."""
    return _owner_state(ident) == "dead"


def _owner_state(ident: str) -> str:
    """``dead`` (provably gone, see ``owner_dead``), ``live`` (that process runs on this host),
    ``foreign`` (another host) or ``unknown`` (no start time recorded, or ``/proc`` unreadable)."""
    pid, ticks, host, _ = ident.split("-")
    if host != _host():
        return "foreign"
    if int(ticks) == 0:
        return "unknown"
    try:
        now = _start_ticks(int(pid))
    except OSError:
        return "unknown"
    return "dead" if now is None or now != int(ticks) else "live"


def _kept_warning(final: str, ident: str, pair: dict[str, str], state: str) -> None:
    """Warns that the leftovers ``pair`` of the owner ``ident`` stay (its state: not ``dead``)."""
    pid, _, host, _ = ident.split("-")
    owner = {"live": f"process {pid}, which is still running on this host",
             "foreign": f"process {pid} on another host (host hash {host})",
             "unknown": f"process {pid} on this host, whose state cannot be told"}[state]
    for path in sorted(pair.values()):
        warnings.warn(f"{path} belongs to {owner}: it may still be writing {final}, so it is not removed; "
                      f"remove it once no converter writes {final}.", StagingWarning, stacklevel=4)


def _leftover_re(final: str) -> re.Pattern:
    ident = r"(\d+-\d+-[0-9a-f]{8}-[0-9a-f]{8})"  # new_id()
    return re.compile(re.escape("." + os.path.basename(final)) + r"\.(staging|replaced)-" + ident)


def _survey(final: str) -> dict[str, dict[str, str]]:
    """``<id>`` -> {"staging"|"replaced": path} of the leftovers beside ``final``; warns about
    names of the old format (no owner in them: never touched)."""
    parent, pattern = os.path.dirname(final), _leftover_re(final)
    prefix = "." + os.path.basename(final) + "."
    found: dict[str, dict[str, str]] = {}
    for name in os.listdir(parent):
        m = pattern.fullmatch(name)
        if m:
            found.setdefault(m[2], {})[m[1]] = os.path.join(parent, name)
        elif name.startswith(prefix) and re.fullmatch(r"(staging|replaced)-[0-9a-f]{12}", name[len(prefix):]):
            warnings.warn(f"{os.path.join(parent, name)} was left by an interrupted run of an older mcore_rl "
                          "(no owner recorded, so it is not removed); remove it once no converter writes "
                          f"{final}.", StagingWarning, stacklevel=3)
    return found


def _exists(path: str) -> bool:
    """lexists, with the fault hook; any error but 'absent' propagates (a refusal to act)."""
    io_fault("stat", path)
    try:
        os.lstat(path)
    except FileNotFoundError:
        return False
    return True


def _rename(src: str, dst: str) -> None:
    io_fault("rename", src)
    os.rename(src, dst)


def _remove_tree(path: str, why: str) -> bool:
    """Removes ``path`` (a link: the link only); on any error a warning names it and what was
    left, and False (the next run's ``settle`` removes it)."""
    errors: list[str] = []
    try:
        io_fault("cleanup", path)
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
        else:
            shutil.rmtree(path, onerror=lambda fn, p, exc: errors.append(f"{p}: {exc[1]}"))
    except OSError as e:
        errors.append(f"{path}: {e}")
    if errors:
        warnings.warn(f"could not remove {path} ({why}): {'; '.join(errors[:3])}; the next run writing the "
                      "same output removes it, or remove it yourself.", StagingWarning, stacklevel=3)
    return not errors


@contextlib.contextmanager
def _parent_lock(parent: str):
    """An exclusive flock on the parent directory: concurrent ``settle`` calls on one host act
    one at a time (no lock file left behind; where flock fails, the owner checks still hold)."""
    try:
        fd = os.open(parent, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        import fcntl

        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _settle_one(final: str, pair: dict[str, str], forward: bool) -> None:
    """Finishes (``forward``: the staging copy is complete once the old one was moved aside) or
    undoes one interrupted commit; removes what the settled state no longer needs."""
    staging, replaced = pair.get("staging"), pair.get("replaced")
    staged = staging is not None and _exists(staging)
    aside = replaced is not None and _exists(replaced)
    if aside and not _exists(final):
        if staged and forward:
            _rename(staging, final)
            staged = False
        else:
            _rename(replaced, final)  # the old output back in place
            aside = False
    if aside and staged:  # both copies beside a final written since: which one is meant is unclear
        warnings.warn(f"{staging} and {replaced} are left of an interrupted commit of {final}, which was "
                      "written again since; neither is removed: remove them once you know which you need.",
                      StagingWarning, stacklevel=3)
        return
    if aside:
        _remove_tree(replaced, f"the old copy of {final}, replaced")
    if staged:
        _remove_tree(staging, f"an unfinished output for {final}")
    fsync_path(os.path.dirname(final))


def settle(final: str) -> None:
    """Finishes or undoes every interrupted commit of ``final`` whose owner is provably dead and
    removes their leftovers (see module doc). Errors while surveying propagate: nothing is
    decided from an observation that failed."""
    final = os.path.realpath(final)
    parent = os.path.dirname(final)
    if not os.path.isdir(parent):
        return
    with _parent_lock(parent):
        for ident, pair in sorted(_survey(final).items()):
            state = _owner_state(ident)
            if state == "dead":
                _settle_one(final, pair, forward=True)
            else:
                _kept_warning(final, ident, pair, state)


@dataclass
class Staging:
    """A staging directory ``path`` for the destination ``final`` (both absolute, real paths)."""

    final: str
    path: str
    made: list[str] = field(default_factory=list)  # parent dirs created for it (outermost first)
    committing: bool = False  # set when commit starts: discard() then settles instead of removing

    @classmethod
    def create(cls, final: str) -> Staging:
        """Creates the staging directory beside ``final`` (``final``'s parents when missing),
        after settling what interrupted earlier runs left beside it."""
        final = os.path.realpath(final)
        made = _make_parents(os.path.dirname(final))
        try:
            settle(final)
        except OSError as e:
            cls(final, "", made).discard()
            raise StagingError(f"cannot settle what an interrupted run left beside the output {final}: {e}; "
                               "check the disk, then run again.") from e
        path = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.staging-{new_id()}")
        try:
            os.mkdir(path)
        except OSError as e:
            cls(final, path, made).discard()
            raise StagingError(f"cannot create {path} beside the output {final}: {e}; the output's "
                               "parent directory must be writable.") from e
        return cls(final, path, made)

    @classmethod
    def join(cls, final: str, name: str) -> Staging:
        """The staging directory ``name`` another process created beside ``final``."""
        final = os.path.realpath(final)
        return cls(final, os.path.join(os.path.dirname(final), name))

    @property
    def name(self) -> str:
        """The staging directory's name (what rank 0 tells the other ranks)."""
        return os.path.basename(self.path)

    @property
    def replaced(self) -> str:
        """Where commit moves an existing ``final`` aside (the staging directory's ``<id>``)."""
        ident = self.name.rsplit(".staging-", 1)[1]
        return os.path.join(os.path.dirname(self.final), f".{os.path.basename(self.final)}.replaced-{ident}")

    def commit(self, *, replace: bool) -> None:
        """Publishes the staging directory as ``final``: fsync, then (``replace``) an existing
        ``final`` is moved aside, the staging directory renamed into place, and only then the old
        one deleted (a failure to delete it is a warning naming it; the next run removes it).

        ``replace=False`` (no ``--overwrite``): one rename, which the kernel refuses when ``final``
        exists then and is not an empty directory (written by another run since the caller's
        check): a StagingError naming it; that output stays untouched, and this staging directory
        is left for the caller's ``discard()``."""
        fsync_tree(self.path)
        parent = os.path.dirname(self.final)
        fault_point("stage_commit")
        if not replace:
            self._publish_new()
            return
        there = _exists(self.final)
        self.committing = True  # before the first rename: an interrupt right after it is settled
        if there:
            _rename(self.final, self.replaced)
            fault_point("stage_aside")
            _rename(self.path, self.final)
            fsync_path(parent)
            fault_point("stage_swapped")
            _remove_tree(self.replaced, f"the old copy of {self.final}, replaced")
        else:
            _rename(self.path, self.final)
        fsync_path(parent)

    def _publish_new(self) -> None:
        """Renames the staging directory to ``final`` unless something is there (an empty
        directory aside: rename(2) replaces it, as the callers' checks allow)."""
        try:
            _rename(self.path, self.final)
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise
            raise StagingError(f"{self.final} appeared while this output was written (another run writing the "
                               "same path?) and is not replaced without --overwrite: it is left as it is and "
                               "this output is discarded; run again with --overwrite to replace it, or choose "
                               "another output path.") from None
        fsync_path(os.path.dirname(self.final))

    def discard(self) -> None:
        """Removes the staging directory and the (still empty) parents made for it; once a
        commit has started it undoes it instead (the old output back in place) or, when the new
        one is in place already, only removes the old one. Never raises (it runs while another
        error propagates): what it cannot do, the next run's ``settle`` does."""
        if self.committing:
            try:
                _settle_one(self.final, {"staging": self.path, "replaced": self.replaced}, forward=False)
            except OSError as e:
                warnings.warn(f"could not undo the interrupted commit of {self.final}: {e}; the next run "
                              "writing it finishes or undoes it.", StagingWarning, stacklevel=2)
            return
        if self.path:
            shutil.rmtree(self.path, ignore_errors=True)
        for path in reversed(self.made):
            try:
                os.rmdir(path)
            except OSError:
                break
