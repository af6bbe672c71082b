"""Fix ``frozen_linear_dgrad_folded``: a frozen linear's input gradient from GPTModel's transposed
logits gradient ([s, b, V], not contiguous) is one folded matrix product (aten::mm), not a
product batched over the positions (aten::bmm, ~5x slower on the CPU: a LoRA model's frozen LM
head); the values are the same product (fp32 rounding)."""
from __future__ import annotations

import torch

from tests.dist import run_ranks


def _frozen_head_dgrad(fixed: bool) -> dict:
    from torch.profiler import profile

    from megatron.core.tensor_parallel.layers import LinearWithFrozenWeight
    from mcore_rl.platform.fixes import revert_fix

    if not fixed:
        revert_fix("frozen_linear_dgrad_folded")
    g = torch.Generator().manual_seed(0)
    s, b, h, vocab = 12, 3, 16, 40
    hidden = torch.randn(s, b, h, generator=g, requires_grad=True)  # the final norm's output [s, b, h]
    weight = torch.randn(vocab, h, generator=g)  # frozen
    logits = LinearWithFrozenWeight.apply(hidden, weight, None, False, None).transpose(0, 1)  # as GPTModel
    grad = torch.randn(b, s, vocab, generator=g)
    with profile() as prof:
        logits.backward(grad)
    ops = {e.name for e in prof.events() if e.name in ("aten::mm", "aten::bmm")}
    a, w = grad.transpose(0, 1).reshape(-1, vocab).double(), weight.double()
    # the exact product and Higham's bound for any fp32 summation order: |fl(AW) - AW| <= n u |A||W|
    bound = vocab * 2.0**-24 / (1 - vocab * 2.0**-24) * (a.abs() @ w.abs())
    return {"ops": sorted(ops), "dgrad": hidden.grad, "exact": a @ w, "bound": bound}


def test_frozen_linear_dgrad_is_one_folded_product():
    fixed = run_ranks(1, _frozen_head_dgrad, True)[0]
    assert fixed["ops"] == ["aten::mm"], fixed["ops"]
    defect = run_ranks(1, _frozen_head_dgrad, False)[0]  # megatron-core 0.16.1 without the fix
    assert defect["ops"] == ["aten::bmm"], defect["ops"]
    # both are the exact product up to fp32 rounding of a 40-term sum (the two summation orders
    # differ by up to ~5e-6 relative, and which one MKL takes can vary between runs)
    for run in (fixed, defect):
        error = (run["dgrad"].reshape(-1, 16).double() - run["exact"]).abs()
        assert (error <= run["bound"]).all(), (error / run["bound"]).max()
