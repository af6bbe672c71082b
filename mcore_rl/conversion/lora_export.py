"""Exports of a live LoRA model: a PEFT adapter directory, or the merged HF weights.

Both are collective (every rank calls them; rank 0 writes). A PEFT adapter holds, for every
adapted HF module, ``lora_A`` [r, in] and ``lora_B`` [out, r] with ``r``/``lora_alpha`` set so
that peft's ``alpha / r`` is the adapter's scaling (``rank_pattern``/``alpha_pattern`` for
modules that differ from the most common pair); routed experts go out in peft's
``target_parameters`` layout with ``lora_dropout`` 0 (peft refuses dropout there). The output
directory is written beside its destination and renamed into place (fileio/staging.py).
"""
from __future__ import annotations

import collections
import json
import os

import torch
from megatron.core import parallel_state

from mcore_rl.fileio.safetensors_write import write_bucket_shards
from mcore_rl.fileio.staging import Staging
from mcore_rl.mapping.peft import AdapterMap, to_peft_tensors
from mcore_rl.mapping.peft_experts import PeftExpertsError, check_peft_targets, peft_config_entries
from mcore_rl.mapping.weights import export_hf_weights, iter_hf_buckets
from mcore_rl.models.builder import Role
from mcore_rl.models.hf_config import ModelArgs
from mcore_rl.models.hf_weights import weight_map
from mcore_rl.lora.layers import merged_tensor_of
from mcore_rl.lora.build import adapter_sites
from mcore_rl.lora.config import LoraConfig

ADAPTER_FILE = "adapter_model.safetensors"
TASK_TYPES = {"actor": "CAUSAL_LM", "critic": "TOKEN_CLS"}


def peft_adapter_tensors(chunks: list[torch.nn.Module], args: ModelArgs, role: Role) -> dict[str, torch.Tensor]:
    """Every adapter as PEFT-named full tensors, on every rank (collective)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    amap = AdapterMap(weight_map(args, role, tp), adapter_sites(chunks))
    return to_peft_tensors(export_hf_weights(chunks, amap, adapters=True), args.arch.model_type)


def _module_ranks(chunks: list[torch.nn.Module], args: ModelArgs, role: Role) -> dict[str, tuple[int, float]]:
    """HF module -> (r, scaling) of every adapter of the model (gathered from all ranks)."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    wmap, local = weight_map(args, role, tp), {}
    for name, site in adapter_sites(chunks).items():
        hf, transform = wmap.rule(name + ".weight")
        if transform.expert:  # one entry per adapted part: "experts.gate_up" / "experts.down"
            local["experts." + ("gate_up" if name.endswith("linear_fc1") else "down")] = (site.rank, site.scaling)
            continue
        pieces = [hf[p] for p in site.parts] if site.parts else hf
        rank = site.rank if site.parts else _fused_rank(chunks, name)
        local.update({n[: -len(".weight")]: (rank, site.scaling) for n in pieces})
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)  # our own metadata, not untrusted input
    return {k: v for part in gathered for k, v in part.items()}


def _fused_rank(chunks: list[torch.nn.Module], name: str) -> int:
    from mcore_rl.lora.build import linear_sites

    return next(m.lora.A.shape[0] for c in chunks for n, m in linear_sites(c) if n == name)


def peft_adapter_config(ranks: dict[str, tuple[int, float]], config: LoraConfig, args: ModelArgs,
                        role: Role, base: str | None) -> dict:
    """adapter_config.json for ``ranks`` (HF module -> (r, scaling); 'experts.gate_up' /
    'experts.down' for the adapted parts of the routed experts: only those become
    ``target_parameters``, peft wraps exactly the listed ones)."""
    parts = [p for p in ("gate_up", "down") if f"experts.{p}" in ranks]
    pairs = {ranks.pop(f"experts.{p}") for p in parts}
    if len(pairs) > 1:
        raise PeftExpertsError(f"the routed experts' gate_up and down adapters have (rank, scaling) {sorted(pairs)}; "
                               "peft's expert adapters share one r and lora_alpha: export merged weights instead.")
    experts = pairs.pop() if pairs else None
    common = collections.Counter(ranks.values()).most_common(1)
    # the experts' pair is the global one: peft's expert wrappers take r and lora_alpha
    r, scaling = experts if experts is not None else common[0][0]
    targets = sorted({m.rsplit(".", 1)[-1] for m in ranks})
    out = {"peft_type": "LORA", "task_type": TASK_TYPES[role], "base_model_name_or_path": base, "r": r,
           "lora_alpha": scaling * r, "lora_dropout": config.dropout, "bias": "none", "fan_in_fan_out": False,
           "use_rslora": False, "use_dora": False, "target_modules": targets, "inference_mode": True,
           "rank_pattern": {m: v[0] for m, v in ranks.items() if v[0] != r},
           "alpha_pattern": {m: v[1] * v[0] for m, v in ranks.items() if v != (r, scaling)}}
    check_peft_targets(args.arch.model_type, targets)  # also without expert adapters
    if experts is not None:
        out.update(peft_config_entries(args.arch.model_type, parts, targets))
        out["target_modules"] = sorted(out["target_modules"]) if out["target_modules"] else targets
    return out


def save_peft_adapter(chunks: list[torch.nn.Module], args: ModelArgs, role: Role, config: LoraConfig,
                      directory: str, base: str | None = None) -> None:
    """Writes the model's adapters as a PEFT adapter directory (``PeftModel.from_pretrained``
    reads it). Collective; rank 0 writes, into a staging directory renamed into place."""
    tensors = peft_adapter_tensors(chunks, args, role)
    ranks = _module_ranks(chunks, args, role)
    if torch.distributed.get_rank() == 0:
        adapter_config = peft_adapter_config(ranks, config, args, role, base)
        staging = Staging.create(os.path.abspath(directory))
        try:
            from safetensors.torch import save_file

            # a fused adapter's pieces share one A: separate copies on disk
            save_file({k: v.detach().clone() for k, v in tensors.items()}, os.path.join(staging.path, ADAPTER_FILE),
                      metadata={"format": "pt"})
            with open(os.path.join(staging.path, "adapter_config.json"), "w", encoding="utf-8") as f:
                json.dump(adapter_config, f, indent=2, sort_keys=True)
            staging.commit(replace=True)  # fsyncs, then renames into place (replacing)
        except BaseException:
            staging.discard()
            raise
    torch.distributed.barrier()


def save_merged_hf(chunks: list[torch.nn.Module], args: ModelArgs, role: Role, directory: str,
                   bucket_bytes: int = 512 << 20) -> None:
    """Writes the merged weights (W + s B A for every adapted linear) as HF safetensors shards
    (no config files: copy the base's). Collective; rank 0 writes."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    buckets = iter_hf_buckets(chunks, weight_map(args, role, tp), bucket_bytes, merged_tensor_of(chunks))
    if torch.distributed.get_rank() != 0:
        for _ in buckets:  # collective: the other ranks take part in every gather
            pass
    else:
        staging = Staging.create(os.path.abspath(directory))
        try:
            write_bucket_shards(staging.path, buckets)
            staging.commit(replace=True)  # fsyncs, then renames into place (replacing)
        except BaseException:
            staging.discard()
            raise
    torch.distributed.barrier()
