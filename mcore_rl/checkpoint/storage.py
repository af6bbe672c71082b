"""Checkpoint storage: durable writes, the torch_dist file inventory, node-local roots.

Durability: ``write_json_atomic`` (temp file + fsync + rename + dir fsync) and ``fsync_tree``.
Inventory: ``expected_files`` lists every file a torch_dist checkpoint must hold with its minimum
size (from the ``.metadata`` storage info); ``check_files`` names what is missing or truncated.
Node-local roots: ``detect_storage`` finds whether all nodes see one file system at the root
(probe files); ``is_writer`` says which ranks write a root's shared files (rank 0 on a shared
root, each node's leader on node-local disks; ``peer_sync`` copies the files between nodes).
Node identity comes from the launcher's environment, never from host names: ``MCORE_RL_NODE_RANK``
/ ``MCORE_RL_LOCAL_RANK`` where a launcher without torchrun's variables sets them (the verl
integration does, from Ray's node ids), else torchrun's ``GROUP_RANK`` / ``LOCAL_RANK``.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import uuid
from typing import Any, Callable, Iterator, Literal

import torch

from mcore_rl.checkpoint.collective import all_gather_bytes, any_rank, comm_device, distributed
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.files import fsync_path  # noqa: F401 - storage.fsync_path for its users
from mcore_rl.fileio.paths import contained
from mcore_rl.fileio.safe_load import UnsafeCheckpointError, restricted_unpickling

logger = logging.getLogger(__name__)

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


NODE_ENV, LOCAL_ENV = "MCORE_RL_NODE_RANK", "MCORE_RL_LOCAL_RANK"  # set by launchers without torchrun's


def node_leader() -> bool:
    """True on the process whose rank within its node is 0 (it writes the node's shared files):
    ``MCORE_RL_LOCAL_RANK``, else torchrun's ``LOCAL_RANK`` (0 when unset)."""
    return _env_int(LOCAL_ENV if LOCAL_ENV in os.environ else "LOCAL_RANK", 0) == 0


def node_id() -> int:
    """This process's node: ``MCORE_RL_NODE_RANK``, else torchrun's ``GROUP_RANK`` (0 when unset,
    i.e. a single node)."""
    return _env_int(NODE_ENV if NODE_ENV in os.environ else "GROUP_RANK", 0)


# ----------------------------------------------------------------------------- durable files


def write_bytes_atomic(path: str, chunks: Iterator[bytes], keep_if: Callable[[], bool] | None = None) -> int:
    """Writes ``chunks`` to a temp file beside ``path``, fsyncs, renames, fsyncs the dir.

    A crash at any point leaves ``path`` either absent or with its previous complete content.
    ``keep_if``: asked after the last chunk; False leaves ``path`` as it was (e.g. the bytes
    that arrived have the wrong checksum). Returns the number of bytes written.
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
        if keep_if is not None and not keep_if():
            os.unlink(tmp)
            return written
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_path(parent)
    return written


def write_json_atomic(path: str, obj: Any) -> None:
    """Writes ``obj`` as JSON to ``path`` durably and atomically; makes parent dirs. Keys keep
    their order (a trainer's records come back as they were written).

    Temp file + fsync + rename + dir fsync: readers see the old file or the new one, never a part.
    """
    try:
        text = json.dumps(obj, indent=1, allow_nan=False) + "\n"
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{path}: the object to write is not JSON-able ({e}); pass plain dicts, lists, "
            "strings, finite numbers and booleans."
        ) from e
    write_bytes_atomic(path, iter([text.encode()]))


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


def fsync_dirs(directory: str) -> None:
    """fsyncs ``directory`` and every directory under it (bottom-up), not following links: the
    names of files written there become durable (each writer fsyncs its own files' data)."""
    for dirpath, _, _ in os.walk(directory, topdown=False):
        if not os.path.islink(dirpath):
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
        if info.relative_path not in sizes:  # torch's reader would open it: checked once per name
            contained(dist_ckpt_dir, info.relative_path, meta_path)
        end = int(info.offset) + int(info.length)
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end, 1)
    return sizes


def check_files(base_dir: str, expected: dict[str, int]) -> None:
    """Raises CheckpointError listing every file of ``expected`` (relpath -> minimum size)
    missing under ``base_dir`` or shorter than its minimum size."""
    missing, truncated = [], []
    for rel, min_size in sorted(expected.items()):
        path = contained(base_dir, rel, os.path.join(base_dir, ".metadata"))
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


# ----------------------------------------------------------------------------- nodes and roles


def node_leaders() -> dict[int, int]:
    """Collective: node id -> global rank of its leader; checks each node has exactly one."""
    dev = comm_device()
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
            f"{NODE_ENV} to the node index and {LOCAL_ENV} to the rank within the node."
        )
    return {n: ranks[0] for n, ranks in sorted(leaders.items())}


def node_ranks() -> list[int]:
    """Collective: the global ranks of this process's node, ascending."""
    ids = [int(raw) for raw in all_gather_bytes(str(node_id()).encode())]
    return [r for r, n in enumerate(ids) if n == node_id()]


Mode = Literal["shared", "node_local"]


def is_writer(mode: Mode) -> bool:
    """Whether this rank writes and deletes a root's shared files (markers, tracker, removals):
    rank 0 on a shared root, each node's leader on node-local disks."""
    if not distributed():
        return True
    return torch.distributed.get_rank() == 0 if mode == "shared" else node_leader()


def detect_storage(root: str, announce: bool = True, required: bool = True) -> Mode | None:
    """Collective over the world: ``"shared"`` when every rank sees one file system at ``root``;
    ``announce``: rank 0 logs the mode; ``required=False``: None (not an error) when a node
    cannot write its probe (a read-only root).

    Each node's leader writes ``<root>/.probe_<uuid>_<node>``; after a barrier every rank checks
    that it sees every node's probe; the probes are removed. One process: ``"shared"``.
    """
    root = os.path.abspath(root)
    if not distributed():
        return "shared"
    leaders = node_leaders()
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
    if any(failed) and not required:
        if node_leader():
            with contextlib.suppress(OSError):
                os.unlink(probe)
        return None
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
        with contextlib.suppress(OSError):
            os.unlink(probe)
    mode: Mode = "node_local" if unseen else "shared"
    if announce and torch.distributed.get_rank() == 0:
        if mode == "shared":
            logger.info("checkpoint root %s: shared by all %d node(s)", root, len(nodes))
        else:
            logger.info(
                "checkpoint root %s: node-local on %d nodes; each node gets the files it lacks "
                "from its peers after every save", root, len(nodes))
    return mode
