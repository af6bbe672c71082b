"""Test-only fault hook: ``MCORE_RL_CKPT_FAULT=<phase>`` kills this process with SIGKILL at that
phase of a save, to prove a crash never leaves a checkpoint that looks complete."""
from __future__ import annotations

import os
import signal
import time

PHASES = ("shards", "metadata", "marker", "tracker", "retention")
ENV = "MCORE_RL_CKPT_FAULT"
RANK_ENV = "MCORE_RL_CKPT_FAULT_RANK"  # optional: only this global rank dies


def fault_point(phase: str) -> None:
    """Kills this process (SIGKILL, no cleanup) when the env var names ``phase``."""
    assert phase in PHASES, phase  # a typo here would make a fault test pass vacuously
    if os.environ.get(ENV) != phase:
        return
    only = os.environ.get(RANK_ENV)
    if only is not None and only != os.environ.get("RANK", "0"):
        return
    os.kill(os.getpid(), signal.SIGKILL)


HOLD_ENV = "MCORE_RL_CKPT_HOLD"  # test-only: a directory; the writer waits there until released


def hold_point(phase: str) -> None:
    """Test-only: with ``MCORE_RL_CKPT_HOLD=<dir>``, announces ``<dir>/<phase>.<pid>`` and waits
    until ``<dir>/release`` exists, so a test can act while a save is provably in flight."""
    where = os.environ.get(HOLD_ENV)
    if not where:
        return
    with open(os.path.join(where, f"{phase}.{os.getpid()}"), "w"):
        pass
    while not os.path.exists(os.path.join(where, "release")):
        time.sleep(0.01)
