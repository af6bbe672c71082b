"""megatron-core 0.16.1's DistributedOptimizer load defects with torch's Adam (no apex/TE), each
fixed in mcore_rl/platform/fixes.py and shown to return when its fix is reverted.

The call sequence proven here (what a checkpoint manager uses):
  save: msd = model.module.sharded_state_dict();
        dist_checkpointing.save({"model": msd, "optimizer": optimizer.sharded_state_dict(msd,
        metadata={"distrib_optim_sharding_type": T})}, path)
  load: msd = fresh.module.sharded_state_dict(); sd = dist_checkpointing.load({"model": msd,
        "optimizer": optimizer.sharded_state_dict(msd, is_loading=True, metadata=same)}, path);
        module.load_state_dict(sd["model"]); optimizer.load_state_dict(sd["optimizer"])
Resuming is bit-exact: N steps == k steps, save, load into a fresh engine, N - k steps."""
from __future__ import annotations

import os

import pytest
import torch

from tests.ckpt_util import engine, flat_tensors, save, train_step
from tests.dist import run_ranks

FULLY, DP_RESHARDABLE = "fully_reshardable", "dp_reshardable"
K, N = 2, 3  # save after K steps, compare after N


def _meta(sharding: str) -> dict:
    return {"distrib_optim_sharding_type": sharding}


def _optimizers(eng) -> list:
    return getattr(eng.optimizer, "chained_optimizers", None) or [eng.optimizer]


def optimizer_state(eng) -> dict[str, torch.Tensor]:
    """This rank's fp32 main params and Adam state (exp_avg, exp_avg_sq, step) in order."""
    out = {}
    for i, o in enumerate(_optimizers(eng)):
        for g, group in enumerate(o.optimizer.param_groups):
            for j, p in enumerate(group["params"]):
                out[f"{i}.{g}.{j}.param"] = p.detach().clone()
                for k, v in o.optimizer.state[p].items():
                    out[f"{i}.{g}.{j}.{k}"] = v.detach().clone()
    return out


def params(eng) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for c in eng.model for k, v in c.module.state_dict().items()
            if torch.is_tensor(v)}


def _save(eng, path: str, sharding: str) -> None:
    msd = eng.model[0].module.sharded_state_dict()
    save({"model": msd, "optimizer": eng.optimizer.sharded_state_dict(msd, metadata=_meta(sharding))}, path)


def _load(eng, path: str, sharding: str) -> None:
    from megatron.core import dist_checkpointing

    msd = eng.model[0].module.sharded_state_dict()
    template = {"model": msd,
                "optimizer": eng.optimizer.sharded_state_dict(msd, is_loading=True, metadata=_meta(sharding))}
    sd = dist_checkpointing.load(template, path)
    eng.model[0].module.load_state_dict(sd["model"])
    eng.optimizer.load_state_dict(sd["optimizer"])


def _resume(root: str, sharding: str, layout: dict, reverted: tuple[str, ...] = (),
            load_layout: dict | None = None, model_type: str = "llama") -> dict:
    """Uninterrupted N steps vs save after K + fresh engine (optionally at ``load_layout``)
    loading it + N - K steps. ``reverted``: fixes undone before the load."""
    from mcore_rl.parallel.layout import destroy_parallel_state
    from mcore_rl.platform.fixes import revert_fix

    path = os.path.join(root, "ckpt")
    a = engine(layout, model_type)
    for s in range(K):
        train_step(a, s)
    _save(a, path, sharding)
    at_save = optimizer_state(a)
    for s in range(K, N):
        train_step(a, s)
    out = {"params_a": params(a), "steps_a": sorted({float(v) for k, v in optimizer_state(a).items()
                                                     if k.endswith("step")})}
    destroy_parallel_state()  # b builds its own groups (the same or another layout)
    b = engine(load_layout or layout, model_type)
    for name in reverted:
        revert_fix(name)
    try:
        _load(b, path, sharding)
    except Exception as e:
        import traceback

        out["error"] = f"{type(e).__name__}: {e}"
        out["traceback"] = traceback.format_exc()[-1500:]
        return out
    if load_layout is not None:  # canonical comparison: re-save at the new layout
        _save(b, os.path.join(root, "resaved"), FULLY)
        return out
    loaded = optimizer_state(b)
    out["state_keys_equal"] = sorted(loaded) == sorted(at_save)
    out["state_mismatch"] = sorted(k for k in at_save if k in loaded and not torch.equal(loaded[k], at_save[k]))
    out["state_kinds"] = sorted({k.rsplit(".", 1)[1] for k in loaded})
    out["step_loaded"] = sorted({float(v) for k, v in loaded.items() if k.endswith("step")})
    for s in range(K, N):
        train_step(b, s)
    out["params_b"] = params(b)
    out["steps_b"] = sorted({float(v) for k, v in optimizer_state(b).items() if k.endswith("step")})
    return out


def _check_resumed(results: list[dict]) -> None:
    for r in results:
        assert "error" not in r, r["traceback"]
        assert r["state_keys_equal"] and r["state_mismatch"] == [], (r["state_mismatch"], r["steps_a"], r["steps_b"], r.get("step_loaded"))
        assert r["state_kinds"] == ["exp_avg", "exp_avg_sq", "param", "step"]
        assert r["steps_a"] == r["steps_b"] == [float(N)]
        diff = [k for k in r["params_a"] if not torch.equal(r["params_a"][k], r["params_b"][k])]
        assert diff == [] and len(r["params_a"]) > 10, diff


@pytest.mark.parametrize("sharding", [FULLY, DP_RESHARDABLE])
def test_resume_is_bit_exact(tmp_path, sharding):
    _check_resumed(run_ranks(2, _resume, str(tmp_path), sharding, {}))


def test_moe_chained_optimizer_ep2_resume(tmp_path):
    """MoE with EP=2: get_megatron_optimizer returns a ChainedOptimizer (dense + expert params)."""
    results = run_ranks(2, _resume, str(tmp_path), FULLY, dict(ep=2, sequence_parallel=False),
                        (), None, "qwen3_moe")
    _check_resumed(results)


def test_without_no_grad_fix_dp_reshardable_load_fails(tmp_path):
    results = run_ranks(2, _resume, str(tmp_path), DP_RESHARDABLE, {}, ("distopt_load_under_no_grad",))
    for r in results:
        assert "a view of a leaf Variable that requires grad" in r.get("error", ""), r.get("error")


def test_without_step_fix_fully_reshardable_load_fails(tmp_path):
    results = run_ranks(2, _resume, str(tmp_path), FULLY, {}, ("distopt_reshardable_keeps_adam_step",))
    for r in results:
        assert "KeyError: 'step'" in r.get("error", ""), r.get("error")


def test_without_step_fix_dp_reshardable_loads_the_templates_step(tmp_path):
    results = run_ranks(2, _resume, str(tmp_path), DP_RESHARDABLE, {}, ("distopt_reshardable_keeps_adam_step",))
    for r in results:
        assert "error" not in r, r["traceback"]
        assert r["step_loaded"] == [0.0] and r["steps_b"] == [float(N - K)], (r["step_loaded"], r["steps_b"])


def test_without_fresh_state_fix_the_load_template_fails(tmp_path):
    results = run_ranks(2, _resume, str(tmp_path), FULLY, {}, ("distopt_state_dict_before_first_step",))
    for r in results:
        assert "assert len(steps) == 1" in r.get("traceback", ""), r.get("traceback")


@pytest.mark.parametrize("sharding", [FULLY, DP_RESHARDABLE])
def test_without_unshare_fix_step_counts_every_param(tmp_path, sharding):
    """The load succeeds but the shared step tensor jumps: the resumed update is wrong."""
    results = run_ranks(2, _resume, str(tmp_path), sharding, {}, ("distopt_unshare_loaded_adam_step",))
    for r in results:
        assert r["steps_a"] == [float(N)] and r["steps_b"] != [float(N)], (r["steps_a"], r["steps_b"])
        assert any(not torch.equal(r["params_a"][k], r["params_b"][k]) for k in r["params_a"])


def test_fully_reshardable_dp2_to_tp2(tmp_path):
    """Saved at DP=2, loaded at TP=2 (same 2 processes), re-saved: every tensor of both
    checkpoints (params, fp32 main params, exp_avg, exp_avg_sq) equal."""
    run_ranks(2, _resume, str(tmp_path), FULLY, {}, (), dict(tp=2))
    first = run_ranks(1, _plain, str(tmp_path / "ckpt"))[0]
    second = run_ranks(1, _plain, str(tmp_path / "resaved"))[0]
    assert sorted(first) == sorted(second) and len(first) > 20
    assert [k for k in first if not torch.equal(first[k], second[k])] == []  # incl. Adam steps


def _plain(path: str) -> dict:
    from megatron.core.dist_checkpointing import load_common_state_dict, load_plain_tensors

    out = flat_tensors(load_plain_tensors(path))
    steps = [g["step"] for g in flat_groups(load_common_state_dict(path))]
    out["steps"] = torch.tensor(steps, dtype=torch.float64)
    return out


def flat_groups(common: dict) -> list[dict]:
    opt = common["optimizer"]
    parts = [opt[k] for k in sorted(opt) if isinstance(k, int)] if 0 in opt else [opt]
    return [g for p in parts for g in p["optimizer"]["param_groups"]]
