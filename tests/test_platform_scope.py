"""platform_scope is reference counted; teardown_platform restores every object setup replaced;
the platform can be set up again after a teardown and megatron runs."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.dist import run_ranks
from tests.steps import forward_outputs, train_step
from tests.tiny import padded_batch, tiny_config, tiny_hf_model


def _snapshot() -> dict:
    """Every object the platform may replace: torch attributes, megatron module globals, the
    megatron objects the fixes patch, the import machinery."""
    import megatron.core.tensor_parallel.random as mrandom
    from megatron.core.transformer.moe import moe_layer, moe_utils, token_dispatcher

    objects = {f"Tensor.{n}": torch.Tensor.__dict__.get(n) for n in (
        "to", "cuda", "type", "pin_memory", "record_stream", "new_empty", "new_zeros", "new_ones",
        "new_full", "new_tensor")}
    objects.update({f"Module.{n}": torch.nn.Module.__dict__.get(n) for n in ("to", "cuda")})
    for owner in (torch, torch.cuda, torch.distributed):
        objects.update({f"{owner.__name__}.{n}": v for n, v in vars(owner).items() if callable(v)})
    for name, module in list(sys.modules.items()):
        if name.startswith("megatron.") and module is not None:
            objects.update({f"{name}:{k}": v for k, v in vars(module).items()
                            if isinstance(v, type(torch))})  # torch, torch.cuda, ... or a proxy
    objects.update({
        "mrandom._get_cuda_rng_state": mrandom._get_cuda_rng_state,
        "mrandom._set_cuda_rng_state": mrandom._set_cuda_rng_state,
        "MoELayer.__init__": moe_layer.MoELayer.__dict__["__init__"],
        "moe_utils.te_general_gemm": getattr(moe_utils, "te_general_gemm", "absent"),
        "moe_utils.maybe_move_tensor_to_cpu": moe_utils.maybe_move_tensor_to_cpu,
        "token_dispatcher.maybe_move_tensor_to_cpu": token_dispatcher.maybe_move_tensor_to_cpu,
    })
    objects.update({f"sys.meta_path[{i}]": finder for i, finder in enumerate(sys.meta_path)})
    return objects


def _changed(before: dict, after: dict) -> list[str]:
    return sorted(k for k in before.keys() | after.keys() if before.get(k, "absent") is not after.get(k, "absent"))


def _scopes_nest_and_teardown_restores(hf_dir: str) -> dict:
    import mcore_rl.platform as pm
    from mcore_rl.parallel import destroy_parallel_state
    from mcore_rl.platform import PlatformError, platform_scope, setup_platform, teardown_platform

    batch = padded_batch(200)
    first = forward_outputs(hf_dir, {}, "actor", batch)  # under the worker's setup_platform()
    active = _snapshot()
    teardown_platform()
    assert pm._active is None
    clean = _snapshot()
    out = {"changed_by_setup": _changed(clean, active)}
    with platform_scope("cpu") as outer:
        in_scope = _snapshot()
        with platform_scope() as inner:
            assert inner is outer, "nested scopes must share one activation"
            with pytest.raises(PlatformError, match="open platform_scope"):
                teardown_platform()
        out["inner_exit_kept"] = (_changed(in_scope, _snapshot()), pm._active is outer)
    out["restored_after_scopes"] = _changed(clean, _snapshot())
    with platform_scope("cpu"):
        setup_platform()  # pins the activation: the scope's exit keeps it
    out["pinned_kept"] = pm._active is not None
    teardown_platform()
    out["restored_after_teardown"] = _changed(clean, _snapshot())
    setup_platform("cpu")  # setup after teardown works again: megatron runs, same outputs
    destroy_parallel_state()
    out["again_equal"] = torch.equal(forward_outputs(hf_dir, {}, "actor", batch), first)
    return out


def test_scope_nesting_teardown_and_setup_again(tmp_path):
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(tmp_path)
    (out,) = run_ranks(1, _scopes_nest_and_teardown_restores, str(tmp_path))
    changed = out["changed_by_setup"]
    # setup really replaced things (so 'restored' below means something): methods, megatron
    # globals, the RNG accessors and the fixes
    for expected in ("Tensor.to", "Module.cuda", "megatron.core.utils:torch", "MoELayer.__init__",
                     "mrandom._get_cuda_rng_state", "moe_utils.te_general_gemm", "sys.meta_path[0]"):
        assert expected in changed, (expected, changed)
    assert not any(k.startswith(("torch.", "torch.cuda.", "torch.distributed.")) for k in changed), changed
    assert out["inner_exit_kept"] == ([], True), out["inner_exit_kept"]
    assert out["restored_after_scopes"] == []
    assert out["pinned_kept"]
    assert out["restored_after_teardown"] == []
    assert out["again_equal"]


_IMPORT_AFTER_SETUP = """
import sys, torch
from mcore_rl.platform import init_distributed, setup_platform
from mcore_rl.platform.cpu_shim import NamespaceProxy

platform = setup_platform("cpu")
assert "megatron.core.models.gpt.gpt_model" not in sys.modules
assert "megatron.core.transformer.transformer_block" not in sys.modules
init_distributed(platform, 0, 1, init_method="file://" + sys.argv[2])
from tests.steps import train_step  # imports megatron's model, DDP, schedule modules now

out = train_step(sys.argv[1], {})
late = ("megatron.core.models.gpt.gpt_model", "megatron.core.transformer.transformer_block")
proxied = [isinstance(sys.modules[name].torch, NamespaceProxy) for name in late]
torch.save({"grads": out["grads"], "outputs": out["outputs"], "proxied": proxied}, sys.argv[3])
torch.distributed.destroy_process_group()
"""


def test_megatron_imported_after_setup_gets_the_shim(tmp_path):
    # a trainer may set the platform up before importing mcore_rl's model code: megatron modules
    # imported later get the CPU view through the import hook
    d = str(tmp_path / "llama")
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(d)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    args = [d, str(tmp_path / "store"), str(tmp_path / "out.pt")]
    proc = subprocess.run([sys.executable, "-c", _IMPORT_AFTER_SETUP, *args], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = torch.load(tmp_path / "out.pt", weights_only=True)
    assert result["proxied"] == [True, True]
    (forked,) = run_ranks(1, train_step, d, {})  # megatron imported before setup, then forked
    assert torch.equal(result["outputs"], forked["outputs"])
    assert result["grads"].keys() == forked["grads"].keys()
    assert all(torch.equal(g, forked["grads"][k]) for k, g in result["grads"].items())


def _left_after_first_teardown(clean: dict) -> list[str]:
    from mcore_rl.platform import teardown_platform

    assert "to" in vars(torch.Tensor)  # the worker's setup_platform() gated Tensor.to
    teardown_platform()
    return _changed(clean, _snapshot())


def test_teardown_leaves_no_trace_of_the_first_setup():
    # Tensor.to/.cuda/.new_* are inherited from TensorBase: putting the originals back into
    # Tensor's own __dict__ would leave 10 class attributes behind
    assert "to" not in vars(torch.Tensor)
    clean = _snapshot()  # pytest's process: the platform was never set up here (fork passes it as is)
    (left,) = run_ranks(1, _left_after_first_teardown, clean)
    assert left == [], left
