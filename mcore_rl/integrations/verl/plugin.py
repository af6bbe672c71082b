"""verl's ``verl.plugins`` entry point (run by ``import verl``): registers the CPU platform and,
when verl ends up on it, applies the CPU patches. On a machine with a GPU nothing changes."""
from __future__ import annotations


def _load() -> None:
    from verl.plugin.platform.platform_manager import PlatformRegistry, get_platform

    from mcore_rl.integrations.verl import platform

    PlatformRegistry.register(platform="cpu")(platform.make_platform_class())
    if get_platform().device_name == "cpu":
        import verl

        platform.apply_patches(getattr(verl, "__version__", "?"))


_load()
