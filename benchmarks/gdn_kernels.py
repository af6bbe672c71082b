"""Time of mcore_rl's torch gated delta rule (``chunk_gated_delta_rule``, forward + backward) on
this machine, B = 1, H = 4 heads, K = V = 32, fp32, at T = 512, 2048, 8192 tokens, one sequence
and the same tokens packed as 8 sequences (``cu_seqlens``); one thread, median of ``--rounds``
runs after a warm-up, printed as ms and µs per token.

    python benchmarks/gdn_kernels.py [--rounds 5] [--threads 1] [--device cpu]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run as a script

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from mcore_rl.platform.gdn_kernels import chunk_gated_delta_rule  # noqa: E402

HEADS, DIM = 4, 32


def _inputs(length: int, device: torch.device) -> list[torch.Tensor]:
    """q, k, v, g, beta of one [1, T, H, 32] stream (k unit-norm, decays in (0, 1)), leaves."""
    gen = torch.Generator().manual_seed(0)
    shape = (1, length, HEADS, DIM)
    q = torch.randn(shape, generator=gen)
    k = F.normalize(torch.randn(shape, generator=gen), dim=-1)
    v = torch.randn(shape, generator=gen)
    g = F.logsigmoid(torch.randn(shape[:3], generator=gen) + 3)
    beta = torch.rand(shape[:3], generator=gen)
    return [x.to(device).requires_grad_(True) for x in (q, k, v, g, beta)]


def _fwd_bwd_seconds(length: int, packed: bool, rounds: int, device: torch.device) -> float:
    """Median wall time of one forward + backward."""
    xs = _inputs(length, device)
    cu = None
    if packed:
        cu = torch.linspace(0, length, 9, device=device).long()  # 8 sequences of T / 8
    times = []
    for i in range(rounds + 1):
        start = time.perf_counter()
        out, _ = chunk_gated_delta_rule(*xs, cu_seqlens=cu)
        out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first is the warm-up
            times.append(time.perf_counter() - start)
        for x in xs:
            x.grad = None
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"chunk_gated_delta_rule fwd+bwd, B=1 H={HEADS} K=V={DIM} fp32, {args.threads} thread(s), {device}")
    print(f"{'T':>6}  {'layout':<10}  {'ms':>9}  {'us/token':>9}")
    for length in (512, 2048, 8192):
        for packed in (False, True):
            seconds = _fwd_bwd_seconds(length, packed, args.rounds, device)
            layout = "8 packed" if packed else "1 seq"
            print(f"{length:>6}  {layout:<10}  {seconds * 1e3:>9.1f}  {seconds / length * 1e6:>9.1f}")


if __name__ == "__main__":
    main()
