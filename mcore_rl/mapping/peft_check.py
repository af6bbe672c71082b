"""What a PEFT LoRA adapter must be before mcore_rl imports it: its ``adapter_config.json`` values
(types, ranks, patterns) and its tensor names, checked against the whole model (every layer,
whatever this rank's pipeline stage holds), so every tensor of the file is used or refused by name.

Targets follow peft: a ``target_modules`` list entry matches a HF module named like it or ending
in ``.<entry>``, a string is a regular expression over the whole module name, ``all-linear`` is
every linear but the output layer; ``exclude_modules`` alike. Routed experts are adapted through
``target_parameters`` (``mlp.experts.gate_up_proj`` / ``mlp.experts.down_proj``).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Collection, Iterable

from mcore_rl.errors import McoreRLError
from mcore_rl.mapping.peft_experts import MODEL_TYPES, peft_keys
from mcore_rl.mapping.weights import WeightMap

PEFT_PREFIX = "base_model.model."
FACTORS = ("lora_A.weight", "lora_B.weight")
# adapter_config key -> (value it must have, why)
REFUSED = {
    "use_dora": (False, "DoRA's magnitude vectors are not implemented"),
    "fan_in_fan_out": (False, "transposed (Conv1D) weights are not megatron linears"),
    "bias": ("none", "adapter biases are not implemented"),
    "lora_bias": (False, "adapter biases are not implemented"),
    "modules_to_save": (None, "full copies of modules are not LoRA adapters"),
    "trainable_token_indices": (None, "trainable token embeddings are not LoRA adapters"),
    "layers_to_transform": (None, "restrict layers with lora.target_modules patterns instead"),
    "layer_replication": (None, "layer replication is not supported"),
    "use_qalora": (False, "QA-LoRA's pooled inputs are not implemented"),
}


def suffix_pattern(key: str) -> str:
    """peft's rank_pattern / alpha_pattern rule: ``key`` matches the end of a module name after a dot."""
    return rf"(.*\.)?({key})$"


class PeftAdapterError(McoreRLError, ValueError):
    """A PEFT adapter mcore_rl cannot import; the message names the file, the value and the fix."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_alpha(value) -> bool:
    """A finite non-zero number (alpha 0: an adapter that neither contributes nor learns)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value != 0


def _check_regex(where: str, key: str, pattern, suffix: bool = False) -> None:
    """``pattern`` compiles (``suffix``: as peft matches pattern keys, the end of a module name)."""
    if not isinstance(pattern, str):
        raise PeftAdapterError(f"{where}: {key} entry {pattern!r} is not a string; write module names or "
                               "regular expressions.")
    try:
        re.compile(suffix_pattern(pattern) if suffix else pattern)
    except re.error as e:
        raise PeftAdapterError(f"{where}: {key} entry {pattern!r} is not a valid regular expression ({e}); "
                               "fix or drop it.") from None


def check_adapter_config(config, where: str) -> None:
    """Refuses an adapter_config.json (``where``: its path) mcore_rl cannot honour exactly: not
    LoRA, a refused feature, ``r`` not an int > 0, ``lora_alpha`` not a finite number, patterns
    with bad keys or values, targets of the wrong type."""
    if not isinstance(config, dict):
        raise PeftAdapterError(f"{where} holds {type(config).__name__} {str(config)[:60]!r}, not a JSON object; "
                               "point adapter_path at a PEFT adapter directory.")
    if config.get("peft_type", "LORA") != "LORA":
        raise PeftAdapterError(f"{where}: peft_type {config['peft_type']!r} is not LORA; only LoRA adapters import.")
    for key, (allowed, why) in REFUSED.items():
        value = config.get(key, allowed)
        if value != allowed and not (allowed is None and not value) and not (allowed is False and value is None):
            raise PeftAdapterError(f"{where}: {key}={value!r} ({why}); export the adapter without it.")
    r, alpha = config.get("r", 8), config.get("lora_alpha", 8)
    if not _is_int(r) or r <= 0:
        raise PeftAdapterError(f"{where}: r={r!r} must be an integer > 0 (the adapters' rank).")
    if not _is_alpha(alpha):
        raise PeftAdapterError(f"{where}: lora_alpha={alpha!r} must be a finite non-zero number (scaling = "
                               "lora_alpha / r).")
    if config.get("use_rslora", False) not in (True, False):
        raise PeftAdapterError(f"{where}: use_rslora={config['use_rslora']!r} must be true or false.")
    _check_patterns_and_targets(config, where)


def _check_patterns_and_targets(config: dict, where: str) -> None:
    """rank_pattern / alpha_pattern: valid regular expressions -> valid values; targets: lists
    of names (or one regular expression)."""
    for key, valid, what in (("rank_pattern", lambda v: _is_int(v) and v > 0, "an integer > 0"),
                             ("alpha_pattern", _is_alpha, "a finite non-zero number")):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict):
            raise PeftAdapterError(f"{where}: {key}={patterns!r} must be a mapping of module pattern -> value.")
        for pattern, value in patterns.items():
            _check_regex(where, key, pattern, suffix=True)
            if not valid(value):
                raise PeftAdapterError(f"{where}: {key}[{pattern!r}]={value!r} must be {what}.")
    for key in ("target_modules", "exclude_modules", "target_parameters"):
        value = config.get(key)
        if value is None or (isinstance(value, str) and key != "target_parameters"):
            if isinstance(value, str):
                _check_regex(where, key, value)
            continue
        if not isinstance(value, list):
            raise PeftAdapterError(f"{where}: {key}={value!r} must be a list of names"
                                   + ("" if key == "target_parameters" else " or one regular expression") + ".")
        for name in value:
            if not isinstance(name, str) or not name:
                raise PeftAdapterError(f"{where}: {key} entry {name!r} is not a module name.")


@dataclass(frozen=True)
class ModelModules:
    """The HF modules of a whole model an adapter may sit on: ``linears`` (dense linears, e.g.
    ``model.layers.0.self_attn.q_proj``), ``moe_layers`` (layers with routed experts)."""

    linears: tuple[str, ...]
    moe_layers: tuple[int, ...]


def model_modules(wmap: WeightMap, linears: Collection[str]) -> ModelModules:
    """The adaptable HF modules of the model ``wmap`` describes; ``linears``: the last components
    of the megatron linears that take adapters (``linear_qkv``, ...)."""
    names, moe = [], ()
    for template, (hf_templates, _) in wmap.rows.items():
        if not template.endswith(".weight") or template[: -len(".weight")].rsplit(".", 1)[-1] not in linears:
            continue
        if "{expert}" in template:
            moe = tuple(wmap.layers_for(template))
            continue
        for layer in wmap.layers_for(template):
            names.extend(t.format(layer=layer)[: -len(".weight")] for t in hf_templates)
    return ModelModules(tuple(sorted(set(names))), moe)


def matches(targets, module: str) -> bool:
    """peft's test: a list entry equal to ``module`` or its suffix after a dot; a string fully
    matching it as a regular expression; 'all-linear' (decoder linears)."""
    if targets is None:
        return False
    if isinstance(targets, str):
        return targets == "all-linear" or re.fullmatch(targets, module) is not None
    return any(module == t or module.endswith("." + t) for t in targets)


def _listed(names: Iterable[str], limit: int = 4) -> str:
    names = sorted(names)
    return f"{names[:limit]}" + (f" and {len(names) - limit} more" if len(names) > limit else "")


def expert_parts(config: dict, where: str, modules: ModelModules, model_type: str) -> tuple[str, ...]:
    """The routed-expert parts ('gate_up', 'down') ``target_parameters`` adapts; entries that
    name no expert parameter of this model are refused."""
    targets = config.get("target_parameters") or []
    if not targets:
        return ()
    if not modules.moe_layers or model_type not in MODEL_TYPES:
        raise PeftAdapterError(f"{where}: target_parameters {targets} adapt routed experts, which this "
                               f"{model_type} model has not (or has in no layout peft can adapt); drop them.")
    layout = MODEL_TYPES[model_type].layout
    parts = []
    for target in targets:
        hit = [p for p, param in layout.params if matches([target], f"{layout.experts_module}.{param}")
               or target.endswith(f".{layout.experts_module}.{param}")]
        if not hit:
            names = [f"{layout.experts_module}.{param}" for _, param in layout.params]
            raise PeftAdapterError(f"{where}: target_parameters entry {target!r} names no expert parameter of "
                                   f"this model; use {names}.")
        parts.extend(hit)
    return tuple(p for p, _ in layout.params if p in parts)


def check_adapter_names(config: dict, tensor_names: Collection[str], where: str, wmap: WeightMap,
                        linears: Collection[str]) -> tuple[str, ...]:
    """Every tensor of the adapter belongs to a targeted linear of the model, every targeted
    linear has both factors, every target matches; returns the adapted expert parts."""
    modules = model_modules(wmap, linears)
    supported = sorted({m.rsplit(".", 1)[-1] for m in modules.linears})
    targets, excluded = config.get("target_modules"), config.get("exclude_modules")
    if isinstance(targets, list):
        for t in targets:
            if not any(matches([t], m) for m in modules.linears):
                raise PeftAdapterError(f"{where}: target_modules entry {t!r} matches no linear mcore_rl can adapt "
                                       f"in this {wmap.model_type} model (lm_head and embeddings take no adapter); "
                                       f"supported targets: {supported}.")
    targeted = [m for m in modules.linears if matches(targets, m) and not matches(excluded, m)]
    parts = expert_parts(config, where, modules, wmap.model_type)
    if not targeted and not parts:
        raise PeftAdapterError(f"{where}: target_modules={targets!r} target no linear of this {wmap.model_type} "
                               f"model; supported targets: {supported}.")
    wanted = {f"{PEFT_PREFIX}{m}.{f}" for m in targeted for f in FACTORS}
    for layer in modules.moe_layers if parts else ():
        wanted.update(k for pair in peft_keys(f"model.layers.{layer}", wmap.model_type, parts).values() for k in pair)
    extra = set(tensor_names) - wanted
    if extra:
        untargeted = {f"{PEFT_PREFIX}{m}.{f}" for m in modules.linears for f in FACTORS}
        why = ("belong to linears adapter_config.json does not target (fix target_modules)" if extra <= untargeted
               else "name no linear mcore_rl can adapt in this model: it imports LoRA on the decoder's "
               f"linears {supported} and on routed experts (target_parameters), not on lm_head, embeddings "
               "(lora_embedding_A/B) or modules the model lacks")
        raise PeftAdapterError(f"{where}: tensors {_listed(extra)} {why}; remove them from the adapter.")
    missing = wanted - set(tensor_names)
    if missing:
        raise PeftAdapterError(f"{where}: tensors {_listed(missing)} are missing for the modules adapter_config.json "
                               "targets; the adapter is incomplete.")
    return parts
