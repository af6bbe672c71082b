"""LoRA settings (verl's ``model.lora`` keys and meanings) and which linears they target.

Target names are matched against *canonical* module names: global layer and global expert
indices, checkpoint spelling, e.g. ``decoder.layers.3.self_attention.linear_qkv`` or
``decoder.layers.1.mlp.experts.local_experts.5.linear_fc1`` — so ``*.layers.0.*`` means the same
layer at every pipeline and expert-parallel layout. A target without ``*``/``?``/``.`` names the
module's last component (``linear_fc1`` = dense MLP, shared experts and routed experts alike); a
target with wildcards or dots is an ``fnmatch`` pattern over the whole name (``*.mlp.linear_fc1``:
dense MLPs only; ``*.shared_experts.*``; ``*.local_experts.*``). An empty ``target_modules`` adapts
every linear except those ``exclude_modules`` names (which needs the empty target list).
Canonical LoRA (``type='canonical_lora'``) targets the parts of the fused linears:
``linear_q``/``linear_k``/``linear_v`` (of ``linear_qkv``; gated attention's ``linear_q`` is HF's
``q_proj``, query and gate rows), ``linear_fc1_gate``/``linear_fc1_up`` (of ``linear_fc1``) and the
HF projections a Gated DeltaNet's ``in_proj`` fuses, named as HF names them (Qwen3.5:
``in_proj_qkv``/``in_proj_z``/``in_proj_b``/``in_proj_a``; Qwen3-Next: ``in_proj_qkvz``/
``in_proj_ba``), each part with its own rank-``rank`` adapter.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass, fields
from typing import Any, Literal

from mcore_rl.errors import McoreRLError

# the linears an adapter can sit on (the last component of a canonical module name)
ATTENTION_LINEARS = ("linear_qkv", "linear_proj")
MLA_LINEARS = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
               "linear_kv_up_proj")
# Gated DeltaNet layers (hybrid models): the fused input projection and the output projection
GDN_LINEARS = ("in_proj", "out_proj")
MLP_LINEARS = ("linear_fc1", "linear_fc2")
LINEARS = ATTENTION_LINEARS + MLA_LINEARS + GDN_LINEARS + MLP_LINEARS
# canonical LoRA: part name -> (fused linear, part index among that linear's parts)
CANONICAL_PARTS = {
    "linear_q": ("linear_qkv", 0), "linear_k": ("linear_qkv", 1), "linear_v": ("linear_qkv", 2),
    "linear_fc1_gate": ("linear_fc1", 0), "linear_fc1_up": ("linear_fc1", 1),
}
PART_COUNT = {"linear_qkv": 3, "linear_fc1": 2}
# canonical LoRA on GDN's in_proj: its parts are the model's HF pieces of it (the mapping table's
# row), so their number and order depend on the architecture (Qwen3.5's four, Qwen3-Next's two)
GDN_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "in_proj_qkvz", "in_proj_ba")
INIT_METHODS = ("xavier", "kaiming", "normal", "zero")
REFUSED_TYPES = {
    "dora": "DoRA's magnitude vectors are not implemented",
    "vlm_lora": "mcore_rl builds language models only",
}
DEFAULT_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


class LoraConfigError(McoreRLError, ValueError):
    """A LoRA setting mcore_rl cannot honour; the message names the key, the value and the fix."""


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters on the frozen base's linears: ``y = W x + (alpha / rank) * B A x``.

    ``rank`` 0 turns LoRA off. ``dropout`` on the adapter's input (``dropout_position='pre'``)
    or on ``A x`` ('post'). Init methods for A and B: 'xavier' (normal), 'kaiming' (uniform,
    a=sqrt(5), peft's default for A), 'normal' (std 0.02), 'zero'. Every full adapter is drawn
    from a generator seeded by ``seed`` and its canonical name, then split: all layouts start
    from the same adapters. ``dtype``: None (the model's) or 'float32'/'bfloat16'/'float16'.
    ``adapter_path``: a PEFT adapter directory to start from. ``merge``: weight sync sends
    merged weights (else verl's adapter-only protocol after the first sync).
    """

    type: Literal["lora", "canonical_lora"] = "lora"
    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    dropout_position: Literal["pre", "post"] = "pre"
    lora_A_init_method: str = "xavier"
    lora_B_init_method: str = "zero"
    dtype: str | None = None
    target_modules: tuple[str, ...] = DEFAULT_TARGETS
    exclude_modules: tuple[str, ...] = ()
    adapter_path: str | None = None
    merge: bool = False
    seed: int = 0

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_modules", tuple(self.target_modules or ()))
        object.__setattr__(self, "exclude_modules", tuple(self.exclude_modules or ()))
        if self.type in REFUSED_TYPES:
            raise LoraConfigError(f"lora.type={self.type!r}: {REFUSED_TYPES[self.type]}; use 'lora' or "
                                  "'canonical_lora'.")
        if self.type not in ("lora", "canonical_lora"):
            raise LoraConfigError(f"lora.type={self.type!r}; use 'lora' (fused) or 'canonical_lora'.")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise LoraConfigError(f"lora.rank={self.rank!r} must be an int >= 0 (0 turns LoRA off).")
        if not self.enabled:
            return
        if not self.alpha > 0:
            raise LoraConfigError(f"lora.alpha={self.alpha!r} must be > 0 (scaling = alpha / rank).")
        if not 0.0 <= self.dropout < 1.0:
            raise LoraConfigError(f"lora.dropout={self.dropout!r} must lie in [0, 1).")
        if self.dropout_position not in ("pre", "post"):
            raise LoraConfigError(f"lora.dropout_position={self.dropout_position!r}; use 'pre' or 'post'.")
        for key in ("lora_A_init_method", "lora_B_init_method"):
            if getattr(self, key) not in INIT_METHODS:
                raise LoraConfigError(f"lora.{key}={getattr(self, key)!r}; use one of {list(INIT_METHODS)}.")
        if self.lora_A_init_method == "zero" and self.lora_B_init_method == "zero":
            raise LoraConfigError("lora.lora_A_init_method and lora_B_init_method are both 'zero': A and B "
                                  "would get no gradient; use 'xavier' for A.")
        if self.dtype not in (None, "float32", "bfloat16", "float16", "fp32", "bf16", "fp16"):
            raise LoraConfigError(f"lora.dtype={self.dtype!r}; use null (the model's), 'float32', "
                                  "'bfloat16' or 'float16'.")
        if self.exclude_modules and self.target_modules:
            raise LoraConfigError(f"lora.exclude_modules={list(self.exclude_modules)} needs an empty "
                                  f"target_modules (got {list(self.target_modules)}); set target_modules=[] "
                                  "to adapt every linear but the excluded ones.")
        self._check_names()

    def _check_names(self) -> None:
        parts = tuple(CANONICAL_PARTS) + GDN_PARTS
        plain = LINEARS + parts if self.type == "canonical_lora" else LINEARS
        for key in ("target_modules", "exclude_modules"):
            for name in getattr(self, key):
                if key == "target_modules" and ("visual" in name.lower() or "vision" in name.lower()):
                    raise LoraConfigError(f"lora.target_modules entry {name!r} names a vision tower: mcore_rl builds "
                                          "and trains the language model of a vision-language checkpoint only (its "
                                          "vision tower is carried through untouched); drop it.")
                if "router" in name:
                    raise LoraConfigError(f"lora.{key} entry {name!r}: adapters on MoE routers are not "
                                          "supported; drop it.")
                if _is_pattern(name):
                    continue
                if key == "exclude_modules" and name in parts:
                    raise LoraConfigError(f"lora.exclude_modules entry {name!r} is a part of a fused linear; "
                                          "exclude_modules leaves out whole linears: list the parts to adapt in "
                                          "target_modules instead.")
                if self.type == "lora" and name in parts:
                    whole = CANONICAL_PARTS[name][0] if name in CANONICAL_PARTS else "in_proj"
                    raise LoraConfigError(f"lora.{key} entry {name!r} is a canonical_lora part; with "
                                          f"type='lora' target {whole!r}, or set type='canonical_lora'.")
                if name not in plain:
                    raise LoraConfigError(f"lora.{key} entry {name!r} names no linear; use one of "
                                          f"{list(plain)} or a pattern such as '*.layers.0.*.linear_qkv'.")

    def parts(self, module_name: str, pieces: tuple[str, ...] = ()) -> tuple[int, ...] | None:
        """The adapted parts of the linear ``module_name`` (canonical): None when it gets no
        adapter, () for a whole-linear (fused) adapter, part indices for canonical LoRA.
        ``pieces``: the HF module names (last components) of the linear's pieces, which name a
        GDN in_proj's canonical parts (``in_proj_z`` ...)."""
        if not self.enabled:
            return None
        last = module_name.rsplit(".", 1)[-1]
        if last not in LINEARS:
            return None
        if not self.target_modules:  # every linear but the excluded ones
            if any(_matches(p, module_name, last) for p in self.exclude_modules):
                return None
            return self._whole(last, pieces)
        count = _part_count(last, pieces)
        if self.type == "canonical_lora" and count:
            if last == "in_proj":
                hit = [i for i, piece in enumerate(pieces) if piece in self.target_modules]
            else:
                hit = [CANONICAL_PARTS[t][1] for t in self.target_modules if t in CANONICAL_PARTS
                       and CANONICAL_PARTS[t][0] == last]
            pattern_hit = [t for t in self.target_modules if _is_pattern(t) and _matches(t, module_name, last)]
            if pattern_hit or last in self.target_modules:
                return tuple(range(count))
            return tuple(sorted(set(hit))) or None
        if any(_matches(t, module_name, last) for t in self.target_modules):
            return self._whole(last, pieces)
        return None

    def _whole(self, last: str, pieces: tuple[str, ...]) -> tuple[int, ...]:
        count = _part_count(last, pieces)
        if self.type == "canonical_lora" and count:
            return tuple(range(count))
        return ()


def _part_count(last: str, pieces: tuple[str, ...]) -> int:
    """How many canonical parts the linear ``last`` has (0: none, one adapter for the whole)."""
    if last == "in_proj":
        return len(pieces) if len(pieces) > 1 else 0
    return PART_COUNT.get(last, 0)


def _is_pattern(name: str) -> bool:
    return any(c in name for c in "*?[.")


def _matches(target: str, module_name: str, last: str) -> bool:
    if _is_pattern(target):
        return fnmatch.fnmatchcase(module_name, target)
    return target == last


def lora_config_from_dict(values: dict[str, Any] | None) -> LoraConfig:
    """LoraConfig from verl's ``model.lora`` dict (or the main job's ``actor.lora``); unknown keys
    are refused by name. verl-only keys without meaning here are accepted at their defaults."""
    values = dict(values or {})
    ignored_defaults = {"a2a_experimental": False, "freeze_vision_model": True, "freeze_vision_projection": True,
                        "freeze_language_model": True}
    for key, default in ignored_defaults.items():
        if key in values and values.pop(key) not in (default, None):
            raise LoraConfigError(f"lora.{key} is not supported by mcore_rl; leave it at {default}.")
    known = {f.name for f in fields(LoraConfig)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise LoraConfigError(f"unknown lora key(s) {unknown}; known keys: {sorted(known)}.")
    for key in ("target_modules", "exclude_modules"):
        if key in values and values[key] is not None and isinstance(values[key], str):
            values[key] = (values[key],)
    return LoraConfig(**values)
