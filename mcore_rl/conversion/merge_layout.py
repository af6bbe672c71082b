"""What a merge writes beyond the mapping table's tensors: a vision-language wrapper's carried
tensors (vision tower, ``mtp.*``: ``huggingface/`` ``CARRIED_FILE`` of the model directory, as
the converter stored them) and fused experts where the source stored them fused
(``models.hf_layout``). No megatron import."""
from __future__ import annotations

import itertools
import os
from typing import Iterator

import torch

from mcore_rl.conversion.merge_io import MergeError, ModelDir
from mcore_rl.fileio.safetensors_write import TensorSpec, dtype_of_name
from mcore_rl.mapping.casts import cast_checked, wider_dtypes
from mcore_rl.mapping.hf_io import read_header
from mcore_rl.models.hf_layout import (
    CARRIED_FILE, EXPERTS_KEY, always_fused, carried_tensors, expert_layout, fuse_stream, read_carried,
)

Tensor = torch.Tensor


def _stack_spec(layout, kind: str, parts: list[TensorSpec]) -> TensorSpec:
    """The spec of ``layout.stack(kind, parts)`` (name set by the caller): stacked on meta tensors."""
    fused = layout.stack(kind, [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in parts])
    return TensorSpec("", tuple(fused.shape), parts[0].dtype)


class SourceLayout:
    """The carried tensors' specs (in file order) and whether experts go back fused."""

    def __init__(self, model: ModelDir) -> None:
        self.model = model
        names, meta = read_carried(model.hf_dir)
        self.fused = meta.get(EXPERTS_KEY) == "fused" or always_fused(model.args)
        wrapper = model.args.wrapper
        if wrapper is not None and not names:
            raise MergeError(
                f"{model.path} holds the text model of a {wrapper.hf_class} but not its vision tower: "
                f"huggingface/{CARRIED_FILE} is absent (written by an mcore_rl that did not carry it). Convert "
                "the HF checkpoint again with converters/hf_to_mcore.py and merge that, or a checkpoint of a run "
                "started from it or from the HF directory (their huggingface/ carry the vision tower).")
        entries = read_header(os.path.join(model.hf_dir, CARRIED_FILE)) if names else {}
        self.carried = [TensorSpec(n, tuple(entries[n]["shape"]), dtype_of_name(entries[n]["dtype"], n))
                        for n in names]

    def specs(self, specs: list[TensorSpec]) -> list[TensorSpec]:
        """The merged model's tensor specs in write order."""
        if self.fused:
            layout = expert_layout(self.model.args)
            specs = [TensorSpec(name, s.shape, s.dtype) for name, s in fuse_stream(
                ((s.name, s) for s in specs), self._experts(), lambda k, p: _stack_spec(layout, k, p), layout)]
        return specs + self.carried

    def tensors(self, tensors: Iterator[tuple[str, Tensor]], dtype: torch.dtype | None) -> Iterator[tuple[str, Tensor]]:
        """``tensors`` (the units' HF tensors) fused as ``specs`` says, then the carried ones
        (cast to ``dtype`` when given)."""
        if self.fused:
            layout = expert_layout(self.model.args)
            tensors = fuse_stream(tensors, self._experts(), layout.stack, layout)
        if not self.carried:
            return tensors
        carried = carried_tensors(self.model.hf_dir)
        if dtype is not None:
            carried = ((n, cast_checked(t, dtype, n, wider_dtypes(dtype)) if t.is_floating_point() else t)
                       for n, t in carried)
        return itertools.chain(tensors, carried)

    def _experts(self) -> int:
        moe = self.model.args.moe
        if moe is None:
            raise MergeError(f"{self.model.path}: huggingface/{CARRIED_FILE} records fused experts but "
                             "huggingface/config.json has no experts; merge with the config it was converted with.")
        return moe.num_experts
