"""verl's LoRA keys -> mcore_rl's ``LoraConfig``, and the weight-sync payloads of a LoRA engine.

verl's model config carries two LoRA vocabularies (verl 0.9.1, ``HFModelConfig``): the Megatron
engine's ``model.lora.*`` dict (``type``, ``rank``, ``alpha``, ``target_modules`` with megatron's
linear names, ``merge``, ...) and the FSDP engine's top-level keys (``lora_rank``,
``lora_alpha``, ``target_modules`` with HF module names, ...). The mcore_rl engine reads
``model.lora.*``; the FSDP keys at their defaults (always present) are ignored, another value is
an error naming the ``model.lora`` key to use instead.

Weight sync (``get_per_tensor_param(base_sync_done=...)``, as verl's worker calls it):
``lora.merge=True``: merged weights ``W + s B A`` under the HF names, no PEFT config.
``lora.merge=False`` (verl's default): the first sync (``base_sync_done=False``) sends the base
weights without adapters, later ones only the adapter factors under PEFT names
(``base_model.model.<module>.lora_A.weight`` [r, in] / ``lora_B.weight`` [out, r]), each with
verl's PEFT-config dict (``build_peft_config_for_vllm``: ``r``, ``lora_alpha``, ...). Routed
experts' adapters have no per-tensor PEFT form (peft stacks a layer's experts): with them the
unmerged sync is refused (``merge=True`` sends them merged).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch

from mcore_rl.integrations.verl.engine_config import VerlConfigError
from mcore_rl.lora.config import LoraConfig, LoraConfigError, lora_config_from_dict

Tensor = torch.Tensor


class AdapterWeights:
    """The export of a LoRA engine served unmerged (``lora.merge=False``, verl's first sync):
    iterating it yields the base weights (HF names) only, as verl's colocated protocol wants
    before its adapter-only syncs; ``with_adapters()`` yields the base weights, then the adapter
    factors (PEFT names) — what a checkpoint engine that carries adapters (``mcore_rl``'s) sends
    when verl asks for the weights without arguments. ``peft_config``: verl's PEFT-config dict.
    Both streams are collective: every rank runs the same one to its end."""

    def __init__(self, base: Iterable[tuple[str, Tensor]], peft_config: Mapping[str, Any],
                 adapters: Callable[[], Iterable[tuple[str, Tensor]]] | None = None) -> None:
        self._base, self._adapters, self.peft_config = base, adapters, dict(peft_config)

    def __iter__(self) -> Iterator[tuple[str, Tensor]]:
        return iter(self._base)

    def with_adapters(self) -> Iterator[tuple[str, Tensor]]:
        """The base weights, then the adapter factors (none when built without them)."""
        yield from self._base
        if self._adapters is not None:
            yield from self._adapters()
# verl's FSDP-engine LoRA keys: (default, what to set instead)
FSDP_KEYS = {
    "lora_rank": (0, "lora.rank"),
    "lora_alpha": (16, "lora.alpha"),
    "target_modules": ("all-linear", "lora.target_modules (megatron names: linear_qkv, linear_proj, ...)"),
    "target_parameters": (None, "lora.target_modules (routed experts: '*.local_experts.*')"),
    "exclude_modules": (None, "lora.exclude_modules"),
    "lora_adapter_path": (None, "lora.adapter_path"),
}


def _get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, Mapping):
        return config.get(key, default)
    return getattr(config, key, default)


def _plain(value: Any) -> Any:
    """OmegaConf containers -> dicts/lists (verl hands either)."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - verl depends on omegaconf
        return value
    if isinstance(value, (DictConfig, ListConfig)):
        return OmegaConf.to_container(value, resolve=True)
    return value


def lora_config(model_config: Any, where: str, seed: int = 0) -> LoraConfig:
    """The ``LoraConfig`` of verl's model config ``model_config`` (``where``: its key path in the
    user's config, for errors); FSDP-only LoRA keys away from their defaults are refused. ``seed``
    seeds the adapters' initialisation unless ``lora.seed`` is given. rank 0: LoRA off."""
    for key, (default, instead) in FSDP_KEYS.items():
        value = _plain(_get(model_config, key, default))
        if value != default:
            raise VerlConfigError(f"{where}.{key}={value!r} is verl's FSDP-engine LoRA key, which the mcore_rl engine "
                                  f"does not read (it reads {where}.lora.*): set {where}.{instead} instead and leave "
                                  f"{where}.{key} at its default {default!r}.")
    values = dict(_plain(_get(model_config, "lora", None)) or {})
    values.setdefault("seed", seed)
    try:
        config = lora_config_from_dict(values)
    except LoraConfigError as e:
        text = str(e)
        raise VerlConfigError(f"{where}.{text}" if text.startswith("lora.") else f"{where}.lora: {text}") from e
    except TypeError as e:  # a key of the right name with a value LoraConfig cannot take
        raise VerlConfigError(f"{where}.lora={values!r}: {e}") from e
    return config


@dataclass(frozen=True)
class SyncPlan:
    """What an adapter-only sync announces: ``rank`` (peft config ``r``: the largest PEFT rank
    of any adapter of the model), ``scaling`` (``lora_alpha / r``: the largest adapter scaling;
    an adapter with a smaller one, e.g. from a PEFT import with ``alpha_pattern``, goes out with
    its ratio folded into B), ``experts``: routed-expert adapters exist."""

    rank: int
    scaling: float
    experts: bool


def sync_plan(engine, device: torch.device) -> SyncPlan:
    """The model's ``SyncPlan``, agreed over all ranks (collective: pipeline stages hold
    different adapters)."""
    from mcore_rl.lora.layers import lora_modules

    modules = list(lora_modules(engine.model))
    local = torch.tensor([max((_peft_rank(m.lora) for m in modules), default=0),
                          max((_scaling(m.lora) for m in modules), default=0.0),
                          float(any(m.lora.is_expert for m in modules))], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(local, op=torch.distributed.ReduceOp.MAX)
    rank, scaling, experts = local.tolist()
    return SyncPlan(int(rank), scaling, bool(experts))


def _scaling(adapter) -> float:
    """The adapter's own s = alpha / r (its checkpointed ``scale`` buffer)."""
    return float(adapter.scale)


def _peft_rank(adapter) -> int:
    """The rank of the adapter's PEFT tensors: a canonical part's rank, else all of A's rows."""
    return adapter.site.rank if adapter.site.parts else int(adapter.A.shape[0])


def peft_config_for_rollout(config: LoraConfig, plan: SyncPlan) -> dict[str, Any]:
    """verl's PEFT-config dict for rollout engines (vLLM's ``PEFTHelper.from_dict``, SGLang's
    loader, the mcore_rl rollout server), built by verl's own ``build_peft_config_for_vllm``:
    ``r`` and ``lora_alpha`` give the plan's rank and scaling."""
    from verl.utils.megatron_peft_utils import build_peft_config_for_vllm

    return build_peft_config_for_vllm({"rank": plan.rank, "alpha": plan.scaling * plan.rank,
                                       "dropout": config.dropout})


def adapter_tensors(engine, plan: SyncPlan) -> Iterator[tuple[str, Tensor]]:
    """(PEFT name, full tensor) of every adapter factor of a LoRA ``ModelEngine``, one at a
    time; B scaled by (adapter scaling / ``plan.scaling``) where they differ, so that every
    adapter is ``plan.scaling * B A``. Collective: every rank must run it to its end."""
    from mcore_rl.mapping.peft import AdapterMap
    from mcore_rl.mapping.weights import iter_hf_buckets
    from mcore_rl.models.hf_weights import weight_map
    from mcore_rl.lora.layers import lora_modules
    from mcore_rl.lora.build import adapter_sites

    fold = {id(m.lora.B): _scaling(m.lora) / plan.scaling for m in lora_modules(engine.model)
            if _scaling(m.lora) != plan.scaling}

    def tensor_of(param: Tensor) -> Tensor:
        ratio = fold.get(id(param))
        return param.data if ratio is None else param.data * ratio

    amap = AdapterMap(weight_map(engine.args, engine.role, engine.layout.tp), adapter_sites(engine.model))
    for bucket in iter_hf_buckets(engine.model, amap, bucket_bytes=1, tensor_of=tensor_of, adapters=True):
        yield from bucket
