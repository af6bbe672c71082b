"""``McoreRLEngineConfig``: verl's engine config for ``strategy='mcore_rl'``.

Field names are those of verl's ``McoreEngineConfig`` where the meaning is the same; the batching
fields (``use_dynamic_bsz``, ``max_token_len_per_gpu``, ``micro_batch_size_per_gpu``, ...) and
offload flags come from verl's ``EngineConfig``. verl's worker sets ``use_remove_padding`` from
``model.use_remove_padding``.

The fields and their checks are ``engine_config.McoreRLEngineSettings`` (the bottom of the
adapter, which the engine reads); this module adds the actor / critic configs of verl's PPO
trainer and, at import, registers mcore_rl in verl's registries.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from verl.workers.config import ActorConfig, CriticConfig, McoreEngineConfig

from mcore_rl.integrations.verl import megatron_keys, registry
from mcore_rl.integrations.verl.engine_config import McoreRLEngineSettings, VerlConfigError
from mcore_rl.integrations.verl.verl_lora import lora_config

__all__ = ["McoreRLActorConfig", "McoreRLCriticConfig", "McoreRLEngineConfig", "MegatronEngineKeys",
           "VerlConfigError", "check_lora"]


@dataclass
class McoreRLEngineConfig(McoreRLEngineSettings):
    """verl's engine config for ``strategy='mcore_rl'`` (``engine=mcore_rl``): the fields and checks
    of ``engine_config.McoreRLEngineSettings``; being defined here, in the module that registers
    mcore_rl in verl's registries, a worker that unpickles one knows the engines."""


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
    if model_config is not None:
        lora_config(model_config, where)


def _merge_megatron(engine: McoreRLEngineConfig, megatron: Any, where: str) -> McoreRLEngineConfig:
    return megatron_keys.merge(engine, megatron, where)


@dataclass
class McoreRLActorConfig(ActorConfig):
    """verl's actor (and reference) config for ``model_engine=mcore_rl`` in verl's PPO trainer:
    the engine settings live under ``mcore_rl``; a verl Megatron script's ``megatron`` keys are
    read into them (``megatron_keys``). ``use_rollout_log_probs`` is the field every engine's
    actor config of verl 0.9.1 declares (fully-async's config sets it True); verl 0.9.1 reads it
    nowhere (``algorithm.rollout_correction.bypass_mode`` decides whose log-probs train)."""

    _mutable_fields = ActorConfig._mutable_fields | {"mcore_rl"}

    strategy: str = "mcore_rl"
    mcore_rl: McoreRLEngineConfig = field(default_factory=McoreRLEngineConfig)
    megatron: Optional[MegatronEngineKeys] = None
    use_rollout_log_probs: bool = False

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
