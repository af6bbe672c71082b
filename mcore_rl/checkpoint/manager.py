"""CheckpointManager: save / resume / load of ModelEngines (actor, critic) plus the trainer's
JSON state, complete-or-nothing, on a shared root or on node-local disks.

A save writes ``global_step_<N>/`` (beside an existing complete step of that number, swapped in
after its marker), records every file with its size and CRC-32, copies the files between nodes
on node-local disks, checks each node's copy, then writes marker, tracker and retention, in
that order. Every decision taken from the disk comes from one agreed ``inventory.Survey``, and
every step that some ranks take alone is ``agreed``: a failure anywhere fails the save on every
rank, and nothing complete is deleted before its successor is. A load checks everything for
every role (marker, metadata, layout, every file's size and content, the pickled parts) before
the first engine is touched. Layout: see the package docs.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import torch

from mcore_rl.checkpoint import (contents_manifest, hf_export, integrity, inventory, peer_sync, recovery, step_dirs,
                                 storage)
from mcore_rl.checkpoint.adapters import save_part
from mcore_rl.checkpoint.async_saves import AsyncSaves
from mcore_rl.checkpoint.collective import agreed, all_gather_bytes
from mcore_rl.checkpoint.config import CheckpointConfig
from mcore_rl.checkpoint.export_queue import ExportQueue
from mcore_rl.checkpoint.exports import ManagerExports
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.faults import fault_point
from mcore_rl.fileio import item_sums
from mcore_rl.fileio.checksum import file_checksum
from mcore_rl.fileio.files import META, copy_hf_files
from mcore_rl.fileio.model_layout import MCORE_RL, ModelLayout, layout_of
from mcore_rl.models.hf_layout import carry_from_hf
from mcore_rl.checkpoint.inventory import MARKER, TRACKER, TRAINER_STATE, Marker
from mcore_rl.checkpoint.load_checks import check_step, preread_pickles
from mcore_rl.checkpoint.model_dir import load_planned
from mcore_rl.checkpoint.verified_read import has_item_sums
from mcore_rl.models.mtp import record_mtp_count
from mcore_rl.checkpoint.save_plan import SaveStructure
from mcore_rl.checkpoint.state import build_metadata, sharded_state
from mcore_rl.checkpoint.writer import ItemSaveStrategy, plan_item_save

log = logging.getLogger("mcore_rl.checkpoint")


@dataclass
class _Pending:
    """A save between its call and its marker."""

    step: int
    final_dir: str  # global_step_<N>
    write_dir: str  # final_dir, or its incoming side dir when step N exists complete
    order: int  # the completion order its marker records
    mode: storage.Mode
    roles: list[str] = field(default_factory=list)
    strategies: list[ItemSaveStrategy] = field(default_factory=list)


class CheckpointManager:
    """Saves and restores ``{role: ModelEngine}`` under ``cfg.root``. Every method is
    collective: all ranks call it.

    ``hf_sources``: per role, a HF model directory (its config, tokenizer and generation config
    are copied) or a transformers config object, written to the role's HF dir. ``layout``: where
    a role directory keeps its checkpoint and HF files (``fileio.model_layout``: the main job's
    ``MCORE_RL``, verl's ``VERL_V2``); recorded in its ``mcore_rl.json``, which every reader follows.
    ``exports``: the queue of background HF exports (``hf_model``; see ``exports``), None: the
    manager makes its own when ``hf_model`` is in ``save_contents``.
    """

    def __init__(self, cfg: CheckpointConfig, root: str | None = None,
                 hf_sources: dict[str, Any] | None = None, exports: ExportQueue | None = None,
                 layout: ModelLayout = MCORE_RL) -> None:
        chosen = cfg.root or root
        if not chosen:
            raise CheckpointError("checkpoint.root is not set; set checkpoint.root=/path/to/checkpoints.")
        self.cfg, self.root, self.hf_sources = cfg, os.path.abspath(chosen), dict(hf_sources or {})
        self.layout = layout
        self._async = AsyncSaves()  # the save in flight and the retention behind it
        self._structures: dict[str, SaveStructure] = {}  # per role: the last validated plan (save_plan)
        self._mode: storage.Mode | None = None  # shared / node_local, found by the last save or resume
        self._exports = ManagerExports(cfg, exports)
        roots = [raw.decode() for raw in all_gather_bytes(self.root.encode())]
        if len(set(roots)) > 1:
            bad = next(r for r, x in enumerate(roots) if x != roots[0])
            raise CheckpointError(
                f"ranks were given different checkpoint roots: rank 0 {roots[0]!r}, rank {bad} "
                f"{roots[bad]!r}; pass the same checkpoint.root on every rank (a shared or same-path dir).")

    # ---- listing -------------------------------------------------------------------------
    def step_dir(self, step: int) -> str:
        return os.path.join(self.root, inventory.step_name(step))

    def complete_steps(self) -> list[int]:
        """Steps complete on every node, ascending (collective)."""
        self._async.join_cleaning()
        return inventory.survey(self.root).in_state("complete")

    def incomplete_steps(self) -> list[int]:
        """Step dirs without a marker on every node, ascending (collective)."""
        self._async.join_cleaning()
        found = inventory.survey(self.root)
        return sorted(found.in_state("torn") + found.in_state("partial"))

    # ---- save: prepare -> write -> finish -------------------------------------------------
    def save(self, step: int, engines: dict[str, Any], trainer_state: dict) -> str:
        """Saves every engine and ``trainer_state`` (JSON-able) as ``global_step_<step>``.

        Sync: returns once the step is complete (marker and tracker written). Async
        (``cfg.async_save``): returns once the shard writers are started (each holds the state as
        of this call); the step is finalized by ``poll()`` once every rank's writer is done, or by
        ``wait()``, which the next save, a load, an engine's offload/onload and ``close()`` call.
        A step number that exists complete is replaced atomically (the old one stays whole until
        the new one is complete). With ``hf_model``, the HF weights are exported in the
        background once the step is complete (``exports``); an earlier export's failure is
        raised here, on every rank, before anything is written."""
        self.wait()
        self._exports.raise_failures(f"the save of step {step}")
        self._exports.check_engines(engines)
        pending = self._prepare(step)
        requests = self._write(pending, self._snapshot(engines), engines, trainer_state)
        finish = partial(self._finish, pending)
        if not self.cfg.async_save:
            for request in requests:
                fault_point("shards")
                request.execute_sync()  # what megatron's sync save does with the same request
            finish()
            return pending.final_dir
        for engine in engines.values():  # offload/onload wait for the write in flight
            if self.wait not in engine.before_state_moves:
                engine.before_state_moves.append(self.wait)
        fault_point("shards")
        requests[-1].add_finalize_fn(finish)  # the queue finalizes requests in order
        self._async.start(requests, step, pending.final_dir)
        return pending.final_dir

    def poll(self) -> int | None:
        """Collective, non-blocking: finalizes an async save whose writers all finished;
        returns its step (else None). The job calls it after every training step; a poll that
        does not finalize waits for no other rank (``async_saves``)."""
        self._exports.collect()
        return self._async.poll()

    def wait(self) -> int | None:
        """Collective: blocks until the async save in flight (if any) is complete and its
        retention done; returns its step."""
        return self._async.wait()

    def wait_exports(self) -> None:
        """Collective: finishes the save in flight, then waits until every node's background HF
        exports are done; an export that failed on any node is a CheckpointError on every rank."""
        self.wait()
        self._exports.wait()

    def close(self) -> None:
        """Finishes the save in flight and (``hf_export_wait_at_close``) the HF exports; raises
        an export's failure on every rank. Call before the process group is destroyed."""
        if self.cfg.hf_export_wait_at_close:
            self.wait_exports()
            return
        self.wait()
        self._exports.raise_failures("close")

    def _prepare(self, step: int) -> _Pending:
        """Mode, interrupted replacements finished, the agreed survey; removes a torn or partial
        step of this number on every node; a complete one is replaced via its incoming dir."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"save(step={step!r}): the step must be an integer >= 0.")
        agreed(lambda: self._check_root(), f"preparing checkpoint root {self.root}")
        mode = storage.detect_storage(self.root, announce=self._mode is None)
        if self._mode not in (None, mode) and torch.distributed.get_rank() == 0:
            log.warning("checkpoint root %s is now %s storage (was %s)", self.root, mode, self._mode)
        self._mode = mode
        found = self._recover(mode)
        final = self.step_dir(step)
        if step in found.links:
            raise CheckpointError(f"{final} is a symlink; mcore_rl never writes or deletes through links: "
                                  "remove the link, or save to another checkpoint.root.")
        incoming = os.path.join(self.root, inventory.incoming_name(step))
        if inventory.incoming_name(step) in found.side_links:
            raise CheckpointError(f"{incoming} is a symlink mcore_rl did not create; a save never writes "
                                  "through a link: remove it, or save to another checkpoint.root.")
        state = found.steps[step].state(found.nodes) if step in found.steps else None
        write_dir = incoming if state == "complete" else final
        if state == "complete":
            self._exports.cancel(step, storage.is_writer(mode))  # it exports the content being replaced
        if torch.distributed.get_rank() == 0 and state is not None:
            log.warning("%s exists (%s): %s", final, state,
                        "the new save is written beside it and replaces it once complete" if state == "complete"
                        else "removing it before saving it again")
        writer = storage.is_writer(mode)
        stale = writer and state in ("torn", "partial")
        agreed(partial(step_dirs.remove_step_dir, final) if stale else None, f"removing the incomplete {final}")
        agreed(partial(step_dirs.make_step_dir, write_dir) if writer else None, f"creating {write_dir}")
        return _Pending(step, final, write_dir, found.next_order(), mode)

    def _check_root(self) -> None:
        try:
            os.makedirs(self.root, exist_ok=True)
            problem = None if os.access(self.root, os.W_OK | os.X_OK) else "no write permission"
        except OSError as e:
            problem = f"{type(e).__name__}: {e}"
        if problem:
            raise CheckpointError(f"checkpoint root {self.root!r} is not writable ({problem}); choose a "
                                  "writable checkpoint.root (check permissions and mounts).")

    def _recover(self, mode: storage.Mode) -> inventory.Survey:
        """Finishes or undoes replacements a crash cut short, decided once from every node's
        inventory (``recovery``; writers of ``mode`` act); returns the survey after it."""
        found = inventory.survey(self.root)
        fixes = recovery.plan(found)
        if not fixes:
            return found
        if torch.distributed.get_rank() == 0:
            for line in recovery.describe(found, fixes):
                log.warning("%s under %s", line, self.root)
        agreed(partial(recovery.apply, self.root, fixes) if storage.is_writer(mode) else None,
               f"finishing interrupted replacements under {self.root}")
        return inventory.survey(self.root)

    def _snapshot(self, engines: dict[str, Any]) -> dict[str, tuple[tuple[str, ...], dict]]:
        """Per role: (contents, sharded state dict). No tensor is copied here: a sync save writes
        the engines' tensors before it returns; an async save's writer (a forked process) sees a
        copy-on-write image of host memory as of the save call, and the writer's plan copies what
        that image would not freeze (device tensors, tensors in shared memory)."""
        out = {}
        for role, engine in engines.items():
            contents = tuple(c for c in self.cfg.save_contents
                             if engine.optimizer is not None or c not in ("optimizer", "extra"))
            dist = tuple(c for c in contents if c != "hf_model")
            out[role] = (contents, sharded_state(engine, dist, self.cfg.optimizer_sharding, is_loading=False,
                                                 part=save_part(engine)))  # LoRA: adapter-only
        return out

    def _write(self, p: _Pending, snapshot: dict, engines: dict[str, Any], trainer_state: dict | None) -> list:
        """Plans every role's shards (requests, not run yet) and writes the small files (metadata,
        HF files, trainer state unless None); every rank-0 write is agreed."""
        rank0 = torch.distributed.get_rank() == 0
        requests = []
        for role, (contents, state) in snapshot.items():
            role_dir = os.path.join(p.write_dir, role)
            dist_dir = self.layout.dist_dir(role_dir)
            agreed(partial(os.makedirs, dist_dir, exist_ok=True), f"creating {dist_dir}")  # each writer its own
            strategy = ItemSaveStrategy(stage_device_tensors=self.cfg.async_save,
                                        structure=self._structures.setdefault(role, SaveStructure()))
            request = plan_item_save(state, dist_dir, strategy)
            request.finalize_fns.insert(0, lambda: fault_point("metadata"))  # after every rank's shards
            p.roles.append(role)
            p.strategies.append(strategy)
            requests.append(request)
            meta = build_metadata(engines[role], role, contents, self.cfg.optimizer_sharding, self.layout)
            agreed(partial(self._write_role_files, role, role_dir, meta, engines[role].args,
                           (p.step, engines[role].scheduler is not None)) if rank0 else None, f"writing {role_dir}")
        if trainer_state is not None:
            agreed(partial(storage.write_json_atomic, os.path.join(p.write_dir, TRAINER_STATE), trainer_state)
                   if rank0 else None, f"writing {TRAINER_STATE}")
        return requests

    def _write_role_files(self, role: str, role_dir: str, meta: dict, args, manifest: tuple[int, bool]) -> None:
        """Rank 0: ``mcore_rl.json``, the HF files and (a layout with one) the contents manifest,
        last; ``manifest``: (the step, whether the engine has an LR scheduler)."""
        storage.write_json_atomic(os.path.join(role_dir, META), meta)
        source, hf_dir = self.hf_sources.get(role), self.layout.hf_dir(role_dir)
        if isinstance(source, (str, os.PathLike)):
            copy_hf_files(os.fspath(source), hf_dir)
            carry_from_hf(os.fspath(source), hf_dir)  # a vision-language checkpoint's vision tower
        elif source is not None:
            os.makedirs(hf_dir, exist_ok=True)
            source.to_json_file(os.path.join(hf_dir, "config.json"))
        config = os.path.join(hf_dir, "config.json")
        if source is not None and role == "actor" and os.path.isfile(config):  # the MTP layers it holds
            record_mtp_count(config, args, args.mtp_built)
        if "hf_model" in meta["contents"]:  # config.json as the background export will write it
            hf_export.write_export_config(role_dir, role, self._exports.spec(),
                                          getattr(torch, meta["params_dtype"].removeprefix("torch.")))
        if self.layout.manifest:
            step, scheduler = manifest
            contents_manifest.write(self.layout, role_dir, contents_manifest.build(
                self.layout, role, step, tuple(meta["contents"]), meta["layout"]["world_size"],
                contents_manifest.hf_arch(hf_dir), scheduler, "lora" in meta,
                os.path.isfile(os.path.join(hf_dir, "tokenizer_config.json")), os.path.isdir(hf_dir)))

    # ---- finish: manifest -> copies between nodes -> checks -> marker -> tracker -> retention --
    def _finish(self, p: _Pending) -> None:
        """Once every rank's shards are written (and ``.metadata``): the step's manifest, the
        node-local copy, each node's check, then marker, replacement swap, tracker, retention."""
        manifest = self._manifest(p)
        if p.mode == "node_local":
            log.info("checkpoint root %s is node-local: copying missing files between nodes", self.root)
            peer_sync.sync_step_to_all_nodes(p.write_dir, manifest)
        writer = storage.is_writer(p.mode)
        agreed(partial(_check_written, p, manifest) if writer else None, f"checking {p.write_dir} "
               "(the step is not marked complete)")
        marker = Marker(p.step, tuple(sorted(p.roles)), p.order,
                        {rel: (e.size, e.crc32) for rel, e in manifest.items()})
        marker_path = os.path.join(p.write_dir, MARKER)
        _phase(writer, partial(step_dirs.write_marker, marker_path, marker), partial(step_dirs.remove_file, marker_path),
               f"writing the {MARKER} marker of {p.final_dir}")
        if p.write_dir != p.final_dir:
            _phase(writer, partial(step_dirs.swap_in, p.write_dir, p.final_dir), partial(step_dirs.swap_out, p.write_dir, p.final_dir),
                   f"replacing {p.final_dir} with the new save")
        agreed(partial(step_dirs.write_tracker, self.root, p.step) if writer else None,
               f"writing {TRACKER} (step {p.step} is complete; the tracker still names the step before it)")
        try:
            self._retention(p, writer)
        finally:  # hf_model: exported from the complete step; its exporter starts after retention's collectives
            self._exports.submit(p.step, p.final_dir, p.roles, writer)

    def _manifest(self, p: _Pending, scope: tuple[str, ...] = ()) -> integrity.Manifest:
        """Every file of the step with size, CRC-32 and writing node: each rank's shards from
        its writer; rank 0's other files (megatron's metadata, JSON, HF) fsynced and read back.
        ``scope``: only rank 0's files under these subdirectories (default: the whole step)."""
        mine: dict[str, tuple[int, str]] = {}
        for role, strategy in zip(p.roles, p.strategies):
            for name, digest in (strategy.writer.written_files() if strategy.writer else {}).items():
                mine[f"{role}/{self.layout.dist_rel(name)}"] = digest
        own = agreed(partial(_digest_rank0_files, p.write_dir, scope) if torch.distributed.get_rank() == 0 else None,
                     f"recording the files of {p.write_dir}")
        return integrity.gather_manifest({**mine, **(own or {})}, p.write_dir)

    def _retention(self, p: _Pending, writer: bool) -> None:
        """Removes crash debris (torn steps numbered below the new one), finished replacements'
        old copies and, by completion order, complete steps beyond ``max_ckpt_to_keep``."""
        found = inventory.survey(self.root)
        old, debris, abandoned = found.retention(p.step, self.cfg.max_ckpt_to_keep)
        old = self._exports.protect(old, writer)  # never a step whose HF export runs
        if torch.distributed.get_rank() == 0:
            if abandoned:
                log.warning("steps %s are numbered above the step just saved (%d): treated as an abandoned "
                            "branch, ranked by completion order (kept while max_ckpt_to_keep allows)",
                            abandoned, p.step)
            for step in debris:
                log.warning("removing crash debris %s (incomplete, numbered below step %d)", self.step_dir(step), p.step)
            for step in old:
                log.info("retention: removing %s (max_ckpt_to_keep=%s)", self.step_dir(step), self.cfg.max_ckpt_to_keep)
        dirs, fixes = [self.step_dir(s) for s in debris + old], recovery.plan(found)
        finish = partial(recovery.apply, self.root, fixes)
        what = f"removing old checkpoints under {self.root} (step {p.step} is complete and tracked)"
        if self.cfg.async_save and (dirs or fixes):  # joined by the next save, load, listing or close
            self._async.clean_behind(self.root, dirs, finish, writer, what)
            return
        agreed(partial(step_dirs.clean, self.root, dirs, finish) if writer else None, what)

    # ---- resume / load ---------------------------------------------------------------------
    def resume(self, engines: dict[str, Any]) -> dict | None:
        """Loads by ``resume_mode``; returns the trainer state, or None when starting fresh.
        ``auto``: the step the tracker names when complete, else the step completed last."""
        self.wait()
        mode = self.cfg.resume_mode
        if mode == "disable":
            return None
        if mode == "path":
            return self.load(os.path.abspath(self.cfg.resume_path), engines, self.cfg.load_contents)
        found_mode = storage.detect_storage(self.root, announce=self._mode is None, required=False)
        if found_mode is not None:  # None: a read-only root, nothing to finish there
            self._mode = found_mode
            found = self._recover(found_mode)
            self._exports.recover(self.root, found, found_mode)  # complete steps lacking their HF export
        else:
            found = inventory.survey(self.root)
        step, notes = found.resume_step()
        if torch.distributed.get_rank() == 0:
            for note in notes:
                log.warning(note)
        if step is None:
            return None
        return self.load(self.step_dir(step), engines, self.cfg.load_contents)

    def load(self, step_dir: str, engines: dict[str, Any], contents: tuple[str, ...]) -> dict:
        """Loads ``contents`` of every engine from ``step_dir``. Everything is checked first for
        every role — marker, metadata, layout, each file's size and CRC-32 on every node, the
        pickled parts — so a refusal touches no state. Returns the trainer state."""
        self.wait()
        step_dir = os.path.abspath(step_dir)
        checked = agreed(partial(check_step, step_dir, engines, tuple(contents), self._choices),
                         f"checking {step_dir}")
        plans, trainer_state, marker = checked
        in_read = self._verify_content(step_dir, marker, list(engines))
        preread_pickles(step_dir, list(engines))
        roles = list(engines)
        pending = [load_planned(os.path.join(step_dir, role), engines[role], plans[role], verified=in_read.get(role),
                                later=role != roles[-1]) for role in roles]  # the last role checked, all apply
        for apply in pending:
            apply()
        return trainer_state

    def _verify_content(self, step_dir: str, marker: Marker, roles: list[str]) -> dict[str, tuple]:
        """Every node holds the same marker, and (``cfg.verify_content``) every node's copy of the
        files the load reads has the recorded checksum. Shards with item checksums are checked
        while the load reads them: returns, per role, its ``load_planned(verified=...)``. The
        other files (small ones; every file of a step written before item checksums) are read
        here, the work split by size over the ranks that share a disk."""
        crcs = {raw for raw in all_gather_bytes(file_checksum(os.path.join(step_dir, MARKER))[1].encode())}
        if len(crcs) > 1:
            raise CheckpointError(f"the nodes hold different versions of {step_dir} (their {MARKER} markers "
                                  "differ); resume another step with checkpoint.resume_mode=path.")
        if not self.cfg.verify_content:
            return {}
        hf = {role: f"{role}/{layout_of(os.path.join(step_dir, role)).hf}/" for role in roles}
        files = {rel: v for rel, v in marker.files.items()
                 if rel == TRAINER_STATE or (rel.split("/")[0] in roles and not rel.startswith(hf[rel.split("/")[0]]))}
        if all(crc is None for _, crc in files.values()):
            if torch.distributed.get_rank() == 0:
                log.warning("%s was written before checkpoints recorded checksums: sizes checked, content not", step_dir)
            return {}
        in_read = {}
        for role in roles:
            dist = f"{role}/{layout_of(os.path.join(step_dir, role)).dist}"
            prefix = dist + "/"
            recorded = {rel[len(prefix):]: v for rel, v in files.items() if rel.startswith(prefix)}
            shards = [name for name in recorded if name.endswith(".distcp")]
            if has_item_sums(recorded, shards):
                in_read[role] = (recorded, step_dir, dist)
                for name in shards:
                    del files[prefix + name], files[prefix + item_sums.sums_name(name)]
        parent = os.path.dirname(step_dir)
        mode = self._mode if parent == self.root and self._mode else \
            storage.detect_storage(parent, announce=False, required=False)
        group = list(range(torch.distributed.get_world_size())) if mode == "shared" else storage.node_ranks()
        mine = integrity.share(sorted(files), {r: files[r][0] for r in files},
                               group.index(torch.distributed.get_rank()), len(group))
        agreed(partial(integrity.check_content, step_dir, files, mine), f"verifying the content of {step_dir}")
        return in_read

    def _choices(self) -> str:
        """This node's complete steps and how to pick one (for error messages)."""
        try:
            scan = inventory.scan_root(self.root)
        except CheckpointError as e:
            return f"the complete steps under {self.root} cannot be listed ({e})."
        steps = sorted(int(s) for s, v in scan["steps"].items() if v["marker"] == "ok")
        if not steps:
            return f"there is no complete checkpoint under {self.root}."
        return (f"complete steps under {self.root}: {steps}; pick one with checkpoint.resume_mode=path "
                f"checkpoint.resume_path={self.step_dir(steps[-1])}")


# ---- what writers do on their disk ----------------------------------------------------------------
def _phase(writer: bool, do: Callable[[], None], undo: Callable[[], None], what: str) -> None:
    """An agreed step of the writers; when it failed anywhere, writers that did it undo it."""
    done = []
    try:
        agreed((lambda: (do(), done.append(True))) if writer else None, what)
    except CheckpointError:
        if done:
            try:
                undo()
            except (OSError, CheckpointError) as e:  # reported, never silent: what it left is named
                log.error("could not undo %s on this writer (%s: %s); the directories it left are finished "
                          "or undone by the next save or resume", what, type(e).__name__, e)
        raise


def _digest_rank0_files(write_dir: str, scope: tuple[str, ...] = ()) -> dict[str, tuple[int, str]]:
    """Rank 0's files of a step (all but the shards, which their writers record) or of its
    subdirectories ``scope``: fsynced, then read back for their CRC-32 (megatron's
    ``.metadata``/``common.pt`` are not fsynced by it)."""
    rels = []
    tops = [os.path.join(write_dir, top) for top in scope] or [write_dir]
    for dirpath, _, names in (walked for top in tops for walked in os.walk(top)):
        for name in names:
            path = os.path.join(dirpath, name)
            written_by_writers = name.endswith(".distcp") or item_sums.is_sums_file(name)
            if not written_by_writers and not name.endswith(storage.TMP_SUFFIX) and not os.path.islink(path):
                rels.append(os.path.relpath(path, write_dir))
    return integrity.digest_files(write_dir, sorted(rels))


def _check_written(p: _Pending, manifest: integrity.Manifest, trainer_state: bool = True) -> None:
    """This node holds every file of the manifest with its size, the files every role's
    ``.metadata`` names are in it, and the step's directories are durable. ``trainer_state``:
    the step's trainer state is one of them."""
    integrity.check_sizes(p.write_dir, {rel: (e.size, e.crc32) for rel, e in manifest.items()})
    required = ((TRAINER_STATE,) if trainer_state else ()) + tuple(f"{role}/{META}" for role in p.roles)
    missing = [r for r in required if r not in manifest]
    for role in p.roles:
        layout = layout_of(os.path.join(p.write_dir, role))
        for rel, size in storage.expected_files(layout.dist_dir(os.path.join(p.write_dir, role))).items():
            entry = manifest.get(f"{role}/{layout.dist_rel(rel)}")
            if entry is None or entry.size < size:
                missing.append(f"{role}/{layout.dist_rel(rel)}")
    if missing:
        raise CheckpointError(f"{p.write_dir}: {missing[:8]} not written (a writer reported no file, or a "
                              "shorter one than .metadata needs); the step is not marked complete.")
    storage.fsync_dirs(p.write_dir)
