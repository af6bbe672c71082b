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
    # Gated DeltaNet layers (hybrid models): key/value heads and head sizes (0: no such layers)
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0

    @property
    def linear_pieces(self) -> tuple[int, int, int, int, int, int]:
        """Rows of megatron's GDN in_proj pieces [q | k | v | z | beta | alpha] (TP=1)."""
        qk = self.linear_key_heads * self.linear_key_head_dim
        v = self.linear_value_heads * self.linear_value_head_dim
        return qk, qk, v, v, self.linear_value_heads, self.linear_value_heads


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

    def bind(self, dims: Dims) -> Transform:
        """This transform for a model of ``dims`` (those whose TP split depends on the model's
        sizes return a copy that knows them; the others are shared as they are)."""
        return self

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
EXPERT_REPLICATED = Transform("expert_replicated", expert=True)  # a routed expert's fc2 bias
MLA_QUERY = _MlaRopeRows("mla_query", split_dim=0, per_head=True)
MLA_KV_DOWN = _MlaRopeRows("mla_kv_down", split_dim=None, per_head=False)


class _Pieces(Transform):
    """A tensor stacked from pieces along dim 0, each piece split over TP on its own: TP rank r
    holds [piece_0 part r | piece_1 part r | ...] (megatron's GDN in_proj and conv1d). The piece
    sizes come from the model (``bind``)."""

    def __init__(self, name: str, sizes: tuple[int, ...] = ()) -> None:
        super().__init__(name, split_dim=0)
        self.sizes = sizes

    def piece_sizes(self, dims: Dims) -> tuple[int, ...]:
        raise NotImplementedError

    def bind(self, dims: Dims) -> Transform:
        bound = type(self)(self.name, self.piece_sizes(dims))
        return bound

    def _sizes(self, total: int) -> tuple[int, ...]:
        if not self.sizes or sum(self.sizes) != total:
            raise ShardError(f"{self.name}: {total} rows do not fit the model's pieces {self.sizes}; the "
                             "config does not match this tensor.")
        return self.sizes

    def shard(self, full: Tensor, rank: int, size: int) -> Tensor:
        pieces = full.split(self._sizes(full.shape[0]), dim=0)
        return torch.cat([_chunk(p, 0, rank, size) for p in pieces], dim=0)

    def unshard(self, locals_: list[Tensor]) -> Tensor:
        size = len(locals_)
        local_sizes = [s // size for s in self._sizes(locals_[0].shape[0] * size)]
        parts = [t.split(local_sizes, dim=0) for t in locals_]
        return torch.cat([parts[r][i] for i in range(len(local_sizes)) for r in range(size)], dim=0)


class _GdnConv(_Pieces):
    """GDN depthwise conv weight [q | k | v channels, 1, kernel] (same layout in HF and megatron)."""

    def piece_sizes(self, dims: Dims) -> tuple[int, ...]:
        return dims.linear_pieces[:3]


class _GdnInProjSplit(_Pieces):
    """Qwen3.5's GDN input projections (each flat over heads): in_proj_qkv [q | k | v], in_proj_z,
    in_proj_b, in_proj_a -> megatron's in_proj [q | k | v | z | beta | alpha]."""

    def piece_sizes(self, dims: Dims) -> tuple[int, ...]:
        return dims.linear_pieces

    def to_mcore(self, hf: list[Tensor], dims: Dims) -> Tensor:
        return torch.cat(hf, dim=0)

    def to_hf(self, full: Tensor, dims: Dims) -> list[Tensor]:
        q, k, v, z, b, a = full.split(dims.linear_pieces, dim=0)
        return [torch.cat([q, k, v]), z.contiguous(), b.contiguous(), a.contiguous()]


class _GdnInProjGrouped(_Pieces):
    """Qwen3-Next's fused GDN input projections, grouped per key head h: in_proj_qkvz rows
    [q_h | k_h | v_h (value heads of h) | z_h] and in_proj_ba rows [b_h | a_h], h after h ->
    megatron's in_proj [q | k | v | z | beta | alpha], each flat over heads."""

    def piece_sizes(self, dims: Dims) -> tuple[int, ...]:
        return dims.linear_pieces

    @staticmethod
    def _group(dims: Dims) -> tuple[int, list[int], list[int]]:
        hk, per = dims.linear_key_heads, dims.linear_value_heads // dims.linear_key_heads
        dk, dv = dims.linear_key_head_dim, dims.linear_value_head_dim
        return hk, [dk, dk, per * dv, per * dv], [per, per]

    def to_mcore(self, hf: list[Tensor], dims: Dims) -> Tensor:
        qkvz, ba = hf
        hk, qkvz_rows, ba_rows = self._group(dims)
        rest = qkvz.shape[1:]
        q, k, v, z = qkvz.reshape(hk, sum(qkvz_rows), *rest).split(qkvz_rows, dim=1)
        b, a = ba.reshape(hk, sum(ba_rows), *rest).split(ba_rows, dim=1)
        return torch.cat([t.reshape(-1, *rest) for t in (q, k, v, z, b, a)], dim=0)

    def to_hf(self, full: Tensor, dims: Dims) -> list[Tensor]:
        hk, qkvz_rows, ba_rows = self._group(dims)
        rest = full.shape[1:]
        q, k, v, z, b, a = (t.reshape(hk, -1, *rest) for t in full.split(dims.linear_pieces, dim=0))
        qkvz = torch.cat([q, k, v, z], dim=1).reshape(-1, *rest)
        ba = torch.cat([b, a], dim=1).reshape(-1, *rest)
        return [qkvz.contiguous(), ba.contiguous()]


GDN_CONV = _GdnConv("gdn_conv")
GDN_IN_PROJ_SPLIT = _GdnInProjSplit("gdn_in_proj_split")
GDN_IN_PROJ_GROUPED = _GdnInProjGrouped("gdn_in_proj_grouped")
