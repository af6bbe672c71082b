"""The background HF exports of a verl worker process (``hf_model`` in ``checkpoint.save_contents``).

verl's trainers make one ``RoleStepManager`` per save (``verl_checkpoints``), and a colocated
worker saves the actor and then the critic in one process; an export runs on after the save
returns. So the exports of a process go through ONE queue (``process_queue``) that outlives the
per-save managers: at most one export at a time on each node (a node's writer is one process,
``storage.is_writer``), in order, a newer step's superseding an older one that has not started.

When they end: the manager's ``close()`` after each save does not wait. The trainer's last save
(``global_step`` >= verl's ``optim.total_training_steps``) waits for every node's exports before
it returns, because verl's Ray workers are killed at the end of the job (no exit hook runs
there); a process that ends another way (the SFT trainer under torchrun, a run stopped early)
waits for its queue at exit (``atexit``, local). A failure is raised on every rank at the next
save; one the last save or the exit finds is logged as an error (verl's step is complete by
then: ``mcore_to_hf.py merge`` of the role dir, or the next resume, writes its weights).
"""
from __future__ import annotations

import atexit
import logging
import sys

from mcore_rl.checkpoint.export_queue import ExportQueue

log = logging.getLogger("mcore_rl.integrations.verl")


class _ProcessExports:
    """The process's queue, made at the first save with ``hf_model`` (the holder is the one
    module-level object: a queue per process is what keeps one export per node)."""

    queue: ExportQueue | None = None


_PROCESS = _ProcessExports()


def process_queue(threads: int, supersede: bool) -> ExportQueue:
    """This process's export queue (made by the first save or load with ``hf_model``, with its
    ``threads`` and ``supersede``; it is waited for when the process exits)."""
    if _PROCESS.queue is None:
        _PROCESS.queue = ExportQueue(threads, supersede)
        atexit.register(wait_at_exit, _PROCESS.queue)
    return _PROCESS.queue


def existing_queue() -> ExportQueue | None:
    """The process's queue when a save or load made one (None before)."""
    return _PROCESS.queue


def last_step(optimizer_config, global_step: int) -> bool:
    """Whether ``global_step`` is the trainer's last (verl sets ``optim.total_training_steps``
    for every trained role, the SFT trainer and the PPO trainers alike)."""
    total = getattr(optimizer_config, "total_training_steps", None)
    return isinstance(total, int) and total > 0 and global_step >= total


def wait_at_exit(queue: ExportQueue) -> None:
    """At process exit: the exports still queued or running finish; a failure is logged (there
    is no later save to raise it at)."""
    if queue.busy():
        log.info("waiting for the background HF exports of this process before it exits")
    for failure in queue.wait():
        line = f"{failure.describe()} (found at process exit)"
        log.error("%s", line)
        print(f"error: {line}", file=sys.stderr, flush=True)
    queue.close()


__all__ = ["process_queue", "existing_queue", "last_step", "wait_at_exit"]
