"""Layer specs: Transformer Engine modules on GPU, megatron's local modules + ours on CPU.

Both specs give the same dist-checkpoint keys (tests/data/te_sharded_keys.json), so a checkpoint
moves between CPU and GPU. Attention always runs with ``padding_causal``: the model is handed a
key-padding mask [b, 1, 1, s] (True = padding).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.post_training.modelopt.layers import Linear as ReplicatedLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.ssm.gated_delta_net import GatedDeltaNetSubmodules

from mcore_rl.models.gdn import PackedGatedDeltaNet
from mcore_rl.models.layers import PlainRMSNorm, RMSNorm, TorchCoreAttention
from mcore_rl.lora.layers import LoraColumnParallelLinear, LoraMLASelfAttention, LoraRowParallelLinear

# The local spec keeps norms as separate modules; TE fuses them into the next linear. These
# renames make the local spec's checkpoint keys the TE ones. TE's MoE layers keep a separate
# pre_mlp_layernorm, so MoE layers rename only the input norm (megatron's own local spec renames
# both even for MoE, which makes its MoE checkpoints differ from TE's).
DENSE_TO_TE_KEYS = {
    "input_layernorm.": "self_attention.linear_qkv.layer_norm_",
    "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_",
}
MOE_TO_TE_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
# MLA: TE fuses the q/kv norms into the up-projections; the input norm stays its own module
MLA_TO_TE_KEYS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}

@dataclass(frozen=True)
class Linears:
    """The linear classes a spec places: megatron's, or their LoRA-capable subclasses."""

    column: type = ColumnParallelLinear
    row: type = RowParallelLinear
    # MLA's replicated down-projections must be megatron's own class (it checks the exact type):
    # the LoRA attention class swaps in the LoRA-capable subclass after construction
    mla_attention: type = MLASelfAttention


LOCAL_LINEARS = Linears()
LORA_LINEARS = Linears(LoraColumnParallelLinear, LoraRowParallelLinear, LoraMLASelfAttention)


def _mlp(lin: Linears) -> MLPSubmodules:
    # a fresh object per use: dense MLP, shared experts and routed experts each have their own
    return MLPSubmodules(linear_fc1=lin.column, linear_fc2=lin.row)


def _local_moe(lin: Linears) -> ModuleSpec:
    return ModuleSpec(
        module=MoELayer,
        submodules=MoESubmodules(
            experts=ModuleSpec(module=SequentialMLP, submodules=_mlp(lin)),
            shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=_mlp(lin)),
        ),
    )


def _gqa_attention(qk_norm: bool, lin: Linears) -> ModuleSpec:
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.padding_causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=lin.column,
            core_attention=TorchCoreAttention,
            linear_proj=lin.row,
            q_layernorm=RMSNorm if qk_norm else IdentityOp,
            k_layernorm=RMSNorm if qk_norm else IdentityOp,
        ),
    )


# The down-projections are replicated over TP, as TE's 'duplicated' linears: megatron's MLA then
# all-gathers the shared rope key over SP with a reduce-scatter backward, where its TP-split
# (ColumnParallelLinear) branch drops the other ranks' gradient of that key (Megatron-LM #1699).
def _mla_attention(lin: Linears) -> ModuleSpec:
    return ModuleSpec(
        module=lin.mla_attention,
        params={"attn_mask_type": AttnMaskType.padding_causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=lin.column,
            linear_q_down_proj=ReplicatedLinear,
            linear_q_up_proj=lin.column,
            linear_kv_down_proj=ReplicatedLinear,
            linear_kv_up_proj=lin.column,
            core_attention=TorchCoreAttention,
            linear_proj=lin.row,
            q_layernorm=RMSNorm,
            kv_layernorm=RMSNorm,
        ),
    )


def local_layer_spec(qk_norm: bool, moe: bool = False, mla: bool = False,
                     lin: Linears = LOCAL_LINEARS) -> ModuleSpec:
    """CPU spec: megatron's TransformerLayer/SelfAttention (or MLASelfAttention)/MLP (or
    MoELayer with SequentialMLP experts) with our norm and core attention; ``lin``: the linear
    classes (LORA_LINEARS for a model with adapters)."""
    mlp = _local_moe(lin) if moe else ModuleSpec(module=MLP, submodules=_mlp(lin))
    if mla:
        keys = {**MLA_TO_TE_KEYS, **({} if moe else {"pre_mlp_layernorm.": DENSE_TO_TE_KEYS["pre_mlp_layernorm."]})}
    else:
        keys = MOE_TO_TE_KEYS if moe else DENSE_TO_TE_KEYS
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=_mla_attention(lin) if mla else _gqa_attention(qk_norm, lin),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=dict(keys),
        ),
    )


def gdn_layer_spec(moe: bool, lin: Linears = LOCAL_LINEARS) -> ModuleSpec:
    """A Gated DeltaNet layer of a hybrid model (models/gdn.py) with a dense or MoE MLP; its
    checkpoint keys are TE's (the input norm fused into in_proj). The output norm is plain
    (Qwen's one norm that is not zero-centred)."""
    keys = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
    if not moe:
        keys["pre_mlp_layernorm."] = DENSE_TO_TE_KEYS["pre_mlp_layernorm."]
    mixer = ModuleSpec(
        module=PackedGatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=lin.column, out_norm=PlainRMSNorm, out_proj=lin.row),
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=mixer,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=_local_moe(lin) if moe else ModuleSpec(module=MLP, submodules=_mlp(lin)),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys,
        ),
    )


def te_layer_spec(qk_norm: bool, num_experts: int | None = None, mla: bool = False) -> ModuleSpec:
    """GPU spec: megatron's Transformer Engine layer (grouped-GEMM experts for MoE layers),
    attention switched to padding_causal. MLA: qk_layernorm fuses its q/kv norms."""
    spec = copy.deepcopy(
        get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None,
            qk_layernorm=qk_norm or mla, multi_latent_attention=mla,
        )
    )
    spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.padding_causal
    return spec


def block_spec(
    config: TransformerConfig,
    qk_norm: bool,
    use_te: bool,
    vp_stage: int | None,
    moe_layers: tuple[bool, ...] | None = None,
    mla: bool = False,
    lora: bool = False,
    linear_layers: tuple[bool, ...] | None = None,
) -> TransformerBlockSubmodules:
    """The decoder block of one pipeline (virtual) stage: its layers and the final norm.

    ``moe_layers[i]`` (global layer index) selects an MoE layer; None means all dense.
    ``lora``: the local spec with LoRA-capable linears, on GPU too (the Transformer Engine spec
    fuses the layer norm into linear_qkv/linear_fc1, whose adapters would need the normed input,
    and runs grouped expert GEMMs; both specs have the same checkpoint keys).
    ``linear_layers[i]`` (a hybrid model): layer i is a Gated DeltaNet layer; hybrid models use
    the local spec on GPU too (megatron 0.16.1's hybrid spec needs TE and refuses packing).
    """
    if linear_layers is not None:
        return _hybrid_block_spec(config, vp_stage, moe_layers, linear_layers, lora)
    if use_te and not lora:
        from megatron.core.extensions.transformer_engine import TENorm

        dense, moe = te_layer_spec(qk_norm, mla=mla), te_layer_spec(qk_norm, config.num_moe_experts, mla)
        final_norm = TENorm
    else:
        lin = LORA_LINEARS if lora else LOCAL_LINEARS
        dense, moe = local_layer_spec(qk_norm, mla=mla, lin=lin), local_layer_spec(qk_norm, True, mla, lin)
        final_norm = RMSNorm
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    kinds = moe_layers or (False,) * config.num_layers
    layers = [moe if kinds[i] else dense for i in range(first, first + count)]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)


def _hybrid_block_spec(config: TransformerConfig, vp_stage: int | None, moe_layers: tuple[bool, ...] | None,
                       linear_layers: tuple[bool, ...], lora: bool) -> TransformerBlockSubmodules:
    lin = LORA_LINEARS if lora else LOCAL_LINEARS
    kinds = moe_layers or (False,) * config.num_layers
    first = get_transformer_layer_offset(config, vp_stage=vp_stage)
    count = get_num_layers_to_build(config, vp_stage=vp_stage)
    layers = [
        gdn_layer_spec(kinds[i], lin) if linear_layers[i] else local_layer_spec(True, kinds[i], lin=lin)
        for i in range(first, first + count)
    ]
    return TransformerBlockSubmodules(layer_specs=layers, layer_norm=RMSNorm)
