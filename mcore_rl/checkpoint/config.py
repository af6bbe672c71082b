"""CheckpointConfig: the main job's ``checkpoint:`` section (exactly these keys)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.safetensors_write import parse_size

CONTENTS = ("model", "optimizer", "extra", "hf_model")
SHARDING_TYPES = ("dp_reshardable", "fully_reshardable", "model_space")
RESUME_MODES = ("auto", "path", "disable")
HF_DTYPES = ("fp32", "bf16", "fp16", "fp8", "mxfp4")  # what ``mcore_to_hf.py merge --dtype`` writes


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
    hf_model: the HF weights are exported from the saved step in the background (after it is
    complete, by one process per node holding a copy: ``export_queue``), the same path as
    ``mcore_to_hf.py merge``; the save itself writes only the HF dir's config and side files.
    hf_max_shard_size: largest hf_model shard (e.g. "5GB", "500MiB"; a larger tensor is a shard of
    its own). hf_dtype: the exported dtype (fp32, bf16, fp16, fp8, mxfp4 as ``merge --dtype``;
    None: the checkpoint's). hf_export_threads: the exporter's torch/OMP threads.
    hf_export_supersede: a newer step's export replaces an older one that has not started.
    hf_export_wait_at_close: ``close()`` waits for the exports (else they end with the process;
    the next start re-exports the newest step that lacks one).
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
    hf_dtype: str | None = None
    hf_export_threads: int = 1
    hf_export_supersede: bool = True
    hf_export_wait_at_close: bool = True
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
        self._check_export_keys()
        if "hf_model" in self.load_contents:
            raise CheckpointError(
                "checkpoint.load_contents may not hold 'hf_model' (HF weights are an export; "
                "load 'model' instead, or start a run from the huggingface/ dir via model.hf_dir).")

    def _check_export_keys(self) -> None:
        if self.hf_dtype is not None and self.hf_dtype not in HF_DTYPES:
            raise CheckpointError(f"checkpoint.hf_dtype={self.hf_dtype!r}; use one of {list(HF_DTYPES)} "
                                  "or null (the checkpoint's dtype).")
        threads = self.hf_export_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise CheckpointError(f"checkpoint.hf_export_threads={threads!r} must be an integer >= 1 "
                                  "(the exporter's CPU threads).")
        for key in ("hf_export_supersede", "hf_export_wait_at_close"):
            if not isinstance(getattr(self, key), bool):
                raise CheckpointError(f"checkpoint.{key}={getattr(self, key)!r} must be true or false.")
