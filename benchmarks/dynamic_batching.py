"""compute_log_prob (and one update) throughput with length-grouped dynamic micro-batches vs
fixed-size micro-batches on a batch whose real lengths vary 10x; prints tokens/s and the ratio.

    torchrun --standalone --nproc_per_node=2 benchmarks/dynamic_batching.py

DP=2 (each rank computes half the rows). Fixed: micro_batch_size rows at the full padded
length. Dynamic: max_tokens_per_micro_batch = micro_batch_size * S, rows grouped by length
and padding columns trimmed. Measured alternately in one run; medians.
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

ROWS, PROMPT, RESPONSE, MICRO = 32, 64, 192, 4


def varied_batch(vocab: int) -> dict:
    """Rows of 26..256 real tokens (prompt 2..64 left-padded, response 24..192 right-padded)."""
    g = torch.Generator().manual_seed(0)
    s = PROMPT + RESPONSE
    ids = torch.randint(1, vocab, (ROWS, s), generator=g)
    mask = torch.zeros(ROWS, s, dtype=torch.long)
    for row in range(ROWS):
        frac = row / (ROWS - 1)  # lengths spread evenly from short to full
        p, r = int(2 + frac * (PROMPT - 2)), int(24 + frac * (RESPONSE - 24))
        mask[row, PROMPT - p : PROMPT + r] = 1
    perm = torch.randperm(ROWS, generator=g)  # lengths in random row order
    ids, mask = (ids * mask)[perm], mask[perm]
    adv = torch.randn(ROWS, RESPONSE, generator=g) * mask[:, PROMPT:]
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, PROMPT:].clone(),
            "advantages": adv}


def main() -> None:
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout()
    platform = start(layout)
    args, weights = tiny_llama(vocab_size=4000, layers=4, hidden=256)
    engine = ModelEngine(args, layout, "actor", platform, optim=OptimConfig(lr=1e-6), hf_weights=weights)
    fixed = Actor(engine, ActorConfig(micro_batch_size=MICRO, ppo_mini_batch_size=ROWS))
    dynamic = Actor(engine, ActorConfig(max_tokens_per_micro_batch=MICRO * (PROMPT + RESPONSE),
                                        ppo_mini_batch_size=ROWS))
    batch = varied_batch(args.vocab_size)
    batch["old_log_probs"] = fixed.compute_log_prob(batch)["log_probs"]
    diff = (dynamic.compute_log_prob(batch)["log_probs"] - batch["old_log_probs"]).abs().max()
    tokens = float(batch["attention_mask"].sum())
    for what, call in (("compute_log_prob", lambda a: a.compute_log_prob(batch)),
                       ("update_policy", lambda a: a.update_policy(batch))):
        times: dict[str, list[float]] = {"fixed": [], "dynamic": []}
        for i in range(7):
            for name, actor in (("fixed", fixed), ("dynamic", dynamic)):
                torch.distributed.barrier()
                t = time.perf_counter()
                call(actor)
                torch.distributed.barrier()
                if i >= 1:  # warm-up
                    times[name].append(time.perf_counter() - t)
        f, d = statistics.median(times["fixed"]), statistics.median(times["dynamic"])
        rank0_print(f"{what}: fixed {tokens / f:,.0f} tok/s, dynamic {tokens / d:,.0f} tok/s, "
                    f"speed-up {f / d:.2f}x (medians of {len(times['fixed'])})")
    rank0_print(f"log-probs dynamic vs fixed: max abs diff {float(diff):.2g}; real tokens {tokens:.0f} "
                f"of {ROWS * (PROMPT + RESPONSE)} padded")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
