"""verl's ``verl.plugins`` entry point (run by ``import verl``): registers the CPU platform and,
when verl ends up on it, applies the CPU patches; installs mcore_rl's registrations (engines,
rollout backend: ``registry``), which take effect when verl imports its registries. On a machine
with a GPU nothing else changes. verl logs a failing plugin at debug level only, so failures
here are logged as warnings before they propagate."""
from __future__ import annotations

import logging


def _load() -> None:
    from verl.plugin.platform.platform_manager import PlatformRegistry, get_platform

    from mcore_rl.integrations.verl import platform, registry

    registry.install()
    PlatformRegistry.register(platform="cpu")(platform.make_platform_class())
    if get_platform().device_name == "cpu":
        import verl

        platform.apply_patches(getattr(verl, "__version__", "?"))


try:
    _load()
except Exception:
    logging.getLogger("mcore_rl.integrations.verl").warning("mcore_rl's verl plugin failed", exc_info=True)
    raise
