"""Routed-expert LoRA factors <-> PEFT adapter tensors (peft 0.21 on transformers 5.x), pure tensors.

Ours: one adapter per expert linear, ``delta W_e = s * B_e @ A_e`` (s = alpha / r, W in HF
orientation [out, in]): ``gate_up`` (fc1) A_e [r, h], B_e [2f, r] with rows [gate; up];
``down`` (fc2) A_e [r, f], B_e [h, r].

transformers 5.x stores a layer's experts as 3D parameters of ``mlp.experts``: ``gate_up_proj``
[E, 2f, h] (rows [gate; up], split by ``chunk(2)``) and ``down_proj`` [E, h, f]. peft adapts them
with ``LoraConfig(target_parameters=...)``: one ``ParamWrapper`` per targeted parameter, nested
in the parameters' registration order (the first is innermost, so with both targeted gate_up's
adapter lives under ``mlp.experts.base_layer`` and down's under ``mlp.experts``). Its tensors:
``lora_A.weight`` [E*r, in] expert-outer (rows e*r .. e*r+r-1 are A_e) and ``lora_B.weight``
[out, r*E] expert-inner (column k*E + e is column k of B_e); peft needs ``lora_dropout`` 0 there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch

from mcore_rl.errors import McoreRLError

Tensor = torch.Tensor
FactorPair = tuple[Tensor, Tensor]  # (A [r, in], B [out, r])
LayerFactors = dict[int, dict[str, FactorPair]]  # expert -> part ("gate_up" | "down") -> (A, B)
PEFT_PREFIX = "base_model.model."


class PeftExpertsError(McoreRLError, ValueError):
    """Expert LoRA factors or PEFT tensors that cannot be converted; the message names the fix."""


@dataclass(frozen=True)
class ExpertLayout:
    """Where a model type keeps its fused experts and in which order.

    ``params``: our part -> the 3D parameter of ``experts_module``, in registration order (peft's
    nesting order). ``fc1_halves``: the order of the gate and up row blocks in ``gate_up_proj``.
    """

    experts_module: str
    params: tuple[tuple[str, str], ...]
    fc1_halves: tuple[str, str]


@dataclass(frozen=True)
class ModelEntry:
    """A model type's expert layout and the ``target_modules`` names peft 0.21 rewrites into
    ``target_parameters`` for it (``_MOE_TARGET_MODULE_MAPPING``): listing any of them would
    double gate_up's rank through ``rank_pattern`` and drop dense-MLP/shared-expert LoRA."""

    layout: ExpertLayout
    rewritten_targets: tuple[str, ...]


FUSED_3D = ExpertLayout(
    experts_module="mlp.experts",
    params=(("gate_up", "gate_up_proj"), ("down", "down_proj")),
    fc1_halves=("gate", "up"),
)
_QWEN2_MOE_NAMES = ("gate", "gate_proj", "up_proj", "down_proj")
MODEL_TYPES: dict[str, ModelEntry] = {
    "qwen3_moe": ModelEntry(FUSED_3D, _QWEN2_MOE_NAMES),
    "qwen2_moe": ModelEntry(FUSED_3D, ()),  # not in transformers' conversion table: never rewritten
    "mixtral": ModelEntry(FUSED_3D, ("gate", "w1", "w2", "w3")),
    "deepseek_v3": ModelEntry(FUSED_3D, _QWEN2_MOE_NAMES),
    "glm4_moe": ModelEntry(FUSED_3D, _QWEN2_MOE_NAMES),
    "qwen3_next": ModelEntry(FUSED_3D, _QWEN2_MOE_NAMES),
    "qwen3_5_moe_text": ModelEntry(FUSED_3D, ()),  # transformers converts only its prefix: never rewritten
}


def _entry(model_type: str) -> ModelEntry:
    if model_type not in MODEL_TYPES:
        raise PeftExpertsError(
            f"PEFT expert LoRA: model_type {model_type!r} has no expert layout; supported: "
            f"{sorted(MODEL_TYPES)}. Export this model's adapters merged instead."
        )
    return MODEL_TYPES[model_type]


def _check_parts(layout: ExpertLayout, parts: Sequence[str]) -> tuple[str, ...]:
    """``parts`` in the layout's registration order; unknown or repeated parts are refused."""
    known = [p for p, _ in layout.params]
    if not parts or len(set(parts)) != len(parts) or not set(parts) <= set(known):
        raise PeftExpertsError(f"PEFT expert LoRA: parts {list(parts)} must be distinct and among {known}")
    return tuple(p for p in known if p in parts)


def peft_keys(layer_prefix: str, model_type: str, parts: Sequence[str]) -> dict[str, tuple[str, str]]:
    """part -> (lora_A key, lora_B key) as ``get_peft_model_state_dict`` names them.

    ``layer_prefix``: the HF decoder layer's module path, e.g. ``model.layers.3``. ``parts``: the
    targeted parts of every MoE layer (peft wraps the same parameters in all of them).
    """
    layout = _entry(model_type).layout
    ordered = _check_parts(layout, parts)
    keys = {}
    for i, part in enumerate(ordered):
        base = f"{PEFT_PREFIX}{layer_prefix}.{layout.experts_module}." + "base_layer." * (len(ordered) - 1 - i)
        keys[part] = (f"{base}lora_A.weight", f"{base}lora_B.weight")
    return keys


def check_peft_targets(model_type: str, target_modules: Sequence[str]) -> None:
    """Refuses ``target_modules`` names that peft 0.21 rewrites into expert ``target_parameters``
    for ``model_type`` (then gate_up's rank is doubled and dense-MLP / shared-expert LoRA
    dropped), with or without expert adapters; model types without fused experts pass."""
    if isinstance(target_modules, str):
        raise PeftExpertsError(f"PEFT expert LoRA: target_modules must be a list of names, got {target_modules!r}")
    entry = MODEL_TYPES.get(model_type)
    rewritten = entry.rewritten_targets if entry else ()
    bad = [t for t in target_modules for n in rewritten if t == n or t.endswith(f".{n}")]
    if bad:
        raise PeftExpertsError(
            f"PEFT expert LoRA: target_modules {bad} of a {model_type} adapter would be rewritten by peft "
            f"into expert target_parameters (gate_up rank doubled, dense-MLP and shared-expert LoRA dropped); "
            f"names {list(rewritten)} cannot be exported: drop them or export merged weights."
        )


def peft_config_entries(model_type: str, parts: Sequence[str] = ("gate_up", "down"),
                        target_modules: Sequence[str] = ()) -> dict[str, object]:
    """The adapter_config.json entries the experts need: ``target_parameters``, ``lora_dropout``
    0 (peft's ParamWrapper refuses anything else) and ``target_modules`` (the caller's non-expert
    targets, checked: names peft would rewrite for this model type are refused)."""
    entry = _entry(model_type)
    check_peft_targets(model_type, target_modules)
    layout = entry.layout
    names = dict(layout.params)
    params = [f"{layout.experts_module}.{names[p]}" for p in _check_parts(layout, parts)]
    return {"target_modules": list(target_modules), "target_parameters": params, "lora_dropout": 0.0}


def _fc1_rows(b: Tensor, src: tuple[str, str], dst: tuple[str, str]) -> Tensor:
    """B [2f, r] with row halves ordered ``src`` -> the same rows ordered ``dst``."""
    if src == dst:
        return b
    halves = dict(zip(src, b.chunk(2, dim=0)))
    return torch.cat([halves[name] for name in dst], dim=0)


def _experts_of(factors: Mapping[int, Mapping[str, FactorPair]], layer_prefix: str) -> int:
    num = len(factors)
    if num == 0 or sorted(factors) != list(range(num)):
        raise PeftExpertsError(
            f"PEFT expert LoRA: layer {layer_prefix} has factors for experts {sorted(factors)}; "
            f"every expert 0..E-1 of the layer is needed (PEFT stores all experts in one tensor)"
        )
    return num


def experts_to_peft(layer_prefix: str, factors: Mapping[int, Mapping[str, FactorPair]],
                    model_type: str, named_parts: Sequence[str] | None = None) -> dict[str, Tensor]:
    """One layer's per-expert factors -> its PEFT state-dict entries (exact copies).

    ``factors``: {e: {"gate_up": (A [r, h], B [2f, r] rows [gate; up]), "down": (A [r, f],
    B [h, r])}} for every expert e of the layer, all with the same parts and rank r. Returns
    {lora_A key: [E*r, in] expert-outer, lora_B key: [out, r*E] expert-inner} per part, named
    as peft nests ``named_parts`` (the model's adapted parts; default: this layer's).
    """
    num = _experts_of(factors, layer_prefix)
    parts = tuple(factors[0])
    layout = _entry(model_type).layout
    named = peft_keys(layer_prefix, model_type, named_parts or parts)
    if not set(parts) <= set(named):
        raise PeftExpertsError(f"PEFT expert LoRA: layer {layer_prefix} has parts {sorted(parts)} outside "
                               f"{sorted(named)}")
    keys = {part: named[part] for part in parts}
    for e in range(num):
        if set(factors[e]) != set(parts):
            raise PeftExpertsError(
                f"PEFT expert LoRA: layer {layer_prefix} expert {e} has parts {sorted(factors[e])}, "
                f"expert 0 has {sorted(parts)}; peft adapts the same parameters for every expert"
            )
    ranks = {part: factors[0][part][0].shape[0] for part in parts}
    if len(set(ranks.values())) != 1:
        raise PeftExpertsError(
            f"PEFT expert LoRA: layer {layer_prefix} has ranks {ranks}; one LoraConfig.r covers them all "
            f"(no rank_pattern is written): give every part the same rank"
        )
    out: dict[str, Tensor] = {}
    for part, (key_a, key_b) in keys.items():
        pairs = [factors[e][part] for e in range(num)]
        _check_shapes(pairs, f"{layer_prefix} {part}")
        b_s = [b for _, b in pairs]
        if part == "gate_up":
            b_s = [_fc1_rows(b, ("gate", "up"), layout.fc1_halves) for b in b_s]
        out[key_a] = torch.cat([a for a, _ in pairs], dim=0).contiguous()  # [E*r, in] expert-outer
        out[key_b] = torch.stack(b_s, dim=-1).flatten(1).contiguous()  # [out, r, E] -> [out, r*E]
    return out


def _check_shapes(pairs: list[FactorPair], where: str) -> None:
    a0, b0 = pairs[0]
    for e, (a, b) in enumerate(pairs):
        if a.dim() != 2 or b.dim() != 2 or a.shape != a0.shape or b.shape != b0.shape or a.shape[0] != b.shape[1]:
            raise PeftExpertsError(
                f"PEFT expert LoRA: {where} expert {e} has A {tuple(a.shape)}, B {tuple(b.shape)}; expected "
                f"A [r, in], B [out, r] equal for every expert (expert 0: A {tuple(a0.shape)}, B {tuple(b0.shape)})"
            )


def experts_from_peft(layer_prefix: str, state_dict: Mapping[str, Tensor], model_type: str, rank: int,
                      parts: Sequence[str] = ("gate_up", "down"), only: str | None = None) -> LayerFactors:
    """Inverse of ``experts_to_peft``: one layer's PEFT tensors -> {e: {part: (A [r, in], B [out, r])}}.

    ``rank``: the adapter's ``r``; ``parts``: the targeted parts (from adapter_config.json's
    ``target_parameters``; the key names alone cannot tell a lone gate_up from a lone down);
    ``only``: convert that part alone (the keys still named as ``parts`` nest them).
    """
    layout = _entry(model_type).layout
    factors: LayerFactors = {}
    for part, (key_a, key_b) in peft_keys(layer_prefix, model_type, parts).items():
        if only is not None and part != only:
            continue
        missing = [k for k in (key_a, key_b) if k not in state_dict]
        if missing:
            raise PeftExpertsError(f"PEFT expert LoRA: {missing} not in the adapter's tensors (parts {list(parts)})")
        a, b = state_dict[key_a], state_dict[key_b]
        if rank <= 0 or a.dim() != 2 or b.dim() != 2 or a.shape[0] % rank or a.shape[0] != b.shape[1]:
            raise PeftExpertsError(
                f"PEFT expert LoRA: {key_a} {tuple(a.shape)} and {key_b} {tuple(b.shape)} are not "
                f"[E*r, in] and [out, r*E] for r={rank}: check the adapter's r"
            )
        num = a.shape[0] // rank
        if factors and len(factors) != num:
            raise PeftExpertsError(f"PEFT expert LoRA: {key_a} holds {num} experts, other parts {len(factors)}")
        b3 = b.reshape(b.shape[0], rank, num)  # [out, r, E]
        for e in range(num):
            b_e = b3[:, :, e]
            if part == "gate_up":
                b_e = _fc1_rows(b_e, layout.fc1_halves, ("gate", "up"))
            factors.setdefault(e, {})[part] = (a[e * rank:(e + 1) * rank].clone(), b_e.contiguous().clone())
    return factors
