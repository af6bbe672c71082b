"""MINIMAL LOCAL STAND-IN (TODO(lead): replace with the ckpt-storage helper's storage.py at merge).

Durable writes, the torch_dist file inventory, shared-vs-node-local detection. Only the API the
manager calls is here; node-local peer sync is not implemented in this stand-in (an error)."""
from __future__ import annotations

import json
import os
import tempfile
from typing import Literal

import torch

from mcore_rl.checkpoint.errors import CheckpointError

FIXED_FILES = (".metadata", "metadata.json", "common.pt")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: str, obj) -> None:
    """Temp file + fsync + rename + dir fsync; makes parent dirs."""
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=parent, prefix=".tmp_")
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(parent)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def fsync_tree(directory: str) -> None:
    """fsync every file and dir under ``directory``."""
    for dirpath, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(dirpath)


def expected_files(dist_ckpt_dir: str) -> dict[str, int]:
    """relpath -> minimum size: every storage file named in the torch_dist ``.metadata`` (end of
    its last item) plus the fixed files (size >= 1)."""
    from torch.distributed.checkpoint import FileSystemReader

    sizes = {name: 1 for name in FIXED_FILES}
    meta = FileSystemReader(dist_ckpt_dir).read_metadata()
    for info in (meta.storage_data or {}).values():
        end = info.offset + info.length
        sizes[info.relative_path] = max(sizes.get(info.relative_path, 0), end)
    return sizes


def node_leader() -> bool:
    """LOCAL_RANK == 0 (torchrun)."""
    return os.environ.get("LOCAL_RANK", "0") == "0"


def detect_storage(root: str) -> Literal["shared", "node_local"]:
    """Collective: each node's leader writes a probe; all ranks count the probes they see."""
    node = os.environ.get("GROUP_RANK", "0")
    probe_dir = os.path.join(root, ".storage_probe")
    os.makedirs(probe_dir, exist_ok=True)
    if node_leader():
        write_json_atomic(os.path.join(probe_dir, f"node_{node}"), {"node": node})
    nodes = torch.tensor([1 if node_leader() else 0], dtype=torch.int64)
    torch.distributed.all_reduce(nodes)
    torch.distributed.barrier()
    seen = len([n for n in os.listdir(probe_dir) if n.startswith("node_")])
    flag = torch.tensor([1 if seen >= int(nodes.item()) else 0], dtype=torch.int64)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    if node_leader():
        os.remove(os.path.join(probe_dir, f"node_{node}"))
    return "shared" if flag.item() else "node_local"


def sync_step_to_all_nodes(step_dir: str) -> None:
    """Stand-in: shared roots need nothing; node-local sync is the storage helper's."""
    raise CheckpointError(
        f"{step_dir}: the checkpoint root is node-local and peer sync is not in this build; "
        "use a root on storage shared by all nodes.")
