"""RoPE frequencies computed by mcore_rl, so every parameter of a HF rope config is honoured.

megatron-core 0.16.1's RotaryEmbedding hard-codes llama3's low/high frequency factors and original
context length; instead the builder overwrites the module's ``inv_freq`` with ``inv_freq(spec)``
(before the first forward, so megatron's per-length cache never holds stale values).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from mcore_rl.errors import McoreRLError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
MLA_ROPE_TYPES = ("default", "yarn")  # multi-latent attention: megatron's own rotary classes


class RopeError(McoreRLError, ValueError):
    """A rope configuration mcore_rl does not implement."""


@dataclass(frozen=True)
class YarnSpec:
    """HF's YaRN parameters (beta_fast / beta_slow: HF's defaults for unset or 0 values)."""

    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters (HF ``rope_parameters`` / ``rope_scaling``)."""

    rope_type: str
    theta: float
    dim: int  # rotary dims of a head: head_dim * partial
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial: float = 1.0  # the first dim of each head's head_dim rotate, the rest pass through
    yarn: YarnSpec | None = None


def rope_spec_from_hf(cfg: Any, head_dim: int, supported: tuple[str, ...] = SUPPORTED_ROPE_TYPES) -> RopeSpec:
    """Reads transformers 5 ``rope_parameters`` (or legacy ``rope_scaling``/``rope_theta``);
    ``supported``: the rope types the attention implements (MLA: ``MLA_ROPE_TYPES``)."""
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    legacy = getattr(cfg, "rope_scaling", None)
    if not params and legacy:
        params = dict(legacy)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in supported:
        raise RopeError(
            f"rope_type={rope_type!r} is not supported; supported: {', '.join(supported)}. "
            "Use a checkpoint with one of these, or remove rope scaling from config.json."
        )
    partial = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    partial = 1.0 if partial is None else float(partial)
    dim = int(head_dim * partial)  # as HF: the rotary dims are truncated, not rounded
    if not 0 < partial <= 1 or dim % 2:
        raise RopeError(
            f"partial_rotary_factor={partial} with head_dim={head_dim} gives {dim} rotary dims; "
            "it must be in (0, 1] and give an even number of dims."
        )
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    spec = RopeSpec(rope_type=rope_type, theta=float(theta), dim=dim, partial=partial)
    if rope_type == "default":
        return spec
    if "factor" not in params:
        raise RopeError(f"rope_type={rope_type!r} needs 'factor' in rope parameters {params}.")
    if rope_type == "yarn":
        return _yarn(spec, params)
    extra = {"factor": float(params["factor"])}
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise RopeError(f"rope_type='llama3' needs {key!r} in rope parameters {params}.")
            extra[key] = params[key]
    return RopeSpec(**{**spec.__dict__, **extra})


def _yarn(spec: RopeSpec, params: dict) -> RopeSpec:
    if "original_max_position_embeddings" not in params:
        raise RopeError(f"rope_type='yarn' needs 'original_max_position_embeddings' in {params}.")
    yarn = YarnSpec(
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        attention_factor=params.get("attention_factor"),
        truncate=bool(params.get("truncate", True)),
    )
    factor = params["factor"]  # None: max_position_embeddings / original, as HF derives it
    return RopeSpec(**{**spec.__dict__, "factor": float(factor) if factor else 0.0, "yarn": yarn})


def inv_freq(spec: RopeSpec) -> torch.Tensor:
    """Inverse frequencies, float32 [dim // 2], as HF computes them for ``spec.rope_type``."""
    # on the host even while a meta model is built: meta ops would import torch's compiler
    exponent = torch.arange(0, spec.dim, 2, dtype=torch.int64, device="cpu")  # host: the builder moves it
    exponent = exponent.float() / spec.dim
    base = 1.0 / (spec.theta**exponent)
    if spec.rope_type == "default":
        return base
    if spec.rope_type == "linear":
        return base / spec.factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate smoothly in between.
    old_ctx = spec.original_max_position_embeddings
    low_wavelen = old_ctx / spec.low_freq_factor
    high_wavelen = old_ctx / spec.high_freq_factor
    wavelen = 2 * math.pi / base
    scaled = torch.where(wavelen > low_wavelen, base / spec.factor, base)
    smooth = (old_ctx / wavelen - spec.low_freq_factor) / (
        spec.high_freq_factor - spec.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / spec.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
