"""What ``hf_model`` in ``save_contents`` costs the training loop: the time an async save blocks
it (the save call + every poll until the step is finalized) with the background HF export and
without, alternating side by side in one run; when the HF dir appeared after the save call; the
training step time while the save's shards are written (both) and while the exporter runs; the
exporter's peak RSS against the step's size.

    torchrun --standalone --nproc_per_node=2 benchmarks/ckpt_hf_export.py [--root DIR] [--reps 3]
        [--tp 2 --layers 16]

World of 2, TP=1 DP=2, a fp32 llama (hidden 1536, 6 layers, vocab 32k: 861 MiB of weights on
every rank) after one Adam step (``--tp 2 --layers 16``: TP=2 DP=1, about as much per rank).
Each rep saves once into a root without ``hf_model`` and once into a root with it (the order
alternates), ``async_save`` on, then trains (one update per step) and polls after every step,
as the job does, until the save is finalized and, with ``hf_model``, until its export is done.
A save's blocked time is the save call plus the polls (max over the ranks); the goal is
blocked(hf_model) / blocked(without) <= 1.05.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import torch  # noqa: E402

from benchmarks.common import rank0_print, start, tiny_llama  # noqa: E402
from mcore_rl.parallel import ParallelLayout  # noqa: E402

VOCAB, HIDDEN = 32000, 1536
CONTENTS = ("model", "optimizer", "extra")


def build(tp: int, layers: int):
    """The engine, an Actor on it and a batch for its updates (TP=``tp``, one Adam step done)."""
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig
    from tests.tiny import rl_batch

    layout = ParallelLayout(tp=tp)
    platform = start(layout)
    args, weights = tiny_llama(vocab_size=VOCAB, layers=layers, hidden=HIDDEN)
    engine = ModelEngine(args, layout, "actor", platform, optim=OptimConfig(lr=1e-5), hf_weights=weights)
    del weights
    actor = Actor(engine, ActorConfig(micro_batch_size=2, ppo_mini_batch_size=4))
    batch = rl_batch(VOCAB, batch=4, prompt=8, response=4, seed=0)
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"] - 0.1
    batch["advantages"] = torch.randn(batch["old_log_probs"].shape, generator=torch.Generator().manual_seed(0))
    actor.update_policy(batch)
    return engine, actor, batch, args


def max_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return float(t)


class ExporterPeak:
    """Samples the running exporter's VmHWM (its own peak resident memory: the mm of the
    exec'd exporter, which ``getrusage``'s maxrss is not: that carries the rank's peak across
    the exec) every 20 ms; ``peak`` in bytes."""

    def __init__(self, queue) -> None:
        self.queue, self.peak, self._stop = queue, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pid = self.queue.running_pid()
            try:
                with open(f"/proc/{pid}/status") as f:
                    kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmHWM:"))
                self.peak = max(self.peak, kb * 1024)
            except (OSError, StopIteration, TypeError):
                pass
            self._stop.wait(0.02)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def one_save(mgr, engine, actor, batch, step: int, exporting: bool, managers: list) -> dict:
    """Saves ``step`` and trains until it is finalized (and, ``exporting``, its export is done):
    the blocked seconds, the step times, when the HF weights appeared. Every manager's retention
    left running (the deletion of its previous step) is joined first: a job has one manager,
    whose own deletion the next save joins and counts; the other's is an artifact of the comparison."""
    queue, sampler = mgr._exports.queue, None  # the sampler starts at the finalize (the exporter's start)
    for each in managers:
        each.wait()
    torch.distributed.barrier()
    begin = time.perf_counter()
    mgr.save(step, {"actor": engine}, {"step": step})
    call = blocked = time.perf_counter() - begin
    steps, finalized, appeared = [], False, None
    while not finalized or (exporting and appeared is None):
        t = time.perf_counter()
        actor.update_policy(batch)
        steps.append(time.perf_counter() - t)
        t = time.perf_counter()
        done = mgr.poll()
        if not finalized:
            blocked += time.perf_counter() - t
            finalized = done == step
            if finalized:
                writing = len(steps)  # the steps trained while the save's shards were written
                if exporting and torch.distributed.get_rank() == 0:
                    sampler = ExporterPeak(queue)
        flag = int(exporting and queue is not None and finalized and not queue.busy())
        everywhere = torch.tensor([flag if torch.distributed.get_rank() == 0 else 1])
        torch.distributed.all_reduce(everywhere, op=torch.distributed.ReduceOp.MIN)
        if everywhere.item() and appeared is None:
            appeared = time.perf_counter() - begin
    peak = sampler.stop() if sampler is not None else 0
    return {"blocked": max_over_ranks(blocked), "call": max_over_ranks(call), "steps": steps[:writing],
            "exporting": steps[writing:], "appeared": appeared, "exporter_peak": peak}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default=None, help="checkpoint directory (default: a temp dir)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1, help="tensor parallel size (the rest is DP)")
    parser.add_argument("--layers", type=int, default=6)
    a = parser.parse_args()
    engine, actor, batch, _ = build(a.tp, a.layers)
    base = a.root or (tempfile.mkdtemp(prefix="ckpt_hf_export_") if torch.distributed.get_rank() == 0 else "")
    holder = [base]
    torch.distributed.broadcast_object_list(holder)
    base = holder[0]
    try:
        _compare(a, engine, actor, batch, base)
    finally:  # a failed run (a full disk) leaves nothing behind either
        if a.root is None and torch.distributed.get_rank() == 0:
            shutil.rmtree(base, ignore_errors=True)
    torch.distributed.destroy_process_group()


def _compare(a, engine, actor, batch, base: str) -> None:
    """The alternating saves with and without ``hf_model`` under ``base``, then the report."""
    from mcore_rl.checkpoint.config import CheckpointConfig
    from mcore_rl.checkpoint.manager import CheckpointManager

    hf_config = _hf_config(a.layers)
    managers = {
        kind: CheckpointManager(CheckpointConfig(root=os.path.join(base, kind), async_save=True, max_ckpt_to_keep=1,
                                                 save_contents=CONTENTS + (("hf_model",) if kind == "hf_model" else ())),
                                hf_sources={"actor": hf_config})
        for kind in ("plain", "hf_model")}
    weights = sum(p.numel() * p.element_size() for p in engine.model[0].parameters())
    world = torch.distributed.get_world_size()
    rank0_print(f"model: {weights / 2**20:.0f} MiB of fp32 weights per rank ({a.layers} layers, TP={a.tp} "
                f"DP={world // a.tp}), async_save, reps {a.reps}")
    results = {"plain": [], "hf_model": []}
    for rep in range(a.reps):
        order = ("plain", "hf_model") if rep % 2 == 0 else ("hf_model", "plain")
        for kind in order:
            results[kind].append(one_save(managers[kind], engine, actor, batch, rep + 1, kind == "hf_model",
                                          list(managers.values())))
    for mgr in managers.values():
        mgr.close()
    _report(results, managers["hf_model"], base)
    torch.distributed.barrier()


def _hf_config(layers: int):
    """The transformers config of the benchmark's llama (what the job passes as the HF source)."""
    from mcore_rl.job.loop import tiny_hf_config
    from mcore_rl.job.schema import TinyModelConfig

    return tiny_hf_config(TinyModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                                          num_hidden_layers=layers, max_position_embeddings=512))


def _weights_bytes(step_dir: str) -> int:
    hf = os.path.join(step_dir, "actor", "huggingface")
    return sum(os.path.getsize(os.path.join(hf, n)) for n in os.listdir(hf) if n.endswith(".safetensors"))


def _report(results: dict, mgr, base: str) -> None:
    blocked = {k: [r["blocked"] for r in v] for k, v in results.items()}
    med = {k: statistics.median(v) for k, v in blocked.items()}
    for kind in ("plain", "hf_model"):
        steps = [s for r in results[kind] for s in r["steps"]]
        calls = statistics.median(r["call"] for r in results[kind])
        rank0_print(f"{kind:9s}: blocked {', '.join(f'{b:.3f}' for b in blocked[kind])} s (median {med[kind]:.3f} s, "
                    f"of which the save call {calls:.3f} s, the polls to the finalize {med[kind] - calls:.3f} s); "
                    f"training step while the shards are written {statistics.median(steps):.2f} s median over "
                    f"{len(steps)} steps")
    exporting = [s for r in results["hf_model"] for s in r["exporting"]]
    rank0_print(f"training step while the exporter runs {statistics.median(exporting):.2f} s median over "
                f"{len(exporting)} steps")
    rank0_print(f"blocked with hf_model / without: {med['hf_model'] / med['plain']:.3f}x (goal <= 1.05x)")
    appeared = [r["appeared"] for r in results["hf_model"]]
    rank0_print(f"HF weights complete {', '.join(f'{t:.1f}' for t in appeared)} s after the save call")
    step_dir = os.path.join(base, "hf_model", f"global_step_{len(appeared)}")
    step_bytes = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(step_dir) for n in ns
                     if "huggingface" not in d)
    peak = max(r["exporter_peak"] for r in results["hf_model"])
    rank0_print(f"exporter peak RSS (VmHWM) {peak / 2**20:.0f} MiB = {peak / step_bytes:.2f}x the step's "
                f"{step_bytes / 2**20:.0f} MiB (model + optimizer + extra), "
                f"{peak / (_weights_bytes(step_dir)):.2f}x its {_weights_bytes(step_dir) / 2**20:.0f} MiB of HF weights")
    if torch.distributed.get_rank() == 0 and mgr._exports.queue is not None:
        for done in mgr._exports.queue.done:  # (its own "peak RSS" is getrusage's: the rank's, see ExporterPeak)
            print(f"exporter, step {done.step}: {done.ended - done.started:.1f} s: {done.line}", flush=True)


if __name__ == "__main__":
    main()
