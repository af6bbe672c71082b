"""Node-local roots: after a save every node gets, from its peers, the files of the step it
lacks, so each node holds a full checkpoint.

The plan follows the manifest (``integrity.gather_manifest``: every file with its size, CRC-32
and writing node), not directory listings: a node holds a file when one of its ranks wrote it in
this save, or when its copy has the recorded CRC-32 (checked only for files it did not write:
after a restart a node may hold an earlier run's file of the same size). Each missing or
differing file goes from the lowest writing node, leader to leader, in bounded chunks; the
receiver checks size and CRC-32 of what arrived and renames it into place atomically.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Iterator

import torch

from mcore_rl.checkpoint import storage
from mcore_rl.checkpoint.collective import (agreed, all_gather_bytes, comm_device, distributed, gather_errors,
                                            raise_if_any)
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.checksum import Hasher, algorithm_of, file_checksum
from mcore_rl.checkpoint.integrity import Manifest
from mcore_rl.fileio.paths import contained

logger = logging.getLogger("mcore_rl.checkpoint")

CHUNK_BYTES = 64 << 20  # bounded transfer buffers: a 10 GB shard never sits in memory at once
Transfer = tuple[str, int, int, list[int]]  # relpath, size, source node, receiving nodes


def _needs(step_dir: str, manifest: Manifest, me: int) -> list[str]:
    """The files this node lacks or holds with other content (its own writes are trusted)."""
    out = []
    for rel, entry in sorted(manifest.items()):
        if entry.node == me:
            continue
        path = contained(step_dir, rel, "the step's manifest")
        if not os.path.isfile(path) or os.path.islink(path):
            out.append(rel)
        elif entry.crc32 is None or file_checksum(path, like=entry.crc32) != (entry.size, entry.crc32):
            logger.warning("%s differs from the copy written on node %d: replacing it", path, entry.node)
            out.append(rel)
    return out


def transfer_plan(manifest: Manifest, needs: dict[int, list[str]]) -> list[Transfer]:
    """(relpath, size, source node, receiving nodes) per file some node needs; sorted, so the
    same on every rank. The source is the file's writing node."""
    plan = []
    for rel in sorted({r for rels in needs.values() for r in rels}):
        receivers = sorted(n for n, rels in needs.items() if rel in rels)
        source = manifest[rel].node
        if source in receivers:
            raise CheckpointError(f"{rel}: its writing node {source} lacks it; the step is damaged: save it again.")
        plan.append((rel, manifest[rel].size, source, receivers))
    return plan


def _send_file(path: str, size: int, dst_ranks: list[int], chunk_bytes: int) -> str | None:
    """Sends ``size`` bytes of ``path`` to each of ``dst_ranks`` in chunks; an error text when
    the file could not be read whole (zeros are sent instead: the receivers keep in step)."""
    dev, error = comm_device(), None
    try:
        f = open(path, "rb")
    except OSError as e:
        f, error = None, f"{type(e).__name__}: {e}"
    try:
        for start in range(0, size, chunk_bytes):
            n = min(chunk_bytes, size - start)
            data = b""
            if f is not None and error is None:
                try:
                    data = f.read(n)
                except OSError as e:
                    error = f"{type(e).__name__}: {e}"
            if len(data) != n:  # the file changed since the manifest: send zeros, fail after
                error = error or f"{path} is shorter than the {size} bytes recorded"
                data = data.ljust(n, b"\0")
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
            for dst in dst_ranks:
                torch.distributed.send(tensor, dst)
    finally:
        if f is not None:
            f.close()
    return error


def _recv_file(path: str, size: int, crc: str | None, src_rank: int, chunk_bytes: int) -> str | None:
    """Receives ``size`` bytes from ``src_rank`` into ``path`` (atomic, fsynced, dirs made
    here); an error text (and the old file kept) when writing failed or the bytes do not have
    the recorded checksum. Every chunk is received whatever happens: the sender goes on."""
    dev, hasher = comm_device(), Hasher(algorithm_of(crc))

    def chunks() -> Iterator[bytes]:
        for start in range(0, size, chunk_bytes):
            tensor = torch.empty(min(chunk_bytes, size - start), dtype=torch.uint8, device=dev)
            torch.distributed.recv(tensor, src_rank)
            data = tensor.cpu().numpy().tobytes()
            hasher.update(data)
            yield data

    def matches() -> bool:
        return crc is None or hasher.value() == crc

    received = chunks()
    try:
        storage.write_bytes_atomic(path, received, keep_if=matches)
    except OSError as e:
        for _ in received:  # drain: the sender sends every chunk
            pass
        return f"writing {path}: {type(e).__name__}: {e}"
    if not matches():
        return f"{path} arrived with checksum {hasher.value()}, the manifest records {crc}"
    return None


def sync_step_to_all_nodes(step_dir: str, manifest: Manifest, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Collective: every node ends with every file of ``manifest`` under ``step_dir``, with the
    recorded content. Raises the same CheckpointError on every rank when a file cannot be made
    whole on some node (changed during the transfer, damaged on the way, a disk error)."""
    if not distributed():
        return
    if chunk_bytes < 1:
        raise CheckpointError(f"chunk_bytes={chunk_bytes}; use a positive byte count.")
    step_dir = os.path.abspath(step_dir)
    leaders, me, lead = storage.node_leaders(), storage.node_id(), storage.node_leader()
    mine = agreed(lambda: _needs(step_dir, manifest, me) if lead else [], f"comparing {step_dir} with its manifest")
    payloads = all_gather_bytes(json.dumps(mine).encode() if lead else b"")
    needs = {n: json.loads(payloads[r]) for n, r in leaders.items()}
    plan = transfer_plan(manifest, needs)
    error, received = None, 0
    for rel, size, src, receivers in plan:  # same order on every leader: no deadlock
        path = os.path.join(step_dir, rel)
        if lead and me == src:
            error = _send_file(path, size, [leaders[n] for n in receivers], chunk_bytes) or error
        elif lead and me in receivers:
            error = _recv_file(path, size, manifest[rel].crc32, leaders[src], chunk_bytes) or error
            received += size
        # per file, so the other ranks wait one file's transfer, not the whole sync, within the
        # process group's collective timeout
        torch.distributed.barrier()
    if lead and any(me in r for *_, r in plan):
        logger.info("node %d: received %d byte(s) of %s from peer nodes", me, received, step_dir)
    raise_if_any(gather_errors(error), f"copying {step_dir} between nodes (the step is not complete "
                                        "on every node: save it again)")
