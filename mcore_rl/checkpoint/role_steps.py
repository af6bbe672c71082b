"""RoleStepManager: one engine's role part of a step that a trainer (verl) completes, on the
CheckpointManager's machinery (writer, manifest, node-local copy, checks, agreed steps, survey).
The protocol (parts, seal, retention) is in ``role_parts``.

A save of role R into step N (collective over the engine's ranks):

1. survey the root; seal the step the trainer's tracker names when it is not sealed yet (its
   parts whole on every node: the trainer's files copied to every node, then the marker);
2. retention for R (sealed steps only; never the tracked step, N, or N's predecessor);
3. N sealed, or named by the tracker: refused (the trainer would overwrite its files in place,
   which cannot be complete-or-nothing). N holding what this save may continue (whole parts of
   the roles saved before R, written since this engine's processes started): kept; anything else
   in N is an earlier run's and is removed on every node first;
4. the part: shards and small files, manifest, node-local copy, each node's check, then the
   ``PART`` record on every node. The tracker is the trainer's: never written here;
5. with ``hf_model``: the part's HF weights are exported in the background from the part as its
   ``PART`` records it (complete and verifiable on every node), by each node's writer (global
   rank 0 on a shared root, each node's leader on node-local disks) through the manager's export
   queue (``exports``; verl's engine passes one queue that outlives the per-save manager). An
   earlier export's failure is raised on every rank at the start of the next save (and at
   ``close()``); retention keeps every part of a step whose export runs or waits on any node.

A load of step N: sealed -> the normal checked load; unsealed but named by the tracker -> sealed
first; otherwise refused (the trainer never finished N).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time
from functools import partial
from typing import Any

import torch

from mcore_rl.checkpoint import inventory, peer_sync, role_parts, step_dirs, storage
from mcore_rl.checkpoint.collective import agreed, all_gather_bytes, all_ranks_ok
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.faults import fault_point
from mcore_rl.fileio.files import process_age_s
from mcore_rl.checkpoint.integrity import gather_manifest
from mcore_rl.checkpoint.inventory import MARKER, PART, PARTS_KIND, TRACKER, Marker, Survey
from mcore_rl.checkpoint.manager import CheckpointManager, _check_written, _Pending, _phase

log = logging.getLogger("mcore_rl.checkpoint")


class RoleStepManager(CheckpointManager):
    """Saves and loads one role's part of ``<root>/global_step_<N>``; ``cfg.max_ckpt_to_keep``
    is that role's retention count. Sync saves only. Every method is collective."""

    def save_role(self, step: int, role: str, engine: Any) -> str:
        """Writes ``engine`` as role ``role`` of step ``step`` (see the module doc); returns the
        part's directory. The step is complete once the trainer's tracker names it."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise CheckpointError(f"save_role(step={step!r}): the step must be an integer >= 0.")
        if self.cfg.async_save:
            raise CheckpointError("async_save=True: role parts are saved synchronously; set async_save=False.")
        self.wait()
        self._exports.raise_failures(f"the save of step {step} ({role})")  # before anything is written
        self._exports.check_engines({role: engine})  # a LoRA engine under a quantized hf_dtype: refused here
        agreed(lambda: self._check_root(), f"preparing checkpoint root {self.root}")
        self._mode = storage.detect_storage(self.root, announce=self._mode is None)
        found = inventory.survey(self.root)
        self._refuse_overwrite(found, step)  # before anything changes on disk
        found = self._seal_tracked(found)
        self._retain(found, role, step)
        pending, again = self._prepare_part(inventory.survey(self.root), step, role)
        snapshot = self._snapshot({role: engine})
        requests = self._write(pending, snapshot, {role: engine}, None)
        for request in requests:
            fault_point("shards")
            request.execute_sync()
        self._finish_part(pending, role)
        if "hf_model" in snapshot[role][0]:  # the part is complete on every node: exported from it
            self._exports.submit(step, pending.write_dir, [role, *again], storage.is_writer(self._mode))
        return os.path.join(pending.final_dir, role)

    def load_role(self, step_dir: str, role: str, engine: Any, contents: tuple[str, ...]) -> None:
        """Loads ``contents`` of ``role`` from ``step_dir`` (a step under this root), sealing it
        first when the trainer's tracker names it; an unfinished step is refused."""
        self.wait()
        step_dir = os.path.abspath(step_dir)
        step = inventory.parse_step_name(os.path.basename(step_dir))
        if os.path.dirname(step_dir) != self.root or step is None:
            raise CheckpointError(f"{step_dir} is not a step directory of {self.root} (global_step_<N>).")
        mode = storage.detect_storage(self.root, announce=False, required=False)
        self._mode = mode or self._mode
        found = inventory.survey(self.root)
        st = found.steps.get(step)
        if st is not None and st.state(found.nodes) != "complete" and st.parts:
            tracked = found.tracked()
            if tracked != step:
                raise CheckpointError(_unfinished(step_dir, found, step, tracked))
            if mode is None:
                raise CheckpointError(f"{step_dir} is complete but not sealed yet, and {self.root} is not "
                                      "writable here: load it once from a writable mount (that seals it).")
            self._seal(found, step)
        self.load(step_dir, {role: engine}, contents)
        if mode is not None:  # sealed steps whose HF export is missing or partial: exported again
            self._exports.recover(self.root, inventory.survey(self.root), mode)

    def _choices(self) -> str:
        """This node's complete steps and how a trainer resumes one (for load errors)."""
        try:
            scan = inventory.scan_root(self.root)
        except CheckpointError as e:
            return f"the complete steps under {self.root} cannot be listed ({e})."
        return _resume_hint(self.root, sorted(int(s) for s, v in scan["steps"].items() if v["marker"] == "ok"))

    # ---- seal ----------------------------------------------------------------------------------
    def _seal_tracked(self, found: Survey) -> Survey:
        """Seals the step the trainer's tracker names when it holds parts and is not sealed."""
        tracked = found.tracked()
        st = found.steps.get(tracked) if tracked is not None else None
        if st is None or not st.parts or st.state(found.nodes) == "complete":
            return found
        self._seal(found, tracked)
        return inventory.survey(self.root)

    def _seal(self, found: Survey, step: int) -> None:
        """The trainer finished ``step``: its files copied to every node, then the marker."""
        step_dir = self.step_dir(step)
        problems = role_parts.seal_problems(found, step)
        if problems:
            raise CheckpointError(f"{TRACKER} names step {step}, but {step_dir} cannot be completed: "
                                  f"{'; '.join(problems)}. The step is damaged: restore it, or "
                                  f"{_resume_hint(self.root, role_parts.sealed(found))}")
        roles = sorted(found.steps[step].parts)
        writer = storage.is_writer(self._mode)
        mine = agreed(partial(role_parts.node_view, step_dir, step, roles) if writer else None,
                      f"checking the parts of {step_dir} before completing it")
        views = [json.loads(raw) for raw in all_gather_bytes(json.dumps(mine).encode() if writer else b"") if raw]
        files = role_parts.seal_files(views, step_dir)
        trainer = gather_manifest(mine["others"] if writer else {}, step_dir)
        if self._mode == "node_local":
            peer_sync.sync_step_to_all_nodes(step_dir, trainer)
        files.update({rel: (e.size, e.crc32) for rel, e in trainer.items()})
        marker = Marker(step, tuple(roles), found.next_order(), files, PARTS_KIND)
        if torch.distributed.get_rank() == 0:
            log.info("sealing %s: parts %s and the trainer's files %s", step_dir, roles, sorted(trainer))
        path = os.path.join(step_dir, MARKER)
        _phase(writer, partial(_write_seal, step_dir, marker), partial(step_dirs.remove_file, path),
               f"writing the {MARKER} marker of {step_dir}")

    # ---- retention -----------------------------------------------------------------------------
    def _retain(self, found: Survey, role: str, step: int) -> None:
        tracked = found.tracked()
        plan = role_parts.retention(found, role, self.cfg.max_ckpt_to_keep, step, tracked)
        touched = sorted({s for s, _ in plan.parts} | set(plan.steps) | set(plan.debris))
        if touched:  # never a step whose HF export runs on any node (a later retention removes it)
            free = set(self._exports.protect(touched, storage.is_writer(self._mode)))
            plan = role_parts.Removals([(s, r) for s, r in plan.parts if s in free],
                                       [s for s in plan.steps if s in free], [s for s in plan.debris if s in free])
        if torch.distributed.get_rank() == 0:
            for s in plan.debris:
                log.warning("removing crash debris %s (never completed, numbered below step %d)",
                            self.step_dir(s), step)
            for s, r in plan.parts:
                log.info("retention: removing the %s part of %s (max_ckpt_to_keep=%s)", r, self.step_dir(s),
                         self.cfg.max_ckpt_to_keep)
            for s in plan.steps:
                log.info("retention: removing %s (its last part, %s; max_ckpt_to_keep=%s)", self.step_dir(s), role,
                         self.cfg.max_ckpt_to_keep)
        if tracked is None and any(st.parts for s, st in found.steps.items() if st.state(found.nodes) != "complete"
                                   and s < step) and torch.distributed.get_rank() == 0:
            log.warning("no node of this engine sees the trainer's %s under %s: earlier steps cannot be sealed "
                        "and are kept (retention counts sealed steps only)", TRACKER, self.root)
        if plan.parts or plan.steps or plan.debris:
            agreed(partial(role_parts.remove, self.root, plan.parts, plan.steps + plan.debris)
                   if storage.is_writer(self._mode) else None, f"removing old checkpoints under {self.root}")

    # ---- the part --------------------------------------------------------------------------------
    def _refuse_overwrite(self, found: Survey, step: int) -> None:
        """A save into a sealed step, or the step the tracker names, is refused (the trainer would
        overwrite its files there in place: the old step could be lost before the new one is
        complete); so is a step dir that is a link."""
        final = self.step_dir(step)
        if step in found.links:
            raise CheckpointError(f"{final} is a symlink; mcore_rl never writes or deletes through links: "
                                  "remove the link, or save to another checkpoint root.")
        st = found.steps.get(step)
        if st is not None and (st.marked or st.damaged or step == found.tracked()):
            why = "is a complete checkpoint" if st.marked or st.damaged else f"is the step {TRACKER} names"
            raise CheckpointError(
                f"{final} {why}: saving step {step} again would overwrite it in place (the trainer rewrites "
                f"its own files there), so the old step could be lost before the new one is complete. Continue "
                f"from the step the tracker names (verl: trainer.resume_mode=auto), or, to roll back, move the "
                f"steps from {step} on out of {self.root} first (or save into a new trainer.default_local_dir).")

    def _prepare_part(self, found: Survey, step: int, role: str) -> tuple[_Pending, list[str]]:
        """Step ``step`` made ready for ``role``'s part: what this save may continue is kept (the
        role's own leftover removed), anything else in the step is removed on every node. Also
        the roles whose exports of this step were cancelled here and go again after the part."""
        final, st = self.step_dir(step), found.steps.get(step)
        writer = storage.is_writer(self._mode)
        again: list[str] = []
        if st is not None:
            since = _since()
            verdict = agreed(partial(role_parts.continues, final, role, since) if writer else None,
                             f"checking what {final} holds")  # an error there is a refusal on every rank
            keep = all_ranks_ok(not writer or bool(verdict))
            if torch.distributed.get_rank() == 0 and not keep:
                log.warning("%s holds files of an earlier run (a save that did not finish): removing them", final)
            again = self._cancel_exports(step, role, keep, sorted(st.parts)) if writer else []
            clear = partial(role_parts.remove_part, final, role) if keep else partial(step_dirs.remove_step_dir, final)
            agreed(clear if writer else None, f"clearing {final} for the {role} part")
        return _Pending(step, final, final, 0, self._mode, []), again

    def _cancel_exports(self, step: int, role: str, keep: bool, parts: list[str]) -> list[str]:
        """A writer, before ``step`` is cleared for ``role``'s part: this process's exports of the
        step are killed when what they read goes (the whole step, or ``role``'s own leftover);
        returns the kept roles whose exports go again once the part is written."""
        queue = self._exports.queue
        if queue is None or step not in queue.running_steps() | set(queue.queued_steps()):
            return []
        if keep and not os.path.isdir(os.path.join(self.step_dir(step), role)):
            return []  # the earlier roles' exports of the step go on
        queue.cancel(step)
        kept = [r for r in parts if r != role] if keep else []
        log.warning("HF export of %s cancelled: the %s part is written again%s", self.step_dir(step), role,
                    f" (the exports of {kept} are queued again)" if kept else "")
        return kept

    def _finish_part(self, p: _Pending, role: str) -> None:
        """Manifest, node-local copy, each node's check, then the part record on every node."""
        manifest = self._manifest(p, scope=(role,))
        if p.mode == "node_local":
            peer_sync.sync_step_to_all_nodes(p.write_dir, manifest)
        writer = storage.is_writer(p.mode)
        agreed(partial(_check_written, p, manifest, False) if writer else None,
               f"checking the {role} part of {p.write_dir} (it is not recorded)")
        written = float(all_gather_bytes(repr(time.time()).encode())[0])  # rank 0's clock, on every node
        record = role_parts.PartRecord(p.step, role, written, {rel: (e.size, e.crc32) for rel, e in manifest.items()})
        path = os.path.join(p.write_dir, role, PART)
        _phase(writer, partial(role_parts.write_part, path, record), partial(step_dirs.remove_file, path),
               f"writing the {PART} record of {os.path.dirname(path)}")


def _write_seal(step_dir: str, marker: Marker) -> None:
    storage.fsync_dirs(step_dir)
    step_dirs.write_marker(os.path.join(step_dir, MARKER), marker)


def _since() -> float:
    """Collective: when the first of this engine's processes started (wall clock), the same on
    every rank; -inf when a rank cannot tell (no /proc): the save order is then the only rule."""
    age = process_age_s()
    starts = [float(raw) for raw in all_gather_bytes(repr(time.time() - age if age > 0.0 else -math.inf).encode())]
    return min(starts)


def _unfinished(step_dir: str, found: Survey, step: int, tracked: int | None) -> str:
    st = found.steps[step]
    named = f"names step {tracked}" if tracked is not None else "does not exist on any node"
    return (f"{step_dir} is not complete: the trainer's {TRACKER} {named}, so the save of this step did not "
            f"finish (it holds the parts {sorted(st.parts)}; a step completes when the trainer has written its "
            f"own files and its tracker names it). Resume the step the tracker names (verl: "
            f"trainer.resume_mode=auto), or {_resume_hint(found.root, role_parts.sealed(found))}")


def _resume_hint(root: str, complete: list[int]) -> str:
    if not complete:
        return f"start fresh (there is no complete step under {root})."
    return (f"resume a complete step: {sorted(complete)} under {root} (verl: trainer.resume_mode=resume_path "
            f"trainer.resume_from_path={os.path.join(root, inventory.step_name(max(complete)))}).")
