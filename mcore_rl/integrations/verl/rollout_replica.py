"""verl's rollout interface for the CPU rollout server (``actor_rollout_ref.rollout.name=mcore_rl``).

- ``McoreRLReplica`` (verl's ``RolloutReplica``): one ``RolloutServer`` Ray actor per replica, on
  the node of the replica's first trainer worker, with ``num_cpus=0`` (it computes while the
  trainer waits: verl's synchronous trainer alternates the two), named
  ``mcore_rl_server_<replica>`` so the workers' adapters find it.
- ``ServerAdapter`` (verl's ``BaseRollout``, built in every trainer worker): ``update_weights``
  drains verl's ``get_per_tensor_param()`` generator on every rank (it is collective: TP/PP
  gathers), and the replica's first rank pushes the tensors to its server in buckets of
  ``checkpoint_engine.update_weights_bucket_megabytes``; ``resume`` / ``release`` reach the server.

Served modes: verl's hybrid mode (colocated, synchronous; the naive sync above) and the standalone
mode of verl's asynchronous trainers (``init_standalone``: the replica's workers are verl's
``CheckpointEngineWorker`` actors holding a ``ServerAdapter`` built with ``device_mesh=None``; the
weights come through a checkpoint engine; with ``checkpoint_engine.backend=mcore_rl`` the server
joins the sync's group and receives the version itself, see ``checkpoint_engine``). Reward-model
and teacher servers are refused.
"""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Generator

import ray
import torch
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutMode, RolloutReplica

from mcore_rl.integrations.verl.checkpoint_engine import VersionStream
from mcore_rl.integrations.verl.rollout_server import RolloutServer, RolloutServerError

log = logging.getLogger("mcore_rl.integrations.verl")
NAME = "mcore_rl"  # rollout.name


def server_name(replica_rank: int, suffix: str = "") -> str:
    return f"{NAME}_server_{replica_rank}{suffix}"


def engine_options(config: Any) -> dict[str, Any]:
    """``rollout.engine_kwargs.mcore_rl``: ``num_threads`` (the server's torch threads; default:
    torch's), ``weight_sync`` (default True; False keeps the rollout on its starting weights, a
    diagnostic). Another key is an error naming it."""
    options = dict((config.engine_kwargs or {}).get(NAME) or {})
    unknown = sorted(set(options) - {"num_threads", "weight_sync"})
    if unknown:
        raise RolloutServerError(f"rollout.engine_kwargs.{NAME} keys {unknown} are unknown; it takes num_threads, "
                                 "weight_sync.")
    return options


def rollout_world_size(config: Any) -> int:
    return config.tensor_model_parallel_size * config.data_parallel_size * config.pipeline_model_parallel_size


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, copied when it is a view of a larger storage: pickling a view sends its whole
    storage (a parameter that is a view of DDP's contiguous buffer would send the whole model)."""
    if tensor.untyped_storage().nbytes() != tensor.nbytes or not tensor.is_contiguous():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


class McoreRLReplica(RolloutReplica):
    """A replica = one CPU rollout server holding the whole model."""

    def rollout_worker_use_gpu(self) -> bool:
        return False

    async def launch_servers(self) -> None:
        """Starts the replica's server next to its first worker and waits until it is built."""
        served = (RolloutMode.HYBRID, RolloutMode.STANDALONE)
        if self.rollout_mode not in served or self.is_reward_model or self.is_teacher_model:
            raise RolloutServerError(
                f"rollout.name={NAME} serves the policy in verl's hybrid and standalone modes only; got "
                f"{self.rollout_mode} ({'reward model' if self.is_reward_model else 'teacher' if self.is_teacher_model else 'policy'}"
                "). Use vllm or sglang for colocated, reward-model and teacher servers.")
        node_id = await self.workers[0].__ray_call__.remote(lambda _self: ray.get_runtime_context().get_node_id())
        name = server_name(self.replica_rank, self.name_suffix)
        options = engine_options(self.config)
        server = ray.remote(RolloutServer).options(
            name=name, num_cpus=0, max_concurrency=self.max_concurrency,
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id=node_id, soft=False),
        ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank,
                 num_threads=options.get("num_threads"))
        await server.ready.remote()
        self.servers = [server]
        self._server_handle = server
        self._server_address = f"{NAME}://{name}"  # unique per replica; no HTTP endpoint


class ServerAdapter(BaseRollout):
    """The trainer worker's side: weight sync into its replica's server, wake-up and release."""

    def __init__(self, config: Any, model_config: Any, device_mesh: Any, replica_rank: int = -1, **_kwargs: Any) -> None:
        super().__init__(config, model_config, device_mesh)
        rank, size = int(os.environ["RANK"]), rollout_world_size(self.config)
        self.replica_rank = rank // size if replica_rank == -1 else replica_rank
        self.is_pusher = rank % size == 0  # one rank per replica talks to the server
        self.bucket_bytes = int(self.config.checkpoint_engine.update_weights_bucket_megabytes) << 20
        options = engine_options(self.config)
        # a diagnostic: False leaves the rollout on its starting weights (the measure of how far the
        # policy moved; the tests' control run)
        self.weight_sync = bool(options.get("weight_sync", True))
        self._server = None

    def _handle(self):
        if self.is_pusher and self._server is None:
            self._server = ray.get_actor(server_name(self.replica_rank))
        return self._server

    async def resume(self, tags: list[str]) -> None:
        if self._handle() is not None:
            await self._server.wake_up.remote(tags=tags)

    async def release(self) -> None:
        if self._handle() is not None:
            await self._server.sleep.remote()

    async def _receive_version(self, stream: Any, global_steps: int | None) -> dict[str, Any]:
        """A checkpoint-engine version (``checkpoint_engine.VersionStream``): the server joins the
        gloo group and receives it; over NCCL this worker receives it (on its GPU) and hands the
        checked version to the server. A worker that sits out (``stream.link`` None) does nothing."""
        if stream.link is None:
            return {}
        server = self._handle() or ray.get_actor(server_name(self.replica_rank))
        if stream.link.transport == "gloo":
            return await server.receive_weights.remote(stream.link, global_steps, install=self.weight_sync)
        known = await server.known_version.remote()
        version = await asyncio.to_thread(stream.receive, known)
        if not self.weight_sync:
            await server.set_global_steps.remote(global_steps)
            return {}
        return await server.install_version.remote(version, global_steps)

    @torch.no_grad()
    async def update_weights(self, weights: Generator[tuple[str, torch.Tensor], None, None], global_steps: int | None = None,
                             wire_format: str = "named_tensors", peft_config: Any = None, base_sync_done: bool = False,
                             **_kwargs: Any) -> None:
        """Every rank runs ``weights`` to its end (a collective generator); the pushing rank sends
        the full tensors in buckets of at most ``bucket_bytes`` (a larger tensor alone). verl's
        LoRA protocol: ``peft_config`` with ``base_sync_done=True``: the tensors are the adapter
        factors (PEFT names), served unmerged; without (or ``base_sync_done=False``): weights.
        A ``VersionStream`` of mcore_rl's checkpoint engine: ``_receive_version``."""
        if isinstance(weights, VersionStream):
            return await self._receive_version(weights, global_steps)
        if wire_format != "named_tensors":
            for _ in weights:  # keep the collective going on every rank before failing
                pass
            raise RolloutServerError(f"the mcore_rl rollout takes full named tensors only (wire_format={wire_format!r}); "
                                     "use checkpoint_engine.backend=naive.")
        adapters = dict(peft_config) if peft_config is not None and base_sync_done else None
        server = self._handle() if self.weight_sync else None
        if server is not None:
            try:
                await server.begin_weight_update.remote(adapters)  # refuses adapters it cannot serve
            except BaseException:
                for _ in weights:  # the other ranks are in the collective generator
                    pass
                raise
        elif self._handle() is not None:  # weight_sync=False: the step advances, the weights stay
            await self._server.set_global_steps.remote(global_steps)
        bucket: list[tuple[str, torch.Tensor]] = []
        size = sent = 0
        ok = False
        try:
            for name, tensor in weights:
                if server is None:
                    continue
                if bucket and size + tensor.nbytes > self.bucket_bytes:
                    sent += await server.update_weights_bucket.remote(bucket)
                    bucket, size = [], 0
                bucket.append((name, _own_storage(tensor.detach().cpu())))
                size += tensor.nbytes
            if bucket:
                sent += await server.update_weights_bucket.remote(bucket)
            ok = True
        finally:
            if server is not None:
                await server.finish_weight_update.remote(global_steps, complete=ok)
        if server is not None and self.replica_rank == 0:
            log.info("weight sync: %d tensors to replica 0 (step %s)", sent, global_steps)
