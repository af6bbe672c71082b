"""Weight transforms: exact inverses, and the TP layouts megatron expects."""
from __future__ import annotations

import pytest
import torch

from mcore_rl.mapping.transforms import COLUMN, GATE_UP, QKV, REPLICATED, ROW, VOCAB, Dims

DIMS = Dims(num_heads=4, num_kv_heads=2, head_dim=1, vocab_size=5, padded_vocab_size=8)


def test_qkv_interleaves_per_query_group():
    q, k, v = torch.tensor([[0.0], [1.0], [2.0], [3.0]]), torch.tensor([[10.0], [11.0]]), torch.tensor([[20.0], [21.0]])
    full = QKV.to_mcore([q, k, v], DIMS)
    assert full.flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert QKV.shard(full, 1, 2).flatten().tolist() == [2, 3, 11, 21]  # TP splits whole groups
    assert QKV.to_mcore([q.flatten(), k.flatten(), v.flatten()], DIMS).tolist() == full.flatten().tolist()


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
