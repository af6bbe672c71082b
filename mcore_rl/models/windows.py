"""Sliding-window attention read from a HF config: the window and the layers it applies to.

HF's ``sliding_window`` W lets a query see the W most recent positions, itself included (megatron:
``window_size=(W - 1, 0)``). Which layers use it differs between architectures; each rule below
is what transformers 5.24 does for the architectures that name it in the registry:
- ``all``: every layer whenever ``sliding_window`` is set (Mistral, Mixtral);
- ``use_sliding_window``: only with ``use_sliding_window: true`` (transformers nulls the window
  otherwise), on the layers ``layer_types`` marks ``sliding_attention``, by default those from
  ``max_window_layers`` on (Qwen2, Qwen3);
- ``use_sliding_window_all``: only with ``use_sliding_window: true``, every layer (Qwen3-MoE);
- ``layer_types``: the ``sliding_attention`` layers, by default the even ones (gpt-oss).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Literal

from mcore_rl.errors import McoreRLError

WindowRule = Literal["all", "use_sliding_window", "use_sliding_window_all", "layer_types"]


class WindowConfigError(McoreRLError, ValueError):
    """A sliding-window setting mcore_rl cannot apply; the message names the value and the fix."""


@dataclass(frozen=True)
class _Rule:
    gated: bool  # applies only with use_sliding_window: true
    per_layer: bool  # reads layer_types (else every layer)
    default_layers: Callable[[Any, int], bool] = lambda cfg, i: True  # layer i without layer_types


WINDOW_RULES: dict[str, _Rule] = {
    "all": _Rule(gated=False, per_layer=False),
    "use_sliding_window": _Rule(gated=True, per_layer=True,
                                default_layers=lambda cfg, i: i >= getattr(cfg, "max_window_layers", 0)),
    "use_sliding_window_all": _Rule(gated=True, per_layer=False),
    "layer_types": _Rule(gated=False, per_layer=True, default_layers=lambda cfg, i: i % 2 == 0),
}


def window_from_hf(cfg: Any, rule: str | None, num_layers: int,
                   max_seq_len: int) -> tuple[int | None, tuple[bool, ...] | None]:
    """(window W, windowed layers) of a HF config under the architecture's ``rule``; (None,
    None) when no layer has a window or the window is at least ``max_seq_len`` (it never cuts:
    such a model keeps the Transformer Engine spec on GPU). An architecture without a rule
    refuses a window shorter than ``max_seq_len``."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if rule is None:
        used = window is not None and ("sliding_attention" in (layer_types or [])
                                       or getattr(cfg, "use_sliding_window", False))
        if used and window < max_seq_len:
            raise WindowConfigError(
                f"sliding_window={window} is shorter than the max sequence length {max_seq_len}, and "
                f"model_type {cfg.model_type!r} has no sliding-window rule in mcore_rl's registry; set "
                "max_seq_len <= sliding_window or sliding_window=null in config.json.")
        return None, None
    spec = WINDOW_RULES[rule]
    if window is None or (spec.gated and not getattr(cfg, "use_sliding_window", False)):
        return None, None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise WindowConfigError(f"sliding_window={window!r} must be an integer >= 1 (tokens a query sees, "
                                "itself included) or null; fix config.json.")
    if spec.per_layer and layer_types is not None:
        if len(layer_types) != num_layers:
            raise WindowConfigError(f"layer_types has {len(layer_types)} entries for num_hidden_layers={num_layers}; "
                                    "give one per layer in config.json.")
        bad = sorted({t for t in layer_types if t not in ("sliding_attention", "full_attention")})
        if bad:
            raise WindowConfigError(f"layer_types holds {bad}; model_type {cfg.model_type!r} takes "
                                    "'sliding_attention' and 'full_attention' only: fix config.json.")
        layers = tuple(t == "sliding_attention" for t in layer_types)
    elif spec.per_layer:
        layers = tuple(bool(spec.default_layers(cfg, i)) for i in range(num_layers))
    else:
        layers = (True,) * num_layers
    if not any(layers) or window >= max_seq_len:  # a window as long as any sequence cuts nothing
        return None, None
    return window, layers
