"""Gives the targeted linears of freshly built chunks their LoRA adapters and freezes the base.

Each full adapter (the TP=1 layout) is drawn from a seed keyed by its canonical name, then split
as its weight is (the mapping table's transform), so every layout starts from the same adapters.
Canonical LoRA's B has one column block per adapted part (q/k/v, gate/up), zero elsewhere: its
mask is built in the HF layout (one indicator per part) and brought into megatron's row order by
the same transform as the weight.
"""
from __future__ import annotations

import torch

from mcore_rl.mapping.peft import AdapterSite
from mcore_rl.mapping.peft_import import PeftAdapterError, SitePlan, plan_site, read_peft_adapter
from mcore_rl.mapping.transforms import Transform
from mcore_rl.mapping.weights import WeightMap, unwrap
from mcore_rl.lora.layers import (
    LORA_LINEARS,
    LoraAdapter,
    LoraColumnParallelLinear,
    adapter_dtype,
    expert_tp_rank_size,
    init_full,
    lora_modules,
)
from mcore_rl.lora.config import GDN_PARTS, LINEARS, LoraConfig, LoraConfigError

Tensor = torch.Tensor


def linear_sites(chunk: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(canonical module name, module) of every LoRA-capable linear in a chunk."""
    from mcore_rl.mapping.weights import canonical_params

    names = {id(p): n for n, p in canonical_params(chunk)}
    sites = []
    for module in unwrap(chunk).modules():
        if isinstance(module, LORA_LINEARS):
            name = names[id(module.weight)]
            sites.append((name[: -len(".weight")], module))
    return sites


def attach_adapters(chunks: list[torch.nn.Module], config: LoraConfig, wmap: WeightMap,
                    params_dtype: torch.dtype) -> int:
    """Adapters on every linear ``config`` targets, initialised from their seeds, or with
    ``config.adapter_path`` on every linear the PEFT adapter there adapts, with its values,
    ranks and scalings; every other parameter frozen. Returns the number of adapted linears."""
    dtype = adapter_dtype(config, params_dtype)
    adapter = read_peft_adapter(config.adapter_path) if config.adapter_path else None
    if adapter is not None:
        adapter.check_against(wmap, LINEARS)  # every tensor used or refused, on every stage
    else:
        _check_gdn_parts(config, wmap)
    expert_cache: dict = {}
    count = 0
    for chunk in chunks:
        for name, module in linear_sites(chunk):
            _, transform = wmap.rule(name + ".weight")
            if adapter is not None:
                plan = plan_site(adapter, wmap, name, config.type, expert_cache, _full_shape(module, transform))
            else:
                plan = _seeded_plan(module, name, config, transform, wmap)
            if plan is None:
                continue
            module.lora = _build_adapter(module, name, plan, config, transform, wmap, dtype)
            if isinstance(module, LoraColumnParallelLinear):
                module.lora_glu_rows = transform.name.endswith("gate_up")
            count += 1
    if count == 0 and adapter is None:
        _check_some_target(chunks, config, wmap)
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            param.requires_grad_(".lora." in name)
    return count


def piece_names(wmap: WeightMap, name: str) -> tuple[str, ...]:
    """The HF module names (last components) of the pieces of the linear ``name`` (canonical):
    ('q_proj', 'k_proj', 'v_proj') for linear_qkv, ('in_proj_qkvz', 'in_proj_ba') for
    Qwen3-Next's GDN in_proj."""
    hf_weights, _ = wmap.rule(name + ".weight")
    return tuple(n.removesuffix(".weight").rsplit(".", 1)[-1] for n in hf_weights)


def _check_gdn_parts(config: LoraConfig, wmap: WeightMap) -> None:
    """canonical_lora targets naming GDN in_proj pieces must name this model's pieces (the
    whole model's table, whatever this pipeline stage holds)."""
    named = [t for t in config.target_modules if t in GDN_PARTS]
    if not named or not config.enabled:
        return
    rows = [hf for template, (hf, _) in wmap.rows.items() if template.endswith(".self_attention.in_proj.weight")]
    pieces = tuple(n.removesuffix(".weight").rsplit(".", 1)[-1] for n in rows[0]) if rows else ()
    wrong = [t for t in named if t not in pieces]
    if wrong:
        have = (f"its Gated DeltaNet in_proj fuses {list(pieces)}" if pieces
                else "it has no Gated DeltaNet layers")
        raise LoraConfigError(f"lora.target_modules entries {wrong} name no part of this {wmap.model_type} model: "
                              f"{have}; target those (or 'in_proj' for all of them).")


def _check_some_target(chunks: list[torch.nn.Module], config: LoraConfig, wmap: WeightMap) -> None:
    """A pipeline stage may hold no targeted layer; a model may not (checked on this stage's
    names: the message lists what exists)."""
    names = [n for c in chunks for n, _ in linear_sites(c)]
    if not any(config.parts(n, piece_names(wmap, n)) is not None for n in names) \
            and not any("*" in t for t in config.target_modules):
        raise LoraConfigError(
            f"lora.target_modules={list(config.target_modules)} match no linear of this model; its "
            f"linears are named like {sorted({n.rsplit('.', 1)[-1] for n in names})}."
        )


def _full_shape(module: torch.nn.Module, transform: Transform) -> tuple[int, int]:
    """(rows, columns) of the full (TP=1) weight of ``module``."""
    _, size = expert_tp_rank_size(transform.expert)
    out_local, in_local = module.weight.shape
    return (out_local * size if transform.split_dim == 0 else out_local,
            in_local * size if transform.split_dim == 1 else in_local)


def _seeded_plan(module: torch.nn.Module, name: str, config: LoraConfig, transform: Transform,
                 wmap: WeightMap) -> SitePlan | None:
    """A fresh adapter for a targeted linear: full factors drawn from the seed and the name."""
    parts = config.parts(name, piece_names(wmap, name))
    if parts is None:
        return None
    full_out, full_in = _full_shape(module, transform)
    r = config.rank * max(len(parts), 1)
    a_full = init_full(config.lora_A_init_method, (r, full_in), f"{name}.lora.A", config.seed)
    b_full = init_full(config.lora_B_init_method, (full_out, r), f"{name}.lora.B", config.seed)
    if parts:
        b_full = b_full * _part_mask(parts, config.rank, transform, wmap, full_out)
    return SitePlan(a_full, b_full, config.scaling, parts, config.rank)


def _build_adapter(module: torch.nn.Module, name: str, plan: SitePlan, config: LoraConfig, transform: Transform,
                   wmap: WeightMap, dtype: torch.dtype) -> LoraAdapter:
    """``module``'s (canonical ``name``) adapter from ``plan``'s full factors, checked to fit the
    full weight (A [R, in], B [out, R]: a mis-shaped factor is never broadcast), then sharded."""
    split = {0: "column", 1: "row", None: None}[transform.split_dim]
    rank, size = expert_tp_rank_size(transform.expert)
    full_out, full_in = _full_shape(module, transform)
    r = plan.A.shape[0]
    if plan.A.dim() != 2 or plan.B.dim() != 2 or plan.A.shape != (r, full_in) or plan.B.shape != (full_out, r):
        raise PeftAdapterError(f"the adapter of {name} has A {list(plan.A.shape)} and B "
                               f"{list(plan.B.shape)}; the weight needs A [r, {full_in}] and B [{full_out}, r]: "
                               f"check lora.adapter_path={config.adapter_path!r}.")
    mask = None
    if plan.parts:
        mask = _shard(_part_mask(plan.parts, plan.part_rank, transform, wmap, full_out), transform, split, "B",
                      rank, size)
    adapter = LoraAdapter(module, plan.A.shape[0], plan.scaling, config, split, mask, dtype)
    with torch.no_grad():
        adapter.A.copy_(_shard(plan.A, transform, split, "A", rank, size))
        adapter.B.copy_(_shard(plan.B, transform, split, "B", rank, size))
    pieces = transform.to_hf(torch.empty(full_out, 1, device="meta"), wmap.dims)
    adapter.site = AdapterSite(plan.parts, plan.part_rank, plan.scaling, tuple(p.shape[0] for p in pieces))
    return adapter


def _shard(full: Tensor, transform: Transform, split: str | None, factor: str, rank: int, size: int) -> Tensor:
    """This rank's part of a full factor: B split like the weight's rows, A like its columns."""
    if (split, factor) in (("column", "B"), ("row", "A")):
        return transform.shard(full, rank, size)
    return full


def _part_mask(parts: tuple[int, ...], rank: int, transform: Transform, wmap: WeightMap,
               full_out: int) -> Tensor:
    """[full_out, rank * len(parts)]: 1 where a row of adapted part ``parts[j]`` meets column
    block j, in megatron's row order (the transform of the HF pieces)."""
    pieces = transform.to_hf(torch.zeros(full_out, 1), wmap.dims)  # host: the mask is built full, then sharded
    width = rank * len(parts)
    blocks = []
    for index, piece in enumerate(pieces):
        block = torch.zeros(piece.shape[0], width)  # host: the mask is built full, then sharded
        if index in parts:
            j = parts.index(index)
            block[:, j * rank:(j + 1) * rank] = 1.0
        blocks.append(block)
    return transform.to_mcore(blocks, wmap.dims)


def keep_input_grad(chunks: list[torch.nn.Module]) -> None:
    """The embedding output requires grad while training: megatron's activation recompute
    (CheckpointFunction) returns no gradient when its inputs need none, and with a frozen
    embedding the first layer's inputs would not (the adapters would silently get zero grads)."""
    for chunk in chunks:
        model = unwrap(chunk)
        if getattr(model, "pre_process", False):
            model.embedding.register_forward_hook(_require_grad)


def _require_grad(module, inputs, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        return output.detach().requires_grad_(True)
    return output


def adapter_count(chunks: list[torch.nn.Module]) -> int:
    return sum(1 for _ in lora_modules(chunks))


def adapter_sites(chunks: list[torch.nn.Module]) -> dict[str, AdapterSite]:
    """canonical linear name -> its adapter's layout, for the adapters of these chunks."""
    return {name: module.lora.site for chunk in chunks for name, module in linear_sites(chunk)
            if module.lora is not None}
