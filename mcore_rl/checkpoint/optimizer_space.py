"""``model_space`` optimizer checkpoints: megatron's DistributedOptimizer state saved in the
model's own global coordinates, without any gather, and loaded at any TP/PP/EP/DP layout.

Each DP rank owns one flat range ``[start, stop)`` of every parameter it updates (of the
parameter's local TP/EP shard, row-major). A flat range of a row-major tensor is a union of at
most ``2 * (ndim - 1) + 1`` rectangular boxes, each contiguous in flat order
(``flat_range_boxes``). Each box of the main param and of Adam's moments becomes a
ShardedTensor ``optimizer.state.{fp32_param|exp_avg|exp_avg_sq}.{model key}`` with the model
tensor's global shape and the box's global offset (irregular sharding, ``axis_fragmentations
=None``), whose data is a view of the rank's flat state (no copy). torch_dist then writes every
element once (TP replicas once, every DP rank its own range: ``replica_id``) and a load in
another layout reads its own boxes by overlap with the saved ones.

Sharded-tensor factories of the model (the swiglu ``linear_fc1`` split, LoRA's B of fc1) are
built on the parameter: each tensor they produce must be a contiguous view of it, whose flat
offset in the parameter places it against the DP range.

megatron-core 0.16.1's own ``fully_sharded_model_space`` builds flattened ShardedTensors, which
its ``ShardedTensor.validate_metadata_integrity`` refuses ("ShardedTensor.flattened_range is not
supported"); this module is its working counterpart. It hands megatron's
``load_parameter_state_from_fs_model_space`` the flat tensors it expects.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from megatron.core.dist_checkpointing import ShardedTensor
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from mcore_rl.errors import CheckpointError

SHARDING = "model_space"
MEGATRON_TYPE = "fully_sharded_model_space"  # the load_state_dict dispatch that takes our flat tensors
STATE_KEYS = {"param": "fp32_param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}  # engine -> file
Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, size) per axis


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The rectangular boxes, in flat order, whose union is the flat range ``[start, stop)`` of
    a row-major tensor of ``shape`` (at most ``2 * (len(shape) - 1) + 1``, none empty)."""
    numel = math.prod(shape)
    if not 0 <= start <= stop <= numel:
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of shape {tuple(shape)} ({numel} elements)")
    if start == stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,))] if shape else [((), ())]
    row, rest = math.prod(shape[1:]), tuple(shape[1:])
    first, last = start // row, (stop - 1) // row
    if first == last:  # inside one row: that row's boxes
        return [((first, *o), (1, *s)) for o, s in flat_range_boxes(rest, start - first * row, stop - first * row)]
    boxes: list[Box] = []
    full_from, full_to = first, stop // row  # rows [full_from, full_to) are whole
    if start % row:
        boxes += [((first, *o), (1, *s)) for o, s in flat_range_boxes(rest, start % row, row)]
        full_from = first + 1
    if full_to > full_from:
        boxes.append(((full_from, *[0] * len(rest)), (full_to - full_from, *rest)))
    if stop % row:
        boxes += [((full_to, *o), (1, *s)) for o, s in flat_range_boxes(rest, 0, stop % row)]
    return boxes


def _flat_index(shape: tuple[int, ...], offset: tuple[int, ...]) -> int:
    """Row-major flat index of ``offset`` in a tensor of ``shape``."""
    index = 0
    for size, off in zip(shape, offset):
        index = index * size + off
    return index


@dataclass(frozen=True)
class Piece:
    """One box of one parameter's DP range: where it sits in the global model tensor ``key``
    and at which element ``at`` of the rank's flat range (``[start, stop)``) it starts."""

    key: str
    global_shape: tuple[int, ...]
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]  # the box, with the model tensor's prepended axes (layers, experts) as 1s
    replica_id: tuple[int, ...]
    at: int

    def tensor(self, name: str, flat: torch.Tensor) -> ShardedTensor:
        """The ShardedTensor of state ``name`` (fp32_param, exp_avg, exp_avg_sq) whose data is a
        view of ``flat`` (the rank's flat range of the param, 1-D [stop - start]). Irregular
        sharding: torch_dist writes its chunk as (global offset, local shape), so the prepended
        axes are real axes of size 1 (``prepend_axis_num`` 0)."""
        data = flat[self.at:self.at + math.prod(self.shape)].view(self.shape)
        return ShardedTensor(f"optimizer.state.{name}.{self.key}", data, data.dtype, self.shape, self.global_shape,
                             self.global_offset, None, self.replica_id)


def _sub_tensors(model_sh, param: torch.Tensor, name: str) -> list[tuple[ShardedTensor, int]]:
    """(ShardedTensor, flat offset in ``param``) for the model entry of ``param``: the entry
    itself, or each tensor a factory builds from the param (each a contiguous view of it)."""
    if isinstance(model_sh, ShardedTensor):
        if model_sh.flattened_range is not None or tuple(model_sh.local_shape) != tuple(param.shape):
            raise CheckpointError(f"{name} ({model_sh.key}): its sharded tensor is flattened or of another shape "
                                  f"({model_sh.local_shape} vs {tuple(param.shape)}); save with "
                                  "optimizer_sharding=fully_reshardable.")
        return [(model_sh, 0)]
    built = model_sh.build_fn(model_sh.key, param, model_sh.replica_id, None)
    out = []
    for sub in nested_values(built):
        data = sub.data if isinstance(sub, ShardedTensor) else None
        if (data is None or not data.is_contiguous() or sub.flattened_range is not None
                or data.untyped_storage().data_ptr() != param.untyped_storage().data_ptr()):
            raise CheckpointError(f"{name} ({model_sh.key}): its sharded-tensor factory builds a tensor that is not "
                                  "a contiguous view of the parameter, which model_space cannot place; save with "
                                  "optimizer_sharding=fully_reshardable.")
        out.append((sub, data.storage_offset() - param.storage_offset()))
    return out


def param_pieces(model_sh, param: torch.Tensor, start: int, stop: int, instance: int, name: str) -> list[Piece]:
    """The boxes of ``param``'s flat DP range ``[start, stop)`` in flat order. ``model_sh``:
    the param's model ShardedTensor or ShardedTensorFactory; ``instance``: the distributed
    optimizer instance id, which replaces the replica id's DP coordinate (every DP rank writes
    its own range; TP replicas, e.g. layernorms, and a tied output layer still write none)."""
    pieces = []
    for sub, offset in _sub_tensors(model_sh, param, name):
        if len(sub.replica_id) != 3:
            raise CheckpointError(f"{name} ({sub.key}): replica id {sub.replica_id} is not (PP, TP, DP); save with "
                                  "optimizer_sharding=fully_reshardable.")
        lo, hi = max(start, offset), min(stop, offset + sub.data.numel())
        if lo >= hi:
            continue
        shape, pre = tuple(sub.local_shape), sub.prepend_axis_num
        for box_offset, box_shape in flat_range_boxes(shape, lo - offset, hi - offset):
            global_offset = (*sub.global_offset[:pre],
                             *(g + b for g, b in zip(sub.global_offset[pre:], box_offset)))
            at = offset + _flat_index(shape, box_offset) - start
            pieces.append(Piece(sub.key, tuple(sub.global_shape), global_offset, (1,) * pre + box_shape,
                                (*sub.replica_id[:2], instance), at))
    pieces.sort(key=lambda p: p.at)
    ends = [p.at + math.prod(p.shape) for p in pieces]
    if [p.at for p in pieces] != [0, *ends[:-1]] or (ends[-1] if ends else 0) != stop - start:
        raise CheckpointError(f"{name} ({model_sh.key}): the tensors of its sharded state do not cover the parameter "
                              "once each; save with optimizer_sharding=fully_reshardable.")
    return pieces


def _model_entries(model_state: dict) -> dict[int, Any]:
    """id(param) -> its ShardedTensor or ShardedTensorFactory in the model's sharded state."""
    tensors, _ = extract_sharded_tensors_and_factories(model_state)
    return {id(sh.data): sh for sh in nested_values(tensors)}


def _ranges(opt: DistributedOptimizer):
    """(param, [start, stop) of its local shard this DP rank updates), in megatron's order
    (gbuf_ranges -> buckets -> param_map, as ``load_parameter_state_from_fs_model_space``)."""
    for gbuf_range_maps in opt.gbuf_ranges:
        for bucket_maps in gbuf_range_maps.values():
            for bucket_map in bucket_maps:
                for param, range_map in bucket_map["param_map"].items():
                    yield param, range_map["param"].start, range_map["param"].end


def _param_state(opt: DistributedOptimizer, entries: dict[int, Any], is_loading: bool) -> dict[int, dict]:
    """``{param index: {file state name: [ShardedTensor per box]}}`` of one DistributedOptimizer.
    Saving: views of the engine's state. Loading: views of fresh host tensors of the same
    dtypes (a failed load leaves the engine's state as it was)."""
    out = {}
    for index, (param, start, stop) in enumerate(_ranges(opt)):
        name = opt._param_name(param)
        if id(param) not in entries:
            raise CheckpointError(f"parameter {name} has optimizer state but no entry in the model's sharded state "
                                  "dict; save with optimizer_sharding=fully_reshardable (report this).")
        state = opt._get_main_param_and_optimizer_states(param)
        extra = sorted(set(state) - set(STATE_KEYS) - {"step"})
        if extra:
            raise CheckpointError(f"parameter {name}: optimizer state {extra} beyond {sorted(STATE_KEYS)}; "
                                  "model_space saves Adam's state only: use optimizer_sharding=fully_reshardable.")
        pieces = param_pieces(entries[id(param)], param, start, stop, opt.distributed_optimizer_instance_id, name)
        flats = {key: torch.empty(stop - start, dtype=state[key].dtype) if is_loading  # host: load buffers
                 else state[key].detach().view(-1) for key in STATE_KEYS}
        out[index] = {file_key: [p.tensor(file_key, flats[key]) for p in pieces]
                      for key, file_key in STATE_KEYS.items()}
    return out


def _distributed(optimizer) -> list[DistributedOptimizer] | None:
    """The DistributedOptimizers of ``optimizer`` (itself, or a ChainedOptimizer's members:
    MoE experts have their own with the expert-DP group); None when none is one."""
    members = list(getattr(optimizer, "chained_optimizers", None) or [optimizer])
    dist = [o for o in members if isinstance(o, DistributedOptimizer)]
    if dist and len(dist) != len(members):
        raise CheckpointError(f"optimizer_sharding=model_space: a mix of distributed and other optimizers "
                              f"({[type(o).__name__ for o in members]}); use optimizer_sharding=fully_reshardable.")
    return dist or None


def sharded_state_dict(optimizer, model_state: dict, is_loading: bool) -> dict:
    """The optimizer's ``model_space`` sharded state dict; ``model_state``: the model's sharded
    state (``{"model{i}": ...}``) whose tensors are the engine's parameters. Per
    DistributedOptimizer: its ``state_dict()`` (param groups, step; saved once, as megatron does
    for its fully reshardable formats) and ``param_state`` (``_param_state``); a ChainedOptimizer
    of several gives ``{index: ...}`` as megatron's. A non-distributed optimizer's own sharded
    state dict is already in model space (megatron's)."""
    opts = _distributed(optimizer)
    if opts is None:
        return optimizer.sharded_state_dict(model_state, is_loading)
    entries = _model_entries(model_state)
    if len(opts) > 1:  # megatron's ChainedOptimizer aligns TE's per-group steps first
        optimizer._synchronize_steps()
    states = []
    for opt in opts:
        common = opt.state_dict()
        if is_loading:  # allocates the state of a fresh optimizer, as megatron's sharded_state_dict
            opt.load_state_dict(opt.state_dict())
        states.append({**common, "param_state": _param_state(opt, entries, is_loading)})
    return states[0] if len(states) == 1 else dict(enumerate(states))


def _flatten(per_param: dict[int, dict[str, list[torch.Tensor]]]) -> dict[int, dict[str, torch.Tensor]]:
    """Loaded boxes -> one flat tensor per param and state (1-D [stop - start]), the input of
    megatron's ``load_parameter_state_from_fs_model_space``."""
    return {index: {key: torch.cat([box.reshape(-1) for box in boxes]) for key, boxes in states.items()}
            for index, states in per_param.items()}


def loaded_state_dict(optimizer, loaded: Any) -> Any:
    """What ``optimizer.load_state_dict`` takes from a loaded ``model_space`` state dict (the
    structure ``sharded_state_dict`` built, with tensors in place of the ShardedTensors)."""
    if _distributed(optimizer) is None:
        return loaded
    parts = [loaded] if "param_state" in loaded else [loaded[i] for i in sorted(loaded)]
    out = [{**part, "param_state": _flatten(part["param_state"]), "param_state_sharding_type": MEGATRON_TYPE}
           for part in parts]
    return out[0] if "param_state" in loaded else dict(enumerate(out))
