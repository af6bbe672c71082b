"""CheckpointManager: save / resume / load of ModelEngines (actor, critic) plus the trainer's
JSON state, complete-or-nothing (marker after every rank's files are durable, then the tracker),
retention and crash-debris cleanup. Layout: see the package docs (``global_step_<N>/<role>/``)."""
from __future__ import annotations

import logging
import os
import re
import shutil
from functools import partial
from typing import Any

import torch
from megatron.core import dist_checkpointing

from mcore_rl.checkpoint import storage
from mcore_rl.checkpoint.config import CheckpointConfig
from mcore_rl.checkpoint.errors import CheckpointError
from mcore_rl.checkpoint.faults import fault_point
from mcore_rl.checkpoint.files import META, copy_hf_files
from mcore_rl.checkpoint.model_dir import load_planned
from mcore_rl.checkpoint.safetensors_write import parse_size, write_bucket_shards
from mcore_rl.checkpoint.state import build_metadata, plan_load, sharded_state
from mcore_rl.checkpoint.writer import ItemSaveStrategy

log = logging.getLogger("mcore_rl.checkpoint")
TRACKER = "latest_checkpointed_iteration.txt"
MARKER = "COMPLETE"
TRAINER_STATE = "trainer_state.json"
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def _all_ranks_ok(ok: bool) -> bool:
    """Collective: True when ``ok`` holds on every rank."""
    return storage.any_rank([0 if ok else 1]) == [0]


def _gather_strings(text: str) -> list[str]:
    """Collective: every rank's ``text`` (bytes over torch.distributed, no pickling)."""
    return [raw.decode() for raw in storage.all_gather_bytes(text.encode())]


class CheckpointManager:
    """Saves and restores ``{role: ModelEngine}`` under ``cfg.root`` (collective: every rank).

    ``hf_sources``: per role, a HF model directory (its config, tokenizer and generation config
    are copied) or a transformers config object, written to ``<role>/huggingface/``.
    """

    def __init__(self, cfg: CheckpointConfig, root: str | None = None,
                 hf_sources: dict[str, Any] | None = None) -> None:
        chosen = cfg.root or root
        if not chosen:
            raise CheckpointError("checkpoint.root is not set; set checkpoint.root=/path/to/checkpoints.")
        self.cfg, self.root, self.hf_sources = cfg, os.path.abspath(chosen), dict(hf_sources or {})
        self._queue, self._in_flight = None, None  # megatron's async calls queue, step being written
        self._mode: str | None = None  # storage mode found by the last save (shared / node_local)
        roots = _gather_strings(self.root)
        if len(set(roots)) > 1:
            bad = next(r for r, x in enumerate(roots) if x != roots[0])
            raise CheckpointError(
                f"ranks were given different checkpoint roots: rank 0 {roots[0]!r}, rank {bad} "
                f"{roots[bad]!r}; pass the same checkpoint.root on every rank (a shared or same-path dir).")

    # ---- listing -------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, f"global_step_{step}")

    def _step_dirs(self) -> dict[int, str]:
        if not os.path.isdir(self.root):
            return {}
        found = {}
        for name in os.listdir(self.root):
            m = _STEP_DIR.match(name)
            if m and os.path.isdir(os.path.join(self.root, name)):
                found[int(m.group(1))] = os.path.join(self.root, name)
        return found

    def complete_steps(self) -> list[int]:
        """Steps whose completion marker exists, ascending."""
        return sorted(s for s, d in self._step_dirs().items() if os.path.isfile(os.path.join(d, MARKER)))

    def incomplete_steps(self) -> list[int]:
        return sorted(s for s, d in self._step_dirs().items() if not os.path.isfile(os.path.join(d, MARKER)))

    # ---- save: snapshot -> write -> finalize ---------------------------------------------
    def save(self, step: int, engines: dict[str, Any], trainer_state: dict) -> str:
        """Saves every engine and ``trainer_state`` (JSON-able) as ``global_step_<step>``.

        Sync: returns once the step is complete (marker and tracker written). Async
        (``cfg.async_save``): returns once the shard writers are started (each holds the state as
        of this call); the step is finalized by ``poll()`` once every rank's writer is done, or by
        ``wait()``, which the next save, a load, an engine's offload/onload and ``close()`` call."""
        self.wait()
        step_dir = self._prepare(step)
        requests, roles = self._write(step_dir, self._snapshot(engines), engines, trainer_state)
        finish = partial(self._finish, step, step_dir, roles)
        if not self.cfg.async_save:
            for request in requests:
                fault_point("shards")
                request.execute_sync()  # what megatron's sync save does with the same request
            finish()
            return step_dir
        for engine in engines.values():  # offload/onload wait for the write in flight
            if self.wait not in engine.before_state_moves:
                engine.before_state_moves.append(self.wait)
        fault_point("shards")
        requests[-1].add_finalize_fn(finish)  # the queue finalizes requests in order
        for request in requests:
            self._async_queue().schedule_async_request(request)
        self._in_flight = step
        return step_dir

    def _async_queue(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if self._queue is None:
            self._queue = AsyncCallsQueue(persistent=False)  # forks a writer per save
        return self._queue

    def poll(self) -> int | None:
        """Collective, non-blocking: finalizes an async save whose writers all finished;
        returns its step (else None). The job calls it after every training step."""
        return self._settle(blocking=False)

    def wait(self) -> int | None:
        """Collective: blocks until the async save in flight (if any) is complete; returns its step."""
        return self._settle(blocking=True)

    def close(self) -> None:
        """Finishes the save in flight; call before the process group is destroyed."""
        self.wait()
        self._queue = None

    def _settle(self, blocking: bool) -> int | None:
        if self._in_flight is None:
            return None
        step = self._in_flight
        try:
            self._queue.maybe_finalize_async_calls(blocking=blocking)
        except CheckpointError:
            self._in_flight = None
            raise
        except Exception as e:  # megatron's CheckpointException names the failed ranks
            self._in_flight = None
            raise CheckpointError(f"async save of {self.step_dir(step)} failed: {e}; the step is not "
                                  "marked complete and resume skips it.") from e
        if self._queue.get_num_unfinalized_calls():
            return None
        self._in_flight = None
        return step

    def _prepare(self, step: int) -> str:
        ok = True
        try:
            os.makedirs(self.root, exist_ok=True)
            ok = os.access(self.root, os.W_OK | os.X_OK)
        except OSError:
            ok = False
        if not _all_ranks_ok(ok):
            raise CheckpointError(f"checkpoint root {self.root!r} is not writable on every rank; "
                                  "choose a writable checkpoint.root (check permissions and mounts).")
        step_dir = self.step_dir(step)
        if os.path.isfile(os.path.join(step_dir, MARKER)):
            raise CheckpointError(f"{step_dir} is already a complete checkpoint; resume from it "
                                  "(resume_mode=auto) or save to another checkpoint.root.")
        torch.distributed.barrier()
        if os.path.isdir(step_dir) and storage.node_leader() and self._is_writer():
            log.warning("removing incomplete %s before saving it again", step_dir)
            shutil.rmtree(step_dir)
        torch.distributed.barrier()
        return step_dir

    def _is_writer(self) -> bool:
        return torch.distributed.get_rank() == 0 or self._mode == "node_local"

    def _snapshot(self, engines: dict[str, Any]) -> dict[str, tuple[tuple[str, ...], dict]]:
        """Per role: (contents, sharded state dict). The async path copies tensors here."""
        out = {}
        for role, engine in engines.items():
            contents = tuple(c for c in self.cfg.save_contents
                             if engine.optimizer is not None or c not in ("optimizer", "extra"))
            dist = tuple(c for c in contents if c != "hf_model")
            out[role] = (contents, sharded_state(engine, dist, self.cfg.optimizer_sharding, is_loading=False))
        return out

    def _write(self, step_dir: str, snapshot: dict, engines: dict[str, Any],
               trainer_state: dict) -> tuple[list, list[str]]:
        """Plans every role's shards (megatron requests, not run yet) and writes the small files
        (metadata, HF files, trainer state); returns the requests and the roles."""
        mode = storage.detect_storage(self.root, announce=self._mode is None)
        if self._mode not in (None, mode):
            log.warning("checkpoint root %s is now %s storage (was %s)", self.root, mode, self._mode)
        self._mode = mode
        rank0 = torch.distributed.get_rank() == 0
        requests, roles = [], []
        for role, (contents, state) in snapshot.items():
            role_dir = os.path.join(step_dir, role)
            dist_dir = os.path.join(role_dir, "dist_ckpt")
            os.makedirs(dist_dir, exist_ok=True)  # every writer makes its own dirs
            torch.distributed.barrier()
            requests.append(_plan_dist(state, dist_dir, stage=self.cfg.async_save))
            engine = engines[role]
            if "hf_model" in contents:
                self._write_hf_weights(engine, role, os.path.join(role_dir, "huggingface"), rank0)
            if rank0:
                storage.write_json_atomic(os.path.join(role_dir, META),
                                          build_metadata(engine, role, contents, self.cfg.optimizer_sharding))
                self._write_hf_files(role, os.path.join(role_dir, "huggingface"))
            roles.append(role)
        if rank0:
            storage.write_json_atomic(os.path.join(step_dir, TRAINER_STATE), trainer_state)
        return requests, roles

    def _finish(self, step: int, step_dir: str, roles: list[str]) -> None:
        """Once every rank's shards are written: fsync, node-local copy, verify, marker, tracker."""
        # rank 0's writes done first: a walk beside them lists its temp files, renamed away before
        # the open (FileNotFoundError on rank 1, seen in the fault test)
        torch.distributed.barrier()
        storage.fsync_tree(step_dir)
        torch.distributed.barrier()
        if self._mode == "node_local":
            log.info("checkpoint root %s is node-local: copying missing files between nodes", self.root)
            storage.sync_step_to_all_nodes(step_dir)
        self._finalize(step, step_dir, roles)

    def _write_hf_weights(self, engine, role: str, hf_dir: str, rank0: bool) -> None:
        """HF safetensors shards of at most ``hf_max_shard_size`` (+ index), streamed bucket by
        bucket (collective: every rank gathers each bucket; rank 0 writes it)."""
        from mcore_rl.models.hf_weights import export_hf_buckets

        buckets = export_hf_buckets(engine.model, engine.args, role, parse_size(self.cfg.hf_max_shard_size))
        if rank0:
            write_bucket_shards(hf_dir, buckets)
        else:
            for _ in buckets:
                pass

    def _write_hf_files(self, role: str, hf_dir: str) -> None:
        source = self.hf_sources.get(role)
        if source is None:
            return
        if isinstance(source, (str, os.PathLike)):
            copy_hf_files(os.fspath(source), hf_dir)
        else:
            os.makedirs(hf_dir, exist_ok=True)
            source.to_json_file(os.path.join(hf_dir, "config.json"))

    def _finalize(self, step: int, step_dir: str, roles: list[str]) -> None:
        """Verify every expected file, then marker, then tracker, then cleanup (writer ranks)."""
        writer = self._is_writer() and (self._mode == "shared" or storage.node_leader())
        problem = self._verify(step_dir, roles) if writer else None
        if not _all_ranks_ok(problem is None):
            raise CheckpointError(problem or f"{step_dir}: another rank found missing or short files; "
                                  "see its error; the step is not marked complete.")
        if writer:
            fault_point("marker")
            files = self._inventory(step_dir)
            storage.write_json_atomic(os.path.join(step_dir, MARKER),
                                      {"step": step, "roles": sorted(roles), "files": files})
            fault_point("tracker")
            storage.write_json_atomic(os.path.join(self.root, TRACKER), step)
            fault_point("retention")
            self._cleanup(step)
        torch.distributed.barrier()

    def _verify(self, step_dir: str, roles: list[str]) -> str | None:
        required = {TRAINER_STATE: 1}
        for role in roles:
            required[os.path.join(role, META)] = 1
            for rel, size in storage.expected_files(os.path.join(step_dir, role, "dist_ckpt")).items():
                required[os.path.join(role, "dist_ckpt", rel)] = size
        return _missing_or_short(step_dir, required)

    @staticmethod
    def _inventory(step_dir: str) -> dict[str, int]:
        files = {}
        for dirpath, _, names in os.walk(step_dir):
            for name in names:
                path = os.path.join(dirpath, name)
                files[os.path.relpath(path, step_dir)] = os.path.getsize(path)
        return files

    def _cleanup(self, newest: int) -> None:
        """Crash debris (incomplete dirs older than ``newest``) and retention beyond the limit."""
        for step in self.incomplete_steps():
            if step < newest:
                log.warning("removing crash debris %s (incomplete, older than step %d)", self.step_dir(step), newest)
                shutil.rmtree(self.step_dir(step), ignore_errors=True)
        keep = self.cfg.max_ckpt_to_keep
        complete = self.complete_steps()
        if keep is not None and len(complete) > keep:
            for step in complete[:-keep]:
                if step != complete[-1]:  # never the newest complete one
                    log.info("retention: removing %s (max_ckpt_to_keep=%d)", self.step_dir(step), keep)
                    # marker first: a crash inside rmtree leaves debris, never a "complete" step missing files
                    os.remove(os.path.join(self.step_dir(step), MARKER))
                    storage.fsync_path(self.step_dir(step))
                    shutil.rmtree(self.step_dir(step), ignore_errors=True)

    # ---- resume / load ---------------------------------------------------------------------
    def resume(self, engines: dict[str, Any]) -> dict | None:
        """Loads by ``resume_mode``; returns the trainer state, or None when starting fresh."""
        mode = self.cfg.resume_mode
        if mode == "disable":
            return None
        if mode == "path":
            step_dir = os.path.abspath(self.cfg.resume_path)
            if not os.path.isfile(os.path.join(step_dir, MARKER)):
                raise CheckpointError(f"checkpoint.resume_path={step_dir!r} is not a complete checkpoint "
                                      f"(no {MARKER}); {self._choices()}")
            return self.load(step_dir, engines, self.cfg.load_contents)
        step = self._auto_step()
        if step is None:
            return None
        return self.load(self.step_dir(step), engines, self.cfg.load_contents)

    def _choices(self) -> str:
        steps = self.complete_steps()
        if not steps:
            return f"there is no complete checkpoint under {self.root}."
        return (f"complete steps under {self.root}: {steps}; pick one with checkpoint.resume_mode=path "
                f"checkpoint.resume_path={self.step_dir(steps[-1])}")

    def _auto_step(self) -> int | None:
        """The newest complete step; the tracker, when present, must name a complete step."""
        tracker = os.path.join(self.root, TRACKER)
        if os.path.exists(tracker):
            with open(tracker) as f:
                text = f.read().strip()
            if not text.isdigit():
                raise CheckpointError(f"{tracker} holds {text[:60]!r}, not a step number; {self._choices()}")
            if int(text) not in self.complete_steps():
                state = "missing" if not os.path.isdir(self.step_dir(int(text))) else "incomplete"
                raise CheckpointError(f"{tracker} names step {int(text)}, whose directory is {state}; "
                                      f"{self._choices()}")
        for step in self.incomplete_steps():
            log.warning("skipping incomplete checkpoint %s (no %s marker)", self.step_dir(step), MARKER)
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def load(self, step_dir: str, engines: dict[str, Any], contents: tuple[str, ...]) -> dict:
        """Loads ``contents`` of every engine from ``step_dir``; everything is validated first
        (files, metadata, layout), so a refusal touches no state. Returns the trainer state."""
        self.wait()
        if not os.path.isfile(os.path.join(step_dir, MARKER)):
            raise CheckpointError(f"{step_dir} is not a complete checkpoint (no {MARKER}); {self._choices()}")
        marker = storage.read_json(os.path.join(step_dir, MARKER))
        plans = {}
        for role, engine in engines.items():
            if role not in marker["roles"]:
                raise CheckpointError(f"{step_dir} holds roles {marker['roles']}, not {role!r}; "
                                      "load only the roles it saved.")
            role_dir = os.path.join(step_dir, role)
            problem = _missing_or_short(step_dir, self._required(role_dir, role))
            if problem:
                raise CheckpointError(problem)
            meta = storage.read_json(os.path.join(role_dir, META))
            plans[role] = plan_load(meta, engine, role, tuple(contents), role_dir)
        for role, engine in engines.items():
            load_planned(os.path.join(step_dir, role), engine, plans[role])
        return storage.read_json(os.path.join(step_dir, TRAINER_STATE))

    @staticmethod
    def _required(role_dir: str, role: str) -> dict[str, int]:
        dist_dir = os.path.join(role_dir, "dist_ckpt")
        required = {os.path.join(role, META): 1, os.path.join(role, "dist_ckpt", ".metadata"): 1}
        if os.path.isfile(os.path.join(dist_dir, ".metadata")):
            for rel, size in storage.expected_files(dist_dir).items():
                required[os.path.join(role, "dist_ckpt", rel)] = size
        return required


def _plan_dist(state: dict, dist_dir: str, stage: bool):
    """megatron's torch_dist save of ``state`` as an unscheduled request (plan done, common.pt
    written; the request writes this rank's shard file, its finalize writes ``.metadata`` and
    ``metadata.json`` on rank 0). The fault hook ``metadata`` fires after every rank's shards,
    before any metadata. ``stage``: copy device tensors to host now (async save)."""
    request = dist_checkpointing.save(state, dist_dir, sharded_strategy=ItemSaveStrategy(stage),
                                      async_sharded_save=True)
    request.finalize_fns.insert(0, lambda: fault_point("metadata"))
    return request


def _missing_or_short(step_dir: str, required: dict[str, int]) -> str | None:
    """A message naming every missing or truncated file (expected vs actual size), or None."""
    bad = []
    for rel, size in sorted(required.items()):
        path = os.path.join(step_dir, rel)
        if not os.path.isfile(path):
            bad.append(f"{rel} missing")
        elif os.path.getsize(path) < size:
            bad.append(f"{rel} truncated ({os.path.getsize(path)} bytes, expected >= {size})")
    if not bad:
        return None
    return (f"checkpoint {step_dir} is damaged: {'; '.join(bad)}; restore the files, or resume from "
            "another step with checkpoint.resume_mode=path checkpoint.resume_path=<root>/global_step_<N>.")
