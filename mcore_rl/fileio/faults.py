"""Test-only fault hooks, read from the environment (no privilege needed, and they reach the
writer processes an async save forks):

- ``MCORE_RL_CKPT_FAULT=<phase>`` kills this process with SIGKILL at that phase of a save, to
  prove a crash never leaves a checkpoint that looks complete.
- ``MCORE_RL_CKPT_IO_FAULT=<point>:<ERRNO>`` makes the system call at ``point`` fail with that
  errno (e.g. ``flush:EIO``, ``write:ENOSPC``), as a failing or full disk would: the faults a
  kill cannot show.

  ``MCORE_RL_CKPT_IO_FAULT=<point>:<ERRNO>@<suffix>`` fails only for paths ending in
  ``<suffix>`` (e.g. ``stat:EIO@global_step_1/COMPLETE``): one file of a survey, not all of them.

``MCORE_RL_CKPT_FAULT_RANK`` (optional) limits either to one global rank;
``MCORE_RL_CKPT_FAULT_AT=<n>`` (optional) kills at the n-th time this process reaches the phase
(e.g. one engine's save of a later step; default: the first).
"""
from __future__ import annotations

import errno
import os
import signal
import time

# recover: a checkpoint recovery between its renames; stage_commit / stage_aside / stage_swapped:
# Staging.commit before its first rename, after the old output was moved aside, after the new one
# was renamed into place (the old not yet removed)
# hf_export_merge / _move / _record: a background HF export with the merge staged (nothing moved),
# after its first weight file moved into the HF dir, with every file moved (no record yet)
PHASES = ("shards", "metadata", "marker", "swap", "tracker", "retention", "recover", "stage_commit", "stage_aside",
          "stage_swapped", "hf_export_merge", "hf_export_move", "hf_export_record")
ENV = "MCORE_RL_CKPT_FAULT"
RANK_ENV = "MCORE_RL_CKPT_FAULT_RANK"  # optional: only this global rank dies
AT_ENV = "MCORE_RL_CKPT_FAULT_AT"  # optional: the n-th arrival at the phase in this process dies
_ARRIVALS: dict[str, int] = {}  # phase -> arrivals so far in this process (test-only counter)


def _this_rank() -> bool:
    only = os.environ.get(RANK_ENV)
    return only is None or only == os.environ.get("RANK", "0")


def fault_point(phase: str) -> None:
    """Kills this process (SIGKILL, no cleanup) when the env var names ``phase``."""
    assert phase in PHASES, phase  # a typo here would make a fault test pass vacuously
    if os.environ.get(ENV) != phase or not _this_rank():
        return
    _ARRIVALS[phase] = _ARRIVALS.get(phase, 0) + 1
    if _ARRIVALS[phase] == int(os.environ.get(AT_ENV, "1")):
        os.kill(os.getpid(), signal.SIGKILL)


IO_ENV = "MCORE_RL_CKPT_IO_FAULT"
# flush: a shard's background fdatasync; write: a shard's write after its first item (a disk
# that fills up mid-file); marker / tracker / cleanup: the manager's own writes and deletions;
# stat / open / rename: a file's metadata lookup, opening it to read, renaming it (a flaky disk,
# an NFS ESTALE) wherever the code routes those calls through this hook
IO_POINTS = ("flush", "write", "marker", "tracker", "cleanup", "stat", "open", "rename")


def io_fault(point: str, path: str = "") -> None:
    """Raises ``OSError(<errno>)`` for ``path`` when ``MCORE_RL_CKPT_IO_FAULT=<point>:<ERRNO>``
    (``...@<suffix>``: only when ``path`` ends with ``<suffix>``)."""
    assert point in IO_POINTS, point
    spec = os.environ.get(IO_ENV)
    if not spec or not _this_rank():
        return
    spec_point, _, only = spec.partition("@")
    name, _, code = spec_point.partition(":")
    if name != point or (only and not os.path.normpath(path).endswith(os.path.normpath(only))):
        return
    number = getattr(errno, code or "EIO", None)
    if not isinstance(number, int):
        raise ValueError(f"{IO_ENV}={spec!r}: {code!r} is not an errno name (e.g. EIO, ENOSPC).")
    raise OSError(number, f"{os.strerror(number)} (injected by {IO_ENV}={spec})", path or None)


HOLD_ENV = "MCORE_RL_CKPT_HOLD"  # test-only: a directory; the writer waits there until released
HOLD_ONLY_ENV = "MCORE_RL_CKPT_HOLD_ONLY"  # test-only, optional: hold at this phase only


def hold_point(phase: str) -> None:
    """Test-only: with ``MCORE_RL_CKPT_HOLD=<dir>``, announces ``<dir>/<phase>.<pid>`` and waits
    until ``<dir>/release`` exists, so a test can act while a save is provably in flight
    (``MCORE_RL_CKPT_HOLD_ONLY=<phase>``: only at that phase)."""
    where = os.environ.get(HOLD_ENV)
    if not where or os.environ.get(HOLD_ONLY_ENV, phase) != phase:
        return
    with open(os.path.join(where, f"{phase}.{os.getpid()}"), "w"):
        pass
    while not os.path.exists(os.path.join(where, "release")):
        time.sleep(0.01)
