"""DeepSeek-V3 (multi-latent attention, sigmoid group routing, shared experts, dense first layer)
and GLM-4.5 MoE: logits equal transformers' at world 1, TP=2+SP, PP=2, EP=2 and TP=2 x EP=2; one
update_policy step equals the formula reference on one rank and one rank at every layout; the
megatron-core fixes MLA needs on this platform, each shown needed; configs refused clearly."""
from __future__ import annotations

import logging

import pytest
import torch

from mcore_rl.models.hf_config import model_args_from_hf
from mcore_rl.models.mla import MLAConfigError
from mcore_rl.models.rope import RopeError
from tests.dist import run_ranks
from tests.steps import outputs_of_models
from tests.test_actor_update import _assert_metrics, _assert_params, _update, make_batch, reference_update
from tests.tiny import saved_variants, padded_batch, tiny_config, tiny_hf_model

YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, rope_theta=10000.0)
VARIANTS = {  # name -> (model_type, overrides)
    "ds_q_lora_groups": ("deepseek_v3", {}),  # q_lora_rank 32, n_group 2, scaling 2.5
    "ds_full_query": ("deepseek_v3", dict(q_lora_rank=None, n_group=1, topk_group=1)),
    "ds_yarn": ("deepseek_v3", dict(rope_parameters=YARN, routed_scaling_factor=1.0)),
    "ds_rope_halves": ("deepseek_v3", dict(rope_interleave=False, first_k_dense_replace=2)),
    "glm4_moe": ("glm4_moe", {}),  # QKV bias, QK norm, partial rotary, 1 dense layer, scaling 2.5
    # no bias or norm; two groups of 4 experts, the best group only (topk 2 = 2 * topk_group 1)
    "glm4_moe_groups": ("glm4_moe", dict(attention_bias=False, use_qk_norm=False, n_group=2,
                                         topk_group=1, first_k_dense_replace=2, routed_scaling_factor=1.0)),
}
LAYOUTS = {  # name -> (world, layout)
    "single": (1, {}),
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True)),
    "pp2": (2, dict(pp=2)),
    "ep2": (2, dict(ep=2)),
    "tp2_ep2_sp": (4, dict(tp=2, ep=2, sequence_parallel=True)),
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return saved_variants(tmp_path_factory, VARIANTS)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_hf(layout, hf_models):
    batch = padded_batch(200)
    world, kwargs = LAYOUTS[layout]
    outputs = run_ranks(world, outputs_of_models, {n: d for n, (d, _) in hf_models.items()}, kwargs, "actor", batch)[0]
    real = batch["attention_mask"].bool()
    for name, (_, hf) in hf_models.items():
        with torch.no_grad():
            ref = hf(**batch).logits
        diff = (outputs[name][..., :200] - ref)[real].abs().max().item()
        assert diff <= 1e-4, f"{name} at {layout}: logits differ from HF by {diff:.3g}"
        assert ref[real].abs().max() > 0.5


def _prepared(tmp_path_factory, model_type: str) -> tuple:
    d = tmp_path_factory.mktemp(f"update_{model_type}")
    hf = tiny_hf_model(tiny_config(model_type, num_hidden_layers=2))
    hf.save_pretrained(d)
    batch = make_batch(hf)
    return str(d), batch, reference_update(hf, batch), run_ranks(1, _update, str(d), {}, batch, True)[0]


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    return _prepared(tmp_path_factory, "deepseek_v3")


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return _prepared(tmp_path_factory, "glm4_moe")


UPDATE_LAYOUTS = {  # name -> (model, world, layout)
    "deepseek_tp2_sp": ("deepseek", 2, dict(tp=2, sequence_parallel=True)),
    "deepseek_pp2": ("deepseek", 2, dict(pp=2)),
    "deepseek_ep2": ("deepseek", 2, dict(ep=2)),
    "deepseek_tp2_ep2_sp": ("deepseek", 4, dict(tp=2, ep=2, sequence_parallel=True)),
    "glm_tp2_sp": ("glm", 2, dict(tp=2, sequence_parallel=True)),
    "glm_tp2_ep2_sp": ("glm", 4, dict(tp=2, ep=2, sequence_parallel=True)),
}


def test_single_rank_update_equals_formula_reference(deepseek, glm):
    for name, (_, _, ref, ours) in {"deepseek": deepseek, "glm": glm}.items():
        _assert_metrics(ours["metrics"], ref["metrics"], 1e-5, name)


@pytest.mark.parametrize("case", UPDATE_LAYOUTS)
def test_update_at_layout_equals_single_rank(case, deepseek, glm):
    model, world, kwargs = UPDATE_LAYOUTS[case]
    hf_dir, batch, ref, single = {"deepseek": deepseek, "glm": glm}[model]
    for rank, result in enumerate(run_ranks(world, _update, hf_dir, kwargs, batch, True)):
        _assert_params(result["params"], single["params"], f"{case} rank {rank}")
        _assert_metrics(result["metrics"], ref["metrics"], 1e-5, f"{case} rank {rank}")


@pytest.mark.parametrize("world,layout", [(2, dict(pp=2, vpp=2)), (4, dict(ep=2, etp=2))],
                         ids=["pp2_vpp2", "ep2_etp2"])
def test_gradients_at_layout_equal_single_rank(world, layout, hf_models):
    """Outputs and every gradient (4 micro-batches, DP ranks on different data) at PP=2 x VPP=2
    (one layer per virtual chunk) and EP=2 x ETP=2 equal one rank's (tests/steps.train_step)."""
    from tests.steps import train_step
    from tests.test_parallel_invariance import assert_matches

    d = hf_models["ds_q_lora_groups"][0]
    ref = run_ranks(1, train_step, d, {})[0]
    assert all(g.abs().max() > 0 for k, g in ref["grads"].items() if ".experts." in k or "kv_a_proj" in k)
    for rank, result in enumerate(run_ranks(world, train_step, d, layout)):
        assert_matches(result, ref, rank)


def _build_without_fix(hf_dir: str, fix: str) -> str:
    from mcore_rl.platform.fixes import revert_fix
    from tests.steps import forward_outputs

    revert_fix(fix)
    try:
        forward_outputs(hf_dir, {}, "actor", padded_batch(200))
    except Exception as e:  # the defect's own error
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("fix,variant,error", [
    ("mla_without_te_stand_ins", "ds_q_lora_groups", "TypeError: isinstance() arg 2 must be a type"),
    ("mla_yarn_on_host", "ds_yarn", "RuntimeError"),
])
def test_mla_fixes_are_needed(fix, variant, error, hf_models):
    assert run_ranks(1, _build_without_fix, hf_models[variant][0], fix)[0].startswith(error)


@pytest.mark.parametrize("overrides,error,message", [
    (dict(attention_bias=True), MLAConfigError, r"attention_bias=True puts biases on q_a_proj"),
    (dict(rope_parameters={**YARN, "attention_factor": 0.5}), MLAConfigError, r"attention_factor=0.5"),
    (dict(rope_parameters={**YARN, "mscale": 0.0}), MLAConfigError, r"mscale_all_dim=1.0 without mscale"),
    (dict(rope_parameters=dict(rope_type="linear", factor=2.0, rope_theta=1e4)), RopeError,
     r"rope_type='linear' is not supported; supported: default, yarn"),
])
def test_unsupported_deepseek_configs(overrides, error, message):
    with pytest.raises(error, match=message):
        model_args_from_hf(tiny_config("deepseek_v3", **overrides))


def test_yarn_stays_refused_for_grouped_query_attention():
    with pytest.raises(RopeError, match=r"rope_type='yarn' is not supported; supported: default, linear, llama3"):
        model_args_from_hf(tiny_config("glm4_moe", rope_parameters=YARN))


def test_mtp_layers_are_skipped_with_a_log_line(hf_models, caplog):
    """A checkpoint with multi-token-prediction layers (HF layer num_hidden_layers) built without
    them (``with_mtp(False)``) loads its base model; the skipped tensors are named in a warning,
    not dropped silently (built with them: tests/test_mtp.py)."""
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from mcore_rl.mapping.weights import MappingError, check_hf_keys
    from mcore_rl.models.hf_weights import weight_map

    d = hf_models["ds_q_lora_groups"][0]
    keys = set(SafetensorsReader(d)) | {"model.layers.4.eh_proj.weight", "model.layers.4.enorm.weight"}
    cfg = tiny_config("deepseek_v3", num_nextn_predict_layers=1)
    with caplog.at_level(logging.WARNING, logger="mcore_rl"):
        check_hf_keys(weight_map(model_args_from_hf(cfg).with_mtp(False), "actor", 1), keys)
    assert "skipping 2 tensors of multi-token-prediction layers [4]" in caplog.text
    with pytest.raises(MappingError, match="model.layers.4.eh_proj.weight"):  # not declared: an error
        check_hf_keys(weight_map(model_args_from_hf(tiny_config("deepseek_v3")), "actor", 1), keys)
