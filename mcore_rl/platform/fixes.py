"""Named, version-gated workarounds for defects in megatron-core.

Each fix names the defect, the megatron-core versions known to have it, and whether it matters on
the current platform. ``apply_fixes`` applies those that match the installed version and records
them; a version outside every range gets none of them, so an upgrade surfaces a defect (through the
test that proves each fix) instead of hiding it under a stale patch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from packaging.version import Version


@dataclass(frozen=True)
class Fix:
    """One workaround: ``apply()`` patches megatron-core when ``min_version <= v <= max_version``."""

    name: str
    defect: str
    min_version: str
    max_version: str
    cpu_only: bool
    apply: Callable[[], None]

    def matches(self, megatron_version: str, on_cpu: bool) -> bool:
        v = Version(megatron_version)
        in_range = Version(self.min_version) <= v <= Version(self.max_version)
        return in_range and (on_cpu or not self.cpu_only)


FIXES: list[Fix] = []


def megatron_version() -> str:
    from megatron.core.package_info import __version__

    return __version__


def apply_fixes(on_cpu: bool, only: set[str] | None = None) -> list[str]:
    """Applies every matching fix (or only those named in ``only``); returns the names applied."""
    version = megatron_version()
    applied = []
    for fix in FIXES:
        if only is not None and fix.name not in only:
            continue
        if fix.matches(version, on_cpu):
            fix.apply()
            applied.append(fix.name)
    return applied
