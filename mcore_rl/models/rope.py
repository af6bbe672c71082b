"""RoPE frequencies computed by mcore_rl, so every parameter of a HF rope config is honoured.

megatron-core 0.16.1's RotaryEmbedding hard-codes llama3's low/high frequency factors and original
context length; instead the builder overwrites the module's ``inv_freq`` with ``inv_freq(spec)``
(before the first forward, so megatron's per-length cache never holds stale values).

YaRN (for architectures whose registry entry lists it: gpt-oss) works the same way: HF's
frequencies, ``truncate: false`` included, computed here; megatron's attention multiplies cos and
sin by HF's attention factor (0.1 ln(factor) + 1, or the mscale ratio) through the ``yarn_*``
attributes the builder sets on the config instance. An explicit ``attention_factor`` other than
that derived value cannot be expressed and is refused.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from mcore_rl.errors import McoreRLError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# architectures whose registry entry opts in (ArchSpec.rope_types): YaRN through inv_freq and the
# yarn_* attributes of the config instance (yarn_config_attributes), checked against HF
WITH_YARN = (*SUPPORTED_ROPE_TYPES, "yarn")
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
        return _yarn(spec, params, getattr(cfg, "max_position_embeddings", None))
    extra = {"factor": float(params["factor"])}
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise RopeError(f"rope_type='llama3' needs {key!r} in rope parameters {params}.")
            extra[key] = params[key]
    return RopeSpec(**{**spec.__dict__, **extra})


def _yarn(spec: RopeSpec, params: dict, max_position_embeddings: int | None) -> RopeSpec:
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
    if not factor and not max_position_embeddings:
        raise RopeError(f"rope_type='yarn' with factor={factor!r} needs max_position_embeddings in the config "
                        "(HF derives the factor from it); set factor in rope_parameters.")
    factor = factor or max_position_embeddings / yarn.original_max_position_embeddings
    return RopeSpec(**{**spec.__dict__, "factor": float(factor), "yarn": yarn})


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(spec: RopeSpec) -> float:
    """The factor HF multiplies YaRN's cos and sin by (its ``attention_scaling``)."""
    y, factor = spec.yarn, spec.factor
    if y.attention_factor is not None:
        return float(y.attention_factor)
    if y.mscale and y.mscale_all_dim:
        return _mscale(factor, y.mscale) / _mscale(factor, y.mscale_all_dim)
    return _mscale(factor)


def yarn_config_attributes(spec: RopeSpec) -> dict:
    """The ``yarn_*`` attributes to set on a (GQA) TransformerConfig instance so that megatron's
    attention multiplies cos/sin by HF's YaRN attention factor (``apply_rotary_pos_emb(...,
    mscale=_yarn_get_concentration_factor_from_config(config))``); the frequencies themselves are
    ``inv_freq(spec)``. megatron derives the factor from (factor, mscale, mscale_all_dim) only: an
    explicit ``attention_factor`` other than that value is refused, naming it."""
    factor, y = spec.factor, spec.yarn
    both = bool(y.mscale and y.mscale_all_dim)
    attrs = dict(yarn_rotary_scaling_factor=factor, yarn_mscale=float(y.mscale) if both else None,
                 yarn_mscale_all_dim=float(y.mscale_all_dim) if both else None)
    derived = _mscale(factor, y.mscale) / _mscale(factor, y.mscale_all_dim) if both else _mscale(factor)
    if y.attention_factor is not None and float(y.attention_factor) != derived:
        raise RopeError(
            f"YaRN attention_factor={y.attention_factor} differs from the factor derived from factor={factor}"
            f"{f', mscale={y.mscale}, mscale_all_dim={y.mscale_all_dim}' if both else ''} ({derived}), the only "
            "one megatron-core's attention can apply; remove attention_factor from rope_parameters (or set it "
            f"to {derived}).")
    return attrs


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
    if spec.rope_type == "yarn":
        return _yarn_inv_freq(spec)
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


def _yarn_inv_freq(spec: RopeSpec) -> torch.Tensor:
    """HF's YaRN frequencies (``_compute_yarn_parameters``, op for op so the values are the
    same bits): interpolated (/ factor) below the correction range, extrapolated above it, a
    linear ramp between; ``truncate=False`` keeps the range's bounds fractional (gpt-oss)."""
    y, dim, base = spec.yarn, spec.dim, spec.theta
    def correction_dim(rotations: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: no singular ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(dtype=torch.float) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (spec.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep
