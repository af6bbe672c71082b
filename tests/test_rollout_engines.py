"""Rollout engines behind one contract, on tiny models: the builtin sampler (left-padded prompts,
end-of-sequence, greedy, rollout log-probs equal to the trainer's) and per-replica transformers
engines placed on each replica's first rank (DP, TP, CP), refreshed after an update; greedy
answers of both engines agree on the same weights."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

BOUND = 1e-4  # max |rollout log-prob - trainer log-prob| for the same fp32 weights
EOS = 3
PROMPTS = [[5, 9, 2], [7, 1, 1, 4, 8, 2], [11], [4, 4, 6, 12]] * 2  # different lengths: left padding


def _actor(hf_dir: str, layout: dict, lr: float = 1e-2):
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(**layout)
    initialize_parallel_state(layout, seed=5)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "actor", active_platform(), BuildOptions(), OptimConfig(lr=lr, warmup_steps=0), hf_dir)
    return Actor(engine, ActorConfig(temperature=0.8, micro_batch_size=4, ppo_mini_batch_size=8))


def _builtin(hf_dir: str, layout: dict) -> dict:
    from mcore_rl.rl.batch import response_mask
    from mcore_rl.rollout.builtin import BuiltinRollout
    from mcore_rl.rollout.hf_generate import TransformersRollout

    actor = _actor(hf_dir, layout)
    engine = BuiltinRollout(actor, eos_id=EOS, pad_id=0)
    sampled = engine.generate(PROMPTS, 6, 0.8, seed=4)
    batch = sampled.batch()
    old = actor.compute_log_prob(batch)["log_probs"]
    greedy = engine.generate(PROMPTS, 6, 0.0, seed=0)
    reference = TransformersRollout(hf_dir, eos_id=EOS, pad_id=0).generate(PROMPTS, 6, 0.0, seed=0)
    return {"batch": batch, "old": old, "mask": response_mask(batch), "greedy": greedy.responses,
            "greedy_lp": greedy.rollout_log_probs, "hf_greedy": reference.responses}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "hf"
    tiny_hf_model(tiny_config("llama", vocab_size=16, num_hidden_layers=2)).save_pretrained(path)
    return str(path)


def test_builtin_sampler_behind_the_engine_contract(tiny_dir):
    ranks = run_ranks(2, _builtin, tiny_dir, dict(tp=2))
    for other in ranks[1:]:  # every rank gets the same rows
        assert torch.equal(other["batch"]["input_ids"], ranks[0]["batch"]["input_ids"])
        assert torch.equal(other["greedy"], ranks[0]["greedy"])
    r = ranks[0]
    batch, mask = r["batch"], r["mask"].bool()
    width = max(len(p) for p in PROMPTS)
    for i, p in enumerate(PROMPTS):  # prompts right-aligned, padding masked
        assert batch["input_ids"][i, width - len(p):width].tolist() == p
        assert batch["attention_mask"][i, :width].sum() == len(p)
    ended = (batch["responses"] == EOS) & mask
    assert ended.any() and not ended.any(1).all(), "the seed must end some rows early and not others"
    for row, live in zip(batch["responses"], mask):
        n = int(live.sum())
        assert live[:n].all() and not live[n:].any()  # one contiguous response, then padding
        assert (row[:n - 1] != EOS).all() and (row[n:] == 0).all()
    diff = ((r["old"] - batch["rollout_log_probs"]).abs() * mask).max()
    assert diff <= BOUND and (batch["rollout_log_probs"][~mask] == 0).all()
    assert (batch["rollout_log_probs"][mask] < 0).all()
    assert r["greedy_lp"] is None
    assert torch.equal(r["greedy"], r["hf_greedy"])  # both engines pick the same argmax tokens


def _group(hf_dir: str, layout: dict, sync: bool) -> dict:
    from megatron.core import parallel_state

    from mcore_rl.rl.batch import response_mask
    from mcore_rl.rollout.group import RolloutGroup, replica_group
    from mcore_rl.rollout.hf_generate import TransformersRollout
    from mcore_rl.rollout.metrics import rollout_corr_metrics
    from transformers import AutoConfig

    actor = _actor(hf_dir, layout)
    src, group = replica_group()
    mine = torch.distributed.get_rank() == src
    engine = TransformersRollout(AutoConfig.from_pretrained(hf_dir), eos_id=EOS, pad_id=0) if mine else None
    rollouts = RolloutGroup(engine, 0, torch.device("cpu"), bucket_bytes=4096, replica=(src, group))
    rollouts.sync(actor.engine.model, actor.engine.args)  # random weights -> the actor's
    out = []
    for step in range(2):
        batch = rollouts.generate(PROMPTS, 5, 0.8, seed=step).batch()
        rollout_lp = batch.pop("rollout_log_probs")
        old = actor.compute_log_prob(batch)["log_probs"]
        out.append(rollout_corr_metrics(old, rollout_lp, response_mask(batch)))
        sign = torch.tensor([1.0, -1.0] * (len(PROMPTS) // 2)).unsqueeze(1)
        actor.update_policy({**batch, "old_log_probs": old, "advantages": sign * response_mask(batch)})
        if sync:
            rollouts.sync(actor.engine.model, actor.engine.args)
    return {"metrics": out, "engine": mine, "dp": parallel_state.get_data_parallel_rank(), "ids": batch["input_ids"]}


@pytest.mark.parametrize("layout", [dict(tp=1), dict(tp=2), dict(tp=1, cp=2)], ids=["dp2", "tp2", "cp2"])
def test_per_replica_engines_are_placed_and_synced(tiny_dir, layout):
    ranks = run_ranks(2, _group, tiny_dir, layout, True)
    dp = 2 if layout == dict(tp=1) else 1
    assert sum(r["engine"] for r in ranks) == dp  # one engine per model replica, on its first rank
    assert all(torch.equal(r["ids"], ranks[0]["ids"]) for r in ranks)
    if dp == 2:  # the two replicas drew different samples for the same prompts (distinct seeds)
        half = len(PROMPTS) // 2
        assert not torch.equal(ranks[0]["ids"][:half], ranks[0]["ids"][half:])
    for m in ranks[0]["metrics"]:
        assert m["rollout_corr/max_abs_log_prob_diff"] <= BOUND, m


def test_engine_without_sync_is_caught_by_the_mismatch_metric(tiny_dir):
    metrics = run_ranks(2, _group, tiny_dir, dict(tp=1), False)[0]["metrics"]
    assert metrics[0]["rollout_corr/max_abs_log_prob_diff"] <= BOUND
    assert metrics[1]["rollout_corr/max_abs_log_prob_diff"] >= 10 * BOUND, metrics[1]


def _bucket_lifetimes(hf_dir: str) -> dict:
    """While each parameter is fetched (the next bucket filling), how many tensors of buckets the
    consumer already handled and dropped are still alive: from export_hf_buckets and inside
    sync_weights. ``_fetch`` is wrapped to look, and otherwise runs unchanged."""
    import weakref

    from mcore_rl.mapping import weights
    from mcore_rl.models.hf_weights import export_hf_buckets
    from mcore_rl.rollout.engine import sync_weights

    actor = _actor(hf_dir, dict(tp=2))
    chunks, args = actor.engine.model, actor.engine.args

    class Probe:  # an engine that only remembers what it was handed
        def __init__(self) -> None:
            self.refs, self.alive, self.sizes = [], [], []

        def update_weights(self, named) -> int:
            self.refs = [weakref.ref(t) for _, t in named]
            self.sizes.append(len(self.refs))
            return len(self.refs)

    fetch = weights._fetch

    def watched(*a, **k):
        probe.alive.append(sum(r() is not None for r in probe.refs))
        return fetch(*a, **k)

    weights._fetch = watched
    try:
        probe = direct = Probe()
        for bucket in export_hf_buckets(chunks, args, "actor", 64 << 10):
            direct.update_weights(bucket)
            del bucket
        probe = synced = Probe()
        sync_weights(synced, chunks, args, 64 << 10)
    finally:
        weights._fetch = fetch
    return {"direct": (direct.alive, direct.sizes), "sync": (synced.alive, synced.sizes)}


def test_weight_sync_keeps_one_bucket_alive(tiny_dir):
    """Extra memory of a sync is one bucket + one parameter in transit, not two buckets: while
    the next bucket fills, nothing of the one the engine took is still alive."""
    for alive, sizes in run_ranks(2, _bucket_lifetimes, tiny_dir)[0].values():
        assert max(sizes) >= 4, sizes  # buckets hold several tensors: a second alive bucket would show
        assert max(alive) == 0, (alive, sizes)


def test_sync_refuses_a_value_the_rollout_dtype_cannot_hold():
    """Issue #37 item 6: the weight sync into an fp16 engine rounds each fp32 tensor once, and a
    weight beyond +-65504 is refused naming it and the fix (a wider engine dtype), the engine's
    parameter left as it was; a bf16 engine takes the same value."""
    from mcore_rl.mapping.casts import CastOverflowError
    from mcore_rl.rollout.hf_generate import TransformersRollout

    config = tiny_config("llama", vocab_size=16, num_hidden_layers=1)
    name = "model.layers.0.mlp.down_proj.weight"
    for dtype in (torch.float16, torch.bfloat16):
        engine = TransformersRollout(config, dtype=dtype, eos_id=EOS, pad_id=0)
        param = engine.params[name]
        weight = torch.randn(param.shape)  # fp32, as an fp32 trainer sends it
        assert engine.update_weights([(name, weight)]) == 1
        assert torch.equal(param, weight.to(dtype))
        weight[2, 1] = 7e4
        if dtype == torch.bfloat16:
            assert engine.update_weights([(name, weight)]) == 1 and param[2, 1].item() == 70144.0
            continue
        before = param.detach().clone()
        with pytest.raises(CastOverflowError, match=rf"weight '{name}' of the sync: 1 value\(s\) beyond float16's range "
                                                    r"\+-65504, the first 70000 at \[2, 1\], would be written as inf; "
                                                    r"the rollout model's float16 cannot hold it: run the rollout "
                                                    r"engine in a wider dtype"):
            engine.update_weights([(name, weight)])
        assert torch.equal(param, before)


def test_transformers_engine_samples_gpt_oss_with_eager_attention():
    """transformers' gpt-oss has no SDPA path (its attention sinks live in the eager kernel): the
    engine picks eager for it (sdpa for the others); its rollout log-probs, sampled with the KV
    cache from left-padded prompts past an active sliding window of 3 tokens, equal a full eager
    forward of the sampled rows, which a run without the window or the sinks does not match."""
    from mcore_rl.rollout.hf_generate import TransformersRollout

    config = tiny_config("gpt_oss", vocab_size=16, num_hidden_layers=2, head_dim=16, num_local_experts=4,
                         num_experts_per_tok=2, intermediate_size=48, sliding_window=3)
    assert TransformersRollout(tiny_config("llama", vocab_size=16, num_hidden_layers=1)).model.config._attn_implementation == "sdpa"
    torch.manual_seed(0)
    engine = TransformersRollout(config, eos_id=EOS, pad_id=0)
    model = engine.model
    assert model.config._attn_implementation == "eager" and model.config.layer_types == ["sliding_attention", "full_attention"]
    with torch.no_grad():
        for name, p in model.named_parameters():  # random sinks and biases: both matter
            if name.endswith(("sinks", "bias")):
                p.copy_(torch.randn_like(p))
    out = engine.generate(PROMPTS, 6, 0.8, seed=4)
    mask = out.attention_mask[:, -6:].bool()
    assert int(out.attention_mask.sum(1).max()) > 3 + 6  # rows far longer than the window

    def full_forward(**change) -> torch.Tensor:
        saved = {k: getattr(model.config, k) for k in change}
        for k, v in change.items():
            setattr(model.config, k, v)
        try:
            with torch.no_grad():
                logits = model(input_ids=out.input_ids, attention_mask=out.attention_mask).logits[:, -7:-1]
        finally:
            for k, v in saved.items():
                setattr(model.config, k, v)
        return torch.log_softmax(logits.float() / 0.8, -1).gather(-1, out.responses.unsqueeze(-1)).squeeze(-1) * mask

    reference = full_forward()
    assert float((out.rollout_log_probs - reference).abs().max()) <= 1e-5
    assert float((full_forward(sliding_window=64) - reference).abs().max()) > 1e-2  # the window acts
    sinks = [m.self_attn.sinks for m in model.model.layers]
    saved = [s.detach().clone() for s in sinks]
    with torch.no_grad():
        for s in sinks:
            s.fill_(-1e4)  # no sink: HF's attention without the extra logit
    try:
        assert float((full_forward() - reference).abs().max()) > 1e-2  # the sinks act
    finally:
        with torch.no_grad():
            for s, v in zip(sinks, saved):
                s.copy_(v)
