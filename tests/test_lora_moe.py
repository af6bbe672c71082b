"""LoRA on MoE models against peft 0.21 + transformers (fp32): routed-expert adapters (peft's
``target_parameters`` on the fused expert tensors), attention adapters, and DeepSeek-V3's MLA
projections; log-probs, the frozen base as reference, one PPO update; EP=2 and TP=2+SP x EP=2 x
expert-TP=2 against one rank."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.lora_bodies import (adapted_names, assert_equal_to_one_rank, assert_matches_peft_step, lora_ref_with_replay,
                               lora_update, peft_model)
from tests.test_actor_update import ACTOR, make_batch
from tests.tiny import hf_log_probs, tiny_config, tiny_hf_model

TOL = 1e-5
EXPERTS = "*.local_experts.*"
BASE = dict(rank=4, alpha=16.0, lora_A_init_method="kaiming", lora_B_init_method="normal", seed=3)
MODELS = {  # name -> (model_type, lora for log-probs and layouts, lora for the update against peft)
    # qkv's fused adapter shares A between q, k and v (peft: one A each): the update compares the
    # adapters peft holds the same way (o_proj, the experts' fused gate_up and down)
    "qwen3_moe": ("qwen3_moe", dict(BASE, target_modules=("linear_qkv", "linear_proj", EXPERTS)),
                  dict(BASE, target_modules=("linear_proj", EXPERTS))),
    # MLA projections are one HF linear each; the first layer is dense (peft cannot adapt it on
    # this family without the experts' rewrite), shared experts likewise
    "deepseek_v3": ("deepseek_v3", dict(BASE, target_modules=(
        "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
        EXPERTS)), None),
}
LAYOUTS = {  # name -> (model, world, layout)
    "qwen3_moe-ep2": ("qwen3_moe", 2, dict(ep=2)),
    "qwen3_moe-tp2_sp_ep2_etp2": ("qwen3_moe", 4, dict(tp=2, sequence_parallel=True, ep=2, etp=2)),
    "deepseek_v3-tp2_sp_ep2": ("deepseek_v3", 2, dict(tp=2, sequence_parallel=True, ep=2, etp=1)),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (HF dir, HF model, batch, {'main': world-1 result, 'update': world-1 result})."""
    out = {}
    for name, (model_type, lora, update_lora) in MODELS.items():
        d = tmp_path_factory.mktemp(f"lora_{name}")
        hf = tiny_hf_model(tiny_config(model_type, num_hidden_layers=2))
        hf.save_pretrained(d)
        batch = make_batch(hf)
        runs = {"main": run_ranks(1, lora_update, str(d), {}, lora, batch, ACTOR, True)[0]}
        if update_lora is not None:
            runs["update"] = run_ranks(1, lora_update, str(d), {}, update_lora, batch, ACTOR, True)[0]
        out[name] = (str(d), hf, batch, runs)
    return out


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("name", MODELS)
def test_log_probs_and_reference_match_peft(name, models):
    _, hf, batch, runs = models[name]
    ours = runs["main"]
    assert any(".mlp.experts." in k for k in ours["peft_before"])  # the experts carry adapters
    model = peft_model(hf, BASE, ours["peft_before"])
    want, _ = hf_log_probs(model, batch, ACTOR["temperature"])
    base, _ = hf_log_probs(hf, batch, ACTOR["temperature"])
    assert _max_diff(ours["log_probs"], want) <= TOL
    assert _max_diff(ours["log_probs"], base) > 100 * TOL
    assert _max_diff(ours["ref_log_probs"], base) <= TOL


@pytest.mark.parametrize("name", MODELS)
def test_update_matches_peft_step(name, models):
    d, hf, batch, runs = models[name]
    assert_matches_peft_step(hf, d, batch, BASE, runs.get("update", runs["main"]), TOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_equal_one_rank(layout, models):
    name, world, kwargs = LAYOUTS[layout]
    d, _, batch, runs = models[name]
    one, lora = runs["main"], MODELS[name][1]
    assert_equal_to_one_rank(run_ranks(world, lora_update, d, kwargs, lora, batch, ACTOR, True), one, TOL)


def test_reference_replays_the_actors_routes(models):
    """With R2 and the actor's routes in the batch, the LoRA reference is the frozen base routed
    as the policy was; without routes it is the base routed afresh (a separate ref engine)."""
    d, _, batch, _ = models["qwen3_moe"]
    got = run_ranks(1, lora_ref_with_replay, d, MODELS["qwen3_moe"][1], batch, ACTOR)[0]
    assert torch.equal(got["ref_replay"], got["base_replay"])
    assert torch.equal(got["ref_fresh"], got["base_fresh"])  # bit for bit: the same frozen weights
    # the adapters changed some routes, so replaying them changes the reference
    assert _max_diff(got["ref_replay"], got["ref_fresh"]) > 100 * TOL


def test_patterns_name_global_layers_and_experts(models):
    """'*.layers.1.*' and '*.local_experts.3.*' mean the same modules at every layout: names
    carry global layer and expert indices (stage 1 of PP=2 holds layer 1 as its layer 0; EP
    rank 1 holds expert 3 as its local expert 1)."""
    d = models["qwen3_moe"][0]
    lora = dict(BASE, target_modules=("*.layers.1.self_attention.linear_qkv", "*.local_experts.3.linear_fc2"))
    want = ["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2",
            "decoder.layers.1.mlp.experts.local_experts.3.linear_fc2",
            "decoder.layers.1.self_attention.linear_qkv"]
    assert run_ranks(1, adapted_names, d, {}, lora, True)[0] == want
    assert run_ranks(2, adapted_names, d, dict(pp=2), lora, True)[0] == want
    assert run_ranks(2, adapted_names, d, dict(ep=2), lora, True)[0] == want
