"""Rank bodies of tests/verl/test_verl_lora.py: verl's ActorRolloutRefWorker (role actor_rollout)
with ``model.lora.*`` on the mcore_rl engine and its CPU rollout server (in this process, called
as Ray would call it), driven by verl's own ``compute_log_prob`` (``no_lora_adapter``: verl's
``ref_in_actor``), ``update_actor`` and ``update_weights`` (verl's LoRA sync protocol)."""
from __future__ import annotations

import asyncio

import torch

from tests.verl import rl_bodies as B

LORA = {"rank": 4, "alpha": 8}
LR = 0.02  # adapters move far enough in one step that their effect dwarfs the tolerances


class _Local:
    """A server's methods called as a Ray actor handle calls them (``handle.m.remote(...)``
    awaited), recording (method, first argument)."""

    def __init__(self, server, calls: list):
        self._server, self._calls = server, calls

    def __getattr__(self, name):
        method = getattr(self._server, name)
        calls = self._calls

        class _Remote:
            @staticmethod
            def remote(*args, **kwargs):
                calls.append((name, args[0] if args else None))
                return method(*args, **kwargs)

        return _Remote


def _worker(model_dir: str, merge: bool):
    """verl's actor+rollout worker at TP=2 (rollout TP=2: one replica, rank 0 pushes), its
    rollout server in this process on rank 0 (random weights until the first sync)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from mcore_rl.integrations.verl.rollout_server import RolloutServer

    lora = [f"actor_rollout_ref.model.lora.{k}={v}" for k, v in {**LORA, "merge": merge}.items()]
    cfg = B.ppo_config(model_dir, *lora, "actor_rollout_ref.actor.mcore_rl.tensor_model_parallel_size=2",
                       "critic.mcore_rl.tensor_model_parallel_size=2", f"actor_rollout_ref.actor.optim.lr={LR}",
                       "actor_rollout_ref.rollout.name=mcore_rl", "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                       "actor_rollout_ref.rollout.load_format=dummy", "actor_rollout_ref.rollout.dtype=float32",
                       "actor_rollout_ref.rollout.prompt_length=16", "actor_rollout_ref.rollout.response_length=8",
                       "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1")
    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor_rollout")
    worker.init_model()
    calls: list = []
    server = None
    if worker.rollout.is_pusher:
        server = RolloutServer(cfg.actor_rollout_ref.rollout, omega_conf_to_dataclass(cfg.actor_rollout_ref.model), 0)
        worker.rollout._server = _Local(server, calls)
    return worker, server, calls


def _log_probs(worker, rows: dict, **meta) -> torch.Tensor | None:
    td = B._to_verl(rows, (), calculate_entropy=False, compute_loss=False, temperature=B.TEMPERATURE, **meta)
    return B._response_view(worker, worker.compute_log_prob(td), td, "log_probs")


def _update(worker, rows: dict, old: torch.Tensor, seed: int) -> None:
    rows = dict(rows)
    rows.update(B.update_inputs(old, old, rows["response_mask"], seed))
    td = B._to_verl(rows, ("old_log_probs", "advantages", "ref_log_prob"), temperature=B.TEMPERATURE,
                    calculate_entropy=True, global_batch_size=B.MINI, mini_batch_size=B.MINI, epochs=1, seed=42,
                    dataloader_kwargs={"shuffle": False}, compute_loss=True)
    worker.update_actor(td)


def _synced(worker, server, calls: list, rows: dict, step: int) -> dict:
    """verl's update_weights (naive: the colocated path), then what the rollout server's model
    gives the rows and what it was sent."""
    from tests.tiny import hf_log_probs

    calls.clear()
    asyncio.run(worker.update_weights(global_steps=step, mode="naive"))
    if server is None:
        return {}
    syncs, current = [], None
    for name, arg in calls:
        if name == "begin_weight_update":
            current = {"peft": arg is not None, "names": []}
            syncs.append(current)
        elif name == "update_weights_bucket":
            current["names"] += [n for n, _ in arg]
    server_lp, _ = hf_log_probs(server.engine.model, rows, B.TEMPERATURE)
    return {"syncs": syncs, "server": server_lp, "steps": server.global_steps,
            "adapted": sorted(server.adapters.active), "params": sorted(server.engine.params)}


def _one_worker(model_dir: str, merge: bool, rows_seed: int) -> dict:
    worker, server, calls = _worker(model_dir, merge)
    engine = worker.actor.engine.engine
    rows = B.global_batch(engine.args.vocab_size, rows_seed)
    out = {"rows": rows, "start": _log_probs(worker, rows)}  # B = 0: the frozen base's log-probs
    _update(worker, rows, out["start"] if out["start"] is not None else torch.zeros(rows["responses"].shape),
            rows_seed + 1)
    out["trained"] = _log_probs(worker, rows)
    out["ref"] = _log_probs(worker, rows, no_lora_adapter=True)  # verl's ref_in_actor
    out["first"] = _synced(worker, server, calls, rows, 1)
    # a second step and sync: adapter-only for merge=False (the base is there), replacing the first
    _update(worker, rows, out["trained"] if out["trained"] is not None else torch.zeros(rows["responses"].shape),
            rows_seed + 2)
    out["trained2"] = _log_probs(worker, rows)
    out["second"] = _synced(worker, server, calls, rows, 2)
    out["trainable"] = sorted(n for c in engine.model for n, p in c.named_parameters() if p.requires_grad)
    return out


def lora_sync_body(model_dir: str, seed: int) -> dict:
    """The unmerged (verl's default) and the merged protocol, one worker each."""
    B._env()
    return {"unmerged": _one_worker(model_dir, False, seed), "merged": _one_worker(model_dir, True, seed)}
