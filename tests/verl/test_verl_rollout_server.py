"""The CPU rollout server (rollout.name=mcore_rl) driven as verl's agent loop and weight sync
drive it, in-process (no Ray): samples and their log-probs against transformers' own forward,
batch invariance, seeds, the weight sync's coverage checks, aborts and refused requests."""
from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("verl")

from tests.verl.verl_fixtures import save_tiny_model  # noqa: E402

T = 0.8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("rollout") / "model"))


def make_server(model_dir: str, **rollout):
    from verl.workers.config import HFModelConfig, RolloutConfig

    from mcore_rl.integrations.verl.rollout_server import RolloutServer

    settings = dict(name="mcore_rl", dtype="float32", prompt_length=16, response_length=8, load_format="auto",
                    tensor_model_parallel_size=1, seed=3)
    config = RolloutConfig(**{**settings, **rollout})
    return RolloutServer(config, HFModelConfig(path=model_dir), replica_rank=0)


def prompts(n: int) -> list[list[int]]:
    return [[7 + (3 * i + j) % 30 for j in range(2 + i % 5)] for i in range(n)]


def generate_all(server, batch: list[list[int]], request_ids: list[str], **params):
    async def run():
        return await asyncio.gather(*[server.generate(prompt_ids=p, request_id=r, sampling_params={
            "temperature": T, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True, **params})
            for p, r in zip(batch, request_ids)])

    return asyncio.run(run())


def hf_log_probs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    picked = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, -1)
    return picked.gather(-1, torch.tensor(response)[:, None])[:, 0]


def test_samples_score_as_transformers_and_do_not_depend_on_the_batch(model_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    batched = make_server(model_dir)
    alone = make_server(model_dir, full_determinism=True)  # one request at a time
    assert alone.max_batch == 1 and batched.max_batch > 1
    ids = [f"r{i}" for i in range(12)]
    out_b = generate_all(batched, prompts(12), ids)
    out_a = generate_all(alone, prompts(12), ids)
    eos = batched.stop
    lengths = set()
    for p, b, a in zip(prompts(12), out_b, out_a):
        assert b.token_ids == a.token_ids, "a sample changed with the batch it was generated in"
        assert b.stop_reason == "completed" and 1 <= len(b.token_ids) <= 8
        assert all(t not in eos for t in b.token_ids[:-1])  # it ends at the first end-of-sequence
        lengths.add(len(b.token_ids))
        diff = (hf_log_probs(reference, p, b.token_ids, T) - torch.tensor(b.log_probs)).abs().max()
        assert diff <= 1e-5, f"rollout log-probs differ from transformers' log_softmax(logits / T) by {diff}"
    assert len(lengths) > 1  # some samples stopped early, others ran to the budget


def test_greedy_is_the_argmax_and_top_k_one_equals_greedy(model_dir):
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    server = make_server(model_dir)
    greedy = generate_all(server, prompts(4), ["g0", "g1", "g2", "g3"], temperature=0.0)
    top1 = generate_all(server, prompts(4), ["k0", "k1", "k2", "k3"], top_k=1)
    for p, g, k in zip(prompts(4), greedy, top1):
        seq = list(p)
        for t in g.token_ids:
            with torch.no_grad():
                assert int(reference(torch.tensor([seq])).logits[0, -1].argmax()) == t
            seq.append(t)
        assert k.token_ids == g.token_ids
        lp = hf_log_probs(reference, p, k.token_ids, T)  # top-k restricts the draw, not the log-probs
        assert (lp - torch.tensor(k.log_probs)).abs().max() <= 1e-5


def test_seeds_separate_a_groups_samples_and_reproduce_after_a_restart(model_dir):
    group = [prompts(1)[0]] * 6  # verl sends one request id for every sample under full_determinism
    first = generate_all(make_server(model_dir, full_determinism=True), group, ["det-0"] * 6)
    again = generate_all(make_server(model_dir, full_determinism=True), group, ["det-0"] * 6)
    samples = [tuple(o.token_ids) for o in first]
    assert len(set(samples)) > 1, "identical requests of one group drew the same sample"
    assert sorted(samples) == sorted(tuple(o.token_ids) for o in again)
    other_seed = generate_all(make_server(model_dir, full_determinism=True, seed=4), group, ["det-0"] * 6)
    assert sorted(samples) != sorted(tuple(o.token_ids) for o in other_seed)


def test_weight_sync_replaces_every_parameter_or_refuses_to_generate(model_dir):
    from transformers import AutoModelForCausalLM

    from mcore_rl.integrations.verl.rollout_server import RolloutServerError

    server = make_server(model_dir, load_format="dummy")  # random weights until the first sync
    trained = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    names = list(trained)

    async def sync(items, steps):  # as the adapter sends: buckets, then finish (complete unless one failed)
        await server.begin_weight_update()
        complete = False
        try:
            for i in range(0, len(items), 3):
                await server.update_weights_bucket(items[i:i + 3])
            complete = True
        finally:
            await server.finish_weight_update(steps, complete=complete)

    asyncio.run(sync([(n, trained[n]) for n in names], 5))
    for name, param in server.engine.model.state_dict().items():
        assert torch.equal(param, trained[name]), name
    assert generate_all(server, prompts(1), ["x"])[0].extra_fields["global_steps"] == 5
    with pytest.raises(RolloutServerError, match="left 1 rollout parameters unchanged"):
        asyncio.run(sync([(n, trained[n]) for n in names[1:]], 6))
    with pytest.raises(RolloutServerError, match="failed part-way"):
        generate_all(server, prompts(1), ["y"])
    with pytest.raises(Exception, match="no parameter of the rollout model"):
        asyncio.run(sync([("model.nonsense.weight", trained[names[0]])], 7))
    asyncio.run(sync([(n, trained[n]) for n in names], 8))  # a whole sync recovers
    assert generate_all(server, prompts(1), ["z"])[0].extra_fields["global_steps"] == 8


def test_abort_ends_queued_requests_and_resume_readmits(model_dir):
    server = make_server(model_dir)

    async def run():
        first = [asyncio.ensure_future(server.generate(prompt_ids=p, request_id=f"a{i}", sampling_params={}))
                 for i, p in enumerate(prompts(3))]
        await asyncio.sleep(0)  # queued, the batch not started yet
        result = await server.abort_all_requests()
        aborted = await asyncio.gather(*first)
        waiting = asyncio.ensure_future(server.generate(prompt_ids=[5, 6], request_id="late", sampling_params={}))
        await asyncio.sleep(0.05)
        parked = not waiting.done()
        await server.resume_generation()
        late = await waiting
        await server.abort_all_requests(reject_request=True)
        rejected = await server.generate(prompt_ids=[5, 6], request_id="r", sampling_params={})
        return result, aborted, parked, late, rejected

    result, aborted, parked, late, rejected = asyncio.run(run())
    assert result["aborted_count"] == 3 and all(o.stop_reason == "aborted" and not o.token_ids for o in aborted)
    assert parked and late.stop_reason == "completed" and late.token_ids
    assert rejected.stop_reason == "aborted" and not rejected.token_ids


@pytest.mark.parametrize("params, message", [
    ({"repetition_penalty": 1.1}, "repetition_penalty"),
    ({"stop": ["w1"]}, r"\['stop'\] are not supported"),
    ({"n": 2}, "'n'"),
])
def test_unsupported_sampling_is_refused_by_name(model_dir, params, message):
    from mcore_rl.integrations.verl.rollout_server import RolloutServerError

    server = make_server(model_dir)
    with pytest.raises(RolloutServerError, match=message):
        generate_all(server, prompts(1), ["q"], **params)


def test_a_prompt_without_room_is_refused(model_dir):
    from mcore_rl.integrations.verl.rollout_server import RolloutServerError

    server = make_server(model_dir)
    with pytest.raises(RolloutServerError, match="leaves no room"):
        generate_all(server, [[5] * 24], ["long"])


class _Local:
    """Calls a server's methods as a Ray actor handle would (``handle.method.remote(...)``
    awaited), in this process."""

    def __init__(self, server, calls: list):
        self._server, self._calls = server, calls

    def __getattr__(self, name):
        method = getattr(self._server, name)

        class _Remote:
            @staticmethod
            def remote(*args, **kwargs):
                self._calls.append((name, args))
                return method(*args, **kwargs)

        return _Remote


def test_adapter_sends_buckets_from_one_rank_and_copies_views(model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM
    from verl.workers.config import HFModelConfig, RolloutConfig

    from mcore_rl.integrations.verl.rollout_replica import ServerAdapter

    trained = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    flat = torch.cat([t.flatten() for t in trained.values()])  # every tensor a view of one storage, as DDP's buffer
    views, offset = {}, 0
    for name, t in trained.items():
        views[name] = flat[offset:offset + t.numel()].view(t.shape)
        offset += t.numel()
    config = RolloutConfig(name="mcore_rl", dtype="float32", prompt_length=16, response_length=8,
                           load_format="dummy", tensor_model_parallel_size=2)
    sent = {}
    for rank in (0, 1):  # rollout TP=2: one replica, rank 0 pushes
        monkeypatch.setenv("RANK", str(rank))
        adapter = ServerAdapter(config, HFModelConfig(path=model_dir), None)
        adapter.bucket_bytes = 20_000
        server, calls = make_server(model_dir, load_format="dummy"), []
        adapter._server = _Local(server, calls) if adapter.is_pusher else None
        drained = []

        def weights():
            for name, t in views.items():
                drained.append(name)
                yield name, t

        asyncio.run(adapter.update_weights(weights(), global_steps=3))
        assert drained == list(views)  # every rank runs the collective generator to its end
        sent[rank] = [args[0] for name, args in calls if name == "update_weights_bucket"]
        if adapter.is_pusher:
            assert server.global_steps == 3
            for name, param in server.engine.model.state_dict().items():
                assert torch.equal(param, trained[name]), name
    assert sent[1] == [] and len(sent[0]) > 2
    for bucket in sent[0]:
        size = sum(t.nbytes for _, t in bucket)
        assert size <= 20_000 or len(bucket) == 1, size  # a larger tensor travels alone
        assert all(t.untyped_storage().nbytes() == t.nbytes for _, t in bucket)  # not the whole buffer


def test_adapter_sync_serves_w_plus_sba_refuses_partial_adapters_and_a_full_sync_removes_them(model_dir):
    """verl's adapter-only sync (PEFT names, peft config) into the server: the model computes
    (W + alpha/r B A) x on the adapted linear; a missing factor, an unknown module, a shape that
    does not fit or DoRA is refused (and the server refuses to generate until a whole sync); a
    full weight sync (verl's base sync) removes the adapters."""
    import copy

    from mcore_rl.integrations.verl.rollout_lora import RolloutAdapterError
    from mcore_rl.integrations.verl.rollout_server import RolloutServerError

    server = make_server(model_dir)
    model = server.engine.model
    ids = torch.tensor([prompts(1)[0]])
    with torch.no_grad():
        base = model(ids).logits
    q = model.model.layers[0].self_attn.q_proj
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, q.in_features, generator=g), torch.randn(q.out_features, 2, generator=g)
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    peft = {"r": 2, "lora_alpha": 6, "peft_type": "LORA"}

    async def sync(items, peft_config):
        await server.begin_weight_update(peft_config)
        complete = False
        try:
            await server.update_weights_bucket(items)
            complete = True
        finally:
            await server.finish_weight_update(4, complete=complete)

    merged = copy.deepcopy(model)  # before the sync: the adapters' forward hooks would be copied too
    with torch.no_grad():
        merged.model.layers[0].self_attn.q_proj.weight += 3.0 * b @ a
        expected = merged(ids).logits
    asyncio.run(sync([(name.format("A"), a), (name.format("B"), b)], peft))
    with torch.no_grad():
        served = model(ids).logits
    assert (served - expected).abs().max() <= 1e-5 and (served - base).abs().max() > 1e-2
    for items, config, message in (
            ([(name.format("A"), a)], peft, "only lora_A arrived"),
            ([(name.format("A").replace("q_proj", "nope"), a)], peft, "has no linear"),
            ([(name.format("A"), a.T), (name.format("B"), b)], peft, "do not fit"),
            ([(name.format("A"), a), (name.format("B"), b)], {**peft, "use_dora": True}, "use_dora")):
        with pytest.raises(RolloutAdapterError, match=message):
            asyncio.run(sync(items, config))
        with pytest.raises(RolloutServerError, match="failed part-way"):
            generate_all(server, prompts(1), ["x"])  # stale after a failed sync
    trained = dict(model.named_parameters())
    asyncio.run(sync([(n, p.detach().clone()) for n, p in trained.items()], None))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, base) and not server.adapters.active


def test_adapter_refused_at_the_start_still_drains_the_collective_generator(model_dir, monkeypatch):
    from verl.workers.config import HFModelConfig, RolloutConfig

    from mcore_rl.integrations.verl.rollout_lora import RolloutAdapterError
    from mcore_rl.integrations.verl.rollout_replica import ServerAdapter

    monkeypatch.setenv("RANK", "0")
    config = RolloutConfig(name="mcore_rl", dtype="float32", prompt_length=16, response_length=8,
                           tensor_model_parallel_size=1)
    adapter = ServerAdapter(config, HFModelConfig(path=model_dir), None)
    adapter._server = _Local(make_server(model_dir), [])
    drained = []

    def weights():
        for i in range(3):
            drained.append(i)
            yield f"base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight", torch.zeros(2, 2)

    with pytest.raises(RolloutAdapterError, match="use_dora"):
        asyncio.run(adapter.update_weights(weights(), global_steps=1, peft_config={"r": 2, "lora_alpha": 4,
                                                                                    "use_dora": True},
                                           base_sync_done=True))
    assert drained == [0, 1, 2]


def test_a_sync_whose_sender_died_does_not_wedge_the_server(model_dir):
    """Issue #37 item 9: a sync begun, one bucket sent, then its sender died (no finish): the
    lock it holds blocked every later sync and request forever. The next trainer's begin takes
    over (the request that waited is served by its complete weights); a sync silent for
    ``sync_timeout_s`` is abandoned: the request that waited and later ones fail with a clear
    error until a whole sync; a late call of the dead sync is refused."""
    from transformers import AutoModelForCausalLM

    from mcore_rl.integrations.verl.rollout_server import RolloutServerError

    server = make_server(model_dir)
    server.sync_timeout_s = 0.5
    trained = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    items = [(n, t) for n, t in trained.items()]
    ask = dict(prompt_ids=[5, 6, 7], sampling_params={"temperature": T})

    async def dies_after_one_bucket():
        await server.begin_weight_update()
        await server.update_weights_bucket(items[:1])

    async def whole(steps):
        await server.begin_weight_update()
        await server.update_weights_bucket(items)
        await server.finish_weight_update(steps)

    async def run():
        await dies_after_one_bucket()
        waiting = asyncio.ensure_future(server.generate(request_id="w1", **ask))
        await asyncio.sleep(0.05)
        parked = not waiting.done()
        await asyncio.wait_for(whole(9), 5)  # the next trainer's sync: takes over
        served = await asyncio.wait_for(waiting, 5)
        await dies_after_one_bucket()
        waiting = asyncio.ensure_future(server.generate(request_id="w2", **ask))
        failed = await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), 5)
        later = await asyncio.gather(server.generate(request_id="w3", **ask), return_exceptions=True)
        late_call = await asyncio.gather(server.finish_weight_update(10), return_exceptions=True)
        await asyncio.wait_for(whole(11), 5)
        again = await asyncio.wait_for(server.generate(request_id="w4", **ask), 5)
        return parked, served, failed[0], later[0], late_call[0], again

    parked, served, failed, later, late_call, again = asyncio.run(run())
    assert parked and served.stop_reason == "completed" and served.token_ids
    assert served.extra_fields["global_steps"] == 9
    for error in (failed, later):
        assert isinstance(error, RolloutServerError) and "failed part-way or was abandoned" in str(error), error
    assert isinstance(late_call, RolloutServerError) and "finish_weight_update outside" in str(late_call), late_call
    assert again.token_ids and again.extra_fields["global_steps"] == 11


def test_an_out_of_vocabulary_token_id_is_refused_alone(model_dir):
    """Issue #37 item 11: one request with an id past the vocabulary (or negative) failed every
    request batched with it with a bare IndexError; it is refused naming the id and the
    vocabulary size, and its batch-mates are served."""
    from mcore_rl.integrations.verl.rollout_server import RolloutServerError

    server = make_server(model_dir)
    vocab = server.engine.model.get_input_embeddings().num_embeddings

    async def run():
        batch = [[5, 6], [5, vocab], [7, 8], [-1, 4]]
        return await asyncio.gather(*[server.generate(prompt_ids=p, request_id=f"v{i}", sampling_params={})
                                      for i, p in enumerate(batch)], return_exceptions=True)

    ok1, too_big, ok2, negative = asyncio.run(run())
    assert ok1.stop_reason == ok2.stop_reason == "completed" and ok1.token_ids and ok2.token_ids
    for error, bad in ((too_big, vocab), (negative, -1)):
        assert isinstance(error, RolloutServerError), error
        assert f"prompt token id {bad} " in str(error) and f"vocabulary of {vocab} ids" in str(error), error


def test_gpt_oss_samples_with_eager_attention_past_its_window(tmp_path):
    """A tiny gpt-oss (no SDPA in transformers: sinks exist in its eager kernel only) served from
    its directory and from verl's config (``load_format=dummy``): the server picks eager both ways; samples from prompts of up to 6 tokens
    with 8 new ones (past the sliding window of 3) score as transformers' eager forward."""
    from transformers import AutoModelForCausalLM

    path = save_tiny_model(str(tmp_path / "gpt_oss"), model_type="gpt_oss", num_hidden_layers=2, head_dim=16,
                           num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, sliding_window=3)
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():  # sinks that matter (HF initialises them near 0)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.randn_like(layer.self_attn.sinks))
    model.save_pretrained(path)
    reference = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    server = make_server(path)
    dummy = make_server(path, load_format="dummy")
    assert server.engine.model.config._attn_implementation == dummy.engine.model.config._attn_implementation == "eager"
    out = generate_all(server, prompts(8), [f"g{i}" for i in range(8)], ignore_eos=True)
    for p, o in zip(prompts(8), out):
        assert len(o.token_ids) == 8
        diff = (hf_log_probs(reference, p, o.token_ids, T) - torch.tensor(o.log_probs)).abs().max()
        assert diff <= 1e-5, f"rollout log-probs differ from transformers' eager forward by {diff}"
