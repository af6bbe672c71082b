"""The async side of CheckpointManager: the writers megatron's queue forks, the poll that
finalizes a save once every rank's writers are done, and the retention left running behind it.

A poll must be collective (the finalize gathers from every rank) and cheap (the job polls after
every training step). Each poll sends whether this rank's writers still run as a non-blocking
all-reduce on a host (gloo) group and reads the one the previous poll sent, which every rank
has sent by now: the finalize starts on every rank at the same poll, the first after every
writer finished, and a poll that does not finalize waits for no other rank (megatron's own
check is a blocking all-reduce per poll).

An async save's retention (the deletion of old steps, decided from the agreed survey after the
tracker names the new step) runs on a thread of each writer; the next call that looks at the
root (a save, load, resume, listing or close) joins it, and its failure on any writer is
raised on every rank there.
"""
from __future__ import annotations

from typing import Callable

from mcore_rl.checkpoint import step_dirs
from mcore_rl.checkpoint.collective import PendingMax, agreed, host_group
from mcore_rl.errors import CheckpointError


class AsyncSaves:
    """The async save in flight (at most one) and the retention behind the last one."""

    def __init__(self) -> None:
        self._queue = None  # megatron's AsyncCallsQueue
        self._in_flight: tuple[int, str] | None = None  # (step, its directory)
        self._vote: PendingMax | None = None  # the last poll's "my writers still run", being reduced
        self._group: list = []  # [the host group the votes travel on], made by the first start
        self._cleaning: tuple[str, step_dirs.BackgroundClean | None] | None = None

    def start(self, requests: list, step: int, step_dir: str) -> None:
        """Collective: forks each request's writer; the last request's finalize completes the step."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        if not self._group:
            self._group.append(host_group())
        if self._queue is None:
            self._queue = AsyncCallsQueue(persistent=False)  # forks a writer per request
        for request in requests:
            self._queue.schedule_async_request(request)
        self._in_flight = (step, step_dir)

    def poll(self) -> int | None:
        """Collective, non-blocking: finalizes the save in flight at the first poll after every
        rank's writers finished (see the module doc); returns its step, else None."""
        if self._in_flight is None:
            return None
        if self._vote is not None:
            running = self._vote.result()[0]
            self._vote = None
            if not running:
                return self._settle(agreed_done=True)
        self._vote = PendingMax([int(self.writers_running())], self._group[0])
        return None

    def writers_running(self) -> bool:
        """Whether a writer process of this rank still runs (a finished one is joined)."""
        return not all(call.async_caller.is_current_async_call_done(blocking=False, no_dist=True)
                       for call in list(self._queue.async_calls))

    def wait(self) -> int | None:
        """Collective: waits for the save in flight and finalizes it, then for its retention;
        returns its step (None when none was in flight)."""
        if self._vote is not None:  # every rank sent it at its last poll: only collected here
            self._vote.result()
            self._vote = None
        step = self._settle()
        self.join_cleaning()
        return step

    def _settle(self, agreed_done: bool = False) -> int | None:
        """Waits for the writers in flight, then finalizes (``agreed_done``: every rank already
        knows every writer finished; megatron's own check is skipped)."""
        if self._in_flight is None:
            return None
        (step, step_dir), self._in_flight = self._in_flight, None
        try:
            self._queue.maybe_finalize_async_calls(blocking=True, no_dist=agreed_done)
        except Exception as e:  # the failure is agreed: every rank is here
            self._abandon_queue()
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"async save of {step_dir} failed: {e}; the step is not marked complete "
                                  "and resume skips it.") from e
        return step

    def _abandon_queue(self) -> None:
        """After a failed finalize: the save's other requests (another role's writer) are waited
        for but never finalized (their last finalize would mark the step complete)."""
        for call in list(self._queue.async_calls):
            call.async_caller.is_current_async_call_done(blocking=True)
        self._queue.async_calls.clear()
        self._queue = None

    def clean_behind(self, root: str, dirs: list[str], finish: Callable[[], None], writer: bool, what: str) -> None:
        """Starts retention's ``step_dirs.clean`` on a thread of this writer (every rank calls it)."""
        self._cleaning = (what, step_dirs.BackgroundClean(root, dirs, finish) if writer else None)

    def join_cleaning(self) -> None:
        """Collective: waits for the retention left running; its failure on any writer is raised
        on every rank."""
        if self._cleaning is None:
            return
        (what, cleaning), self._cleaning = self._cleaning, None
        agreed(cleaning.join if cleaning is not None else None, what)
