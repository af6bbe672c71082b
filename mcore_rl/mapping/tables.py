"""Weight-name tables, one per architecture, used for both directions (HF -> mcore, mcore -> HF).

Names on the mcore side are canonical megatron names with the *global* layer index and, for
routed experts, the *global* expert index: the Transformer Engine spec's parameter names, which
are also the dist-checkpoint keys of both specs (the local CPU spec's ``input_layernorm``/
``pre_mlp_layernorm`` are renamed to them). Names on the HF side are the Hub's safetensors keys.
Placeholders: ``{layer}`` and ``{expert}``. Rows are grouped by where they apply: every layer
(``attention``), dense-MLP layers only (``dense_mlp``) or MoE layers only (``moe_mlp``).
``variants`` are attention rows that exist only when the model has the named feature (GLM-4.5's
optional QKV bias and QK norm; DeepSeek-V3's low-rank or full query projection).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mcore_rl.mapping.mtp_names import DEFAULT_PREFIX
from mcore_rl.mapping.transforms import (
    COLUMN,
    EXPERT_GATE_UP,
    EXPERT_REPLICATED,
    EXPERT_ROW,
    GATE_UP,
    GATED_QKV,
    GDN_CONV,
    GDN_IN_PROJ_GROUPED,
    GDN_IN_PROJ_SPLIT,
    MLA_KV_DOWN,
    MLA_QUERY,
    QKV,
    REPLICATED,
    ROW,
    VOCAB,
    Transform,
)

Row = tuple[tuple[str, ...], Transform]


@dataclass(frozen=True)
class MappingTable:
    """mcore name template -> (HF name templates, transform), grouped by where rows apply."""

    globals_: dict[str, Row]
    attention: dict[str, Row]
    dense_mlp: dict[str, Row] = field(default_factory=dict)
    moe_mlp: dict[str, Row] = field(default_factory=dict)
    lm_head: dict[str, Row] = field(default_factory=dict)
    value_head: dict[str, Row] = field(default_factory=dict)
    variants: dict[str, dict[str, Row]] = field(default_factory=dict)
    # hybrid models: rows of Gated DeltaNet layers; ``attention`` rows then exist only in the
    # full-attention layers (``ModelArgs.hybrid.linear_layers`` tells which layer is which)
    linear_attention: dict[str, Row] = field(default_factory=dict)
    # multi-token-prediction rows an architecture opts into (mapping/mtp.py reads them)
    mtp: dict[str, Row] = field(default_factory=dict)
    # the HF prefix of MTP layer {mtp}'s decoder layer: DeepSeek-V3 / GLM-4.5 number it as HF layer
    # {layer} = num_hidden_layers + {mtp}; Qwen3-Next / Qwen3.5 keep it under ``mtp.layers.{mtp}``
    # (then every ``mtp.*`` tensor is an MTP one). Its keys are a main layer's under that prefix.
    mtp_layer_prefix: str = DEFAULT_PREFIX

    @property
    def mtp_shared(self) -> bool:
        """The MTP layers' own rows (norms, projection) are single HF tensors, not one per MTP
        layer (Qwen's ``mtp.fc``): a checkpoint can then hold one MTP layer only."""
        return any("{layer}" not in t for k, (hf, _) in self.mtp.items() if k.startswith("mtp.") for t in hf)

    def rows(self, role: str, features: frozenset[str] = frozenset(), hf_prefix: str = "") -> dict[str, Row]:
        """Every row for ``role`` ('actor' has the LM head, 'critic' the value head) of a model
        with ``features`` (names of ``variants``). ``hf_prefix``: HF names under ``model.`` are
        spelled under it instead (a vision-language wrapper's ``model.language_model.``)."""
        head = {"actor": self.lm_head, "critic": self.value_head}[role]
        extra = {k: v for name in sorted(features & self.variants.keys()) for k, v in self.variants[name].items()}
        rows = {**self.globals_, **self.attention, **self.linear_attention, **extra, **self.dense_mlp,
                **self.moe_mlp, **head}
        if not hf_prefix:
            return rows
        return {k: (tuple(with_prefix(n, hf_prefix) for n in hf), tr) for k, (hf, tr) in rows.items()}


def with_prefix(hf_name: str, prefix: str) -> str:
    """``model.X`` -> ``prefix + X`` (a wrapper's text model); other names as they are."""
    return prefix + hf_name[len("model."):] if hf_name.startswith("model.") else hf_name


_L = "model.layers.{layer}"
_D = "decoder.layers.{layer}"

_GLOBALS: dict[str, Row] = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), VOCAB),
    "decoder.final_layernorm.weight": (("model.norm.weight",), REPLICATED),
}

_ATTENTION: dict[str, Row] = {
    f"{_D}.self_attention.linear_qkv.layer_norm_weight": ((f"{_L}.input_layernorm.weight",), REPLICATED),
    f"{_D}.self_attention.linear_qkv.weight": (
        (f"{_L}.self_attn.q_proj.weight", f"{_L}.self_attn.k_proj.weight", f"{_L}.self_attn.v_proj.weight"),
        QKV,
    ),
    f"{_D}.self_attention.linear_proj.weight": ((f"{_L}.self_attn.o_proj.weight",), ROW),
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

_DENSE_MLP: dict[str, Row] = {
    f"{_D}.mlp.linear_fc1.layer_norm_weight": ((f"{_L}.post_attention_layernorm.weight",), REPLICATED),
    f"{_D}.mlp.linear_fc1.weight": ((f"{_L}.mlp.gate_proj.weight", f"{_L}.mlp.up_proj.weight"), GATE_UP),
    f"{_D}.mlp.linear_fc2.weight": ((f"{_L}.mlp.down_proj.weight",), ROW),
}

_E = f"{_D}.mlp.experts.local_experts.{{expert}}"
_QWEN_MOE: dict[str, Row] = {
    f"{_D}.pre_mlp_layernorm.weight": ((f"{_L}.post_attention_layernorm.weight",), REPLICATED),
    f"{_D}.mlp.router.weight": ((f"{_L}.mlp.gate.weight",), REPLICATED),
    f"{_E}.linear_fc1.weight": (
        (f"{_L}.mlp.experts.{{expert}}.gate_proj.weight", f"{_L}.mlp.experts.{{expert}}.up_proj.weight"),
        EXPERT_GATE_UP,
    ),
    f"{_E}.linear_fc2.weight": ((f"{_L}.mlp.experts.{{expert}}.down_proj.weight",), EXPERT_ROW),
}

_QWEN2_SHARED_EXPERT: dict[str, Row] = {
    f"{_D}.mlp.shared_experts.linear_fc1.weight": (
        (f"{_L}.mlp.shared_expert.gate_proj.weight", f"{_L}.mlp.shared_expert.up_proj.weight"),
        GATE_UP,
    ),
    f"{_D}.mlp.shared_experts.linear_fc2.weight": ((f"{_L}.mlp.shared_expert.down_proj.weight",), ROW),
    f"{_D}.mlp.shared_experts.gate_weight": ((f"{_L}.mlp.shared_expert_gate.weight",), REPLICATED),
}

_M = f"{_L}.block_sparse_moe"
_MIXTRAL_MOE: dict[str, Row] = {
    f"{_D}.pre_mlp_layernorm.weight": ((f"{_L}.post_attention_layernorm.weight",), REPLICATED),
    f"{_D}.mlp.router.weight": ((f"{_M}.gate.weight",), REPLICATED),
    f"{_E}.linear_fc1.weight": (
        (f"{_M}.experts.{{expert}}.w1.weight", f"{_M}.experts.{{expert}}.w3.weight"), EXPERT_GATE_UP,
    ),
    f"{_E}.linear_fc2.weight": ((f"{_M}.experts.{{expert}}.w2.weight",), EXPERT_ROW),
}

# DeepSeek-V3 / GLM-4.5: sigmoid router with a score-correction bias, shared experts ungated
_SIGMOID_MOE: dict[str, Row] = {
    **_QWEN_MOE,
    f"{_D}.mlp.router.expert_bias": ((f"{_L}.mlp.gate.e_score_correction_bias",), REPLICATED),
    f"{_D}.mlp.shared_experts.linear_fc1.weight": (
        (f"{_L}.mlp.shared_experts.gate_proj.weight", f"{_L}.mlp.shared_experts.up_proj.weight"),
        GATE_UP,
    ),
    f"{_D}.mlp.shared_experts.linear_fc2.weight": ((f"{_L}.mlp.shared_experts.down_proj.weight",), ROW),
}

# DeepSeek-V3 multi-latent attention (megatron's MLASelfAttention, TE key spelling: the q/kv
# norms are fused into the up-projections, the input norm stays a module of its own)
_S, _A = f"{_D}.self_attention", f"{_L}.self_attn"
_MLA: dict[str, Row] = {
    f"{_D}.input_layernorm.weight": ((f"{_L}.input_layernorm.weight",), REPLICATED),
    f"{_S}.linear_kv_down_proj.weight": ((f"{_A}.kv_a_proj_with_mqa.weight",), MLA_KV_DOWN),
    f"{_S}.linear_kv_up_proj.layer_norm_weight": ((f"{_A}.kv_a_layernorm.weight",), REPLICATED),
    f"{_S}.linear_kv_up_proj.weight": ((f"{_A}.kv_b_proj.weight",), COLUMN),
    f"{_S}.linear_proj.weight": ((f"{_A}.o_proj.weight",), ROW),
}
_MLA_Q_LORA: dict[str, Row] = {
    f"{_S}.linear_q_down_proj.weight": ((f"{_A}.q_a_proj.weight",), REPLICATED),
    f"{_S}.linear_q_up_proj.layer_norm_weight": ((f"{_A}.q_a_layernorm.weight",), REPLICATED),
    f"{_S}.linear_q_up_proj.weight": ((f"{_A}.q_b_proj.weight",), MLA_QUERY),
}
_MLA_Q_FULL: dict[str, Row] = {f"{_S}.linear_q_proj.weight": ((f"{_A}.q_proj.weight",), MLA_QUERY)}

# Qwen3-Next / Qwen3.5 gated full attention: q_proj holds each head's query and output gate
# ([q_h | gate_h]); megatron's linear_qkv per query group [q heads | gate heads | k | v]
_GATED_ATTENTION: dict[str, Row] = {
    **_ATTENTION,
    f"{_D}.self_attention.linear_qkv.weight": (
        (f"{_L}.self_attn.q_proj.weight", f"{_L}.self_attn.k_proj.weight", f"{_L}.self_attn.v_proj.weight"),
        GATED_QKV,
    ),
    **_QK_NORM,
}

# Gated DeltaNet layers (megatron's GatedDeltaNet as ``self_attention``; TE's key spelling: the
# input norm is fused into in_proj)
_G, _H = f"{_D}.self_attention", f"{_L}.linear_attn"
_GDN_COMMON: dict[str, Row] = {
    f"{_G}.in_proj.layer_norm_weight": ((f"{_L}.input_layernorm.weight",), REPLICATED),
    f"{_G}.conv1d.weight": ((f"{_H}.conv1d.weight",), GDN_CONV),
    f"{_G}.dt_bias": ((f"{_H}.dt_bias",), COLUMN),
    f"{_G}.A_log": ((f"{_H}.A_log",), COLUMN),
    f"{_G}.out_norm.weight": ((f"{_H}.norm.weight",), REPLICATED),
    f"{_G}.out_proj.weight": ((f"{_H}.out_proj.weight",), ROW),
}
_GDN_QWEN3_NEXT: dict[str, Row] = {
    **_GDN_COMMON,
    f"{_G}.in_proj.weight": ((f"{_H}.in_proj_qkvz.weight", f"{_H}.in_proj_ba.weight"), GDN_IN_PROJ_GROUPED),
}
_GDN_QWEN3_5: dict[str, Row] = {
    **_GDN_COMMON,
    f"{_G}.in_proj.weight": (
        (f"{_H}.in_proj_qkv.weight", f"{_H}.in_proj_z.weight", f"{_H}.in_proj_b.weight", f"{_H}.in_proj_a.weight"),
        GDN_IN_PROJ_SPLIT,
    ),
}

# DeepSeek-V3 / GLM-4.5 multi-token prediction: MTP layer {mtp} is HF layer {layer} =
# num_hidden_layers + {mtp}; its decoder layer maps as a decoder layer of that index. Rows named
# after a main-model parameter are the HF copies of it each MTP layer holds (megatron shares them).
_MTP = "mtp.layers.{mtp}"
_DEEPSEEK_MTP: dict[str, Row] = {
    f"{_MTP}.enorm.weight": ((f"{_L}.enorm.weight",), REPLICATED),
    f"{_MTP}.hnorm.weight": ((f"{_L}.hnorm.weight",), REPLICATED),
    f"{_MTP}.eh_proj.weight": ((f"{_L}.eh_proj.weight",), COLUMN),
    f"{_MTP}.final_layernorm.weight": ((f"{_L}.shared_head.norm.weight",), REPLICATED),
    "embedding.word_embeddings.weight": ((f"{_L}.embed_tokens.weight",), VOCAB),
    "output_layer.weight": ((f"{_L}.shared_head.head.weight",), VOCAB),
}

# Qwen3-Next / Qwen3.5 multi-token prediction (the keys vLLM and SGLang load): one projection
# ``mtp.fc`` of [pre_fc_norm_embedding(embedding) ; pre_fc_norm_hidden(hidden)], the decoder layer
# ``mtp.layers.{mtp}.*`` (gated full attention), ``mtp.norm``; zero-centred norms like every
# other Qwen norm; the embedding and LM head are the main model's (no copies)
_QWEN_MTP: dict[str, Row] = {
    f"{_MTP}.enorm.weight": (("mtp.pre_fc_norm_embedding.weight",), REPLICATED),
    f"{_MTP}.hnorm.weight": (("mtp.pre_fc_norm_hidden.weight",), REPLICATED),
    f"{_MTP}.eh_proj.weight": (("mtp.fc.weight",), COLUMN),
    f"{_MTP}.final_layernorm.weight": (("mtp.norm.weight",), REPLICATED),
}
_QWEN_MTP_KW = dict(mtp=_QWEN_MTP, mtp_layer_prefix="mtp.layers.{mtp}")

_LM_HEAD: dict[str, Row] = {"output_layer.weight": (("lm_head.weight",), VOCAB)}

# The critic's hidden -> 1 head, named as in transformers' *ForTokenClassification.
_VALUE_HEAD: dict[str, Row] = {
    "output_layer.weight": (("score.weight",), REPLICATED),
    "output_layer.bias": (("score.bias",), REPLICATED),
}

_HEADS = dict(lm_head=_LM_HEAD, value_head=_VALUE_HEAD)

LLAMA = MappingTable(_GLOBALS, _ATTENTION, dense_mlp=_DENSE_MLP, **_HEADS)
QWEN2 = MappingTable(_GLOBALS, {**_ATTENTION, **_QKV_BIAS}, dense_mlp=_DENSE_MLP, **_HEADS)
QWEN3 = MappingTable(_GLOBALS, {**_ATTENTION, **_QK_NORM}, dense_mlp=_DENSE_MLP, **_HEADS)
QWEN2_MOE = MappingTable(
    _GLOBALS,
    {**_ATTENTION, **_QKV_BIAS},
    dense_mlp=_DENSE_MLP,  # decoder_sparse_step / mlp_only_layers mix dense layers in
    moe_mlp={**_QWEN_MOE, **_QWEN2_SHARED_EXPERT},
    **_HEADS,
)
QWEN3_MOE = MappingTable(
    _GLOBALS, {**_ATTENTION, **_QK_NORM}, dense_mlp=_DENSE_MLP, moe_mlp=_QWEN_MOE, **_HEADS
)
MIXTRAL = MappingTable(_GLOBALS, _ATTENTION, moe_mlp=_MIXTRAL_MOE, **_HEADS)
GLM4_MOE = MappingTable(
    _GLOBALS,
    _ATTENTION,
    dense_mlp=_DENSE_MLP,  # first_k_dense_replace
    moe_mlp=_SIGMOID_MOE,
    variants={"qkv_bias": _QKV_BIAS, "qk_norm": _QK_NORM},
    mtp=_DEEPSEEK_MTP,
    **_HEADS,
)
DEEPSEEK_V3 = MappingTable(
    _GLOBALS,
    _MLA,
    dense_mlp=_DENSE_MLP,  # first_k_dense_replace
    moe_mlp=_SIGMOID_MOE,
    variants={"q_lora": _MLA_Q_LORA, "q_full": _MLA_Q_FULL},
    mtp=_DEEPSEEK_MTP,
    **_HEADS,
)
QWEN3_NEXT = MappingTable(
    _GLOBALS,
    _GATED_ATTENTION,
    dense_mlp=_DENSE_MLP,  # decoder_sparse_step / mlp_only_layers
    moe_mlp={**_QWEN_MOE, **_QWEN2_SHARED_EXPERT},
    linear_attention=_GDN_QWEN3_NEXT,
    **_QWEN_MTP_KW,
    **_HEADS,
)
QWEN3_5 = MappingTable(_GLOBALS, _GATED_ATTENTION, dense_mlp=_DENSE_MLP, linear_attention=_GDN_QWEN3_5,
                       **_QWEN_MTP_KW, **_HEADS)
QWEN3_5_MOE = MappingTable(
    _GLOBALS,
    _GATED_ATTENTION,
    moe_mlp={**_QWEN_MOE, **_QWEN2_SHARED_EXPERT},
    linear_attention=_GDN_QWEN3_5,
    **_QWEN_MTP_KW,
    **_HEADS,
)

# gpt-oss: biases on q/k/v and o_proj, a learnable sink logit per head (megatron's
# softmax_offset, split over TP with the heads), a router with a bias, experts with biases. Its
# checkpoints store experts fused (models/expert_layouts.py ``gpt_oss``); these per-expert names
# are the view hf_layout.FusedExperts gives of them, and exports fuse them back.
_X = f"{_L}.mlp.experts.{{expert}}"
_GPT_OSS_ATTENTION: dict[str, Row] = {
    **_ATTENTION,
    **_QKV_BIAS,
    f"{_D}.self_attention.linear_proj.bias": ((f"{_L}.self_attn.o_proj.bias",), REPLICATED),
    f"{_D}.self_attention.core_attention.softmax_offset": ((f"{_L}.self_attn.sinks",), COLUMN),
}
_GPT_OSS_MOE: dict[str, Row] = {
    f"{_D}.pre_mlp_layernorm.weight": ((f"{_L}.post_attention_layernorm.weight",), REPLICATED),
    f"{_D}.mlp.router.weight": ((f"{_L}.mlp.router.weight",), REPLICATED),
    f"{_D}.mlp.router.bias": ((f"{_L}.mlp.router.bias",), REPLICATED),
    f"{_E}.linear_fc1.weight": ((f"{_X}.gate_proj.weight", f"{_X}.up_proj.weight"), EXPERT_GATE_UP),
    f"{_E}.linear_fc1.bias": ((f"{_X}.gate_proj.bias", f"{_X}.up_proj.bias"), EXPERT_GATE_UP),
    f"{_E}.linear_fc2.weight": ((f"{_X}.down_proj.weight",), EXPERT_ROW),
    f"{_E}.linear_fc2.bias": ((f"{_X}.down_proj.bias",), EXPERT_REPLICATED),
}
GPT_OSS = MappingTable(_GLOBALS, _GPT_OSS_ATTENTION, moe_mlp=_GPT_OSS_MOE, **_HEADS)
