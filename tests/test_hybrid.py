"""Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (Gated DeltaNet layers mixed with gated attention): logits
equal transformers' (fp32, eager, its torch delta rule) at world 1, TP=2+SP, PP=2 (a stage boundary
between layer kinds) and EP=2, with rows longer than the delta rule's chunks; the HF round trip
is bit-exact at each layout; a packed stream (a length-1 sequence, boundaries in mid-chunk) gives
the padded batch's logits and gradients; layouts GDN cannot take are refused clearly."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.hybrid_bodies import VARIANTS, logits_and_roundtrip, long_batch, packed_and_padded, save_hybrids
from tests.tiny import tiny_config

MOE = ("qwen3_next", "qwen3_5_moe")
LAYOUTS = {  # name -> (world, layout, models)
    "single": (1, {}, tuple(VARIANTS)),
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True), tuple(VARIANTS)),
    "pp2": (2, dict(pp=2), tuple(VARIANTS)),
    "ep2": (2, dict(ep=2), MOE),
}


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    return save_hybrids(tmp_path_factory.mktemp("hybrid"))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_logits_match_transformers(layout, hybrids):
    world, kwargs, names = LAYOUTS[layout]
    batch = long_batch(200)
    out = run_ranks(world, logits_and_roundtrip, {n: hybrids[n][0] for n in names}, kwargs, batch)[0]
    real = batch["attention_mask"].bool()
    for name in names:
        with torch.no_grad():
            ref = hybrids[name][1](**batch).logits
        ours = out[name]["logits"][..., :200]
        diff = (ours - ref)[real].abs().max().item()
        assert diff <= 1e-4, f"{name} at {layout}: logits differ from transformers by {diff:.3g}"
        # per-token log-probs of the next token (what RL scores)
        nxt = batch["input_ids"][:, 1:, None]
        lp = [torch.log_softmax(x[:, :-1].double(), -1).gather(-1, nxt)[..., 0] for x in (ours, ref)]
        both = real[:, 1:] & real[:, :-1]
        lp_diff = (lp[0] - lp[1])[both].abs().max().item()
        assert lp_diff <= 1e-4, f"{name} at {layout}: log-probs differ from transformers by {lp_diff:.3g}"
        assert ref[real].abs().max() > 0.5
        assert out[name]["roundtrip_mismatch"] == [], f"{name} at {layout}: {out[name]['roundtrip_mismatch'][:4]}"


@pytest.mark.parametrize("world,layout", [(1, {}), (2, dict(tp=2, sequence_parallel=True))], ids=["single", "tp2_sp"])
def test_packed_equals_padded(world, layout, hybrids):
    """Forward and every parameter gradient: sequences of 70, 1, 90 and 45 tokens in a stream of
    224 (a filler tail), so chunk boundaries (64, 128, 192) fall inside sequences and sequence
    boundaries (70, 71, 161) inside chunks. Logits within 1e-5 of their scale (max |logit| ~3.4):
    fp32 rounding alone moves them by 1.5e-5 between two padded layouts (TP=2 vs 1); a state
    or convolution leaking across a boundary moves them by > 1e-2."""
    batch = long_batch(200)
    names = ("qwen3_5", "qwen3_next")
    out = run_ranks(world, packed_and_padded, {n: hybrids[n][0] for n in names}, layout, batch, 224)[0]
    for name in names:
        padded, packed = out[f"{name}/padded"], out[f"{name}/packed"]
        diff = (packed["logits"] - padded["logits"]).abs().max().item()
        scale = padded["logits"].abs().max().item()
        assert diff <= 1e-5 * scale, f"{name}: packed logits differ from padded by {diff:.3g} (scale {scale:.3g})"
        gdn = [k for k in padded["grads"] if ".linear_attn." in k]
        assert gdn and all(padded["grads"][k].abs().max() > 0 for k in gdn)
        for key, ref in padded["grads"].items():
            d = (packed["grads"][key] - ref).abs().max().item()
            assert d <= 1e-5, f"{name} {key}: packed gradient differs from padded by {d:.3g}"


def test_layouts_gdn_cannot_take_are_refused():
    from mcore_rl.models.builder import check_divisibility
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hybrid import HybridConfigError
    from mcore_rl.parallel import ParallelLayout

    model_type, overrides = VARIANTS["qwen3_5"]
    args = model_args_from_hf(tiny_config(model_type, **overrides))
    with pytest.raises(HybridConfigError, match=r"cp\(2\) with Gated DeltaNet layers .* set cp=1"):
        check_divisibility(args, ParallelLayout(cp=2))
    odd = model_args_from_hf(tiny_config(model_type, **{**overrides, "linear_num_key_heads": 3,
                                                         "linear_num_value_heads": 6}))
    with pytest.raises(HybridConfigError, match=r"tp\(2\) does not divide linear_num_key_heads\(3\)"):
        check_divisibility(odd, ParallelLayout(tp=2))


@pytest.mark.parametrize("overrides,match", [
    (dict(layer_types=["linear_attention", "sliding_attention", "full_attention", "full_attention"]),
     "'sliding_attention'"),
    (dict(linear_num_key_heads=3), "linear_num_value_heads=8 is not a multiple of linear_num_key_heads=3"),
])
def test_bad_hybrid_configs_are_refused(overrides, match):
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hybrid import HybridConfigError

    model_type, base = VARIANTS["qwen3_5"]
    with pytest.raises(HybridConfigError, match=match):
        model_args_from_hf(tiny_config(model_type, **{**base, **overrides}))


def test_converter_round_trips_bit_exact(hybrids, tmp_path):
    """HF -> model directory (one process; Qwen3-Next also split over TP=2) -> loaded at
    TP=2 x PP=2 (EP=2) -> HF, and -> merge -> HF: every tensor bit-identical; GDN parameters are
    stored in megatron's pieces (``in_proj.weight.query`` ...); ``--test``'s logit check passes."""
    from mcore_rl.mapping.hf_io import SafetensorsReader

    from converters.verify_logits import TOL
    from mcore_rl.conversion.merge import merge
    from tests.test_convert import _assert_same_hf, _convert_all, _load_and_export, _verify

    out = {n: str(tmp_path / f"out_{n}") for n in hybrids}
    run_ranks(1, _convert_all, [(hybrids[n][0], out[n]) for n in hybrids])
    run_ranks(2, _convert_all, [(hybrids["qwen3_next"][0], str(tmp_path / "split"))], dict(tp=2))
    results = run_ranks(4, _load_and_export, {**out, "split": str(tmp_path / "split")})[0]
    assert results["split"][1] == results["qwen3_next"][1], "the TP=2 conversion wrote other keys"
    _assert_same_hf("split", results["split"][0], hybrids["qwen3_next"][0])
    for name, (hf_dir, _) in hybrids.items():
        _assert_same_hf(name, results[name][0], hf_dir)
        assert "decoder.layers.0.self_attention.in_proj.weight.alpha" in results[name][1]
        target = tmp_path / f"merged_{name}"
        merge(out[name], str(target))
        merged = dict(SafetensorsReader(str(target)))
        _assert_same_hf(name, merged, hf_dir)
    checks = run_ranks(1, _verify, {n: (out[n], hybrids[n][0]) for n in hybrids})[0]
    for name, (diff, cos) in checks.items():
        assert diff <= TOL and cos > 0.9999, f"{name}: max |diff| {diff:.3g}, cosine {cos:.6f}"


def test_checkpoint_resumes_exactly_at_another_layout(tmp_path):
    """A Qwen3.5 actor (a GDN layer, then gated attention) trained 2 steps at TP=2 + SP, saved
    fully_reshardable and model_space, resumed at PP=2 (one layer kind per stage): model and
    Adam state bit-equal, the next update equal within fp32 reordering (tests/test_ckpt_reshard)."""
    from tests.ckpt_reshard_bodies import hf_dir, load_worlds, save_worlds
    from tests.test_ckpt_reshard import FULLY, SPACE, _check_loaded

    _, overrides = VARIANTS["qwen3_5"]
    hf = hf_dir(str(tmp_path), "qwen3_5_text", **{**overrides, "layer_types": ["linear_attention", "full_attention"]})
    roots = {s: str(tmp_path / s) for s in (FULLY, SPACE)}
    saved = run_ranks(2, save_worlds, [(hf, dict(tp=2, sequence_parallel=True), roots)], daemon=False)[0]
    loads = run_ranks(2, load_worlds, [("load", hf, dict(pp=2), roots[FULLY]), ("load", hf, dict(pp=2), roots[SPACE])],
                      daemon=False)[0]
    old, new = "tp=2,pp=1,vpp=None,cp=1,ep=1,etp=2,dp=1", "tp=1,pp=2,vpp=None,cp=1,ep=1,etp=1,dp=1"
    for job in (0, 1):
        _check_loaded(saved[0], loads[job], old, new)
    assert any(".linear_attn.in_proj_qkv" in k for k in saved[0]["at_save"]["opt/exp_avg"])
