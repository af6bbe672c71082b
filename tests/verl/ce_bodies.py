"""Sender bodies for tests/verl/test_verl_checkpoint_engine.py: a Megatron trainer at TP=2 or PP=2
streaming versions through mcore_rl's checkpoint engine (run by tests.dist.run_ranks), and a
plain sender process that kills itself part-way through a version."""
from __future__ import annotations

import asyncio
import os
import signal
from typing import Any, Iterator

import torch


def _topology(ce_cls, trainer_ranks: int, receivers: int, meta: dict) -> tuple[dict, dict]:
    metadata = [meta] + [{"leader": False}] * (trainer_ranks - 1) + [{"leader": True}] * receivers
    return ce_cls.build_topology(trainer_ranks, receivers, metadata)


def _perturb(chunks) -> None:
    """A training step's stand-in: moves layer 0's MLP input projection and the final norm (on
    the ranks holding them), nothing else."""
    with torch.no_grad():
        for chunk in chunks:
            for name, p in chunk.named_parameters():
                if ("layers.0.mlp.linear_fc1.weight" in name) or name.endswith("final_layernorm.weight"):
                    p.add_(0.01 * torch.arange(p.numel(), dtype=p.dtype).view(p.shape).sin())


def trainer_body(hf_dir: str, layout_kwargs: dict, plan: list[int], bucket_bytes: int, metas) -> dict:
    """Versions 1..len(plan) of a Megatron actor's export (``get_per_tensor_param``'s stream:
    ``export_hf_buckets`` flattened) to ``plan[v]`` receivers; the model moves before the last
    one. Rank 0 publishes each sync's store address on ``metas``. Returns (rank 0) every
    version's exported tensors and the engine's sync metrics."""
    from mcore_rl.integrations.verl.checkpoint_engine import McoreRLCheckpointEngine
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf_buckets
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "actor", active_platform(), hf_weights=hf_dir)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    ce = McoreRLCheckpointEngine(bucket_bytes, is_master=rank == 0, delta=True, timeout_s=120)
    exports, metrics = [], []
    for version, receivers in enumerate(plan, start=1):
        if version == len(plan):
            _perturb(engine.model)
        meta = ce.prepare()
        if rank == 0:
            metas.put(meta)
        meta = [meta if rank == 0 else None]
        torch.distributed.broadcast_object_list(meta, src=0)  # the trainer ranks learn the topology together
        actor, _ = _topology(McoreRLCheckpointEngine, world, receivers, meta[0])
        ce.init_process_group(actor["rank"][rank], actor["world_size"][rank], actor["master"][rank])
        exported: dict[str, torch.Tensor] = {}

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for bucket in export_hf_buckets(engine.model, args, "actor", bucket_bytes=1):
                for name, tensor in bucket:
                    exported[name] = tensor.clone()
                    yield name, tensor

        metrics.append(asyncio.run(ce.send_weights(stream(), global_steps=version)))
        ce.finalize()
        exports.append(exported)
    return {"exports": exports, "metrics": metrics} if rank == 0 else {"metrics": metrics}


def killed_sender(weights: dict[str, torch.Tensor], bucket_bytes: int, metas, die_after: int) -> None:
    """Sends version 1 whole, then dies by SIGKILL after ``die_after`` tensors of version 2 (some
    of its buckets on the wire already)."""
    from mcore_rl.integrations.verl.checkpoint_engine import McoreRLCheckpointEngine

    ce = McoreRLCheckpointEngine(bucket_bytes, is_master=True, timeout_s=60)
    for version in (1, 2):
        meta = ce.prepare()
        metas.put(meta)
        actor, _ = _topology(McoreRLCheckpointEngine, 1, 1, meta)
        ce.init_process_group(actor["rank"][0], actor["world_size"][0], actor["master"][0])

        def stream() -> Iterator[tuple[str, torch.Tensor]]:
            for i, (name, tensor) in enumerate(weights.items()):
                if version == 2 and i == die_after:
                    os.kill(os.getpid(), signal.SIGKILL)
                yield name, tensor + (version - 1)

        asyncio.run(ce.send_weights(stream(), global_steps=version))
        ce.finalize()


def receiver_links(ce_cls, trainer_ranks: int, receivers: int, meta: dict) -> list[Any]:
    """The links verl's rollout workers would hand their servers for one sync."""
    _, rollout = _topology(ce_cls, trainer_ranks, receivers, meta)
    links = []
    for i in range(receivers):
        ce = ce_cls(1 << 20)
        ce.init_process_group(rollout["rank"][i], rollout["world_size"][i], rollout["master"][i])
        links.append(ce.receive_weights().link)
    return links
