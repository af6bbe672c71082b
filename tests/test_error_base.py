"""One error base class: every exception class defined in mcore_rl derives from McoreRLError."""
from __future__ import annotations

import importlib
import importlib.util
import inspect
import pathlib

from mcore_rl.errors import McoreRLError

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "mcore_rl"


def test_every_package_error_derives_from_the_base():
    classes = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "integrations" in path.parts and importlib.util.find_spec("verl") is None:
            continue  # verl's adapter imports verl (tests/verl runs this check where it is installed)
        module = importlib.import_module(".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts))
        classes += [
            cls for _, cls in inspect.getmembers(module, inspect.isclass)
            if issubclass(cls, BaseException) and cls.__module__ == module.__name__
        ]
    assert len(classes) >= 5, classes  # the scan found the package's errors
    strays = [f"{c.__module__}.{c.__qualname__}" for c in classes if not issubclass(c, McoreRLError)]
    assert not strays, f"errors not deriving from mcore_rl.errors.McoreRLError: {strays}"
