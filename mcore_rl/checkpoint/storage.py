"""Checkpoint storage: durable writes, the torch_dist file inventory, node-local roots.

Durability: ``write_json_atomic`` (temp file + fsync + rename + dir fsync) and ``fsync_tree``.
Inventory: ``expected_files`` lists every file a torch_dist checkpoint must hold with its minimum
size (from the ``.metadata`` storage info); ``check_files`` names what is missing or truncated.
Node-local roots: ``detect_storage`` finds whether all nodes see one file system at the root
(probe files); ``sync_step_to_all_nodes`` sends each node the files it lacks over
torch.distributed, so every node holds a full checkpoint. Node identity comes from torchrun's
``GROUP_RANK`` / ``LOCAL_RANK`` environment variables, never from host names.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import uuid
from typing import Any, Iterator, Literal

import torch

from mcore_rl.checkpoint.errors import CheckpointError
from mcore_rl.checkpoint.safe_load import UnsafeCheckpointError, restricted_unpickling

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20  # bounded transfer buffers: a 10 GB shard never sits in memory at once
TMP_SUFFIX = ".mcore_rl_tmp"  # half-written files carry it; listings and syncs skip them
PROBE_PREFIX = ".probe_"
FIXED_FILES = (".metadata", "common.pt", "metadata.json")  # written by rank 0 beside the shards


def _safe_loading() -> contextlib.AbstractContextManager:
    """The one place where reading pickled checkpoint metadata is guarded: torch DCP's
    ``.metadata`` is a pickle, read through the allowlists of ``safe_load``."""
    return restricted_unpickling()


# ----------------------------------------------------------------------------- node identity


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise CheckpointError(
            f"environment variable {name}={raw!r} is not an integer; launch with torchrun "
            f"(it sets {name}) or set it to this process's value."
        ) from None


def node_leader() -> bool:
    """True on the process with ``LOCAL_RANK == 0`` (it writes the node's shared files)."""
    return _env_int("LOCAL_RANK", 0) == 0


def node_id() -> int:
    """This process's node: torchrun's ``GROUP_RANK`` (0 when unset, i.e. a single node)."""
    return _env_int("GROUP_RANK", 0)


# ----------------------------------------------------------------------------- durable files


def fsync_path(path: str) -> None:
    """fsync a file or a directory (opened read-only)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_bytes_atomic(path: str, chunks: Iterator[bytes]) -> int:
    """Writes ``chunks`` to a temp file beside ``path``, fsyncs, renames, fsyncs the dir.

    A crash at any point leaves ``path`` either absent or with its previous complete content.
    Returns the number of bytes written.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)  # every writer makes its own dirs (no peer made them here)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{os.path.basename(path)}.", suffix=TMP_SUFFIX)
    written = 0
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                written += len(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(parent)
    return written


def write_json_atomic(path: str, obj: Any) -> None:
    """Writes ``obj`` as JSON to ``path`` durably and atomically; makes parent dirs.

    Temp file + fsync + rename + dir fsync: readers see the old file or the new one, never a part.
    """
    try:
        text = json.dumps(obj, indent=1, sort_keys=True, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{path}: the object to write is not JSON-able ({e}); pass plain dicts, lists, "
            "strings, finite numbers and booleans."
        ) from e
    _write_bytes_atomic(path, iter([text.encode()]))


def read_json(path: str) -> dict:
    """The JSON object in ``path``; CheckpointError naming the file if missing or not an object."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(
            f"{path} does not exist; the checkpoint is incomplete or the path is wrong "
            "(pick a complete step, one with a COMPLETE marker)."
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{path} is not valid JSON ({e}); the file is damaged: pick another complete step "
            "or remove the damaged one."
        ) from None
    if not isinstance(data, dict):
        raise CheckpointError(
            f"{path} holds a JSON {type(data).__name__}, expected an object; the file is damaged "
            "or not a checkpoint file."
        )
    return data


def fsync_tree(directory: str) -> None:
    """fsyncs every file and directory under ``directory`` (files first, then dirs bottom-up)."""
    for dirpath, _, files in os.walk(directory, topdown=False):
        for name in files:
            path = os.path.join(dirpath, name)
            if not os.path.islink(path):
                fsync_path(path)
        fsync_path(dirpath)


# ----------------------------------------------------------------------------- inventory


def expected_files(dist_ckpt_dir: str) -> dict[str, int]:
    """Every file a torch_dist checkpoint must hold: relpath -> minimum size in bytes.

    Data files: the end (offset + length) of their last item in the ``.metadata`` storage info;
    ``.metadata``, ``common.pt`` and ``metadata.json``: size > 0.
    """
    from torch.distributed.checkpoint import FileSystemReader

    meta_path = os.path.join(dist_ckpt_dir, ".metadata")
    if not os.path.isfile(meta_path):
        raise CheckpointError(
            f"{meta_path} does not exist: {dist_ckpt_dir} is not a complete torch_dist checkpoint; "
            "pick a complete step (one with a COMPLETE marker)."
        )
    try:
        with _safe_loading():
            metadata = FileSystemReader(dist_ckpt_dir).read_metadata()
    except (CheckpointError, UnsafeCheckpointError):
        raise
    except Exception as e:  # a truncated pickle raises EOFError, UnpicklingError, ...
        raise CheckpointError(
            f"{meta_path} cannot be read ({type(e).__name__}: {e}); the file is damaged: pick "
            "another complete step."
        ) from e
    sizes = {name: 1 for name in FIXED_FILES}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end, 1)
    return sizes


def check_files(base_dir: str, expected: dict[str, int]) -> None:
    """Raises CheckpointError listing every file of ``expected`` (relpath -> minimum size)
    missing under ``base_dir`` or shorter than its minimum size."""
    missing, truncated = [], []
    for rel, min_size in sorted(expected.items()):
        path = os.path.join(base_dir, rel)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            missing.append(rel)
            continue
        if size < min_size:
            truncated.append(f"{rel} ({size} bytes, expected at least {min_size})")
    if missing or truncated:
        parts = []
        if missing:
            parts.append(f"missing: {', '.join(missing)}")
        if truncated:
            parts.append(f"truncated: {', '.join(truncated)}")
        raise CheckpointError(
            f"checkpoint files under {base_dir} are incomplete ({'; '.join(parts)}); this step "
            "cannot be used: resume from another complete step (resume_mode: path)."
        )


# ----------------------------------------------------------------------------- collectives


def _comm_device() -> torch.device:
    # NCCL moves only CUDA tensors; gloo (and the CPU platform) only CPU ones
    if torch.distributed.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _node_leaders() -> dict[int, int]:
    """Collective: node id -> global rank of its leader; checks each node has exactly one."""
    dev = _comm_device()
    mine = torch.tensor([node_id(), 1 if node_leader() else 0], dtype=torch.int64, device=dev)
    table = [torch.empty_like(mine) for _ in range(torch.distributed.get_world_size())]
    torch.distributed.all_gather(table, mine)
    leaders: dict[int, list[int]] = {}
    nodes: set[int] = set()
    for rank, row in enumerate(table):
        node, is_leader = (int(v) for v in row.cpu())
        nodes.add(node)
        if is_leader:
            leaders.setdefault(node, []).append(rank)
    bad = {n: leaders.get(n, []) for n in sorted(nodes) if len(leaders.get(n, [])) != 1}
    if bad:
        raise CheckpointError(
            "each node needs exactly one process with LOCAL_RANK=0, but got (node: leader ranks) "
            f"{bad}; launch with torchrun (it sets GROUP_RANK and LOCAL_RANK per process) or set "
            "GROUP_RANK to the node index and LOCAL_RANK to the rank within the node."
        )
    return {n: ranks[0] for n, ranks in sorted(leaders.items())}


def all_gather_bytes(payload: bytes) -> list[bytes]:
    """Collective: every rank's ``payload``, indexed by global rank (no pickling)."""
    dev = _comm_device()
    world = torch.distributed.get_world_size()
    size = torch.tensor([len(payload)], dtype=torch.int64, device=dev)
    sizes = [torch.empty_like(size) for _ in range(world)]
    torch.distributed.all_gather(sizes, size)
    lengths = [int(s.item()) for s in sizes]
    buf = torch.zeros(max(max(lengths), 1), dtype=torch.uint8)  # host: filled from bytes, then sent on dev
    if payload:
        buf[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    bufs = [torch.empty_like(buf, device=dev) for _ in range(world)]
    torch.distributed.all_gather(bufs, buf.to(dev))
    return [bytes(b[:n].cpu().numpy().tobytes()) for b, n in zip(bufs, lengths)]


def any_rank(flags: list[int]) -> list[int]:
    """Collective: element-wise max of ``flags`` over all ranks."""
    t = torch.tensor(flags, dtype=torch.int64, device=_comm_device())
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return [int(v) for v in t.cpu()]


def detect_storage(root: str, announce: bool = True) -> Literal["shared", "node_local"]:
    """Collective over the world: ``"shared"`` when every rank sees one file system at ``root``;
    ``announce``: rank 0 logs the mode.

    Each node's leader writes ``<root>/.probe_<uuid>_<node>``; after a barrier every rank checks
    that it sees every node's probe; the probes are removed. One process: ``"shared"``.
    """
    root = os.path.abspath(root)
    if not _distributed():
        return "shared"
    leaders = _node_leaders()
    nodes = sorted(leaders)
    first = torch.distributed.get_rank() == 0
    token = all_gather_bytes(uuid.uuid4().hex.encode() if first else b"")[0]
    probe = os.path.join(root, f"{PROBE_PREFIX}{token.decode()}_{node_id()}")
    failed, reason = [0] * len(nodes), ""
    if node_leader():
        try:
            os.makedirs(root, exist_ok=True)
            with open(probe, "w") as f:
                f.write(str(node_id()))
        except OSError as e:
            failed[nodes.index(node_id())], reason = 1, f" ({e})"
    failed = any_rank(failed)  # also the barrier between writing and looking
    if any(failed):
        bad = [n for n, f in zip(nodes, failed) if f]
        raise CheckpointError(
            f"checkpoint root {root} is not writable on node(s) {bad}{reason}; give a directory "
            "every node can create and write (checkpoint.root)."
        )
    seen = all(
        os.path.exists(os.path.join(root, f"{PROBE_PREFIX}{token.decode()}_{n}")) for n in nodes
    )
    unseen = any_rank([0 if seen else 1])[0]
    if node_leader():
        with contextlib.suppress(FileNotFoundError):
            os.unlink(probe)
    mode: Literal["shared", "node_local"] = "node_local" if unseen else "shared"
    if announce and torch.distributed.get_rank() == 0:
        if mode == "shared":
            logger.info("checkpoint root %s: shared by all %d node(s)", root, len(nodes))
        else:
            logger.info(
                "checkpoint root %s: node-local on %d nodes; each node gets the files it lacks "
                "from its peers after every save", root, len(nodes))
    return mode


# ----------------------------------------------------------------------------- node-local sync


def _listing(step_dir: str) -> dict[str, int]:
    """relpath -> size of every regular file under ``step_dir`` (temp files and probes skipped)."""
    out: dict[str, int] = {}
    for dirpath, _, files in os.walk(step_dir):
        for name in files:
            if name.endswith(TMP_SUFFIX) or name.startswith(PROBE_PREFIX):
                continue
            path = os.path.join(dirpath, name)
            if os.path.isfile(path) and not os.path.islink(path):
                out[os.path.relpath(path, step_dir)] = os.path.getsize(path)
    return out


Transfer = tuple[str, int, int, list[int]]  # relpath, size, source node, receiving nodes


def _transfer_plan(listings: dict[int, dict[str, int]], step_dir: str) -> list[Transfer]:
    """(relpath, size, source node, receiving nodes) for every file some node lacks; the same on
    every rank (sorted). Raises when two nodes hold one file with different sizes."""
    plan = []
    for rel in sorted(set().union(*listings.values())):
        holders = {n: files[rel] for n, files in listings.items() if rel in files}
        if len(set(holders.values())) > 1:
            raise CheckpointError(
                f"{os.path.join(step_dir, rel)} differs between nodes (node: size) {holders}; "
                "two nodes wrote the same file differently: write node-specific files under "
                "node-specific names, then save again."
            )
        receivers = [n for n in listings if rel not in listings[n]]
        if receivers:
            rel_norm = os.path.normpath(rel)
            if os.path.isabs(rel_norm) or rel_norm.split(os.sep)[0] == "..":
                raise CheckpointError(f"refusing to sync {rel!r}: it leaves {step_dir}.")
            plan.append((rel, next(iter(holders.values())), min(holders), receivers))
    return plan


def _send_file(path: str, size: int, dst_ranks: list[int], chunk_bytes: int) -> bool:
    """Sends ``size`` bytes of ``path`` to each of ``dst_ranks`` in chunks; False if short."""
    dev, intact = _comm_device(), True
    with open(path, "rb") as f:
        for start in range(0, size, chunk_bytes):
            n = min(chunk_bytes, size - start)
            data = f.read(n)
            if len(data) != n:  # the file changed since the listing: send zeros, fail after
                intact, data = False, data.ljust(n, b"\0")
            tensor = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
            for dst in dst_ranks:
                torch.distributed.send(tensor, dst)
    return intact


def _recv_file(path: str, size: int, src_rank: int, chunk_bytes: int) -> None:
    """Receives ``size`` bytes from ``src_rank`` into ``path`` (atomic, fsynced, dirs made here)."""
    dev = _comm_device()

    def chunks() -> Iterator[bytes]:
        for start in range(0, size, chunk_bytes):
            tensor = torch.empty(min(chunk_bytes, size - start), dtype=torch.uint8, device=dev)
            torch.distributed.recv(tensor, src_rank)
            yield tensor.cpu().numpy().tobytes()

    _write_bytes_atomic(path, chunks())


def sync_step_to_all_nodes(step_dir: str, chunk_bytes: int = CHUNK_BYTES) -> None:
    """Collective: every node ends with the union of the files under ``step_dir``.

    Node leaders exchange listings; each file some node lacks is sent by the lowest node that has
    it, leader to leader, as uint8 tensors of at most ``chunk_bytes``; receivers write it
    atomically (making dirs themselves) and fsync. On a shared root all listings agree and
    nothing moves. Raises CheckpointError on every rank if a file changed during the transfer.
    """
    if not _distributed():
        return
    if chunk_bytes < 1:
        raise CheckpointError(f"chunk_bytes={chunk_bytes}; use a positive byte count.")
    step_dir = os.path.abspath(step_dir)
    leaders = _node_leaders()
    mine = json.dumps(_listing(step_dir)).encode() if node_leader() else b""
    payloads = all_gather_bytes(mine)
    listings = {n: json.loads(payloads[r].decode()) for n, r in leaders.items()}
    plan = _transfer_plan(listings, step_dir)
    me, lead, changed, received = node_id(), node_leader(), 0, 0
    for rel, size, src, receivers in plan:  # same order on every leader: no deadlock
        path = os.path.join(step_dir, rel)
        if lead and me == src:
            dsts = [leaders[n] for n in receivers]
            changed |= 0 if _send_file(path, size, dsts, chunk_bytes) else 1
        elif lead and me in receivers:
            _recv_file(path, size, leaders[src], chunk_bytes)
            received += size
        # per file, so the other ranks wait one file's transfer, not the whole sync, within the
        # process group's collective timeout
        torch.distributed.barrier()
    if lead and any(me in r for *_, r in plan):
        fsync_tree(step_dir)
        logger.info("node %d: received %d byte(s) of %s from peer nodes",
                    me, received, step_dir)
    if any_rank([changed])[0]:
        raise CheckpointError(
            f"a file under {step_dir} changed while it was sent to other nodes; the step is not "
            "complete on every node: save it again."
        )
