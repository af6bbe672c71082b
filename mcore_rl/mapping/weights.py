"""Moves HF-format tensors into a (TP/PP/VPP-sharded) megatron model and back out.

Each rank touches only its own parameters: its pipeline stages' layers and its TP shard. Export
gathers TP shards, converts to HF names and shares every stage's tensors with all PP ranks, so
each rank ends with the full HF state dict.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping

import torch
from megatron.core import parallel_state

from mcore_rl.mapping.tables import Row
from mcore_rl.mapping.transforms import Dims, Transform
from mcore_rl.platform import active_platform
from mcore_rl.errors import McoreRLError

Tensor = torch.Tensor
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
# Transformer Engine's grouped experts name their weights linear_fc1.weight<i> instead
_TE_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_TIED_OUTPUT = "output_layer.weight"


class MappingError(McoreRLError, KeyError):
    """A name with no row in the mapping table, or tensors that do not fit the model."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class WeightMap:
    """The rows of one architecture and role, plus the model facts the transforms need.

    ``dense_only`` / ``moe_only``: row templates that exist only in dense-MLP / MoE layers;
    ``moe_layers[i]`` tells which kind layer i is (None: a dense model).
    """

    model_type: str
    rows: dict[str, Row]
    dims: Dims
    num_layers: int
    tied_embeddings: bool
    dense_only: frozenset[str] = frozenset()
    moe_only: frozenset[str] = frozenset()
    moe_layers: tuple[bool, ...] | None = None
    num_experts: int = 0
    skipped: frozenset[str] = frozenset()  # megatron names left as initialised (e.g. a new head)

    def __post_init__(self) -> None:
        if self.tied_embeddings:  # the last stage's copy of the embedding comes from it
            embed = self.rows["embedding.word_embeddings.weight"]
            object.__setattr__(self, "rows", {**self.rows, _TIED_OUTPUT: embed})

    def rule(self, canonical: str) -> tuple[list[str], Transform]:
        """HF names and transform for one canonical megatron name."""
        layer = expert = None
        template = canonical
        m = _LAYER.match(canonical)
        if m:
            layer, rest = int(m[1]), m[2]
            e = _EXPERT.match(rest)
            if e:
                expert, rest = int(e[1]), f"mlp.experts.local_experts.{{expert}}.{e[2]}"
            template = f"decoder.layers.{{layer}}.{rest}"
        if template not in self.rows:
            raise MappingError(
                f"megatron parameter {canonical!r} has no row in the {self.model_type} mapping "
                "table (mcore_rl/mapping/tables.py); add one."
            )
        hf_templates, transform = self.rows[template]
        return [t.format(layer=layer, expert=expert) for t in hf_templates], transform

    def _layers_for(self, template: str) -> range | list:
        if "{layer}" not in template:
            return [None]
        kinds = self.moe_layers or (False,) * self.num_layers
        if template in self.moe_only:
            return [i for i in range(self.num_layers) if kinds[i]]
        if template in self.dense_only:
            return [i for i in range(self.num_layers) if not kinds[i]]
        return range(self.num_layers)

    def hf_keys(self) -> set[str]:
        """Every HF tensor name this model has (what a full HF checkpoint must contain)."""
        keys = set()
        for template, (hf_templates, _) in self.rows.items():
            if self.tied_embeddings and template == _TIED_OUTPUT:
                continue
            experts = range(self.num_experts) if "{expert}" in template else [None]
            for layer in self._layers_for(template):
                for e in experts:
                    keys.update(t.format(layer=layer, expert=e) for t in hf_templates)
        return keys


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def _canonical_layer_name(layer: torch.nn.Module, rest: str) -> str:
    """Layer-relative parameter name -> checkpoint spelling with global expert indices."""
    for old, new in layer.submodules_config.sharded_state_dict_keys_map.items():
        if rest.startswith(old):
            rest = new + rest[len(old):]
    e = _EXPERT.match(rest) or _TE_GROUPED.match(rest)
    if e is None:
        return rest
    if e.re is _EXPERT:
        local, tail = int(e[1]), e[2]
    else:
        local, tail = int(e[3]), f"{e[1]}.{e[2]}"
    return f"mlp.experts.local_experts.{layer.mlp.local_expert_indices[local]}.{tail}"


def canonical_params(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter): global layer and expert indices, checkpoint key spelling."""
    model = unwrap(chunk)
    for name, param in model.named_parameters():
        m = _LAYER.match(name)
        if m is None:
            yield name, param
            continue
        layer = model.decoder.layers[int(m[1])]
        yield f"decoder.layers.{layer.layer_number - 1}.{_canonical_layer_name(layer, m[2])}", param


def check_hf_keys(wmap: WeightMap, source_keys: set[str], ignore: set[str] = frozenset()) -> None:
    """Errors naming HF tensors the table cannot place and tensors the model needs but lacks."""
    expected = wmap.hf_keys()
    aliases = {"lm_head.weight"} if wmap.tied_embeddings else set()
    unmapped = sorted(source_keys - expected - aliases - set(ignore))
    if unmapped:
        raise MappingError(
            f"HF tensors with no row in the {wmap.model_type} mapping table: {unmapped[:8]}"
            f"{' ...' if len(unmapped) > 8 else ''}; the checkpoint does not match the config."
        )
    missing = sorted(expected - source_keys)
    if missing:
        raise MappingError(
            f"HF checkpoint lacks tensors the {wmap.model_type} model needs: {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}."
        )


@torch.no_grad()
def load_hf_weights(
    chunks: list[torch.nn.Module],
    wmap: WeightMap,
    source: Mapping[str, Tensor],
    ignore: set[str] = frozenset(),
) -> None:
    """Copies HF tensors (name -> tensor, e.g. a SafetensorsReader) into this rank's shards.
    Parameters without a row in ``wmap`` keep their values; ``ignore``: HF names to skip."""
    check_hf_keys(wmap, set(source.keys()), ignore)
    for chunk in chunks:
        for name, param in canonical_params(chunk):
            if name in wmap.skipped:
                continue
            hf_names, transform = wmap.rule(name)
            full = transform.to_mcore([source[n] for n in hf_names], wmap.dims)
            rank, size = _tp_rank_size(transform.expert)
            local = transform.shard(full, rank, size)
            if local.shape != param.shape:
                raise MappingError(
                    f"{name}: HF tensors {hf_names} give shape {tuple(local.shape)} on tensor-"
                    f"parallel rank {rank}/{size}, the model has {tuple(param.shape)}; the config "
                    "does not match the weights."
                )
            param.copy_(local)


def _tp_rank_size(expert: bool) -> tuple[int, int]:
    """This rank's index and size in the group a tensor is split over (TP, or ETP for experts)."""
    if expert:
        return (
            parallel_state.get_expert_tensor_parallel_rank(),
            parallel_state.get_expert_tensor_parallel_world_size(),
        )
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )


def _gather_tp(tensor: Tensor, split: bool, expert: bool) -> list[Tensor]:
    size = _tp_rank_size(expert)[1]
    if not split or size == 1:
        return [tensor]
    group = (
        parallel_state.get_expert_tensor_parallel_group()
        if expert
        else parallel_state.get_tensor_model_parallel_group()
    )
    parts = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return parts


def _share_across(local: dict[str, Tensor], group) -> dict[str, Tensor]:
    """Every member of ``group`` ends with the union of the members' tensors."""
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return local
    metas: list = [None] * size
    torch.distributed.all_gather_object(
        metas, [(k, tuple(v.shape), v.dtype) for k, v in local.items()], group=group
    )
    me = torch.distributed.get_rank(group)
    device = active_platform().device()  # NCCL receives only into device buffers
    out: dict[str, Tensor] = {}
    for stage, meta in enumerate(metas):
        src = torch.distributed.get_global_rank(group, stage)
        for key, shape, dtype in meta:
            t = local[key].contiguous() if stage == me else torch.empty(shape, dtype=dtype, device=device)
            torch.distributed.broadcast(t, src=src, group=group)
            out[key] = t
    return out


@torch.no_grad()
def export_hf_weights(
    chunks: list[torch.nn.Module],
    wmap: WeightMap,
    tensor_of: Callable[[torch.nn.Parameter], Tensor] = lambda p: p.data,
) -> dict[str, Tensor]:
    """Full HF-named tensors on every rank. ``tensor_of`` picks what to export per parameter
    (the weights by default; ``lambda p: p.main_grad`` exports gradients the same way)."""
    local: dict[str, Tensor] = {}
    experts: dict[str, Tensor] = {}
    for chunk in chunks:
        for name, param in canonical_params(chunk):
            if wmap.tied_embeddings and name == _TIED_OUTPUT:
                continue  # the embedding on the first stage is the exported copy
            hf_names, transform = wmap.rule(name)
            parts = _gather_tp(tensor_of(param), transform.split_dim is not None, transform.expert)
            full = transform.unshard(parts)
            target = experts if transform.expert else local
            target.update(zip(hf_names, transform.to_hf(full, wmap.dims)))
    if experts:  # each EP rank holds its own experts
        local.update(_share_across(experts, parallel_state.get_expert_model_parallel_group()))
    return _share_across(local, parallel_state.get_pipeline_model_parallel_group())
