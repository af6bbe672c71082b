"""The one seam between mcore_rl and the hardware: NCCL + CUDA on GPUs, gloo + CPU otherwise.

Nothing here runs at import. ``setup_platform()`` must be called in every process that runs model
code (each torchrun rank, each forked or spawned test worker) before megatron-core is used.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

import torch

from mcore_rl.platform.cpu_shim import CpuShim
from mcore_rl.platform.fixes import apply_fixes


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


_active: Platform | None = None
_shim: CpuShim | None = None


def detect_platform() -> Literal["cuda", "cpu"]:
    """'cuda' when a GPU is visible to this process, else 'cpu'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def setup_platform(device_type: Literal["cuda", "cpu"] | None = None) -> Platform:
    """Activates the platform for this process (idempotent); returns it.

    On CPU this installs the CUDA-to-CPU shim; on GPU it binds the process to LOCAL_RANK's GPU.
    Both apply the megatron-core defect fixes that match the installed version.
    """
    global _active, _shim
    device_type = device_type or detect_platform()
    if _active is not None:
        if _active.device_type != device_type:
            raise RuntimeError(
                f"platform already set up for {_active.device_type!r} in this process; "
                f"cannot switch to {device_type!r}. Start a new process instead."
            )
        return _active
    if device_type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device_type='cuda' requested but torch sees no GPU; use 'cpu'.")
    if device_type == "cpu":
        _shim = CpuShim()
        _shim.activate()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    fixes = apply_fixes(on_cpu=device_type == "cpu")
    has_te = device_type == "cuda" and importlib.util.find_spec("transformer_engine") is not None
    _active = Platform(
        device_type=device_type,
        backend="gloo" if device_type == "cpu" else "nccl",
        transformer_engine=has_te,
        applied_fixes=tuple(fixes),
    )
    return _active


def active_platform() -> Platform:
    """The platform set up in this process; raises if ``setup_platform`` was not called."""
    if _active is None:
        raise RuntimeError(
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


__all__ = ["Platform", "setup_platform", "active_platform", "detect_platform", "init_distributed"]
