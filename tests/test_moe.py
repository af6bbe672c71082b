"""Mixture-of-experts: HF parity, expert-parallel layouts against a single rank, HF round trips,
the megatron-core defect fixes, router options and clear errors."""
from __future__ import annotations

import pytest
import torch

from mcore_rl.models.builder import check_divisibility
from mcore_rl.models.hf_config import model_args_from_hf
from mcore_rl.models.moe import MoEConfigError, MoEOptions
from mcore_rl.parallel import LayoutError, ParallelLayout
from tests.dist import run_ranks
from tests.steps import forward_outputs, outputs_of_models, train_step
from tests.test_parallel_invariance import assert_matches
from tests.tiny import saved_variants, padded_batch, tiny_config, tiny_hf_model

PARITY = {  # name -> (model_type, overrides)
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen2_moe_dense_mixed": ("qwen2_moe", dict(decoder_sparse_step=2, mlp_only_layers=[2])),
    "qwen2_moe_norm_topk": ("qwen2_moe", dict(norm_topk_prob=True)),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe_no_norm_topk": ("qwen3_moe", dict(norm_topk_prob=False)),
    "mixtral": ("mixtral", {}),
    "mixtral_tied": ("mixtral", dict(tie_word_embeddings=True)),
    # sinks, windows shorter than the batch, YaRN, clamped SwiGLU, biases everywhere (tests/tiny.py)
    "gpt_oss": ("gpt_oss", {}),
}
LAYOUTS = {  # name -> (world size, layout, MoE options)
    "ep2_allgather": (2, dict(ep=2), dict(dispatcher="allgather")),
    "ep2_alltoall": (2, dict(ep=2), dict(dispatcher="alltoall")),
    "tp2_ep2_sp": (4, dict(tp=2, ep=2, sequence_parallel=True), {}),
    "ep2_etp2": (4, dict(ep=2, etp=2), {}),  # experts TP-split while attention is not
    "etp2": (2, dict(etp=2), {}),
    "pp2_ep2": (4, dict(pp=2, ep=2), {}),
    # dense DP 4 and expert DP 2: experts' grads are reduced over their own DP group
    "ep2_edp2": (4, dict(ep=2), {}),
    "etp2_edp2": (4, dict(etp=2), {}),  # ep=1 with etp != tp: the fixed megatron path, EDP 2
}


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    return saved_variants(tmp_path_factory, PARITY)


def test_dense_layers_mixed_in():
    args = model_args_from_hf(tiny_config("qwen2_moe", decoder_sparse_step=2, mlp_only_layers=[2]))
    assert args.moe.moe_layers == (False, True, False, True)


@pytest.mark.parametrize("layout", [dict(), dict(ep=2)], ids=["single", "ep2"])
def test_logits_match_hf(layout, hf_models):
    batch = padded_batch(200)
    dirs = {name: d for name, (d, _) in hf_models.items()}
    outputs = run_ranks(layout.get("ep", 1), outputs_of_models, dirs, layout, "actor", batch)[0]
    real = batch["attention_mask"].bool()
    for name, (_, hf) in hf_models.items():
        with torch.no_grad():
            ref = hf(**batch).logits
        diff = (outputs[name][..., :200] - ref)[real].abs().max().item()
        assert diff <= 1e-4, f"{name}: logits differ from HF by {diff:.3g}"


@pytest.fixture(scope="module")
def reference(hf_models):
    d = hf_models["qwen2_moe_dense_mixed"][0]
    return d, run_ranks(1, train_step, d, {})[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_expert_layouts_match_single_rank(layout, reference):
    d, ref = reference
    world, layout_kwargs, moe = LAYOUTS[layout]
    assert ref["roundtrip_mismatch"] == []
    expert_grads = [g for k, g in ref["grads"].items() if ".experts." in k]
    assert len(expert_grads) == 2 * 3 * 4 and all(g.abs().max() > 0 for g in expert_grads)
    for rank, result in enumerate(run_ranks(world, train_step, d, layout_kwargs, "actor", None, moe)):
        assert_matches(result, ref, rank)


ETP_WITHOUT_EP = {"tp1_etp2": dict(etp=2), "tp2_etp1": dict(tp=2, etp=1, sequence_parallel=True)}


@pytest.mark.parametrize("layout", ETP_WITHOUT_EP)
def test_etp_differs_from_tp_without_ep(layout, reference):
    d, ref = reference
    for rank, result in enumerate(run_ranks(2, train_step, d, ETP_WITHOUT_EP[layout])):
        assert_matches(result, ref, rank)


def _grads_without_fix(hf_dir: str, layout: dict) -> dict:
    from mcore_rl.platform.fixes import revert_fix

    revert_fix("moe_expert_grads_use_expert_dp")
    return train_step(hf_dir, layout)


def test_fix_expert_grads_is_needed(reference):
    d, ref = reference
    result = run_ranks(2, _grads_without_fix, d, dict(etp=2))[0]
    worst = max((result["grads"][k] - g).abs().max().item() for k, g in ref["grads"].items())
    assert worst > 1e-3, f"without the fix expert grads still match (worst {worst:.3g})"


def test_mixtral_critic_with_expert_parallel(tmp_path):
    tiny_hf_model(tiny_config("mixtral"), role="critic").save_pretrained(tmp_path)
    ref = run_ranks(1, train_step, str(tmp_path), {}, "critic")[0]
    for rank, result in enumerate(
        run_ranks(4, train_step, str(tmp_path), dict(tp=2, ep=2, sequence_parallel=True), "critic")
    ):
        assert_matches(result, ref, rank)


def _forward_without_fix(hf_dir: str, fix: str, layout: dict) -> str:
    from mcore_rl.platform.fixes import revert_fix

    revert_fix(fix)
    try:
        forward_outputs(hf_dir, layout, "actor", padded_batch(200))
    except Exception as e:  # the defect the fix removes
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_fix_te_general_gemm_is_needed(hf_models):
    d = hf_models["mixtral"][0]
    (msg,) = run_ranks(1, _forward_without_fix, d, "moe_te_general_gemm_undefined", {})
    assert msg.startswith("NameError") and "te_general_gemm" in msg, msg


def test_fix_cpu_splits_is_needed(hf_models):
    d = hf_models["mixtral"][0]
    msgs = run_ranks(2, _forward_without_fix, d, "moe_cpu_splits_as_numpy", dict(ep=2))
    assert all(m.startswith("TypeError") for m in msgs), msgs


def _router_grads(hf_dir: str, freeze: bool) -> dict:
    result = train_step(hf_dir, {}, "actor", None, dict(freeze_router=freeze))
    return {k: g.abs().max().item() for k, g in result["grads"].items() if k.endswith("mlp.gate.weight")}


def test_freeze_router(hf_models):
    d = hf_models["qwen3_moe"][0]
    (frozen,) = run_ranks(1, _router_grads, d, True)
    (free,) = run_ranks(1, _router_grads, d, False)
    assert frozen and all(v == 0 for v in frozen.values())
    assert all(v > 0 for v in free.values())


def test_experts_not_divisible_by_ep():
    args = model_args_from_hf(tiny_config("mixtral"))
    with pytest.raises(LayoutError, match=r"ep\(3\) does not divide num_experts\(4\); choose ep among the divisors of 4"):
        check_divisibility(args, ParallelLayout(ep=3))


def test_tp_with_ep_needs_sequence_parallel():
    with pytest.raises(LayoutError, match=r"tp\(2\) with ep\(2\) requires sequence_parallel=True .*set sequence_parallel=True"):
        ParallelLayout(tp=2, ep=2).validate(world_size=4)
    args = model_args_from_hf(tiny_config("qwen3_moe"))
    with pytest.raises(LayoutError, match=r"MoE models with tp\(2\) need sequence_parallel=True"):
        check_divisibility(args, ParallelLayout(tp=2))


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(load_balancing="sinkhorn"), "MoE load_balancing='sinkhorn' is not supported; use one of none, aux_loss, seq_aux_loss"),
        (dict(router_dtype="bf16"), "MoE router_dtype='bf16' is not supported; use one of fp32, fp64"),
        (dict(dispatcher="flex"), "MoE dispatcher='flex' is not supported; use one of alltoall, allgather"),
        (dict(aux_loss_coeff=0.01), "aux_loss_coeff=0.01 has no effect with load_balancing='none'"),
    ],
)
def test_unsupported_router_options(options, message):
    with pytest.raises(MoEConfigError) as e:
        MoEOptions(**options).validate()
    assert message in str(e.value)


def test_unsupported_router_score_function():
    cfg = tiny_config("qwen3_moe")
    cfg.scoring_func = "sigmoid"
    with pytest.raises(MoEConfigError, match="router scoring_func='sigmoid' is not supported for qwen3_moe; supported: softmax"):
        model_args_from_hf(cfg)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(n_group=4, topk_group=1, num_experts_per_tok=4),
         r"num_experts_per_tok\(4\) != 2 \* topk_group\(1\) is not supported: HF scores a group by its top-2"),
        (dict(n_group=3), r"n_group\(3\) does not divide the expert count \(8\)"),
        (dict(norm_topk_prob=False), r"norm_topk_prob=False with num_experts_per_tok=2 is not supported"),
    ],
)
def test_sigmoid_router_configs_that_would_route_differently(overrides, message):
    with pytest.raises(MoEConfigError, match=message):
        model_args_from_hf(tiny_config("glm4_moe", **overrides))


def test_glm4_moe_features_follow_the_config():
    on = model_args_from_hf(tiny_config("glm4_moe"))
    off = model_args_from_hf(tiny_config("glm4_moe", attention_bias=False, use_qk_norm=False))
    assert (on.qkv_bias, on.qk_norm, off.qkv_bias, off.qk_norm) == (True, True, False, False)
    assert on.moe.moe_layers == (False, True, True, True) and on.moe.shared_expert_ffn == 48
    assert (on.rope.dim, on.moe.score_function, on.moe.scaling_factor) == (12, "sigmoid", 2.5)
