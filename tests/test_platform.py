"""The platform layer: nothing happens at import; setup makes megatron's CUDA-assuming calls land
on the CPU in every rank, for megatron's code only; RNG tracker streams behave as on GPU; fixes are
version-gated."""
from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

import mcore_rl  # noqa: F401
import mcore_rl.models.builder  # noqa: F401
import mcore_rl.platform as platform_mod
from mcore_rl.platform.fixes import FIXES, Fix, apply_fixes
from tests.dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_import_patches_nothing():
    # pytest's own process imported all of mcore_rl but never called setup_platform
    import megatron.core.utils as mutils

    assert platform_mod._active is None
    assert not hasattr(torch.zeros, "__wrapped__")
    assert not hasattr(torch.Tensor.to, "__wrapped__")
    assert mutils.torch is torch
    with pytest.raises((RuntimeError, AssertionError)):
        torch.cuda.current_device()


def as_megatron_code(fn, module: str = "megatron.core.utils"):
    """``fn`` re-bound to a megatron module's globals: it runs as code of that module would."""
    namespace = vars(sys.modules[module])
    return types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)


def _cuda_intent_calls():
    # runs with megatron.core.utils' globals: `torch` is whatever megatron's code sees there
    out = {
        "literal": torch.empty(3, device="cuda").device.type,
        "ordinal": torch.zeros(2, device=torch.cuda.current_device()).device.type,
        "dot_cuda": torch.ones(2).cuda().device.type,
        "to": torch.ones(2).to(torch.device("cuda", 0)).device.type,
        "new": torch.ones(2).new_zeros(3, device="cuda").device.type,
        "type": torch.ones(2).type(),
    }
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        torch.cuda.current_stream().wait_stream(torch.cuda.Stream())
    return out


def _megatron_calls_land_on_cpu():
    from megatron.core import tensor_parallel

    out = as_megatron_code(_cuda_intent_calls)()
    # megatron's tracker: forked regions draw from their own saved stream, the default continues
    tracker = tensor_parallel.get_cuda_rng_tracker()
    tracker.add("test-stream", 1234)
    before = torch.get_rng_state()
    with tracker.fork("test-stream"):
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), before), "fork must restore the default stream"
    with tracker.fork("test-stream"):
        b = torch.rand(4)
    torch.manual_seed(1234)
    assert torch.equal(a, torch.rand(4)) and not torch.equal(a, b)
    return out


def test_megatron_cuda_calls_land_on_cpu_in_ranks():
    for result in run_ranks(2, _megatron_calls_land_on_cpu):
        assert result.pop("type") == "torch.cuda.FloatTensor"
        assert set(result.values()) == {"cpu"}, result


def _tp_streams_differ():
    from megatron.core import parallel_state, tensor_parallel

    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state

    initialize_parallel_state(ParallelLayout(tp=2), seed=7)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        tp_draw = torch.rand(3)
    default_draw = torch.rand(3)
    return {"tp_rank": parallel_state.get_tensor_model_parallel_rank(), "tp": tp_draw, "dp": default_draw}


def test_model_parallel_rng_streams():
    # TP ranks draw differently inside the model-parallel fork and identically outside it
    r0, r1 = run_ranks(2, _tp_streams_differ)
    assert not torch.equal(r0["tp"], r1["tp"])
    assert torch.equal(r0["dp"], r1["dp"])


def _shim_is_needed():
    platform_mod._shim.deactivate()
    try:
        as_megatron_code(_cuda_intent_calls)()
    except (RuntimeError, AssertionError) as e:
        return f"raised: {e}"
    return "no error"


def test_without_shim_cuda_placement_fails():
    (result,) = run_ranks(1, _shim_is_needed)
    assert result.startswith("raised"), result


def _setup_is_idempotent():
    from mcore_rl.platform import setup_platform

    first = setup_platform("cpu")
    assert setup_platform() is first
    try:
        setup_platform("cuda")
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_setup_twice_and_switch():
    (msg,) = run_ranks(1, _setup_is_idempotent)
    assert "platform already set up for 'cpu' in this process; cannot switch to 'cuda'" in msg


def test_fixes_are_version_gated(monkeypatch):
    calls = []
    fixes = [
        Fix("in_range", "d", "0.16.0", "0.16.1", cpu_only=False, apply=lambda: calls.append("a") or (lambda: None)),
        Fix("too_new", "d", "0.17.0", "0.18.0", cpu_only=False, apply=lambda: calls.append("b") or (lambda: None)),
        Fix("cpu_only", "d", "0.16.0", "0.16.1", cpu_only=True, apply=lambda: calls.append("c") or (lambda: None)),
    ]
    monkeypatch.setattr("mcore_rl.platform.fixes.FIXES", fixes)
    monkeypatch.setattr("mcore_rl.platform.fixes.megatron_version", lambda: "0.16.1")
    monkeypatch.setattr("mcore_rl.platform.fixes._undo", {})
    assert apply_fixes(on_cpu=False) == ["in_range"]
    assert apply_fixes(on_cpu=True) == ["cpu_only"]  # each fix is applied once per process
    assert calls == ["a", "c"]


def _uneven_collectives():
    def collectives():  # run as megatron's MoE dispatchers would call them
        rank = torch.distributed.get_rank()
        mine = torch.full((rank + 1, 2), float(rank + 1))  # rank r holds r + 1 rows
        pieces = [torch.empty(r + 1, 2) for r in range(2)]
        torch.distributed.all_gather(pieces, mine)
        inputs = [torch.full((r + 1, 2), float(rank + 1)) for r in range(2)]
        out = torch.empty(rank + 1, 2)
        torch.distributed.reduce_scatter(out, inputs)
        return {"gathered": pieces, "reduced": out}

    return as_megatron_code(collectives, "megatron.core.tensor_parallel.mappings")()


def test_gloo_uneven_all_gather_and_reduce_scatter():
    # megatron's MoE dispatchers (TP x EP with sequence parallel) need both; gloo alone refuses
    for rank, result in enumerate(run_ranks(2, _uneven_collectives)):
        assert [p.tolist() for p in result["gathered"]] == [[[1.0, 1.0]], [[2.0, 2.0]] * 2]
        assert torch.equal(result["reduced"], torch.full((rank + 1, 2), 3.0))


def test_unknown_device_type_is_refused():
    from mcore_rl.errors import McoreRLError
    from mcore_rl.platform import setup_platform

    with pytest.raises(McoreRLError, match="device_type='tpu'; use 'cuda', 'cpu' or None"):
        setup_platform("tpu")
    assert platform_mod._active is None


def _setup_with_a_failing_fix() -> dict:
    import mcore_rl.platform as pm
    from mcore_rl.platform import fixes, setup_platform, teardown_platform
    from megatron.core.transformer.moe import moe_layer, moe_utils

    teardown_platform()
    clean = (moe_layer.MoELayer.__dict__["__init__"], moe_utils.maybe_move_tensor_to_cpu,
             hasattr(moe_utils, "te_general_gemm"))

    def broken():
        raise RuntimeError("planted: this fix cannot be applied")

    fixes.FIXES.append(Fix("broken", "d", "0.0.0", "99.0.0", cpu_only=False, apply=broken))
    try:
        setup_platform("cpu")
    except RuntimeError as e:
        error = str(e)
    else:
        error = "no error"
    fixes.FIXES.pop()
    after = (moe_layer.MoELayer.__dict__["__init__"], moe_utils.maybe_move_tensor_to_cpu,
             hasattr(moe_utils, "te_general_gemm"))
    out = {"error": error, "active": pm._active is not None, "left_applied": sorted(fixes._undo),
           "objects_restored": [a is b for a, b in zip(clean, after)]}
    out["applied_again"] = list(setup_platform("cpu").applied_fixes)  # a later setup applies them all
    return out


def test_failed_setup_reverts_the_fixes_it_applied():
    (out,) = run_ranks(1, _setup_with_a_failing_fix)
    assert out["error"] == "planted: this fix cannot be applied" and not out["active"]
    assert out["left_applied"] == [], out  # earlier fixes must not stay patched
    assert out["objects_restored"] == [True, True, True], out
    assert out["applied_again"] == [f.name for f in FIXES if not f.before_import], out


def _rng_fork_notices() -> dict:
    import logging

    from megatron.core.tensor_parallel import random as mrandom

    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state

    initialize_parallel_state(ParallelLayout(), seed=1)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logger = logging.getLogger("megatron.core.tensor_parallel.random")
    logger.addHandler(handler)
    before = torch.get_rng_state()
    with mrandom.get_cuda_rng_tracker().fork():  # what megatron's dropout in a TP region does
        inside = torch.rand(4)  # moves the CPU generator: megatron's check sees a change
    after = torch.get_rng_state()
    logger.warning("another notice")  # the filter drops only the shared-RNG false positive
    logger.removeHandler(handler)
    return {"records": records, "restored": torch.equal(before, after),
            "own_stream": not torch.equal(inside, torch.rand(4))}


def test_rng_fork_on_the_shared_cpu_generator_logs_nothing():
    # on CPU the "CUDA" generator is the CPU one: megatron's check would log on every dropout
    (out,) = run_ranks(1, _rng_fork_notices)
    assert out["restored"] and out["own_stream"], out  # the fork drew from its own state, then restored
    assert out["records"] == ["another notice"], out


_IMPORT_PROBE = """
import contextlib, sys, torch
from mcore_rl.platform.fixes import megatron_import_fixes
original = torch.compile
fix = megatron_import_fixes(on_cpu=True) if sys.argv[1] == "fix" else contextlib.nullcontext([])
with fix as applied:
    import megatron.core.models.gpt, megatron.core.transformer.moe.moe_layer
    from megatron.core.fusions import fused_bias_swiglu
    mine = torch.compile(lambda x: x * 2 + 1, backend="eager")
print("APPLIED", applied)
print("DYNAMO_AFTER_IMPORT", "torch._dynamo" in sys.modules)
print("RESTORED", torch.compile is original, type(fused_bias_swiglu.swiglu).__name__)
x = torch.arange(4.0)
print("SAME", torch.equal(mine(x), x * 2 + 1), "torch._dynamo" in sys.modules)
print("COMPILED_BY_DYNAMO", hasattr(getattr(mine, "_compiled", mine), "_torchdynamo_orig_callable"))
"""


def test_megatron_import_defers_its_torch_compile_calls():
    """jit_fuser_compiles_at_import: importing megatron-core under ``megatron_import_fixes`` (what
    hf_to_mcore.py does) imports neither torch._dynamo nor torch._inductor; jit_fuser functions
    become wrappers that torch.compile with the same options on their first call (shown with a
    function compiled under the fix: same result, compiled by dynamo once called). Without the
    fix (a second fresh process) the import itself imports torch._dynamo: the defect."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    runs = {mode: subprocess.Popen([sys.executable, "-c", _IMPORT_PROBE, mode], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True) for mode in ("fix", "none")}
    out = {mode: p.communicate(timeout=300) for mode, p in runs.items()}
    fixed, plain = out["fix"][0], out["none"][0]
    assert "APPLIED ['jit_fuser_compiles_at_import']" in fixed and "DYNAMO_AFTER_IMPORT False" in fixed, out["fix"]
    assert "RESTORED True _CompileOnFirstCall" in fixed and "SAME True True" in fixed, fixed
    assert "COMPILED_BY_DYNAMO True" in fixed, fixed
    assert "APPLIED []" in plain and "DYNAMO_AFTER_IMPORT True" in plain, out["none"]
    assert "RESTORED True function" in plain, out["none"]
