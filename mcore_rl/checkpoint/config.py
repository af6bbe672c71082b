"""CheckpointConfig: the main job's ``checkpoint:`` section (exactly these keys)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.safetensors_write import parse_size

CONTENTS = ("model", "optimizer", "extra", "hf_model")
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "model_space")
RESUME_MODES = ("auto", "path", "disable")


@dataclass(frozen=True)
class CheckpointConfig:
    """Where and when to save, what to save/load and how to resume.

    root: directory of ``global_step_<N>`` dirs (None: ``<output_dir>/checkpoints`` in the job).
    save_freq: save every this many steps (0 = never; the job also saves after the last step
    when > 0). max_ckpt_to_keep: complete steps kept (None = all). resume_mode: ``auto`` (newest
    complete step), ``path`` (``resume_path``, a ``global_step_<N>`` dir) or ``disable``.
    save_contents / load_contents: subsets of model, optimizer, extra (RNG + LR scheduler),
    hf_model (HF safetensors, save only). optimizer_sharding: DistributedOptimizer format:
    ``dp_reshardable`` (no gather; resumes at another DP/CP only), ``model_space`` (no gather;
    resumes at any TP/PP/EP/DP: ``optimizer_space.py``), ``fully_reshardable`` (megatron's:
    gathers the state over DP at each save; resumes at any layout).
    hf_max_shard_size: largest hf_model shard (e.g. "5GB", "500MiB"; a larger tensor is a shard of
    its own), also the most HF weights a rank holds at once while writing them.
    verify_content: a load checks every file it loads against its recorded checksum, each shard
    item in the same pass as it reads it (a shard damaged or replaced by other bytes of the same
    size is refused before any engine state moves); False checks sizes only.
    """

    root: str | None = None
    save_freq: int = 0
    async_save: bool = False
    max_ckpt_to_keep: int | None = None
    resume_mode: Literal["auto", "path", "disable"] = "auto"
    resume_path: str | None = None
    save_contents: tuple[str, ...] = ("model", "optimizer", "extra")
    load_contents: tuple[str, ...] = ("model", "optimizer", "extra")
    optimizer_sharding: Literal["dp_reshardable", "fully_reshardable", "model_space"] = "dp_reshardable"
    hf_max_shard_size: str = "5GB"
    verify_content: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.save_freq, int) or self.save_freq < 0:
            raise CheckpointError(f"checkpoint.save_freq={self.save_freq!r} must be an integer >= 0 (0 = never).")
        if self.max_ckpt_to_keep is not None and self.max_ckpt_to_keep < 1:
            raise CheckpointError(
                f"checkpoint.max_ckpt_to_keep={self.max_ckpt_to_keep!r} must be >= 1 or null (keep all).")
        if self.resume_mode not in RESUME_MODES:
            raise CheckpointError(f"checkpoint.resume_mode={self.resume_mode!r}; use one of {RESUME_MODES}.")
        if self.resume_mode == "path" and not self.resume_path:
            raise CheckpointError(
                "checkpoint.resume_mode='path' needs checkpoint.resume_path=<root>/global_step_<N>.")
        if self.optimizer_sharding not in SHARDING_TYPES:
            raise CheckpointError(
                f"checkpoint.optimizer_sharding={self.optimizer_sharding!r}; use one of {SHARDING_TYPES}.")
        for key in ("save_contents", "load_contents"):
            bad = [c for c in getattr(self, key) if c not in CONTENTS]
            if bad or not getattr(self, key):
                raise CheckpointError(
                    f"checkpoint.{key}={list(getattr(self, key))!r}: {bad or 'empty'}; "
                    f"choose a non-empty subset of {list(CONTENTS)}.")
        try:
            parse_size(self.hf_max_shard_size)
        except CheckpointError as e:
            raise CheckpointError(f"checkpoint.hf_max_shard_size: {e}") from None
        if "hf_model" in self.load_contents:
            raise CheckpointError(
                "checkpoint.load_contents may not hold 'hf_model' (HF weights are an export; "
                "load 'model' instead, or start a run from the huggingface/ dir via model.hf_dir).")
