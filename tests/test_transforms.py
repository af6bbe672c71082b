"""Weight transforms: exact inverses, and the TP layouts megatron expects."""
from __future__ import annotations

import pytest
import torch

from mcore_rl.mapping.transforms import COLUMN, GATE_UP, GATED_QKV, QKV, REPLICATED, ROW, VOCAB, Dims

DIMS = Dims(num_heads=4, num_kv_heads=2, head_dim=1, vocab_size=5, padded_vocab_size=8)


def test_qkv_interleaves_per_query_group():
    q, k, v = torch.tensor([[0.0], [1.0], [2.0], [3.0]]), torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    full = QKV.to_mcore([q, k, v], DIMS)
    assert full.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert QKV.shard(full, 1, 2).flatten().tolist() == [2, 3, 11, 21]  # TP splits whole groups
    assert QKV.to_mcore([q.flatten(), k.flatten(), v.flatten()], DIMS).tolist() == full.flatten().tolist()


def _labelled_q_gate_k_v(heads: int, kv: int, d: int, hidden: int) -> list[torch.Tensor]:
    """HF q_proj/k_proj/v_proj whose every entry says what it is: 10000*kind + 100*head + 10*row
    + column, kind 1 = query, 2 = gate, 3 = key, 4 = value (q_proj rows per head: [q_h | gate_h])."""
    row = torch.arange(d).reshape(1, d, 1) * 10 + torch.arange(hidden)
    q = [torch.cat([10000 + 100 * h + row[0], 20000 + 100 * h + row[0]]) for h in range(heads)]
    k = [30000 + 100 * g + row[0] for g in range(kv)]
    v = [40000 + 100 * g + row[0] for g in range(kv)]
    return [torch.cat(t).double() for t in (q, k, v)]


@pytest.mark.parametrize("kv", [1, 2])
@pytest.mark.parametrize("ratio", [1, 2, 4])  # query heads per KV head
def test_gated_qkv_is_megatrons_per_group_layout(ratio, kv):
    """megatron-core 0.16.1 SelfAttention.get_query_key_value_tensors (attention_output_gate):
    linear_qkv output viewed as [groups, (2*np/ng + 2)*hn], split [np/ng*hn, np/ng*hn, hn, hn]
    into query, gate, key, value; query and gate reshaped to heads of hn."""
    heads, d, hidden = ratio * kv, 3, 2
    full = GATED_QKV.to_mcore(_labelled_q_gate_k_v(heads, kv, d, hidden), Dims(heads, kv, d, 8, 8))
    assert full.shape == (kv * (2 * ratio + 2) * d, hidden)
    grouped = full.reshape(kv, (2 * ratio + 2) * d, hidden)
    query, gate, key, value = grouped.split([ratio * d, ratio * d, d, d], dim=1)
    row = (torch.arange(d).reshape(d, 1) * 10 + torch.arange(hidden)).double()
    for g in range(kv):
        for j in range(ratio):  # global head g*ratio + j: megatron's query head order
            h = g * ratio + j
            assert torch.equal(query[g].reshape(ratio, d, hidden)[j], 10000 + 100 * h + row)
            assert torch.equal(gate[g].reshape(ratio, d, hidden)[j], 20000 + 100 * h + row)
        assert torch.equal(key[g], 30000 + 100 * g + row) and torch.equal(value[g], 40000 + 100 * g + row)


def test_gated_qkv_ranks_sharing_a_group_hold_contiguous_parts():
    """TP=2, 1 KV head, 2 query heads, head_dim 1: the group's rows [q0 q1 | g0 g1 | k | v]
    split in halves (megatron all-gathers them before slicing the group)."""
    q_gate, k, v = torch.tensor([[0.0], [10.0], [1.0], [11.0]]), torch.tensor([[20.0]]), torch.tensor([[30.0]])
    full = GATED_QKV.to_mcore([q_gate, k, v], Dims(2, 1, 1, 8, 8))
    assert full.flatten().tolist() == [0, 1, 10, 11, 20, 30]
    assert [GATED_QKV.shard(full, r, 2).flatten().tolist() for r in (0, 1)] == [[0, 1, 10], [11, 20, 30]]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("kv", [1, 2])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_gated_qkv_round_trip_is_bit_exact(ratio, kv, bias):
    heads, d = ratio * kv, 2
    dims = Dims(heads, kv, d, 8, 8)
    rest = () if bias else (5,)
    hf = [torch.randn(2 * heads * d, *rest), torch.randn(kv * d, *rest), torch.randn(kv * d, *rest)]
    full = GATED_QKV.to_mcore(hf, dims)
    for tp in (1, 2, 4):
        back = GATED_QKV.to_hf(GATED_QKV.unshard([GATED_QKV.shard(full, r, tp) for r in range(tp)]), dims)
        assert all(torch.equal(a, b) and b.is_contiguous() for a, b in zip(hf, back))


def test_gate_up_shards_hold_their_gate_and_up():
    gate, up = torch.arange(4.0).reshape(4, 1), torch.arange(10.0, 14.0).reshape(4, 1)
    full = GATE_UP.to_mcore([gate, up], DIMS)
    assert GATE_UP.shard(full, 0, 2).flatten().tolist() == [0, 1, 10, 11]
    assert GATE_UP.shard(full, 1, 2).flatten().tolist() == [2, 3, 12, 13]


def test_vocab_pads_with_zeros_and_drops_padding():
    emb = torch.randn(5, 3)
    full = VOCAB.to_mcore([emb], DIMS)
    assert full.shape == (8, 3) and torch.equal(full[5:], torch.zeros(3, 3))
    assert torch.equal(VOCAB.to_hf(full, DIMS)[0], emb)


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize(
    "transform,shapes",
    [(QKV, [(4, 6), (2, 6), (2, 6)]), (QKV, [(4,), (2,), (2,)]), (GATE_UP, [(8, 6), (8, 6)]),
     (COLUMN, [(8, 6)]), (ROW, [(6, 8)]), (VOCAB, [(5, 8)]), (REPLICATED, [(6,)])],
    ids=lambda x: repr(x) if not isinstance(x, list) else str(len(x)),
)
def test_round_trips_are_bit_exact(transform, shapes, tp):
    if transform is QKV and tp > DIMS.num_kv_heads:
        pytest.skip("TP cannot exceed the query groups")
    hf = [torch.randn(s) for s in shapes]
    full = transform.to_mcore(hf, DIMS)
    shards = [transform.shard(full, r, tp) for r in range(tp)]
    back = transform.to_hf(transform.unshard(shards), DIMS)
    assert all(torch.equal(a, b) for a, b in zip(hf, back))
