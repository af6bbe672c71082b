"""``McoreRLEngineConfig``: verl's engine config for ``strategy='mcore_rl'``.

Field names are those of verl's ``McoreEngineConfig`` where the meaning is the same; the batching
fields (``use_dynamic_bsz``, ``max_token_len_per_gpu``, ``micro_batch_size_per_gpu``, ...) and
offload flags come from verl's ``EngineConfig``. verl's worker sets ``use_remove_padding`` from
``model.use_remove_padding``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

from verl.workers.config import ActorConfig, CriticConfig, McoreEngineConfig
from verl.workers.config.engine import EngineConfig

from mcore_rl.checkpoint.config import SHARDING_TYPES
from mcore_rl.errors import McoreRLError
from mcore_rl.integrations.verl import registry

log = logging.getLogger("mcore_rl.integrations.verl")
DTYPES = ("bfloat16", "float32", "fp32", "bf16")


class VerlConfigError(McoreRLError, ValueError):
    """An engine setting mcore_rl cannot run; the message names the key and the fix."""


@dataclass
class McoreRLEngineConfig(EngineConfig):
    """Parallel layout, dtype and checkpoint options of the mcore_rl engine.

    dtype: parameter dtype, 'bfloat16' (fp32 main weights in the optimizer) or 'float32'.
    verify_content: a load checks the content of every checkpoint file it reads against its
    recorded checksum (mcore_rl's ``checkpoint.verify_content``).
    optimizer_sharding: the distributed optimizer's checkpoint format (mcore_rl's
    ``checkpoint.optimizer_sharding``): dp_reshardable, model_space (resumes at any layout, no
    gather; verl's ``megatron.dist_ckpt_optim_fully_reshardable=True`` selects it) or
    fully_reshardable.
    recompute_granularity: activation recomputation, 'full' (whole layers, uniform) or
    'selective' (core attention); null follows ``model.enable_gradient_checkpointing`` (full).
    recompute_num_layers: layers per recomputed block with 'full' (null: 1).
    router_replay: verl's ``EngineRouterReplayConfig`` (``mode``: disabled, R2, R3).
    """

    _mutable_fields = EngineConfig._mutable_fields | {"sequence_parallel"}

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    sequence_parallel: bool = True
    use_distributed_optimizer: bool = True
    verify_content: bool = True
    optimizer_sharding: str = "dp_reshardable"
    recompute_granularity: Optional[str] = None
    recompute_num_layers: Optional[int] = None
    strategy: str = "mcore_rl"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.strategy != "mcore_rl":
            raise VerlConfigError(f"engine.strategy={self.strategy!r}; McoreRLEngineConfig needs strategy=mcore_rl.")
        if self.dtype not in DTYPES:
            raise VerlConfigError(f"engine.dtype={self.dtype!r}; mcore_rl's verl engine runs {list(DTYPES)} "
                                  "(float16 needs loss scaling, not wired yet).")
        if self.context_parallel_size != 1:
            raise VerlConfigError(f"engine.context_parallel_size={self.context_parallel_size}: context "
                                  "parallelism is not wired into the verl engine yet; set it to 1.")
        if self.tensor_model_parallel_size == 1 and self.sequence_parallel:
            self.sequence_parallel = False  # as verl's McoreEngineConfig: SP needs TP > 1
        if self.use_fused_kernels:
            raise VerlConfigError("engine.use_fused_kernels=True: mcore_rl has no fused LM-head kernels; "
                                  "set model.use_fused_kernels=False.")
        if self.optimizer_sharding not in SHARDING_TYPES:
            raise VerlConfigError(f"engine.optimizer_sharding={self.optimizer_sharding!r}; use one of "
                                  f"{list(SHARDING_TYPES)}.")
        if self.recompute_granularity not in (None, "full", "selective"):
            raise VerlConfigError(f"engine.recompute_granularity={self.recompute_granularity!r}; choose full, "
                                  "selective or null.")
        if self.recompute_num_layers is not None and (self.recompute_granularity != "full"
                                                      or self.recompute_num_layers < 1):
            raise VerlConfigError(f"engine.recompute_num_layers={self.recompute_num_layers} needs "
                                  f"recompute_granularity='full' (got {self.recompute_granularity!r}) and a count >= 1.")

    @property
    def is_bf16(self) -> bool:
        return self.dtype in ("bfloat16", "bf16")


@dataclass
class MegatronEngineKeys(McoreEngineConfig):
    """verl's ``McoreEngineConfig`` fields as a verl Megatron script sets them (``<section>.megatron``),
    read, not validated (verl's checks are for verl's engine): ``megatron_keys.merge`` takes them
    into ``McoreRLEngineConfig`` or refuses them."""

    def __post_init__(self) -> None:
        pass


def check_lora(model_config: Any, where: str) -> None:
    """verl's model config's LoRA settings, checked when verl validates its configs (the engine
    reads them again): ``model.lora.*`` as mcore_rl's LoraConfig, FSDP-only keys at their
    defaults (``verl_lora.lora_config``)."""
    from mcore_rl.integrations.verl.verl_lora import lora_config

    if model_config is not None:
        lora_config(model_config, where)


def _merge_megatron(engine: McoreRLEngineConfig, megatron: Any, where: str) -> McoreRLEngineConfig:
    from mcore_rl.integrations.verl import megatron_keys

    return megatron_keys.merge(engine, megatron, where)


@dataclass
class McoreRLActorConfig(ActorConfig):
    """verl's actor (and reference) config for ``model_engine=mcore_rl`` in verl's PPO trainer:
    the engine settings live under ``mcore_rl``; a verl Megatron script's ``megatron`` keys are
    read into them (``megatron_keys``)."""

    _mutable_fields = ActorConfig._mutable_fields | {"mcore_rl"}

    strategy: str = "mcore_rl"
    mcore_rl: McoreRLEngineConfig = field(default_factory=McoreRLEngineConfig)
    megatron: Optional[MegatronEngineKeys] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        where = "actor_rollout_ref.ref" if self.mcore_rl.forward_only else "actor_rollout_ref.actor"
        self.mcore_rl = _merge_megatron(self.mcore_rl, self.megatron, where)
        self.engine = self.mcore_rl

    def validate(self, n_gpus: int, train_batch_size: int, model_config: dict = None) -> None:
        """verl's checks, and the LoRA keys (verl's ``validate_config`` passes the model config)."""
        super().validate(n_gpus, train_batch_size, model_config)
        check_lora(model_config, "actor_rollout_ref.model")


@dataclass
class McoreRLCriticConfig(CriticConfig):
    """verl's critic config for ``model_engine=mcore_rl``: engine settings under ``mcore_rl``, a
    verl Megatron script's ``megatron`` keys read into them."""

    _mutable_fields = CriticConfig._mutable_fields | {"mcore_rl"}

    strategy: str = "mcore_rl"
    mcore_rl: McoreRLEngineConfig = field(default_factory=McoreRLEngineConfig)
    megatron: Optional[MegatronEngineKeys] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_lora(self.model, "critic.model")
        self.mcore_rl = _merge_megatron(self.mcore_rl, self.megatron, "critic")
        self.engine = self.mcore_rl


# Importing this module (Hydra's _target_, or a Ray worker unpickling one of these configs) makes
# verl's registries know mcore_rl in this process.
registry.install()
