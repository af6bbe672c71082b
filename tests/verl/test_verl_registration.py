"""mcore_rl is known to verl's registries in every process verl builds engines or rollouts in:
a Ray worker that only unpickles an mcore_rl config (verl's critic: TaskRunner builds the config,
the worker unpickles it), and a process that never sees an mcore_rl config (the TaskRunner picks
the rollout replica by name). Both registrations are cheap: no megatron-core import."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

pytest.importorskip("verl")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_fresh(code: str, plugins: str = "auto", stdin: bytes = b"") -> list[str]:
    """Runs ``code`` in a new interpreter (verl's plugin policy ``plugins``); its printed lines."""
    env = {**os.environ, "PYTHONPATH": REPO, "VERL_USE_EXTERNAL_PLUGINS": plugins}
    proc = subprocess.run([sys.executable, "-c", code], input=stdin, env=env, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return proc.stdout.decode().split()


def test_a_worker_that_unpickles_the_config_knows_the_engines():
    from mcore_rl.integrations.verl.config import McoreRLEngineConfig

    config = pickle.dumps(McoreRLEngineConfig(strategy="mcore_rl", forward_only=True))
    code = ("import pickle, sys\n"
            "config = pickle.loads(sys.stdin.buffer.read())  # what a Ray worker does with its arguments\n"
            "from verl.workers.engine import BaseEngine, EngineRegistry\n"
            "for kind in ('language_model', 'value_model'):\n"
            "    cls = EngineRegistry.get_engine_cls(kind, config.strategy)\n"
            "    print(cls.__name__, issubclass(cls, BaseEngine))\n"
            "print('mcore_rl.integrations.verl.engine' in sys.modules)  # built on first use only\n")
    out = run_fresh(code, plugins="none", stdin=config)  # not through the plugin: the config alone
    assert out == ["McoreRLEngineWithLMHeadLoader", "True", "McoreRLEngineWithValueHeadLoader", "True", "False"]


def test_a_process_without_mcore_rl_configs_knows_the_rollout():
    code = ("import sys, verl\n"
            "print('megatron' in sys.modules, 'verl.workers.rollout.replica' in sys.modules)\n"
            "from verl.workers.rollout.replica import get_rollout_replica_class\n"
            "from verl.workers.rollout.base import get_rollout_class\n"
            "print(get_rollout_replica_class('mcore_rl').__name__, get_rollout_class('mcore_rl', 'async').__name__)\n")
    assert run_fresh(code) == ["False", "False", "McoreRLReplica", "ServerAdapter"]


def test_the_adapter_registry_patch_is_gated_on_verl_0_9_1(monkeypatch, caplog):
    import verl
    from verl.workers.rollout import base

    from mcore_rl.integrations.verl import registry

    table = dict(base._ROLLOUT_REGISTRY)
    table.pop(("mcore_rl", "async"), None)
    monkeypatch.setattr(base, "_ROLLOUT_REGISTRY", table)
    monkeypatch.setattr(verl, "__version__", "0.9.2")
    registry._register_adapter(base)
    assert ("mcore_rl", "async") not in table and "written for verl 0.9.1, found 0.9.2" in caplog.text
    monkeypatch.setattr(verl, "__version__", "0.9.1")
    registry._register_adapter(base)
    assert table[("mcore_rl", "async")] == registry.ADAPTER
