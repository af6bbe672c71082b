"""A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) as
full megatron-layout adapters, one plan per adapted linear.

Fused type: the HF pieces of one megatron linear (q, k, v / gate, up) become one adapter by rank
expansion: A = the pieces' A stacked, B = the pieces' B block-diagonal in the weight's row order,
each block scaled by its piece's ``alpha_p / r_p`` over the site's scaling (the first piece's), so
``s B A`` equals the sum of the pieces' deltas. Canonical type: the pieces stay separate parts
(one rank each; every part of a linear needs the same rank and alpha). ``rank_pattern`` and
``alpha_pattern`` are honoured (peft's rule: the first key whose regular expression matches the
module name's end after a dot); ``use_rslora`` scales by ``alpha / sqrt(r)``. Routed experts come
in peft's ``target_parameters`` layout (mapping/peft_experts.py). Nothing is imported unchecked:
the config and every tensor name first (mapping/peft_check.py), then each factor's dtype, shape
(against the model's weight and the module's rank) and values (finite).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Mapping

import torch

from mcore_rl.mapping.hf_io import SafetensorsReader
from mcore_rl.mapping.peft_check import PeftAdapterError, check_adapter_config, check_adapter_names, suffix_pattern
from mcore_rl.mapping.peft import peft_name
from mcore_rl.mapping.peft_experts import experts_from_peft, peft_keys
from mcore_rl.mapping.weights import WeightMap

Tensor = torch.Tensor
CONFIG_FILE = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
_EXPERT_SITE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")


@dataclass(frozen=True)
class SitePlan:
    """One linear's imported adapter: full (TP=1 megatron layout) A [R, in] and B [out, R],
    the scaling of ``B A``, and the canonical parts (() for a fused adapter) of rank ``part_rank``."""

    A: Tensor
    B: Tensor
    scaling: float
    parts: tuple[int, ...]
    part_rank: int


@dataclass
class PeftAdapter:
    """The adapter's config (JSON, checked) and its tensors (read on demand); ``expert_parts``:
    the routed-expert parts it adapts (set by ``check_against``)."""

    path: str
    config: dict
    tensors: Mapping[str, Tensor]
    expert_parts: tuple[str, ...] = ()

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """(r, scaling) of the HF module ``module`` (e.g. 'model.layers.0.self_attn.q_proj')."""
        r = _pattern(self.config.get("rank_pattern") or {}, module, self.config.get("r", 8))
        alpha = _pattern(self.config.get("alpha_pattern") or {}, module, self.config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r
        return int(r), float(scale)

    def check_against(self, wmap: WeightMap, linears) -> None:
        """Refuses tensors and targets that do not fit the whole model (``peft_check``)."""
        self.expert_parts = check_adapter_names(self.config, list(self.tensors), self.path, wmap, linears)

    def factor(self, key: str, shape: tuple[int, int]) -> Tensor:
        """The tensor ``key`` as fp32, refused unless it is a finite floating tensor of ``shape``."""
        tensor = self.tensors[key]
        if not tensor.is_floating_point():
            raise PeftAdapterError(f"{self.path}: {key} has dtype {tensor.dtype}; LoRA factors are floating point.")
        if tuple(tensor.shape) != tuple(shape):
            raise PeftAdapterError(f"{self.path}: {key} has shape {list(tensor.shape)}, the model and the config's "
                                   f"rank need {list(shape)}; the adapter does not belong to this model or is damaged.")
        tensor = tensor.float()
        if not torch.isfinite(tensor).all():
            raise PeftAdapterError(f"{self.path}: {key} holds NaN or infinite values; the adapter is damaged.")
        return tensor


def _pattern(patterns: dict, module: str, default):
    """peft's rule: the first key whose regular expression matches the end of ``module`` after a dot."""
    for key, value in patterns.items():
        if re.match(suffix_pattern(key), module):
            return value
    return default


def read_peft_adapter(path: str) -> PeftAdapter:
    """The adapter at ``path``, its config checked (``peft_check.check_adapter_config``)."""
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise PeftAdapterError(f"lora.adapter_path={path!r}: {CONFIG_FILE} is not readable JSON "
                               f"({type(e).__name__}: {e}); point adapter_path at a PEFT adapter directory.") from None
    check_adapter_config(config, config_path)
    if not os.path.isfile(os.path.join(path, ADAPTER_FILE)):
        raise PeftAdapterError(f"lora.adapter_path={path!r} holds no {ADAPTER_FILE} (a .bin adapter: save it with "
                               "save_pretrained(..., safe_serialization=True)); point adapter_path at a PEFT adapter "
                               "directory.")
    return PeftAdapter(path, config, SafetensorsReader(path))


def plan_site(adapter: PeftAdapter, wmap: WeightMap, site: str, lora_type: str, expert_cache: dict,
              full_shape: tuple[int, int]) -> SitePlan | None:
    """The imported adapter of the megatron linear ``site`` (canonical name) whose full weight is
    ``full_shape`` [out, in], or None when the adapter has none for it. Every factor is checked
    against the piece it adapts: A [r, in], B [rows of the piece, r] (r of its module)."""
    hf_weights, transform = wmap.rule(site + ".weight")
    if transform.expert:
        return _expert_plan(adapter, site, wmap, expert_cache, full_shape)
    present = [i for i, n in enumerate(hf_weights) if peft_name(n, "A") in adapter.tensors]
    if not present:
        return None
    rows = [p.shape[0] for p in transform.to_hf(torch.empty(full_shape[0], 1, device="meta"), wmap.dims)]
    modules = [hf_weights[i][: -len(".weight")] for i in present]
    ranks = [adapter.rank_alpha(m) for m in modules]
    pieces_a = [adapter.factor(peft_name(hf_weights[i], "A"), (r, full_shape[1])) for i, (r, _) in zip(present, ranks)]
    pieces_b = {i: adapter.factor(peft_name(hf_weights[i], "B"), (rows[i], r)) for i, (r, _) in zip(present, ranks)}
    scaling = ranks[0][1]
    if lora_type == "canonical_lora" and len(hf_weights) > 1:
        if len({r for r in ranks}) != 1:
            raise PeftAdapterError(f"{adapter.path}: {modules} have ranks/scalings {ranks}; canonical_lora needs one "
                                   "rank and alpha per fused linear: import with lora.type='lora'.")
        r = ranks[0][0]
        blocks = [torch.zeros(n, r * len(present)) for n in rows]  # host: full factors from the file, sharded and copied later
        for j, i in enumerate(present):
            blocks[i][:, j * r:(j + 1) * r] = pieces_b[i]
        return SitePlan(torch.cat(pieces_a), transform.to_mcore(blocks, wmap.dims), scaling, tuple(present), r)
    total = sum(r for r, _ in ranks)
    blocks, col = [torch.zeros(n, total) for n in rows], 0  # host: full factors from the file, sharded and copied later
    for (r, s), i in zip(ranks, present):
        blocks[i][:, col:col + r] = pieces_b[i] * (s / scaling)  # alpha != 0: peft_check
        col += r
    return SitePlan(torch.cat(pieces_a), transform.to_mcore(blocks, wmap.dims), scaling, (), total)


def _expert_plan(adapter: PeftAdapter, site: str, wmap: WeightMap, cache: dict,
                 full_shape: tuple[int, int]) -> SitePlan | None:
    """A routed expert's adapter from peft's per-layer expert tensors (target_parameters):
    A [E*r, in] and B [out, r*E] of its layer and part, checked against ``full_shape`` [out, in]."""
    m = _EXPERT_SITE.match(site)
    layer, expert, part = int(m[1]), int(m[2]), {"linear_fc1": "gate_up", "linear_fc2": "down"}[m[3]]
    parts = adapter.expert_parts
    if part not in parts:
        return None
    if adapter.config.get("rank_pattern") and any("experts" in k for k in adapter.config["rank_pattern"]):
        raise PeftAdapterError(f"{adapter.path}: rank_pattern for the experts is not supported; use one r.")
    r, scaling = adapter.rank_alpha(f"model.layers.{layer}.mlp.experts")
    if (layer, part) not in cache:
        key_a, key_b = peft_keys(f"model.layers.{layer}", wmap.model_type, parts)[part]
        num = wmap.num_experts
        checked = {key_a: adapter.factor(key_a, (num * r, full_shape[1])),
                   key_b: adapter.factor(key_b, (full_shape[0], r * num))}
        cache[(layer, part)] = experts_from_peft(f"model.layers.{layer}", checked, wmap.model_type, r, parts, only=part)
    a, b = cache[(layer, part)][expert][part]
    return SitePlan(a, b, scaling, (), r)
