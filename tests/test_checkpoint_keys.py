"""The CPU spec's dist-checkpoint keys equal the Transformer Engine spec's (committed list), so a
checkpoint written on CPU loads on GPU and back."""
from __future__ import annotations

import json
import os

import pytest

from tests.dist import run_ranks
from tests.tiny import tiny_config

EXPECTED = json.load(open(os.path.join(os.path.dirname(__file__), "data", "te_sharded_keys.json")))
CASES = [k for k in EXPECTED if not k.startswith("_")]


def _checkpoint_keys(cases: list[str], layout_kwargs: dict) -> dict:
    from mcore_rl.models.builder import build_model
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout)
    keys = {}
    for case in cases:
        model_type, role = case.split("/")
        extra = dict(mlp_only_layers=[0]) if model_type == "qwen2_moe" else {}
        args = model_args_from_hf(tiny_config(model_type, num_hidden_layers=2, **extra))
        chunks = build_model(args, layout, role, active_platform())
        keys[case] = sorted({v.key for c in chunks for v in c.sharded_state_dict().values()})
    return keys


@pytest.mark.parametrize(
    "layout", [dict(), dict(tp=2, pp=2, sequence_parallel=True)], ids=["single", "tp2_pp2_sp"]
)
def test_cpu_spec_keys_equal_te_spec_keys(layout):
    world = layout.get("tp", 1) * layout.get("pp", 1)
    per_rank = run_ranks(world, _checkpoint_keys, CASES, layout)
    for case in CASES:
        union = sorted(set().union(*(r[case] for r in per_rank)))
        assert union == EXPECTED[case], case


@pytest.mark.cuda
def test_te_spec_keys_equal_committed_list():
    from mcore_rl.platform import setup_platform

    platform = setup_platform("cuda")
    if not platform.transformer_engine:
        pytest.skip("Transformer Engine not installed")
    # run in this process: the committed list is checked against the real TE modules
    import torch

    from mcore_rl.platform import init_distributed

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    init_distributed(platform, 0, 1)
    try:
        keys = _checkpoint_keys(CASES, {})
    finally:
        torch.distributed.destroy_process_group()
    for case in CASES:
        assert keys[case] == EXPECTED[case], case
