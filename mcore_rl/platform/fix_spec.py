"""What one named workaround for a megatron-core defect is (``fixes.FIXES`` lists them; the
modules beside it that hold fixes of one area each export theirs as a tuple of ``Fix``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from packaging.version import Version


@dataclass(frozen=True)
class Fix:
    """One workaround: ``apply()`` patches megatron-core when ``min_version <= v <= max_version``
    and returns a callable that undoes the patch (used by the test that proves the fix)."""

    name: str
    defect: str
    min_version: str
    max_version: str
    cpu_only: bool
    apply: Callable[[], Callable[[], None]]
    before_import: bool = False  # acts on megatron-core's import: ``megatron_import_fixes`` applies it

    def matches(self, megatron_version: str, on_cpu: bool) -> bool:
        v = Version(megatron_version)
        in_range = Version(self.min_version) <= v <= Version(self.max_version)
        return in_range and (on_cpu or not self.cpu_only)
