"""LoRA factors <-> PEFT adapter tensors, through the architecture's weight-mapping table.

A megatron adapter sits on one linear whose weight row maps to one or more HF weights (q, k, v
for ``linear_qkv``; gate, up for ``linear_fc1``). B's rows follow the weight's rows, so the
weight's transform splits a full B into the HF pieces' B; A is shared by the pieces of a fused
adapter (exact: ``W_p + s B_p A`` for each piece p) and split into per-part blocks for canonical
LoRA (part j owns rows ``j*r:(j+1)*r`` of A and the same columns of B). ``AdapterMap`` gives
these rules the shape of a ``WeightMap`` for the canonical adapter names ``<linear>.lora.A``/
``.lora.B``, so mapping/weights.py gathers and broadcasts adapters like weights.
PEFT names: ``base_model.model.<HF module>.lora_A.weight`` [r, in] / ``lora_B.weight`` [out, r].
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from mcore_rl.mapping.peft_experts import experts_to_peft
from mcore_rl.mapping.transforms import Dims, Transform
from mcore_rl.mapping.weights import MappingError, WeightMap

Tensor = torch.Tensor
PEFT_PREFIX = "base_model.model."
FACTOR_SUFFIX = {"A": "lora_A.weight", "B": "lora_B.weight"}


@dataclass(frozen=True)
class AdapterSite:
    """One adapted linear: ``parts`` () for a fused adapter, else the adapted HF pieces (canonical
    LoRA, one rank-``rank`` block each); ``rank`` per block; ``scaling`` = alpha / rank;
    ``piece_rows``: rows of each HF piece of the weight (q, k, v / gate, up / one)."""

    parts: tuple[int, ...]
    rank: int
    scaling: float
    piece_rows: tuple[int, ...]


class LoraFactor(Transform):
    """How one factor of an adapter maps to its PEFT tensors. B: split and re-laid-out as the
    weight's rows; A: split as the weight's columns (row-parallel linears) or replicated."""

    def __init__(self, base: Transform, factor: str, site: AdapterSite, whole: bool = False) -> None:
        split = base.split_dim if (factor, base.split_dim) in (("B", 0), ("A", 1)) else None
        super().__init__(f"lora_{factor}({base.name})", split, base.expert)
        self.base, self.factor, self.site = base, factor, site
        self.whole = whole  # one tensor in megatron's full layout (routed experts: peft_experts.py)

    def shard(self, full: Tensor, rank: int, size: int) -> Tensor:
        return full if self.split_dim is None else self.base.shard(full, rank, size)

    def unshard(self, locals_: list[Tensor]) -> Tensor:
        return locals_[0] if self.split_dim is None else self.base.unshard(locals_)

    def to_hf(self, full: Tensor, dims: Dims) -> list[Tensor]:
        """B [out, R] -> each PEFT B [rows_p, r]; A [R, in] -> each PEFT A [r, in]."""
        r, parts = self.site.rank, self.site.parts
        if self.whole:
            return [full]
        if self.factor == "B":
            pieces = self.base.to_hf(full, dims)  # B's rows are laid out as the weight's
            if not parts:
                return pieces
            return [pieces[p][:, j * r:(j + 1) * r].contiguous() for j, p in enumerate(parts)]
        if not parts:
            return [full] * len(self.site.piece_rows)
        return [full[j * r:(j + 1) * r].contiguous() for j in range(len(parts))]

    def to_mcore(self, hf: list[Tensor], dims: Dims) -> Tensor:
        """Inverse of to_hf (a fused adapter's pieces must share one A)."""
        parts, r = self.site.parts, self.site.rank
        if self.whole:
            return hf[0]
        if self.factor == "A":
            if parts:
                return torch.cat(hf, dim=0)
            if any(not torch.equal(hf[0], t) for t in hf[1:]):
                raise MappingError("the pieces of a fused adapter have different lora_A; import the "
                                   "adapter with rank expansion or as canonical_lora.")
            return hf[0]
        if not parts:
            return self.base.to_mcore(hf, dims)
        pieces = [hf[0].new_zeros(rows, r * len(parts)) for rows in self.site.piece_rows]
        for j, p in enumerate(parts):
            pieces[p][:, j * r:(j + 1) * r] = hf[j]
        return self.base.to_mcore(pieces, dims)


class AdapterMap:
    """``WeightMap``-shaped rules for the adapter factors of the sites this rank holds:
    ``rule('<linear>.lora.A')`` -> (PEFT names, LoraFactor)."""

    def __init__(self, wmap: WeightMap, sites: dict[str, AdapterSite]) -> None:
        self.base, self.sites = wmap, sites
        self.dims, self.tied_embeddings, self.model_type = wmap.dims, False, wmap.model_type

    def rule(self, canonical: str) -> tuple[list[str], LoraFactor]:
        linear, _, factor = canonical.rpartition(".lora.")
        if linear not in self.sites or factor not in FACTOR_SUFFIX:
            raise MappingError(f"{canonical!r} is not an adapter factor of this model.")
        site = self.sites[linear]
        hf_weights, transform = self.base.rule(linear + ".weight")
        if transform.expert:  # one [E*r, in] / [out, r*E] tensor per layer in peft: staged per expert
            return [_expert_stage_name(linear, factor, site)], LoraFactor(transform, factor, site, whole=True)
        if site.parts:
            hf_weights = [hf_weights[p] for p in site.parts]
        names = [peft_name(n, factor) for n in hf_weights]
        return names, LoraFactor(transform, factor, site)


def peft_name(hf_weight: str, factor: str) -> str:
    """'model.layers.0.self_attn.q_proj.weight', 'A' -> PEFT's key for that module's lora_A."""
    if not hf_weight.endswith(".weight"):
        raise MappingError(f"{hf_weight!r} is not a weight; adapters sit on linear weights only.")
    return PEFT_PREFIX + hf_weight[: -len("weight")] + FACTOR_SUFFIX[factor]


_EXPERT_SITE = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)$")
EXPERT_STAGE = "routed_expert_lora"  # staging names: routed_expert_lora.<layer>.<expert>.<part>.<A|B>
_EXPERT_PART = {"linear_fc1": "gate_up", "linear_fc2": "down"}


def _expert_stage_name(linear: str, factor: str, site: AdapterSite) -> str:
    m = _EXPERT_SITE.match(linear)
    if m is None:
        raise MappingError(f"{linear!r}: an expert adapter outside a routed expert's fc1/fc2.")
    if site.parts:
        raise MappingError(f"{linear!r}: canonical LoRA (separate gate/up adapters) on routed experts has no "
                           "PEFT form (peft adapts gate_up_proj as one parameter); export merged weights or "
                           "use type='lora' for the experts.")
    return f"{EXPERT_STAGE}.{m[1]}.{m[2]}.{_EXPERT_PART[m[3]]}.{factor}"


def to_peft_tensors(tensors: dict[str, Tensor], model_type: str) -> dict[str, Tensor]:
    """Exported adapter tensors (AdapterMap names) -> PEFT's state dict: routed experts' staged
    per-expert factors become peft's per-layer expert tensors (mapping/peft_experts.py)."""
    out, layers = {}, {}
    for name, tensor in tensors.items():
        if not name.startswith(EXPERT_STAGE + "."):
            out[name] = tensor
            continue
        _, layer, expert, part, factor = name.split(".")
        pair = layers.setdefault(int(layer), {}).setdefault(int(expert), {}).setdefault(part, {})
        pair[factor] = tensor
    # peft wraps the same expert parameters in every MoE layer: keys are named for all adapted parts
    every_part = sorted({part for experts in layers.values() for parts in experts.values() for part in parts})
    for layer, experts in sorted(layers.items()):
        factors = {e: {part: (ab["A"], ab["B"]) for part, ab in parts.items()} for e, parts in experts.items()}
        out.update(experts_to_peft(f"model.layers.{layer}", factors, model_type, every_part))
    return out
