"""Vocab-parallel log-probs and entropy (mcore_rl.rl.logprob): values and gradients against a
float64 full-vocab autograd reference at TP=1, 2, 4; what backward keeps and what it runs.

Inputs make every mechanism active: a vocab padded to 256 (a shard partly or wholly padding)
whose padding columns hold large logits (they would dominate if they leaked in), temperature
!= 1, labels in every shard's real columns, random per-token loss weights a, b.

Tolerances. fp32 logits: log-prob and entropy within 1e-5 * max(1, |ref|) per token (fp32
log-sum-exp of logits ~20 in size rounds at ~2e-6); gradients within 1e-5 * max|ref grad| (the
reference is float64). bf16 logits: the math runs in fp32 on the exactly representable bf16
values, so values keep the fp32 tolerance and the reference uses the same bf16-rounded logits;
the gradient is returned in bf16, so each entry may carry bf16 rounding on top (7 stored bits:
at most 2^-8 relative): |g - ref| <= 2^-8 * |ref| + 1e-5 * max|ref|. Measured: fp32 values within
~3e-7, fp32 gradients within ~2% of their band, bf16 gradients within 0.79-0.95 of theirs.
"""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks

PADDED = 256
CASES = [  # (dtype, temperature, with_entropy, entropy_grad)
    (torch.float32, 0.7, True, True),
    (torch.bfloat16, 0.7, True, True),
    (torch.float32, 1.0, True, True),
    (torch.float32, 1.3, True, False),
    (torch.bfloat16, 0.7, False, True),
]


def _inputs(vocab: int, tp: int, dtype: torch.dtype, seed: int = 0):
    """full logits [3, 11, PADDED] (rounded to dtype), labels [3, 11], weights a, b [3, 11]."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(3, 11, PADDED, generator=g, dtype=torch.float64) * 3.0
    full[..., vocab:] = 40.0  # garbage padding logits
    labels = torch.randint(0, vocab, (3, 11), generator=g)
    width = PADDED // tp
    real_shards = [s for s in range(tp) if s * width < vocab]
    edges = [i for s in real_shards for i in (s * width, min((s + 1) * width, vocab) - 1)]
    labels.view(-1)[: len(edges)] = torch.tensor(edges)  # first and last real id of every shard
    a, b = torch.randn(3, 11, generator=g), torch.randn(3, 11, generator=g)
    return full.to(dtype), labels, a, b


def _reference(full, labels, a, b, vocab, temperature, with_entropy, entropy_grad):
    """float64 log-probs, entropy and d(sum(a lp + b H))/d logits [.., PADDED] over the unpadded vocab."""
    z = full[..., :vocab].double().requires_grad_()
    logp = torch.log_softmax(z / temperature, -1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    loss = (a.double() * lp).sum()
    if with_entropy and entropy_grad:
        loss = loss + (b.double() * ent).sum()
    loss.backward()
    grad = torch.zeros(full.shape, dtype=torch.float64)
    grad[..., :vocab] = z.grad
    return lp.detach(), ent.detach(), grad


def _value_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """max |x - ref| / max(1, |ref|), per token."""
    return ((x.double() - ref).abs() / ref.abs().clamp(min=1.0)).max().item()


def _grad_error(grad: torch.Tensor, ref: torch.Tensor, scale: float) -> float:
    """how far the gradient is outside its tolerance band, in units of that band (<= 1 passes);
    scale: max |reference gradient| over the whole vocab (a shard of padding has 0 gradient)."""
    band = torch.full_like(ref, 1e-5 * scale)
    if grad.dtype == torch.bfloat16:
        band = band + 2.0**-8 * ref.abs()
    return ((grad.double() - ref).abs() / band).max().item()


def _check_case(vocab, tp, dtype, temperature, with_entropy, entropy_grad) -> list[str]:
    from megatron.core import parallel_state

    from mcore_rl.rl.logprob import log_probs_and_entropy

    full, labels, a, b = _inputs(vocab, tp, dtype)
    rank, width = parallel_state.get_tensor_model_parallel_rank(), PADDED // tp
    shard = full[..., rank * width : (rank + 1) * width].clone().requires_grad_()
    lp, ent = log_probs_and_entropy(shard, labels, vocab, temperature, with_entropy, entropy_grad)
    loss = (a * lp).sum()
    if with_entropy:
        loss = loss + (b * ent).sum()  # with entropy_grad=False ent is detached: adds no gradient
    loss.backward()
    ref_lp, ref_ent, ref_grad = _reference(full, labels, a, b, vocab, temperature, with_entropy, entropy_grad)
    scale, ref_grad = ref_grad.abs().max().item(), ref_grad[..., rank * width : (rank + 1) * width]
    name = f"vocab={vocab} tp={tp} rank={rank} {dtype} T={temperature} entropy={with_entropy}/{entropy_grad}"
    errors = {"lp": _value_error(lp, ref_lp), "grad": _grad_error(shard.grad, ref_grad, scale)}
    if with_entropy:
        errors["entropy"] = _value_error(ent, ref_ent)
    limits = {"lp": 1e-5, "entropy": 1e-5, "grad": 1.0}  # grad: in units of its tolerance band
    failed = [f"{name}: {k} error {v:.3g}" for k, v in errors.items() if not v <= limits[k]]
    padding = shard.grad[..., max(0, vocab - rank * width) :]
    if padding.numel() and padding.abs().max().item() != 0.0:  # padding columns get no gradient at all
        failed.append(f"{name}: padding gradient {padding.abs().max().item():.3g}")
    if shard.grad.dtype != dtype:
        failed.append(f"{name}: grad dtype {shard.grad.dtype}")
    if (ent is not None) != with_entropy or (with_entropy and ent.requires_grad != entropy_grad):
        failed.append(f"{name}: entropy is {None if ent is None else ent.requires_grad} (requires_grad)")
    return failed


def _all_cases(tp: int, vocabs: tuple[int, ...]) -> list[str]:
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state

    initialize_parallel_state(ParallelLayout(tp=tp))
    return [msg for vocab in vocabs for case in CASES for msg in _check_case(vocab, tp, *case)]


@pytest.mark.parametrize("tp,vocabs", [(1, (200,)), (2, (200,)), (4, (200, 100))])
def test_values_and_gradients_match_full_vocab_reference(tp, vocabs):
    # vocab 200 of 256: the last shard is partly padding; vocab 100 at TP=4: shards 2, 3 are all padding
    failures = [msg for rank in run_ranks(tp, _all_cases, tp, vocabs) for msg in rank]
    assert failures == [], "\n".join(failures)


def _saved_and_peak(dtype: torch.dtype, with_entropy: bool, entropy_grad: bool, tokens: int, width: int):
    """(bytes saved for backward, peak live bytes over forward + backward, aten ops run in backward)."""
    from benchmarks.logprob_memory import LiveBytes
    from mcore_rl.rl.logprob import log_probs_and_entropy

    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(tokens, width, generator=g) * 3).to(dtype).requires_grad_()
    labels = torch.randint(0, width - 5, (tokens,), generator=g)  # the last 5 columns are padding
    a, b = torch.randn(tokens, generator=g), torch.randn(tokens, generator=g)
    saved: list[int] = []

    def pack(t: torch.Tensor):
        saved.append(t.numel() * t.element_size())
        return t

    tracker, ops = LiveBytes(), _OpNames()
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            lp, ent = log_probs_and_entropy(logits, labels, width - 5, 0.7, with_entropy, entropy_grad)
        loss = (a * lp).sum() + ((b * ent).sum() if with_entropy else 0.0)
        with ops:
            loss.backward()
    return sum(saved), tracker.peak, ops.names


class _OpNames(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _memory_cases(tokens: int, width: int, chunk: int) -> dict:
    import mcore_rl.rl.logprob as logprob
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state

    initialize_parallel_state(ParallelLayout(tp=1))
    logprob._CHUNK_ELEMENTS = chunk  # small row chunks, so one chunk is far below one shard
    return {
        f"{str(dtype)[6:]} {mode}": _saved_and_peak(dtype, mode != "lp", mode == "lp+H", tokens, width)
        for dtype in (torch.float32, torch.bfloat16) for mode in ("lp", "lp+H", "lp+H detached")
    }


def test_backward_keeps_one_fp32_shard_and_detached_entropy_costs_nothing():
    tokens, width, chunk = 256, 1024, 1 << 14
    shard32, vectors = tokens * width * 4, 64 * tokens  # per-token vectors: a few [tokens] tensors
    results = run_ranks(1, _memory_cases, tokens, width, chunk)[0]
    for case, (saved, peak, _) in results.items():
        grad_bytes = shard32 // 2 if case.startswith("bfloat16") else 0  # the bf16 gradient (fp32 reuses p)
        # saved for backward: the softmax [tokens, width] in fp32 and per-token vectors only
        assert saved <= shard32 + vectors, (case, saved, shard32)
        # over forward + backward: that fp32 buffer, the returned gradient, two row chunks of temporaries
        assert peak <= shard32 + grad_bytes + 2 * 4 * chunk + vectors, (case, peak, shard32)
    for dtype in ("float32", "bfloat16"):  # a detached entropy adds no saved bytes and no backward op
        assert results[f"{dtype} lp+H detached"][0] == results[f"{dtype} lp"][0]
        assert results[f"{dtype} lp+H detached"][2] == results[f"{dtype} lp"][2]
        assert results[f"{dtype} lp+H"][2] != results[f"{dtype} lp"][2]  # the comparison can tell


def _errors() -> list[str]:
    from mcore_rl.errors import McoreRLError
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.rl.logprob import log_probs_and_entropy

    initialize_parallel_state(ParallelLayout(tp=2))
    logits, labels = torch.randn(2, 3, 64), torch.zeros(2, 3, dtype=torch.long)
    bad = {
        "temperature=0": lambda: log_probs_and_entropy(logits, labels, 100, 0.0),
        "labels (3, 2)": lambda: log_probs_and_entropy(logits, labels.view(3, 2), 100),
        "vocab_size=129": lambda: log_probs_and_entropy(logits, labels, 129),
        "[100, 100] but must be token ids in [0, vocab_size=100)":
            lambda: log_probs_and_entropy(logits, torch.full_like(labels, 100), 100),
        "dtype torch.float32": lambda: log_probs_and_entropy(logits, labels.float(), 100),
    }
    messages = []
    for expected, call in bad.items():
        try:
            call()
            messages.append(f"no error for {expected}")
        except McoreRLError as e:
            assert isinstance(e, ValueError) and expected in str(e), (expected, str(e))
            messages.append(str(e))
    leaf = logits.clone().requires_grad_()
    lp, _ = log_probs_and_entropy(leaf, labels, 100)
    lp.sum().backward(retain_graph=True)
    try:
        lp.sum().backward()  # the saved softmax became the first gradient
        messages.append("no error for a second backward")
    except McoreRLError as e:
        messages.append(str(e))
    return messages


def test_bad_inputs_and_second_backward_raise_clear_errors():
    for messages in run_ranks(2, _errors):
        assert not [m for m in messages if m.startswith("no error")], messages
        assert "retain_graph" in messages[-1], messages[-1]
