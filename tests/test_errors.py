"""Bad input fails with a message that names the value and the fix (checked by text)."""
from __future__ import annotations

import json
import types

import pytest

from mcore_rl.mapping.transforms import Dims
from mcore_rl.mapping.weights import MappingError, WeightMap, check_hf_keys
from mcore_rl.models.builder import check_attention_split, check_divisibility
from mcore_rl.models.hf_config import ConfigError, model_args_from_hf
from mcore_rl.models.registry import UnknownArchitectureError, lookup_arch
from mcore_rl.models.rope import RopeError
from mcore_rl.parallel import LayoutError, ParallelLayout
from tests.tiny import tiny_config


def test_unknown_architecture_lists_supported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    with pytest.raises(UnknownArchitectureError) as e:
        model_args_from_hf(tmp_path)
    msg = str(e.value)
    assert "'gpt_neox'" in msg and ("llama, mistral, mixtral, qwen2, qwen2_moe, qwen3, qwen3_5, qwen3_5_moe, "
                                    "qwen3_5_moe_text, qwen3_5_text, qwen3_moe, qwen3_next") in msg
    assert "registry.py" in msg


def test_missing_config_names_directory(tmp_path):
    with pytest.raises(ConfigError, match=f"no config.json in '{tmp_path}'.*save_pretrained"):
        model_args_from_hf(tmp_path)


def test_malformed_config_names_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config.json is not a valid JSON object .*fix or re-export"):
        model_args_from_hf(tmp_path)


def test_config_without_model_type(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ConfigError, match="has no 'model_type'"):
        model_args_from_hf(tmp_path)


def test_config_missing_field_names_it():
    fields = tiny_config("llama").to_dict()
    del fields["rms_norm_eps"]
    cfg = types.SimpleNamespace(**fields)  # a config-like object without the field
    with pytest.raises(ConfigError, match="model_type 'llama' is missing 'rms_norm_eps'; add it"):
        model_args_from_hf(cfg)


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope"])
def test_unsupported_rope_type(rope_type):
    rope = dict(rope_type=rope_type, factor=2.0, rope_theta=1e4)
    if rope_type == "longrope":
        rope.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=64)
    cfg = tiny_config("llama", rope_parameters=rope)
    with pytest.raises(RopeError) as e:
        model_args_from_hf(cfg)
    assert f"rope_type={rope_type!r} is not supported; supported: default, linear, llama3" in str(e.value)


def test_llama3_rope_missing_parameter():
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, rope_theta=1e4,
                original_max_position_embeddings=64)
    fields = {**tiny_config("llama").to_dict(), "rope_parameters": rope}
    cfg = types.SimpleNamespace(**fields)  # transformers would refuse to build this config
    with pytest.raises(RopeError, match="rope_type='llama3' needs 'high_freq_factor'"):
        model_args_from_hf(cfg)


def test_short_window_of_an_arch_without_a_window_rule_is_refused():
    cfg = tiny_config("qwen2_moe", sliding_window=64, use_sliding_window=True)
    with pytest.raises(ConfigError, match=r"sliding_window=64 is shorter than the max sequence length 128, "
                                          r"and model_type 'qwen2_moe' has no sliding-window rule"):
        model_args_from_hf(cfg)
    assert model_args_from_hf(cfg, max_seq_len=64).window is None


def test_mistral_window_is_applied_not_refused():
    args = model_args_from_hf(tiny_config("mistral", sliding_window=64))
    assert (args.window, args.window_layers) == (64, (True,) * 4)
    # a window at least as long as any sequence cuts nothing: no window (the TE spec on GPU)
    assert model_args_from_hf(tiny_config("mistral", sliding_window=128)).window is None
    assert model_args_from_hf(tiny_config("mistral", sliding_window=64), max_seq_len=64).window is None
    assert model_args_from_hf(tiny_config("mistral", sliding_window=64), max_seq_len=65).window == 64


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "qwen3_moe"])
def test_qwen_window_ignored_unless_enabled(model_type):
    """qwen applies the window only with use_sliding_window=True (transformers nulls it else)."""
    off = model_args_from_hf(tiny_config(model_type, sliding_window=8, use_sliding_window=False))
    assert (off.window, off.window_layers) == (None, None)
    on = model_args_from_hf(tiny_config(model_type, sliding_window=8, use_sliding_window=True, max_window_layers=1))
    layers = (True,) * 4 if model_type == "qwen3_moe" else (False, True, True, True)  # MoE: every layer
    assert (on.window, on.window_layers) == (8, layers)


def test_tp_not_dividing_heads():
    args = model_args_from_hf(tiny_config("llama", hidden_size=96, num_attention_heads=6, num_key_value_heads=2))
    with pytest.raises(LayoutError) as e:  # kv heads neither divide nor are divided by tp
        check_divisibility(args, ParallelLayout(tp=3))
    assert (
        "tp(3) cannot split num_attention_heads(6) with num_key_value_heads(2): tp must divide the "
        "query heads and either divide or be a multiple of the KV heads; choose tp among the "
        "divisors of 6 that are multiples or divisors of num_key_value_heads(2)"
    ) in str(e.value)
    args = model_args_from_hf(tiny_config("llama", num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(LayoutError, match=r"tp\(8\) cannot split num_attention_heads\(4\) with num_key_value_heads\(2\)"):
        check_divisibility(args, ParallelLayout(tp=8))  # a multiple of the kv heads, not a divisor of the heads


def test_tp_above_kv_heads_is_allowed():
    """megatron-core shares a KV head over tp / kv_heads ranks (Qwen2.5-3B: 2 KV heads, TP=4)."""
    for kv, tp in ((2, 4), (1, 2), (1, 4), (2, 2)):
        args = model_args_from_hf(tiny_config("qwen2", num_attention_heads=4, num_key_value_heads=kv))
        check_divisibility(args, ParallelLayout(tp=tp))


def test_tp_splitting_a_kv_group_unevenly():
    args = model_args_from_hf(tiny_config("llama", num_attention_heads=8, num_key_value_heads=1, head_dim=6))
    with pytest.raises(LayoutError, match=r"fused qkv rows \(60 = .* over 8 ranks unevenly"):
        check_divisibility(args, ParallelLayout(tp=8))
    check_divisibility(args, ParallelLayout(tp=4))


def test_tp_splitting_a_gated_kv_group_unevenly():
    """Gated attention (Qwen3-Next): a KV head's rows are [query heads | gate heads | k | v]."""
    args = model_args_from_hf(tiny_config("llama", num_attention_heads=8, num_key_value_heads=1, head_dim=6))
    with pytest.raises(LayoutError) as e:
        check_attention_split(args, 8, gated=True)
    assert (
        "tp(8) splits each KV head's fused qkv and output-gate rows (108 = (2 * num_attention_heads(8) "
        "/ num_key_value_heads(1) + 2) * head_dim(6)) over 8 ranks unevenly; choose tp among the "
        "divisors of 8 that are multiples or divisors of num_key_value_heads(1) with tp / "
        "num_key_value_heads dividing 108."
    ) in str(e.value)
    for tp in (1, 2, 4):  # 108 rows in 1, 2 or 4 equal parts
        check_attention_split(args, tp, gated=True)
    two_kv = model_args_from_hf(tiny_config("llama", num_attention_heads=4, num_key_value_heads=2, head_dim=6))
    for tp in (2, 4):  # a group each, or (4 + 2) * 6 rows in halves
        check_attention_split(two_kv, tp, gated=True)


def test_layers_not_dividing_pipeline():
    args = model_args_from_hf(tiny_config("llama", num_hidden_layers=4))
    with pytest.raises(LayoutError, match=r"num_hidden_layers\(4\) is not divisible by pp\(2\) \* vpp\(3\) = 6"):
        check_divisibility(args, ParallelLayout(pp=2, vpp=3))


def test_world_size_not_matching_layout():
    with pytest.raises(LayoutError) as e:
        ParallelLayout(tp=2, pp=2).validate(world_size=6)
    assert str(e.value).startswith("tp(2) * pp(2) * cp(1) = 4 does not divide WORLD_SIZE(6)")
    assert ParallelLayout(tp=2, pp=2).dp(world_size=8) == 2


def test_layout_rules():
    with pytest.raises(LayoutError, match=r"tp\(2\) with ep\(2\) requires sequence_parallel=True"):
        ParallelLayout(tp=2, ep=2).validate(4)
    with pytest.raises(LayoutError, match=r"sequence_parallel=True needs tp > 1 \(tp=1\)"):
        ParallelLayout(sequence_parallel=True).validate(2)
    with pytest.raises(LayoutError, match=r"vpp\(2\) needs pp >= 2 \(pp=1\)"):
        ParallelLayout(vpp=2).validate(2)
    with pytest.raises(LayoutError, match=r"ep\(4\) \* etp\(1\) \* pp\(1\) = 4 does not divide WORLD_SIZE\(2\)"):
        ParallelLayout(ep=4).validate(2)
    with pytest.raises(LayoutError, match=r"tp=0 must be an integer >= 1"):
        ParallelLayout(tp=0).validate(2)


def test_lookup_arch_known():
    assert lookup_arch("qwen3").qk_norm and lookup_arch("qwen2").qkv_bias


def _wmap(tied=False):
    arch = lookup_arch("llama")
    dims = Dims(num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=200, padded_vocab_size=256)
    return WeightMap("llama", arch.table.rows("actor"), dims, num_layers=2, tied_embeddings=tied)


def test_unmapped_hf_key_is_named():
    keys = _wmap().hf_keys() | {"model.layers.0.self_attn.rotary_emb.inv_freq"}
    with pytest.raises(MappingError, match=r"HF tensors with no row in the llama mapping table: \['model.layers.0.self_attn.rotary_emb.inv_freq'\]"):
        check_hf_keys(_wmap(), keys)


def test_missing_hf_key_is_named():
    keys = _wmap().hf_keys() - {"lm_head.weight"}
    with pytest.raises(MappingError, match=r"lacks tensors the llama model needs: \['lm_head.weight'\]"):
        check_hf_keys(_wmap(), keys)
    check_hf_keys(_wmap(tied=True), keys)  # tied: the embedding is the head


def test_unmapped_megatron_param_is_named():
    with pytest.raises(MappingError, match=r"megatron parameter 'decoder.layers.3.mlp.router.weight' has no row"):
        _wmap().rule("decoder.layers.3.mlp.router.weight")
