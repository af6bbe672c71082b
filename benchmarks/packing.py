"""compute_log_prob throughput with packed (padding-free) micro-batches vs padded ones, on 64 rows
whose real lengths are log-uniform in [S/10, S] (S = 1024); prints tokens/s and ratios.

    torchrun --standalone --nproc_per_node=2 benchmarks/packing.py

DP=2 (each rank computes 32 rows). One token budget per micro-batch, BUDGET = 4 * S:
padded    micro_batch_size = 4 rows at the full padded length S, rows in batch order (baseline);
dynamic   the hardening issue's length-grouped dynamic batching: rows grouped by length up to
          BUDGET padded tokens, padding columns trimmed;
packed    use_remove_padding: rows packed by real tokens up to BUDGET, one stream per micro-batch.
Measured alternately in one run (medians after a warm-up); the log-probs of all three must agree.
"""
from __future__ import annotations

import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import torch  # noqa: E402

from benchmarks.common import rank0_print, start, tiny_llama  # noqa: E402
from mcore_rl.parallel import ParallelLayout  # noqa: E402

ROWS, S, MICRO = 64, 1024, 4
PROMPT = S // 4  # prompt columns (left-padded); the rest are response columns (right-padded)
BUDGET = MICRO * S


def log_uniform_batch(vocab: int) -> dict:
    """Rows of L ~ log-uniform [S/10, S] real tokens: a quarter prompt, the rest response."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.exp(torch.empty(ROWS).uniform_(math.log(S / 10), math.log(S), generator=g)).round().long()
    ids = torch.randint(1, vocab, (ROWS, S), generator=g)
    mask = torch.zeros(ROWS, S, dtype=torch.long)
    for row, length in enumerate(lengths.tolist()):
        p = max(1, length // 4)
        mask[row, PROMPT - p : PROMPT + length - p] = 1
    ids = ids * mask
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, PROMPT:].clone()}


def main() -> None:
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine

    layout = ParallelLayout()
    platform = start(layout)
    args, weights = tiny_llama(vocab_size=4000, layers=2, hidden=128, max_positions=S)
    engine = ModelEngine(args, layout, "actor", platform, hf_weights=weights)
    actors = {
        "padded": Actor(engine, ActorConfig(micro_batch_size=MICRO)),
        "dynamic": Actor(engine, ActorConfig(max_tokens_per_micro_batch=BUDGET)),
        "packed": Actor(engine, ActorConfig(max_tokens_per_micro_batch=BUDGET, use_remove_padding=True)),
    }
    batch = log_uniform_batch(args.vocab_size)
    ref = actors["padded"].compute_log_prob(batch)["log_probs"]
    diffs = {n: float((a.compute_log_prob(batch)["log_probs"] - ref).abs().max()) for n, a in actors.items()}
    times: dict[str, list[float]] = {n: [] for n in actors}
    for i in range(6):
        for name, actor in actors.items():
            torch.distributed.barrier()
            t = time.perf_counter()
            actor.compute_log_prob(batch)
            torch.distributed.barrier()
            if i >= 1:  # warm-up
                times[name].append(time.perf_counter() - t)
    tokens = float(batch["attention_mask"].sum())
    med = {n: statistics.median(t) for n, t in times.items()}
    rank0_print(f"{ROWS} rows, real lengths log-uniform in [{S // 10}, {S}]: {tokens:.0f} real tokens of "
                f"{ROWS * S} padded ({ROWS * S / tokens:.2f}x); budget {BUDGET} tokens per micro-batch, DP=2")
    for name in actors:
        rank0_print(f"  {name:8s} {tokens / med[name]:9,.0f} real tok/s  (median of {len(times[name])}, "
                    f"log-probs max |diff| vs padded {diffs[name]:.2g})")
    rank0_print(f"packed / padded  {med['padded'] / med['packed']:.2f}x  (goal >= 2x)")
    rank0_print(f"packed / dynamic {med['dynamic'] / med['packed']:.2f}x")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
