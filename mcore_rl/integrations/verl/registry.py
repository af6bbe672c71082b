"""mcore_rl in verl's registries, in every process where verl looks them up.

verl builds engines and rollout replicas by name from registries filled at import time, and
its processes are many (the driver, the TaskRunner, each worker; configs travel pickled): a
registration done in one process is missing in the next. ``install()`` registers in the current
process *when verl imports the registry* (an import hook that only watches three module names,
see ``mcore_rl.platform.import_hook``), or at once when it is imported already; it imports no
megatron-core. It runs wherever mcore_rl's verl config is imported or unpickled (Hydra's
``_target_``, a Ray worker receiving the config) and at ``import verl`` through the
``verl.plugins`` entry point (the TaskRunner, which never sees an mcore_rl config when only the
rollout is ours).

Registered:
- engines ``mcore_rl`` for ``language_model`` / ``value_model`` on cpu and cuda (``EngineRegistry``):
  small loader classes whose construction imports ``engine`` and builds the real engine;
- the rollout replica ``mcore_rl`` (``RolloutReplicaRegistry``, verl's public loader registry);
- the checkpoint engine ``mcore_rl`` (``CheckpointEngineRegistry``, verl's public registry; the
  class imports torch.distributed and verl's base, no megatron-core);
- the rollout adapter ``("mcore_rl", "async")`` in ``verl.workers.rollout.base._ROLLOUT_REGISTRY``,
  a private dict: the named patch ``rollout_adapter_registry``, gated on verl 0.9.1.
"""
from __future__ import annotations

import logging
import types
from typing import Any

from mcore_rl.platform.import_hook import when_imported

log = logging.getLogger("mcore_rl.integrations.verl")
BACKEND = "mcore_rl"
VERL_VERSION = "0.9.1"  # the release the private-registry patch was read from
ENGINES = {"language_model": "McoreRLEngineWithLMHead", "value_model": "McoreRLEngineWithValueHead"}
ADAPTER = "mcore_rl.integrations.verl.rollout_replica.ServerAdapter"


def install() -> None:
    """Registers mcore_rl's engines and rollout backend now or when verl imports its registries
    (idempotent, cheap)."""
    when_imported("verl.workers.engine.base", _register_engines)
    when_imported("verl.workers.rollout.replica", _register_replica)
    when_imported("verl.workers.rollout.base", _register_adapter)
    when_imported("verl.checkpoint_engine.base", _register_checkpoint_engine)


def _engine_loader(base_engine: type, class_name: str) -> type:
    def __new__(cls, *args: Any, **kwargs: Any):
        from mcore_rl.integrations.verl import engine

        return getattr(engine, class_name)(*args, **kwargs)  # not a loader instance: no second __init__

    doc = f"Builds mcore_rl.integrations.verl.engine.{class_name} (imports megatron-core on first use)."
    return type(f"{class_name}Loader", (base_engine,), {"__new__": __new__, "__doc__": doc})


def _register_engines(base: types.ModuleType) -> None:
    registry = base.EngineRegistry
    for model_type, class_name in ENGINES.items():
        if BACKEND in registry._engines.get(model_type, {}):
            continue
        registry.register(model_type=model_type, backend=BACKEND, device=["cpu", "cuda"])(
            _engine_loader(base.BaseEngine, class_name))


def _load_replica() -> type:
    from mcore_rl.integrations.verl.rollout_replica import McoreRLReplica

    return McoreRLReplica


def _register_replica(replica: types.ModuleType) -> None:
    replica.RolloutReplicaRegistry.register(BACKEND, _load_replica)


def _register_adapter(base: types.ModuleType) -> None:
    import verl

    table = getattr(base, "_ROLLOUT_REGISTRY", None)
    if getattr(verl, "__version__", "?") != VERL_VERSION or not isinstance(table, dict):
        log.warning("rollout.name=%s is unavailable: the patch rollout_adapter_registry (verl's private "
                    "_ROLLOUT_REGISTRY) was written for verl %s, found %s", BACKEND, VERL_VERSION,
                    getattr(verl, "__version__", "?"))
        return
    table.setdefault((BACKEND, "async"), ADAPTER)


def _register_checkpoint_engine(_base: types.ModuleType) -> None:
    # the module registers its class when it has run (it may be the import that brought verl's
    # base in, half-run now: a plain import of it does not fail then)
    import mcore_rl.integrations.verl.checkpoint_engine  # noqa: F401
