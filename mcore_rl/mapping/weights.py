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

Tensor = torch.Tensor
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")  # the one regex: the layer index
_TIED_OUTPUT = "output_layer.weight"


class MappingError(KeyError):
    """A name with no row in the mapping table, or tensors that do not fit the model."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


@dataclass(frozen=True)
class WeightMap:
    """The rows of one architecture and role, plus the model facts the transforms need."""

    model_type: str
    rows: dict[str, Row]
    dims: Dims
    num_layers: int
    tied_embeddings: bool

    def __post_init__(self) -> None:
        if self.tied_embeddings:  # the last stage's copy of the embedding comes from it
            embed = self.rows["embedding.word_embeddings.weight"]
            object.__setattr__(self, "rows", {**self.rows, _TIED_OUTPUT: embed})

    def rule(self, canonical: str) -> tuple[list[str], Transform]:
        """HF names and transform for one canonical megatron name."""
        m = _LAYER.match(canonical)
        template = f"decoder.layers.{{layer}}.{m[2]}" if m else canonical
        if template not in self.rows:
            raise MappingError(
                f"megatron parameter {canonical!r} has no row in the {self.model_type} mapping "
                "table (mcore_rl/mapping/tables.py); add one."
            )
        hf_templates, transform = self.rows[template]
        layer = int(m[1]) if m else None
        return [t.format(layer=layer) for t in hf_templates], transform

    def hf_keys(self) -> set[str]:
        """Every HF tensor name this model has (what a full HF checkpoint must contain)."""
        keys = set()
        for template, (hf_templates, _) in self.rows.items():
            if self.tied_embeddings and template == _TIED_OUTPUT:
                continue
            layers = range(self.num_layers) if "{layer}" in template else [None]
            keys.update(t.format(layer=i) for t in hf_templates for i in layers)
        return keys


def unwrap(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module") and not hasattr(chunk, "decoder"):
        chunk = chunk.module
    return chunk


def canonical_params(chunk: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter): global layer index, checkpoint key spelling."""
    model = unwrap(chunk)
    for name, param in model.named_parameters():
        m = _LAYER.match(name)
        if m is None:
            yield name, param
            continue
        layer = model.decoder.layers[int(m[1])]
        rest = m[2]
        for old, new in layer.submodules_config.sharded_state_dict_keys_map.items():
            if rest.startswith(old):
                rest = new + rest[len(old):]
        yield f"decoder.layers.{layer.layer_number - 1}.{rest}", param


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
    chunks: list[torch.nn.Module], wmap: WeightMap, source: Mapping[str, Tensor]
) -> None:
    """Copies HF tensors (name -> tensor, e.g. a SafetensorsReader) into this rank's shards."""
    check_hf_keys(wmap, set(source.keys()))
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    for chunk in chunks:
        for name, param in canonical_params(chunk):
            hf_names, transform = wmap.rule(name)
            full = transform.to_mcore([source[n] for n in hf_names], wmap.dims)
            local = transform.shard(full, tp_rank, tp_size)
            if local.shape != param.shape:
                raise MappingError(
                    f"{name}: HF tensors {hf_names} give shape {tuple(local.shape)} on TP rank "
                    f"{tp_rank}/{tp_size}, the model has {tuple(param.shape)}; the config does "
                    "not match the weights."
                )
            param.copy_(local)


def _gather_tp(tensor: Tensor, split: bool) -> list[Tensor]:
    size = parallel_state.get_tensor_model_parallel_world_size()
    if not split or size == 1:
        return [tensor]
    parts = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(
        parts, tensor.contiguous(), group=parallel_state.get_tensor_model_parallel_group()
    )
    return parts


def _share_across_pp(local: dict[str, Tensor]) -> dict[str, Tensor]:
    group = parallel_state.get_pipeline_model_parallel_group()
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return local
    metas: list = [None] * size
    torch.distributed.all_gather_object(
        metas, [(k, tuple(v.shape), v.dtype) for k, v in local.items()], group=group
    )
    me = torch.distributed.get_rank(group)
    out: dict[str, Tensor] = {}
    for stage, meta in enumerate(metas):
        src = torch.distributed.get_global_rank(group, stage)
        for key, shape, dtype in meta:
            t = local[key].contiguous() if stage == me else torch.empty(shape, dtype=dtype)
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
    for chunk in chunks:
        for name, param in canonical_params(chunk):
            if wmap.tied_embeddings and name == _TIED_OUTPUT:
                continue  # the embedding on the first stage is the exported copy
            hf_names, transform = wmap.rule(name)
            parts = _gather_tp(tensor_of(param), transform.split_dim is not None)
            full = transform.unshard(parts)
            local.update(zip(hf_names, transform.to_hf(full, wmap.dims)))
    return _share_across_pp(local)
