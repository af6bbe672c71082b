"""MoE routing replay (verl's R2/R3): compute_log_prob records every MoE layer's expert choices
per token; update_policy replays them. Checked after perturbing the routers so that fresh routing
differs: a hook on every router sees exactly the recorded experts, and the update's log-probs
equal transformers' with the same (perturbed) weights forced to the recorded experts. Recorded
routes are the same at every layout (EP=2, PP=2, TP=2+SP with packing, CP=2); a reference model
in the same process and megatron's process-global replay switches never reach the actor."""
from __future__ import annotations

import os

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import rl_batch, tiny_config, tiny_hf_model

ROWS, PROMPT, RESPONSE = 8, 8, 6
LAYOUTS = {  # name -> (world, layout, actor overrides)
    "single": (1, {}, {}),
    "ep2": (2, dict(ep=2), {}),
    "pp2": (2, dict(pp=2), {}),
    "tp2_sp_packed": (2, dict(tp=2, sequence_parallel=True), dict(use_remove_padding=True)),
    "cp2": (2, dict(cp=2), {}),
    "cp2_packed": (2, dict(cp=2), dict(use_remove_padding=True)),
}


def _batch() -> dict:
    batch = rl_batch(200, batch=ROWS, prompt=PROMPT, response=RESPONSE, seed=21)
    g = torch.Generator().manual_seed(4)
    mask = batch["attention_mask"][:, -RESPONSE:].float()
    batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    return batch


def _run(hf_dir: str, layout_kwargs: dict, actor_kwargs: dict, mode: str, out_dir: str) -> dict:
    """Record (R2) with the loaded weights, perturb every router, then update with ``mode``;
    a hook counts, for each router call of the update, tokens whose experts differ from the
    recorded ones. Also: a reference engine in the process, megatron's global switches."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.models.routing import ROUTED_EXPERTS
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    options = BuildOptions(moe=MoEOptions(router_dtype="fp64"))
    engine = ModelEngine(args, layout, "actor", active_platform(), options, OptimConfig(lr=1e-3), hf_dir)
    ref = ModelEngine(args, layout, "actor", active_platform(), options, None, hf_dir)
    config = ActorConfig(micro_batch_size=2, ppo_mini_batch_size=ROWS, router_replay=mode, **actor_kwargs)
    actor = Actor(engine, config, ref=ref)
    batch = _batch()
    ref_before = actor.compute_ref_log_prob(batch)
    recorder = Actor(engine, ActorConfig(**{**config.__dict__, "router_replay": "R2"}))
    recorded = recorder.compute_log_prob(batch)
    routes = recorded[ROUTED_EXPERTS]
    with torch.no_grad():  # the recorded routes replayed with the same weights: the same log-probs
        again = recorder._forward_log_probs(engine, {**batch, ROUTED_EXPERTS: routes}, False, replay_routing=True)
    # another library's global switch: reaches neither engine (their routers left the list)
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    ref_after = actor.compute_ref_log_prob(batch)
    with torch.no_grad():  # fresh routing would now pick other experts for many tokens
        for chunk in engine.model:
            for name, p in chunk.named_parameters():
                if name.endswith("router.weight"):
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(9)).to(p) * 0.3)
    engine.refresh_optimizer_params()
    # the perturbed weights the update starts from (copies: export gives views of the parameters)
    weights = {k: v.clone() for k, v in export_hf(engine.model, args, "actor").items()}
    seen = _hook_routers(engine, routes)
    batch.update(old_log_probs=recorded["log_probs"], **({ROUTED_EXPERTS: routes} if mode != "disabled" else {}))
    metrics = actor.update_policy(batch)
    out = {"routes": routes, "log_probs": recorded["log_probs"], "ref_same": torch.equal(ref_before, ref_after),
           "replayed_log_probs": again["log_probs"],
           "mismatch": seen["mismatch"], "tokens": seen["tokens"], "replayed": seen["replayed"], "metrics": metrics,
           "global_list": len(RouterReplay.global_router_replay_instances)}
    if torch.distributed.get_rank() == 0:
        from safetensors.torch import save_file

        os.makedirs(out_dir, exist_ok=True)
        save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out_dir, "model.safetensors"))
    return out


def _replays_recording(r: dict) -> bool:
    """The recorded routes replayed (same weights) give the recording's log-probs, within fp32
    rounding: replay sends padding tokens to experts 0..k-1 (the recording routed them freely),
    so the experts' GEMMs run on other row counts (measured: 1 ulp, 4.8e-7 at |log p| ~ 6)."""
    lp = r["log_probs"]
    return (r["replayed_log_probs"] - lp).abs().max().item() <= 8 * torch.finfo(lp.dtype).eps * lp.abs().max().item()


def _hook_routers(engine, routes: torch.Tensor) -> dict:
    """Counts real tokens whose chosen experts (a router's routing map) differ from ``routes``,
    matching tokens through the recording's own map (every replayed router sees its tokens)."""
    seen = {"mismatch": 0, "tokens": 0, "replayed": 0}
    for chunk in engine.model:
        for module in chunk.modules():
            replay = getattr(module, "router_replay", None)
            if replay is None:
                continue

            def check(router, _inputs, output, replay=replay):
                if replay.target_topk_idx is None:  # not replaying: compare with nothing
                    seen["tokens"] += int(output[1].shape[0])
                    return
                chosen = output[1].nonzero()[:, 1].view(-1, output[1].sum(1).max().int())
                want = replay.target_topk_idx.sort(1).values
                seen["mismatch"] += int((chosen.sort(1).values != want).any(1).sum())
                seen["tokens"] += int(chosen.shape[0])
                seen["replayed"] += int(chosen.shape[0])

            module.register_forward_hook(check)
    return seen


def _hf_ppo_kl(weights_dir: str, hf_dir: str, batch: dict, old: torch.Tensor, routes: torch.Tensor | None) -> float:
    """mean(old - log p) over the response tokens with transformers and the saved weights;
    ``routes`` given: every MoE router forced to them (padding tokens to experts 0..k-1)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from tests.tiny import hf_log_probs

    shutil.copy(os.path.join(hf_dir, "config.json"), weights_dir)
    hf = AutoModelForCausalLM.from_pretrained(weights_dir, attn_implementation="eager").eval()
    if routes is not None:
        k = routes.shape[-1]
        flat = routes.reshape(-1, routes.shape[2], k)
        flat = torch.where(flat < 0, torch.arange(k).expand_as(flat), flat)
        gates = [getattr(layer.mlp, "gate", None) or layer.mlp.router for layer in hf.model.layers
                 if hasattr(layer.mlp, "gate") or hasattr(layer.mlp, "router")]
        for ordinal, gate in enumerate(gates):
            gate.forward = _forced(gate, flat[:, ordinal])
    lp, _ = hf_log_probs(hf, batch)
    mask = batch["attention_mask"][:, -RESPONSE:].bool()
    return float((old.double() - lp.double())[mask].mean())


def _forced(gate, indices: torch.Tensor):
    """``gate``'s forward with its top-k forced to ``indices``: DeepSeek's sigmoid router (scores
    renormalised, scaled), gpt-oss' router (a bias; softmax over the chosen logits), or a softmax
    router (Qwen3-Next: probabilities over all experts, renormalised over the chosen ones when
    norm_topk_prob)."""
    def forward(hidden):
        bias = getattr(gate, "bias", None)
        logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim).float(), gate.weight.float(),
                                            None if bias is None else bias.float())
        if bias is not None:  # gpt-oss: top-k of the logits, then a softmax over those k
            return logits, logits.gather(1, indices).softmax(-1).to(hidden.dtype), indices
        if hasattr(gate, "routed_scaling_factor"):
            weights = logits.sigmoid().gather(1, indices)
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20) * gate.routed_scaling_factor
            return logits, weights, indices
        weights = logits.softmax(-1).gather(1, indices)
        if gate.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights.to(hidden.dtype), indices
    return forward


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("deepseek_replay")
    tiny_hf_model(tiny_config("deepseek_v3", num_hidden_layers=4)).save_pretrained(d)
    return str(d)


@pytest.fixture(scope="module")
def single(hf_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("single_weights"))
    return run_ranks(1, _run, hf_dir, {}, {}, "R2", out)[0], out


@pytest.mark.parametrize("layout", LAYOUTS)
def test_replay_forces_the_recorded_experts(layout, hf_dir, single, tmp_path):
    ref, weights = single
    world, kwargs, actor_kwargs = LAYOUTS[layout]
    if layout != "single":
        weights = str(tmp_path)
        results = run_ranks(world, _run, hf_dir, kwargs, actor_kwargs, "R2", weights)
    else:
        results = [ref]
    real = _batch()["attention_mask"].bool()
    assert (ref["routes"][real] >= 0).all() and (ref["routes"][~real] == -1).all()
    forced = _hf_ppo_kl(weights, hf_dir, _batch(), ref["log_probs"], ref["routes"])
    fresh = _hf_ppo_kl(weights, hf_dir, _batch(), ref["log_probs"], None)
    assert abs(forced - fresh) > 1e-3, (forced, fresh)  # the perturbed routers would route otherwise
    for rank, r in enumerate(results):
        assert torch.equal(r["routes"], ref["routes"]), f"{layout} rank {rank}: recorded routes differ"
        assert _replays_recording(r), f"{layout} rank {rank}: replaying the recorded routes changed the log-probs"
        assert r["replayed"] > 0 and r["mismatch"] == 0, r
        assert r["ref_same"] and r["global_list"] == 0
        got = r["metrics"]["actor/ppo_kl"]
        assert abs(got - forced) <= 1e-5, f"{layout} rank {rank}: ppo_kl {got} vs forced {forced}"


def test_replay_off_routes_afresh(hf_dir, single, tmp_path):
    ref, _ = single
    (r,) = run_ranks(1, _run, hf_dir, {}, {}, "disabled", str(tmp_path))
    fresh = _hf_ppo_kl(str(tmp_path), hf_dir, _batch(), ref["log_probs"], None)
    assert abs(r["metrics"]["actor/ppo_kl"] - fresh) <= 1e-5
    assert r["replayed"] == 0 and r["tokens"] > 0  # no router had replay targets


def _errors(hf_dir: str, dense_dir: str) -> dict:
    from mcore_rl.errors import McoreRLError
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.routing import ROUTED_EXPERTS
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    def error(fn) -> str:
        try:
            fn()
        except McoreRLError as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    initialize_parallel_state(ParallelLayout())
    moe = ModelEngine(model_args_from_hf(hf_dir), ParallelLayout(), "actor", active_platform(),
                      optim=OptimConfig(lr=1e-3), hf_weights=hf_dir)
    dense = ModelEngine(model_args_from_hf(dense_dir), ParallelLayout(), "actor", active_platform(), hf_weights=dense_dir)
    actor = Actor(moe, ActorConfig(micro_batch_size=2, ppo_mini_batch_size=ROWS, router_replay="R3"))
    batch = {**_batch(), "old_log_probs": torch.zeros(ROWS, RESPONSE)}
    bad = torch.zeros(ROWS, PROMPT + RESPONSE, 3, 2, dtype=torch.long)  # 3 MoE layers, top 2
    return {
        "dense": error(lambda: Actor(dense, ActorConfig(router_replay="R2"))),
        "mode": error(lambda: Actor(moe, ActorConfig(router_replay="R4"))),
        "missing": error(lambda: actor.update_policy(batch)),
        "shape": error(lambda: actor.update_policy({**batch, ROUTED_EXPERTS: bad[:, :, :2]})),
        "range": error(lambda: actor.update_policy({**batch, ROUTED_EXPERTS: bad + 8})),
    }


def test_clear_errors(hf_dir, tmp_path):
    from tests.tiny import saved_tiny_llama

    out = run_ranks(1, _errors, hf_dir, saved_tiny_llama(tmp_path, 2))[0]
    assert out["dense"].startswith("ConfigError: router_replay='R2' needs an MoE model; llama here is dense")
    assert out["mode"].startswith("ConfigError: router_replay='R4'; use 'disabled', 'R2' or 'R3'")
    assert "router_replay='R3' needs batch['routed_experts'] [B, S, MoE layers, top_k] from the rollout (R3)" in out["missing"]
    assert "replay needs [rows, seq, MoE layers, top_k] = [8, 14, 3, 2]" in out["shape"]
    assert "must hold expert indices in [0, 8) (-1 at padding); got torch.int64 values in [8, 8]" in out["range"]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_softmax_routers_replay_too(model_type, tmp_path):
    """Replay is not DeepSeek's alone: softmax routers (renormalised top-k, and mixtral's) at EP=2
    record valid routes and take exactly the replayed experts after their weights moved."""
    d = tmp_path / "hf"
    tiny_hf_model(tiny_config(model_type, num_hidden_layers=2)).save_pretrained(d)
    for r in run_ranks(2, _run, str(d), dict(ep=2), {}, "R2", str(tmp_path / "w")):
        real = _batch()["attention_mask"].bool()
        assert (r["routes"][real] >= 0).all() and (r["routes"][~real] == -1).all()
        assert r["replayed"] > 0 and r["mismatch"] == 0 and r["ref_same"] and r["global_list"] == 0


def test_gpt_oss_router_replays_at_ep2(tmp_path):
    """gpt-oss' router (a bias, a softmax over the top-k logits) at EP=2: valid routes, exactly the
    recorded experts after the routers moved, and the update's ppo_kl equals transformers' with
    every router forced to the recorded experts (not what fresh routing would give)."""
    d = tmp_path / "hf"
    tiny_hf_model(tiny_config("gpt_oss", num_hidden_layers=2)).save_pretrained(d)
    weights = str(tmp_path / "w")
    results = run_ranks(2, _run, str(d), dict(ep=2), {}, "R2", weights)
    ref, real = results[0], _batch()["attention_mask"].bool()
    assert ref["routes"].shape == (ROWS, PROMPT + RESPONSE, 2, 2)
    assert (ref["routes"][real] >= 0).all() and (ref["routes"][~real] == -1).all()
    forced = _hf_ppo_kl(weights, str(d), _batch(), ref["log_probs"], ref["routes"])
    fresh = _hf_ppo_kl(weights, str(d), _batch(), ref["log_probs"], None)
    assert abs(forced - fresh) > 1e-3, (forced, fresh)
    for rank, r in enumerate(results):
        assert torch.equal(r["routes"], ref["routes"]) and _replays_recording(r)
        assert r["replayed"] > 0 and r["mismatch"] == 0 and r["ref_same"] and r["global_list"] == 0, r
        assert abs(r["metrics"]["actor/ppo_kl"] - forced) <= 1e-5, (rank, r["metrics"]["actor/ppo_kl"], forced)


def test_hybrid_moe_replays_at_world_1_and_ep2(tmp_path):
    """Qwen3-Next with Gated DeltaNet layers and a dense-MLP layer (layers: GDN+MoE, attention+MoE,
    GDN+dense, GDN+MoE): routes cover the 3 MoE layers only (the dense layer is skipped in their
    indexing), replaying them gives the recording's log-probs, the same routes at EP=2, and after
    the routers moved the update's ppo_kl equals transformers' with each MoE layer's gate forced
    to its recorded experts."""
    from tests.hybrid_bodies import VARIANTS

    model_type, overrides = VARIANTS["qwen3_next"]
    assert overrides["mlp_only_layers"] == [2] and overrides["layer_types"][2] == "linear_attention"
    d = tmp_path / "hf"
    tiny_hf_model(tiny_config(model_type, **overrides)).save_pretrained(d)
    real = _batch()["attention_mask"].bool()
    for world, layout in ((1, {}), (2, dict(ep=2))):
        weights = str(tmp_path / f"w{world}")
        results = run_ranks(world, _run, str(d), layout, {}, "R2", weights)
        ref = results[0]
        assert ref["routes"].shape == (ROWS, PROMPT + RESPONSE, 3, 2)
        assert (ref["routes"][real] >= 0).all() and (ref["routes"][~real] == -1).all()
        forced = _hf_ppo_kl(weights, str(d), _batch(), ref["log_probs"], ref["routes"])
        fresh = _hf_ppo_kl(weights, str(d), _batch(), ref["log_probs"], None)
        assert abs(forced - fresh) > 1e-3, (forced, fresh)  # the perturbed routers would route otherwise
        for rank, r in enumerate(results):
            assert torch.equal(r["routes"], ref["routes"]) and _replays_recording(r)
            assert r["replayed"] > 0 and r["mismatch"] == 0 and r["ref_same"] and r["global_list"] == 0, r
            got = r["metrics"]["actor/ppo_kl"]
            assert abs(got - forced) <= 1e-5, f"world {world} rank {rank}: ppo_kl {got} vs forced {forced}"
        if world == 1:
            single = ref["routes"]
        else:
            assert torch.equal(ref["routes"], single), "EP=2 recorded other routes than one rank"
