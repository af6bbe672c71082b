"""CheckpointManager's side of the background HF exports (``hf_model`` in ``save_contents``).

The save writes no HF weights: once a step is complete (marker and tracker), each node that holds
a copy of it queues its export (``export_queue``: rank 0 on a shared root, each node's leader on
node-local disks). Everything here that decides for the job is collective and agreed:

- failures: an export that failed or was killed on any node is raised as one CheckpointError on
  every rank at the next save, ``wait_exports()`` or ``close()`` (``raise_failures``);
- retention (and so a rollback's removal of an abandoned branch) never deletes a step whose
  export runs on any node: it stays for a later retention; queued exports of the steps it does
  delete are dropped first (``protect``);
- a save that replaces complete step N kills N's export first (``cancel``);
- at resume, complete steps whose export is missing or partial (a kill) are cleaned (one warning
  line per node) and exported again, the newest only when superseding (``recover``).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
from functools import partial

import torch

from mcore_rl.checkpoint import hf_export, hf_export_record, storage
from mcore_rl.checkpoint.adapters import is_lora
from mcore_rl.checkpoint.collective import agreed, all_gather_bytes, any_rank, gather_errors
from mcore_rl.checkpoint.config import CheckpointConfig
from mcore_rl.checkpoint.export_queue import ExportFailure, ExportQueue
from mcore_rl.checkpoint.inventory import Survey, step_name
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.files import META
from mcore_rl.mapping.fp8_quant import BlockFp8

log = logging.getLogger("mcore_rl.checkpoint")


class ManagerExports:
    """The exports of one CheckpointManager: its queue (``queue``, or its own when None and
    ``hf_model`` is saved) and the failures this rank has seen but not yet raised."""

    def __init__(self, cfg: CheckpointConfig, queue: ExportQueue | None) -> None:
        self.cfg = cfg
        self.enabled = "hf_model" in cfg.save_contents
        self.owned = queue is None and self.enabled
        self.queue = ExportQueue(cfg.hf_export_threads, cfg.hf_export_supersede) if self.owned else queue
        self._failures: list[ExportFailure] = []

    def spec(self) -> hf_export.ExportSpec:
        """What the exports write: ``hf_dtype`` (fp8: 128x128 blocks, float scales, as ``merge --dtype fp8``)."""
        fp8 = BlockFp8() if self.cfg.hf_dtype == "fp8" else None
        return hf_export.ExportSpec(dtype=self.cfg.hf_dtype, max_shard_size=self.cfg.hf_max_shard_size, fp8=fp8)

    def check_engines(self, engines: dict) -> None:
        """Refuses (before anything is written) a save with ``hf_model`` of a LoRA engine under a
        quantized ``hf_dtype``: its steps hold adapters only, whose export is their merge with
        the base (``merge_lora``), never quantized. Other LoRA saves export base + adapters."""
        quantized = self.enabled and self.cfg.hf_dtype in ("fp8", "mxfp4")
        lora = sorted(role for role, engine in engines.items() if quantized and is_lora(engine))
        if lora:
            raise CheckpointError(
                f"checkpoint.save_contents holds 'hf_model' with checkpoint.hf_dtype={self.cfg.hf_dtype!r}, but "
                f"role(s) {lora} train LoRA adapters: their export merges the adapters into the base unquantized. "
                "Set checkpoint.hf_dtype to fp32, bf16, fp16 or null (the run's params dtype), or drop 'hf_model'.")

    # ---- local, non-blocking ---------------------------------------------------------------
    def collect(self) -> None:
        """Keeps the failures the queue reported since the last look (local, non-blocking)."""
        if self.queue is not None:
            self._failures += self.queue.poll()

    def submit(self, step: int, step_dir: str, roles: list[str], writer: bool) -> None:
        """Queues the export of ``roles`` of complete step ``step`` on this node's exporter."""
        if self.enabled and writer and self.queue is not None:
            self.queue.submit(step, {r: os.path.join(step_dir, r) for r in roles}, self.spec())

    def cancel(self, step: int, writer: bool) -> None:
        """A save replacing complete ``step``: its export (of the old content) is killed first."""
        if writer and self.queue is not None and self.queue.cancel(step):
            log.warning("HF export of step %d cancelled: the step is being replaced by a new save", step)

    # ---- collective ------------------------------------------------------------------------
    def raise_failures(self, when: str) -> None:
        """Collective: every rank raises one CheckpointError naming every node's failed exports
        (step, role, node, the exporter's error line) when any failed; each is raised once."""
        self.collect()
        mine, self._failures = self._failures, []
        text = json.dumps([f.__dict__ for f in mine]) if mine else None
        gathered = gather_errors(text)
        if not gathered:
            return
        failures = sorted({(f["step"], f["role"], f["node"], f["error"]) for raw in gathered.values()
                           for f in json.loads(raw)})
        lines = "; ".join(ExportFailure(*f).describe() for f in failures)
        raise CheckpointError(
            f"{lines} (found at {when}). The steps themselves are complete and resume; write their HF weights "
            "with `python converters/mcore_to_hf.py merge <step dir>/<role> <output dir>`, or fix the cause "
            "and save again.")

    def wait(self) -> None:
        """Collective: every node's exports drained, then their failures raised on every rank."""
        if self.queue is not None:
            self._failures += self.queue.wait()
        self.raise_failures("wait_exports")

    def protect(self, old: list[int], writer: bool) -> list[int]:
        """Collective: the steps of ``old`` retention may delete now: those whose export runs on
        no node. This node's queued exports of those steps are dropped (one line). ``old`` is the
        same list on every rank (it comes from the agreed survey): one flag per step is reduced
        over the ranks, no collective at all when it is empty."""
        if not self.enabled or not old:
            return old
        queue = self.queue if writer else None
        with (queue.paused() if queue is not None else contextlib.nullcontext()):  # nothing starts meanwhile
            running = queue.running_steps() if queue is not None else set()
            flags = any_rank([int(s in running) for s in old])
            busy = {s for s, flag in zip(old, flags) if flag}
            kept = [s for s in old if s in busy]
            doomed = [s for s in old if s not in busy]
            dropped = queue.drop(set(doomed)) if queue is not None else []
        if dropped:
            log.warning("HF export of step(s) %s dropped: retention removes the step(s)", dropped)
        if kept and torch.distributed.get_rank() == 0:
            log.info("retention: keeping step(s) %s while their HF export runs (removed by a later retention)", kept)
        return doomed

    def recover(self, root: str, found: Survey, mode: storage.Mode) -> None:
        """Collective, at resume: every complete step that saved ``hf_model`` and lacks a complete
        export on some node has its partial export cleaned (one warning line per node) and is
        exported again (with superseding: the newest of them only; one line says which)."""
        if not self.enabled or self.queue is None:
            return
        writer = storage.is_writer(mode)
        with self.queue.paused():  # an export of this process's own (queued, running) is no leftover
            busy = self.queue.running_steps() | set(self.queue.queued_steps())
            steps = [s for s in found.in_state("complete") if s not in busy]
            lacking = agreed(partial(_lacking, root, steps) if writer else None,
                             f"checking the HF exports under {root}")
        everywhere: dict[int, list[str]] = {}
        for raw in all_gather_bytes(json.dumps(lacking or {}).encode()):
            for step, roles in json.loads(raw).items():
                everywhere.setdefault(int(step), [])
                everywhere[int(step)] = sorted(set(everywhere[int(step)]) | set(roles))
        if not everywhere:
            return
        redo = sorted(everywhere)[-1:] if self.cfg.hf_export_supersede else sorted(everywhere)
        left = sorted(set(everywhere) - set(redo))
        if torch.distributed.get_rank() == 0:
            log.warning("HF exports missing or partial for step(s) %s: exporting %s again in the background%s",
                        sorted(everywhere), redo, f"; step(s) {left} are left without HF weights (checkpoint."
                        "hf_export_supersede; `mcore_to_hf.py merge` writes them)" if left else "")
        for step in redo:
            mine = (lacking or {}).get(str(step), [])
            if writer and mine:
                self.queue.submit(step, {r: os.path.join(root, step_name(step), r) for r in mine}, self.spec())

    def close(self) -> None:
        """Stops a queue this manager made (a running export is killed; the next start redoes it)."""
        if self.owned and self.queue is not None:
            self.queue.close()


def _lacking(root: str, steps: list[int]) -> dict[str, list[str]]:
    """On a writer: step -> roles whose saved ``hf_model`` has no complete export on this node,
    their partial exports removed first (one warning line naming what went)."""
    out, removed = {}, []
    for step in steps:
        step_dir = os.path.join(root, step_name(step))
        for role in _hf_roles(step_dir):
            try:
                state = hf_export_record.export_state(os.path.join(step_dir, role))
            except CheckpointError as e:  # the step resumes all the same; its HF dir is left as it is
                log.warning("cannot tell whether %s/%s has its HF export (%s); left as it is", step_dir, role, e)
                continue
            if state in ("complete", "inline"):
                continue
            if state == "partial":
                removed += [f"{step_name(step)}/{rel}" for rel in hf_export_record.clean_partial(os.path.join(step_dir, role))]
            out.setdefault(str(step), []).append(role)
    if removed:
        log.warning("removed partial HF export(s) under %s (an export was interrupted; never used): %s",
                    root, ", ".join(removed))
    return out


def _hf_roles(step_dir: str) -> list[str]:
    """The roles of a step whose ``mcore_rl.json`` lists ``hf_model`` among its contents."""
    roles = []
    for name in sorted(os.listdir(step_dir)):
        meta = os.path.join(step_dir, name, META)
        if os.path.isfile(meta) and "hf_model" in storage.read_json(meta).get("contents", []):
            roles.append(name)
    return roles
