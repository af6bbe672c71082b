"""A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) as
full megatron-layout adapters, one plan per adapted linear.

Fused type: the HF pieces of one megatron linear (q, k, v / gate, up) become one adapter by rank
expansion: A = the pieces' A stacked, B = the pieces' B block-diagonal in the weight's row order,
each block scaled by its piece's ``alpha_p / r_p`` over the site's scaling (the first piece's), so
``s B A`` equals the sum of the pieces' deltas. Canonical type: the pieces stay separate parts
(one rank each; every part of a linear needs the same rank and alpha). ``rank_pattern`` and
``alpha_pattern`` are honoured (a key matches a module name that equals it or ends in
``.<key>``); ``use_rslora`` scales by ``alpha / sqrt(r)``. Routed experts come in peft's
``target_parameters`` layout (mapping/peft_experts.py).
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from typing import Mapping

import torch

from mcore_rl.errors import McoreRLError
from mcore_rl.mapping.hf_io import SafetensorsReader
from mcore_rl.mapping.peft import peft_name
from mcore_rl.mapping.peft_experts import experts_from_peft
from mcore_rl.mapping.weights import WeightMap

Tensor = torch.Tensor
CONFIG_FILE = "adapter_config.json"
_EXPERT_SITE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")
_REFUSED = {  # adapter_config key -> (value it must have, why)
    "use_dora": (False, "DoRA's magnitude vectors are not implemented"),
    "fan_in_fan_out": (False, "transposed (Conv1D) weights are not megatron linears"),
    "bias": ("none", "adapter biases are not implemented"),
    "modules_to_save": (None, "full copies of modules are not LoRA adapters"),
    "layers_to_transform": (None, "restrict layers with lora.target_modules patterns instead"),
    "layer_replication": (None, "layer replication is not supported"),
}


class PeftAdapterError(McoreRLError, ValueError):
    """A PEFT adapter mcore_rl cannot import; the message names the file, the value and the fix."""


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
    """The adapter's config (JSON) and its tensors (read on demand)."""

    path: str
    config: dict
    tensors: Mapping[str, Tensor]

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """(r, scaling) of the HF module ``module`` (e.g. 'model.layers.0.self_attn.q_proj')."""
        r = _pattern(self.config.get("rank_pattern") or {}, module, self.config.get("r", 8))
        alpha = _pattern(self.config.get("alpha_pattern") or {}, module, self.config.get("lora_alpha", 8))
        scale = alpha / math.sqrt(r) if self.config.get("use_rslora") else alpha / r
        return int(r), float(scale)


def _pattern(patterns: dict, module: str, default):
    for key, value in patterns.items():
        if module == key or module.endswith("." + key) or re.fullmatch(rf"(.*\.)?{key}", module):
            return value
    return default


def read_peft_adapter(path: str) -> PeftAdapter:
    """The adapter at ``path``, its config checked (LoRA, no DoRA/biases/modules_to_save)."""
    config_path = os.path.join(path, CONFIG_FILE)
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise PeftAdapterError(f"lora.adapter_path={path!r}: {CONFIG_FILE} is not readable JSON "
                               f"({type(e).__name__}: {e}); point adapter_path at a PEFT adapter directory.") from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise PeftAdapterError(f"{config_path}: peft_type {config.get('peft_type') if isinstance(config, dict) else config!r} "
                               "is not LORA; only LoRA adapters import.")
    for key, (allowed, why) in _REFUSED.items():
        value = config.get(key, allowed)
        if value != allowed and not (allowed is None and not value):
            raise PeftAdapterError(f"{config_path}: {key}={value!r} ({why}); export the adapter without it.")
    return PeftAdapter(path, config, SafetensorsReader(path))


def plan_site(adapter: PeftAdapter, wmap: WeightMap, site: str, lora_type: str,
              expert_cache: dict) -> SitePlan | None:
    """The imported adapter of the megatron linear ``site`` (canonical name), or None when the
    adapter has none for it."""
    hf_weights, transform = wmap.rule(site + ".weight")
    if transform.expert:
        return _expert_plan(adapter, site, wmap.model_type, expert_cache)
    present = [i for i, n in enumerate(hf_weights) if peft_name(n, "A") in adapter.tensors]
    if not present:
        return None
    modules = [hf_weights[i][: -len(".weight")] for i in present]
    ranks = [adapter.rank_alpha(m) for m in modules]
    pieces_a = [_tensor(adapter, peft_name(hf_weights[i], "A")) for i in present]
    pieces_b = {i: _tensor(adapter, peft_name(hf_weights[i], "B")) for i in present}
    for m, (r, _), a in zip(modules, ranks, pieces_a):
        if a.shape[0] != r:
            raise PeftAdapterError(f"{adapter.path}: {m}.lora_A has {a.shape[0]} rows, the config says r={r}; "
                                   "the adapter's config does not match its tensors.")
    rows = _piece_rows(transform.name, wmap, len(hf_weights), next(iter(pieces_b.values())).shape[0])
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
        blocks[i][:, col:col + r] = pieces_b[i] * (s / scaling)
        col += r
    return SitePlan(torch.cat(pieces_a), transform.to_mcore(blocks, wmap.dims), scaling, (), total)


def _piece_rows(name: str, wmap: WeightMap, count: int, present_rows: int) -> list[int]:
    """Rows of each HF piece of a weight (q, k, v from the dims; gate and up alike)."""
    if count == 1:
        return [present_rows]
    if name == "qkv":
        d = wmap.dims
        return [d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim, d.num_kv_heads * d.head_dim]
    return [present_rows] * count


def _expert_plan(adapter: PeftAdapter, site: str, model_type: str, cache: dict) -> SitePlan | None:
    """A routed expert's adapter from peft's per-layer expert tensors (target_parameters)."""
    m = _EXPERT_SITE.match(site)
    layer, expert, part = int(m[1]), int(m[2]), {"linear_fc1": "gate_up", "linear_fc2": "down"}[m[3]]
    targets = [t.rsplit(".", 1)[-1] for t in adapter.config.get("target_parameters") or []]
    parts = tuple(p for p, param in (("gate_up", "gate_up_proj"), ("down", "down_proj")) if param in targets)
    if part not in parts:
        return None
    if adapter.config.get("rank_pattern") and any("experts" in k for k in adapter.config["rank_pattern"]):
        raise PeftAdapterError(f"{adapter.path}: rank_pattern for the experts is not supported; use one r.")
    if layer not in cache:
        r, _ = adapter.rank_alpha(f"model.layers.{layer}.mlp.experts")
        cache[layer] = experts_from_peft(f"model.layers.{layer}", adapter.tensors, model_type, r, parts)
    a, b = cache[layer][expert][part]
    r, scaling = adapter.rank_alpha(f"model.layers.{layer}.mlp.experts")
    return SitePlan(a.float(), b.float(), scaling, (), r)


def _tensor(adapter: PeftAdapter, key: str) -> Tensor:
    if key not in adapter.tensors:
        raise PeftAdapterError(f"{adapter.path}: {key} is missing (its lora_A is there); the adapter is incomplete.")
    return adapter.tensors[key].float()
