"""The one architecture registry: HF ``model_type`` -> what differs between architectures, as data."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore_rl.mapping.tables import (
    DEEPSEEK_V3, GLM4_MOE, GPT_OSS, LLAMA, MIXTRAL, QWEN2, QWEN2_MOE, QWEN3, QWEN3_5, QWEN3_5_MOE, QWEN3_MOE, QWEN3_NEXT,
    MappingTable,
)
from mcore_rl.models.moe import MoEFields
from mcore_rl.models.rope import SUPPORTED_ROPE_TYPES, WITH_YARN
from mcore_rl.models.windows import WindowRule
from mcore_rl.errors import McoreRLError


class UnknownArchitectureError(McoreRLError, ValueError):
    """A HF model_type with no registry entry."""


@dataclass(frozen=True)
class GluFields:
    """The gated MLP's activation: ``act(clamp(gate)) * (clamp(up) + linear_offset)`` with
    megatron's ``activation_func`` named by ``activation`` (silu, or quick_gelu = x * sigmoid(1.702 x)),
    the clamp read from the config field ``clamp_field`` (None: no clamp) and the sigmoid gain
    from ``alpha_field`` (megatron hard-codes 1.702 for quick_gelu: another value is refused)."""

    activation: Literal["silu", "quick_gelu"] = "silu"
    linear_offset: float = 0.0
    clamp_field: str | None = None
    alpha_field: str | None = None


@dataclass(frozen=True)
class ArchSpec:
    """Per-architecture facts: HF classes, weight table and the switches the builder reads."""

    model_type: str
    hf_causal_lm: str
    hf_token_classification: str
    table: MappingTable
    qkv_bias: bool = False
    qk_norm: bool = False
    # where the config switches them per checkpoint (GLM-4.5: attention_bias, use_qk_norm)
    qkv_bias_field: str | None = None
    qk_norm_field: str | None = None
    # which layers HF applies `sliding_window` to (models/windows.py WINDOW_RULES); None: the
    # architecture has no window (an active one is refused)
    window_rule: WindowRule | None = None
    # gpt-oss: a learnable sink logit per attention head (megatron softmax_type="learnable")
    attention_sinks: bool = False
    moe: MoEFields | None = None  # None: dense
    attention: Literal["gqa", "mla"] = "gqa"  # mla: DeepSeek's multi-latent attention
    mtp_layers_field: str | None = None  # config field counting multi-token-prediction layers
    # Qwen3-Next / Qwen3.5: Gated DeltaNet layers mixed with gated full attention (layer_types),
    # zero-centred RMSNorms (x * (1 + w)); models/hybrid.py
    hybrid: bool = False
    # the config field transformers passes as the word embedding's padding_idx
    # (nn.Embedding(vocab, hidden, padding_idx=config.<field>): that token's row gets no gradient
    # through the lookup); None: its embedding has no padding_idx. All nine architectures below
    # read pad_token_id (checked in transformers 5.10 and 5.24).
    pad_row_field: str | None = "pad_token_id"
    # the rope types the config may name (models/rope.py; YaRN only where checked against HF)
    rope_types: tuple[str, ...] = SUPPORTED_ROPE_TYPES
    # every linear has a bias (q/k/v, o_proj, router, experts: megatron's add_bias_linear); the
    # config flag ``linear_bias_field`` must then be true (gpt-oss: attention_bias)
    linear_bias: bool = False
    linear_bias_field: str | None = None
    glu: GluFields = GluFields()
    # HF's fused expert tensors, when the architecture stores experts only that way (models/hf_layout.py)
    fused_experts: str | None = None


# Qwen3-Next / Qwen3.5-MoE: softmax router, a shared expert scaled by sigmoid(gate(x))
QWEN_SHARED_GATED_MOE = MoEFields(shared_expert_ffn="shared_expert_intermediate_size", shared_expert_gate=True)

# DeepSeek-V3 and GLM-4.5 routers: sigmoid scores + correction bias, groups, scaled weights
SIGMOID_MOE = MoEFields(
    num_experts=("n_routed_experts",),
    sparse_step=None,
    mlp_only_layers=None,
    first_dense_layers="first_k_dense_replace",
    shared_expert_count="n_shared_experts",
    score_function="sigmoid",
    expert_bias=True,
    num_groups="n_group",
    group_topk="topk_group",
    scaling_factor="routed_scaling_factor",
)

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        # gpt-oss: biases on every linear, a top-k-then-softmax router with a bias, the clamped
        # SwiGLU (quick_gelu with +1 on the linear half), fused transposed interleaved experts
        ArchSpec(
            "gpt_oss",
            "GptOssForCausalLM",
            "GptOssForTokenClassification",
            GPT_OSS,
            moe=MoEFields(num_experts=("num_local_experts",), ffn_hidden_size="intermediate_size",
                          norm_topk_prob=None, sparse_step=None, mlp_only_layers=None),
            rope_types=WITH_YARN,
            linear_bias=True,
            linear_bias_field="attention_bias",
            glu=GluFields("quick_gelu", linear_offset=1.0, clamp_field="swiglu_limit", alpha_field="swiglu_alpha"),
            fused_experts="gpt_oss",
            window_rule="layer_types",
            attention_sinks=True,
        ),
        ArchSpec("llama", "LlamaForCausalLM", "LlamaForTokenClassification", LLAMA),
        ArchSpec(
            "mistral",
            "MistralForCausalLM",
            "MistralForTokenClassification",
            LLAMA,
            window_rule="all",
        ),
        ArchSpec("qwen2", "Qwen2ForCausalLM", "Qwen2ForTokenClassification", QWEN2, qkv_bias=True,
                 window_rule="use_sliding_window"),
        ArchSpec("qwen3", "Qwen3ForCausalLM", "Qwen3ForTokenClassification", QWEN3, qk_norm=True,
                 window_rule="use_sliding_window"),
        ArchSpec(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            "Qwen2MoeForTokenClassification",
            QWEN2_MOE,
            qkv_bias=True,
            moe=MoEFields(shared_expert_ffn="shared_expert_intermediate_size", shared_expert_gate=True),
        ),
        ArchSpec(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "Qwen3MoeForTokenClassification",
            QWEN3_MOE,
            qk_norm=True,
            window_rule="use_sliding_window_all",
            moe=MoEFields(),
        ),
        ArchSpec(
            "mixtral",
            "MixtralForCausalLM",
            "MixtralForTokenClassification",
            MIXTRAL,
            window_rule="all",
            moe=MoEFields(
                ffn_hidden_size="intermediate_size",
                norm_topk_prob=None,
                sparse_step=None,
                mlp_only_layers=None,
            ),
        ),
        ArchSpec(
            "glm4_moe",
            "Glm4MoeForCausalLM",
            "Glm4MoeForTokenClassification",
            GLM4_MOE,
            qkv_bias_field="attention_bias",  # q/k/v only: GLM's o_proj never has a bias
            qk_norm_field="use_qk_norm",
            moe=SIGMOID_MOE,
            mtp_layers_field="num_nextn_predict_layers",
        ),
        # also Kimi-K2 and Moonlight checkpoints (model_type deepseek_v3)
        ArchSpec(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            "DeepseekV3ForTokenClassification",
            DEEPSEEK_V3,
            moe=SIGMOID_MOE,
            attention="mla",
            mtp_layers_field="num_nextn_predict_layers",
        ),
        ArchSpec(
            "qwen3_next",
            "Qwen3NextForCausalLM",
            "Qwen3NextForTokenClassification",
            QWEN3_NEXT,
            qk_norm=True,
            moe=QWEN_SHARED_GATED_MOE,
            hybrid=True,
            mtp_layers_field="mtp_num_hidden_layers",
        ),
        ArchSpec(
            "qwen3_5_text",
            "Qwen3_5ForCausalLM",
            "Qwen3_5ForTokenClassification",
            QWEN3_5,
            qk_norm=True,
            hybrid=True,
            mtp_layers_field="mtp_num_hidden_layers",
        ),
        ArchSpec(
            "qwen3_5_moe_text",
            "Qwen3_5MoeForCausalLM",
            "Qwen3_5MoeForTokenClassification",
            QWEN3_5_MOE,
            qk_norm=True,
            # every layer is sparse and top-k weights are always renormalised
            moe=MoEFields(shared_expert_ffn="shared_expert_intermediate_size", shared_expert_gate=True,
                          norm_topk_prob=None, sparse_step=None, mlp_only_layers=None),
            hybrid=True,
            mtp_layers_field="mtp_num_hidden_layers",
        ),
    )
}


@dataclass(frozen=True)
class WrapperSpec:
    """A published vision-language wrapper around a registered text architecture: its config
    holds the text model's config under ``text_config``; its safetensors hold the text model's
    tensors with ``model.`` renamed to ``hf_prefix`` (``lm_head.weight`` as is), a vision tower
    under ``vision`` and other tensors under ``carried`` that mcore_rl does not train: the
    converter carries them through untouched, ``load_hf`` ignores them by name."""

    model_type: str
    text_model_type: str
    hf_class: str  # the transformers class merge writes back
    hf_prefix: str = "model.language_model."
    vision: str = "model.visual."
    carried: tuple[str, ...] = ("model.visual.", "mtp.")  # mtp.*: MTP layers mcore_rl does not import here


WRAPPERS: dict[str, WrapperSpec] = {
    w.model_type: w
    for w in (
        WrapperSpec("qwen3_5", "qwen3_5_text", "Qwen3_5ForConditionalGeneration"),
        WrapperSpec("qwen3_5_moe", "qwen3_5_moe_text", "Qwen3_5MoeForConditionalGeneration"),
    )
}


# model_types that are another's checkpoints under a new name: Kimi-K2 is DeepSeek-V3's
# architecture (its release notes tell users to edit model_type to deepseek_v3 for other tools)
MODEL_TYPE_ALIASES: dict[str, str] = {"kimi_k2": "deepseek_v3"}


def lookup_arch(model_type: str) -> ArchSpec:
    """The registry entry for ``model_type`` (an alias: its architecture's); unknown types list
    the supported ones. A vision-language wrapper (``WRAPPERS``) gives its text architecture."""
    if model_type in WRAPPERS:
        return ARCHITECTURES[WRAPPERS[model_type].text_model_type]
    try:
        return ARCHITECTURES[MODEL_TYPE_ALIASES.get(model_type, model_type)]
    except KeyError:
        raise UnknownArchitectureError(
            f"unknown architecture model_type={model_type!r}; supported: "
            f"{', '.join(sorted([*ARCHITECTURES, *MODEL_TYPE_ALIASES, *WRAPPERS]))}. Add an ArchSpec to "
            "mcore_rl/models/registry.py "
            "to support another."
        ) from None
