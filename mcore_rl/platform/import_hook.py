"""Run a callback right after a module's code has executed: the one import-hook mechanism.

``AfterImport(select, callback)`` is a meta-path finder: for module names ``select`` accepts it
finds the module with the other finders, then wraps the loader so ``callback(module)`` runs once
the module's own code has run. The module keeps its real loader and spec; nothing else about the
import changes. Used by the CPU shim (megatron modules get their CPU view) and by the verl
integration (mcore_rl's engines and rollout backend are registered in verl's registries when verl
imports them, in whichever process that happens).
"""
from __future__ import annotations

import importlib.abc
import sys
import types
from typing import Any, Callable


class _CallAfterExec(importlib.abc.Loader):
    """Runs the real loader, then the callback on the new module."""

    def __init__(self, loader: Any, callback: Callable[[types.ModuleType], None]) -> None:
        self._loader, self._callback = loader, callback

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        module.__loader__ = self._loader  # the module keeps its real loader (inspect, linecache)
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._callback(module)


class AfterImport(importlib.abc.MetaPathFinder):
    """Finds the modules ``select(name)`` accepts with the other finders; ``callback(module)``
    runs after each of them has executed. ``install()`` / ``remove()`` manage ``sys.meta_path``."""

    def __init__(self, select: Callable[[str], bool], callback: Callable[[types.ModuleType], None]) -> None:
        self._select, self._callback = select, callback
        self._searching: set[str] = set()  # names this hook is finding now (other hooks ask back)

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname in self._searching or not self._select(fullname):
            return None
        self._searching.add(fullname)
        try:
            spec = self._find_elsewhere(fullname, path, target)
        finally:
            self._searching.discard(fullname)
        if spec is None:
            return None
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _CallAfterExec(spec.loader, self._callback)
        return spec

    def _find_elsewhere(self, fullname: str, path: Any, target: Any) -> Any:
        for finder in sys.meta_path:
            if finder is not self and hasattr(finder, "find_spec"):
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    return spec
        return None

    @property
    def installed(self) -> bool:
        return self in sys.meta_path

    def install(self) -> None:
        if not self.installed:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self.installed:
            sys.meta_path.remove(self)


_WAITING: dict[tuple[str, Callable], AfterImport] = {}  # (name, callback) -> its installed hook


def when_imported(name: str, callback: Callable[[types.ModuleType], None]) -> AfterImport | None:
    """``callback(module)`` now if ``name`` is imported already, else right after it is; returns
    the installed hook (None when it ran at once). The hook removes itself after one call; asking
    again for the same (name, callback) while it waits returns the waiting hook."""
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
        return None
    key = (name, callback)
    if key in _WAITING and _WAITING[key].installed:
        return _WAITING[key]

    def once(module: types.ModuleType) -> None:
        hook.remove()
        _WAITING.pop(key, None)
        callback(module)

    hook = AfterImport(lambda fullname: fullname == name, once)
    hook.install()
    _WAITING[key] = hook
    return hook
