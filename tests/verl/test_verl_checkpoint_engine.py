"""mcore_rl's checkpoint engine (checkpoint_engine.backend=mcore_rl) into CPU rollout servers built
in this process, as verl's CheckpointEngineManager drives it: versions bit-exact at trainer TP=2
and PP=2 into 1 and 2 replicas, delta versions sending only what changed, a sender killed mid-sync,
and versions with a missing, repeated, extra or altered tensor refused whole."""
from __future__ import annotations

import asyncio
import multiprocessing as mp
import threading

import pytest
import torch

pytest.importorskip("verl")

from tests.dist import run_ranks  # noqa: E402
from tests.verl import ce_bodies as B  # noqa: E402
from tests.verl.test_verl_rollout_server import generate_all, make_server, prompts  # noqa: E402
from tests.verl.verl_fixtures import save_tiny_model  # noqa: E402

_FORK = mp.get_context("fork")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("ce") / "model"))


def _served(server) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in server.engine.params.items()}


def _serve(ce_cls, servers, plan: list[int], trainer_ranks: int, metas, seen: list, failed: list) -> None:
    """The rollout side of each sync: the servers of ``plan[v]`` replicas receive version v+1.
    (Runs in a thread while run_ranks forks: it imports nothing, a fork would inherit a held
    import lock.)"""
    try:
        for version, receivers in enumerate(plan, start=1):
            links = B.receiver_links(ce_cls, trainer_ranks, receivers, metas.get(timeout=300))

            async def receive_all():
                return await asyncio.gather(*[s.receive_weights(link, version) for s, link in zip(servers, links)])

            replies = asyncio.run(receive_all())
            seen.append([(reply, _served(s), s.parameter_checksums()) for reply, s in zip(replies, servers)])
    except BaseException as e:  # noqa: BLE001 - reported by the test
        failed.append(e)


@pytest.mark.parametrize("layout", [dict(tp=2, sequence_parallel=True), dict(pp=2)], ids=["tp2", "pp2"])
def test_every_version_reaches_every_replica_bit_exact_and_a_delta_sends_only_the_changed(model_dir, layout):
    """Versions 1 (into 1 replica), 2 (into 2: the new one holds nothing, so a full version) and
    3 (a delta after the trainer moved two tensors' worth of parameters): after each, every
    receiving server's parameters equal the trainer's export bit for bit (tensor and checksum);
    the delta sends exactly the tensors that changed (count and bytes)."""
    from mcore_rl.integrations.verl.checkpoint_engine import McoreRLCheckpointEngine
    from mcore_rl.integrations.verl.weight_wire import tensor_checksum

    plan = [1, 2, 2]
    servers = [make_server(model_dir, load_format="dummy") for _ in range(2)]
    metas, seen, failed = _FORK.Queue(), [], []
    thread = threading.Thread(target=_serve, args=(McoreRLCheckpointEngine, servers, plan, 2, metas, seen, failed), daemon=True)
    thread.start()
    result = run_ranks(2, B.trainer_body, model_dir, layout, plan, 40_000, metas, timeout_s=180)[0]
    thread.join(timeout=60)
    assert not failed, failed
    exports, metrics = result["exports"], result["metrics"]
    assert len(seen) == len(plan)
    for version, (export, replies) in enumerate(zip(exports, seen), start=1):
        for reply, params, sums in replies:
            assert reply["tensors"] == metrics[version - 1]["checkpoint_engine/tensors_sent"]
            for name, tensor in export.items():
                assert torch.equal(params[name], tensor), (version, name)
                assert sums[name] == tensor_checksum(tensor), (version, name)
            assert reply["tensors"] and set(export) <= set(params)
    total = len(exports[0])
    assert [m["checkpoint_engine/delta"] for m in metrics] == [0.0, 0.0, 1.0]
    assert metrics[0]["checkpoint_engine/tensors_sent"] == metrics[1]["checkpoint_engine/tensors_sent"] == total
    changed = [n for n in exports[2] if not torch.equal(exports[2][n], exports[1][n])]
    assert 2 <= len(changed) < total // 4, changed  # layer 0's up/gate projections and the final norm
    assert metrics[2]["checkpoint_engine/tensors_sent"] == len(changed)
    assert metrics[2]["checkpoint_engine/tensor_bytes_sent"] == sum(exports[2][n].nbytes for n in changed)
    assert metrics[2]["checkpoint_engine/bytes_sent"] < metrics[1]["checkpoint_engine/bytes_sent"] / 4


def test_a_sender_killed_mid_sync_leaves_the_previous_version_served(model_dir):
    """The sender dies by SIGKILL with part of version 2's buckets delivered: the server's receive
    fails, its weights are version 1's bit for bit, and it keeps generating with them."""
    from transformers import AutoModelForCausalLM

    from mcore_rl.integrations.verl.checkpoint_engine import McoreRLCheckpointEngine

    weights = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    server = make_server(model_dir, load_format="dummy")
    metas = _FORK.Queue()
    sender = _FORK.Process(target=B.killed_sender, args=(weights, 20_000, metas, len(weights) // 2), daemon=True)
    sender.start()
    try:
        (link,) = B.receiver_links(McoreRLCheckpointEngine, 1, 1, metas.get(timeout=120))
        assert asyncio.run(server.receive_weights(link, 1))["tensors"] == len(weights)
        version1 = _served(server)
        (link,) = B.receiver_links(McoreRLCheckpointEngine, 1, 1, metas.get(timeout=120))
        with pytest.raises(Exception) as failure:
            asyncio.run(asyncio.wait_for(server.receive_weights(link, 2), 60))
    finally:
        sender.join(timeout=30)
    assert sender.exitcode == -9, (sender.exitcode, failure.value)
    after = _served(server)
    assert all(torch.equal(after[n], version1[n]) for n in version1)
    assert all(torch.equal(version1[n], weights[n]) for n in weights)
    sample = generate_all(server, prompts(1), ["after-kill"])[0]
    assert sample.stop_reason == "completed" and sample.token_ids and sample.extra_fields["global_steps"] == 1


def _bad_version(case: str, weights: dict[str, torch.Tensor], held: tuple[int, dict]) -> tuple[list, dict]:
    """(buckets of (name, tensor), manifest) of a version with one planted fault."""
    from mcore_rl.integrations.verl.weight_wire import tensor_checksum

    items = [(n, t + 1) for n, t in weights.items()]
    sums = {n: tensor_checksum(t) for n, t in items}
    names = [n for n, _ in items]
    manifest = {"token": 77, "base": 0, "names": names, "checksums": sums, "sent": list(names)}
    buckets = [items[:len(items) // 2], items[len(items) // 2:]]
    if case == "missing":
        buckets[1] = buckets[1][:-1]
    elif case == "repeated":
        buckets[1] = buckets[1] + [buckets[0][0]]
    elif case == "extra":
        manifest["sent"] = manifest["sent"][:-1]
    elif case == "altered":
        name, t = buckets[1][0]
        buckets[1][0] = (name, t.clone().view(-1).index_fill_(0, torch.tensor([0]), 5.0).view(t.shape))
    elif case == "foreign base":  # a delta of one tensor against a version this server never held
        buckets, manifest = [items[:1]], {**manifest, "base": held[0] + 1, "sent": names[:1]}
    return buckets, manifest


def _send_raw(link, buckets: list, manifest: dict) -> int:
    """The sender's side of the wire with the given buckets and manifest; returns the ack."""
    from mcore_rl.integrations.verl import weight_wire as W

    store = torch.distributed.TCPStore(link.host, link.port, is_master=False)
    group = W.open_group(W.Link(link.host, link.port, 0, link.world_size, link.prefix, link.timeout_s), store)
    cpu = torch.device("cpu")
    W._all_reduce_min(group, torch.tensor([2**62, 2**62]))
    for bucket in buckets:
        meta, offset, placed = [], 0, []
        for name, t in bucket:
            meta.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, t.nbytes])
            placed.append((offset, t))
            offset = W._aligned(offset + t.nbytes)
        W._send(group, cpu, W.BUCKET, meta, placed)
    W._send(group, cpu, W.MANIFEST, manifest, [])
    return int(W._all_reduce_min(group, torch.ones(1, dtype=torch.int64))[0])


@pytest.mark.parametrize("case, message", [
    ("missing", "1 tensors of the manifest never arrived"), ("repeated", "arrived twice"),
    ("extra", "the manifest does not list"), ("altered", "differ from the manifest's checksum"),
    ("foreign base", "a delta against version"),
])
def test_a_faulty_version_is_refused_whole(model_dir, case, message):
    """A version with a tensor missing, repeated, not in the manifest, altered on the way, or a
    delta against a version the server does not hold: the server refuses it (naming the fault),
    the sender's ack is 0, and the server still serves version 1, generating."""
    from transformers import AutoModelForCausalLM

    from mcore_rl.integrations.verl.checkpoint_engine import McoreRLCheckpointEngine
    from mcore_rl.integrations.verl.weight_wire import WeightSyncError

    weights = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    server, acks = make_server(model_dir, load_format="dummy"), []
    sender = McoreRLCheckpointEngine(1 << 20, is_master=True, timeout_s=60)
    meta = sender.prepare()
    actor, _ = B._topology(McoreRLCheckpointEngine, 1, 1, meta)
    sender.init_process_group(actor["rank"][0], actor["world_size"][0], actor["master"][0])
    (link,) = B.receiver_links(McoreRLCheckpointEngine, 1, 1, meta)
    thread = threading.Thread(target=lambda: asyncio.run(sender.send_weights(iter(weights.items()), 1)))
    thread.start()
    asyncio.run(server.receive_weights(link, 1))
    thread.join()
    version1 = _served(server)
    buckets, manifest = _bad_version(case, weights, server.known)
    (link,) = B.receiver_links(McoreRLCheckpointEngine, 1, 1, sender.prepare())
    thread = threading.Thread(target=lambda: acks.append(_send_raw(link, buckets, manifest)))
    thread.start()
    with pytest.raises(WeightSyncError, match=message):
        asyncio.run(server.receive_weights(link, 2))
    thread.join()
    assert acks == [0]
    assert all(torch.equal(p, version1[n]) for n, p in _served(server).items())
    assert generate_all(server, prompts(1), ["still"])[0].extra_fields["global_steps"] == 1


def test_topology_and_refused_options():
    """One sender (trainer rank 0), one receiver per replica (its first worker); the other
    workers sit out (-1). Unknown engine_kwargs, transports and timeouts are refused by name."""
    from mcore_rl.integrations.verl.checkpoint_engine import McoreRLCheckpointEngine as CE
    from mcore_rl.integrations.verl.weight_wire import WeightSyncError

    master = {"master": {"host": "h", "port": 1}}
    actor, rollout = CE.build_topology(3, 4, [master, {}, {}] + [{"leader": True}, {"leader": False}] * 2)
    assert actor["rank"] == [0, -1, -1] and rollout["rank"] == [1, -1, 2, -1]
    assert set(actor["world_size"]) == set(rollout["world_size"]) == {3}
    for kwargs, message in (({"delta_mode": 1}, r"keys \['delta_mode'\] are unknown"),
                            ({"transport": "tcp"}, "transport='tcp'"), ({"timeout_s": 0}, "timeout_s=0")):
        with pytest.raises(WeightSyncError, match=message):
            CE(1 << 20, **kwargs)
    with pytest.raises(WeightSyncError, match="trainer rank 0 reported no store address"):
        CE.build_topology(1, 1, [{"leader": False}, {"leader": True}])


def test_standalone_replicas_take_versions_through_verls_checkpoint_engine_manager(model_dir):
    """Two standalone replicas (verl's ``init_standalone``: CheckpointEngineWorker actors on
    Ray's fake GPUs, the servers beside them) and a 2-rank trainer group, synced by verl's own
    ``CheckpointEngineManager.update_weights`` (abort, release, prepare, topology, send/receive,
    finalize, resume) with ``delta``: both servers hold the trainer's tensors bit for bit after
    each version, the second sends one tensor, the manager returns the sender's metrics, and
    the servers generate with the step they were given."""
    import ray
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import get_rollout_replica_class

    from mcore_rl.integrations.verl import registry
    from tests.verl.main_ppo_runner import RayHead

    registry.install()
    engine = CheckpointEngineConfig(backend="mcore_rl", update_weights_bucket_megabytes=1,
                                    engine_kwargs={"mcore_rl": {"delta": True, "timeout_s": 120}})
    config = RolloutConfig(name="mcore_rl", mode="async", dtype="float32", prompt_length=16, response_length=8,
                           load_format="dummy", tensor_model_parallel_size=1, checkpoint_engine=engine)
    with RayHead(num_cpus=6, num_gpus=2):
        replica_cls = get_rollout_replica_class("mcore_rl")
        replicas = [replica_cls(replica_rank=r, config=config, model_config=HFModelConfig(path=model_dir),
                                gpus_per_node=1) for r in range(2)]

        async def start():
            await asyncio.gather(*[r.init_standalone() for r in replicas])

        asyncio.run(start())
        trainer = RayWorkerGroup(resource_pool=RayResourcePool([2], use_gpu=False, max_colocate_count=1), ray_cls_with_init=RayClassWithInitArgs(
            cls=ray.remote(B.fake_trainer_class()), model_dir=model_dir, bucket_bytes=40_000,
            engine_kwargs=dict(engine.engine_kwargs["mcore_rl"])))
        manager = CheckpointEngineManager(engine, trainer, replicas)
        metrics, served = [], []
        for step, moved in ((1, "model.norm.weight"), (2, "model.layers.1.mlp.up_proj.weight")):
            want = trainer.step(moved)[0]
            metrics.append(manager.update_weights(global_steps=step))
            for replica in replicas:
                have = ray.get(replica.server_handle.parameter_checksums.remote())
                sample = ray.get(replica.server_handle.generate.remote(
                    prompt_ids=[5, 6, 7], sampling_params={"temperature": 1.0}, request_id=f"s{step}"))
                served.append((all(have[n] == c for n, c in want.items()), sample.extra_fields["global_steps"]))
    assert served == [(True, 1), (True, 1), (True, 2), (True, 2)]
    assert [m["checkpoint_engine/delta"] for m in metrics] == [0.0, 1.0]
    assert metrics[0]["checkpoint_engine/tensors_sent"] == metrics[0]["checkpoint_engine/tensors_total"] > 10
    assert metrics[1]["checkpoint_engine/tensors_sent"] == 1


def test_adapter_versions_send_only_the_changed_factors_and_serve_them_unmerged(model_dir):
    """LoRA served unmerged through the engine (``AdapterWeights``: base weights + PEFT-named
    factors, with ``delta``): version 1 sends everything and the server computes (W + s B A) x;
    version 2, after one factor moved, sends that factor alone (bytes counted), keeps the others
    and the base, and still serves exactly the trainer's adapters."""
    import copy

    from transformers import AutoModelForCausalLM

    from mcore_rl.integrations.verl.checkpoint_engine import McoreRLCheckpointEngine
    from mcore_rl.integrations.verl.verl_lora import AdapterWeights

    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    server = make_server(model_dir, load_format="dummy")
    model = server.engine.model
    g = torch.Generator().manual_seed(3)
    factors = {}
    for layer in range(2):
        for proj, (out, inp) in (("q_proj", model.model.layers[layer].self_attn.q_proj.weight.shape),
                                 ("v_proj", model.model.layers[layer].self_attn.v_proj.weight.shape)):
            stem = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            factors[f"{stem}.lora_A.weight"] = torch.randn(4, inp, generator=g)
            factors[f"{stem}.lora_B.weight"] = torch.randn(out, 4, generator=g)
    peft = {"r": 4, "lora_alpha": 8, "target_modules": {"q_proj", "v_proj"}}
    sender = McoreRLCheckpointEngine(1 << 20, is_master=True, delta=True, timeout_s=60)
    metrics, replies = [], []
    for version in (1, 2):
        if version == 2:
            factors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"] *= 2
        meta = sender.prepare()
        actor, _ = B._topology(McoreRLCheckpointEngine, 1, 1, meta)
        sender.init_process_group(actor["rank"][0], actor["world_size"][0], actor["master"][0])
        (link,) = B.receiver_links(McoreRLCheckpointEngine, 1, 1, meta)
        weights = AdapterWeights(list(base.items()), peft, lambda: list(factors.items()))
        thread = threading.Thread(target=lambda: metrics.append(asyncio.run(sender.send_weights(weights, version))))
        thread.start()
        replies.append(asyncio.run(server.receive_weights(link, version)))
        thread.join()
        sender.finalize()
        merged = copy.deepcopy(AutoModelForCausalLM.from_pretrained(model_dir))
        with torch.no_grad():
            for layer in range(2):
                for proj in ("q_proj", "v_proj"):
                    stem = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
                    linear = getattr(merged.model.layers[layer].self_attn, proj)
                    linear.weight += 2.0 * factors[f"{stem}.lora_B.weight"] @ factors[f"{stem}.lora_A.weight"]
            ids = torch.tensor([prompts(1)[0]])
            assert (model(ids).logits - merged(ids).logits).abs().max() <= 1e-5, version
        assert all(torch.equal(server.engine.params[n], t) for n, t in base.items())
    assert replies[0]["adapters"] == replies[1]["adapters"] == 4
    assert metrics[0]["checkpoint_engine/tensors_sent"] == len(base) + len(factors)
    assert metrics[1]["checkpoint_engine/tensors_sent"] == 1 and metrics[1]["checkpoint_engine/delta"] == 1.0
    moved = factors["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"]
    assert metrics[1]["checkpoint_engine/tensor_bytes_sent"] == moved.nbytes
    assert generate_all(server, prompts(1), ["lora"])[0].extra_fields["global_steps"] == 2


def test_a_foreign_rollout_iterating_the_stream_gets_each_version_checked():
    """A rollout that is not mcore_rl's (verl's vLLM/SGLang adapters on GPU) iterates what
    ``receive_weights`` returns: it gets every tensor of a full version, then, with ``delta``,
    exactly the tensors that moved, equal to what was sent. An export that fails mid-version (a
    tensor yielded twice) yields nothing: the sender tells the receivers at once (abort), they do
    not wait out ``timeout_s``."""
    import time

    from mcore_rl.integrations.verl.checkpoint_engine import McoreRLCheckpointEngine
    from mcore_rl.integrations.verl.weight_wire import WeightSyncError

    g = torch.Generator().manual_seed(5)
    weights = {f"w{i}": torch.randn(3, 5 + i, generator=g) for i in range(6)}
    sender = McoreRLCheckpointEngine(64, is_master=True, delta=True, timeout_s=60)  # buckets of 64 bytes
    receiver = McoreRLCheckpointEngine(64, timeout_s=60)
    sender_errors: list[str] = []

    def one_version(version: int, stream: list) -> list[tuple[str, torch.Tensor]]:
        meta = sender.prepare()
        actor, rollout = B._topology(McoreRLCheckpointEngine, 1, 1, meta)
        sender.init_process_group(actor["rank"][0], actor["world_size"][0], actor["master"][0])
        receiver.init_process_group(rollout["rank"][0], rollout["world_size"][0], rollout["master"][0])
        def send() -> None:
            try:
                asyncio.run(sender.send_weights(iter(stream), version))
            except WeightSyncError as e:
                sender_errors.append(str(e))

        thread = threading.Thread(target=send, daemon=True)
        thread.start()

        async def take():
            return [(n, t.clone()) for n, t in [item async for item in receiver.receive_weights(version)]]

        try:
            return asyncio.run(take())
        finally:
            thread.join(timeout=60)
            sender.finalize()
            receiver.finalize()

    got = one_version(1, list(weights.items()))
    assert [n for n, _ in got] == list(weights) and all(torch.equal(t, weights[n]) for n, t in got)
    weights["w2"] = weights["w2"] * 2
    got = one_version(2, list(weights.items()))
    assert [n for n, _ in got] == ["w2"] and torch.equal(got[0][1], weights["w2"])
    start = time.perf_counter()
    with pytest.raises(WeightSyncError, match="abandoned the weight version .*'w0' twice"):
        one_version(3, list(weights.items()) + [("w0", weights["w0"] + 1)])
    assert time.perf_counter() - start < 30 and len(sender_errors) == 1 and "twice" in sender_errors[0]
