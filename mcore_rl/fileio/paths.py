"""Containment of file names read from checkpoints and HF model directories.

A ``relative_path`` in a torch_dist ``.metadata``, a file name in a completion marker or a peer's
listing, a shard named by a HF index's ``weight_map``: each comes from a file an attacker (or a
damaged disk) may control, and each is joined to a directory before it is opened, written or
deleted. ``contained`` is the one gate: no absolute path, no ``..`` component, and no symlink on
the way that leads out of the directory. No megatron import (the merge runs without it).
"""
from __future__ import annotations

import os

from mcore_rl.errors import CheckpointError


class UnsafePathError(CheckpointError):
    """A file name from a checkpoint or index that would leave its directory."""


def contained(base: str, rel: str, source: str, hub_cache: bool = False) -> str:
    """``base/rel`` as an absolute path, when it stays inside ``base``.

    ``source`` names where ``rel`` was read (e.g. ``"<dir>/.metadata"``) for the error. Refused:
    a non-string or empty name, a NUL byte, an absolute path, any ``..`` component, and a name
    whose real path (symlinks resolved) is outside ``base``'s real path. ``hub_cache=True`` (HF
    model folders): in a Hugging Face hub-cache snapshot (``<repo>/snapshots/<rev>/``) files are
    links into the same repo's ``<repo>/blobs/``, which is allowed too (and nothing else).
    """
    if not isinstance(rel, str) or not rel or "\0" in rel:
        raise UnsafePathError(f"{source} names the file {rel!r}, which is not a file name; the "
                              "checkpoint is damaged or was tampered with: do not load it.")
    parts = rel.replace("\\", "/").split("/")
    if os.path.isabs(rel) or ".." in parts:
        raise UnsafePathError(f"{source} names the file {rel!r}, which leaves {base}; a checkpoint "
                              "only names files inside its own directory: it is damaged or was "
                              "tampered with, do not load it.")
    path = os.path.join(os.path.abspath(base), rel)
    if not _any_link(os.path.abspath(base), parts):
        return path  # no link on the way: lexically inside is inside
    real = os.path.realpath(path)
    allowed = [os.path.realpath(base)]
    snapshots = os.path.dirname(os.path.abspath(base))
    if hub_cache and os.path.basename(snapshots) == "snapshots":
        allowed.append(os.path.realpath(os.path.join(os.path.dirname(snapshots), "blobs")))
    if not any(real == root or real.startswith(root + os.sep) for root in allowed):
        raise UnsafePathError(f"{source} names the file {rel!r}, which resolves to {real} outside "
                              f"{allowed[0]} (a symlink leaves the directory); replace the link "
                              "with the file itself, or do not load this checkpoint.")
    return path


def _any_link(base: str, parts: list[str]) -> bool:
    """Whether a component of ``base/parts...`` below ``base`` is a symlink (a few lstat calls,
    cheaper than resolving the whole path; ``base`` itself may be a link: the root a user chose)."""
    path = base
    for part in parts:
        if part in ("", "."):
            continue
        path = os.path.join(path, part)
        if os.path.islink(path):
            return True
    return False


def is_real_dir(path: str) -> bool:
    """A directory that is not a symlink (retention and cleanup never follow a link)."""
    return os.path.isdir(path) and not os.path.islink(path)
