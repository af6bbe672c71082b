"""Online export for rollout engines (issue #9 C): ``export_hf_buckets`` streams the live sharded
actor's full HF tensors to every rank in bounded buckets. The stream must equal the HF weights the
engine was loaded from (bit for bit, names exactly the HF keys), be the same on every rank, keep
each bucket within the byte limit (a bigger tensor alone) and send experts one at a time."""
from __future__ import annotations

import re

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

# tiny sizes (fp32): embedding / lm_head 200x64 = 51200 bytes, the largest; layer tensors
# 256 B .. 24576 B. 40000 bytes puts several layer tensors in one bucket and no vocab tensor.
LIMIT = 40_000

CASES = {  # name -> (model_type, config overrides, world size, layout)
    "tp2": ("llama", {}, 2, dict(tp=2, sequence_parallel=True)),
    "pp2_vpp2_tied": ("qwen2", dict(tie_word_embeddings=True), 2, dict(pp=2, vpp=2)),
    "ep2_qwen2_moe_shared": ("qwen2_moe", {}, 2, dict(ep=2)),
    "tp2_ep2_qwen3_moe": ("qwen3_moe", {}, 4, dict(tp=2, ep=2, sequence_parallel=True)),
    "tp2_ep2_deepseek_v3": ("deepseek_v3", {}, 4, dict(tp=2, ep=2, sequence_parallel=True)),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def _export_buckets(hf_dir: str, layout_kwargs: dict, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf_buckets
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "actor", active_platform(), hf_weights=hf_dir)
    buckets = export_hf_buckets(engine.model, args, "actor", bucket_bytes=bucket_bytes)
    return [[(name, t.clone()) for name, t in bucket] for bucket in buckets]


def _runs(keys: list) -> list:
    """Consecutive-run labels of ``keys``: [a, a, b, a] -> [a, b, a]."""
    return [k for i, k in enumerate(keys) if i == 0 or keys[i - 1] != k]


def _assert_stream_ok(buckets: list, source) -> None:
    names = [n for b in buckets for n, _ in b]
    assert all(buckets), "an empty bucket"
    assert len(names) == len(set(names)), "a tensor was exported twice"
    assert set(names) == set(source.keys()), (set(names) ^ set(source.keys()))
    for bucket in buckets:
        for name, tensor in bucket:
            assert tensor.dtype == source[name].dtype and torch.equal(tensor, source[name]), name
    sizes = [[t.numel() * t.element_size() for _, t in b] for b in buckets]
    for bucket, nbytes in zip(buckets, sizes):
        assert len(bucket) == 1 or sum(nbytes) <= LIMIT, ([n for n, _ in bucket], sum(nbytes))
    assert any(len(b) > 1 for b in buckets), "the limit never combined tensors: the test is too weak"
    largest = max((nb, i) for i, b in enumerate(sizes) for nb in b)
    assert largest[0] > LIMIT and len(buckets[largest[1]]) == 1, [n for n, _ in buckets[largest[1]]]
    layers = [int(m[1]) for n in names if (m := _LAYER.match(n))]
    assert sorted(_runs(layers)) == sorted(set(layers)), f"layers interleaved: {_runs(layers)}"
    experts = [(int(m[1]), int(m[2])) for n in names if (m := _EXPERT.match(n))]
    runs = _runs(experts)
    assert runs == sorted(set(experts)), f"experts not one at a time in order: {runs}"


@pytest.mark.parametrize("case", list(CASES))
def test_buckets_equal_hf_weights_on_every_rank(case, tmp_path):
    from mcore_rl.mapping.hf_io import SafetensorsReader

    model_type, overrides, world, layout = CASES[case]
    tiny_hf_model(tiny_config(model_type, **overrides)).save_pretrained(tmp_path)
    per_rank = run_ranks(world, _export_buckets, str(tmp_path), layout, LIMIT)
    source = SafetensorsReader(tmp_path)
    if model_type.endswith("moe"):
        assert any(_EXPERT.match(k) for k in source.keys())
    _assert_stream_ok(per_rank[0], source)
    for rank, buckets in enumerate(per_rank[1:], start=1):
        assert [[n for n, _ in b] for b in buckets] == [[n for n, _ in b] for b in per_rank[0]], rank
        for bucket, first in zip(buckets, per_rank[0]):
            assert all(torch.equal(t, u) for (_, t), (_, u) in zip(bucket, first)), rank


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1MB"])
def test_bad_bucket_size_is_a_clear_error(bad):
    from mcore_rl.errors import McoreRLError
    from mcore_rl.mapping.weights import iter_hf_buckets
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import weight_map

    wmap = weight_map(model_args_from_hf(tiny_config("llama")), "actor", 1)
    with pytest.raises(McoreRLError, match=r"bucket_bytes=.*must be a positive int") as info:
        iter_hf_buckets([], wmap, bad)  # raised at the call, before any collective
    assert isinstance(info.value, ValueError) and repr(bad) in str(info.value)
