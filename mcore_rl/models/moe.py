"""Mixture-of-experts: architecture facts from the HF config, training options, megatron kwargs.

RL defaults (MoEOptions): dropless routing (no capacity factor), no load-balancing loss and no
z-loss (verl and NeMo-RL turn the aux loss off for RL: it fights the policy-gradient signal and
the policy starts from a balanced pretrained router), router logits in fp32, alltoall dispatcher.
Sigmoid routers with a score-correction bias (DeepSeek-V3, GLM-4.5) keep the bias fixed by default
(``expert_bias_update_rate=0``): aux-loss-free balancing is a pretraining mechanism.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal
from mcore_rl.errors import McoreRLError

ROUTER_DTYPES = ("fp32", "fp64")
LOAD_BALANCING_TYPES = ("none", "aux_loss", "seq_aux_loss")
DISPATCHERS = ("alltoall", "allgather")
SCORE_FUNCTIONS = ("softmax",)  # what a config's scoring_func may say (HF ignores it elsewhere)


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
    first_dense_layers: str | None = None  # DeepSeek/GLM: the first k layers have a dense MLP
    shared_expert_count: str | None = None  # shared ffn = moe ffn * this count (DeepSeek/GLM)
    # sigmoid routers (DeepSeek-V3/GLM-4.5): scores, correction bias, groups, scaling
    score_function: str | None = None  # a fixed scoring function; None: cfg.scoring_func or softmax
    expert_bias: bool = False  # e_score_correction_bias
    num_groups: str | None = None
    group_topk: str | None = None
    scaling_factor: str | None = None


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
    score_function: str = "softmax"
    expert_bias: bool = False
    num_groups: int | None = None  # group-limited routing; None: every expert is a candidate
    group_topk: int | None = None
    scaling_factor: float | None = None


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
    # sigmoid routers with a correction bias: megatron's count rule, bias += rate * sign(mean - count)
    # after every optimizer step; 0 keeps the pretrained bias bit-identical
    expert_bias_update_rate: float = 0.0

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
        rate = self.expert_bias_update_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not rate >= 0:
            raise MoEConfigError(
                f"expert_bias_update_rate={rate!r} must be a number >= 0 (0 keeps the bias fixed)."
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
    scoring = fields.score_function or getattr(cfg, "scoring_func", "softmax")
    if fields.score_function is None and scoring not in SCORE_FUNCTIONS:
        raise MoEConfigError(
            f"router scoring_func={scoring!r} is not supported for {cfg.model_type}; "
            f"supported: {', '.join(SCORE_FUNCTIONS)}."
        )
    num_experts = _first(cfg, fields.num_experts)
    if not num_experts:
        raise MoEConfigError(
            f"{cfg.model_type} config has no expert count ({' or '.join(fields.num_experts)})."
        )
    moe_ffn = int(getattr(cfg, fields.ffn_hidden_size))
    norm = getattr(cfg, fields.norm_topk_prob, False) if fields.norm_topk_prob else True
    args = MoEArgs(
        num_experts=int(num_experts),
        ffn_hidden_size=moe_ffn,
        top_k=int(getattr(cfg, fields.top_k)),
        norm_topk_prob=bool(norm),
        shared_expert_ffn=_shared_ffn(cfg, fields, moe_ffn),
        shared_expert_gate=fields.shared_expert_gate and bool(_shared_ffn(cfg, fields, moe_ffn)),
        moe_layers=_moe_layers(cfg, fields, num_layers),
        score_function=scoring,
        expert_bias=fields.expert_bias,
        scaling_factor=_scaling(cfg, fields),
        **_groups(cfg, fields, int(num_experts)),
    )
    _check_sigmoid_normalisation(cfg, args)
    return args


def _moe_layers(cfg: Any, fields: MoEFields, num_layers: int) -> tuple[bool, ...]:
    step = getattr(cfg, fields.sparse_step, 1) if fields.sparse_step else 1
    dense = set(getattr(cfg, fields.mlp_only_layers, None) or []) if fields.mlp_only_layers else set()
    if fields.first_dense_layers:
        dense |= set(range(int(getattr(cfg, fields.first_dense_layers, 0) or 0)))
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def _shared_ffn(cfg: Any, fields: MoEFields, moe_ffn: int) -> int | None:
    if fields.shared_expert_count:
        count = int(getattr(cfg, fields.shared_expert_count, 0) or 0)
        return moe_ffn * count or None
    shared = getattr(cfg, fields.shared_expert_ffn, None) if fields.shared_expert_ffn else None
    return int(shared) if shared else None


def _scaling(cfg: Any, fields: MoEFields) -> float | None:
    factor = getattr(cfg, fields.scaling_factor, None) if fields.scaling_factor else None
    return None if factor in (None, 1, 1.0) else float(factor)


def _groups(cfg: Any, fields: MoEFields, num_experts: int) -> dict:
    """Group-limited routing, or none where every group is always selected (n_group=topk_group).

    Both HF and megatron keep the ``topk_group`` best groups, but HF scores a group by the sum of
    its top 2 experts and megatron 0.16.1 by the sum of its top ``topk / topk_group``: they agree
    only when topk = 2 * topk_group, so other configs are refused rather than routed differently."""
    groups = int(getattr(cfg, fields.num_groups, 1) or 1) if fields.num_groups else 1
    chosen = int(getattr(cfg, fields.group_topk, groups) or groups) if fields.group_topk else groups
    if groups <= 1 or chosen >= groups:
        return {}
    top_k = int(getattr(cfg, fields.top_k))
    if num_experts % groups:
        raise MoEConfigError(
            f"n_group({groups}) does not divide the expert count ({num_experts}); fix config.json."
        )
    if top_k != 2 * chosen:
        raise MoEConfigError(
            f"group-limited routing with num_experts_per_tok({top_k}) != 2 * topk_group({chosen}) "
            f"is not supported: HF scores a group by its top-2 experts, megatron-core by its top "
            f"num_experts_per_tok / topk_group; only configs with num_experts_per_tok = 2 * topk_group "
            f"(as DeepSeek-V3's 8 and 4) route identically. Use such a config or n_group = topk_group."
        )
    return dict(num_groups=groups, group_topk=chosen)


def _check_sigmoid_normalisation(cfg: Any, args: MoEArgs) -> None:
    # megatron normalises sigmoid top-k weights exactly when top_k > 1; HF when norm_topk_prob
    if args.score_function == "sigmoid" and args.norm_topk_prob != (args.top_k > 1):
        raise MoEConfigError(
            f"{cfg.model_type}: norm_topk_prob={args.norm_topk_prob} with num_experts_per_tok="
            f"{args.top_k} is not supported: megatron-core's sigmoid router renormalises the top-k "
            "weights exactly when more than one expert is chosen. Use norm_topk_prob="
            f"{args.top_k > 1}."
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
        moe_router_pre_softmax=not moe.norm_topk_prob and moe.score_function == "softmax",
        moe_router_score_function=moe.score_function,
        moe_router_enable_expert_bias=moe.expert_bias,
        moe_router_bias_update_rate=float(options.expert_bias_update_rate),
        moe_router_num_groups=moe.num_groups,
        moe_router_group_topk=moe.group_topk,
        moe_router_topk_scaling_factor=moe.scaling_factor,
        moe_shared_expert_intermediate_size=moe.shared_expert_ffn,
        moe_shared_expert_gate=moe.shared_expert_gate,
        # an int keeps megatron's stacked (layer-homogeneous) checkpoint keys; a list indexes layers
        moe_layer_freq=1 if all(moe.moe_layers) else [int(x) for x in moe.moe_layers],
        moe_router_dtype=options.router_dtype,
        moe_router_load_balancing_type=options.load_balancing,
        moe_aux_loss_coeff=options.aux_loss_coeff,
        moe_z_loss_coeff=options.z_loss_coeff,
        moe_expert_capacity_factor=options.capacity_factor,
        # a RouterReplay per router (idle unless an engine records or replays: models/routing.py)
        moe_enable_routing_replay=True,
    )
