"""A zero-copy view of the tensor in one ``torch.save`` payload held in memory.

A torch_dist shard item is a ``torch.save`` zip of one tensor: a pickle (``*/data.pkl``) and the
storage bytes, stored uncompressed (``*/data/0``). ``torch.load`` copies those bytes into a new
storage; when the caller already knows the tensor's dtype and shape (DCP's metadata) and the
writer saved it compact (mcore_rl's writer saves every tensor contiguous, storage = tensor), the
tensor is a view of the payload buffer at the record's offset. Anything else (another record
layout, a size that does not match, compression) returns None and the caller uses torch.load.
"""
from __future__ import annotations

import math
import struct

import torch

_EOCD = b"PK\x05\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"


def _storage_record(buf: memoryview) -> tuple[int, int] | None:
    """(offset, size) in ``buf`` of the single ``*/data/<key>`` record, stored uncompressed."""
    tail = bytes(buf[max(0, len(buf) - 65557):])
    at = tail.rfind(_EOCD)
    if at < 0 or len(tail) - at < 22:
        return None
    entries, cd_size, cd_offset = struct.unpack_from("<HII", tail, at + 10)
    found = []
    pos = cd_offset
    for _ in range(entries):
        head = bytes(buf[pos: pos + 46])
        if len(head) < 46 or head[:4] != _CENTRAL:
            return None
        method, size, name_len, extra_len, comment_len, local = (
            struct.unpack_from("<H", head, 10)[0], struct.unpack_from("<I", head, 24)[0],
            *struct.unpack_from("<HHH", head, 28), struct.unpack_from("<I", head, 42)[0])
        name = bytes(buf[pos + 46: pos + 46 + name_len]).decode(errors="replace")
        if "/data/" in name:
            found.append((method, size, local))
        pos += 46 + name_len + extra_len + comment_len
    if len(found) != 1 or found[0][0] != 0:
        return None
    _, size, local = found[0]
    head = bytes(buf[local: local + 30])
    if len(head) < 30 or head[:4] != _LOCAL:
        return None
    name_len, extra_len = struct.unpack_from("<HH", head, 26)
    start = local + 30 + name_len + extra_len
    return (start, size) if start + size <= len(buf) else None


def tensor_view(payload: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """The tensor of dtype/shape stored in ``payload`` (uint8 [n]: a ``torch.save`` zip), a view
    of it; None when the payload is not one compact uncompressed storage of exactly that size."""
    record = _storage_record(memoryview(payload.numpy()))
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if record is None or record[1] != nbytes:
        return None
    if numel == 0:
        return torch.empty(shape, dtype=dtype, device=payload.device)
    start = record[0]
    return payload[start: start + nbytes].view(dtype).view(shape)
