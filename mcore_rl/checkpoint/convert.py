"""HF safetensors -> mcore model directory (``dist_ckpt/``, ``huggingface/``, ``mcore_rl.json``),
streaming and without a GPU.

The model is built on the meta device at the target layout, so its ``sharded_state_dict()`` is
megatron's exact on-disk form (keys, layer-stacked global shapes, replicas, factories) at no
memory cost. The save runs megatron's torch_dist plan with a writer that resolves each item when
it is written: the item's meta tensor is a parameter or a view of one (a swiglu factory writes
gate and up as two views of fc1), so the parameter's real local shard is computed from the HF
tensors exactly as ``mapping.weights.load_hf_weights`` does and the item is the same view of it.
A parameter's real tensor lives until its last item is written: peak memory is one parameter (one
expert for MoE) plus its HF sources. Collective: every rank of a TP x PP x EP world writes its part.
"""
from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal, Mapping

import torch
from megatron.core import dist_checkpointing

from mcore_rl.checkpoint import storage
from mcore_rl.checkpoint.errors import CheckpointError
from mcore_rl.checkpoint.files import META, copy_hf_files, peak_rss_mb
from mcore_rl.checkpoint.state import build_metadata
from mcore_rl.checkpoint.writer import ItemSaveStrategy
from mcore_rl.mapping.hf_io import SafetensorsReader
from mcore_rl.mapping.weights import MappingError, WeightMap, _tp_rank_size, canonical_params, check_hf_keys
from mcore_rl.models.builder import BuildOptions, Role, build_model
from mcore_rl.models.hf_config import model_args_from_hf
from mcore_rl.models.hf_weights import weight_map
from mcore_rl.parallel import ParallelLayout, destroy_parallel_state, initialize_parallel_state
from mcore_rl.platform import active_platform

Tensor = torch.Tensor
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class ConvertError(CheckpointError):
    """Bad converter input (missing or damaged HF files, an occupied output, a wrong split)."""


@dataclass(frozen=True)
class ConvertOptions:
    """What to convert and at which layout (the split of the work; the output is layout-free)."""

    hf_model_path: str
    output_path: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    dtype: Literal["fp32", "bf16"] = "fp32"
    role: Role | None = None
    overwrite: bool = False


@dataclass
class Summary:
    """What all ranks wrote (tensors, bytes), the time, and the largest peak RSS of a rank."""

    role: str
    tensors: int
    bytes: int
    seconds: float
    peak_rss_mb: float
    peak_live_params: int  # most parameters a rank held in real memory at once


# ---- input checks --------------------------------------------------------------------------------
def role_from_config(hf_dir: str) -> Role:
    """``*ForCausalLM`` -> actor, ``*ForTokenClassification`` / ``*ForSequenceClassification``
    -> critic, from config.json ``architectures``."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    for name in archs:
        if name.endswith("ForCausalLM"):
            return "actor"
        if name.endswith(("ForTokenClassification", "ForSequenceClassification")):
            return "critic"
    raise ConvertError(f"{hf_dir}/config.json: architectures={archs!r} name neither a *ForCausalLM (actor) "
                       "nor a *ForTokenClassification (critic); pass --role actor|critic.")


def _shard_files(hf_dir: str) -> list[str]:
    """The safetensors files the checkpoint consists of; an index naming a missing file errors."""
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(hf_dir, n))]
        if missing:
            raise ConvertError(f"{index} names shard files that do not exist: {missing}; copy the "
                               "complete checkpoint (every file the index lists).")
        return [os.path.join(hf_dir, n) for n in names]
    files = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not files:
        raise ConvertError(f"no *.safetensors weights in {hf_dir!r}; save the HF model with "
                           "save_pretrained(..., safe_serialization=True).")
    return [os.path.join(hf_dir, n) for n in files]


def _check_shard(path: str) -> None:
    """A safetensors file whose header promises more bytes than the file holds is truncated."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
        header = f.read(n) if 0 < n <= size - 8 else b""
    try:
        meta = json.loads(header)
    except ValueError:
        meta = None
    if meta is None:
        raise ConvertError(f"{path}: unreadable safetensors header ({size} bytes on disk); the file is "
                           "truncated or not safetensors; copy it again.")
    end = max((v["data_offsets"][1] for k, v in meta.items() if k != "__metadata__"), default=0)
    if 8 + n + end > size:
        raise ConvertError(f"{path} is truncated: {size} bytes on disk, its header needs {8 + n + end}; "
                           "copy the file again.")


def check_input(hf_dir: str) -> SafetensorsReader:
    """Validates the HF directory (config, every shard complete) and opens it lazily."""
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"--hf_model_path {hf_dir!r} is not a directory; pass the HF model directory "
                           "(config.json + *.safetensors).")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ConvertError(f"{hf_dir!r} has no config.json; pass a HF model directory.")
    for path in _shard_files(hf_dir):
        _check_shard(path)
    return SafetensorsReader(hf_dir)


def check_output(path: str, overwrite: bool) -> None:
    """Refuses a file, or a non-empty directory unless ``overwrite`` (every rank checks)."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConvertError(f"--output_path {path!r} is a file; pass a directory.")
    if os.path.isdir(path) and os.listdir(path) and not overwrite:
        raise ConvertError(f"--output_path {path!r} is not empty; pass --overwrite to replace its "
                           "contents or choose an empty directory.")


def prepare_output(path: str) -> None:
    """An empty ``path/dist_ckpt`` (what was there goes: ``check_output`` allowed it)."""
    if os.path.isdir(path):
        shutil.rmtree(path)
    os.makedirs(os.path.join(path, "dist_ckpt"))


# ---- lazy item data ------------------------------------------------------------------------------
def _storage_key(t: Tensor) -> int:
    """Identifies the parameter behind a meta item: megatron detaches the views it saves (``_base``
    is lost) but a detached view shares its parameter's storage."""
    return t.untyped_storage()._cdata


class HFShardResolver:
    """The writer's ``LazyResolver``: each meta item -> the same view of its parameter's real
    local shard, computed from HF tensors when the parameter's first item is written and dropped
    after its last one."""

    def __init__(self, chunks: list[torch.nn.Module], wmap: WeightMap, source: Mapping[str, Tensor]) -> None:
        self.wmap, self.source = wmap, source
        self.params = {_storage_key(p): (name, p) for chunk in chunks for name, p in canonical_params(chunk)}
        if len(self.params) != sum(1 for chunk in chunks for _ in canonical_params(chunk)):
            raise CheckpointError("two model parameters share one storage; the converter cannot tell "
                                  "their checkpoint items apart (report this).")
        self.remaining: dict[int, int] = {}
        self.real: dict[int, Tensor] = {}
        self.used_hf: set[str] = set()
        self.written: set[str] = set()
        self.tensors = self.bytes = 0
        self.peak_live = 0  # most parameters held in real memory at once (streaming: 1)
        self.bar: Any = None  # a tqdm bar, counted per item written

    def plan(self, tensors: list[Tensor]) -> None:
        for t in tensors:
            key = _storage_key(t)
            if key not in self.params:
                raise CheckpointError(f"a checkpoint item of shape {tuple(t.shape)} is no model parameter "
                                      "nor a view of one; the converter cannot fill it (report this).")
            self.remaining[key] = self.remaining.get(key, 0) + 1
        if self.bar is not None:
            self.bar.total = len(tensors)
            self.bar.refresh()

    def _compute(self, key: int) -> Tensor:
        name, param = self.params[key]
        hf_names, transform = self.wmap.rule(name)
        full = transform.to_mcore([self.source[n] for n in hf_names], self.wmap.dims)
        rank, size = _tp_rank_size(transform.expert)
        local = transform.shard(full, rank, size)
        if local.shape != param.shape:
            raise MappingError(f"{name}: HF tensors {hf_names} give shape {tuple(local.shape)} on tensor-"
                               f"parallel rank {rank}/{size}, the model has {tuple(param.shape)}; the "
                               "config does not match the weights.")
        self.used_hf.update(hf_names)
        self.written.add(name)
        # a compact tensor of its own: as_strided offsets count from the storage's start, and a
        # TP shard is a view into the middle of the full tensor
        return torch.empty(param.shape, dtype=param.dtype).copy_(local)  # host: the converter works on the CPU

    def __call__(self, meta: Tensor) -> Tensor:
        key = _storage_key(meta)
        if key not in self.real:
            self.real[key] = self._compute(key)
            self.peak_live = max(self.peak_live, len(self.real))
        out = self.real[key].as_strided(meta.size(), meta.stride(), meta.storage_offset())
        self.remaining[key] -= 1
        if self.remaining[key] == 0:
            del self.real[key]
        self.tensors += 1
        self.bytes += out.numel() * out.element_size()
        if self.bar is not None:
            self.bar.update(1)
        return out


# ---- the conversion ------------------------------------------------------------------------------
def check_world(opts: ConvertOptions) -> ParallelLayout:
    """The layout that splits the work: tp * pp * ep must be the world size."""
    world = torch.distributed.get_world_size()
    if opts.tp * opts.pp * opts.ep != world:
        raise ConvertError(f"--tp {opts.tp} x --pp {opts.pp} x --ep {opts.ep} = {opts.tp * opts.pp * opts.ep} "
                           f"!= WORLD_SIZE {world}; run torchrun --nproc_per_node "
                           f"{opts.tp * opts.pp * opts.ep}, or choose factors whose product is {world}.")
    return ParallelLayout(tp=opts.tp, pp=opts.pp, ep=opts.ep, etp=opts.etp, sequence_parallel=opts.tp > 1)


def _gather_names(names: set[str]) -> set[str]:
    """Collective: the union of every rank's names (JSON bytes, no pickling)."""
    return {n for raw in storage.all_gather_bytes(json.dumps(sorted(names)).encode()) for n in json.loads(raw)}


def check_coverage(resolver: HFShardResolver, chunks: list[torch.nn.Module], source: Mapping[str, Tensor]) -> None:
    """Collective: every HF tensor was used and every model parameter was written by some rank."""
    used = _gather_names(resolver.used_hf)
    written = _gather_names(resolver.written)
    params = _gather_names({name for chunk in chunks for name, _ in canonical_params(chunk)})
    aliases = {"lm_head.weight"} if resolver.wmap.tied_embeddings else set()
    unused = sorted(set(source) - used - aliases)
    if unused:
        raise ConvertError(f"HF tensors never written into the checkpoint: {unused[:8]}; the mapping table "
                           "or the model build misses them (report this); the output is not usable.")
    if resolver.wmap.tied_embeddings:  # the last stage's copy is a replica of the embedding's key
        params.discard("output_layer.weight")
    unset = sorted(params - written)
    if unset:
        raise ConvertError(f"model parameters no rank wrote: {unset[:8]}; the output is not usable "
                           "(report this).")


def convert(opts: ConvertOptions, progress: bool = True) -> Summary:
    """Converts ``opts.hf_model_path`` into the model directory ``opts.output_path`` (collective
    over a torch.distributed world of tp * pp * ep ranks; the platform must be set up). Sets up
    megatron's parallel state for the split (any earlier state of this process is torn down)."""
    start = time.time()
    layout = check_world(opts)
    rank0 = torch.distributed.get_rank() == 0
    source = check_input(opts.hf_model_path)
    args = model_args_from_hf(opts.hf_model_path)
    role = opts.role or role_from_config(opts.hf_model_path)
    if opts.dtype not in DTYPES:
        raise ConvertError(f"--dtype {opts.dtype!r}; use one of {sorted(DTYPES)}.")
    destroy_parallel_state()  # the conversion owns this process's megatron groups
    initialize_parallel_state(layout)
    chunks = build_model(args, layout, role, active_platform(),
                         BuildOptions(params_dtype=DTYPES[opts.dtype], meta_device=True))
    wmap = weight_map(args, role, layout.tp)
    check_hf_keys(wmap, set(source.keys()))
    check_output(opts.output_path, opts.overwrite)
    torch.distributed.barrier()  # every rank has looked before rank 0 empties the directory
    if rank0:
        prepare_output(opts.output_path)
    torch.distributed.barrier()
    resolver = HFShardResolver(chunks, wmap, source)
    if progress and rank0:
        from tqdm import tqdm

        resolver.bar = tqdm(total=0, unit="tensor", desc="hf_to_mcore")
    state = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    request = dist_checkpointing.save(state, os.path.join(opts.output_path, "dist_ckpt"),
                                      sharded_strategy=ItemSaveStrategy(resolve=resolver),
                                      async_sharded_save=True)
    request.execute_sync()
    if resolver.bar is not None:
        resolver.bar.close()
    check_coverage(resolver, chunks, source)
    if rank0:  # written last: a failed conversion leaves no loadable directory
        copy_hf_files(opts.hf_model_path, os.path.join(opts.output_path, "huggingface"))
        facts = SimpleNamespace(args=args, layout=layout, config=chunks[0].config)
        storage.write_json_atomic(os.path.join(opts.output_path, META),
                                  build_metadata(facts, role, ("model",), None))
    mine = json.dumps([resolver.tensors, resolver.bytes, peak_rss_mb(), resolver.peak_live]).encode()
    every = [json.loads(raw) for raw in storage.all_gather_bytes(mine)]  # collective: also the last barrier
    return Summary(role, sum(e[0] for e in every), sum(e[1] for e in every), time.time() - start,
                   max(e[2] for e in every), max(e[3] for e in every))


