"""Hybrid models (Qwen3-Next, Qwen3.5): Gated DeltaNet (GDN) linear-attention layers mixed with
gated full attention, as HF's ``layer_types`` lists them; facts from the config, checks against a
layout, and megatron-core's TransformerConfig fields.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_rl.errors import McoreRLError

LINEAR, FULL = "linear_attention", "full_attention"


class HybridConfigError(McoreRLError, ValueError):
    """A hybrid-model setting mcore_rl cannot build; the message names the value and the fix."""


@dataclass(frozen=True)
class HybridArgs:
    """``linear_layers[i]``: layer i is a GDN layer (else gated full attention); GDN sizes."""

    linear_layers: tuple[bool, ...]
    conv_kernel: int
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int


def _layer_types(cfg: Any, num_layers: int) -> list[Any]:
    """HF's layer_types, or the pattern transformers derives from ``full_attention_interval``."""
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return list(types)
    interval = getattr(cfg, "full_attention_interval", None) or 4
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        raise HybridConfigError(f"full_attention_interval={interval!r} must be an integer >= 1; fix config.json.")
    return [LINEAR if (i + 1) % interval else FULL for i in range(num_layers)]


def _size(cfg: Any, name: str) -> int:
    value = getattr(cfg, name, None)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HybridConfigError(f"config.json (model_type {cfg.model_type!r}): {name}={value!r} must be an "
                                "integer >= 1; fix the value in config.json.")
    return value


def hybrid_args_from_hf(cfg: Any, num_layers: int) -> HybridArgs:
    """The layer pattern and GDN sizes of a Qwen3-Next / Qwen3.5 config, checked."""
    types = _layer_types(cfg, num_layers)
    if len(types) != num_layers:
        raise HybridConfigError(f"layer_types has {len(types)} entries but num_hidden_layers={num_layers}; "
                                "give one entry per layer in config.json.")
    unknown = sorted({repr(t) for t in types if t not in (LINEAR, FULL)})
    if unknown:
        raise HybridConfigError(f"layer_types holds {', '.join(unknown)}; each entry must be {LINEAR!r} or {FULL!r}.")
    args = HybridArgs(
        linear_layers=tuple(t == LINEAR for t in types),
        conv_kernel=_size(cfg, "linear_conv_kernel_dim"),
        key_heads=_size(cfg, "linear_num_key_heads"),
        value_heads=_size(cfg, "linear_num_value_heads"),
        key_head_dim=_size(cfg, "linear_key_head_dim"),
        value_head_dim=_size(cfg, "linear_value_head_dim"),
    )
    if args.value_heads % args.key_heads:
        raise HybridConfigError(f"linear_num_value_heads={args.value_heads} is not a multiple of "
                                f"linear_num_key_heads={args.key_heads}; fix the values in config.json.")
    return args


def check_hybrid_layout(args: HybridArgs, tp: int, cp: int) -> None:
    """GDN heads over TP as megatron splits them (key and value heads evenly); no CP."""
    if not any(args.linear_layers):
        return
    if cp > 1:
        raise HybridConfigError(
            f"cp({cp}) with Gated DeltaNet layers (layer_types 'linear_attention'): their recurrent "
            "state would have to cross context-parallel ranks, which is not supported; set cp=1 (packed "
            "sequences keep long rows cheap: the GDN state restarts at every sequence boundary).")
    for name, heads in (("linear_num_key_heads", args.key_heads), ("linear_num_value_heads", args.value_heads)):
        if heads % tp:
            raise HybridConfigError(f"tp({tp}) does not divide {name}({heads}) of the Gated DeltaNet layers; "
                                    f"choose tp among the divisors of {heads}.")


def hybrid_config_kwargs(args: HybridArgs) -> dict:
    """megatron-core TransformerConfig fields of a hybrid model: GDN sizes, the layer pattern
    (1 = GDN), gated full attention and zero-centred norms (Qwen's x * (1 + w))."""
    return dict(
        experimental_attention_variant="gated_delta_net",
        linear_attention_freq=[int(x) for x in args.linear_layers],
        linear_conv_kernel_dim=args.conv_kernel,
        linear_key_head_dim=args.key_head_dim,
        linear_value_head_dim=args.value_head_dim,
        linear_num_key_heads=args.key_heads,
        linear_num_value_heads=args.value_heads,
        attention_output_gate=True,
        layernorm_zero_centered_gamma=True,
    )
