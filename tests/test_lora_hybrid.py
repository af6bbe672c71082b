"""LoRA on hybrid models (Qwen3.5, Qwen3-Next: Gated DeltaNet layers + gated attention) against
peft 0.21 + transformers (fp32): adapters on GDN's in_proj (whole, or some of the HF projections
it fuses, as canonical parts) and out_proj, and on gated attention's q_proj (query and gate rows);
log-probs, the frozen base as reference, one PPO update (adapters after the step, grad norm);
PEFT adapters in and out; an adapter-only step merged offline and resharded."""
from __future__ import annotations

import pytest
import torch

from mcore_rl.lora.config import LoraConfig, LoraConfigError
from tests.dist import run_ranks
from tests.hybrid_lora_bodies import HYBRID_LAYERS, updates
from tests.lora_bodies import assert_matches_peft_step, peft_model
from tests.test_actor_update import ACTOR, make_batch
from tests.tiny import hf_log_probs, tiny_config, tiny_hf_model

TOL = 1e-5
BASE = dict(rank=4, alpha=16.0, lora_A_init_method="kaiming", lora_B_init_method="normal", seed=5)
MODELS = {"qwen3_5": "qwen3_5_text", "qwen3_next": "qwen3_next", "qwen3_5_moe": "qwen3_5_moe_text"}
CASES = {  # name -> (model, lora, the update compared with peft's)
    # canonical: some of Qwen3.5's in_proj pieces (not in_proj_b), q_proj (query + gate rows), v
    "qwen3_5_canonical": ("qwen3_5", dict(BASE, type="canonical_lora", target_modules=(
        "linear_q", "linear_v", "linear_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "out_proj")), True),
    # canonical: only Qwen3-Next's in_proj_ba (its rows interleaved per key head in in_proj)
    "qwen3_next_canonical": ("qwen3_next", dict(BASE, type="canonical_lora", target_modules=(
        "linear_q", "linear_k", "in_proj_ba", "out_proj")), True),
    # fused: one A for all of in_proj's (and linear_qkv's) pieces; peft holds copies: same forward
    "qwen3_next_fused": ("qwen3_next", dict(BASE, target_modules=("in_proj", "out_proj", "linear_qkv", "linear_proj")),
                         False),
}
QWEN3_5_IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
QWEN3_NEXT_IN_PROJ = ("in_proj_qkvz", "in_proj_ba")
IN_PROJ = "decoder.layers.0.self_attention.in_proj"


def test_gdn_targets_and_parts():
    """GDN linears are targets; canonical parts of in_proj are the model's HF pieces by name."""
    fused = LoraConfig(rank=4, target_modules=("in_proj", "out_proj"))
    assert fused.parts(IN_PROJ, QWEN3_5_IN_PROJ) == () and fused.parts("decoder.layers.0.self_attention.out_proj") == ()
    canonical = LoraConfig(rank=4, type="canonical_lora", target_modules=("in_proj_z", "in_proj_a", "in_proj_ba"))
    assert canonical.parts(IN_PROJ, QWEN3_5_IN_PROJ) == (1, 3)
    assert canonical.parts(IN_PROJ, QWEN3_NEXT_IN_PROJ) == (1,)
    whole = LoraConfig(rank=4, type="canonical_lora", target_modules=("in_proj",))
    assert whole.parts(IN_PROJ, QWEN3_5_IN_PROJ) == (0, 1, 2, 3) and whole.parts(IN_PROJ, QWEN3_NEXT_IN_PROJ) == (0, 1)
    everything = LoraConfig(rank=4, type="canonical_lora", target_modules=())
    assert everything.parts(IN_PROJ, QWEN3_NEXT_IN_PROJ) == (0, 1)
    with pytest.raises(LoraConfigError, match="'in_proj_z' is a canonical_lora part; with type='lora' target 'in_proj'"):
        LoraConfig(rank=4, target_modules=("in_proj_z",))
    for part in ("in_proj_z", "linear_q"):  # was silently ignored: every part stayed adapted
        with pytest.raises(LoraConfigError, match=f"exclude_modules entry '{part}' is a part of a fused linear"):
            LoraConfig(rank=4, type="canonical_lora", target_modules=(), exclude_modules=(part,))


def test_gdn_part_of_another_architecture_is_refused():
    """A Qwen3.5 piece name on Qwen3-Next (and any GDN piece on a model without GDN layers)."""
    from mcore_rl.lora.build import _check_gdn_parts
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import weight_map

    cfg = LoraConfig(rank=4, type="canonical_lora", target_modules=("in_proj_z", "out_proj"))
    nxt = weight_map(model_args_from_hf(tiny_config("qwen3_next", **HYBRID_LAYERS)), "actor", 1)
    with pytest.raises(LoraConfigError, match=r"\['in_proj_z'\] name no part of this qwen3_next model: its Gated "
                                              r"DeltaNet in_proj fuses \['in_proj_qkvz', 'in_proj_ba'\]"):
        _check_gdn_parts(cfg, nxt)
    llama = weight_map(model_args_from_hf(tiny_config("llama", num_hidden_layers=2)), "actor", 1)
    with pytest.raises(LoraConfigError, match="it has no Gated DeltaNet layers"):
        _check_gdn_parts(cfg, llama)
    _check_gdn_parts(LoraConfig(rank=4, type="canonical_lora", target_modules=("in_proj_ba",)), nxt)  # fits


@pytest.mark.parametrize("model_type,refused", [("qwen3_next", True), ("qwen3_5_moe_text", False)])
def test_peft_export_of_dense_mlp_targets(model_type, refused):
    """peft 0.21 rewrites gate_proj/up_proj/down_proj targets of a Qwen3-Next adapter into its
    fused experts (transformers converts qwen3_next like qwen2_moe), so adapters on the dense-MLP
    layers or the shared expert have no PEFT form there (refused by name); Qwen3.5-MoE's pass."""
    from types import SimpleNamespace

    from mcore_rl.conversion.lora_export import peft_adapter_config
    from mcore_rl.mapping.peft_experts import PeftExpertsError

    ranks = {"model.layers.2.mlp.gate_proj": (4, 2.0), "model.layers.0.linear_attn.out_proj": (4, 2.0)}
    args = SimpleNamespace(arch=SimpleNamespace(model_type=model_type))
    if refused:
        with pytest.raises(PeftExpertsError, match=r"target_modules \['gate_proj'\] of a qwen3_next adapter"):
            peft_adapter_config(dict(ranks), LoraConfig(rank=4, alpha=8.0), args, "actor", None)
    else:
        out = peft_adapter_config(dict(ranks), LoraConfig(rank=4, alpha=8.0), args, "actor", None)
        assert out["target_modules"] == ["gate_proj", "out_proj"]


@pytest.fixture(scope="module")
def hybrids(tmp_path_factory):
    """model -> (HF dir, HF model, batch); case -> world-1 lora_update result (one process)."""
    models = {}
    for name, model_type in MODELS.items():
        d = tmp_path_factory.mktemp(f"lora_{name}")
        hf = tiny_hf_model(tiny_config(model_type, **HYBRID_LAYERS))
        hf.save_pretrained(d)
        models[name] = (str(d), hf, make_batch(hf))
    cases = [(case, models[m][0], {}, lora, models[m][2], ACTOR, m != "qwen3_5")
             for case, (m, lora, _) in CASES.items()]
    return models, run_ranks(1, updates, cases)[0]


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_log_probs_and_reference_match_peft(case, hybrids):
    models, results = hybrids
    name, lora, _ = CASES[case]
    _, hf, batch = models[name]
    ours = results[case]
    gdn = [k for k in ours["peft_before"] if ".linear_attn." in k]
    assert gdn and any(".self_attn.q_proj." in k for k in ours["peft_before"]), sorted(ours["peft_before"])
    want, _ = hf_log_probs(peft_model(hf, lora, ours["peft_before"]), batch, ACTOR["temperature"])
    base, _ = hf_log_probs(hf, batch, ACTOR["temperature"])
    assert _max_diff(ours["log_probs"], want) <= TOL
    assert _max_diff(ours["log_probs"], base) > 100 * TOL  # the adapters are active
    assert _max_diff(ours["ref_log_probs"], base) <= TOL


@pytest.mark.parametrize("case", [c for c, (_, _, step) in CASES.items() if step])
def test_update_matches_peft_step(case, hybrids):
    """Adapters after one PPO update (Adam, eps 1: the step follows the gradient) and the grad
    norm equal peft's; only the canonical parts asked for exist (peft adapts exactly those)."""
    models, results = hybrids
    name, lora, _ = CASES[case]
    d, hf, batch = models[name]
    ours = results[case]
    modules = {k.split(".")[-3] for k in ours["peft_before"]}
    want = {"qwen3_5": {"q_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "out_proj"},
            "qwen3_next": {"q_proj", "k_proj", "in_proj_ba", "out_proj"}}[name]
    assert modules == want, modules
    assert_matches_peft_step(hf, d, batch, lora, ours, TOL)


def test_canonical_parts_at_tp2_sp_equal_one_rank(hybrids):
    """Canonical parts of in_proj and q_proj (their masks split over TP as the weight's pieces)
    at TP=2 + SP: log-probs, reference, adapters before and after the update, grad norm."""
    from tests.lora_bodies import assert_equal_to_one_rank, lora_update

    models, results = hybrids
    name, lora, _ = CASES["qwen3_5_canonical"]
    d, _, batch = models[name]
    got = run_ranks(2, lora_update, d, dict(tp=2, sequence_parallel=True), lora, batch, ACTOR)
    assert_equal_to_one_rank(got, results["qwen3_5_canonical"], TOL)


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
PEFT_CASES = {  # name -> (model, peft LoraConfig kwargs, our lora, world, layout)
    # fused by rank expansion at TP=2 + SP (expert-TP 2): Qwen3-Next's grouped in_proj pieces with
    # their own ranks, and the routed experts (peft's target_parameters)
    "qwen3_next_fused_tp2_sp": ("qwen3_next", dict(r=4, lora_alpha=8, target_modules=[
        "q_proj", "in_proj_qkvz", "in_proj_ba", "out_proj"], rank_pattern={"in_proj_ba": 2},
        alpha_pattern={"out_proj": 3}, target_parameters=EXPERTS), dict(rank=1), 2, dict(tp=2, sequence_parallel=True)),
    # Qwen3.5-MoE: GDN projections and its routed experts' down_proj only
    "qwen3_5_moe_experts": ("qwen3_5_moe", dict(r=2, lora_alpha=4, target_modules=["in_proj_qkv", "in_proj_b", "o_proj"],
                            target_parameters=EXPERTS[1:]), dict(rank=1), 1, {}),
    # canonical: one of Qwen3.5's four in_proj pieces (and q_proj's query + gate rows) stays alone
    "qwen3_5_only_z_canonical": ("qwen3_5", dict(r=4, lora_alpha=8, target_modules=["in_proj_z", "q_proj"]),
                                 dict(rank=1, type="canonical_lora"), 1, {}),
}


@pytest.mark.parametrize("case", PEFT_CASES)
def test_peft_adapter_round_trip(case, hybrids, tmp_path):
    """An adapter peft wrote imports exactly, trains 2 steps, exports as a PEFT adapter peft loads
    to the engine's log-probs (canonical: the same modules only) and as merged HF weights."""
    import copy
    import json
    import os
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.lora_bodies import lora_roundtrip
    from tests.test_lora_peft_io import _peft_adapter

    models, _ = hybrids
    name, peft_kwargs, lora, world, layout = PEFT_CASES[case]
    hf_dir, hf, batch = models[name]
    _peft_adapter(hf, peft_kwargs, str(tmp_path / "adapter"))
    lora = dict(lora, adapter_path=str(tmp_path / "adapter"))
    got = run_ranks(world, lora_roundtrip, hf_dir, layout, lora, batch, ACTOR, str(tmp_path / "out"),
                    name != "qwen3_5")[0]
    t = ACTOR["temperature"]
    start, _ = hf_log_probs(PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "adapter")), batch, t)
    assert _max_diff(got["before"], start) <= TOL  # the import is exact
    assert _max_diff(got["after"], got["before"]) > 1e-3  # training moved the adapters
    trained, _ = hf_log_probs(PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "out" / "peft")), batch, t)
    assert _max_diff(got["after"], trained) <= TOL
    exported = json.loads((tmp_path / "out" / "peft" / "adapter_config.json").read_text())["target_modules"]
    if lora.get("type") == "canonical_lora":
        assert sorted(exported) == sorted(peft_kwargs["target_modules"])
    _assert_merged_is_peft_merge(hf, hf_dir, str(tmp_path / "out"))
    if name == "qwen3_5":  # see _assert_merged_is_peft_merge for Qwen3-Next and Qwen3.5-MoE
        merged_dir = tmp_path / "out" / "merged"
        for file in os.listdir(hf_dir):
            if file.endswith(".json") and "index" not in file:
                shutil.copy(os.path.join(hf_dir, file), merged_dir / file)
        merged, _ = hf_log_probs(AutoModelForCausalLM.from_pretrained(merged_dir).eval(), batch, t)
        assert _max_diff(got["after"], merged) <= TOL


def _assert_merged_is_peft_merge(hf, hf_dir: str, out: str) -> None:
    """The merged HF weights (out/merged) equal peft's merge of the exported adapter (out/peft,
    in float64) within two fp32 roundings of each tensor, every adapted module moved; tensors
    without an adapter equal the base's bit for bit. (The hybrid MoE models' merged log-probs
    are not compared at 1e-5: one fp32 rounding of Qwen3-Next's in_proj_ba (its decay rows)
    moves them by 1.3e-5, measured; the weights are exact.)"""
    import copy

    from peft import PeftModel

    from mcore_rl.mapping.hf_io import SafetensorsReader

    merged, base = SafetensorsReader(f"{out}/merged"), SafetensorsReader(hf_dir)
    exact = _per_expert(PeftModel.from_pretrained(copy.deepcopy(hf), f"{out}/peft").double().merge_and_unload())
    assert set(merged) == set(base) == set(exact)
    moved = set()
    for key in merged:
        if torch.equal(exact[key], base[key].double()):
            assert torch.equal(merged[key], base[key]), key
            continue
        bound = 2 * torch.finfo(torch.float32).eps * exact[key].abs().max().item()
        assert _max_diff(merged[key], exact[key]) <= bound, key
        moved.add(key)
    adapted = {k.removeprefix("base_model.model.").split(".lora_A.")[0] for k in SafetensorsReader(f"{out}/peft")
               if ".lora_A." in k}
    assert {f"{m}.weight" for m in adapted if ".mlp.experts" not in m} <= moved
    assert any(".mlp.experts." in k for k in moved) == any(".mlp.experts" in m for m in adapted)


def _per_expert(model) -> dict[str, torch.Tensor]:
    """The model's state dict with fused experts ([E, 2f, h] gate_up_proj, [E, h, f] down_proj)
    split into the per-expert HF names the checkpoints use."""
    out = {}
    for key, value in model.state_dict().items():
        layer, _, param = key.rpartition(".mlp.experts.")
        if not layer:
            out[key] = value
            continue
        for e, tensor in enumerate(value):
            if param == "gate_up_proj":
                gate, up = tensor.chunk(2, dim=0)
                out[f"{layer}.mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"{layer}.mlp.experts.{e}.up_proj.weight"] = up
            else:
                out[f"{layer}.mlp.experts.{e}.down_proj.weight"] = tensor
    return out


def test_adapter_only_step_merges_and_reshards(hybrids, tmp_path):
    """A Qwen3-Next LoRA actor (adapters on in_proj, out_proj and the gated linear_qkv) saved
    adapter-only at TP=2+SP: in_proj's lora.B is stored in megatron's in_proj pieces (query ...
    alpha), so the converter's offline merge equals the live merged export and a resume at TP=1
    (DP=2) loads every adapter bit-exact."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from tests.hybrid_lora_bodies import save_merge_resume

    models, _ = hybrids
    lora = dict(BASE, target_modules=("in_proj", "out_proj", "linear_qkv"))
    root = str(tmp_path / "ckpt")
    out = run_ranks(2, save_merge_resume, models["qwen3_next"][0], lora, root, True, daemon=False)
    merge(f"{root}/global_step_1/actor", str(tmp_path / "merged"))
    offline = SafetensorsReader(str(tmp_path / "merged"))
    for rank, got in enumerate(out):
        assert got["adapters"].keys() == got["resumed"].keys() and any(".in_proj_qkvz." in k for k in got["adapters"])
        assert all(torch.equal(v, got["resumed"][k]) for k, v in got["adapters"].items()), f"rank {rank}"
    live = out[0]["merged"]
    assert set(offline) == set(live)
    worst = max((_max_diff(offline[k], v), k) for k, v in live.items())
    assert worst[0] <= 1e-6, f"{worst[1]} differs by {worst[0]:.3g}"  # offline: fp64 B A, rounded once
    base = SafetensorsReader(models["qwen3_next"][0])
    assert not torch.equal(live["model.layers.0.linear_attn.in_proj_qkvz.weight"],
                           base["model.layers.0.linear_attn.in_proj_qkvz.weight"])
