"""Per-sync wall time and bytes of mcore_rl's checkpoint engine (``checkpoint_engine.backend=mcore_rl``,
the rollout server joins a private gloo group and receives the version itself) against verl's
``naive`` colocated path (the trainer worker's ``ServerAdapter`` pushes buckets to the server
through Ray), on SmolLM2-135M (``make prepare-smollm2``), side by side, alternately; then delta
bytes for a full-model step and for a merged-LoRA step (only the adapted projections change).

    .venv-verl/bin/python benchmarks/verl_checkpoint_engine.py [--repeat 3] [--bucket-mb 256] [--model DIR]

Both paths run in one local Ray head: a "trainer" actor holding the model's tensors (the export's
stand-in: the same (name, tensor) stream either way) and one ``RolloutServer`` actor (as
``McoreRLReplica`` starts it). Each sync is timed from the driver: the naive path from the call to
the adapter's last bucket; ours from ``prepare`` to both the sender's and the server's return
(store, group rendezvous, buckets, manifest, ack, swap). After each sync the server's per-tensor
checksums are compared with the trainer's (the run fails unless equal). Goal (issue #40): ours
<= 1.2x naive. Wall times on the shared 2-core machine are noisy: the header prints the load.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # run as a script

import ray  # noqa: E402
import torch  # noqa: E402

LORA_TARGETS = ("q_proj", "v_proj")
LORA_RANK = 8


def _config(dtype: str, bucket_mb: int):
    from verl.workers.config import CheckpointEngineConfig, RolloutConfig

    return RolloutConfig(name="mcore_rl", dtype=dtype, prompt_length=16, response_length=8, load_format="dummy",
                         tensor_model_parallel_size=1,
                         checkpoint_engine=CheckpointEngineConfig(backend="mcore_rl",
                                                                   update_weights_bucket_megabytes=bucket_mb))


class Trainer:
    """The trainer's side: the model's tensors, a naive-path adapter, and two engines (full, delta)."""

    def __init__(self, model_dir: str, dtype: str, bucket_mb: int) -> None:
        from safetensors.torch import load_file
        from verl.workers.config import HFModelConfig

        from mcore_rl.integrations.verl.checkpoint_engine import McoreRLCheckpointEngine
        from mcore_rl.integrations.verl.rollout_replica import ServerAdapter

        os.environ["RANK"] = "0"
        torch.set_num_threads(1)
        cast = getattr(torch, dtype)
        self.tensors = {n: t.to(cast) for n, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}
        self.adapter = ServerAdapter(_config(dtype, bucket_mb), HFModelConfig(path=model_dir), None)
        self.engines = {delta: McoreRLCheckpointEngine(bucket_mb << 20, is_master=True, delta=delta, timeout_s=300)
                        for delta in (False, True)}

    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def checksums(self) -> dict[str, str]:
        from mcore_rl.integrations.verl.weight_wire import tensor_checksum

        return {n: tensor_checksum(t) for n, t in self.tensors.items()}

    async def naive_sync(self, step: int) -> None:
        await self.adapter.update_weights(iter(self.tensors.items()), global_steps=step)

    def prepare(self, delta: bool) -> dict:
        return self.engines[delta].prepare()

    async def send(self, delta: bool, rank: int, world_size: int, master: dict, step: int) -> dict:
        engine = self.engines[delta]
        engine.init_process_group(rank, world_size, master)
        try:
            return await engine.send_weights(iter(self.tensors.items()), global_steps=step)
        finally:
            engine.finalize()

    def step(self, kind: str) -> int:
        """A training step's stand-in: every tensor moves ("full"), or only the LoRA-adapted
        projections (a merged-LoRA step); returns the adapter factors' bytes for "lora"
        (rank 8: what an adapter-only sync of unmerged adapters would send)."""
        factors = 0
        with torch.no_grad():
            for name, t in self.tensors.items():
                if kind == "full" or any(f".{m}." in name for m in LORA_TARGETS):
                    t.add_(1e-3 * torch.sign(t + 0.5))
                    factors += LORA_RANK * (t.shape[0] + t.shape[1]) * t.element_size() if t.dim() == 2 else 0
        return factors


def ce_sync(trainer, server, delta: bool, step: int) -> tuple[float, dict]:
    """One version through mcore_rl's checkpoint engine as verl's manager drives it (one sender,
    one replica): wall seconds and the sender's metrics."""
    from mcore_rl.integrations.verl.checkpoint_engine import McoreRLCheckpointEngine as CE

    start = time.perf_counter()
    meta = ray.get(trainer.prepare.remote(delta))
    actor, rollout = CE.build_topology(1, 1, [meta, {"leader": True}])
    receiver = CE(1 << 20)
    receiver.init_process_group(rollout["rank"][0], rollout["world_size"][0], rollout["master"][0])
    metrics, _ = ray.get([trainer.send.remote(delta, actor["rank"][0], actor["world_size"][0], actor["master"][0], step),
                          server.receive_weights.remote(receiver.receive_weights().link, step)])
    return time.perf_counter() - start, metrics


def check_equal(trainer, server, what: str) -> None:
    want, have = ray.get([trainer.checksums.remote(), server.parameter_checksums.remote()])
    bad = [n for n in want if have.get(n) != want[n]]
    if bad:
        raise SystemExit(f"error: after {what} the server's {len(bad)} tensors differ from the trainer's (e.g. {bad[:3]})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=os.path.join(os.environ.get("MCORE_RL_CACHE", os.path.expanduser(
        "~/.cache/mcore_rl")), "smollm2", "hf"))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.model, "model.safetensors")):
        raise SystemExit(f"error: no model.safetensors in {args.model}; run `make prepare-smollm2` or give --model")
    os.environ.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        run(args)
    finally:
        ray.shutdown()


def run(args) -> None:
    from verl.workers.config import HFModelConfig

    from mcore_rl.integrations.verl.rollout_replica import server_name
    from mcore_rl.integrations.verl.rollout_server import RolloutServer

    config = _config(args.dtype, args.bucket_mb)
    server = ray.remote(RolloutServer).options(name=server_name(0), num_cpus=0, max_concurrency=100).remote(
        config=config, model_config=HFModelConfig(path=args.model), replica_rank=0, num_threads=1)
    ray.get(server.ready.remote())
    trainer = ray.remote(Trainer).options(num_cpus=0).remote(args.model, args.dtype, args.bucket_mb)
    total = ray.get(trainer.nbytes.remote())
    print(f"model {args.model}: {total / 2**20:.1f} MiB ({args.dtype}), bucket {args.bucket_mb} MiB, "
          f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    naive, ours = [], []
    for step in range(args.repeat + 1):  # the first pair warms up, left out
        start = time.perf_counter()
        ray.get(trainer.naive_sync.remote(2 * step))
        elapsed = time.perf_counter() - start
        check_equal(trainer, server, "a naive sync")
        seconds, metrics = ce_sync(trainer, server, False, 2 * step + 1)
        check_equal(trainer, server, "an mcore_rl sync")
        if step:
            naive.append(elapsed)
            ours.append(seconds)
    n, o = statistics.median(naive), statistics.median(ours)
    print(f"naive (Ray, colocated adapter): {n:.2f} s per sync (runs {', '.join(f'{t:.2f}' for t in naive)}), "
          f"{total / 2**20:.1f} MiB of tensors")
    print(f"mcore_rl (gloo, server receives): {o:.2f} s per sync (runs {', '.join(f'{t:.2f}' for t in ours)}), "
          f"{metrics['checkpoint_engine/bytes_sent'] / 2**20:.1f} MiB on the wire")
    print(f"ratio mcore_rl / naive: {o / n:.2f} (goal <= 1.2)")
    ce_sync(trainer, server, True, 100)  # the delta engine's base version
    for kind in ("full", "lora"):
        factors = ray.get(trainer.step.remote(kind))
        seconds, metrics = ce_sync(trainer, server, True, 101 if kind == "full" else 102)
        check_equal(trainer, server, f"a delta sync after a {kind} step")
        extra = f"; unmerged rank-{LORA_RANK} adapters on {'/'.join(LORA_TARGETS)}: {factors / 2**20:.2f} MiB" \
            if kind == "lora" else ""
        print(f"delta after a {'full-model' if kind == 'full' else 'merged-LoRA'} step: "
              f"{int(metrics['checkpoint_engine/tensors_sent'])}/{int(metrics['checkpoint_engine/tensors_total'])} "
              f"tensors, {metrics['checkpoint_engine/tensor_bytes_sent'] / 2**20:.2f} MiB of tensors "
              f"({metrics['checkpoint_engine/bytes_sent'] / 2**20:.2f} MiB on the wire), {seconds:.2f} s{extra}")


if __name__ == "__main__":
    main()
