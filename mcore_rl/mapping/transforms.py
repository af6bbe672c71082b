"""How HF tensors become one megatron tensor, and how that tensor is split over TP ranks.

Each transform has four pure functions over tensors:
  to_mcore(hf_tensors, dims) -> full   (the TP=1 megatron layout)
  to_hf(full, dims) -> hf_tensors      (exact inverse: a round trip is bit-exact)
  shard(full, rank, size) -> local     (what TP rank ``rank`` of ``size`` holds)
  unshard(locals) -> full              (inverse of shard over all ranks)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from mcore_rl.errors import McoreRLError

Tensor = torch.Tensor


@dataclass(frozen=True)
class Dims:
    """Model sizes the transforms need."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    # multi-latent attention: rope rows of each query head and of the KV down-projection
    qk_rope_head_dim: int = 0
    kv_lora_rank: int = 0
    rope_rows_split: bool = False  # HF rope_interleave=False: rows [first halves | second halves]


class Transform:
    """Identity layout, split along ``split_dim`` (None = replicated on every TP rank).

    ``expert``: the tensor belongs to a routed expert, so it is split over the expert-TP group
    (ETP) instead of the TP group, and experts are spread over the EP group.
    """

    split_dim: int | None = None

    def __init__(self, name: str, split_dim: int | None = None, expert: bool = False) -> None:
        self.name = name
        self.split_dim = split_dim
        self.expert = expert

    def __repr__(self) -> str:
        return self.name

    def to_mcore(self, hf: list[Tensor], dims: Dims) -> Tensor:
        (tensor,) = hf
        return tensor

    def to_hf(self, full: Tensor, dims: Dims) -> list[Tensor]:
        return [full]

    def shard(self, full: Tensor, rank: int, size: int) -> Tensor:
        if self.split_dim is None:
            return full
        return _chunk(full, self.split_dim, rank, size)

    def unshard(self, locals_: list[Tensor]) -> Tensor:
        if self.split_dim is None:
            return locals_[0]
        return torch.cat(locals_, dim=self.split_dim)


class ShardError(McoreRLError, ValueError):
    """A tensor that cannot be split over the tensor-parallel ranks as its transform says."""


def _chunk(full: Tensor, dim: int, rank: int, size: int) -> Tensor:
    if full.shape[dim] % size != 0:
        raise ShardError(
            f"dim {dim} of shape {tuple(full.shape)} does not divide by TP={size}; the model config "
            "does not fit this tensor-parallel size."
        )
    return full.chunk(size, dim=dim)[rank]


class _Vocab(Transform):
    """Embedding / LM head rows: zero-padded to the padded vocab, padding dropped on export."""

    def to_mcore(self, hf: list[Tensor], dims: Dims) -> Tensor:
        (tensor,) = hf
        pad = dims.padded_vocab_size - tensor.shape[0]
        return torch.cat([tensor, tensor.new_zeros(pad, *tensor.shape[1:])]) if pad else tensor

    def to_hf(self, full: Tensor, dims: Dims) -> list[Tensor]:
        return [full[: dims.vocab_size]]


class _Qkv(Transform):
    """q, k, v stacked per query group: [q_g (heads/groups rows), k_g, v_g] for each group g.

    Works for weights [rows, hidden] and biases [rows]. TP splits whole groups (dim 0).
    """

    def to_mcore(self, hf: list[Tensor], dims: Dims) -> Tensor:
        q, k, v = hf
        g, d = dims.num_kv_heads, dims.head_dim
        rest = q.shape[1:]
        q = q.reshape(g, (dims.num_heads // g) * d, *rest)
        k = k.reshape(g, d, *rest)
        v = v.reshape(g, d, *rest)
        return torch.cat([q, k, v], dim=1).reshape(-1, *rest)

    def to_hf(self, full: Tensor, dims: Dims) -> list[Tensor]:
        g, d = dims.num_kv_heads, dims.head_dim
        per_group_q = (dims.num_heads // g) * d
        rest = full.shape[1:]
        grouped = full.reshape(g, per_group_q + 2 * d, *rest)
        q, k, v = grouped.split([per_group_q, d, d], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


class _GatedQkv(Transform):
    """Gated attention (Qwen3-Next, Qwen3.5): HF ``q_proj`` holds, per head h, [q_h | gate_h]
    (head_dim rows each); megatron's ``linear_qkv`` (``attention_output_gate``) holds, per query
    group g, [q heads of g | gate heads of g | k_g | v_g], each part flat over its heads.

    hf = [q_proj [2*heads*d, ...], k_proj [kv*d, ...], v_proj [kv*d, ...]] (weights [rows, hidden]
    or biases [rows]) <-> full [kv * (2*heads/kv + 2) * d, ...]. TP splits dim 0 contiguously
    (ColumnParallelLinear): whole groups, or equal parts of a group that several ranks share.
    """

    def to_mcore(self, hf: list[Tensor], dims: Dims) -> Tensor:
        q_gate, k, v = hf
        g, d, heads = dims.num_kv_heads, dims.head_dim, dims.num_heads
        rest = q_gate.shape[1:]
        per_head = q_gate.reshape(g, heads // g, 2, d, *rest)  # [group, head in group, q|gate, d]
        q = per_head[:, :, 0].reshape(g, -1, *rest)
        gate = per_head[:, :, 1].reshape(g, -1, *rest)
        return torch.cat([q, gate, k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1).reshape(-1, *rest)

    def to_hf(self, full: Tensor, dims: Dims) -> list[Tensor]:
        g, d, heads = dims.num_kv_heads, dims.head_dim, dims.num_heads
        per_group_q = (heads // g) * d
        rest = full.shape[1:]
        grouped = full.reshape(g, 2 * per_group_q + 2 * d, *rest)
        q, gate, k, v = grouped.split([per_group_q, per_group_q, d, d], dim=1)
        q_gate = torch.stack([q.reshape(heads, d, *rest), gate.reshape(heads, d, *rest)], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q_gate, k, v)]


class _GateUp(Transform):
    """SwiGLU fc1: full = [gate; up]; TP rank r holds [gate_r; up_r]."""

    def to_mcore(self, hf: list[Tensor], dims: Dims) -> Tensor:
        gate, up = hf
        return torch.cat([gate, up], dim=0)

    def to_hf(self, full: Tensor, dims: Dims) -> list[Tensor]:
        gate, up = full.chunk(2, dim=0)
        return [gate.contiguous(), up.contiguous()]

    def shard(self, full: Tensor, rank: int, size: int) -> Tensor:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([_chunk(gate, 0, rank, size), _chunk(up, 0, rank, size)], dim=0)

    def unshard(self, locals_: list[Tensor]) -> Tensor:
        halves = [t.chunk(2, dim=0) for t in locals_]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def _interleave(rows: Tensor) -> Tensor:
    """Rope rows [a_0..a_{n-1} | b_0..b_{n-1}] -> pairs (a_0, b_0), (a_1, b_1), ... (dim 0)."""
    a, b = rows.chunk(2, dim=0)
    return torch.stack([a, b], dim=1).reshape(rows.shape)


def _deinterleave(rows: Tensor) -> Tensor:
    return torch.cat([rows[0::2], rows[1::2]], dim=0)


class _MlaRopeRows(Transform):
    """MLA weights whose rope rows megatron rotates as interleaved pairs: the query projection
    (per head [nope | rope], ``per_head``) and the KV down-projection ([kv_lora | rope]). HF
    checkpoints with rope_interleave=False keep those rows as halves: interleaved on import,
    de-interleaved on export; otherwise the layout is the same (identity)."""

    def __init__(self, name: str, split_dim: int | None, per_head: bool) -> None:
        super().__init__(name, split_dim)
        self.per_head = per_head

    def _apply(self, tensor: Tensor, dims: Dims, fn) -> Tensor:
        if not dims.rope_rows_split:
            return tensor
        r = dims.qk_rope_head_dim
        if not self.per_head:
            return torch.cat([tensor[:-r], fn(tensor[-r:])])
        heads = tensor.reshape(-1, tensor.shape[0] // dims.num_heads, *tensor.shape[1:])
        return torch.cat([heads[:, :-r], torch.stack([fn(h[-r:]) for h in heads])], dim=1).reshape(tensor.shape)

    def to_mcore(self, hf: list[Tensor], dims: Dims) -> Tensor:
        (tensor,) = hf
        return self._apply(tensor, dims, _interleave)

    def to_hf(self, full: Tensor, dims: Dims) -> list[Tensor]:
        return [self._apply(full, dims, _deinterleave).contiguous()]


REPLICATED = Transform("replicated")
COLUMN = Transform("column", split_dim=0)
ROW = Transform("row", split_dim=1)
VOCAB = _Vocab("vocab", split_dim=0)
QKV = _Qkv("qkv", split_dim=0)
GATED_QKV = _GatedQkv("gated_qkv", split_dim=0)
GATE_UP = _GateUp("gate_up", split_dim=0)
EXPERT_GATE_UP = _GateUp("expert_gate_up", split_dim=0, expert=True)
EXPERT_ROW = Transform("expert_row", split_dim=1, expert=True)
MLA_QUERY = _MlaRopeRows("mla_query", split_dim=0, per_head=True)
MLA_KV_DOWN = _MlaRopeRows("mla_kv_down", split_dim=None, per_head=False)
