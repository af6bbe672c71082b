"""Routed-expert LoRA in PEFT format (mcore_rl/mapping/peft_experts.py) against peft 0.21 itself.

Random per-expert factors go through ``experts_to_peft`` into a peft-wrapped tiny HF model (both
by ``set_peft_model_state_dict`` and from an adapter directory); its logits must equal a model
without peft whose fused expert weights got ``s * B_e @ A_e`` added by hand, and peft must hand
the tensors back unchanged.
"""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import save_file

from mcore_rl.mapping import peft_experts as pe
from tests.tiny import tiny_config, tiny_hf_model

R, ALPHA = 2, 6  # s = 3
TYPES = sorted(pe.MODEL_TYPES)


# hybrids: a full-attention layer too (transformers' cache needs one for a forward)
HYBRID = {"qwen3_next", "qwen3_5_moe_text"}


@functools.lru_cache(maxsize=None)
def _base(model_type: str):
    layers = dict(layer_types=["linear_attention", "full_attention"]) if model_type in HYBRID else {}
    return tiny_hf_model(tiny_config(model_type, num_hidden_layers=2, **layers))  # deepseek/glm: layer 0 dense


def _moe_layers(model) -> list[int]:
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def _random_factors(model, seed: int = 5) -> dict[int, pe.LayerFactors]:
    """{layer: {e: {"gate_up": (A [r, h], B [2f, r]), "down": (A [r, f], B [h, r])}}}, non-zero."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in _moe_layers(model):
        num, h, f = model.model.layers[i].mlp.experts.down_proj.shape
        rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.1  # noqa: E731
        out[i] = {e: {"gate_up": (rnd(R, h), rnd(2 * f, R)), "down": (rnd(R, f), rnd(h, R))} for e in range(num)}
    return out


def _reference(model, factors):
    """The base model with ``s * B_e @ A_e`` added to each expert's weight; no peft involved."""
    ref = copy.deepcopy(model)
    with torch.no_grad():
        for i, layer in factors.items():
            experts = ref.model.layers[i].mlp.experts
            for e, parts in layer.items():
                (a1, b1), (a2, b2) = parts["gate_up"], parts["down"]
                experts.gate_up_proj[e] += (ALPHA / R) * b1 @ a1  # [2f, h], rows [gate; up]
                experts.down_proj[e] += (ALPHA / R) * b2 @ a2  # [h, f]
    return ref


def _peft_state(model_type: str, factors) -> dict[str, torch.Tensor]:
    state = {}
    for i, layer in factors.items():
        state.update(pe.experts_to_peft(f"model.layers.{i}", layer, model_type))
    return state


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("model_type", TYPES)
def test_peft_expert_lora_matches_merged_reference(model_type, tmp_path):
    base = _base(model_type)
    factors = _random_factors(base)
    state = _peft_state(model_type, factors)
    ids = torch.randint(0, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    expected = _logits(_reference(base, factors), ids)
    assert (expected - _logits(base, ids)).abs().max() > 1e-2  # the adapters matter far above the tolerance

    config = LoraConfig(r=R, lora_alpha=ALPHA, **pe.peft_config_entries(model_type))
    model = get_peft_model(copy.deepcopy(base), config)
    loaded = set_peft_model_state_dict(model, state)
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora_" in k]
    torch.testing.assert_close(_logits(model, ids), expected, rtol=0, atol=1e-5)

    back = get_peft_model_state_dict(model)  # peft gives back exactly our tensors, under our names
    assert sorted(back) == sorted(state) and all(torch.equal(back[k], state[k]) for k in state)
    for i, layer in factors.items():
        again = pe.experts_from_peft(f"model.layers.{i}", back, model_type, rank=R)
        assert again.keys() == layer.keys()
        for e in layer:
            for part in ("gate_up", "down"):
                assert all(torch.equal(x, y) for x, y in zip(again[e][part], layer[e][part]))

    config.save_pretrained(tmp_path)  # the adapter directory route: adapter_config.json + safetensors
    save_file(state, str(tmp_path / "adapter_model.safetensors"))
    from_dir = PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path))
    torch.testing.assert_close(_logits(from_dir, ids), expected, rtol=0, atol=1e-5)


def test_one_part_and_nesting_keys():
    """Only the targeted parameters are wrapped: a lone part sits directly on ``mlp.experts``."""
    base = _base("qwen3_moe")
    model = get_peft_model(copy.deepcopy(base), LoraConfig(
        r=R, lora_alpha=ALPHA, **pe.peft_config_entries("qwen3_moe", parts=["down"])))
    want = {k for i in _moe_layers(base) for k in pe.peft_keys(f"model.layers.{i}", "qwen3_moe", ["down"])["down"]}
    assert set(get_peft_model_state_dict(model)) == want
    assert all(".experts.lora_" in k for k in want)
    both = pe.peft_keys("model.layers.0", "qwen3_moe", ["down", "gate_up"])
    assert both["gate_up"][0] == "base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"
    assert both["down"][1] == "base_model.model.model.layers.0.mlp.experts.lora_B.weight"


def test_fc1_halves_order_is_applied(monkeypatch):
    """A layout storing [up; gate] gets B's row halves swapped, and back exactly."""
    swapped = pe.ExpertLayout("mlp.experts", pe.FUSED_3D.params, ("up", "gate"))
    monkeypatch.setitem(pe.MODEL_TYPES, "swapped", pe.ModelEntry(swapped, ()))
    g = torch.Generator().manual_seed(0)
    layer = {e: {"gate_up": (torch.randn(R, 4, generator=g), torch.randn(6, R, generator=g))} for e in range(3)}
    plain = pe.experts_to_peft("model.layers.0", layer, "qwen3_moe")
    other = pe.experts_to_peft("model.layers.0", layer, "swapped")
    key_b = pe.peft_keys("model.layers.0", "qwen3_moe", ["gate_up"])["gate_up"][1]
    assert torch.equal(other[key_b], torch.cat([plain[key_b][3:], plain[key_b][:3]]))
    back = pe.experts_from_peft("model.layers.0", other, "swapped", rank=R, parts=["gate_up"])
    assert all(torch.equal(back[e]["gate_up"][1], layer[e]["gate_up"][1]) for e in layer)


def test_bad_input_is_refused_clearly():
    a, b = torch.zeros(R, 4), torch.zeros(6, R)
    cases = [
        (lambda: pe.experts_to_peft("model.layers.1", {0: {"down": (a, b)}, 2: {"down": (a, b)}}, "qwen3_moe"),
         "experts [0, 2]"),
        (lambda: pe.experts_to_peft("model.layers.1", {0: {"down": (a, b), "gate_up": (a[:1], b[:, :1])}},
                                    "qwen3_moe"), "ranks"),
        (lambda: pe.experts_to_peft("model.layers.1", {0: {"down": (a, b)}, 1: {"down": (a, b[:5])}}, "qwen3_moe"),
         "expert 1 has A (2, 4), B (5, 2)"),
        (lambda: pe.experts_to_peft("model.layers.1", {0: {"down": (a, b)}}, "llama"), "'llama'"),
        (lambda: pe.peft_config_entries("deepseek_v3", target_modules=["o_proj", "shared_experts.gate_proj"]),
         "shared_experts.gate_proj"),
        (lambda: pe.experts_from_peft("model.layers.1", pe.experts_to_peft(
            "model.layers.1", {0: {"down": (a, b)}, 1: {"down": (a, b)}}, "mixtral"), "mixtral", 3, ["down"]), "r=3"),
    ]
    for call, text in cases:
        with pytest.raises(pe.PeftExpertsError, match=text.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
            call()
    assert issubclass(pe.PeftExpertsError, ValueError)


@pytest.mark.parametrize("model_type", TYPES)
def test_peft_rewrites_mlp_target_names(model_type):
    """Pins what peft 0.21 does with dense-MLP names on fused-expert models (the table relies on it):
    named in ``rewritten_targets`` -> moved to target_parameters with gate_up's rank doubled, and no
    dense MLP or shared expert keeps LoRA; qwen2_moe is not rewritten: its routed experts get none."""
    base = _base(model_type)
    names = ["w1", "w2", "w3"] if model_type == "mixtral" else ["gate_proj", "up_proj", "down_proj"]
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=R, lora_alpha=ALPHA, target_modules=["o_proj", *names]))
    config = model.peft_config["default"]
    adapted = {n.split(".lora_A")[0] for n in get_peft_model_state_dict(model) if ".lora_A" in n}
    mlp = {n.split(".mlp.", 1)[1] for n in adapted if ".mlp." in n}
    rewritten = bool(pe.MODEL_TYPES[model_type].rewritten_targets)
    if rewritten:
        assert set(names) <= set(pe.MODEL_TYPES[model_type].rewritten_targets)
        layer = model.get_base_model().model.layers[_moe_layers(base)[0]]
        assert layer.mlp.experts.base_layer.lora_A["default"].weight.shape[0] == 2 * R * layer.mlp.experts.num_experts
    assert (set(config.target_modules) == {"o_proj"}) == rewritten
    assert (config.rank_pattern == {r".*\.gate_up_proj": 2 * R}) == rewritten
    assert mlp == ({"experts", "experts.base_layer"} if rewritten else
                   {"shared_expert.gate_proj", "shared_expert.up_proj", "shared_expert.down_proj"})
