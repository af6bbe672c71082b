"""Output directories the converters write in full beside their destination and rename into
place at the end, so a failure never costs the old output and never leaves a partial one.

``Staging.create(final)`` makes ``<parent>/.<name>.staging-<id>``; ``commit()`` moves an
existing ``final`` aside, renames the staging directory to ``final`` and only then deletes the
old one; ``discard()`` removes the staging directory (and the parents it had to create). No torch
or megatron import: the merge and the converters' pre-flight checks use it.
"""
from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass, field

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.files import fsync_path


class StagingError(CheckpointError):
    """An output directory that cannot be staged beside its destination."""


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


@dataclass
class Staging:
    """A staging directory ``path`` for the destination ``final`` (both absolute, real paths)."""

    final: str
    path: str
    made: list[str] = field(default_factory=list)  # parent dirs created for it (outermost first)

    @classmethod
    def create(cls, final: str) -> Staging:
        """Creates the staging directory beside ``final`` (``final``'s parents when missing)."""
        final = os.path.realpath(final)
        made = _make_parents(os.path.dirname(final))
        path = os.path.join(os.path.dirname(final), f".{os.path.basename(final)}.staging-{uuid.uuid4().hex[:12]}")
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

    def commit(self) -> None:
        """Publishes the staging directory as ``final``: fsync, then an existing ``final`` is moved
        aside, the staging directory renamed into place, and only then the old one deleted."""
        fsync_tree(self.path)
        parent = os.path.dirname(self.final)
        if os.path.lexists(self.final):
            old = os.path.join(parent, f".{os.path.basename(self.final)}.replaced-{uuid.uuid4().hex[:12]}")
            os.rename(self.final, old)
            try:
                os.rename(self.path, self.final)
            except BaseException:
                os.rename(old, self.final)  # the old output back in place
                raise
            if os.path.isdir(old) and not os.path.islink(old):
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.unlink(old)
        else:
            os.rename(self.path, self.final)
        fsync_path(parent)

    def discard(self) -> None:
        """Removes the staging directory and the (still empty) parents made for it; never raises
        (it runs while another error propagates)."""
        shutil.rmtree(self.path, ignore_errors=True)
        for path in reversed(self.made):
            try:
                os.rmdir(path)
            except OSError:
                break
