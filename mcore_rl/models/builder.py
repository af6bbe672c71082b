"""Builds actor/critic megatron-core GPTModels (one chunk per virtual pipeline stage) from ModelArgs."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.fusions import fused_bias_geglu
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from mcore_rl.models.hf_config import ConfigError, ModelArgs
from mcore_rl.models.hf_weights import weight_map
from mcore_rl.models.hybrid import check_hybrid_layout, hybrid_config_kwargs
from mcore_rl.models.layers import ValueHead
from mcore_rl.lora.build import attach_adapters, keep_input_grad
from mcore_rl.lora.config import LoraConfig
from mcore_rl.models.mla import mla_config_kwargs
from mcore_rl.models.model_types import Role, padded_vocab_size
from mcore_rl.models.moe import MoEOptions, moe_config_kwargs
from mcore_rl.models.mtp import finish_mtp_model, mtp_spec_of
from mcore_rl.models.mtp_model import MtpGPTModel
from mcore_rl.models.padding_idx import PadEmbeddingGrad, hold_pad_row
from mcore_rl.models.rope import inv_freq, yarn_config_attributes
from mcore_rl.models.specs import block_spec
from mcore_rl.parallel.layout import LayoutError, ParallelLayout
from mcore_rl.platform import Platform


# megatron activation functions by the names GluArgs uses, read when a config is built (on the
# CPU the platform fix quick_gelu_eager_on_cpu puts megatron's function there uncompiled)
ACTIVATIONS = {"silu": lambda: F.silu, "quick_gelu": lambda: fused_bias_geglu.quick_gelu}


@dataclass(frozen=True)
class BuildOptions:
    """Numerics and memory options. recompute: None, 'full' (whole layers) or 'selective'.
    hidden_dropout: dropout after attention and MLP (megatron's hidden_dropout; HF checkpoints of
    the supported architectures have none, so 0 unless a trainer wants it).
    pad_embedding_grad: 'transformers' (default) gives the pad token's embedding row
    (``ModelArgs.pad_token_id``) no gradient through the lookup, as transformers'
    ``nn.Embedding(padding_idx=pad_token_id)``; a tied output projection still trains it.
    'megatron' trains it through the lookup too (megatron-core has no padding_idx)."""

    params_dtype: torch.dtype = torch.float32
    hidden_dropout: float = 0.0
    recompute: Literal["full", "selective"] | None = None
    recompute_num_layers: int = 1
    max_seq_len: int | None = None
    moe: MoEOptions = MoEOptions()
    # parameters on torch's meta device (shapes only, no memory): a converter's target layout
    meta_device: bool = False
    pad_embedding_grad: PadEmbeddingGrad = "transformers"
    # LoRA adapters on a frozen base (rank 0: off); lora/config.py
    lora: LoraConfig = LoraConfig()


def check_divisibility(args: ModelArgs, layout: ParallelLayout) -> None:
    """Errors for model sizes the layout cannot split, each naming the values and the fix."""
    tp, pp, vpp = layout.tp, layout.pp, layout.vpp or 1
    check_attention_split(args, tp, gated=args.hybrid is not None)
    if args.hybrid is not None:
        check_hybrid_layout(args.hybrid, tp, layout.cp)
    checks = []
    if args.moe is None or not all(args.moe.moe_layers):  # dense MLP layers exist
        checks.append((args.ffn_hidden_size, "intermediate_size"))
    for value, name in checks:
        if value % tp != 0:
            raise LayoutError(
                f"tp({tp}) does not divide {name}({value}); choose tp among the divisors of {value}."
            )
    if args.moe is not None:
        _check_moe_divisibility(args, layout)
    if args.num_layers % (pp * vpp) != 0:
        raise LayoutError(
            f"num_hidden_layers({args.num_layers}) is not divisible by pp({pp}) * vpp({vpp}) = "
            f"{pp * vpp}; choose pp and vpp whose product divides the layer count."
        )


def check_attention_split(args: ModelArgs, tp: int, gated: bool = False) -> None:
    """Attention heads over TP as megatron-core splits them: query heads evenly, and either the
    KV heads evenly (tp divides them) or each KV head shared by tp / kv_heads ranks (megatron
    all-gathers the interleaved qkv and slices its group when num_query_groups < tp).

    ``gated``: megatron's ``attention_output_gate`` (Qwen3-Next, Qwen3.5): each KV head's fused
    rows are [query heads | gate heads | k | v], (2 * heads / kv_heads + 2) * head_dim of them."""
    heads, kv = args.num_heads, args.num_kv_heads
    fix = (
        f"choose tp among the divisors of {heads} that are multiples or divisors of "
        f"num_key_value_heads({kv})"
    )
    if heads % tp != 0 or (kv % tp != 0 and tp % kv != 0):
        raise LayoutError(
            f"tp({tp}) cannot split num_attention_heads({heads}) with num_key_value_heads({kv}): "
            f"tp must divide the query heads and either divide or be a multiple of the KV heads; "
            f"{fix}."
        )
    # ranks sharing a KV head each hold an equal, contiguous part of its [q..., (gate...,) k, v] rows
    ranks_per_group = max(tp // kv, 1)
    factor = 2 if gated else 1
    group_rows = (factor * heads // kv + 2) * args.head_dim
    if group_rows % ranks_per_group != 0:
        what = "fused qkv and output-gate rows" if gated else "fused qkv rows"
        count = "2 * num_attention_heads" if gated else "num_attention_heads"
        raise LayoutError(
            f"tp({tp}) splits each KV head's {what} ({group_rows} = ({count}({heads}) / "
            f"num_key_value_heads({kv}) + 2) * head_dim({args.head_dim})) over "
            f"{ranks_per_group} ranks unevenly; {fix} with tp / num_key_value_heads dividing "
            f"{group_rows}."
        )


def _check_moe_divisibility(args: ModelArgs, layout: ParallelLayout) -> None:
    moe, ep, etp = args.moe, layout.ep, layout.expert_tp
    if layout.tp > 1 and not layout.sequence_parallel:
        raise LayoutError(
            f"MoE models with tp({layout.tp}) need sequence_parallel=True (megatron-core refuses "
            "to train MoE under TP without it); set sequence_parallel=True."
        )
    if moe.num_experts % ep != 0:
        raise LayoutError(
            f"ep({ep}) does not divide num_experts({moe.num_experts}); choose ep among the "
            f"divisors of {moe.num_experts}."
        )
    if moe.ffn_hidden_size % etp != 0:
        raise LayoutError(
            f"etp({etp}) does not divide the expert ffn size ({moe.ffn_hidden_size}); choose "
            "another etp."
        )
    if args.linear_bias and etp > 1:
        raise LayoutError(
            f"etp({etp}) > 1 with {args.arch.model_type}'s expert biases: megatron-core's experts with biases "
            "need expert-tensor-parallel size 1; set etp=1 (each expert whole on its rank; "
            f"tp({layout.tp}) still splits attention, ep splits the experts).")
    if moe.shared_expert_ffn and moe.shared_expert_ffn % layout.tp != 0:
        raise LayoutError(
            f"tp({layout.tp}) does not divide shared_expert_intermediate_size"
            f"({moe.shared_expert_ffn}); choose another tp."
        )


def transformer_config(
    args: ModelArgs, layout: ParallelLayout, options: BuildOptions, platform: Platform, mtp_layers: int = 0
) -> TransformerConfig:
    """megatron TransformerConfig for ``args`` under ``layout``; ``mtp_layers``: the
    multi-token-prediction layers the model is built with (models/mtp.py)."""
    check_divisibility(args, layout)
    recompute = {}
    if options.recompute == "full":
        recompute = dict(
            recompute_granularity="full",
            recompute_method="uniform",
            recompute_num_layers=options.recompute_num_layers,
        )
    elif options.recompute == "selective":
        recompute = dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    elif options.recompute is not None:
        raise ConfigError(f"recompute={options.recompute!r}; use None, 'full' or 'selective'.")
    dtype = options.params_dtype
    moe = moe_config_kwargs(args.moe, options.moe) if args.moe else {}
    config_class, mla = TransformerConfig, {}
    if args.mla is not None:
        config_class = MLATransformerConfig
        mla = mla_config_kwargs(args.mla, args.rope, args.max_position_embeddings)
    hybrid = hybrid_config_kwargs(args.hybrid) if args.hybrid else {}
    config = config_class(
        **window_config_kwargs(args),
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_heads,
        num_query_groups=args.num_kv_heads,
        kv_channels=args.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=args.norm_eps,
        gated_linear_unit=True,
        activation_func=ACTIVATIONS[args.glu.activation](),
        glu_linear_offset=args.glu.linear_offset,
        activation_func_clamp_value=args.glu.clamp,
        add_bias_linear=args.linear_bias,
        add_qkv_bias=args.qkv_bias,
        qk_layernorm=args.qk_norm,
        hidden_dropout=options.hidden_dropout,
        attention_dropout=args.attention_dropout,
        init_method_std=args.init_std,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        sequence_parallel=layout.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # fixed micro-batch shapes: dynamic batching pads its pieces to one shape instead, since
        # megatron's shape exchange (variable_seq_lengths) hangs the interleaved schedule on gloo
        variable_seq_lengths=False,
        # gloo matches messages between two ranks in posting order; megatron's batched p2p posts
        # "to next" and "to previous" in an order that swaps them when PP=2 (one peer), so on
        # CPU use its per-op p2p, which orders sends and receives by rank parity
        batch_p2p_comm=not platform.on_cpu,
        moe_token_dispatcher_type=options.moe.dispatcher,
        use_cpu_initialization=platform.on_cpu,
        # a meta model has no values to set; megatron's init on meta tensors would only import
        # torch's compiler (torch._refs' normal_ goes through dynamo's disable wrapper)
        perform_initialization=not options.meta_device,
        # also required for correctness: megatron's fused GLU clamps before it adds the fc1 bias
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        mtp_num_layers=mtp_layers or None,
        **recompute,
        **moe,
        **mla,
        **hybrid,
    )
    if args.mla is None and args.rope.rope_type == "yarn":
        # megatron's attention scales cos/sin by the factor these attributes give (the
        # frequencies are ours: _build_chunk sets inv_freq)
        for name, value in yarn_config_attributes(args.rope).items():
            setattr(config, name, value)
    return config


def window_config_kwargs(args: ModelArgs) -> dict:
    """megatron's window (``window_size=(W - 1, 0)``, megatron's per-layer list form of
    ``window_attn_skip_freq``: 1 = windowed) and sink switches for ``args``."""
    kwargs = {"softmax_type": "learnable"} if args.attention_sinks else {}
    if args.window is not None:
        kwargs.update(window_size=(args.window - 1, 0), window_attn_skip_freq=[int(w) for w in args.window_layers])
    return kwargs


def _build_chunk(
    args: ModelArgs, config: TransformerConfig, role: Role, platform: Platform, vp_stage: int | None,
    device: torch.device, lora: bool = False,
) -> GPTModel:
    pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    # windows and sinks: the CPU core attention on GPU too (TE's windows with a padding mask and
    # its learnable softmax are not verified here)
    local_attention = args.window is not None or args.attention_sinks
    spec = block_spec(
        config,
        args.qk_norm,
        platform.transformer_engine and not local_attention,
        vp_stage,
        args.moe.moe_layers if args.moe else None,
        mla=args.mla is not None,
        lora=lora,
        linear_layers=args.hybrid.linear_layers if args.hybrid else None,
    )
    mtp = mtp_spec_of(args, config, platform.transformer_engine, lora) if post else None
    model = (MtpGPTModel if mtp is not None else GPTModel)(
        config=config,
        transformer_layer_spec=spec,
        mtp_block_spec=mtp,
        vocab_size=padded_vocab_size(args.vocab_size, config.tensor_model_parallel_size),
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre,
        post_process=post,
        parallel_output=True,
        share_embeddings_and_output_weights=args.tie_embeddings and role == "actor",
        position_embedding_type="rope",
        rotary_base=int(args.rope.theta),
        rotary_percent=args.rope.partial,
        vp_stage=vp_stage,
    )
    # megatron hard-codes parts of llama3 scaling; our frequencies honour the whole HF config
    # (MLA layers own their rotary embedding, megatron's default or YaRN: models/mla.py)
    if args.mla is None:
        model.rotary_pos_emb.inv_freq = inv_freq(args.rope).to(device)
    if post and role == "critic":
        model.output_layer = ValueHead(config, args.hidden_size, bias=args.value_head_bias)
    if mtp is not None:
        finish_mtp_model(model, args.vocab_size)
    return model


def build_model(
    args: ModelArgs,
    layout: ParallelLayout,
    role: Role,
    platform: Platform,
    options: BuildOptions = BuildOptions(),
) -> list[GPTModel]:
    """Model chunks of this rank, one per virtual pipeline stage (one without VPP).

    Megatron's parallel state must already be initialized for ``layout``.
    """
    if role not in ("actor", "critic"):
        raise ConfigError(f"role={role!r}; use 'actor' or 'critic'.")
    config = transformer_config(args, layout, options, platform, args.mtp_built if role == "actor" else 0)
    stages = range(layout.vpp) if layout.vpp else [None]
    device = torch.device("meta") if options.meta_device else platform.device()
    with torch.device("meta") if options.meta_device else contextlib.nullcontext():
        chunks = [_build_chunk(args, config, role, platform, vp, device, options.lora.enabled) for vp in stages]
    hold_pad_row(chunks, args.pad_token_id, options.pad_embedding_grad)
    if options.lora.enabled:
        _add_adapters(chunks, args, layout, role, options)
    if options.moe.freeze_router:
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if name.endswith("mlp.router.weight") or name.endswith("mlp.router.bias"):
                    param.requires_grad_(False)
    if options.meta_device:
        return [_to_meta(chunk) for chunk in chunks]
    return [chunk.to(device) for chunk in chunks]


def _add_adapters(chunks: list[GPTModel], args: ModelArgs, layout: ParallelLayout, role: Role,
                  options: BuildOptions) -> None:
    """LoRA adapters on the targeted linears; every base parameter frozen except a critic's
    value head (new, so trained in full: peft's ``modules_to_save=['score']``)."""
    if options.meta_device:
        raise ConfigError("lora with meta_device=True: a converter's target model has no adapters; "
                          "build without lora.")
    attach_adapters(chunks, options.lora, weight_map(args, role, layout.tp), options.params_dtype)
    if role == "critic":
        for chunk in chunks:
            for name, param in chunk.named_parameters():
                if name.startswith("output_layer."):
                    param.requires_grad_(True)
    keep_input_grad(chunks)


def _to_meta(chunk: GPTModel) -> GPTModel:
    """Moves what megatron still made on the host (norms take an explicit device) to meta:
    ``Module.to('meta')`` keeps the parameter objects, which views and tied weights rely on."""
    return chunk.to("meta")
