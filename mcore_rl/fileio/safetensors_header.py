"""Checks a safetensors file's header against the file before any tensor is read from it.

The format: 8 bytes little-endian header length n, n bytes of a JSON object {name: {"dtype",
"shape", "data_offsets": [begin, end]}, "__metadata__": {...}}, then the data section, in which
the entries' byte ranges follow one another from 0 without gap or overlap and fill it exactly,
each ``end - begin`` = numel(shape) x the dtype's size. The safetensors library refuses a file
that breaks any of this with its own exception type; here the file and the entry are named.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

from mcore_rl.errors import CheckpointError

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the header's JSON
# safetensors dtype name -> bits per element
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
              "F8_E5M2FNUZ": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "I16": 16, "U16": 16, "F16": 16,
              "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64}


def _entry_bytes(name: str, entry: Any, path: str) -> tuple[int, int]:
    """(begin, end) of one entry, checked: a known dtype, a shape of integers >= 0, offsets of
    integers whose span is the shape's bytes."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{path}: header entry {name!r} is a JSON {type(entry).__name__}, not an object; "
                              "the file is not safetensors or is damaged; copy or export it again.")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    ints = (lambda v: isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                  for x in v))
    if dtype not in DTYPE_BITS or not ints(shape) or not ints(offsets) or len(offsets) != 2:
        raise CheckpointError(f"{path}: header entry {name!r} has dtype {dtype!r}, shape {shape!r}, data_offsets "
                              f"{offsets!r}: not a safetensors tensor entry (dtype one of {sorted(DTYPE_BITS)}, "
                              "integers >= 0); the file is damaged; copy or export it again.")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8 or offsets[1] - offsets[0] != bits // 8:
        raise CheckpointError(f"{path}: header entry {name!r}: data_offsets {offsets} span "
                              f"{offsets[1] - offsets[0]} bytes, its dtype {dtype} and shape {shape} need "
                              f"{bits / 8:g}; the header does not describe the data; copy or export the file again.")
    return offsets[0], offsets[1]


def check_safetensors(path: str) -> dict[str, Any]:
    """The header of the safetensors file ``path`` (tensor entries; ``__metadata__`` left out)
    after checking it as the safetensors library does: a readable JSON object within the file
    (and within ``MAX_HEADER_BYTES``), every entry's offsets matching its dtype and shape, the
    entries tiling the data section exactly. A truncated copy is named as such."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        header = f.read(n) if 0 < n <= min(size - 8, MAX_HEADER_BYTES) else b""
    try:
        meta = json.loads(header)
    except (ValueError, UnicodeDecodeError, RecursionError):
        meta = None
    if not isinstance(meta, dict):
        cap = f", headers are at most {MAX_HEADER_BYTES} bytes" if n > MAX_HEADER_BYTES else ""
        raise CheckpointError(f"{path}: unreadable safetensors header ({size} bytes on disk, header length "
                              f"{n}{cap}); the file is truncated or not safetensors; copy it again.")
    entries = {k: v for k, v in meta.items() if k != "__metadata__"}
    spans = sorted((_entry_bytes(k, v, path), k) for k, v in entries.items())
    end = 0
    for (begin, stop), name in spans:
        if begin != end:
            raise CheckpointError(f"{path}: header entry {name!r} starts at data byte {begin}, the entries before "
                                  f"it end at {end} (a gap or an overlap); the header is damaged; copy or export "
                                  "the file again.")
        end = stop
    if 8 + n + end > size:
        raise CheckpointError(f"{path} is truncated: {size} bytes on disk, its header needs {8 + n + end}; "
                              "copy the file again.")
    if 8 + n + end != size:
        raise CheckpointError(f"{path}: {size - 8 - n - end} bytes after the last tensor the header names "
                              f"({size} bytes on disk, the header accounts for {8 + n + end}); the file is "
                              "damaged; copy or export it again.")
    return entries
