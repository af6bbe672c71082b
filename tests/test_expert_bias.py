"""The sigmoid routers' score-correction bias (DeepSeek-V3 / GLM-4.5 ``e_score_correction_bias``,
megatron's ``router.expert_bias``) is model state: loaded from HF, fixed by default in RL, moved by
megatron-core's count rule when ``expert_bias_update_rate`` > 0 (its resume is in
test_ckpt_resume), exported back under its HF name."""
from __future__ import annotations

import torch

from tests.ckpt_bodies import step_batch
from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

RATE = 0.01


def _train_recording(hf_dir: str, layout_kwargs: dict, rate: float, steps: int) -> dict:
    """An actor trained ``steps`` updates (2 optimizer steps each); around every optimizer step:
    each router's bias before and after, and the tokens it routed in that step's training
    forwards, counted by a hook on the router's output and summed over TP x DP x CP."""
    from megatron.core import parallel_state

    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout)
    options = BuildOptions(moe=MoEOptions(router_dtype="fp64", expert_bias_update_rate=rate))
    engine = ModelEngine(model_args_from_hf(hf_dir), layout, "actor", active_platform(), options,
                         OptimConfig(lr=0.02), hf_dir)
    actor = Actor(engine, ActorConfig(micro_batch_size=2, ppo_mini_batch_size=4))
    routers = [m for c in engine.model for n, m in c.named_modules() if n.endswith("mlp.router")]
    counts = {id(r): torch.zeros(r.expert_bias.shape[0]) for r in routers}

    def count(router, _inputs, output):
        if torch.is_grad_enabled():  # training forwards only, as megatron's rule counts
            counts[id(router)] += output[1].sum(0).float()

    for r in routers:
        r.register_forward_hook(count)
    records, step = [], engine.step

    def recording_step():
        before = [r.expert_bias.clone() for r in routers]
        tokens = [counts[id(r)].clone() for r in routers]
        for t in tokens:
            torch.distributed.all_reduce(
                t, group=parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True))
        out = step()
        records.append((before, tokens, [r.expert_bias.clone() for r in routers]))
        for c in counts.values():
            c.zero_()
        return out

    engine.step = recording_step
    first_router = routers[0].weight.detach().clone()
    for s in range(steps):
        actor.update_policy(step_batch(engine.args.vocab_size, s))
    return {"records": records, "router_moved": not torch.equal(first_router, routers[0].weight)}


def _hf_dir(tmp_path) -> str:
    tiny_hf_model(tiny_config("glm4_moe")).save_pretrained(tmp_path)
    return str(tmp_path)


def test_bias_is_bit_identical_with_updates_off(tmp_path):
    from mcore_rl.mapping.hf_io import SafetensorsReader

    hf_dir = _hf_dir(tmp_path)
    result = run_ranks(2, _train_recording, hf_dir, dict(ep=2), 0.0, 2)[0]
    assert result["router_moved"] and len(result["records"]) == 4  # training happened
    loaded = SafetensorsReader(hf_dir)["model.layers.1.mlp.gate.e_score_correction_bias"]
    for before, tokens, after in result["records"]:
        assert all(t.sum() > 0 for t in tokens)  # routing counted, yet nothing moves
        assert all(torch.equal(b, a) for b, a in zip(before, after))
    assert torch.equal(result["records"][0][0][0], loaded) and loaded.abs().sum() > 0


def test_bias_follows_the_count_rule_with_updates_on(tmp_path):
    """bias += rate * sign(mean count - count) after every optimizer step, the counts summed over
    DP (EP=2 gives DP=2 for the router): the same on both ranks."""
    results = run_ranks(2, _train_recording, _hf_dir(tmp_path), dict(ep=2), RATE, 2)
    moved = 0
    for result in results:
        for before, tokens, after in result["records"]:
            for b, t, a in zip(before, tokens, after):
                want = b + torch.sign(t.mean() - t) * RATE
                assert torch.equal(a, want), (a, want)
                moved += int((a != b).sum())
    assert moved > 0
    for x, y in zip(results[0]["records"], results[1]["records"]):
        assert all(torch.equal(p, q) for p, q in zip(x[2], y[2]))  # DP ranks agree
