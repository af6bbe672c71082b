"""config.json read without transformers, for ``model_args_from_hf`` on a directory.

Importing transformers and its config classes costs about 0.9 s, a third of the converters'
start-up. A field config.json leaves out takes the value transformers' config class would give
it: ``CLASS_DEFAULTS`` holds those values for the fields mcore_rl reads, as data per
``model_type`` (tests/test_hf_json.py compares every entry, and the ModelArgs of configs with each
field removed in turn, with transformers). Fields a class derives from others (a missing
``head_dim`` is hidden / heads, ``layer_types`` and ``rope_parameters`` come from other fields)
are left out: the readers in ``hf_config``/``rope`` derive them the same way.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

_DENSE = {"hidden_act": "silu", "tie_word_embeddings": False, "attention_dropout": 0.0,
          "initializer_range": 0.02, "pad_token_id": None}


@dataclass(frozen=True)
class ClassDefaults:
    """What a transformers config class sets for fields absent from config.json, and the
    field names it accepts for others (``attribute_map``: alias -> field)."""

    values: Mapping[str, Any]
    aliases: Mapping[str, str] = field(default_factory=dict)


# Qwen3-Next / Qwen3.5: gated attention (head_dim 256, 1/4 of it rotary) and Gated DeltaNet sizes
_HYBRID = {**_DENSE, "attention_bias": False, "head_dim": 256, "max_position_embeddings": 32768,
           "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
           "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
           "linear_num_key_heads": 16, "linear_num_value_heads": 32}
_EXPERTS = {"num_experts": "num_local_experts"}  # mixtral, qwen3_moe
_SIGMOID = {"num_local_experts": "n_routed_experts", "num_mtp_layers": "num_nextn_predict_layers"}

# transformers 5 class defaults of the fields mcore_rl reads (rope_theta and partial_rotary_factor:
# those of the class's default rope_parameters)
CLASS_DEFAULTS: dict[str, ClassDefaults] = {
    "llama": ClassDefaults({
        **_DENSE, "attention_bias": False, "mlp_bias": False, "hidden_size": 4096, "num_attention_heads": 32,
        "max_position_embeddings": 2048, "num_hidden_layers": 32, "vocab_size": 32000,
        "intermediate_size": 11008, "rms_norm_eps": 1e-06, "rope_theta": 10000.0}),
    "mistral": ClassDefaults({
        **_DENSE, "sliding_window": 4096, "num_key_value_heads": 8, "hidden_size": 4096,
        "num_attention_heads": 32, "max_position_embeddings": 131072, "num_hidden_layers": 32,
        "vocab_size": 32000, "intermediate_size": 14336, "rms_norm_eps": 1e-06, "rope_theta": 10000.0}),
    "qwen2": ClassDefaults({
        **_DENSE, "use_sliding_window": False, "max_window_layers": 28, "num_key_value_heads": 32, "hidden_size": 4096,
        "num_attention_heads": 32, "max_position_embeddings": 32768, "num_hidden_layers": 32,
        "vocab_size": 151936, "intermediate_size": 22016, "rms_norm_eps": 1e-06, "rope_theta": 10000.0}),
    "qwen3": ClassDefaults({
        **_DENSE, "attention_bias": False, "use_sliding_window": False, "max_window_layers": 28, "head_dim": 128,
        "num_key_value_heads": 32, "hidden_size": 4096, "num_attention_heads": 32,
        "max_position_embeddings": 32768, "num_hidden_layers": 32, "vocab_size": 151936,
        "intermediate_size": 22016, "rms_norm_eps": 1e-06, "rope_theta": 10000.0}),
    "qwen2_moe": ClassDefaults({
        **_DENSE, "use_sliding_window": False, "num_key_value_heads": 16, "hidden_size": 2048,
        "num_attention_heads": 16, "max_position_embeddings": 32768, "num_hidden_layers": 24,
        "vocab_size": 151936, "intermediate_size": 5632, "rms_norm_eps": 1e-06, "num_experts": 60,
        "moe_intermediate_size": 1408, "num_experts_per_tok": 4, "norm_topk_prob": False,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "shared_expert_intermediate_size": 5632,
        "rope_theta": 10000.0}),
    "qwen3_moe": ClassDefaults({
        **_DENSE, "attention_bias": False, "use_sliding_window": False, "num_key_value_heads": 4,
        "hidden_size": 2048, "num_attention_heads": 32, "max_position_embeddings": 32768,
        "num_hidden_layers": 24, "vocab_size": 151936, "intermediate_size": 6144, "rms_norm_eps": 1e-06,
        "num_local_experts": 128, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
        "norm_topk_prob": False, "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 10000.0},
        _EXPERTS),
    "mixtral": ClassDefaults({
        **_DENSE, "sliding_window": None, "num_key_value_heads": 8, "hidden_size": 4096,
        "num_attention_heads": 32, "max_position_embeddings": 131072, "num_hidden_layers": 32,
        "vocab_size": 32000, "intermediate_size": 14336, "rms_norm_eps": 1e-05, "num_local_experts": 8,
        "num_experts_per_tok": 2, "rope_theta": 1000000.0}, _EXPERTS),
    "glm4_moe": ClassDefaults({
        **_DENSE, "attention_bias": False, "num_key_value_heads": 8, "num_nextn_predict_layers": 1,
        "use_qk_norm": False, "hidden_size": 4096, "num_attention_heads": 96, "max_position_embeddings": 131072,
        "num_hidden_layers": 46, "vocab_size": 151552, "intermediate_size": 10944, "rms_norm_eps": 1e-05,
        "n_routed_experts": 128, "moe_intermediate_size": 1408, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "first_k_dense_replace": 1, "n_shared_experts": 1,
        "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5}, _SIGMOID),
    "deepseek_v3": ClassDefaults({
        **_DENSE, "attention_bias": False, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
        "hidden_size": 7168, "num_attention_heads": 128, "max_position_embeddings": 4096,
        "num_hidden_layers": 61, "vocab_size": 129280, "intermediate_size": 18432, "rms_norm_eps": 1e-06,
        "n_routed_experts": 256, "moe_intermediate_size": 2048, "num_experts_per_tok": 8,
        "norm_topk_prob": True, "first_k_dense_replace": 3, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "n_group": 8, "topk_group": 4, "q_lora_rank": 1536, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "rope_interleave": True,
        "rope_theta": 10000.0}, _SIGMOID),
    "qwen3_next": ClassDefaults({
        **_HYBRID, "num_key_value_heads": 2, "hidden_size": 2048, "num_attention_heads": 16,
        "num_hidden_layers": 48, "vocab_size": 151936, "intermediate_size": 5632, "num_experts": 512,
        "moe_intermediate_size": 512, "num_experts_per_tok": 10, "norm_topk_prob": True,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "shared_expert_intermediate_size": 512}),
    "qwen3_5_text": ClassDefaults({
        **_HYBRID, "num_key_value_heads": 4, "hidden_size": 4096, "num_attention_heads": 16,
        "num_hidden_layers": 32, "vocab_size": 248320, "intermediate_size": 12288}),
    "qwen3_5_moe_text": ClassDefaults({
        **_HYBRID, "num_key_value_heads": 2, "hidden_size": 2048, "num_attention_heads": 16,
        "num_hidden_layers": 40, "vocab_size": 248320, "num_experts": 256, "moe_intermediate_size": 512,
        "num_experts_per_tok": 8, "shared_expert_intermediate_size": 512}),
    # gpt-oss: its class's default rope_parameters is YaRN, not derived from rope_theta (a legacy
    # rope_scaling in the file replaces it: JsonHFConfig); layer_types is derived (alternating)
    "gpt_oss": ClassDefaults({
        **_DENSE, "attention_bias": True, "head_dim": 64, "num_key_value_heads": 8, "hidden_size": 2880,
        "num_attention_heads": 64, "max_position_embeddings": 131072, "num_hidden_layers": 36,
        "vocab_size": 201088, "intermediate_size": 2880, "rms_norm_eps": 1e-05, "num_local_experts": 128,
        "num_experts_per_tok": 4, "sliding_window": 128, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        "rope_theta": 150000.0,
        "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0}},
        {"num_experts": "num_local_experts"}),
}


class JsonHFConfig:
    """A config.json as attributes (``cfg.hidden_size``), class defaults where the file has no
    value; ``getattr(cfg, name, default)`` works as on a transformers config."""

    def __init__(self, raw: Mapping[str, Any], defaults: ClassDefaults) -> None:
        values = dict(defaults.values)
        if "rope_scaling" in raw and "rope_parameters" not in raw:  # the file's legacy spelling wins
            values.pop("rope_parameters", None)
        for key, value in raw.items():
            values[defaults.aliases.get(key, key)] = value
        self._values, self._aliases = values, dict(defaults.aliases)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # the instance's own fields, before __init__ set them
            raise AttributeError(name)
        try:
            return self._values[self._aliases.get(name, name)]
        except KeyError:
            raise AttributeError(name) from None

    def __repr__(self) -> str:
        return f"JsonHFConfig(model_type={self._values.get('model_type')!r})"


def read_config_json(directory: str | os.PathLike) -> dict[str, Any]:
    """The parsed config.json of ``directory``; raises ``OSError`` or ``ValueError`` (the caller
    words the error)."""
    with open(os.path.join(os.fspath(directory), "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"the top level is a JSON {type(raw).__name__}, not an object")
    return raw
