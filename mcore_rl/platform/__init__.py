"""The one seam between mcore_rl and the hardware: NCCL + CUDA on GPUs, gloo + CPU otherwise.

Nothing here runs at import. ``setup_platform()`` (or ``with platform_scope():``) must be called in
every process that runs model code (each torchrun rank, each forked or spawned test worker) before
megatron-core is used; ``teardown_platform()`` undoes it. Code outside megatron-core in the same
process sees torch unchanged while the platform is active (see ``cpu_shim``).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Iterator, Literal

import torch

from mcore_rl.errors import McoreRLError
from mcore_rl.platform.cpu_shim import CpuShim
from mcore_rl.platform.fixes import apply_fixes, revert_fixes


@dataclass(frozen=True)
class Platform:
    """Where model code runs: device type, collective backend, Transformer Engine presence."""

    device_type: Literal["cuda", "cpu"]
    backend: Literal["nccl", "gloo"]
    transformer_engine: bool
    applied_fixes: tuple[str, ...] = ()

    @property
    def on_cpu(self) -> bool:
        return self.device_type == "cpu"

    def device(self) -> torch.device:
        """The torch device this process computes on."""
        if self.on_cpu:
            return torch.device("cpu")
        return torch.device("cuda", torch.cuda.current_device())


class PlatformError(McoreRLError, RuntimeError):
    """The platform cannot be set up, switched or torn down as asked."""


_active: Platform | None = None
_shim: CpuShim | None = None
_scopes = 0  # open platform_scope blocks
_pinned = False  # setup_platform() was called: active until teardown_platform()
_previous_cuda_device: int | None = None


def detect_platform() -> Literal["cuda", "cpu"]:
    """'cuda' when a GPU is visible to this process, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def _acquire(device_type: Literal["cuda", "cpu"] | None) -> Platform:
    """The active platform, activating it first when nothing is active."""
    global _active, _shim, _previous_cuda_device
    device_type = device_type or (_active.device_type if _active else detect_platform())
    if _active is not None:
        if _active.device_type != device_type:
            raise PlatformError(
                f"platform already set up for {_active.device_type!r} in this process; "
                f"cannot switch to {device_type!r}. Start a new process instead (or call "
                "teardown_platform() first)."
            )
        return _active
    if device_type not in ("cuda", "cpu"):
        raise PlatformError(f"device_type={device_type!r}; use 'cuda', 'cpu' or None (detect).")
    if device_type == "cuda" and not torch.cuda.is_available():
        raise PlatformError("device_type='cuda' requested but torch sees no GPU; use 'cpu'.")
    if device_type == "cpu":
        _shim = CpuShim()
        _shim.activate()
    else:
        _previous_cuda_device = torch.cuda.current_device()
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    try:
        fixes = apply_fixes(on_cpu=device_type == "cpu")
    except BaseException:  # leave the process as it was
        if _shim is not None:
            _shim.deactivate()
        _shim = None
        raise
    has_te = device_type == "cuda" and importlib.util.find_spec("transformer_engine") is not None
    _active = Platform(
        device_type=device_type,
        backend="gloo" if device_type == "cpu" else "nccl",
        transformer_engine=has_te,
        applied_fixes=tuple(fixes),
    )
    return _active


def _release() -> None:
    """Undoes what ``_acquire`` did: megatron fixes, the CPU shim, the CUDA device binding."""
    global _active, _shim, _pinned, _previous_cuda_device
    assert _active is not None
    revert_fixes(_active.applied_fixes)
    if _shim is not None:
        _shim.deactivate()
    if _previous_cuda_device is not None:
        torch.cuda.set_device(_previous_cuda_device)
    _active, _shim, _pinned, _previous_cuda_device = None, None, False, None


def setup_platform(device_type: Literal["cuda", "cpu"] | None = None) -> Platform:
    """Activates the platform for this process until ``teardown_platform()`` (idempotent).

    On CPU this gives megatron-core's code (only it) the CUDA-to-CPU shim; on GPU it binds the
    process to LOCAL_RANK's GPU. Both apply the megatron-core defect fixes that match the
    installed version. ``device_type=None`` keeps the active one or detects it.
    """
    global _pinned
    platform = _acquire(device_type)
    _pinned = True
    return platform


@contextlib.contextmanager
def platform_scope(device_type: Literal["cuda", "cpu"] | None = None) -> Iterator[Platform]:
    """``with platform_scope() as platform:`` activates the platform for the block.

    Reference counted: nested scopes (and a ``setup_platform()`` made before or inside them)
    share one activation; the last scope to exit tears it down unless ``setup_platform()`` was
    called, which keeps it until ``teardown_platform()``.
    """
    global _scopes
    platform = _acquire(device_type)
    _scopes += 1
    try:
        yield platform
    finally:
        _scopes -= 1
        if _scopes == 0 and not _pinned and _active is not None:
            _release()


def teardown_platform() -> None:
    """Undoes everything setup did (shim patches, megatron fixes, GPU binding); a no-op when
    nothing is active. torch.distributed and megatron's parallel state are the caller's."""
    if _scopes:
        raise PlatformError(
            f"teardown_platform() called inside {_scopes} open platform_scope block(s), which "
            "still use the platform; exit them instead (the last exit tears down by itself)."
        )
    if _active is not None:
        _release()


def active_platform() -> Platform:
    """The platform set up in this process; raises if ``setup_platform`` was not called."""
    if _active is None:
        raise PlatformError(
            "mcore_rl.platform.setup_platform() has not been called in this process; call it "
            "before building models (every rank and every worker process must call it)."
        )
    return _active


def init_distributed(
    platform: Platform,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    timeout_s: float = 600.0,
) -> None:
    """Initializes torch.distributed with the platform's backend (env:// by default, as torchrun)."""
    if torch.distributed.is_initialized():
        return
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", "1")) if world_size is None else world_size
    torch.distributed.init_process_group(
        backend=platform.backend,
        init_method=init_method or "env://",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


__all__ = [
    "Platform", "PlatformError", "setup_platform", "platform_scope", "teardown_platform",
    "active_platform", "detect_platform", "init_distributed",
]
