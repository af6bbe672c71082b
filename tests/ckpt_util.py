"""Helpers that checkpoint tests run inside N-rank worlds: a trainable engine, a training step
with different data on each DP rank, megatron dist-checkpoint save, nested tensor comparison."""
from __future__ import annotations

import contextlib
import multiprocessing as mp

import torch

from tests.steps import _output_loss
from tests.tiny import rl_batch, tiny_config


def engine(layout_kwargs: dict, model_type: str = "llama", lr: float = 1e-2, **config):
    """A trainable ModelEngine (DDP + DistributedOptimizer, Adam) on a tiny random model."""
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout, seed=1234)
    args = model_args_from_hf(tiny_config(model_type, num_hidden_layers=2, **config))
    options = BuildOptions(moe=MoEOptions(router_dtype="fp64"))
    return ModelEngine(args, layout, "actor", active_platform(), options, optim=OptimConfig(lr=lr))


def train_step(eng, step: int) -> None:
    """One update on this DP rank's micro-batches (different data per DP rank and per step)."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_rank()
    mbs = []
    for i in range(2):
        b = rl_batch(200, batch=2, seed=1000 * step + 10 * dp + i)
        mbs.append({"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]})
    eng.run(mbs, _output_loss("actor", 200), forward_only=False)
    eng.step()


@contextlib.contextmanager
def writer_processes_allowed():
    """megatron's torch_dist writer forks workers and starts a spawn-context Manager; ranks of
    tests/dist.py are daemonic (no children allowed). Lifts that for the save and shuts the
    Manager down afterwards (ranks end with os._exit, which would leave it running)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    proc = mp.current_process()
    was = proc.daemon
    proc.daemon = False
    try:
        yield
    finally:
        proc.daemon = was
        queue = filesystem_async._results_queue
        if queue is not None:
            queue._manager.shutdown()
            filesystem_async._results_queue = None


def save(state: dict, path: str) -> None:
    import os

    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    with writer_processes_allowed():
        dist_checkpointing.save(state, path)
    torch.distributed.barrier()


def flat_tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Path -> tensor for every tensor (or ShardedTensor's data) in nested dicts/lists."""
    from megatron.core.dist_checkpointing.mapping import ShardedBase

    if isinstance(obj, ShardedBase):
        obj = obj.data
    if torch.is_tensor(obj):
        return {prefix: obj}
    out: dict[str, torch.Tensor] = {}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
    for k, v in items:
        out.update(flat_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def reseal(step_dir: str) -> None:
    """Rewrites the step's COMPLETE marker so its file list (sizes, CRC-32) matches what is on
    disk now: a tampered checkpoint whose attacker also rewrote the marker, so that the checks
    behind the marker (the unpickler's allowlists, path containment) are what must refuse it."""
    import json
    import os
    import zlib

    def file_crc32(p: str) -> tuple[int, str]:  # computed here, not by the code under test
        data = open(p, "rb").read()
        return len(data), f"{zlib.crc32(data):08x}"

    path = os.path.join(step_dir, "COMPLETE")
    with open(path) as f:
        marker = json.load(f)
    files = {}
    for d, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(d, name), step_dir)
            if rel != "COMPLETE":
                size, crc = file_crc32(os.path.join(d, name))
                files[rel] = {"size": size, "crc32": crc}
    marker["files"] = files
    with open(path, "w") as f:
        json.dump(marker, f)


def replace_rng_payloads(dist_dir: str, obj) -> None:
    """Every RNG ShardedObject payload replaced by ``torch.save(obj)`` appended to its file."""
    import dataclasses
    import io
    import os
    import pickle

    from torch.distributed.checkpoint import FileSystemReader

    md, buf = FileSystemReader(dist_dir).read_metadata(), io.BytesIO()
    torch.save(obj, buf)
    for index, info in list(md.storage_data.items()):
        if index.fqn.startswith("rng_state/"):
            path = os.path.join(dist_dir, info.relative_path)
            offset = os.path.getsize(path)
            with open(path, "ab") as f:
                f.write(buf.getvalue())
            md.storage_data[index] = dataclasses.replace(info, offset=offset, length=len(buf.getvalue()))
    with open(os.path.join(dist_dir, ".metadata"), "wb") as f:
        pickle.dump(md, f)
