"""Content checksums of checkpoint files: XXH3-128 (xxhash), self-describing.

A recorded checksum is a string that names its algorithm: ``"xxh3_128:<32 hex>"`` for what this
version writes, a bare 8-hex-digit string for the CRC-32 that checkpoints written before it
recorded. ``file_checksum(path, like=recorded)`` recomputes with the recorded algorithm, so every
older marker, PART record and model-directory RECORD still verifies.

XXH3-128 was chosen by measurement on the 2-core CI machine (one 256 MiB buffer): zlib's CRC-32
0.4-1.1 GB/s, hardware CRC32C (``crc32c``) 2.9-4.5 GB/s, XXH3-64 4.3 GB/s, XXH3-128 5.6-7 GB/s,
above what the disk or a memcpy there sustains; xxhash releases the GIL on large buffers, so a
reader thread overlaps it. It detects damaged, torn and stale files; it does not authenticate.
"""
from __future__ import annotations

import concurrent.futures
import os
import re
import zlib

import xxhash

from mcore_rl.errors import CheckpointError

ALGORITHM = "xxh3_128"
_PREFIX = ALGORITHM + ":"
LEGACY = "crc32"
_CRC32 = re.compile(r"[0-9a-fA-F]{8}")


class UnknownChecksumError(CheckpointError):
    """A recorded checksum of an algorithm this version does not know (written by another version)."""


def algorithm_of(recorded: str | None) -> str:
    """The algorithm a recorded checksum names: ``xxh3_128`` (``"xxh3_128:..."``), or ``crc32``
    for a bare 8-hex-digit string (or None: nothing recorded); any other form names an algorithm
    this version does not know: UnknownChecksumError naming it and the known ones (never read as
    one of them, which would call an intact file damaged or skip its check)."""
    if recorded is None or _CRC32.fullmatch(recorded):
        return LEGACY
    if recorded.startswith(_PREFIX):
        return ALGORITHM
    name = recorded.split(":", 1)[0] if ":" in recorded else None
    what = f"names the algorithm {name!r}" if name else "is in no format"
    raise UnknownChecksumError(
        f"recorded checksum {recorded[:80]!r} {what}, which this version of mcore_rl does not know (known: "
        f"{ALGORITHM} as '{ALGORITHM}:<32 hex digits>', {LEGACY} as 8 hex digits); it was written by another "
        "version: read it with that version, or use another copy.")


def recorded_checksum(entry: dict) -> str | None:
    """The checksum of a JSON file entry: ``checksum`` (this version) or ``crc32`` (before it);
    None where none was recorded. Its algorithm is checked here (``algorithm_of``), so a record
    naming an unknown one is refused when it is read."""
    value = entry["checksum"] if "checksum" in entry else entry["crc32"]
    if value is not None and not isinstance(value, str):
        raise TypeError(f"checksum {value!r} is not a string")
    algorithm_of(value)
    return value


class Hasher:
    """A running checksum of one algorithm; ``update(buffer)``, then ``value()`` (the recorded form)."""

    def __init__(self, algorithm: str = ALGORITHM) -> None:
        if algorithm not in (ALGORITHM, LEGACY):
            raise ValueError(f"checksum algorithm {algorithm!r}; known: {ALGORITHM}, {LEGACY}")
        self.algorithm = algorithm
        self._xxh = xxhash.xxh3_128() if algorithm == ALGORITHM else None
        self._crc = 0

    def update(self, data) -> None:
        if self._xxh is not None:
            self._xxh.update(data)
        else:
            self._crc = zlib.crc32(data, self._crc)

    def value(self) -> str:
        if self._xxh is not None:
            return _PREFIX + self._xxh.hexdigest()
        return f"{self._crc & 0xFFFFFFFF:08x}"


def checksum(data, like: str | None = None) -> str:
    """The checksum of ``data`` (bytes-like) in the algorithm of ``like`` (default: XXH3-128)."""
    hasher = Hasher(algorithm_of(like) if like is not None else ALGORITHM)
    hasher.update(data)
    return hasher.value()


def file_checksum(path: str, like: str | None = None, chunk_bytes: int = 8 << 20) -> tuple[int, str]:
    """(size, checksum) of the file at ``path``, in the algorithm of ``like`` (a recorded value;
    default XXH3-128). A thread reads the next chunk while this one is summed."""
    with open(path, "rb") as f:
        return fileobj_checksum(f, like, chunk_bytes)


def fileobj_checksum(f, like: str | None = None, chunk_bytes: int = 8 << 20) -> tuple[int, str]:
    """(size, checksum) of an open binary file from its current position to its end."""
    hasher = Hasher(algorithm_of(like) if like is not None else ALGORITHM)
    if os.fstat(f.fileno()).st_size <= chunk_bytes:  # small files: one read, no thread
        data = f.read()
        hasher.update(data)
        return len(data), hasher.value()
    with concurrent.futures.ThreadPoolExecutor(1) as reader:
        bufs = [bytearray(chunk_bytes), bytearray(chunk_bytes)]
        size, turn = 0, 0
        pending = reader.submit(f.readinto, bufs[0])
        while True:
            n = pending.result()
            if not n:
                break
            turn ^= 1
            pending = reader.submit(f.readinto, bufs[turn])  # the other buffer: not being summed
            hasher.update(memoryview(bufs[turn ^ 1])[:n])
            size += n
    return size, hasher.value()
