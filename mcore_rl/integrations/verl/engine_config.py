"""The bottom of mcore_rl's verl adapter: the engine settings and the error every module of
the adapter raises for a setting it cannot run (imports nothing of ``integrations.verl``).

``McoreRLEngineSettings`` holds the fields and checks of ``engine=mcore_rl``; verl's config class
is its subclass ``config.McoreRLEngineConfig``, defined in ``config`` because importing or
unpickling that module registers mcore_rl in verl's registries. The engine, which those
registries build, checks its config against this class and so never imports ``config``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from verl.workers.config.engine import EngineConfig

from mcore_rl.checkpoint.config import HF_DTYPES, SHARDING_TYPES
from mcore_rl.errors import McoreRLError

DTYPES = ("bfloat16", "float32", "fp32", "bf16")


class VerlConfigError(McoreRLError, ValueError):
    """An engine setting mcore_rl cannot run; the message names the key and the fix."""


@dataclass
class McoreRLEngineSettings(EngineConfig):
    """Parallel layout, dtype and checkpoint options of the mcore_rl engine (the fields and checks
    of verl's ``engine=mcore_rl`` config, whose class is ``config.McoreRLEngineConfig``).

    dtype: parameter dtype, 'bfloat16' (fp32 main weights in the optimizer) or 'float32'.
    verify_content: a load checks the content of every checkpoint file it reads against its
    recorded checksum (mcore_rl's ``checkpoint.verify_content``).
    optimizer_sharding: the distributed optimizer's checkpoint format (mcore_rl's
    ``checkpoint.optimizer_sharding``): dp_reshardable, model_space (resumes at any layout, no
    gather; verl's ``megatron.dist_ckpt_optim_fully_reshardable=True`` selects it) or
    fully_reshardable.
    hf_dtype, hf_export_threads, hf_export_supersede: the background HF export of a save with
    ``hf_model`` in ``checkpoint.save_contents`` (mcore_rl's ``checkpoint.*`` keys of those names):
    the dtype written (fp32, bf16, fp16, fp8, mxfp4 as ``mcore_to_hf.py merge --dtype``; null: the
    checkpoint's), the exporter's CPU threads, and whether a newer step's export replaces an older
    one that has not started.
    recompute_granularity: activation recomputation, 'full' (whole layers, uniform) or
    'selective' (core attention); null follows ``model.enable_gradient_checkpointing`` (full).
    recompute_num_layers: layers per recomputed block with 'full' (null: 1).
    router_replay: verl's ``EngineRouterReplayConfig`` (``mode``: disabled, R2, R3).
    context_parallel_size: every padded row or packed sequence split over that many ranks as
    mcore_rl's actor splits it (``verl_batches``); not with router replay (refused here), MTP
    training or Gated DeltaNet layers (refused by the engine: ``engine.check_context_parallel``).
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
    hf_dtype: Optional[str] = None
    hf_export_threads: int = 1
    hf_export_supersede: bool = True
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
        if self.context_parallel_size < 1:
            raise VerlConfigError(f"engine.context_parallel_size={self.context_parallel_size}; use 1 (off) or more.")
        mode = getattr(self.router_replay, "mode", "disabled")
        if self.context_parallel_size > 1 and mode != "disabled":
            raise VerlConfigError(f"engine.router_replay.mode={mode!r} with engine.context_parallel_size="
                                  f"{self.context_parallel_size}: the verl engine's route table is not split over "
                                  "context-parallel ranks; set context_parallel_size=1 or router_replay.mode=disabled.")
        if self.tensor_model_parallel_size == 1 and self.sequence_parallel:
            self.sequence_parallel = False  # as verl's McoreEngineConfig: SP needs TP > 1
        if self.use_fused_kernels:
            raise VerlConfigError("engine.use_fused_kernels=True: mcore_rl has no fused LM-head kernels; "
                                  "set model.use_fused_kernels=False.")
        if self.optimizer_sharding not in SHARDING_TYPES:
            raise VerlConfigError(f"engine.optimizer_sharding={self.optimizer_sharding!r}; use one of "
                                  f"{list(SHARDING_TYPES)}.")
        if self.hf_dtype not in (None, *HF_DTYPES):
            raise VerlConfigError(f"engine.hf_dtype={self.hf_dtype!r}; use one of {list(HF_DTYPES)} or null (the "
                                  "checkpoint's dtype).")
        if isinstance(self.hf_export_threads, bool) or not isinstance(self.hf_export_threads, int) \
                or self.hf_export_threads < 1:
            raise VerlConfigError(f"engine.hf_export_threads={self.hf_export_threads!r}; use an integer >= 1.")
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
