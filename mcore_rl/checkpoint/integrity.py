"""Content records of a step: which rank wrote which file, its size and checksum (the manifest
a marker holds), and the checks that a node's copy is that content.

The checksum (``fileio/checksum.py``: XXH3-128; CRC-32 in steps written before it) of a shard
and of each of its items is computed by its writer while writing (``files.ChecksumStream``,
``fileio/item_sums.py``); rank 0's small files (megatron's ``.metadata``/``common.pt``/
``metadata.json``, JSON, HF files) are fsynced and read back once. A load checks each shard item
in the same pass as it reads it (``verified_read.py``) and re-reads only the small files and the
shards of older steps (``check_content``): a shard cut short, replaced by other bytes of the same
size, or missing is a clear error before any engine state is touched. Checksums detect damage and
stale files; they do not authenticate (whoever can rewrite a shard can rewrite the marker):
planted pickles are refused by ``safe_load``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mcore_rl.checkpoint import storage
from mcore_rl.checkpoint.collective import all_gather_bytes, distributed
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.checksum import file_checksum
from mcore_rl.fileio.paths import contained


@dataclass(frozen=True)
class FileEntry:
    """One file of a step: size, checksum (``fileio/checksum.py``; None in markers written before
    checksums) and
    the node whose rank wrote it."""

    size: int
    crc32: str | None
    node: int = 0


Manifest = dict[str, FileEntry]  # path relative to the step dir -> entry


def digest_files(base: str, rels: list[str], fsync: bool = True) -> dict[str, tuple[int, str]]:
    """rel -> (size, checksum) of files this rank wrote through other code (read back once);
    ``fsync``: make each durable first (megatron and shutil do not)."""
    out = {}
    for rel in rels:
        path = os.path.join(base, rel)
        if fsync:
            storage.fsync_path(path)
        out[rel] = file_checksum(path)
    return out


def gather_manifest(mine: dict[str, tuple[int, str]], where: str) -> Manifest:
    """Collective: every rank's written files (rel -> (size, crc)) merged, each tagged with the
    writer's node. Two ranks reporting one file with different content is an error."""
    payload = json.dumps({"node": storage.node_id(), "files": mine}).encode()
    manifest: Manifest = {}
    for raw in all_gather_bytes(payload) if distributed() else [payload]:
        part = json.loads(raw)
        for rel, (size, crc) in part["files"].items():
            entry = FileEntry(int(size), str(crc), int(part["node"]))
            old = manifest.get(rel)
            if old is not None and (old.size, old.crc32) != (entry.size, entry.crc32):
                raise CheckpointError(f"{os.path.join(where, rel)} was written twice with different content "
                                      f"(nodes {old.node} and {entry.node}); two ranks wrote one file name.")
            manifest.setdefault(rel, entry)
    return manifest


def check_sizes(step_dir: str, files: dict[str, tuple[int, str | None]], exact: bool = True) -> None:
    """Every file is inside ``step_dir`` and present with its recorded size (``exact=False``:
    at least that size, for markers that recorded minimum sizes); an error lists the others."""
    bad = []
    for rel, (size, _) in sorted(files.items()):
        path = contained(step_dir, rel, os.path.join(step_dir, "COMPLETE"))
        try:
            actual = os.stat(path).st_size
        except FileNotFoundError:
            bad.append(f"{rel} missing")
            continue
        if actual < size or (exact and actual != size):
            bad.append(f"{rel} has {actual} bytes, the marker records {size}")
    if bad:
        raise CheckpointError(f"checkpoint {step_dir} is damaged: {'; '.join(bad[:8])}"
                              f"{f' (+{len(bad) - 8} more)' if len(bad) > 8 else ''}; restore the files, "
                              "or resume another step with checkpoint.resume_mode=path "
                              "checkpoint.resume_path=<root>/global_step_<N>.")


def share(files: list[str], sizes: dict[str, int], index: int, count: int) -> list[str]:
    """This worker's part of ``files`` when ``count`` workers split them by size (largest
    first, each to the least loaded worker): the same split on every rank."""
    load = [0] * count
    mine = []
    for rel in sorted(files, key=lambda r: (-sizes[r], r)):
        w = load.index(min(load))
        load[w] += sizes[rel]
        if w == index:
            mine.append(rel)
    return mine


def check_content(step_dir: str, files: dict[str, tuple[int, str | None]], rels: list[str]) -> None:
    """Re-reads each file of ``rels`` and compares its checksum with the record; an error names
    every file whose bytes differ (e.g. a stale or damaged shard of the right size)."""
    bad = []
    for rel in rels:
        size, crc = files[rel]
        if crc is None:
            continue
        actual_size, actual = file_checksum(contained(step_dir, rel, os.path.join(step_dir, "COMPLETE")), like=crc)
        if (actual_size, actual) != (size, crc):
            bad.append(f"{rel} (checksum {actual}, the marker records {crc})")
    if bad:
        raise CheckpointError(f"checkpoint {step_dir} holds other bytes than were saved: {'; '.join(bad[:8])}; "
                              "the files are damaged or stale: restore them from another node or copy, "
                              "or resume another step with checkpoint.resume_mode=path.")
