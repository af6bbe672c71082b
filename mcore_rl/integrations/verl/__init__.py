"""mcore_rl as a verl training engine (verl 0.9.1): ``engine=mcore_rl`` in verl's configs.

The only package that imports verl. ``import mcore_rl`` never reaches it.
- ``platform``: verl's CPU platform (loaded by verl's ``verl.plugins`` entry point at ``import
  verl``) and the named, version-gated patches of verl functions it needs.
- ``config``: ``McoreRLEngineConfig`` (verl's ``EngineConfig`` with ``strategy='mcore_rl'``) and
  the actor / critic configs of verl's PPO trainer (``model_engine=mcore_rl``); ``megatron_keys``
  reads a verl Megatron script's ``megatron.*`` keys into them; ``verl_optim`` maps verl's
  optimizer config. ``engine_config``: the engine's fields and checks and ``VerlConfigError``,
  below every other module here (the engine reads it, never ``config``, which registers).
- ``engine``: the engines; ``rollout_server`` / ``rollout_replica``: the CPU rollout backend
  (``rollout.name=mcore_rl``); ``registry``: both registered in verl's registries in every
  process verl looks them up (see there).
Kept light: importing this package imports neither verl's workers nor megatron-core.
"""
from __future__ import annotations

from typing import Any

_CONFIGS = ("McoreRLEngineConfig", "McoreRLActorConfig", "McoreRLCriticConfig", "MegatronEngineKeys")
__all__ = [*_CONFIGS, "register_engines"]


def register_engines() -> None:
    """Registers mcore_rl's engines and rollout backend with verl's registries (idempotent)."""
    from mcore_rl.integrations.verl import registry

    registry.install()


def __getattr__(name: str) -> Any:
    # Hydra resolves ``_target_: mcore_rl.integrations.verl.McoreRLEngineConfig`` through here:
    # choosing the engine in a config is what makes verl's registry know it.
    if name in _CONFIGS:
        from mcore_rl.integrations.verl import config  # registers (see config's last line)

        return getattr(config, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
