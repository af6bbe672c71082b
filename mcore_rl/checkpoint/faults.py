"""Test-only fault hook: ``MCORE_RL_CKPT_FAULT=<phase>`` kills this process with SIGKILL at that
phase of a save, to prove a crash never leaves a checkpoint that looks complete."""
from __future__ import annotations

import os
import signal

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
