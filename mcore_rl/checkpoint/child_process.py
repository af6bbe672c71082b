"""What a checkpoint process started beside the ranks does to itself (Linux): die with its parent
(``PR_SET_PDEATHSIG``), and run at a lower CPU and IO priority than training (``nice``,
``ioprio_set``). Used by the torch_dist writer an async save forks and by the background HF
exporter. No torch or megatron import.
"""
from __future__ import annotations

import ctypes
import os
import signal
from functools import partial
from typing import Callable

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
_SYS_IOPRIO = {"x86_64": (251, 252), "aarch64": (30, 31)}  # (ioprio_set, ioprio_get) syscall numbers
_IOPRIO_WHO_PROCESS = 1
_IOPRIO_CLASS_SHIFT = 13
IOPRIO_CLASS_BE, IOPRIO_CLASS_IDLE = 2, 3  # best-effort (levels 0-7, 7 lowest), idle


def die_with_parent(parent_pid: int) -> None:
    """In a child: SIGKILL when the parent dies; exit now if it already has."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def die_with_parent_preexec() -> Callable[[], None]:
    """A ``subprocess.Popen(preexec_fn=...)`` that makes the child die with this process."""
    return partial(die_with_parent, os.getpid())


def _syscalls() -> tuple[int, int]:
    machine = os.uname().machine
    if machine not in _SYS_IOPRIO:
        raise OSError(f"ioprio syscalls are not known for machine {machine!r}")
    return _SYS_IOPRIO[machine]


def ioprio_get(pid: int = 0) -> tuple[int, int]:
    """(IO scheduling class, level) of process ``pid`` (0: this one); class 0 = none set (the
    kernel then derives best-effort from the nice value)."""
    libc = ctypes.CDLL(None, use_errno=True)
    value = libc.syscall(_syscalls()[1], _IOPRIO_WHO_PROCESS, pid)
    if value < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"ioprio_get({pid}): {os.strerror(err)}")
    return value >> _IOPRIO_CLASS_SHIFT, value & ((1 << _IOPRIO_CLASS_SHIFT) - 1)


def ioprio_set(io_class: int, level: int = 0, pid: int = 0) -> None:
    """Sets process ``pid``'s (0: this one) IO scheduling class and level; an OSError when refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(_syscalls()[0], _IOPRIO_WHO_PROCESS, pid, (io_class << _IOPRIO_CLASS_SHIFT) | level) < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"ioprio_set(class {io_class}, level {level}): {os.strerror(err)}")


def lower_priority(nice: int = 10) -> str:
    """This process: ``nice`` more (CPU), IO class idle, or best-effort level 7 where idle is
    refused. Returns what it set, e.g. ``"nice 10, io idle"``; an IO priority the kernel refuses is
    left as it was and said so."""
    now = os.nice(nice)
    try:
        ioprio_set(IOPRIO_CLASS_IDLE)
        io = "io idle"
    except OSError:
        try:
            ioprio_set(IOPRIO_CLASS_BE, 7)
            io = "io best-effort 7"
        except OSError as e:
            io = f"io priority unchanged ({e.strerror or e})"
    return f"nice {now}, {io}"
