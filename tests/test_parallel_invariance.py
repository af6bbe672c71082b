"""TP / PP / VPP / TP×PP / SP / DP layouts against one rank: outputs, gradients after megatron's
finalize_model_grads (gathered to full HF-named tensors on every rank), and the HF round trip.
Each DP rank trains on different micro-batches; the single rank trains on all of them."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.steps import train_step
from tests.tiny import tiny_config, tiny_hf_model

TOL = 1e-5
MODELS = {
    "llama_gqa_untied": dict(model_type="llama"),
    "qwen2_tied_qkvbias": dict(model_type="qwen2", tie_word_embeddings=True),
    "qwen3_qknorm_headdim": dict(model_type="qwen3", head_dim=24),
}
LAYOUTS = {  # name -> (world size, layout)
    "tp2": (2, dict(tp=2)),
    "pp2": (2, dict(pp=2)),
    "pp2_vpp2": (2, dict(pp=2, vpp=2)),  # 8 layers: 2 per virtual chunk
    "tp2_pp2": (4, dict(tp=2, pp=2)),
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True)),
    "dp2": (2, dict()),
}
DP_LAYOUTS = {  # world 4 (slow on 2 cores): one model each
    "tp2_dp2": ("llama_gqa_untied", dict(tp=2)),
    "pp2_dp2": ("qwen2_tied_qkvbias", dict(pp=2)),
}


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    dirs = {}
    for name, kwargs in MODELS.items():
        kwargs = dict(kwargs)
        cfg = tiny_config(kwargs.pop("model_type"), num_hidden_layers=8, **kwargs)
        d = tmp_path_factory.mktemp(name)
        tiny_hf_model(cfg).save_pretrained(d)
        dirs[name] = str(d)
    return dirs


@pytest.fixture(scope="module")
def references(hf_dirs):
    return {name: run_ranks(1, train_step, d, {})[0] for name, d in hf_dirs.items()}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


def assert_matches(result: dict, ref: dict, rank: int) -> None:
    assert result["roundtrip_mismatch"] == [], f"rank {rank}: HF round trip differs"
    d = max_diff(result["outputs"], ref["outputs"])
    assert d <= TOL, f"rank {rank}: outputs differ by {d:.3g}"
    assert set(result["grads"]) == set(ref["grads"])
    worst = max((max_diff(result["grads"][k], g), k) for k, g in ref["grads"].items())
    assert worst[0] <= TOL, f"rank {rank}: grad of {worst[1]} differs by {worst[0]:.3g}"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MODELS)
def test_layout_matches_single_rank(model, layout, hf_dirs, references):
    world, layout_kwargs = LAYOUTS[layout]
    results = run_ranks(world, train_step, hf_dirs[model], layout_kwargs)
    ref = references[model]
    assert ref["roundtrip_mismatch"] == []
    assert all(g.abs().max() > 0 for g in ref["grads"].values()), "a gradient is all zero"
    for rank, result in enumerate(results):
        assert_matches(result, ref, rank)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_recompute_gives_same_gradients(recompute, hf_dirs):
    d = hf_dirs["qwen3_qknorm_headdim"]
    plain = run_ranks(2, train_step, d, dict(tp=2))
    again = run_ranks(2, train_step, d, dict(tp=2), "actor", recompute)
    for rank, (a, b) in enumerate(zip(again, plain)):
        assert_matches(a, b, rank)


@pytest.mark.parametrize("layout", ["tp2_sp", "tp2_pp2"])
def test_critic_layout_matches_single_rank(layout, tmp_path):
    cfg = tiny_config("qwen2", num_hidden_layers=4)
    tiny_hf_model(cfg, role="critic").save_pretrained(tmp_path)
    ref = run_ranks(1, train_step, str(tmp_path), {}, "critic")[0]
    assert ref["outputs"].shape[-1] == 1
    world, layout_kwargs = LAYOUTS[layout]
    for rank, result in enumerate(run_ranks(world, train_step, str(tmp_path), layout_kwargs, "critic")):
        assert_matches(result, ref, rank)


@pytest.mark.parametrize("layout", DP_LAYOUTS)
def test_dp_with_model_parallel_matches_single_rank(layout, hf_dirs, references):
    model, layout_kwargs = DP_LAYOUTS[layout]
    for rank, result in enumerate(run_ranks(4, train_step, hf_dirs[model], layout_kwargs)):
        assert_matches(result, references[model], rank)


def _train_step_without_dp_reduction(hf_dir: str, layout: dict) -> dict:
    from megatron.core.distributed import DistributedDataParallel

    DistributedDataParallel.finish_grad_sync = lambda self, *a, **k: None  # grads stay per rank
    return train_step(hf_dir, layout)


def test_dp_ranks_see_different_data(hf_dirs, references):
    """Without DP's gradient all-reduce the DP=2 gradients must be wrong: proves the DP tests
    feed each rank its own micro-batches."""
    ref = references["llama_gqa_untied"]
    for result in run_ranks(2, _train_step_without_dp_reduction, hf_dirs["llama_gqa_untied"], {}):
        worst = max(max_diff(result["grads"][k], g) for k, g in ref["grads"].items())
        assert worst > 1e-3, f"grads match without the DP reduction (worst {worst:.3g})"


KV_BELOW_TP = {  # name -> (model_type, kv heads, world, layout)
    "llama_kv1_tp2": ("llama", 1, 2, dict(tp=2)),
    "llama_kv1_tp2_sp": ("llama", 1, 2, dict(tp=2, sequence_parallel=True)),
    "qwen2_kv2_tp4": ("qwen2", 2, 4, dict(tp=4)),  # QKV bias split inside a KV group
}


@pytest.mark.parametrize("case", KV_BELOW_TP)
def test_tp_above_kv_heads_matches_single_rank(case, tmp_path):
    """KV heads shared by tp / kv_heads ranks: outputs, gradients (megatron's all-gather of the
    fused qkv reduce-scatters the k/v grads) and the HF round trip equal a single rank's."""
    model_type, kv, world, layout_kwargs = KV_BELOW_TP[case]
    tiny_hf_model(tiny_config(model_type, num_key_value_heads=kv)).save_pretrained(tmp_path)
    ref = run_ranks(1, train_step, str(tmp_path), {})[0]
    for rank, result in enumerate(run_ranks(world, train_step, str(tmp_path), layout_kwargs)):
        assert_matches(result, ref, rank)
