"""Multi-latent attention (DeepSeek-V3 family): its facts from the HF config, megatron kwargs.

megatron-core's ``MLASelfAttention`` computes what HF's ``DeepseekV3Attention`` does with the
same weight layouts (query heads [nope | rope], key/value up-projection heads [k_nope | v],
down-projection [kv_lora | rope]). RoPE differs only in row order: megatron rotates the rope
rows of an MLA head as interleaved pairs (x0, x1), (x2, x3)... always, which is HF's
``rope_interleave=True``; for ``rope_interleave=False`` checkpoints the converters interleave
those rows on import and undo it on export (``mapping.transforms``). YaRN runs in megatron's own
``YarnRotaryEmbedding``; the HF settings it cannot express are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mcore_rl.errors import McoreRLError
from mcore_rl.models.rope import RopeSpec


class MLAConfigError(McoreRLError, ValueError):
    """A multi-latent-attention setting megatron-core cannot reproduce exactly."""


@dataclass(frozen=True)
class MLAArgs:
    """Sizes of multi-latent attention; ``q_lora_rank`` None: a full-rank query projection."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # HF's layout of the rope rows (megatron's is the interleaved one)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def mla_args_from_hf(cfg: Any) -> MLAArgs:
    """The MLA sizes of a DeepSeek-V3-style config; refuses what megatron's MLA cannot build."""
    if getattr(cfg, "attention_bias", False):
        raise MLAConfigError(
            "attention_bias=True puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj, which "
            "megatron-core's multi-latent attention does not have; use attention_bias=False."
        )
    q_lora = getattr(cfg, "q_lora_rank", None)
    return MLAArgs(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg.kv_lora_rank),
        qk_nope_head_dim=int(cfg.qk_nope_head_dim),
        qk_rope_head_dim=int(cfg.qk_rope_head_dim),
        v_head_dim=int(cfg.v_head_dim),
        rope_interleave=bool(getattr(cfg, "rope_interleave", True)),
    )


def mla_rope_kwargs(rope: RopeSpec, max_position_embeddings: int) -> dict:
    """MLATransformerConfig's RoPE fields for ``rope`` (default or YaRN).

    megatron scales the softmax by get_mscale(factor, mscale_all_dim)^2 and cos/sin by
    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim) whatever the rope type;
    HF only for YaRN, with the ratio only when both mscales are set (else get_mscale(factor)).
    """
    if rope.rope_type == "default":
        return dict(rope_type="rope", rotary_base=rope.theta, mscale=1.0, mscale_all_dim=0.0)
    if rope.rope_type != "yarn":
        raise MLAConfigError(
            f"rope_type={rope.rope_type!r} with multi-latent attention is not supported; "
            "megatron-core's MLA implements 'default' and 'yarn'."
        )
    y = rope.yarn
    if y.attention_factor is not None or not y.truncate:
        raise MLAConfigError(
            f"YaRN attention_factor={y.attention_factor} / truncate={y.truncate} cannot be "
            "expressed in megatron-core's MLA (it derives the factor from mscale and always "
            "truncates); remove attention_factor and truncate from rope_parameters."
        )
    if y.mscale_all_dim and not y.mscale:
        raise MLAConfigError(
            f"YaRN mscale_all_dim={y.mscale_all_dim} without mscale: HF then scales cos/sin by "
            "get_mscale(factor) and megatron-core by get_mscale(factor, 1) / get_mscale(factor, "
            "mscale_all_dim); set mscale (DeepSeek-V3 uses mscale = mscale_all_dim = 1.0)."
        )
    both = bool(y.mscale and y.mscale_all_dim)
    factor = rope.factor if rope.factor else max_position_embeddings / y.original_max_position_embeddings
    return dict(
        rope_type="yarn",
        rotary_base=rope.theta,
        rotary_scaling_factor=factor,
        original_max_position_embeddings=y.original_max_position_embeddings,
        beta_fast=y.beta_fast,
        beta_slow=y.beta_slow,
        mscale=float(y.mscale) if both else 1.0,
        mscale_all_dim=float(y.mscale_all_dim) if both else 0.0,
    )


def mla_config_kwargs(mla: MLAArgs, rope: RopeSpec, max_position_embeddings: int) -> dict:
    """MLATransformerConfig keyword arguments (besides the common TransformerConfig ones)."""
    return dict(
        multi_latent_attention=True,
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_head_dim=mla.qk_nope_head_dim,
        qk_pos_emb_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        **mla_rope_kwargs(rope, max_position_embeddings),
    )
