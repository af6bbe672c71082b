"""update_policy step time vs a raw megatron-core forward_backward + optimizer loop on the same
model, batch and micro-batches (TP=2), measured alternately in one run; prints the ratio.

    torchrun --standalone --nproc_per_node=2 benchmarks/update_overhead.py

The raw loop computes the same clipped PPO objective with megatron's vocab-parallel cross
entropy for log-probs and nothing else (no metrics, no entropy, no validation).
"""
from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import torch  # noqa: E402

from benchmarks.common import rank0_print, start, tiny_llama  # noqa: E402
from mcore_rl.parallel import ParallelLayout  # noqa: E402


def raw_step(engine, pieces: list, tokens: float, scale: int) -> None:
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    from mcore_rl.rl.minibatch import response_logits

    def loss_fn(mb, output):
        logits = response_logits(output, mb)
        lp = -vocab_parallel_cross_entropy(logits.float().transpose(0, 1).contiguous(),
                                           mb["responses"].transpose(0, 1).contiguous()).transpose(0, 1)
        ratio = torch.exp(lp - mb["old_log_probs"])
        adv = mb["advantages"]
        loss = torch.maximum(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        mask = mb["attention_mask"][:, -lp.shape[1]:]
        return (loss * mask).sum() / tokens * scale, {}

    engine.run(pieces, loss_fn, forward_only=False)
    engine.step()


def main() -> None:
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.minibatch import local_rows, micro_batches
    from mcore_rl.rl.engine import ModelEngine, OptimConfig
    from tests.tiny import rl_batch

    layout = ParallelLayout(tp=2)
    platform = start(layout)
    args, weights = tiny_llama(vocab_size=8000, layers=4, hidden=256)
    engine = ModelEngine(args, layout, "actor", platform, optim=OptimConfig(lr=1e-5), hf_weights=weights)
    config = ActorConfig(micro_batch_size=4, ppo_mini_batch_size=16)
    actor = Actor(engine, config)
    batch = rl_batch(8000, batch=16, prompt=96, response=32)
    batch["old_log_probs"] = actor.compute_log_prob(batch)["log_probs"]
    batch["advantages"] = torch.randn(batch["old_log_probs"].shape, generator=torch.Generator().manual_seed(0))
    pieces = micro_batches(local_rows(batch), config, engine)
    tokens = float(batch["attention_mask"][:, -32:].sum())
    ours, raw = [], []
    for i in range(12):
        for fn, times in ((lambda: actor.update_policy(batch), ours),
                          (lambda: raw_step(engine, pieces, tokens, len(pieces)), raw)):
            torch.distributed.barrier()
            t = time.perf_counter()
            fn()
            torch.distributed.barrier()
            if i >= 2:  # warm-up
                times.append(time.perf_counter() - t)
    a, b = statistics.median(ours), statistics.median(raw)
    rank0_print(f"update_policy {a * 1e3:.1f} ms, raw forward_backward loop {b * 1e3:.1f} ms, "
                f"ratio {a / b:.3f} (goal <= 1.05); medians of {len(ours)} alternating runs")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
