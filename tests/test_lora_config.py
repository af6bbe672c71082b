"""LoraConfig: verl's keys and meanings, targets matched on canonical names, clear refusals."""
from __future__ import annotations

import pytest

from mcore_rl.lora.config import LoraConfig, LoraConfigError, lora_config_from_dict

QKV = "decoder.layers.3.self_attention.linear_qkv"
DENSE_FC1 = "decoder.layers.0.mlp.linear_fc1"
SHARED_FC1 = "decoder.layers.2.mlp.shared_experts.linear_fc1"
EXPERT_FC1 = "decoder.layers.2.mlp.experts.local_experts.5.linear_fc1"


def test_plain_names_match_every_linear_of_that_name():
    cfg = LoraConfig(rank=8, target_modules=("linear_fc1",))
    assert [cfg.parts(n) for n in (QKV, DENSE_FC1, SHARED_FC1, EXPERT_FC1)] == [None, (), (), ()]


def test_patterns_match_whole_canonical_names():
    cfg = LoraConfig(rank=8, target_modules=("*.mlp.linear_fc1", "*.layers.3.*"))
    assert [cfg.parts(n) for n in (QKV, DENSE_FC1, SHARED_FC1, EXPERT_FC1)] == [(), (), None, None]
    experts = LoraConfig(rank=8, target_modules=("*.local_experts.*",))
    assert [experts.parts(n) for n in (DENSE_FC1, SHARED_FC1, EXPERT_FC1)] == [None, None, ()]


def test_exclude_modules_adapt_every_other_linear():
    cfg = LoraConfig(rank=8, target_modules=(), exclude_modules=("linear_qkv", "*.shared_experts.*"))
    assert [cfg.parts(n) for n in (QKV, DENSE_FC1, SHARED_FC1, EXPERT_FC1)] == [None, (), None, ()]


def test_canonical_parts():
    cfg = LoraConfig(rank=8, type="canonical_lora", target_modules=("linear_q", "linear_v", "linear_fc1_up"))
    assert cfg.parts(QKV) == (0, 2) and cfg.parts(DENSE_FC1) == (1,)
    assert LoraConfig(rank=8, type="canonical_lora", target_modules=("linear_qkv",)).parts(QKV) == (0, 1, 2)


@pytest.mark.parametrize("values, needle", [
    (dict(type="dora", rank=8), "lora.type='dora'"),
    (dict(type="vlm_lora", rank=8), "lora.type='vlm_lora'"),
    (dict(rank=-1), "lora.rank=-1"),
    (dict(rank=8, target_modules=["linear_q"]), "canonical_lora part"),
    (dict(rank=8, target_modules=["router"]), "routers"),
    (dict(rank=8, target_modules=["linear_qkvv"]), "'linear_qkvv' names no linear"),
    (dict(rank=8, exclude_modules=["linear_qkv"]), "needs an empty target_modules"),
    (dict(rank=8, lora_A_init_method="orthogonal"), "lora.lora_A_init_method='orthogonal'"),
    (dict(rank=8, dropout_position="middle"), "dropout_position='middle'"),
    (dict(rank=8, alpha_typo=3), "unknown lora key(s) ['alpha_typo']"),
    (dict(rank=8, a2a_experimental=True), "lora.a2a_experimental"),
])
def test_bad_values_are_refused_by_name(values, needle):
    with pytest.raises(LoraConfigError) as e:
        lora_config_from_dict(values)
    assert needle in str(e.value)


def test_rank_zero_is_off_and_verl_defaults_pass():
    assert not lora_config_from_dict({"rank": 0, "type": "lora", "merge": False, "a2a_experimental": False}).enabled


def test_peft_export_refuses_targets_peft_would_rewrite_even_without_experts():
    """A deepseek_v3 adapter on its dense first layer's MLP only: peft 0.21 would turn the
    gate_proj/up_proj/down_proj targets into expert parameters; refused, a llama's pass."""
    from types import SimpleNamespace

    from mcore_rl.mapping.peft_experts import PeftExpertsError
    from mcore_rl.lora.config import LoraConfig
    from mcore_rl.conversion.lora_export import peft_adapter_config

    ranks = {"model.layers.0.mlp.gate_proj": (4, 2.0), "model.layers.0.self_attn.o_proj": (4, 2.0)}
    cfg = LoraConfig(rank=4, alpha=8.0)
    with pytest.raises(PeftExpertsError, match="gate_proj"):
        peft_adapter_config(dict(ranks), cfg, SimpleNamespace(arch=SimpleNamespace(model_type="deepseek_v3")),
                            "actor", None)
    out = peft_adapter_config(dict(ranks), cfg, SimpleNamespace(arch=SimpleNamespace(model_type="llama")), "actor", None)
    assert out["target_modules"] == ["gate_proj", "o_proj"] and out["r"] == 4 and out["lora_alpha"] == 8.0
