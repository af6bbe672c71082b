"""mcore_rl's checkpoint engine for verl (``actor_rollout_ref.rollout.checkpoint_engine.backend=mcore_rl``):
weights from the trainer to standalone rollout replicas over a private gloo group (NCCL on GPUs).

verl drives it per sync (``CheckpointEngineManager.update_weights``): ``prepare`` on every
trainer and rollout worker, ``build_topology``, ``init_process_group``, then the trainer's
``send_weights`` and every rollout worker's ``receive_weights`` at once, then ``finalize``.
Here:

- trainer rank 0 (``is_master``) hosts the version's TCPStore (``prepare``) and sends; every other
  trainer rank runs the collective export generator to its end and sends nothing;
- each replica's first rollout worker receives (its others sit out: the CPU rollout server holds
  the whole model in one process). With mcore_rl's rollout the worker hands the group's address
  to its server, which joins the group and receives itself (one copy, no second hop through
  Ray); with another rollout, ``receive_weights`` yields the checked version's tensors;
- the wire (``weight_wire``): buckets of ``update_weights_bucket_megabytes``, a manifest of every
  tensor's checksum, an all-receivers ack; a version applies whole or not at all.

``engine_kwargs.mcore_rl``: ``timeout_s`` (default 600: a silent peer fails the sync after it),
``delta`` (default False: True sends only tensors whose checksum changed since the version every
receiver holds), ``transport`` (``gloo``, default; ``nccl`` for GPUs, written but unverified
here: this project's machines have no GPU).
"""
from __future__ import annotations

import asyncio
import os
import secrets
import socket
from datetime import timedelta
from typing import Any, AsyncIterator, Iterable

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry

from mcore_rl.integrations.verl import weight_wire as wire
from mcore_rl.integrations.verl.weight_wire import Link, WeightSyncError

NAME = "mcore_rl"
OPTIONS = ("timeout_s", "delta", "transport")


def _host() -> str:
    """This node's address as the other nodes reach it (Ray's view when Ray runs here)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address().strip("[]")
    except Exception:  # noqa: BLE001 - no Ray: a single-node run
        pass
    return os.environ.get("MCORE_RL_CE_HOST") or socket.gethostbyname(socket.gethostname())


class VersionStream:
    """What a rollout worker's ``receive_weights`` returns: mcore_rl's ``ServerAdapter`` reads
    ``link`` (None: this worker sits out) and lets its server receive; any other adapter
    iterates it (``async for``) and gets the checked version's (name, tensor) pairs."""

    def __init__(self, link: Link | None, engine: "McoreRLCheckpointEngine") -> None:
        self.link, self._engine = link, engine

    def receive(self, known: tuple[int, dict[str, str]] | None) -> wire.Version:
        """Receives the version here (blocking; the caller's thread)."""
        return wire.receive(wire.open_group(self.link), self.link, known)

    async def __aiter__(self) -> AsyncIterator[tuple[str, torch.Tensor]]:
        if self.link is None:
            return
        version = await asyncio.to_thread(self.receive, self._engine.known)
        self._engine.known = (version.token, version.checksums)  # a foreign rollout keeps what it is given
        for name, tensor in wire.iter_version(version):
            yield name, tensor


class McoreRLCheckpointEngine(CheckpointEngine):
    """verl's CheckpointEngine over ``weight_wire`` (see the module doc). ``bucket_size``: bytes
    per bucket; ``is_master``: trainer rank 0 (the sender)."""

    wire_format = "named_tensors"

    def __init__(self, bucket_size: int, is_master: bool = False, timeout_s: float = 600.0, delta: bool = False,
                 transport: str = "gloo", **unknown: Any) -> None:
        if unknown:
            raise WeightSyncError(f"checkpoint_engine.engine_kwargs.{NAME} keys {sorted(unknown)} are unknown; it takes "
                                  f"{list(OPTIONS)}.")
        if transport not in wire.TRANSPORTS:
            raise WeightSyncError(f"checkpoint_engine.engine_kwargs.{NAME}.transport={transport!r}; use one of "
                                  f"{list(wire.TRANSPORTS)}.")
        if not float(timeout_s) > 0:
            raise WeightSyncError(f"checkpoint_engine.engine_kwargs.{NAME}.timeout_s={timeout_s!r}; give seconds > 0.")
        self.bucket_size, self.is_master = int(bucket_size), bool(is_master)
        self.timeout_s, self.transport = float(timeout_s), transport
        self.sender = wire.Sender(self.bucket_size, delta=bool(delta)) if self.is_master else None
        self.known: tuple[int, dict[str, str]] | None = None  # a foreign rollout's held version
        self._store: dist.TCPStore | None = None
        self._link: Link | None = None

    def prepare(self) -> dict[str, Any]:
        """The sender opens this sync's TCPStore and reports its address; a rollout worker
        reports whether it leads its replica (its worker group's rank 0)."""
        if self.is_master:
            host = _host()
            self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                        timeout=timedelta(seconds=self.timeout_s))
            return {"master": {"host": host, "port": int(self._store.port), "prefix": secrets.token_hex(8),
                               "timeout_s": self.timeout_s, "transport": self.transport}}
        return {"leader": os.environ.get("RANK", "0") == "0"}

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int,
                       metadata: list[dict]) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """Rank 0 the sender (trainer rank 0), ranks 1.. each replica's leading rollout worker;
        every other worker -1 (it sits out)."""
        master = metadata[0].get("master") if metadata and isinstance(metadata[0], dict) else None
        if master is None:
            raise WeightSyncError(f"checkpoint_engine.backend={NAME}: trainer rank 0 reported no store address "
                                  f"({metadata[:1]!r}); build the trainer's engine with is_master on rank 0.")
        rollout_meta = metadata[actor_wg_world_size:actor_wg_world_size + rollout_world_size]
        ranks, next_rank = [], 1
        for meta in rollout_meta:
            ranks.append(next_rank if meta.get("leader") else -1)
            next_rank += 1 if meta.get("leader") else 0
        world = next_rank
        actor = {"rank": [0] + [-1] * (actor_wg_world_size - 1), "world_size": [world] * actor_wg_world_size,
                 "master": [master] * actor_wg_world_size}
        rollout = {"rank": ranks, "world_size": [world] * rollout_world_size, "master": [master] * rollout_world_size}
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, master: dict[str, Any]) -> None:
        """Records this member's place; the group itself forms when the version flows (the
        sender and the receivers meet in ``send_weights`` / the server's receive)."""
        self._link = None if rank < 0 else Link(master["host"], int(master["port"]), rank, world_size,
                                                 master["prefix"], float(master["timeout_s"]), master["transport"])

    def finalize(self) -> None:
        """Closes the sync's store (the next sync opens another)."""
        self._store, self._link = None, None

    async def send_weights(self, weights: Iterable[tuple[str, torch.Tensor]],
                           global_steps: int | None = None) -> dict[str, float]:
        """Rank 0 streams the version (returns verl's sync metrics); other trainer ranks drain
        the collective generator and return {}."""
        if self._link is None or self._link.rank != 0:
            wire.drain(weights)
            return {}
        if self.transport == "nccl":
            torch.cuda.set_device(torch.cuda.current_device())
        group = wire.open_group(self._link, self._store)
        try:
            metrics = self.sender.send(group, self._link, weights)
        finally:
            del group
        return {**metrics, "checkpoint_engine/global_steps": float(global_steps if global_steps is not None else -1)}

    def receive_weights(self, global_steps: int | None = None) -> VersionStream:
        """A rollout worker's side: a ``VersionStream`` (see its doc)."""
        return VersionStream(self._link, self)


CheckpointEngineRegistry.register(NAME)(McoreRLCheckpointEngine)
