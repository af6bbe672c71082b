"""The per-node queue of background HF exports (``hf_model`` in ``save_contents``).

One process per node that holds a complete copy of the steps runs the exports: global rank 0 on
a shared root, each node's leader on node-local disks (``storage.is_writer``). An export is a
subprocess, ``python -m mcore_rl.conversion.hf_export_worker`` (``hf_export.export_step``: the
``mcore_to_hf.py merge`` path into a staging dir, moved into the step's HF dir, its record
last), started after its step is complete. It dies with the process that started it
(``PR_SET_PDEATHSIG``, set by a boot step before the exporter is exec'd: ``_BOOT``); it lowers
its own CPU and I/O priority and runs ``threads`` torch / OpenMP / MKL threads
(``hf_export_worker``). At most one runs; the others wait in submission order, and a newer
step's submission drops the older steps' exports that have not started (``supersede``). A
thread of the queue starts each export when the one before it ends, so a job that does not poll
still gets its exports; ``poll()`` only collects failures.

A failure (an exit code other than 0, or a kill) is kept with the exporter's error line (its
last ``error:`` line on stderr) until ``poll()``/``wait()`` hands it to the caller, which raises
it on every rank (``CheckpointManager``). Nothing here is collective.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from mcore_rl.checkpoint.storage import node_id

log = logging.getLogger("mcore_rl.checkpoint")

WORKER = "mcore_rl.conversion.hf_export_worker"
_ERROR_TAIL = 64 * 1024  # bytes of the exporter's output read back for its error line
# Started first in the exporter's process: PR_SET_PDEATHSIG (SIGKILL when the thread that started
# it ends: the queue's), exit if that parent is already gone, then exec the exporter (the signal
# setting survives exec). Not a Popen ``preexec_fn``: that forces a fork() of the rank, which
# costs its main thread ~0.2-0.3 s and every later write to its pages a copy-on-write fault
# (measured: 1.6 s more for the next write of a 3 GiB state); without it Popen uses vfork.
_BOOT = ("import ctypes, os, sys\n"
         "ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)\n"
         "if os.getppid() != int(sys.argv[1]): os._exit(1)\n"
         "os.execvp(sys.argv[2], sys.argv[2:])\n")


@dataclass(frozen=True)
class ExportTask:
    """One role of one step to export (``spec``: ``hf_export.ExportSpec``)."""

    step: int
    role: str
    role_dir: str
    spec: Any


@dataclass(frozen=True)
class ExportFailure:
    """An export that failed or was killed, as every rank reports it."""

    step: int
    role: str
    node: int
    error: str

    def describe(self) -> str:
        return f"the HF export of step {self.step} role {self.role} on node {self.node} failed: {self.error}"


@dataclass(frozen=True)
class ExportDone:
    """An export that ended (exit 0): when it started and ended (``time.time()``), its summary line."""

    step: int
    role: str
    started: float
    ended: float
    line: str


Command = Callable[[ExportTask, int], list[str]]


def worker_command(task: ExportTask, threads: int) -> list[str]:
    """The exporter's command line for ``task``."""
    cmd = [sys.executable, "-m", WORKER, "--role_dir", task.role_dir, "--step", str(task.step),
           "--max_shard_size", str(task.spec.max_shard_size), "--threads", str(threads)]
    if task.spec.dtype:
        cmd += ["--dtype", task.spec.dtype]
    fp8 = getattr(task.spec, "fp8", None)
    if fp8 is not None:
        cmd += ["--fp8_block_size", *map(str, fp8.block), "--scale_fmt", fp8.scale_fmt]
    return cmd


class ExportQueue:
    """This node's exports: at most one running, the rest in order (see the module doc).

    ``command``: builds the exporter's argv from a task and the thread count (default: the
    worker module); tests point it elsewhere."""

    def __init__(self, threads: int = 1, supersede: bool = True, command: Command = worker_command) -> None:
        self.threads, self.supersede, self._command = threads, supersede, command
        self._cond = threading.Condition()
        self._queued: list[ExportTask] = []
        self._running: tuple[ExportTask, subprocess.Popen, Any] | None = None
        self._cancelled: set[int] = set()  # pids killed on purpose (no failure reported)
        self._failures: list[ExportFailure] = []
        self.done: list[ExportDone] = []  # the last exports that succeeded (at most 100)
        self._paused = 0
        self._closed = False
        self._thread: threading.Thread | None = None

    # ---- what callers do -----------------------------------------------------------------
    def submit(self, step: int, role_dirs: dict[str, str], spec: Any) -> None:
        """Queues ``role_dirs`` (role -> role dir) of complete step ``step``; with ``supersede``
        the older steps' exports that have not started are dropped (one line)."""
        with self._cond:
            if self._closed:
                raise RuntimeError("ExportQueue.submit after close()")
            if self.supersede:
                older = sorted({t.step for t in self._queued if t.step < step})
                if older:
                    self._queued = [t for t in self._queued if t.step >= step]
                    log.warning("HF export of step(s) %s dropped before it started: superseded by step %d "
                                "(checkpoint.hf_export_supersede; `mcore_to_hf.py merge` exports such a step)",
                                older, step)
            have = {(t.step, t.role) for t in self._queued}
            self._queued += [ExportTask(step, role, d, spec) for role, d in role_dirs.items() if (step, role) not in have]
            self._ensure_thread()
            self._cond.notify_all()

    def poll(self) -> list[ExportFailure]:
        """Non-blocking: the failures since the last poll/wait (each reported once)."""
        with self._cond:
            out, self._failures = self._failures, []
        return out

    def running_steps(self) -> set[int]:
        with self._cond:
            return {self._running[0].step} if self._running else set()

    def running_pid(self) -> int | None:
        """The process id of the running exporter (None when none runs)."""
        with self._cond:
            return self._running[1].pid if self._running else None

    def queued_steps(self) -> list[int]:
        with self._cond:
            return sorted({t.step for t in self._queued})

    def drop(self, steps: set[int] | list[int]) -> list[int]:
        """Drops the queued (not started) exports of ``steps``; returns the steps dropped."""
        with self._cond:
            dropped = sorted({t.step for t in self._queued if t.step in steps})
            self._queued = [t for t in self._queued if t.step not in steps]
        return dropped

    def cancel(self, step: int) -> bool:
        """Drops ``step``'s queued exports and kills (SIGKILL) and reaps its running one (what
        it left in the HF dir is a partial export, ignored by every reader and cleaned at the
        next start). Returns whether anything was dropped or killed."""
        with self._cond:
            found = bool(self.drop({step}))
            if self._running is not None and self._running[0].step == step:
                proc = self._running[1]
                self._cancelled.add(proc.pid)
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                while self._running is not None and self._running[1] is proc:
                    self._cond.wait()
                found = True
        return found

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No export starts inside (the running one, if any, goes on): a caller decides from
        ``running_steps`` what it may delete and ``drop``s the queued exports of it."""
        with self._cond:
            self._paused += 1
        try:
            yield
        finally:
            with self._cond:
                self._paused -= 1
                self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> list[ExportFailure]:
        """Blocks until nothing is queued or running (``timeout`` seconds at most); returns
        the failures not yet reported (``poll``)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._queued and self._running is None, timeout)
        return self.poll()

    def busy(self) -> bool:
        with self._cond:
            return bool(self._queued) or self._running is not None

    def close(self) -> None:
        """Drops what is queued, kills the running export, stops the thread."""
        with self._cond:
            self._closed = True
            self._queued = []
            running = self._running
            self._cond.notify_all()
        if running is not None:
            self.cancel(running[0].step)
        if self._thread is not None:
            self._thread.join()

    # ---- the thread that runs them ---------------------------------------------------------
    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            # the exporters' parent is this thread (PR_SET_PDEATHSIG fires when it ends): it lives
            # as long as the queue; a daemon, so a process that exits without close() is not held
            self._thread = threading.Thread(target=self._run, name="mcore_rl-hf-export", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or (self._queued and not self._paused))
                if self._closed:
                    return
                task = self._queued.pop(0)
                try:
                    output = tempfile.TemporaryFile()
                    proc = self._start(task, output)
                except OSError as e:
                    self._failures.append(ExportFailure(task.step, task.role, node_id(),
                                                        f"the exporter did not start: {type(e).__name__}: {e}"))
                    self._cond.notify_all()
                    continue
                self._running = (task, proc, output)
                started = time.time()
            code = proc.wait()
            failure, line = _outcome(task, code, output), _error_line(output)
            output.close()
            with self._cond:
                if failure is not None and proc.pid not in self._cancelled:
                    log.error("%s", failure.describe())
                    self._failures.append(failure)
                elif failure is None:
                    log.info("HF export of step %d role %s done: %s", task.step, task.role, line)
                    self.done = [*self.done[-99:], ExportDone(task.step, task.role, started, time.time(), line)]
                self._cancelled.discard(proc.pid)
                self._running = None
                self._cond.notify_all()

    def _start(self, task: ExportTask, output) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        log.info("HF export of step %d role %s started (%s)", task.step, task.role, task.role_dir)
        argv = [sys.executable, "-S", "-c", _BOOT, str(os.getpid()), *self._command(task, self.threads)]
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=output, stderr=subprocess.STDOUT, env=env,
                                close_fds=True)


def _outcome(task: ExportTask, code: int, output) -> ExportFailure | None:
    """None for exit 0, else the failure with the exporter's error line."""
    if code == 0:
        return None
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "?"
        why = f"the exporter was killed by signal {-code} ({name})"
    else:
        why = f"the exporter exited with code {code}"
    line = _error_line(output)
    return ExportFailure(task.step, task.role, node_id(), f"{why}: {line}" if line else why)


def _error_line(output) -> str:
    """The exporter's last ``error:`` line, else its last non-empty line ('' when silent): the
    summary line of an export that succeeded."""
    try:
        size = output.seek(0, os.SEEK_END)
        output.seek(max(0, size - _ERROR_TAIL))
        lines = [ln.strip() for ln in output.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if ln.startswith("error:")]
    return (errors or lines or [""])[-1]
