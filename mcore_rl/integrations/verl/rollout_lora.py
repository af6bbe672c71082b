"""LoRA adapters served by the CPU rollout server (verl's unmerged weight sync, ``lora.merge=False``).

verl sends the base weights once (a full sync), then after each training step only the adapter
factors under PEFT names (``base_model.model.<module>.lora_A.weight`` [r, in],
``.lora_B.weight`` [out, r]) with a PEFT-config dict (``r``, ``lora_alpha``). As vLLM serves
LoRA, the server keeps the base weights untouched and adds the adapter at run time:
``y = W x + (lora_alpha / r) * B (A x)`` on each adapted ``nn.Linear`` (a forward hook), which is
also how the trainer computes it. A new adapter set replaces the old one whole, once every
factor has arrived; a full (non-adapter) sync removes the adapters.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from mcore_rl.errors import McoreRLError

Tensor = torch.Tensor
PREFIX = "base_model.model."
FACTORS = {"lora_A.weight": "A", "lora_B.weight": "B"}
# PEFT-config switches whose effect the server does not implement: (key, the neutral value)
UNSUPPORTED = (("use_dora", False), ("use_rslora", False), ("rank_pattern", {}), ("alpha_pattern", {}))


class RolloutAdapterError(McoreRLError, ValueError):
    """An adapter sync the rollout server cannot apply; names the tensor or key and the fix."""


@dataclass
class _Adapter:
    A: Tensor  # [r, in]
    B: Tensor  # [out, r]
    scaling: float


def _scaling(peft_config: Mapping[str, Any]) -> float:
    for key, neutral in UNSUPPORTED:
        if peft_config.get(key) not in (None, neutral):
            raise RolloutAdapterError(f"peft_config[{key!r}]={peft_config[key]!r}: the mcore_rl rollout applies plain "
                                      "LoRA only; sync merged weights instead (model.lora.merge=True).")
    rank, alpha = peft_config.get("r"), peft_config.get("lora_alpha")
    if not isinstance(rank, int) or rank <= 0 or alpha is None:
        raise RolloutAdapterError(f"peft_config r={rank!r}, lora_alpha={alpha!r}: an adapter sync needs a rank > 0 "
                                  "and an alpha.")
    return float(alpha) / rank


def module_and_factor(name: str) -> tuple[str, str]:
    """'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight' ->
    ('model.layers.0.self_attn.q_proj', 'A')."""
    for suffix, factor in FACTORS.items():
        if name.startswith(PREFIX) and name.endswith("." + suffix):
            return name[len(PREFIX):-len(suffix) - 1], factor
    raise RolloutAdapterError(f"adapter tensor {name!r} is not a PEFT LoRA factor "
                              f"('{PREFIX}<module>.lora_A.weight' / '.lora_B.weight').")


def is_adapter_name(name: str) -> bool:
    """Whether ``name`` is a PEFT LoRA factor's name ('base_model.model.<module>.lora_A.weight')."""
    return name.startswith(PREFIX) and any(name.endswith("." + suffix) for suffix in FACTORS)


class ServedAdapters:
    """The adapters of one rollout model: ``begin`` a sync, ``take`` its buckets, ``install``
    the complete set (or ``clear`` them)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.active: dict[str, _Adapter] = {}
        self._hooks: list = []
        self._pending: dict[str, dict[str, Tensor]] | None = None
        self._scaling = 0.0

    def begin(self, peft_config: Mapping[str, Any]) -> None:
        self._scaling = _scaling(peft_config)
        self._pending = {}

    def take(self, bucket: list[tuple[str, Tensor]]) -> int:
        """Keeps one bucket of (PEFT name, tensor) until ``install``."""
        if self._pending is None:
            raise RolloutAdapterError("adapter tensors outside an adapter sync (begin_weight_update with a "
                                      "peft_config).")
        for name, tensor in bucket:
            module, factor = module_and_factor(name)
            linear = self.linears.get(module)
            if linear is None:
                raise RolloutAdapterError(f"adapter tensor {name!r}: the rollout model has no linear {module!r} "
                                          "(e.g. routed experts' fused weights); sync merged weights "
                                          "(model.lora.merge=True).")
            self._pending.setdefault(module, {})[factor] = tensor.detach().to(linear.weight.dtype).clone()
        return len(bucket)

    def install(self) -> int:
        """Checks the pending set (both factors of every module, shapes against the linear) and
        replaces the active adapters with it; returns the number of adapted linears."""
        pending, self._pending = self._pending or {}, None
        adapters = {}
        for module, factors in sorted(pending.items()):
            linear = self.linears[module]
            a, b = factors.get("A"), factors.get("B")
            if a is None or b is None:
                raise RolloutAdapterError(f"adapter of {module!r}: only lora_{'A' if a is not None else 'B'} arrived; "
                                          "the sync must send both factors.")
            if a.dim() != 2 or b.dim() != 2 or a.shape[1] != linear.in_features or b.shape[0] != linear.out_features \
                    or a.shape[0] != b.shape[1]:
                raise RolloutAdapterError(f"adapter of {module!r}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)} do "
                                          f"not fit the linear [{linear.out_features}, {linear.in_features}].")
            adapters[module] = _Adapter(a, b, self._scaling)
        if not adapters:
            raise RolloutAdapterError("an adapter sync without adapter tensors; the trainer exported none.")
        self.clear()
        self.active = adapters
        self._hooks = [self.linears[m].register_forward_hook(_hook(a)) for m, a in adapters.items()]
        return len(adapters)

    def abandon(self) -> None:
        """A sync that failed part-way: the pending tensors are dropped."""
        self._pending = None

    def clear(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks, self.active = [], {}


def _hook(adapter: _Adapter):
    def add_adapter(_module: torch.nn.Module, inputs: tuple, output: Tensor) -> Tensor:
        x = inputs[0]
        return output + adapter.scaling * torch.nn.functional.linear(torch.nn.functional.linear(x, adapter.A),
                                                                     adapter.B)
    return add_adapter
