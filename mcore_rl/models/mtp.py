"""Multi-token-prediction (MTP) layers of DeepSeek-V3 / GLM-4.5 / Qwen3-Next / Qwen3.5 checkpoints
on megatron-core's ``MultiTokenPredictionBlock``: how many a checkpoint has, the switches a
trainer sets (``MtpConfig``, verl's ``model.mtp.*`` names), and the block spec the builder places
on the last pipeline stage. The forward that runs them on request is ``models/mtp_model.py``.

HF layout (DeepSeek-V3 and GLM-4.5): MTP layer i is HF layer ``num_hidden_layers + i`` with
``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, a full decoder layer, and copies of the
word embedding (``embed_tokens``) and LM head (``shared_head.head``) that megatron shares with
the main model. Qwen3-Next / Qwen3.5 (the keys vLLM and SGLang load): ``mtp.fc`` over
[``mtp.pre_fc_norm_embedding``(embedding) ; ``mtp.pre_fc_norm_hidden``(hidden)], a gated
full-attention decoder layer ``mtp.layers.{i}.*`` and ``mtp.norm``, one fc/norm set for all MTP
layers (so at most one here); no copies. Mapping: ``mapping/mtp.py``, ``mapping/mtp_names.py``.
"""
from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any, Iterable

from mcore_rl.errors import McoreRLError
from mcore_rl.mapping.mtp_names import DEFAULT_PREFIX, mtp_layer_prefix, mtp_layers_in

# megatron-core is imported inside the functions that build: hf_config (the converters'
# start-up) reads MtpConfig and the count without it

class MtpConfigError(McoreRLError, ValueError):
    """MTP switches or an MTP layer count that cannot be honoured; the message names the value."""


@dataclass(frozen=True)
class MtpConfig:
    """The MTP switches, named as verl 0.9.1's ``actor_rollout_ref.model.mtp.*``.

    enable: build the checkpoint's MTP layers (loaded, checkpointed, exported, not run).
    enable_train: run them in the training forward and add megatron's MTP loss
        (``mtp_loss_scaling_factor`` / depth count times each depth's mean cross-entropy).
    detach_encoder: the MTP loss trains the MTP layers and the output head only (the trunk's
        hidden states and the token embeddings enter the MTP layers detached), as verl's.
    enable_rollout: speculative decoding in the rollout engine, the engine's business: mcore_rl
        only sends it the MTP weights (kept for verl's config shape).
    """

    enable: bool = True
    enable_train: bool = False
    enable_rollout: bool = False
    detach_encoder: bool = False
    mtp_loss_scaling_factor: float = 0.1

    def __post_init__(self) -> None:
        for name in ("enable", "enable_train", "enable_rollout", "detach_encoder"):
            if not isinstance(getattr(self, name), bool):
                raise MtpConfigError(f"mtp.{name}={getattr(self, name)!r} must be true or false.")
        scale = self.mtp_loss_scaling_factor
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale >= 0:
            raise MtpConfigError(f"mtp.mtp_loss_scaling_factor={scale!r} must be a number >= 0 (verl's default 0.1).")
        if self.enable_train and not self.enable:
            raise MtpConfigError("mtp.enable_train=true with mtp.enable=false: training the MTP layers needs them "
                                 "built; set mtp.enable=true.")
        if self.enable_rollout and not self.enable:
            raise MtpConfigError("mtp.enable_rollout=true with mtp.enable=false: the rollout engine's speculative "
                                 "decoding needs the MTP weights, which the weight sync sends only when the layers "
                                 "are built; set mtp.enable=true.")


def resolve_mtp_layers(declared: int | None, keys: Iterable[str] | None, num_layers: int, field: str,
                       where: str, prefix: str = DEFAULT_PREFIX) -> int:
    """The MTP layer count: the config's ``field`` (``declared``), else the MTP layers (HF
    decoder-layer ``prefix``, ``MappingTable.mtp_layer_prefix``) in ``keys``; a disagreement
    between the two is refused. A config that declares layers a checkpoint does not hold at all
    (transformers' save_pretrained drops them) counts 0, with a log line. ``keys`` None: only the
    config is known."""
    if declared is not None and (isinstance(declared, bool) or not isinstance(declared, int) or declared < 0):
        raise MtpConfigError(f"{where}: {field}={declared!r} must be an integer >= 0; fix config.json.")
    if keys is None:
        return declared or 0
    return _count_from_keys(declared, set(keys), num_layers, field, where, prefix)


def check_buildable(count: int, shared: bool, model_type: str, field: str | None) -> None:
    """Refuses building ``count`` MTP layers that share one projection and norm set (``shared``,
    ``MappingTable.mtp_shared``: Qwen's ``mtp.fc`` / ``mtp.pre_fc_norm_*`` / ``mtp.norm``) when
    there are several: megatron-core gives each MTP layer its own."""
    if shared and count > 1:
        raise MtpConfigError(
            f"model_type {model_type!r}: the checkpoint has {count} multi-token-prediction layers ({field}) that "
            "share one projection and norm set (mtp.fc, mtp.pre_fc_norm_*, mtp.norm); megatron-core gives each MTP "
            "layer its own, so mcore_rl builds one at most: build without them (mtp.enable=false, "
            "ModelArgs.with_mtp(False)) or use a checkpoint with one MTP layer.")


def _count_from_keys(declared: int | None, keys: set[str], num_layers: int, field: str, where: str,
                     prefix: str) -> int:
    depths = mtp_layers_in(keys, num_layers, prefix)
    names = ", ".join(f"{mtp_layer_prefix(prefix, num_layers, d)}.*" for d in depths)
    if depths and depths != list(range(len(depths))):
        raise MtpConfigError(f"{where}: the checkpoint's multi-token-prediction layers are [{names}] (after "
                             f"num_hidden_layers={num_layers}), not consecutive from "
                             f"{mtp_layer_prefix(prefix, num_layers, 0)}.*; the checkpoint does not match its config.")
    if declared is None:
        return len(depths)
    if depths and len(depths) != declared:
        raise MtpConfigError(f"{where}: {field}={declared} but the checkpoint holds {len(depths)} multi-token-"
                             f"prediction layers [{names}]; set {field} to "
                             f"{len(depths)} in config.json or use the checkpoint that matches it.")
    if declared and not depths:
        logging.getLogger("mcore_rl").warning(
            "%s: %s=%d but the checkpoint holds no multi-token-prediction tensors (%s.*): "
            "built without MTP layers", where, field, declared, mtp_layer_prefix(prefix, num_layers, 0))
        return 0
    return declared


def mtp_block_spec(layer_spec: Any, count: int, use_te: bool) -> Any:
    """``count`` MTP layers whose transformer layer is ``layer_spec`` (the decoder layer kind of
    HF layer num_hidden_layers); norms and projection as the decoder's own spec places them."""
    # megatron's MTP layer refuses padding_causal by name; our core attention always applies the
    # causal and the key-padding mask, so 'causal' builds the same computation (TE: restored by
    # finish_mtp_model after the build)
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    layer_spec = copy.deepcopy(layer_spec)
    layer_spec.submodules.self_attention.params["attn_mask_type"] = AttnMaskType.causal
    if use_te:
        from megatron.core.extensions.transformer_engine import TEColumnParallelLinear, TENorm

        norm, linear = TENorm, TEColumnParallelLinear
    else:
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear

        from mcore_rl.models.layers import RMSNorm

        norm, linear = RMSNorm, ColumnParallelLinear
    layer = ModuleSpec(
        module=MultiTokenPredictionLayer,
        submodules=MultiTokenPredictionLayerSubmodules(
            enorm=norm, hnorm=norm, eh_proj=linear, transformer_layer=layer_spec, layer_norm=norm),
    )
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * count)


def finish_mtp_model(model: Any, vocab_size: int) -> None:
    """After the build: the MTP layers' attention back to padding_causal (see
    ``mtp_block_spec``) and the real vocabulary size the MTP loss softmaxes over."""
    from megatron.core.transformer.enums import AttnMaskType

    model.real_vocab_size = vocab_size
    for module in model.mtp.modules():
        if hasattr(module, "attn_mask_type") and module.attn_mask_type == AttnMaskType.causal:
            module.attn_mask_type = AttnMaskType.padding_causal


def mtp_spec_of(args: Any, config: Any, use_te: bool, lora: bool) -> Any:
    """The MTP block spec of a last-stage chunk of ``args`` (ModelArgs) under ``config`` (a
    TransformerConfig whose ``mtp_num_layers`` says how many; None: no block). The MTP layer is
    of the kind HF gives layer num_hidden_layers: MoE where the last decoder layer is; in a hybrid
    model a gated full-attention layer (on GPU too, as its decoder layers: the local spec with
    zero-centred norms), whatever kind the last decoder layer is."""
    if not config.mtp_num_layers:
        return None
    if lora:
        raise MtpConfigError(f"LoRA adapters on a model built with {config.mtp_num_layers} multi-token-prediction "
                             "layers are not supported; build without them (mtp.enable=false, "
                             "ModelArgs.with_mtp(False)).")
    from mcore_rl.models.specs import local_layer_spec, te_layer_spec

    moe = bool(args.moe is not None and args.moe.moe_layers[-1])
    mla = args.mla is not None
    if args.hybrid is not None:  # Qwen3-Next / Qwen3.5: a gated full-attention layer, local spec
        return mtp_block_spec(local_layer_spec(True, moe), config.mtp_num_layers, use_te=False)
    if use_te:
        layer = te_layer_spec(args.qk_norm, config.num_moe_experts if moe else None, mla)
    else:
        layer = local_layer_spec(args.qk_norm, moe, mla)
    return mtp_block_spec(layer, config.mtp_num_layers, use_te)


def record_mtp_count(config_path: str, args: Any, built: int) -> None:
    """The copied ``config.json`` of a checkpoint states the MTP layers the checkpoint holds
    (``built``), so that whoever reads the directory back builds the same model: a config that
    declared layers its weights lacked (transformers' save_pretrained drops them) says 0, one that
    was silent says how many were counted. Other architectures: unchanged."""
    import json

    field = args.arch.mtp_layers_field
    if not field:
        return
    with open(config_path) as f:
        config = json.load(f)
    if config.get(field, 0) == built:
        return
    config[field] = built
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
