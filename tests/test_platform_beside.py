"""The CPU platform leaves code running beside megatron-core unchanged: a trainer's own torch code
(HF reward/reference models, its collectives) sees torch exactly as without ``setup_platform()``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import torch
from transformers import AutoModelForCausalLM

from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# user code's view of torch, recorded in pytest's process (which never sets the platform up)
ORIGINALS = {
    "zeros": torch.zeros, "tensor": torch.tensor, "current_device": torch.cuda.current_device,
    "all_gather": torch.distributed.all_gather, "manual_seed": torch.cuda.manual_seed,
}


def _outcome(fn) -> str:
    try:
        return f"ok: {fn()!r}"
    except Exception as e:  # the exact exception user code would see
        return f"{type(e).__name__}: {e}"


def user_view() -> dict:
    """What user code observes from CUDA-flavoured torch calls on this CPU build."""
    t = torch.ones(2)
    return {
        "zeros_cuda": _outcome(lambda: torch.zeros(2, device="cuda")),
        "tensor_cuda": _outcome(lambda: torch.tensor([1.0], device="cuda")),
        "current_device": _outcome(torch.cuda.current_device),
        "synchronize": _outcome(torch.cuda.synchronize),
        "stream": _outcome(torch.cuda.Stream),
        "get_rng_state": _outcome(torch.cuda.get_rng_state),
        "to_cuda": _outcome(lambda: t.to("cuda")),
        "dot_cuda": _outcome(lambda: t.cuda()),
        "module_cuda": _outcome(lambda: torch.nn.Linear(2, 2).cuda()),
        "new_zeros_cuda": _outcome(lambda: t.new_zeros(2, device="cuda")),
        "pin_memory": _outcome(lambda: t.pin_memory()),
        "type": t.type(),
        "seeded_draw": _outcome(lambda: (torch.cuda.manual_seed(5), torch.rand(2))[1].tolist()),
        "identities": {name: getattr(owner, name) is obj for name, (owner, obj) in {
            "zeros": (torch, ORIGINALS["zeros"]), "tensor": (torch, ORIGINALS["tensor"]),
            "current_device": (torch.cuda, ORIGINALS["current_device"]),
            "all_gather": (torch.distributed, ORIGINALS["all_gather"]),
            "manual_seed": (torch.cuda, ORIGINALS["manual_seed"]),
        }.items()},
    }


def _user_collectives() -> dict:
    rank = torch.distributed.get_rank()
    uneven = [torch.empty(r + 1, 2) for r in range(2)]
    return {
        "uneven_all_gather": _outcome(lambda: torch.distributed.all_gather(uneven, torch.ones(rank + 1, 2))),
        "reduce_scatter": _outcome(lambda: torch.distributed.reduce_scatter(torch.empty(1), [torch.ones(1)] * 2)),
    }


def _views_with_platform_then_without() -> dict:
    from mcore_rl.platform import active_platform, teardown_platform

    torch.manual_seed(0)
    with_platform = {"view": user_view(), "dist": _user_collectives(), "on_cpu": active_platform().on_cpu}
    teardown_platform()
    torch.manual_seed(0)
    return {"with": with_platform, "without": {"view": user_view(), "dist": _user_collectives()}}


def test_user_torch_unchanged_by_platform():
    torch.manual_seed(0)
    clean = user_view()  # pytest's process: the platform never set up here
    assert all(clean["identities"].values())
    assert clean["zeros_cuda"].startswith(("RuntimeError", "AssertionError")), clean["zeros_cuda"]
    assert clean["type"] == "torch.FloatTensor"
    for rank, result in enumerate(run_ranks(2, _views_with_platform_then_without)):
        assert result["with"]["on_cpu"]
        for key, value in clean.items():
            assert result["with"]["view"][key] == value, (rank, key, result["with"]["view"][key], value)
        # gloo refuses uneven list all_gather and list reduce_scatter for user code, as without us
        assert result["with"]["dist"] == result["without"]["dist"], result
        assert not result["with"]["dist"]["uneven_all_gather"].startswith("ok"), result


_LOAD_AFTER_SETUP = textwrap.dedent("""
    import sys, torch
    from transformers import AutoModelForCausalLM
    from mcore_rl.platform import setup_platform

    setup_platform("cpu")
    ids = torch.load(sys.argv[1], weights_only=True)
    out = {}
    for d in sys.argv[3:]:
        model = AutoModelForCausalLM.from_pretrained(d).eval()
        with torch.no_grad():
            out[d] = {"logits": model(input_ids=ids).logits, **dict(model.named_buffers())}
    torch.save(out, sys.argv[2])
""")


def test_hf_model_loaded_after_setup_matches_clean_process(tmp_path):
    dirs = []
    for model_type in ("llama", "qwen2"):
        d = str(tmp_path / model_type)
        tiny_hf_model(tiny_config(model_type)).save_pretrained(d)
        dirs.append(d)
    ids = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.save(ids, tmp_path / "ids.pt")
    # a fresh interpreter: torch's lazily built tables (device-context constructors) start empty,
    # as in a trainer that sets the platform up before loading its reward or reference model
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_AFTER_SETUP, str(tmp_path / "ids.pt"), str(tmp_path / "out.pt"), *dirs],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    after_setup = torch.load(tmp_path / "out.pt", weights_only=True)
    for d in dirs:
        model = AutoModelForCausalLM.from_pretrained(d).eval()  # pytest's process: no platform
        with torch.no_grad():
            clean = {"logits": model(input_ids=ids).logits, **dict(model.named_buffers())}
        assert clean.keys() == after_setup[d].keys()
        for key, value in clean.items():
            diff = (after_setup[d][key] - value).abs().max().item()
            assert torch.equal(after_setup[d][key], value), f"{os.path.basename(d)} {key}: max diff {diff:.3g}"
