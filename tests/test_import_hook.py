"""The one import-hook mechanism (mcore_rl.platform.import_hook): a callback after a module's
code ran, several hooks on one module, and the same wait asked twice."""
from __future__ import annotations

import sys

from mcore_rl.platform.import_hook import AfterImport, when_imported


def _fresh(tmp_path, monkeypatch, name: str) -> None:
    (tmp_path / f"{name}.py").write_text("VALUE = 41\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop(name, None)


def test_two_hooks_on_one_module_both_run_once(tmp_path, monkeypatch):
    _fresh(tmp_path, monkeypatch, "hooked_twice")
    seen = []
    first = AfterImport(lambda n: n == "hooked_twice", lambda m: seen.append(("first", m.VALUE)))
    second = AfterImport(lambda n: n == "hooked_twice", lambda m: seen.append(("second", m.VALUE)))
    first.install()
    second.install()
    try:
        import hooked_twice  # noqa: F401  (each hook asks the other for the spec: no recursion)
    finally:
        first.remove()
        second.remove()
    assert sorted(seen) == [("first", 41), ("second", 41)]
    assert hooked_twice.__loader__.__class__.__name__ == "SourceFileLoader"  # the real loader stays


def test_when_imported_waits_once_and_runs_at_once_when_loaded(tmp_path, monkeypatch):
    _fresh(tmp_path, monkeypatch, "hooked_later")
    calls = []

    def callback(module):
        calls.append(module.VALUE)

    hook = when_imported("hooked_later", callback)
    assert when_imported("hooked_later", callback) is hook  # asking again does not stack hooks
    import hooked_later  # noqa: F401

    assert calls == [41] and not hook.installed
    assert when_imported("hooked_later", callback) is None and calls == [41, 41]
