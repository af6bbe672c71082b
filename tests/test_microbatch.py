"""The micro-batcher: dynamic (length-grouped, trimmed) micro-batches give the results of fixed
ones with rows back in their order; a sequence length that TP with sequence parallel does not
divide is padded (left) and gives the results of an unpadded TP=1 run."""
from __future__ import annotations

import pytest
import torch

from mcore_rl.rl.microbatcher import MicroBatchSpec, plan_micro_batches
from tests.dist import run_ranks
from tests.tiny import rl_batch, saved_tiny_llama

ROWS, PROMPT, R = 8, 12, 10


def _batch(prompt: int = PROMPT) -> dict:
    """Lengths that vary a lot: prompts of 1..prompt tokens, responses of 1..R."""
    batch = rl_batch(200, batch=ROWS, prompt=prompt, response=R, seed=7)
    mask = batch["attention_mask"]
    mask[0, : prompt - 1] = 0  # a one-token prompt
    mask[0, prompt + 1 :] = 0  # and a one-token response: row 0 is short
    mask[5, :] = 1  # row 5 uses every column
    batch["input_ids"] = torch.randint(1, 200, mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    batch["responses"] = batch["input_ids"][:, -R:].clone()
    g = torch.Generator().manual_seed(3)
    batch.update(old_log_probs=-3.0 * torch.rand(ROWS, R, generator=g) * mask[:, -R:],
                 advantages=torch.randn(ROWS, R, generator=g) * mask[:, -R:])
    return batch


def test_dynamic_plan_groups_by_length_and_trims():
    batch = _batch()
    plan = plan_micro_batches(batch, MicroBatchSpec(max_tokens=3 * (PROMPT + R)))
    widths = [p["input_ids"].shape[1] for p in plan.batches]
    assert min(widths) < PROMPT + R and len(set(widths)) > 1, widths  # padding columns trimmed
    assert plan.rows[0][0] == 5  # the longest row first: rows are reordered
    assert sorted(i for rows in plan.rows for i in rows) == list(range(ROWS))
    assert all(p["input_ids"].numel() <= 3 * (PROMPT + R) for p in plan.batches)
    # restore() puts rows back: the responses of each piece land on their own rows
    back = plan.restore([p["responses"] for p in plan.batches])
    real = batch["attention_mask"][:, -R:].bool()
    assert torch.equal(torch.where(real, back, 0), torch.where(real, batch["responses"], 0))


@pytest.mark.parametrize("spec", [
    dict(micro_batch_size=4, seq_multiple=4),
    dict(max_tokens=3 * (PROMPT + R), seq_multiple=4),
    dict(max_tokens=3 * (PROMPT + R), uniform_shape=True, min_count=5, min_rows=3),
    dict(collate="packed", max_tokens=2 * (PROMPT + R), seq_multiple=4, pack_multiple=4),
])
def test_token_ids_point_at_each_token_in_the_rows_given(spec):
    """Every real token of every micro-batch carries its flat index row * S + column in the rows
    given (what routing replay looks routes up by), through trimming, reordering, left padding,
    filler rows and packing."""
    batch = _batch()
    plan = plan_micro_batches(batch, MicroBatchSpec(**spec))
    flat, seen, s = batch["input_ids"].flatten(), [], batch["input_ids"].shape[1]
    for mb, rows in zip(plan.batches, plan.rows):
        real = mb["attention_mask"].bool()
        assert mb.token_id.shape == mb["input_ids"].shape
        assert torch.equal(flat[mb.token_id[real]], mb["input_ids"][real])
        for j, row in enumerate(rows):  # the row it came from, its columns one after another
            ids = mb.token_id[j][real[j]]
            assert bool((ids // s == row).all()) and bool((ids.diff() == 1).all())
        seen.append(mb.token_id[real])
    assert sorted(torch.cat(seen).tolist()) == batch["attention_mask"].flatten().nonzero().squeeze(-1).tolist()


def _run(hf_dir: str, layout: dict, actor: dict, batch: dict) -> dict:
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(**layout)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "actor", active_platform(), optim=OptimConfig(lr=0.5, eps=1.0), hf_weights=hf_dir)
    act = Actor(engine, ActorConfig(ppo_mini_batch_size=ROWS, **actor))
    out = act.compute_log_prob(batch, with_entropy=True)
    metrics = act.update_policy(batch)
    return {"lp": out["log_probs"], "ent": out["entropy"], "metrics": metrics,
            "params": export_hf(engine.model, args, "actor")}


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return saved_tiny_llama(tmp_path_factory.mktemp("microbatch"))


@pytest.fixture(scope="module")
def fixed(hf_dir):
    return run_ranks(1, _run, hf_dir, {}, dict(micro_batch_size=2), _batch())[0]


def _assert_same(result: dict, ref: dict, what: str) -> None:
    for key in ("lp", "ent"):
        diff = (result[key] - ref[key]).abs().max().item()
        assert diff <= 1e-5, f"{what}: {key} differs by {diff:.3g}"
    worst = max(((result["params"][k] - p).abs().max().item(), k) for k, p in ref["params"].items())
    assert worst[0] <= 1e-5, f"{what}: {worst[1]} differs by {worst[0]:.3g}"
    assert abs(result["metrics"]["actor/pg_loss"] - ref["metrics"]["actor/pg_loss"]) <= 1e-5, what


DYNAMIC = {  # name -> (world, layout); budgets of ~2-3 rows
    "tp1": (1, dict()),
    "dp2": (2, dict()),
    "pp2_vpp2": (2, dict(pp=2, vpp=2)),
}


@pytest.mark.parametrize("name", DYNAMIC)
def test_dynamic_equals_fixed(name, hf_dir, fixed):
    world, layout = DYNAMIC[name]
    budget = dict(max_tokens_per_micro_batch=60)
    for rank, result in enumerate(run_ranks(world, _run, hf_dir, layout, budget, _batch())):
        _assert_same(result, fixed, f"{name} rank {rank}")


def test_sequence_padded_for_sequence_parallel(hf_dir):
    batch = _batch(prompt=PROMPT - 1)  # S = 21: not a multiple of tp = 2
    ref = run_ranks(1, _run, hf_dir, {}, dict(micro_batch_size=2), batch)[0]
    for rank, result in enumerate(run_ranks(2, _run, hf_dir, dict(tp=2, sequence_parallel=True),
                                            dict(micro_batch_size=2), batch)):
        _assert_same(result, ref, f"tp2+sp rank {rank}")


def test_pipeline_shape_keeps_the_token_budget():
    """Under PP every piece has the width of the columns any row uses, which is wider than any
    single row when long prompts and long responses sit in different rows."""
    batch = rl_batch(50, batch=4, prompt=10, response=8)
    mask = batch["attention_mask"]
    mask[:] = 0
    mask[0, 9:] = 1  # one-token prompt, full response: columns 9..17
    mask[1, :11] = 1  # full prompt, one-token response: columns 0..10
    mask[2:, 9:11] = 1
    batch["input_ids"] *= mask
    batch["responses"] = batch["input_ids"][:, 10:].clone()
    for multiple in (1, 4):
        spec = MicroBatchSpec(max_tokens=40, uniform_shape=True, seq_multiple=multiple)
        shapes = [tuple(p["input_ids"].shape) for p in plan_micro_batches(batch, spec).batches]
        assert all(b * s <= 40 for b, s in shapes), (multiple, shapes)
