"""The item checksums of one torch_dist shard file: ``<shard>.sums.json`` beside ``<shard>``.

A shard (``__<rank>_0.distcp``) holds items (one ``torch.save`` payload per tensor chunk or
object) at byte spans ``.metadata`` records. Its writer records each item's span and checksum
while writing, and writes this JSON file after the shard; the step's marker records the JSON
file's own size and checksum like every other file. A load checks each item it reads against it
in the same pass as the read (``checkpoint/verified_read.py``), so no file is read twice.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.checksum import ALGORITHM, checksum

SUFFIX = ".sums.json"
FORMAT = 1


def sums_name(shard: str) -> str:
    """The item-checksum file of shard file name ``shard``."""
    return shard + SUFFIX


def is_sums_file(name: str) -> bool:
    return name.endswith(".distcp" + SUFFIX)


@dataclass(frozen=True)
class ItemSums:
    """One shard's items: byte offset -> (length, checksum)."""

    shard: str
    size: int
    items: dict[int, tuple[int, str]]


def encode(sums: ItemSums) -> bytes:
    """The JSON bytes of ``sums`` (items sorted by offset)."""
    return json.dumps({"format": FORMAT, "algorithm": ALGORITHM, "shard": sums.shard, "size": sums.size,
                       "items": [[off, n, c] for off, (n, c) in sorted(sums.items.items())]}).encode()


def write(path: str, sums: ItemSums) -> tuple[int, str]:
    """Writes ``sums`` to ``path`` (fsynced); returns its (size, checksum) for the manifest."""
    raw = encode(sums)
    with open(path, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return len(raw), checksum(raw)


def read(path: str, recorded: tuple[int, str | None]) -> ItemSums:
    """The item checksums at ``path``, whose (size, checksum) the marker records; a
    CheckpointError when the file differs from the record or is not a sums file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise CheckpointError(f"cannot read {path} ({e.strerror or e}); restore it, or resume another step "
                              "with checkpoint.resume_mode=path.") from None
    size, expected = recorded
    if len(raw) != size or expected is None or checksum(raw, like=expected) != expected:
        raise CheckpointError(f"{path} holds other bytes than were saved (the marker records {size} bytes, "
                              f"checksum {expected}); the files are damaged or stale: restore them, or resume "
                              "another step with checkpoint.resume_mode=path.")
    try:
        data = json.loads(raw)
        items = {int(off): (int(n), str(c)) for off, n, c in data["items"]}
        return ItemSums(str(data["shard"]), int(data["size"]), items)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is not an item checksum file ({type(e).__name__}: {e}).") from None
