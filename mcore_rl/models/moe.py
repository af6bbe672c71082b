"""Mixture-of-experts: architecture facts from the HF config, training options, megatron kwargs.

RL defaults (MoEOptions): dropless routing (no capacity factor), no load-balancing loss and no
z-loss (verl and NeMo-RL turn the aux loss off for RL: it fights the policy-gradient signal and
the policy starts from a balanced pretrained router), router logits in fp32, alltoall dispatcher.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from mcore_rl.errors import McoreRLError

ROUTER_DTYPES = ("fp32", "fp64")
LOAD_BALANCING_TYPES = ("none", "aux_loss", "seq_aux_loss")
DISPATCHERS = ("alltoall", "allgather")
SCORE_FUNCTIONS = ("softmax",)


class MoEConfigError(McoreRLError, ValueError):
    """An MoE setting mcore_rl cannot honour; the message names the value and the fix."""


@dataclass(frozen=True)
class MoEFields:
    """Where an architecture keeps its MoE facts in the HF config (data, per registry entry)."""

    num_experts: tuple[str, ...] = ("num_experts", "num_local_experts")
    ffn_hidden_size: str = "moe_intermediate_size"
    top_k: str = "num_experts_per_tok"
    norm_topk_prob: str | None = "norm_topk_prob"  # None: always renormalised (mixtral)
    shared_expert_ffn: str | None = None
    shared_expert_gate: bool = False  # qwen2_moe: sigmoid(gate(x)) scales the shared expert
    sparse_step: str | None = "decoder_sparse_step"
    mlp_only_layers: str | None = "mlp_only_layers"


@dataclass(frozen=True)
class MoEArgs:
    """MoE architecture of a model; ``moe_layers[i]`` is True where layer i is sparse."""

    num_experts: int
    ffn_hidden_size: int
    top_k: int
    norm_topk_prob: bool
    shared_expert_ffn: int | None
    shared_expert_gate: bool
    moe_layers: tuple[bool, ...]


@dataclass(frozen=True)
class MoEOptions:
    """Training options for routers and dispatchers (see the module docstring for defaults)."""

    dispatcher: Literal["alltoall", "allgather"] = "alltoall"
    router_dtype: Literal["fp32", "fp64"] = "fp32"
    load_balancing: Literal["none", "aux_loss", "seq_aux_loss"] = "none"
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float | None = None
    capacity_factor: float | None = None
    freeze_router: bool = False

    def validate(self) -> None:
        """Raises MoEConfigError naming an unsupported value and the supported ones."""
        for name, value, allowed in (
            ("dispatcher", self.dispatcher, DISPATCHERS),
            ("router_dtype", self.router_dtype, ROUTER_DTYPES),
            ("load_balancing", self.load_balancing, LOAD_BALANCING_TYPES),
        ):
            if value not in allowed:
                raise MoEConfigError(
                    f"MoE {name}={value!r} is not supported; use one of {', '.join(allowed)}."
                )
        if self.load_balancing == "none" and self.aux_loss_coeff:
            raise MoEConfigError(
                f"aux_loss_coeff={self.aux_loss_coeff} has no effect with load_balancing='none'; "
                "set load_balancing='aux_loss' or aux_loss_coeff=0."
            )


def _first(cfg: Any, names: tuple[str, ...]) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value:
            return value
    return None


def moe_args_from_hf(cfg: Any, fields: MoEFields, num_layers: int) -> MoEArgs:
    """Reads the MoE facts of ``cfg`` as laid out by ``fields``."""
    scoring = getattr(cfg, "scoring_func", "softmax")
    if scoring not in SCORE_FUNCTIONS:
        raise MoEConfigError(
            f"router scoring_func={scoring!r} is not supported for {cfg.model_type}; "
            f"supported: {', '.join(SCORE_FUNCTIONS)}."
        )
    num_experts = _first(cfg, fields.num_experts)
    if not num_experts:
        raise MoEConfigError(
            f"{cfg.model_type} config has no expert count ({' or '.join(fields.num_experts)})."
        )
    step = getattr(cfg, fields.sparse_step, 1) if fields.sparse_step else 1
    dense = set(getattr(cfg, fields.mlp_only_layers, None) or []) if fields.mlp_only_layers else set()
    moe_layers = tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))
    shared = getattr(cfg, fields.shared_expert_ffn, None) if fields.shared_expert_ffn else None
    norm = getattr(cfg, fields.norm_topk_prob, False) if fields.norm_topk_prob else True
    return MoEArgs(
        num_experts=int(num_experts),
        ffn_hidden_size=int(getattr(cfg, fields.ffn_hidden_size)),
        top_k=int(getattr(cfg, fields.top_k)),
        norm_topk_prob=bool(norm),
        shared_expert_ffn=int(shared) if shared else None,
        shared_expert_gate=fields.shared_expert_gate and bool(shared),
        moe_layers=moe_layers,
    )


def moe_config_kwargs(moe: MoEArgs, options: MoEOptions) -> dict:
    """TransformerConfig keyword arguments for an MoE model."""
    options.validate()
    return dict(
        num_moe_experts=moe.num_experts,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_router_topk=moe.top_k,
        # HF: softmax over all experts, then top-k, renormalised only with norm_topk_prob.
        # megatron: pre_softmax=True is exactly that without renormalisation; pre_softmax=False
        # softmaxes the top-k logits, which equals the renormalised top-k probabilities.
        moe_router_pre_softmax=not moe.norm_topk_prob,
        moe_router_score_function="softmax",
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn,
        moe_shared_expert_gate=moe.shared_expert_gate,
        # an int keeps megatron's stacked (layer-homogeneous) checkpoint keys; a list indexes layers
        moe_layer_freq=1 if all(moe.moe_layers) else [int(x) for x in moe.moe_layers],
        moe_router_dtype=options.router_dtype,
        moe_router_load_balancing_type=options.load_balancing,
        moe_aux_loss_coeff=options.aux_loss_coeff,
        moe_z_loss_coeff=options.z_loss_coeff,
        moe_expert_capacity_factor=options.capacity_factor,
    )
