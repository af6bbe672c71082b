"""Moves HF-format tensors into a (TP/PP/VPP/EP-sharded) megatron model and back out.

Loading: each rank touches only its own parameters (its pipeline stages' layers, its experts,
its TP shard). Export (``iter_hf_buckets``) streams full HF tensors to every rank in buckets of
bounded size: one megatron parameter at a time is TP/ETP-gathered, broadcast from its expert
owner over EP and from its stage over PP, so no rank ever holds the whole model.
"""
from __future__ import annotations

import itertools
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch
from megatron.core import parallel_state

from mcore_rl.mapping.fp8_quant import SCALE_SUFFIX, BlockFp8, is_quantized, quantize_block_fp8
from mcore_rl.mapping.mtp import missing_mtp_hint, mtp_canonical_params, mtp_hf_keys, mtp_rule
from mcore_rl.mapping.tables import Row
from mcore_rl.mapping.transforms import Dims, Transform
from mcore_rl.mapping.mtp_names import DEFAULT_PREFIX, is_mtp_key
from mcore_rl.platform import active_platform
from mcore_rl.errors import McoreRLError

Tensor = torch.Tensor
_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
# Transformer Engine's grouped experts name their weights linear_fc1.weight<i> instead
_TE_GROUPED = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_TIED_OUTPUT = "output_layer.weight"
_EMBEDDING = "embedding.word_embeddings.weight"


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
    mtp_layers: int = 0  # HF layers after the last one: multi-token prediction (MTP)
    mtp_rows: dict[str, Row] = field(default_factory=dict)  # empty: MTP layers not built, skipped
    mtp_moe: bool = False  # the MTP layers' decoder layer is an MoE layer
    mtp_prefix: str = DEFAULT_PREFIX  # HF prefix of their decoder layers (MappingTable.mtp_layer_prefix)
    # hybrid models: ``linear_layers[i]`` tells a Gated DeltaNet layer (rows ``linear_only``) from
    # a full-attention one (rows ``attention_only``); None: every layer has attention rows
    linear_layers: tuple[bool, ...] | None = None
    attention_only: frozenset[str] = frozenset()
    linear_only: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        # transforms whose TP split depends on the model's sizes learn them here
        object.__setattr__(self, "rows", {k: (hf, tr.bind(self.dims)) for k, (hf, tr) in self.rows.items()})
        if self.tied_embeddings:  # the last stage's copy of the embedding comes from it
            embed = self.rows["embedding.word_embeddings.weight"]
            object.__setattr__(self, "rows", {**self.rows, _TIED_OUTPUT: embed})

    def rule(self, canonical: str) -> tuple[list[str], Transform]:
        """HF names and transform for one canonical megatron name."""
        mtp = mtp_rule(canonical, self.num_layers, self.mtp_rows, self.rule, self.mtp_prefix) if self.mtp_rows else None
        if mtp is not None:
            return mtp
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

    def layers_for(self, template: str) -> range | list:
        """The layer indices a row template exists in ([None] for a template without layers)."""
        if "{layer}" not in template:
            return [None]
        return [i for i in range(self.num_layers) if layer_has_row(self, template, i)]

    def hf_keys(self) -> set[str]:
        """Every HF tensor name this model has (what a full HF checkpoint must contain)."""
        keys = set()
        for template, (hf_templates, _) in self.rows.items():
            if self.tied_embeddings and template == _TIED_OUTPUT:
                continue
            experts = range(self.num_experts) if "{expert}" in template else [None]
            for layer in self.layers_for(template):
                for e in experts:
                    keys.update(t.format(layer=layer, expert=e) for t in hf_templates)
        if self.mtp_rows:
            keys |= mtp_hf_keys(self.rows, self.mtp_rows, self.num_layers, self.mtp_layers, self.mtp_moe,
                                self.moe_only, self.dense_only, self.num_experts, self.linear_only, self.mtp_prefix)
        return keys


def layer_has_row(wmap: WeightMap | Any, template: str, layer: int) -> bool:
    """Whether row ``template`` exists in ``layer``: MoE-only rows in sparse layers, dense-MLP rows
    in dense ones, attention rows in full-attention layers and GDN rows in GDN layers of a hybrid
    model. ``wmap``: anything with WeightMap's ``moe_layers``, ``linear_layers`` and row sets."""
    moe = bool(wmap.moe_layers[layer]) if wmap.moe_layers else False
    linear = bool(wmap.linear_layers[layer]) if wmap.linear_layers else False
    if (template in wmap.moe_only and not moe) or (template in wmap.dense_only and moe):
        return False
    return not ((template in wmap.attention_only and linear) or (template in wmap.linear_only and not linear))


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


# buffers that are model state (checkpointed, converted): the routers' score-correction bias
STATE_BUFFERS = ("mlp.router.expert_bias",)


# LoRA adapter factors (lora/layers.py): ``<linear>.lora.A`` / ``<linear>.lora.B``
ADAPTER_MARK = ".lora."


def canonical_params(chunk: torch.nn.Module, adapters: bool = False) -> Iterator[tuple[str, torch.nn.Parameter]]:
    """(canonical name, parameter): global layer and expert indices, checkpoint key spelling.
    The state buffers (``STATE_BUFFERS``) come after the parameters, as tensors. LoRA adapter
    factors (``ADAPTER_MARK`` in the name) are not base weights: left out unless ``adapters``,
    then they are the only ones given."""
    model = unwrap(chunk)
    buffers = ((n, b) for n, b in model.named_buffers() if n.endswith(STATE_BUFFERS))
    for name, param in itertools.chain(model.named_parameters(), buffers):
        if (ADAPTER_MARK in name) != adapters or name.startswith("mtp."):
            continue
        m = _LAYER.match(name)
        if m is None:
            yield name, param
            continue
        layer = model.decoder.layers[int(m[1])]
        yield f"decoder.layers.{layer.layer_number - 1}.{_canonical_layer_name(layer, m[2])}", param
    yield from mtp_canonical_params(model, _canonical_layer_name, adapters)


def _mtp_keys(wmap: WeightMap, source_keys: set[str]) -> set[str]:
    """The source's tensors of the multi-token-prediction layers of a model built without them
    (``wmap.mtp_prefix``: HF layers num_layers.. after the model's own, or Qwen's ``mtp.*``),
    logged once."""
    if not wmap.mtp_layers:
        return set()
    keys = {k for k in source_keys if is_mtp_key(k, wmap.num_layers, wmap.mtp_layers, wmap.mtp_prefix)}
    if keys:
        first = wmap.num_layers if "{layer}" in wmap.mtp_prefix else 0
        logging.getLogger("mcore_rl").warning(
            "skipping %d tensors of multi-token-prediction layers %s (%s): the model is built without them",
            len(keys), list(range(first, first + wmap.mtp_layers)), wmap.mtp_prefix)
    return keys


def check_hf_keys(wmap: WeightMap, source_keys: set[str], ignore: set[str] = frozenset()) -> None:
    """Errors naming HF tensors the table cannot place and tensors the model needs but lacks
    (multi-token-prediction layers are skipped with a log line)."""
    if not wmap.mtp_rows:
        source_keys = source_keys - _mtp_keys(wmap, source_keys)
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
            f"{' ...' if len(missing) > 8 else ''}.{missing_mtp_hint(missing, wmap.num_layers, bool(wmap.mtp_rows), wmap.mtp_prefix)}"
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


class ExportError(McoreRLError, ValueError):
    """A bad export setting (e.g. a bucket size that is not a positive number of bytes)."""


class _Item(NamedTuple):
    """One megatron parameter to export: who holds it and the HF tensors it becomes."""

    canonical: str
    stage: int  # pipeline rank that holds it
    ep_owner: int | None  # expert-parallel rank that holds it (routed experts only)
    hf: tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (HF name, full shape, dtype)
    order: tuple[int, ...]  # (stage, chunk, layer, expert, position): the export order


_BEFORE_LAYERS, _AFTER_LAYERS = -1, 1 << 30


def _order_key(stage: int, chunk: int, position: int, canonical: str) -> tuple[int, ...]:
    """Stage by stage, chunk by chunk, layer by layer, expert by expert (position breaks ties)."""
    m = _LAYER.match(canonical)
    if m is None:
        layer = _BEFORE_LAYERS if canonical.startswith("embedding.") else _AFTER_LAYERS
        return (stage, chunk, layer, -1, position)
    e = _EXPERT.match(m[2])
    return (stage, chunk, int(m[1]), int(e[1]) if e else -1, position)


def _hf_shapes(transform: Transform, local_shape: torch.Size, dims: Dims) -> list[tuple[int, ...]]:
    """Full HF shapes of a parameter from its local shard's shape (meta tensors: no data moves)."""
    size = _tp_rank_size(transform.expert)[1] if transform.split_dim is not None else 1
    full = transform.unshard([torch.empty(local_shape, device="meta") for _ in range(size)])
    return [tuple(t.shape) for t in transform.to_hf(full, dims)]


def _local_items(
    chunks: list[torch.nn.Module], wmap: WeightMap, tensor_of: Callable, adapters: bool = False
) -> tuple[list[_Item], dict[str, torch.nn.Parameter]]:
    """This rank's parameters (``adapters``: its LoRA factors) as export items, and canonical
    name -> parameter."""
    stage = parallel_state.get_pipeline_model_parallel_rank()
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    items, params = [], {}
    for chunk_index, chunk in enumerate(chunks):
        for position, (name, param) in enumerate(canonical_params(chunk, adapters)):
            if wmap.tied_embeddings and name == _TIED_OUTPUT:
                continue  # the embedding on the first stage is the exported copy
            if name == _EMBEDDING and not unwrap(chunk).pre_process:
                continue  # the MTP layers' copy on the last stage: the first stage's is exported
            hf_names, transform = wmap.rule(name)
            tensor = tensor_of(param)
            shapes = _hf_shapes(transform, tensor.shape, wmap.dims)
            hf = tuple((n, s, tensor.dtype) for n, s in zip(hf_names, shapes))
            owner = ep_rank if transform.expert else None
            items.append(_Item(name, stage, owner, hf, _order_key(stage, chunk_index, position, name)))
            params[name] = param
    return items, params


def _export_plan(local: list[_Item]) -> list[_Item]:
    """Every rank's items, one per parameter, in export order: the same list on every rank."""
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, local)  # metadata only, once
    plan: dict[str, _Item] = {}
    for rank, items in enumerate(gathered):
        for item in items:
            first = plan.setdefault(item.canonical, item)
            if first[:4] != item[:4]:
                raise MappingError(
                    f"{item.canonical}: rank {rank} would export {item.hf} from stage {item.stage}, "
                    f"another rank {first.hf} from stage {first.stage}; the ranks' models differ "
                    "(build every rank from the same config and layout)."
                )
    return sorted(plan.values(), key=lambda i: i.order)


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


def _broadcast(tensors: list[Tensor] | None, item: _Item, owner: int, group) -> list[Tensor] | None:
    """``item``'s HF tensors from group rank ``owner`` (which passes them) to every member."""
    if torch.distributed.get_world_size(group) == 1:
        return tensors
    device = active_platform().device()  # NCCL receives only into device buffers
    out = []
    for i, (_, shape, dtype) in enumerate(item.hf):
        t = tensors[i].contiguous() if tensors is not None else torch.empty(shape, dtype=dtype, device=device)
        torch.distributed.broadcast(t, src=torch.distributed.get_global_rank(group, owner), group=group)
        out.append(t)
    return out


@torch.no_grad()
def _fetch(item: _Item, param, wmap: WeightMap, tensor_of: Callable) -> list[Tensor]:
    """The full HF tensors of one parameter on every rank: TP/ETP gather on its holders, then
    broadcast from its expert owner over EP and from its stage over PP."""
    tensors = None
    if parallel_state.get_pipeline_model_parallel_rank() == item.stage:
        ep_group = parallel_state.get_expert_model_parallel_group()
        if item.ep_owner is None or parallel_state.get_expert_model_parallel_rank() == item.ep_owner:
            _, transform = wmap.rule(item.canonical)
            parts = _gather_tp(tensor_of(param), transform.split_dim is not None, transform.expert)
            tensors = transform.to_hf(transform.unshard(parts), wmap.dims)
            del parts
        if item.ep_owner is not None:
            tensors = _broadcast(tensors, item, item.ep_owner, ep_group)
    return _broadcast(tensors, item, item.stage, parallel_state.get_pipeline_model_parallel_group())


def iter_hf_buckets(
    chunks: list[torch.nn.Module],
    wmap: WeightMap,
    bucket_bytes: int,
    tensor_of: Callable[[torch.nn.Parameter], Tensor] = lambda p: p.data,
    fp8: BlockFp8 | None = None,
    adapters: bool = False,
) -> Iterator[list[tuple[str, Tensor]]]:
    """Full HF-named tensors of a live sharded model, on every rank, in buckets.

    Collective: every rank must iterate to the end; all ranks get the same buckets (names,
    shapes, dtypes, values) in the same order. Order: pipeline stage by stage, layer by layer,
    routed experts one at a time (each expert's tensors as separate HF tensors, never an
    [E, ...] stack). Each bucket holds at most ``bucket_bytes`` bytes, except a tensor larger
    than that, which is a bucket of its own. The union of the buckets is the HF state dict
    (vocab padding stripped; a tied LM head appears once, as the embedding).

    Peak extra memory per rank: the bucket being filled plus one parameter in transit (its TP
    shards and its full HF tensors); the buckets already yielded are the caller's to keep or drop
    (``for bucket in ...: use(bucket); del bucket`` keeps one bucket alive: the loop variable
    would otherwise hold the previous one while the next fills).
    Tensors are views of the parameters where no gather was needed: copy before changing them.
    ``tensor_of`` picks what to export per parameter (``lambda p: p.main_grad`` for gradients).
    ``fp8``: the tensors ``fp8_quant.is_quantized`` names go out as block FP8 (float8_e4m3fn)
    each followed by its float32 ``<name>_scale_inv`` in the same bucket, as ``merge --dtype
    fp8`` writes them; the bucket bound counts the scales' bytes.
    ``adapters``: export the LoRA factors instead of the base weights (``wmap`` then names
    their rules: mapping/peft.py's ``AdapterMap``).
    """
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise ExportError(
            f"bucket_bytes={bucket_bytes!r} must be a positive int (bytes per bucket, e.g. 512 << 20)."
        )
    return _buckets(chunks, wmap, bucket_bytes, tensor_of, fp8, adapters)


def _as_written(name: str, tensor: Tensor, fp8: BlockFp8 | None) -> list[tuple[str, Tensor]]:
    """[(name, tensor)], or with ``fp8`` for a quantized weight [(name, q), (name_scale_inv, s)]."""
    if fp8 is None or not is_quantized(name, tuple(tensor.shape)):
        return [(name, tensor)]
    q, scale = quantize_block_fp8(tensor, fp8, name)
    return [(name, q), (name + SCALE_SUFFIX, scale)]


# no torch.no_grad() here: on a generator its wrapper holds the last yielded bucket while the next
# one fills (two buckets alive); _fetch carries it instead
def _buckets(chunks, wmap: WeightMap, bucket_bytes: int, tensor_of: Callable,
             fp8: BlockFp8 | None = None, adapters: bool = False) -> Iterator[list]:
    local, params = _local_items(chunks, wmap, tensor_of, adapters)
    bucket: list[tuple[str, Tensor]] = []
    filled = 0
    for item in _export_plan(local):
        for (name, _, _), tensor in zip(item.hf, _fetch(item, params.get(item.canonical), wmap, tensor_of)):
            written = _as_written(name, tensor, fp8)  # a weight and its scale stay in one bucket
            nbytes = sum(t.numel() * t.element_size() for _, t in written)
            if bucket and filled + nbytes > bucket_bytes:
                yield bucket
                bucket, filled = [], 0
            bucket.extend(written)
            filled += nbytes
    if bucket:
        yield bucket


def export_hf_weights(
    chunks: list[torch.nn.Module],
    wmap: WeightMap,
    tensor_of: Callable[[torch.nn.Parameter], Tensor] = lambda p: p.data,
    bucket_bytes: int = 512 << 20,
    adapters: bool = False,
) -> dict[str, Tensor]:
    """Full HF-named tensors on every rank (the whole model: a dict over ``iter_hf_buckets``)."""
    buckets = iter_hf_buckets(chunks, wmap, bucket_bytes, tensor_of, adapters=adapters)
    return {name: t for bucket in buckets for name, t in bucket}
