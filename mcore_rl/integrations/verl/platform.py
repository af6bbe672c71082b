"""verl's CPU platform, and the verl functions mcore_rl must replace to run verl on CPU.

verl 0.9.1 has no CPU platform: without a GPU its detection falls back to 'nvidia'. Loaded at
``import verl`` through the ``verl.plugins`` entry point (setup.py), this module registers
``PlatformCPU`` as verl's platform 'cpu'. verl probes its own platforms first, so 'cpu' is chosen
only when no accelerator is found (or with ``VERL_PLATFORM=cpu``).

Patches (each named, gated on the verl version it was read from, applied only while the CPU
platform is verl's platform, and reaching nothing outside verl's modules): see ``PATCHES``.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Callable

import torch

log = logging.getLogger("mcore_rl.integrations.verl")
VERL_VERSION = "0.9.1"  # the release every patch below was read from


def _zero(*_args: Any, **_kwargs: Any) -> int:
    return 0


def _nothing(*_args: Any, **_kwargs: Any) -> None:
    return None


def cpu_device_module() -> SimpleNamespace:
    """What verl calls on ``get_torch_device()``, with CPU meanings: one device, index 'cpu';
    accelerator-memory counters are 0 (there is no accelerator memory; verl reports host memory
    separately as ``perf/cpu_memory_used_gb``); cache, stream and allocator calls do nothing."""
    return SimpleNamespace(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: "cpu",
        get_device_name=lambda *_a: "CPU",  # verl's FLOPs table has a 'CPU' entry
        set_device=_nothing, synchronize=_nothing, empty_cache=_nothing, ipc_collect=_nothing,
        memory_allocated=_zero, memory_reserved=_zero, max_memory_allocated=_zero,
        max_memory_reserved=_zero, reset_peak_memory_stats=_nothing,
        mem_get_info=lambda *_a: (0, 0), set_per_process_memory_fraction=_nothing,
        manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed,
        get_rng_state=lambda *_a: torch.get_rng_state(), set_rng_state=lambda s, *_a: torch.set_rng_state(s),
        Stream=torch.cpu.Stream, current_stream=torch.cpu.current_stream, stream=torch.cpu.stream,
    )


def make_platform_class() -> type:
    """``PlatformCPU``: verl's ``PlatformBase`` for a machine without accelerators."""
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(PlatformBase):
        """No accelerator: tensors on 'cpu', collectives over gloo, no IPC, no profiler ranges."""

        _module = cpu_device_module()

        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: self._module)

        def is_available(self) -> bool:
            return True

        def is_platform_available(self, use_smi_check: bool = False) -> bool:
            return not torch.cuda.is_available()  # probed after verl's own platforms

        def current_device(self) -> Any:
            return "cpu"  # used as ``device=`` and ``.to()`` argument; an int would mean cuda:N

        def device_count(self) -> int:
            return 1

        set_device = _nothing
        synchronize = _nothing
        set_allocator_settings = _nothing
        empty_cache = _nothing
        profiler_start = _nothing
        profiler_stop = _nothing

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        manual_seed_all = manual_seed

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"  # what Ray sets; nothing reads it on CPU

        def nvtx_range(self, msg: str):
            import contextlib

            return contextlib.nullcontext()

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"num_cpus": num_gpus}

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> None:
            return None

    return PlatformCPU


# ---- patches of verl functions ---------------------------------------------------------------
@dataclass(frozen=True)
class VerlPatch:
    """One verl function replaced while verl's platform is 'cpu'. ``why`` says what verl does
    there; ``make(original)`` builds the replacement. ``attribute`` is a name in ``module``, or
    ``Class.method`` for a method of one of its classes."""

    name: str
    module: str
    attribute: str
    why: str
    make: Callable[[Callable], Callable]


def _gloo_process_group(original: Callable) -> Callable:
    def initialize_global_process_group(timeout_second: int = 36000):
        torch.distributed.init_process_group(
            backend="gloo", timeout=timedelta(seconds=timeout_second),
            init_method=os.environ.get("DIST_INIT_METHOD", None))
        return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    initialize_global_process_group.__wrapped__ = original
    return initialize_global_process_group


def _gloo_process_group_ray(original: Callable) -> Callable:
    def initialize_global_process_group_ray(timeout_second=None, backend=None):
        return original(timeout_second=timeout_second, backend=backend or "gloo")

    initialize_global_process_group_ray.__wrapped__ = original
    return initialize_global_process_group_ray


def _sync_dump_without_executor(original: Callable) -> Callable:
    def _dump_generations(self, inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path):
        if hasattr(self, "_dump_executor"):
            return original(self, inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path)
        return self._write_generations(inputs, outputs, gts, scores, reward_extra_infos_dict, dump_path,
                                       self.global_steps)

    _dump_generations.__wrapped__ = original
    return _dump_generations


PATCHES = (
    VerlPatch("gloo_process_group", "verl.utils.distributed", "initialize_global_process_group",
              "asks torch for 'cpu:gloo,<device>:<backend>' = 'cpu:gloo,cpu:gloo' on CPU, which torch "
              "refuses (duplicate device type), then calls set_device(local_rank)", _gloo_process_group),
    VerlPatch("gloo_process_group_ray", "verl.utils.distributed", "initialize_global_process_group_ray",
              "same backend string (TrainingWorker calls it; a no-op when a group exists)",
              _gloo_process_group_ray),
    VerlPatch("rollout_dump_in_async_trainers", "verl.trainer.ppo.ray_trainer", "RayPPOTrainer._dump_generations",
              "submits trainer.rollout_data_dir's file to a thread pool that only RayPPOTrainer.__init__ (and "
              "fully-async's trainer) creates; the one-step-off trainer skips that __init__ (AttributeError "
              "'_dump_executor' at step 1's dump): written at once there", _sync_dump_without_executor),
)


def _owner(module: Any, attribute: str) -> tuple[Any, str]:
    """The object holding ``attribute`` (``name`` or ``Class.name``) and the last name."""
    *path, name = attribute.split(".")
    for part in path:
        module = getattr(module, part)
    return module, name


def apply_patches(verl_version: str) -> list[str]:
    """Applies every patch when verl is the version they were read from (a patch of a module verl
    has not imported yet: right after it is, so ``import verl`` imports nothing more); returns
    their names. Another version: none is applied and a warning says so (verl's own code runs)."""
    if verl_version != VERL_VERSION:
        log.warning("mcore_rl's verl CPU patches were written for verl %s, found %s: not applied",
                    VERL_VERSION, verl_version)
        return []
    from mcore_rl.platform.import_hook import when_imported

    for p in PATCHES:
        when_imported(p.module, _patcher(p))
    return [p.name for p in PATCHES]


def _patcher(p: VerlPatch) -> Callable[[Any], None]:
    def apply(module: Any) -> None:
        owner, name = _owner(module, p.attribute)
        current = getattr(owner, name)
        if getattr(current, "__wrapped__", None) is None:  # not applied yet
            setattr(owner, name, p.make(current))

    return apply


def revert_patches() -> None:
    """Puts verl's functions back (tests)."""
    import importlib

    for p in PATCHES:
        owner, name = _owner(importlib.import_module(p.module), p.attribute)
        original = getattr(getattr(owner, name), "__wrapped__", None)
        if original is not None:
            setattr(owner, name, original)
