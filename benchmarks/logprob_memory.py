"""Peak memory of log-prob + entropy, forward and backward, on vocab-parallel logits (TP=2):
mcore_rl's autograd function vs gathering the full-vocab logits + log_softmax + autograd, and the
previous mcore_rl implementation (plain autograd on the shards) for comparison.

    torchrun --standalone --nproc_per_node=2 benchmarks/logprob_memory.py [tokens] [vocab]

Method: ``LiveBytes``, a TorchDispatchMode, sees every tensor an op returns (forward, collectives
and autograd's backward alike) and counts its storage's bytes once, from creation until the
storage is freed (a weakref finalizer on the storage: torch keeps one Python object per live
storage). The peak of that sum over forward + backward is reported. The input logits shard exists
before the measurement and is not counted; the gradient of the logits (.grad) is. CPU has no
caching-allocator statistics, so this counts tensor bytes, not allocator blocks.
"""
from __future__ import annotations

import os
import sys
import time
import warnings
import weakref

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

Tensor = torch.Tensor


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the live storages created by ops while the mode is active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._tracked: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._tracked:  # views and in-place results share a storage
                    self._tracked.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._release, key, storage.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def old_log_probs_and_entropy(logits, labels, vocab_size, temperature=1.0, with_entropy=False):
    """mcore_rl's previous implementation (plain autograd on the vocab shards), kept to compare."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region as tp_sum

    width = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * width
    scaled = logits.float() / temperature
    if start + width > vocab_size:
        scaled = scaled.masked_fill(torch.arange(start, start + width) >= vocab_size, float("-inf"))
    shift = scaled.max(dim=-1).values.detach().clone()
    torch.distributed.all_reduce(shift, op=torch.distributed.ReduceOp.MAX,
                                 group=parallel_state.get_tensor_model_parallel_group())
    shifted = scaled - shift.unsqueeze(-1)
    exp = shifted.exp()
    sum_exp = tp_sum(exp.sum(dim=-1))
    log_z = sum_exp.log()
    in_shard = (labels >= start) & (labels < start + width)
    picked = shifted.gather(-1, (labels - start).clamp(0, width - 1).unsqueeze(-1)).squeeze(-1)
    log_prob = tp_sum(torch.where(in_shard, picked, torch.zeros_like(picked))) - log_z
    if not with_entropy:
        return log_prob, None
    weighted = (exp * shifted.masked_fill(exp == 0, 0.0)).sum(dim=-1)
    return log_prob, log_z - tp_sum(weighted) / sum_exp


def gathered_log_probs_and_entropy(logits, labels, vocab_size, temperature=1.0, with_entropy=False):
    """The naive way: gather the full-vocab logits over TP, log_softmax, plain autograd."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    full = gather_from_tensor_model_parallel_region(logits)[..., :vocab_size]
    logp = torch.log_softmax(full.float() / temperature, dim=-1)
    log_prob = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return log_prob, (-(logp.exp() * logp).sum(-1) if with_entropy else None)


def measure(fn, shard: Tensor, labels: Tensor, vocab: int, with_entropy: bool, seed: int = 5):
    """(peak live bytes over forward + backward, seconds, log_prob, entropy) of loss = sum(a lp + b H)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(labels.shape, generator=g), torch.randn(labels.shape, generator=g)
    leaf = shard.detach().clone().requires_grad_()
    tracker = LiveBytes()
    begin = time.perf_counter()
    with tracker:
        lp, ent = fn(leaf, labels, vocab, 0.8, with_entropy)
        loss = (a * lp).sum() + ((b * ent).sum() if with_entropy else 0.0)
        loss.backward()
    seconds = time.perf_counter() - begin
    return tracker.peak, seconds, lp.detach(), None if ent is None else ent.detach()


def main() -> None:
    from benchmarks.common import rank0_print, start
    from mcore_rl.parallel import ParallelLayout
    from mcore_rl.rl.logprob import log_probs_and_entropy
    from megatron.core import parallel_state

    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    # 32003 is padded to 32128: rank 1's shard ends in 125 padding columns
    vocab = int(sys.argv[2]) if len(sys.argv) > 2 else 32003
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")  # megatron's gather
    layout = ParallelLayout(tp=2)
    start(layout)
    tp, rank = layout.tp, parallel_state.get_tensor_model_parallel_rank()
    padded = -(-vocab // 128) * 128
    width = padded // tp
    g = torch.Generator().manual_seed(0)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    full = torch.randn(tokens, padded, generator=g) * 2.0
    full[:, vocab:] = 0.0  # megatron's padding rows of the output layer are zero
    rank0_print(f"tokens={tokens} vocab={vocab} (padded {padded}) TP={tp}: shard [{tokens}, {width}]; "
                "peak live tensor bytes over forward + backward (input shard not counted)")
    rank0_print(f"{'case':<22}{'new MiB':>9}{'gather MiB':>12}{'old MiB':>9}{'new/gather':>12}{'new/old':>9}"
                f"{'  time new / gather / old (s)'}")
    for dtype in (torch.float32, torch.bfloat16):
        shard = full[:, rank * width : (rank + 1) * width].to(dtype)
        for with_entropy in (False, True):
            impls = (log_probs_and_entropy, gathered_log_probs_and_entropy, old_log_probs_and_entropy)
            runs = [measure(fn, shard, labels, vocab, with_entropy) for fn in impls]
            (new, t_new, lp, ent), (naive, t_naive, lp_ref, ent_ref), (old, t_old, _, _) = runs
            diff = (lp - lp_ref).abs().max().item()
            if with_entropy:
                diff = max(diff, (ent - ent_ref).abs().max().item())
            case = f"{str(dtype)[6:]} lp{' + entropy' if with_entropy else ''}"
            rank0_print(f"{case:<22}{new / 2**20:>9.1f}{naive / 2**20:>12.1f}{old / 2**20:>9.1f}"
                        f"{new / naive:>12.3f}{new / old:>9.3f}  {t_new:.2f} / {t_naive:.2f} / {t_old:.2f}"
                        f"  (max |diff| vs gather {diff:.1e})")
    shard_mib = tokens * width * 4 / 2**20
    rank0_print(f"one fp32 shard [{tokens}, {width}] = {shard_mib:.1f} MiB; goal new/gather <= 0.5")
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
