"""LoRA on a dense model against peft + transformers (fp32): log-probs with random non-zero
adapters, the frozen base as the reference, one PPO update (adapters after the step, grad norm,
base bit-identical) at world 1 and against one rank at TP=2+SP, PP=2, CP=2 and DP=2."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.lora_bodies import assert_equal_to_one_rank, assert_matches_peft_step, lora_update, peft_model
from tests.test_actor_update import ACTOR, make_batch
from tests.tiny import hf_log_probs, tiny_config, tiny_hf_model

TOL = 1e-5
# every linear, random A and B (B = 0 would make the adapter inactive at the first forward)
LORA = dict(rank=4, alpha=16.0, lora_A_init_method="kaiming", lora_B_init_method="normal", seed=7,
            target_modules=("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))
# canonical LoRA: separate q/k/v and gate/up adapters, as peft's per-module LoRA (the fused type
# shares one A between q, k and v: same forward as peft with that A copied, another gradient)
CANONICAL = dict(LORA, type="canonical_lora", target_modules=(
    "linear_q", "linear_k", "linear_v", "linear_proj", "linear_fc1_gate", "linear_fc1_up", "linear_fc2"))
LAYOUTS = {  # name -> (world, layout, lora)
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True), LORA),
    "tp2_canonical": (2, dict(tp=2), CANONICAL),
    "pp2": (2, dict(pp=2), LORA),
    "cp2": (2, dict(cp=2), LORA),
    "dp2": (2, dict(), LORA),
}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """(HF dir, HF model, batch, {lora type: world-1 result})."""
    d = tmp_path_factory.mktemp("lora_llama")
    hf = tiny_hf_model(tiny_config("llama", num_hidden_layers=4))
    hf.save_pretrained(d)
    batch = make_batch(hf)
    results = {lora["type"] if "type" in lora else "lora": run_ranks(1, lora_update, str(d), {}, lora, batch, ACTOR)[0]
               for lora in (LORA, CANONICAL)}
    return str(d), hf, batch, results


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("kind", ["lora", "canonical_lora"])
def test_log_probs_and_reference_match_peft(kind, dense):
    _, hf, batch, results = dense
    ours = results[kind]
    model = peft_model(hf, LORA, ours["peft_before"])
    want, _ = hf_log_probs(model, batch, ACTOR["temperature"])
    base, _ = hf_log_probs(hf, batch, ACTOR["temperature"])
    assert _max_diff(ours["log_probs"], want) <= TOL
    assert _max_diff(ours["log_probs"], base) > 100 * TOL  # the adapters are active
    # the frozen base with adapters off is the reference policy
    assert _max_diff(ours["ref_log_probs"], base) <= TOL


def test_update_matches_peft_step(dense):
    d, hf, batch, results = dense
    assert_matches_peft_step(hf, d, batch, LORA, results["canonical_lora"], TOL)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layouts_equal_one_rank(layout, dense):
    d, _, batch, results = dense
    world, kwargs, lora = LAYOUTS[layout]
    one = results[lora.get("type", "lora")]
    assert_equal_to_one_rank(run_ranks(world, lora_update, d, kwargs, lora, batch, ACTOR), one, TOL)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_equals_no_recompute(recompute, dense):
    """Activation recompute with a frozen base: megatron's CheckpointFunction gives no gradient
    when its inputs need none, so the embedding output must require grad (else the adapters'
    gradients through recomputed layers are silently zero)."""
    d, _, batch, results = dense
    one = results["lora"]
    got = run_ranks(1, lora_update, d, {}, LORA, batch, ACTOR, False, recompute)[0]
    worst = max((_max_diff(got["peft_after"][k], v), k) for k, v in one["peft_after"].items())
    assert worst[0] <= TOL, f"{worst[1]} differs by {worst[0]:.3g}"
    assert abs(got["metrics"]["actor/grad_norm"] - one["metrics"]["actor/grad_norm"]) <= 1e-5 * one["metrics"]["actor/grad_norm"]
