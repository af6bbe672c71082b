"""Offload under verl's own call sequence (bodies: offload_bodies.py), 2 ranks (DP=2), one launch
per case:

- bf16, param_offload + optimizer_offload (the actor's fp32 main parameters are their own
  storages) with a reference (param_offload) beside it;
- fp32, optimizer_offload only (the distributed optimizer's fp32 shards are views of the
  parameter buffer: they must stay with the parameters).

Inside each verl context the parts it asks for are on the device, outside the offloaded parts are
in host memory (storages of 0 bytes, also on CPU); log-probs, exported weights, metrics and
updated parameters equal a twin actor that never offloads; a checkpoint saved while offloaded and
loaded into an offloaded actor gives the saved weights, the placement verl expects, and the lr
verl's Megatron engine gives (``use_checkpoint_opt_param_scheduler=False``: the config's warmup
and decay at the checkpoint's step).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from tests.dist import run_ranks  # noqa: E402
from tests.verl import offload_bodies as O  # noqa: E402
from tests.verl.verl_fixtures import save_tiny_model  # noqa: E402

LOSSES = ("grad_norm", "lr", "kl_loss")  # and actor/*: verl's metrics that are not timings
CASES = {"bf16_params_and_optimizer": ("bfloat16", True, True), "fp32_optimizer_only": ("float32", False, True)}


def expected(label: str, param_offload: bool, optimizer_offload: bool, shared: bool) -> dict[str, str]:
    """Where verl expects each kind at each point of the sequence ('on' / 'off'). ``shared``: the
    optimizer's parameters are views of the model parameters (they go where the parameters go)."""
    on = lambda moved: "off" if moved else "on"  # noqa: E731
    params, grads, optim = on(param_offload), on(param_offload), on(optimizer_offload)
    if label == "inside actor" or label.startswith("inside train"):
        params = grads = optim = "on"
    if label in ("inside eval", "exporting"):
        params = "on"
    if label == "after sync":
        params = "off" if param_offload else "on"
    if label.startswith("ref") or label == "inside ref":
        return {"params": "on" if label == "inside ref" else on(param_offload)}
    return {"params": params, "grads": grads, "adam": optim, "main_params": params if shared else optim}


def _label(label: str, index: int, log: list) -> str:
    """Inside the actor: eval (forward-only) or train, told apart by what verl called before."""
    if label != "inside actor":
        return label
    before = [name for name, _ in log[:index] if name.startswith("after")]
    return "inside eval" if before and before[-1] == "after sync" else "inside train"


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    dtype, param_offload, optimizer_offload = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    model = save_tiny_model(str(d / "model"), "qwen2", seed=3)
    ranks = run_ranks(2, O.offload_body, model, dtype, param_offload, optimizer_offload, str(d / "ckpt"))
    return CASES[request.param], ranks


def test_each_context_finds_what_verl_asks_for_on_the_device(case):
    (dtype, param_offload, optimizer_offload), ranks = case
    for rank, r in enumerate(ranks):
        shared = r["main_params_are_param_views"]
        assert shared == (dtype == "float32"), f"rank {rank}: the case does not test the storage it is meant to"
        seen = set()
        for index, (label, got) in enumerate(r["log"]):
            label = _label(label, index, r["log"])
            want = expected(label, param_offload, optimizer_offload, shared)
            got = {k: v for k, v in got.items() if k in want and v != "none"}  # Adam state exists after a step
            assert got == {k: want[k] for k in got}, f"rank {rank}, #{index} {label}: {got}, verl expects {want}"
            seen.add(label)
        assert {"inside eval", "inside train", "exporting", "after sync", "after train", "after save"} <= seen
        assert any(v == "off" for _, got in r["log"] for v in got.values()), "nothing was ever offloaded"
        want = expected("after init", param_offload, optimizer_offload, shared)
        assert {k: v for k, v in r["after_load"].items() if k in want} == want, r["after_load"]


def test_offloaded_actor_computes_what_a_twin_without_offload_computes(case):
    _, ranks = case
    for rank, r in enumerate(ranks):
        moved, plain = r["moved"], r["plain"]
        for step in range(O.STEPS):
            assert moved["log_probs"][step] is not None and moved["log_probs"][step].abs().max() > 1.0
            assert torch.equal(moved["log_probs"][step], plain["log_probs"][step]), (rank, step)
            assert moved["export"][step].keys() == plain["export"][step].keys()
            assert all(torch.equal(t, plain["export"][step][n]) for n, t in moved["export"][step].items())
            numbers = lambda m: {k: v for k, v in (m or {}).items() if k.startswith("actor/") or k in LOSSES}  # noqa: E731
            assert numbers(moved["metrics"][step]) == numbers(plain["metrics"][step]), (rank, step)
        assert all(torch.equal(a, b) for a, b in zip(moved["params"], plain["params"], strict=True))
        start, end = plain["export"][0], plain["export"][1]
        assert any(not torch.equal(start[n], end[n]) for n in start), "the update changed nothing"
        if moved["ref_log_probs"]:  # the reference stays at the start weights
            assert torch.equal(moved["ref_log_probs"][0], moved["ref_log_probs"][1])


def test_checkpoint_saved_offloaded_loads_into_an_offloaded_actor(case):
    from verl.utils.megatron.optimizer import get_megatron_optimizer_param_scheduler
    from verl.workers.config import McoreOptimizerConfig

    _, ranks = case
    for r in ranks:
        saved, start = r["plain"]["export"][1], r["plain"]["export"][0]  # the save ran after step 1's update
        assert r["loaded_export"].keys() == saved.keys()
        assert any(not torch.equal(t, start[n]) for n, t in saved.items()), "the checkpoint holds the start weights"
        assert all(torch.equal(t, saved[n]) for n, t in r["loaded_export"].items())
        # verl's Megatron engine (use_checkpoint_opt_param_scheduler=False): the config's warmup and
        # decay steps at the checkpoint's step count; the peak and floor lr come from the param
        # groups megatron's optimizer restores from the checkpoint (max_lr / min_lr of the save)
        groups = type("Groups", (), {"param_groups": [{"max_lr": O.LR, "min_lr": 0.0}]})()
        config = McoreOptimizerConfig(**{**O.OPTIM, **O.LOADED_OPTIM})
        scheduler = get_megatron_optimizer_param_scheduler(groups, config)
        scheduler.load_state_dict(r["moved"]["saved_scheduler"])
        assert r["moved"]["saved_scheduler"]["num_steps"] == 1
        assert r["lr_after_load"] == pytest.approx(groups.param_groups[0]["lr"], rel=1e-12)
        assert r["lr_after_load"] != pytest.approx(r["moved"]["metrics"][0]["lr"][0])  # not the checkpoint's
