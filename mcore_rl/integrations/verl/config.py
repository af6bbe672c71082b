"""``McoreRLEngineConfig``: verl's engine config for ``strategy='mcore_rl'``.

Field names are those of verl's ``McoreEngineConfig`` where the meaning is the same; the batching
fields (``use_dynamic_bsz``, ``max_token_len_per_gpu``, ``micro_batch_size_per_gpu``, ...) and
offload flags come from verl's ``EngineConfig``. verl's worker sets ``use_remove_padding`` from
``model.use_remove_padding``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from verl.workers.config import ActorConfig, CriticConfig
from verl.workers.config.engine import EngineConfig

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
    verify_content: a load re-reads every checkpoint file and checks its CRC-32 (mcore_rl's
    ``checkpoint.verify_content``).
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

    @property
    def is_bf16(self) -> bool:
        return self.dtype in ("bfloat16", "bf16")


@dataclass
class McoreRLActorConfig(ActorConfig):
    """verl's actor (and reference) config for ``model_engine=mcore_rl`` in verl's PPO trainer:
    the engine settings live under ``mcore_rl`` (as verl's megatron actor keeps them under
    ``megatron``)."""

    strategy: str = "mcore_rl"
    mcore_rl: McoreRLEngineConfig = field(default_factory=McoreRLEngineConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.engine = self.mcore_rl


@dataclass
class McoreRLCriticConfig(CriticConfig):
    """verl's critic config for ``model_engine=mcore_rl``: engine settings under ``mcore_rl``."""

    strategy: str = "mcore_rl"
    mcore_rl: McoreRLEngineConfig = field(default_factory=McoreRLEngineConfig)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.engine = self.mcore_rl


# Importing this module (Hydra's _target_, or a Ray worker unpickling one of these configs) makes
# verl's registries know mcore_rl in this process.
registry.install()
