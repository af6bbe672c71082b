"""Weight-name tables, one per architecture, used for both directions (HF -> mcore, mcore -> HF).

Names on the mcore side are canonical megatron names with the *global* layer index: the
Transformer Engine spec's parameter names, which are also the dist-checkpoint keys of both
specs (the local CPU spec's ``input_layernorm``/``pre_mlp_layernorm`` are renamed to them).
Names on the HF side are the Hub's safetensors keys. ``{layer}`` is the only placeholder here;
MoE tables add ``{expert}``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mcore_rl.mapping.transforms import COLUMN, GATE_UP, QKV, REPLICATED, ROW, VOCAB, Transform

Row = tuple[tuple[str, ...], Transform]


@dataclass(frozen=True)
class MappingTable:
    """mcore name template -> (HF name templates, transform); heads are kept apart by role."""

    trunk: dict[str, Row]
    lm_head: dict[str, Row] = field(default_factory=dict)
    value_head: dict[str, Row] = field(default_factory=dict)

    def rows(self, role: str) -> dict[str, Row]:
        head = {"actor": self.lm_head, "critic": self.value_head}[role]
        return {**self.trunk, **head}


_L = "model.layers.{layer}"
_D = "decoder.layers.{layer}"

_LLAMA_TRUNK: dict[str, Row] = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), VOCAB),
    f"{_D}.self_attention.linear_qkv.layer_norm_weight": ((f"{_L}.input_layernorm.weight",), REPLICATED),
    f"{_D}.self_attention.linear_qkv.weight": (
        (f"{_L}.self_attn.q_proj.weight", f"{_L}.self_attn.k_proj.weight", f"{_L}.self_attn.v_proj.weight"),
        QKV,
    ),
    f"{_D}.self_attention.linear_proj.weight": ((f"{_L}.self_attn.o_proj.weight",), ROW),
    f"{_D}.mlp.linear_fc1.layer_norm_weight": ((f"{_L}.post_attention_layernorm.weight",), REPLICATED),
    f"{_D}.mlp.linear_fc1.weight": ((f"{_L}.mlp.gate_proj.weight", f"{_L}.mlp.up_proj.weight"), GATE_UP),
    f"{_D}.mlp.linear_fc2.weight": ((f"{_L}.mlp.down_proj.weight",), ROW),
    "decoder.final_layernorm.weight": (("model.norm.weight",), REPLICATED),
}

_LM_HEAD: dict[str, Row] = {"output_layer.weight": (("lm_head.weight",), VOCAB)}

# The critic's hidden -> 1 head, named as in transformers' *ForTokenClassification.
_VALUE_HEAD: dict[str, Row] = {
    "output_layer.weight": (("score.weight",), REPLICATED),
    "output_layer.bias": (("score.bias",), REPLICATED),
}

_QKV_BIAS: dict[str, Row] = {
    f"{_D}.self_attention.linear_qkv.bias": (
        (f"{_L}.self_attn.q_proj.bias", f"{_L}.self_attn.k_proj.bias", f"{_L}.self_attn.v_proj.bias"),
        QKV,
    ),
}

_QK_NORM: dict[str, Row] = {
    f"{_D}.self_attention.q_layernorm.weight": ((f"{_L}.self_attn.q_norm.weight",), REPLICATED),
    f"{_D}.self_attention.k_layernorm.weight": ((f"{_L}.self_attn.k_norm.weight",), REPLICATED),
}

LLAMA = MappingTable(trunk=_LLAMA_TRUNK, lm_head=_LM_HEAD, value_head=_VALUE_HEAD)
QWEN2 = MappingTable(trunk={**_LLAMA_TRUNK, **_QKV_BIAS}, lm_head=_LM_HEAD, value_head=_VALUE_HEAD)
QWEN3 = MappingTable(trunk={**_LLAMA_TRUNK, **_QK_NORM}, lm_head=_LM_HEAD, value_head=_VALUE_HEAD)

__all__ = ["MappingTable", "LLAMA", "QWEN2", "QWEN3", "COLUMN"]
