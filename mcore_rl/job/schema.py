"""Typed schema of the main job's YAML configs (configs/*.yaml), loaded with ``load_job_config``.

Two values follow others unless set explicitly (interpolations in ``JOB_DEFAULTS``):
``actor.temperature`` is ``rollout.temperature`` (the job samples and computes log-probs at one
temperature; setting them differently is an error), and ``actor_optim.total_steps`` /
``critic_optim.total_steps`` are ``steps`` (the LR schedule spans the run).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import yaml

from mcore_rl.checkpoint.config import CheckpointConfig
from mcore_rl.config_loader import load_config, to_dict
from mcore_rl.job.task import TaskConfig
from mcore_rl.lora.config import LoraConfig
from mcore_rl.models.moe import MoEOptions
from mcore_rl.models.padding_idx import PadEmbeddingGrad
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.rl.actor import ActorConfig
from mcore_rl.rl.critic import CriticConfig
from mcore_rl.rl.engine import OptimConfig
from mcore_rl.rollout.engine import DEFAULT_SYNC_BUCKET_BYTES

SIGMOID_MOE_TYPES = ("glm4_moe", "deepseek_v3")  # num_experts is written as n_routed_experts
HYBRID_MOE_TYPES = ("qwen3_next", "qwen3_5_moe_text")
HYBRID_TYPES = ("qwen3_5_text", *HYBRID_MOE_TYPES)  # Gated DeltaNet + gated attention
LOCAL_EXPERTS_TYPES = ("mixtral", "gpt_oss")  # num_experts is written as num_local_experts; experts: intermediate_size
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", *LOCAL_EXPERTS_TYPES, *SIGMOID_MOE_TYPES, *HYBRID_MOE_TYPES)
WINDOW_TYPES = ("mistral", "mixtral", "gpt_oss")  # read sliding_window (gpt-oss: on its sliding_attention layers)
_GDN_KEYS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim")
_MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# MoE and MLA keys of TinyModelConfig -> the model types that read them
_MOE_KEYS = {
    "num_experts": MOE_MODEL_TYPES,
    "num_experts_per_tok": MOE_MODEL_TYPES,
    # mixtral's and gpt_oss's experts use intermediate_size
    "moe_intermediate_size": ("qwen2_moe", "qwen3_moe", *SIGMOID_MOE_TYPES, *HYBRID_MOE_TYPES),
    "shared_expert_intermediate_size": ("qwen2_moe", *HYBRID_MOE_TYPES),
    # mixtral and qwen3_5_moe_text always renormalise
    "norm_topk_prob": ("qwen2_moe", "qwen3_moe", "qwen3_next", *SIGMOID_MOE_TYPES),
    "decoder_sparse_step": ("qwen2_moe", "qwen3_moe", "qwen3_next"),
    "mlp_only_layers": ("qwen2_moe", "qwen3_moe", "qwen3_next"),
    "layer_types": (*HYBRID_TYPES, "gpt_oss"),
    "sliding_window": WINDOW_TYPES,
    **{k: HYBRID_TYPES for k in ("linear_conv_kernel_dim", *_GDN_KEYS)},
    **{k: SIGMOID_MOE_TYPES for k in ("n_shared_experts", "first_k_dense_replace", "n_group",
                                       "topk_group", "routed_scaling_factor")},
    **{k: ("deepseek_v3",) for k in _MLA_KEYS},
}
_MOE_REQUIRED = {  # HF's defaults are full-size models (60 experts, ...): tiny runs set them
    "qwen2_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size"),
    "qwen3_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    **{t: ("num_experts", "num_experts_per_tok") for t in LOCAL_EXPERTS_TYPES},
    "glm4_moe": ("num_experts", "num_experts_per_tok", "moe_intermediate_size"),
    "deepseek_v3": ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "first_k_dense_replace",
                    "n_group", "topk_group", *_MLA_KEYS),
    "qwen3_5_text": _GDN_KEYS,
    **{t: ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
           *_GDN_KEYS) for t in HYBRID_MOE_TYPES},
}


@dataclass(frozen=True)
class TinyModelConfig:
    """A HF config built in memory (nothing downloaded) and randomly initialised with ``seed``.

    MoE model types (qwen2_moe, qwen3_moe, mixtral, gpt_oss, glm4_moe, deepseek_v3, qwen3_next,
    qwen3_5_moe_text) need the MoE sizes (deepseek_v3 also its multi-latent attention sizes,
    hybrids their Gated DeltaNet sizes); a key on a model type that does not read
    it is an error (it would be ignored). gpt_oss: attention sinks, ``layer_types`` of
    'sliding_attention' (window ``sliding_window``: tokens a query sees, itself included) and
    'full_attention' (HF's default alternates them), experts of ``intermediate_size``.
    """

    model_type: str = "llama"
    vocab_size: int = 16
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 64
    head_dim: int | None = None
    attention_dropout: float = 0.0
    num_experts: int | None = None  # mixtral, gpt_oss: written as num_local_experts
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    norm_topk_prob: bool | None = None
    decoder_sparse_step: int | None = None
    mlp_only_layers: tuple[int, ...] | None = None
    # glm4_moe / deepseek_v3: shared experts (count), dense first layers, expert groups, scaling
    n_shared_experts: int | None = None
    first_k_dense_replace: int | None = None
    n_group: int | None = None
    topk_group: int | None = None
    routed_scaling_factor: float | None = None
    # deepseek_v3's multi-latent attention
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    # hybrid models (qwen3_next, qwen3_5_text, qwen3_5_moe_text): which layer is which
    # ('linear_attention' = Gated DeltaNet, 'full_attention'; default: every 4th is full) and the
    # Gated DeltaNet sizes; gpt_oss: 'sliding_attention' or 'full_attention' per layer
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None  # mistral, mixtral, gpt_oss (mistral, mixtral: None = no window)
    linear_conv_kernel_dim: int | None = None
    linear_num_key_heads: int | None = None
    linear_num_value_heads: int | None = None
    linear_key_head_dim: int | None = None
    linear_value_head_dim: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for key, types in _MOE_KEYS.items():
            if getattr(self, key) is not None and self.model_type not in types:
                raise ValueError(f"{key}={getattr(self, key)!r} is not read by model_type="
                                 f"{self.model_type!r} (only by {', '.join(types)}); remove it")
        if self.model_type == "deepseek_v3" and self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(f"model_type='deepseek_v3' (multi-latent attention) has no KV groups: set "
                             f"num_key_value_heads={self.num_attention_heads} (= num_attention_heads), "
                             f"not {self.num_key_value_heads}")
        missing = [k for k in _MOE_REQUIRED.get(self.model_type, ()) if getattr(self, k) is None]
        if missing:
            raise ValueError(f"model_type={self.model_type!r} needs {', '.join(missing)} "
                             "(HF's defaults are full-size); set them, e.g. num_experts=4")

    def hf_kwargs(self) -> dict:
        """The transformers config kwargs (None fields left to HF; mixtral's and gpt_oss's expert
        count renamed)."""
        skip = ("model_type", "seed")
        kwargs = {k: v for k, v in vars(self).items() if k not in skip and v is not None}
        for key in ("mlp_only_layers", "layer_types"):
            if key in kwargs:
                kwargs[key] = list(kwargs[key])
        if self.model_type in LOCAL_EXPERTS_TYPES:
            kwargs["num_local_experts"] = kwargs.pop("num_experts")
        if self.model_type in SIGMOID_MOE_TYPES:
            kwargs["n_routed_experts"] = kwargs.pop("num_experts")
        return kwargs


@dataclass(frozen=True)
class ModelConfig:
    """Where the actor (and reference) start: ``hf_dir``, a HF model directory; ``mcore_dir``, a
    model directory of role actor (converters/hf_to_mcore.py's output, or a checkpoint's
    ``global_step_N/actor``), loaded at any layout; neither: the embedded tiny model.
    ``critic_dir`` (PPO): the critic's start, a HF directory (*ForCausalLM: fresh value head;
    *ForTokenClassification / *ForSequenceClassification: score head loaded) or a model
    directory (role critic, or role actor: fresh value head); unset: the actor's start with a
    fresh value head.

    Paths may start with ``~`` (the home directory).

    ``dtype``: parameter dtype of actor, reference and critic (bf16 trains with fp32 main
    weights in megatron's optimizer). ``moe``: router/dispatcher options for MoE models.
    ``hidden_dropout``: dropout after attention and MLP blocks (attention dropout is
    ``tiny.attention_dropout`` or the HF config's). ``pad_embedding_grad``: ``transformers``
    (the HF config's ``pad_token_id`` row of the word embedding gets no gradient through the
    lookup, as transformers' ``padding_idx``) or ``megatron`` (it does).
    """

    hf_dir: str | None = None
    mcore_dir: str | None = None
    critic_dir: str | None = None
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    dtype: Literal["fp32", "bf16"] = "fp32"
    hidden_dropout: float = 0.0
    moe: MoEOptions = field(default_factory=MoEOptions)
    pad_embedding_grad: PadEmbeddingGrad = "transformers"

    def __post_init__(self) -> None:
        self.moe.validate()  # e.g. aux_loss_coeff without load_balancing: an error at load time
        for key in ("hf_dir", "mcore_dir", "critic_dir"):  # "~/..." in a YAML file means the home directory
            if getattr(self, key) is not None:
                object.__setattr__(self, key, os.path.expanduser(getattr(self, key)))


@dataclass(frozen=True)
class RolloutConfig:
    """Samples per step = prompts_per_step * samples_per_prompt, drawn at ``temperature``
    (the actor's log-probs use the same temperature) by ``engine``: ``builtin`` (the actor's
    own model, no KV cache: tiny models) or ``transformers`` (a transformers model with KV cache
    on each replica's first rank, refreshed from the actor after every update in buckets of
    ``sync_bucket_mb``)."""

    prompts_per_step: int = 8
    samples_per_prompt: int = 8
    temperature: float = 1.0
    engine: Literal["builtin", "transformers"] = "builtin"
    sync_bucket_mb: int = DEFAULT_SYNC_BUCKET_BYTES >> 20

    def __post_init__(self) -> None:
        for name in ("prompts_per_step", "samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1 (each step samples "
                                 "prompts_per_step * samples_per_prompt responses)")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (logits are divided by it)")
        if self.sync_bucket_mb < 1:
            raise ValueError(f"sync_bucket_mb={self.sync_bucket_mb} must be >= 1 (MiB per weight-sync bucket)")


@dataclass(frozen=True)
class AlgorithmConfig:
    """GRPO (group-normalised rewards) or PPO (critic + GAE); optional KL penalty on rewards."""

    name: Literal["grpo", "ppo"] = "grpo"
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std: bool = True
    kl_in_reward_coeff: float = 0.0


def _lora_field() -> LoraConfig:
    return field(default_factory=LoraConfig)


@dataclass(frozen=True)
class JobActorConfig(ActorConfig):
    """The actor's batching and loss (``ActorConfig``) and ``lora``: LoRA adapters on the
    frozen base (``LoraConfig``'s keys, verl's ``model.lora`` names; ``rank`` 0: full
    fine-tuning). With LoRA the reference policy (a KL term) is the same model with its adapters
    off, so no reference model is built, and the rollout engines take merged weights
    (W + alpha/rank * B A) whatever ``lora.merge`` says (``merge`` is verl's choice between
    merged and adapter-only sync)."""

    lora: LoraConfig = _lora_field()


@dataclass(frozen=True)
class JobCriticConfig(CriticConfig):
    """The critic's batching and value loss (``CriticConfig``) and ``lora``: LoRA adapters on
    its frozen trunk; the value head is new and stays fully trainable."""

    lora: LoraConfig = _lora_field()


@dataclass(frozen=True)
class JobConfig:
    """The whole job. ``layout``: every parallel size of actor, reference and critic (DP is
    what is left of the world size). ``checkpoint``: saves every ``save_freq`` steps and after
    the last; the same command after a crash continues from the newest complete checkpoint
    (root defaults to ``<output_dir>/checkpoints``)."""

    steps: int = 40
    seed: int = 1
    output_dir: str = "outputs/grpo_demo"
    progress_bar: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    layout: ParallelLayout = field(default_factory=ParallelLayout)
    task: TaskConfig = field(default_factory=TaskConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: JobActorConfig = field(default_factory=JobActorConfig)
    actor_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    critic: JobCriticConfig = field(default_factory=JobCriticConfig)
    critic_optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-3))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ValueError(f"steps={self.steps} must be >= 0 (the number of RL steps to run)")
        if self.actor.temperature != self.rollout.temperature:
            raise ValueError(
                f"actor.temperature={self.actor.temperature} differs from rollout.temperature="
                f"{self.rollout.temperature}: the job samples and computes the actor's log-probs "
                "at one temperature; set rollout.temperature only (actor.temperature follows it)"
            )
        if self.actor.router_replay == "R3" and self.rollout.engine != "builtin":
            raise ValueError(
                f"actor.router_replay=R3 replays the rollout's routing, which rollout.engine="
                f"{self.rollout.engine} does not report; use rollout.engine=builtin or router_replay=R2"
            )
        if self.critic.lora.enabled and self.algorithm.name != "ppo":
            raise ValueError(f"critic.lora.rank={self.critic.lora.rank} with algorithm.name="
                             f"{self.algorithm.name!r}, which has no critic: drop critic.lora or use ppo")
        for section in ("actor", "critic"):
            if getattr(self, section).dispatch != "global":
                raise ValueError(
                    f"{section}.dispatch={getattr(self, section).dispatch!r}: the main job passes "
                    f"the whole batch on every rank; set {section}.dispatch=global (sharded "
                    "dispatch is for trainers that hand each DP rank its own rows)"
                )


# interpolations resolved against the whole config: values that follow others unless set
JOB_DEFAULTS = {
    "actor": {"temperature": "${rollout.temperature}"},
    "actor_optim": {"total_steps": "${steps}"},
    "critic_optim": {"total_steps": "${steps}"},
}


def dump_job_config(cfg: JobConfig) -> str:
    """The resolved config as YAML; values that equal what they follow are written as their
    ``${...}`` reference, so a later run from this file with ``steps=N`` still follows."""
    data = to_dict(cfg)
    for section, keys in JOB_DEFAULTS.items():
        for key, reference in keys.items():
            target = data
            for part in reference[2:-1].split("."):
                target = target[part]
            if data[section][key] == target:
                data[section][key] = reference
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def load_job_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> JobConfig:
    """The job's config from YAML file ``path`` and ``key.path=value`` overrides."""
    return load_config(JobConfig, path, overrides, defaults=JOB_DEFAULTS)
