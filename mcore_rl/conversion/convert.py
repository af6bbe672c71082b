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
The output is written into a staging directory beside it and renamed into place when complete
(``staging.Staging``), with its ``RECORD`` (every file's size and CRC-32, written last, verified by
every reader: ``checkpoint.model_record``); the input and output checks are ``convert_input``'s.
"""
from __future__ import annotations

import json
import os
import time
import warnings
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.api import CheckpointException

from mcore_rl.checkpoint import storage
from mcore_rl.checkpoint.model_record import write_record
from mcore_rl.conversion.convert_input import (HF_DTYPE_NAMES, ConvertError, DtypeName, DtypeWarning, check_input,
                                               check_output, resolve_dtype, role_from_config)
from mcore_rl.conversion.merge_fp8 import STORED_KEY
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.files import META, copy_hf_files, peak_rss_mb, process_age_s
from mcore_rl.fileio.model_layout import MCORE_RL  # a converter writes the mcore_rl layout
from mcore_rl.fileio.staging import Staging, StagingError
from mcore_rl.checkpoint.state import build_metadata
from mcore_rl.checkpoint.writer import ItemSaveStrategy, plan_item_save
from mcore_rl.errors import McoreRLError
from mcore_rl.mapping.casts import NonFiniteWarning, cast_checked, describe_nonfinite, first_nonfinite, wider_dtypes
from mcore_rl.mapping.hf_io import SafetensorsReader
from mcore_rl.mapping.weights import MappingError, WeightMap, _tp_rank_size, canonical_params, check_hf_keys
from mcore_rl.models.builder import BuildOptions, Role, build_model
from mcore_rl.models.hf_config import ModelArgs, model_args_from_hf
from mcore_rl.models.hf_layout import carried_names, expert_layout, has_fused_experts, hf_view, write_carried
from mcore_rl.models.mtp import record_mtp_count
from mcore_rl.models.hf_weights import critic_head_source, weight_map
from mcore_rl.parallel import ParallelLayout, destroy_parallel_state, initialize_parallel_state
from mcore_rl.platform import active_platform

Tensor = torch.Tensor
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
__all__ = ["ConvertError", "ConvertOptions", "Summary", "convert", "role_from_config"]


@dataclass(frozen=True)
class ConvertOptions:
    """What to convert and at which layout (the split of the work; the output is layout-free)."""

    hf_model_path: str
    output_path: str
    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int = 1
    dtype: DtypeName | None = None  # None: the weights' own (convert_input.resolve_dtype)
    role: Role | None = None
    overwrite: bool = False


@dataclass
class Summary:
    """What all ranks wrote (tensors, bytes, dtype), the time, and the largest peak RSS of a rank."""

    role: str
    tensors: int
    bytes: int
    seconds: float
    peak_rss_mb: float
    peak_live_params: int  # most parameters a rank held in real memory at once
    dtype: str = "fp32"
    startup_s: float = 0.0  # slowest rank: process start to its first tensor written


# ---- lazy item data ------------------------------------------------------------------------------
def _storage_key(t: Tensor) -> int:
    """Identifies the parameter behind a meta item: megatron detaches the views it saves (``_base``
    is lost) but a detached view shares its parameter's storage."""
    return t.untyped_storage()._cdata


def _owns_storage(t: Tensor) -> bool:
    """A contiguous tensor that is its whole storage (no view into a larger tensor)."""
    return (t.is_contiguous() and t.storage_offset() == 0
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


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
        self.error: BaseException | None = None  # what _compute raised (the writer reports only text)
        self.first_item_age: float | None = None  # process age when the first tensor was asked for
        self.nonfinite: dict[str, tuple[int, tuple[int, ...], float]] = {}  # HF name -> first_nonfinite

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
        # TP shard is a view into the middle of the full tensor; one already compact is used as is
        if local.dtype == param.dtype and _owns_storage(local):
            out = local
        else:
            out = torch.empty(param.shape, dtype=param.dtype).copy_(local)  # host: the converter works on the CPU
        if not bool(torch.isfinite(out).all()):  # one pass; the sources are looked at only on a hit
            self._nonfinite(hf_names, param.dtype)
        return out

    def _nonfinite(self, hf_names: list[str], dtype: torch.dtype) -> None:
        """NaN/inf in a parameter: a CastOverflowError when rounding a finite HF value to ``dtype``
        made it (``--dtype fp16`` of a value beyond +-65504), else the HF tensors that hold them
        are noted for the converter's warning (copied as they are)."""
        for n in hf_names:
            src = self.source[n]
            cast_checked(src, dtype, f"HF tensor {n!r}", wider_dtypes(dtype))
            found = first_nonfinite(src)
            if found is not None:  # named as stored (a fused expert tensor: which expert)
                self.nonfinite[getattr(self.source, "origin", str)(n)] = found

    def __call__(self, meta: Tensor) -> Tensor:
        if self.first_item_age is None:
            self.first_item_age = process_age_s()
        key = _storage_key(meta)
        if key not in self.real:
            try:
                self.real[key] = self._compute(key)
            except BaseException as e:
                self.error = e
                raise
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


def check_coverage(resolver: HFShardResolver, chunks: list[torch.nn.Module], source: Mapping[str, Tensor],
                   carried: frozenset[str] = frozenset()) -> None:
    """Collective: every HF tensor was used (or is ``carried``: written beside the checkpoint)
    and every model parameter was written by some rank."""
    used = _gather_names(resolver.used_hf)
    written = _gather_names(resolver.written)
    params = _gather_names({name for chunk in chunks for name, _ in canonical_params(chunk)})
    aliases = {"lm_head.weight"} if resolver.wmap.tied_embeddings else set()
    unused = sorted(set(source) - used - aliases - carried)
    if unused:
        raise ConvertError(f"HF tensors never written into the checkpoint: {unused[:8]}; the mapping table "
                           "or the model build misses them (report this); the output is not usable.")
    if resolver.wmap.tied_embeddings:  # the last stage's copy is a replica of the embedding's key
        params.discard("output_layer.weight")
    unset = sorted(params - written)
    if unset:
        raise ConvertError(f"model parameters no rank wrote: {unset[:8]}; the output is not usable "
                           "(report this).")


def _stage_output(final: str) -> Staging:
    """Collective: rank 0 creates the staging directory beside ``final`` and every rank joins it
    by name; a rank that does not see it (output on a disk the ranks do not share) fails all."""
    mine, problem = None, ""
    if torch.distributed.get_rank() == 0:
        try:
            mine = Staging.create(final)
        except StagingError as e:  # every rank raises it, none waits in a collective
            problem = str(e)
    said = json.loads(storage.all_gather_bytes(json.dumps([mine.name if mine else "", problem]).encode())[0])
    if said[1]:
        raise StagingError(said[1])
    stage = mine or Staging.join(final, said[0])
    seen = storage.all_gather_bytes(b"1" if os.path.isdir(stage.path) else b"0")
    blind = [r for r, flag in enumerate(seen) if flag != b"1"]
    if blind:
        if mine is not None:
            mine.discard()
        raise ConvertError(f"--output_path {final!r}: ranks {blind} do not see the directory {said[0]} that rank 0 "
                           f"created in {os.path.dirname(stage.final)}; the output must be on a filesystem all "
                           "ranks share (not a node-local disk).")
    if mine is not None:
        os.mkdir(MCORE_RL.dist_dir(stage.path))
    torch.distributed.barrier()
    return stage


def _writer_failure(error: BaseException, resolver: HFShardResolver, output: str) -> BaseException:
    """The error to raise for a failed write: what the resolver raised when it is an mcore_rl
    refusal (it names the value and the fix), else a ConvertError with the writer's report."""
    if isinstance(resolver.error, McoreRLError):
        return resolver.error
    if isinstance(error, CheckpointError):  # agreed over the ranks: it names the failed rank's error
        return ConvertError(f"writing the checkpoint for {output!r} failed: {error}; check free space and "
                            "write permission where the output lives, then run again.")
    reports = []
    for rank, failure in sorted(getattr(error, "failures", {}).items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        reports.append(f"rank {rank}: {' '.join(str(exc).split())}")
    return ConvertError(f"writing the checkpoint for {output!r} failed ({'; '.join(reports) or error}); check "
                        "free space and write permission where the output lives, then run again.")


def _save(chunks: list[torch.nn.Module], resolver: HFShardResolver, dist_dir: str, output: str) -> None:
    """Writes the checkpoint items through ``resolver`` (megatron's plan and metadata)."""
    state = {f"model{i}": chunk.sharded_state_dict() for i, chunk in enumerate(chunks)}
    try:  # rank 0's own writes (common.pt, metadata) agreed: a failure there stops every rank
        plan_item_save(state, dist_dir, ItemSaveStrategy(resolve=resolver)).execute_sync()
    except (CheckpointError, CheckpointException) as e:  # the writer's errors, agreed over the ranks
        raise _writer_failure(e, resolver, output) from None
    finally:
        if resolver.bar is not None:
            resolver.bar.close()


def _summary(role: str, dtype: str, resolver: HFShardResolver, seconds: float) -> Summary:
    """Collective (also the last barrier of the write): totals over ranks."""
    mine = json.dumps([resolver.tensors, resolver.bytes, peak_rss_mb(), resolver.peak_live,
                       resolver.first_item_age or 0.0]).encode()
    every = [json.loads(raw) for raw in storage.all_gather_bytes(mine)]
    return Summary(role, sum(e[0] for e in every), sum(e[1] for e in every), seconds,
                   max(e[2] for e in every), max(e[3] for e in every), dtype, max(e[4] for e in every))


def _state_dtype(config_path: str, dtype: str) -> None:
    """The copied config.json states the dtype written (``dtype`` and ``torch_dtype``, as
    transformers names it), whatever the input's config said."""
    with open(config_path) as f:
        config = json.load(f)
    config["dtype"] = config["torch_dtype"] = HF_DTYPE_NAMES[dtype]
    with open(config_path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


def _hf_side_files(hf_dir: str, out: str, dtype: str, reader: SafetensorsReader, carried: frozenset[str],
                   args: ModelArgs) -> None:
    """``out`` (the output's ``huggingface/``): the input's config (stating ``dtype``), tokenizer and
    generation files, and what merge writes back beside the mapped tensors: a wrapper's carried
    tensors as stored and the experts' layout (``models.hf_layout``)."""
    copy_hf_files(hf_dir, out)
    fused = args.moe is not None and has_fused_experts(reader, expert_layout(args))
    if carried or fused:
        write_carried(out, reader, sorted(carried), fused)
    _state_dtype(os.path.join(out, "config.json"), dtype)


def convert(opts: ConvertOptions, progress: bool = True) -> Summary:
    """Converts ``opts.hf_model_path`` into the model directory ``opts.output_path`` (collective
    over a torch.distributed world of tp * pp * ep ranks; the platform must be set up). Sets up
    megatron's parallel state for the split (any earlier state of this process is torn down).

    The output is written into a staging directory beside ``output_path`` and renamed into place
    when complete: a failure leaves the old output (``overwrite``) as it was and nothing new."""
    start = time.time()
    layout = check_world(opts)
    rank0 = torch.distributed.get_rank() == 0
    check_input(opts.hf_model_path)
    role = opts.role or role_from_config(opts.hf_model_path)
    dtype, dtype_note = (opts.dtype, None) if opts.dtype else resolve_dtype(opts.hf_model_path)
    if dtype_note and rank0:
        warnings.warn(dtype_note, DtypeWarning, stacklevel=2)
    if dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}; use one of {sorted(DTYPES)}.")
    check_output(opts.output_path, opts.hf_model_path, opts.overwrite)
    args = model_args_from_hf(opts.hf_model_path)
    reader = SafetensorsReader(opts.hf_model_path, dequant_dtype=DTYPES[dtype])
    carried = frozenset(carried_names(reader, args.wrapper))  # a vision tower: copied as stored
    source: Mapping[str, Tensor] = hf_view(reader, args, opts.hf_model_path)
    if role == "critic":  # a reward model's bias-free score head: bias 0, as load_hf does
        source = critic_head_source(source, args)
    destroy_parallel_state()  # the conversion owns this process's megatron groups
    initialize_parallel_state(layout)
    chunks = build_model(args, layout, role, active_platform(),
                         BuildOptions(params_dtype=DTYPES[dtype], meta_device=True))
    wmap = weight_map(args, role, layout.tp)
    check_hf_keys(wmap, set(source.keys()), carried)
    torch.distributed.barrier()  # every rank has checked before anything is created
    stage = _stage_output(opts.output_path)
    try:
        resolver = HFShardResolver(chunks, wmap, source)
        if progress and rank0:
            from tqdm import tqdm

            resolver.bar = tqdm(total=0, unit="tensor", desc="hf_to_mcore")
        _save(chunks, resolver, MCORE_RL.dist_dir(stage.path), opts.output_path)
        if resolver.nonfinite:  # this rank's parameters; written as they are, said once per rank
            warnings.warn(describe_nonfinite(resolver.nonfinite, opts.hf_model_path), NonFiniteWarning, stacklevel=2)
        check_coverage(resolver, chunks, source, carried)
        if rank0:
            _hf_side_files(opts.hf_model_path, MCORE_RL.hf_dir(stage.path), dtype, reader, carried, args)
            if role == "actor":  # the MTP layers written (a critic has none)
                record_mtp_count(os.path.join(MCORE_RL.hf_dir(stage.path), "config.json"), args, args.mtp_built)
            facts = SimpleNamespace(args=args, layout=layout, config=chunks[0].config)
            meta = build_metadata(facts, role, ("model",), None)
            if reader.quantized:  # an FP8 / MXFP4 import: merge --dtype fp8 / mxfp4 writes back what was quantized
                meta[STORED_KEY] = reader.stored_dtypes
            storage.write_json_atomic(os.path.join(stage.path, META), meta)
            write_record(stage.path, role)  # last: every file with size and CRC-32, which readers verify
        summary = _summary(role, dtype, resolver, time.time() - start)
        problem = ""
        if rank0:
            try:
                stage.commit(replace=opts.overwrite)
            except StagingError as e:  # another run's output appeared there: every rank raises it
                problem = str(e)
        said = storage.all_gather_bytes(problem.encode())[0]  # no rank returns before the output is in place
        if said:
            raise StagingError(said.decode())
    except BaseException:
        stage.discard()
        raise
    return summary
