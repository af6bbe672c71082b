"""Actor.compute_log_prob / entropy: equal to HF (with temperature, vocab padding) and equal
across TP, PP, PP x VPP, DP and dynamic batching."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import hf_log_probs, rl_batch, tiny_config, tiny_hf_model

TEMPERATURE = 0.7
LAYOUTS = {  # name -> (world, layout, actor config overrides)
    "tp1": (1, dict(), {}),
    "tp2": (2, dict(tp=2), {}),
    "pp2": (2, dict(pp=2), {}),
    "pp2_vpp2": (2, dict(pp=2, vpp=2), {}),
    "dp2": (2, dict(), {}),
    "dynamic_tp2": (2, dict(tp=2), dict(max_tokens_per_micro_batch=48)),
    "dynamic_pp2_vpp2": (2, dict(pp=2, vpp=2), dict(max_tokens_per_micro_batch=40)),
}


def _log_probs(hf_dir: str, layout: dict, overrides: dict, batch: dict) -> dict:
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine

    layout = ParallelLayout(**layout)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "actor", active_platform(), hf_weights=hf_dir)
    config = ActorConfig(temperature=TEMPERATURE, micro_batch_size=2, **overrides)
    return Actor(engine, config).compute_log_prob(batch, with_entropy=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    d = tmp_path_factory.mktemp("actor")
    hf = tiny_hf_model(tiny_config("qwen2", num_hidden_layers=4))  # vocab 200: padded to 256
    hf.save_pretrained(d)
    return str(d), hf


@pytest.fixture(scope="module")
def reference(model):
    d, _ = model
    batch = rl_batch(200)
    return batch, run_ranks(1, _log_probs, d, {}, {}, batch)[0]


def test_matches_hf_with_temperature(model, reference):
    _, hf = model
    batch, ours = reference
    ref_lp, ref_ent = hf_log_probs(hf, batch, TEMPERATURE)
    assert (ours["log_probs"] - ref_lp).abs().max() <= 1e-4
    assert (ours["entropy"] - ref_ent).abs().max() <= 1e-4
    assert ref_lp.abs().max() > 1.0 and ref_ent.abs().max() > 1.0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_equal_across_layouts(layout, model, reference):
    d, _ = model
    batch, ref = reference
    world, kwargs, overrides = LAYOUTS[layout]
    for rank, result in enumerate(run_ranks(world, _log_probs, d, kwargs, overrides, batch)):
        for key in ("log_probs", "entropy"):
            diff = (result[key] - ref[key]).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {key} differs by {diff:.3g}"


def _shapes_seen(hf_dir: str, batch: dict) -> list:
    from torch.utils._python_dispatch import TorchDispatchMode

    class RecordShapes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor):
                    self.shapes.add(tuple(t.shape))
            return out

    recorder = RecordShapes()
    with recorder:
        _log_probs(hf_dir, dict(tp=2), {}, batch)
    return sorted(recorder.shapes)


def test_no_full_vocab_tensor_with_tp2(model):
    d, _ = model
    batch = rl_batch(200)
    for shapes in run_ranks(2, _shapes_seen, d, batch):
        assert (2, 16, 128) in shapes  # the vocab shard of a micro-batch's logits was seen
        wide = [s for s in shapes if s and s[-1] >= 200 and len(s) >= 2]
        assert wide == [], f"tensors as wide as the vocab were created: {wide[:5]}"


def _small_vocab(temperature: float) -> dict:
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.rl.logprob import log_probs_and_entropy
    from megatron.core import parallel_state

    initialize_parallel_state(ParallelLayout(tp=2))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(3, 5, 128, generator=g, requires_grad=True)  # vocab 16 padded to 128
    labels = torch.randint(0, 16, (3, 5), generator=g)
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = full[..., rank * 64 : (rank + 1) * 64]  # rank 1 holds padding columns only
    lp, ent = log_probs_and_entropy(shard, labels, 16, temperature, True)
    (lp.sum() + ent.sum()).backward()
    ref = torch.log_softmax(full.detach()[..., :16].double() / temperature, -1)
    ref_lp = ref.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ref_ent = -(ref.exp() * ref).sum(-1)
    return {"lp": (lp - ref_lp).abs().max().item(), "ent": (ent - ref_ent).abs().max().item(),
            "grad_finite": bool(torch.isfinite(full.grad).all()), "pad_grad": full.grad[..., 16:].abs().max().item()}


def test_shard_of_only_padding_columns():
    for result in run_ranks(2, _small_vocab, 0.5):
        assert result["lp"] <= 1e-6 and result["ent"] <= 1e-6 and result["grad_finite"], result
        assert result["pad_grad"] == 0.0  # padding columns never receive probability mass
