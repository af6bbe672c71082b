"""Largest tensor created while computing response log-probs: mcore_rl's compute_log_prob
(vocab-parallel, TP=2) vs the naive way on the same model output: gather the full-vocab logits
across TP, log_softmax over the sequence, then pick the response tokens (as with HF logits).

    torchrun --standalone --nproc_per_node=2 benchmarks/logprob_memory.py

Both sides run the same model forward; the dispatch mode records every tensor an op returns.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from benchmarks.common import rank0_print, start, tiny_llama  # noqa: E402
from mcore_rl.parallel import ParallelLayout  # noqa: E402


class LargestTensor(TorchDispatchMode):
    """Records the byte size of the largest tensor any op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


def main() -> None:
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.minibatch import response_logits
    from mcore_rl.rl.engine import ModelEngine
    from tests.tiny import rl_batch

    layout = ParallelLayout(tp=2)
    platform = start(layout)
    vocab = 32000
    args, weights = tiny_llama(vocab)
    engine = ModelEngine(args, layout, "actor", platform, hf_weights=weights)
    actor = Actor(engine, ActorConfig(micro_batch_size=4))
    batch = rl_batch(vocab, batch=4, prompt=96, response=32)

    ours = LargestTensor()
    with ours:
        fast = actor.compute_log_prob(batch)["log_probs"]

    def naive(mb, output):
        full = gather_from_tensor_model_parallel_region(output)[..., :vocab]
        logp = response_logits(torch.log_softmax(full.float(), -1), mb)
        lp = logp.gather(-1, mb["responses"].unsqueeze(-1)).squeeze(-1)
        return lp.sum() * 0, {"lp": lp * mb["attention_mask"][:, -32:]}

    baseline = LargestTensor()
    with baseline, torch.no_grad():
        slow = engine.run([batch], naive, forward_only=True)[0]["lp"]
    rank0_print(f"log-prob agreement: max |diff| = {(fast - slow).abs().max().item():.2e}")
    rank0_print(f"largest tensor: mcore_rl {ours.largest / 2**20:.1f} MiB, naive "
                f"{baseline.largest / 2**20:.1f} MiB, ratio {ours.largest / baseline.largest:.3f} (goal <= 0.5)")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
