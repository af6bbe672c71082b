"""Offload frees every byte of params, grads, fp32 main params and optimizer state (distributed
optimizer on/off x fp32/bf16, and a frozen engine); after onload the bytes are back and training
(or the frozen forward) is bit-identical to a run that never offloaded."""
from __future__ import annotations

import itertools

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import rl_batch, tiny_config, tiny_hf_model

MATRIX = list(itertools.product([True, False], ["fp32", "bf16"]))  # (distributed optimizer, dtype)


def state_bytes(engine) -> dict[str, int]:
    """Storage bytes per kind over every tensor reachable from the engine (counted here, not by
    the Offloader): params, their main_grad/grad, fp32 main params (bf16) with their grads, and
    the optimizer's params and state tensors. Shared storages count once per tensor."""
    kinds: dict[str, list] = {"params": [], "grads": [], "main_params": [], "optimizer": []}
    for chunk in engine.model:
        for p in chunk.parameters():
            kinds["params"].append(p)
            kinds["grads"] += [getattr(p, "main_grad", None), p.grad]
            main = getattr(p, "main_param", None)
            kinds["main_params"] += [main, getattr(main, "grad", None)]
    opt = engine.optimizer
    for o in getattr(opt, "chained_optimizers", None) or ([opt] if opt is not None else []):
        for group in o.optimizer.param_groups:
            kinds["main_params"] += [t for p in group["params"] for t in (p, p.grad)]
        for state in o.optimizer.state.values():
            kinds["optimizer"] += [v for v in state.values() if torch.is_tensor(v)]
    return {k: sum(t.untyped_storage().nbytes() for t in ts if t is not None) for k, ts in kinds.items()}


def _engine(hf_dir: str, layout, dtype: str, optim: dict | None):
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    options = BuildOptions(params_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    return ModelEngine(
        model_args_from_hf(hf_dir), layout, "actor", active_platform(), options,
        optim=OptimConfig(lr=1e-2, **optim) if optim is not None else None, hf_weights=hf_dir,
    )


def _offload_and_back(engine, info: dict) -> None:
    from mcore_rl.rl.offload import Offloader

    offloader = Offloader(engine)
    info["before"] = state_bytes(engine)
    info["freed"] = offloader.offload()
    info["offloaded"] = state_bytes(engine)
    offloader.onload()
    info["after"] = state_bytes(engine)


def _train(hf_dir: str, layout, distributed: bool, dtype: str, offload: bool) -> dict:
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.rl.actor import Actor, ActorConfig

    engine = _engine(hf_dir, layout, dtype, dict(use_distributed_optimizer=distributed))
    actor = Actor(engine, ActorConfig(micro_batch_size=2, ppo_mini_batch_size=8))
    info: dict = {}
    start = export_hf(engine.model, engine.args, "actor")
    for step in range(2):
        batch = rl_batch(200, batch=8, seed=step)
        batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
        batch["advantages"] = torch.randn(batch["old_log_probs"].shape, generator=torch.Generator().manual_seed(step))
        actor.update_policy(batch)
        if offload and step == 0:
            _offload_and_back(engine, info)
    info["params"] = export_hf(engine.model, engine.args, "actor")
    info["trained"] = sorted(k for k, v in start.items() if not torch.equal(v, info["params"][k]))
    return info


def _frozen(hf_dir: str, layout) -> dict:
    from mcore_rl.rl.actor import Actor, ActorConfig

    engine = _engine(hf_dir, layout, "fp32", None)
    actor = Actor(engine, ActorConfig(micro_batch_size=2, ppo_mini_batch_size=8))
    batch = rl_batch(200, batch=8, seed=5)
    info = {"plain": actor.compute_log_prob(batch)["log_probs"]}
    _offload_and_back(engine, info)
    info["again"] = actor.compute_log_prob(batch)["log_probs"]
    return info


def _all_cases(hf_dir: str, layout_kwargs: dict) -> dict:
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout)
    out = {}
    for distributed, dtype in MATRIX:
        plain = _train(hf_dir, layout, distributed, dtype, offload=False)
        moved = _train(hf_dir, layout, distributed, dtype, offload=True)
        moved["differ"] = sorted(k for k in plain["params"] if not torch.equal(plain["params"][k], moved["params"][k]))
        del moved["params"]
        out[(distributed, dtype)] = moved
    out["frozen"] = _frozen(hf_dir, layout)
    return out


@pytest.mark.parametrize("layout", [dict(), dict(tp=2)], ids=["dp2", "tp2"])
def test_offload_frees_everything_and_onload_is_bit_identical(layout, tmp_path):
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(tmp_path)
    for rank, out in enumerate(run_ranks(2, _all_cases, str(tmp_path), layout)):
        for distributed, dtype in MATRIX:
            case = f"rank {rank} distributed_optimizer={distributed} {dtype}"
            info = out[(distributed, dtype)]
            before = info["before"]
            kinds = ["params", "grads", "optimizer"] + (["main_params"] if dtype == "bf16" else [])
            assert all(before[k] > 0 for k in kinds), f"{case}: nothing measured in {before}"
            assert info["offloaded"] == dict.fromkeys(before, 0), f"{case}: left after offload {info['offloaded']}"
            assert info["after"] == before, f"{case}: after onload {info['after']} != before {before}"
            assert info["differ"] == [], f"{case}: params differ from a run without offload: {info['differ']}"
            assert info["trained"], f"{case}: training changed no parameter"
        frozen = out["frozen"]
        assert frozen["before"]["params"] > 0 and frozen["offloaded"] == dict.fromkeys(frozen["before"], 0)
        assert frozen["after"] == frozen["before"]
        assert torch.equal(frozen["plain"], frozen["again"]), f"rank {rank}: frozen forward differs after onload"


def _offload_twice(hf_dir: str) -> str:
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.rl.offload import Offloader, OffloadError

    layout = ParallelLayout()
    initialize_parallel_state(layout)
    offloader = Offloader(_engine(hf_dir, layout, "fp32", dict(use_distributed_optimizer=True)))
    offloader.offload()
    try:
        offloader.offload()
    except OffloadError as e:  # a McoreRLError (and a RuntimeError), not a bare RuntimeError
        message = str(e)
    else:
        message = "no error"
    offloader.onload()
    return message


def test_offload_twice_is_an_error_that_says_what_to_do(tmp_path):
    from mcore_rl.errors import McoreRLError
    from mcore_rl.rl.offload import OffloadError

    assert issubclass(OffloadError, McoreRLError) and issubclass(OffloadError, RuntimeError)
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(tmp_path)
    (message,) = run_ranks(1, _offload_twice, str(tmp_path))
    assert message.startswith("offload() called twice") and "call onload() first" in message, message
