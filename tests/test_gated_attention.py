"""Gated attention (megatron-core ``attention_output_gate``; Qwen3-Next / Qwen3.5 full-attention
layers): megatron's SelfAttention on mcore_rl's CPU spec equals a direct computation from the HF
weights, and gives the same output and gradients at TP=2 as at TP=1, also when TP exceeds the KV
heads (fix ``gated_attention_gate_follows_query``: megatron re-indexes the query heads of a
shared KV group to the rank's, not the gate)."""
from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.mapping.transforms import GATED_QKV, ROW, Dims
from tests.dist import run_ranks

S, B, HIDDEN, D = 5, 2, 8, 4
CASES = {"tp2_1kv": (4, 1), "tp2_2kv": (4, 2)}  # (query heads, KV heads)
FIX = "gated_attention_gate_follows_query"


def _hf_weights(heads: int, kv: int, seed: int) -> dict[str, torch.Tensor]:
    """HF Qwen3-Next attention weights: q_proj rows per head [q_h | gate_h] (no biases)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"q_proj": (2 * heads * D, HIDDEN), "k_proj": (kv * D, HIDDEN), "v_proj": (kv * D, HIDDEN),
              "o_proj": (HIDDEN, heads * D)}
    return {k: torch.randn(s, generator=g) * 0.5 for k, s in shapes.items()}


def _direct(w: dict[str, torch.Tensor], x: torch.Tensor, heads: int, kv: int) -> torch.Tensor:
    """o_proj(causal_attention(q, k, v) * sigmoid(gate)) from the HF weights; x [s, b, hidden]."""
    s, b, _ = x.shape
    q_gate = (x @ w["q_proj"].T).view(s, b, heads, 2, D)
    q, gate = q_gate[..., 0, :], q_gate[..., 1, :]
    k = (x @ w["k_proj"].T).view(s, b, kv, D).repeat_interleave(heads // kv, dim=2)
    v = (x @ w["v_proj"].T).view(s, b, kv, D).repeat_interleave(heads // kv, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / math.sqrt(D)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("bhst,tbhd->sbhd", scores.softmax(dim=-1), v)
    return (attn * torch.sigmoid(gate)).reshape(s, b, heads * D) @ w["o_proj"].T


def _megatron(w: dict, x: torch.Tensor, grad: torch.Tensor, heads: int, kv: int, tp: int) -> dict:
    """megatron's SelfAttention (mcore_rl's CPU spec) at TP=tp loaded from the HF weights:
    output, input grad, and this rank's linear_qkv / linear_proj weight grads."""
    from megatron.core import parallel_state
    from megatron.core.transformer.spec_utils import build_module
    from megatron.core.transformer.transformer_config import TransformerConfig

    from mcore_rl.models.specs import LOCAL_LINEARS, _gqa_attention
    from mcore_rl.parallel import ParallelLayout
    from mcore_rl.parallel.layout import destroy_parallel_state, initialize_parallel_state

    initialize_parallel_state(ParallelLayout(tp=tp))
    try:
        config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=heads, num_query_groups=kv,
            kv_channels=D, attention_output_gate=True, add_bias_linear=False,
            tensor_model_parallel_size=tp, use_cpu_initialization=True, attention_dropout=0.0,
            hidden_dropout=0.0,
        )
        attn = build_module(_gqa_attention(False, LOCAL_LINEARS), config=config, layer_number=1)
        rank = parallel_state.get_tensor_model_parallel_rank()
        qkv = GATED_QKV.to_mcore([w["q_proj"], w["k_proj"], w["v_proj"]], Dims(heads, kv, D, 1, 1))
        with torch.no_grad():
            attn.linear_qkv.weight.copy_(GATED_QKV.shard(qkv, rank, tp))
            attn.linear_proj.weight.copy_(ROW.shard(w["o_proj"], rank, tp))
        x = x.clone().requires_grad_()
        out, bias = attn(x, attention_mask=None)
        assert bias is None
        out.backward(grad)
        return {"out": out.detach(), "dx": x.grad, "qkv": attn.linear_qkv.weight.grad,
                "proj": attn.linear_proj.weight.grad}
    finally:
        destroy_parallel_state()


def _all_cases(inputs: dict) -> dict:
    """Every case at TP=1 and TP=2 on 2 ranks, then the 1-KV-head case at TP=2 without the fix.

    Eager: megatron's ``_apply_output_gate`` is a ``jit_fuser`` (torch.compile) function, which
    computes the same ``x * sigmoid(gate)`` but takes ~4.4 s per process to compile on 2 cores."""
    with torch.compiler.set_stance("force_eager"):
        return _cases_eager(inputs)


def _cases_eager(inputs: dict) -> dict:
    from mcore_rl.platform.fixes import revert_fix

    results = {}
    for name, (heads, kv) in CASES.items():
        w, x, grad = inputs[name]
        results[name] = {tp: _megatron(w, x, grad, heads, kv, tp) for tp in (1, 2)}
    revert_fix(FIX)
    w, x, grad = inputs["tp2_1kv"]
    try:
        _megatron(w, x, grad, *CASES["tp2_1kv"], 2)
        results["without_fix"] = "no error"
    except Exception as e:  # the defect the fix removes
        results["without_fix"] = f"{type(e).__name__}: {e}"
    return results


@pytest.fixture(scope="module")
def runs() -> tuple[dict, list[dict]]:
    inputs = {}
    for i, (name, (heads, kv)) in enumerate(CASES.items()):
        g = torch.Generator().manual_seed(100 + i)
        inputs[name] = (_hf_weights(heads, kv, i), torch.randn(S, B, HIDDEN, generator=g),
                        torch.randn(S, B, HIDDEN, generator=g))
    return inputs, run_ranks(2, _all_cases, inputs)


@pytest.mark.parametrize("case", CASES)
def test_tp1_equals_direct_gated_attention(runs, case):
    """TP=1 output and gradients (weights back in the HF layout) against float64 autograd."""
    inputs, ranks = runs
    heads, kv = CASES[case]
    w, x, grad = inputs[case]
    w64 = {k: t.double().requires_grad_() for k, t in w.items()}
    x64 = x.double().requires_grad_()
    ref = _direct(w64, x64, heads, kv)
    ref.backward(grad.double())
    got = ranks[0][case][1]
    q_gate, k, v = GATED_QKV.to_hf(got["qkv"], Dims(heads, kv, D, 1, 1))
    pairs = [(got["out"], ref), (got["dx"], x64.grad), (q_gate, w64["q_proj"].grad),
             (k, w64["k_proj"].grad), (v, w64["v_proj"].grad), (got["proj"], w64["o_proj"].grad)]
    for mine, exact in pairs:
        torch.testing.assert_close(mine.double(), exact.detach(), atol=1e-5, rtol=0)


def _assert_fp32_equal(got: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal up to summation order: within 1e-6 of the tensor's largest entry (values reach ~13,
    where one fp32 ulp is 9.5e-7; TP sums the shared KV head's gradient in another order)."""
    torch.testing.assert_close(got, ref, atol=1e-6 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize("case", CASES)
def test_tp2_equals_tp1(runs, case):
    """Output and input grad on every rank, and the gathered weight grads, as at TP=1."""
    _, ranks = runs
    ref = ranks[0][case][1]
    for rank in ranks:
        _assert_fp32_equal(rank[case][2]["out"], ref["out"])
        _assert_fp32_equal(rank[case][2]["dx"], ref["dx"])
    _assert_fp32_equal(GATED_QKV.unshard([r[case][2]["qkv"] for r in ranks]), ref["qkv"])
    _assert_fp32_equal(ROW.unshard([r[case][2]["proj"] for r in ranks]), ref["proj"])


def test_fix_gate_follows_query_is_needed(runs):
    """megatron-core 0.16.1 without the fix: the gate keeps all heads of the shared KV group
    (4) while the attention output has the rank's 2, so its view in _apply_output_gate fails."""
    _, ranks = runs
    for rank in ranks:
        expected = "RuntimeError: shape '[5, 2, 8]' is invalid for input of size 160"
        assert rank["without_fix"] == expected, rank["without_fix"]


def _compiled_graphs_of_one_gate_call() -> int:
    """Graphs torch.compile makes for one call of megatron's output gate in this process."""
    from megatron.core.transformer.attention import Attention
    from torch._dynamo.utils import counters

    before = counters["stats"]["unique_graphs"]
    x = torch.randn(5, 2, 8)
    out = Attention._apply_output_gate(None, x, torch.randn(5, 2, 2, 4))
    assert out.shape == x.shape
    return counters["stats"]["unique_graphs"] - before


def _gate_compiles_with_and_without_fix() -> tuple[int, int]:
    from mcore_rl.platform.fixes import revert_fix

    eager = _compiled_graphs_of_one_gate_call()
    revert_fix("gated_output_eager_on_cpu")
    return eager, _compiled_graphs_of_one_gate_call()


def test_output_gate_runs_eagerly_on_cpu():
    """Fix gated_output_eager_on_cpu: the gate is not compiled (megatron's jit_fuser would run
    inductor on the first call of every CPU process: 2.6-4.4 s); reverted, it is."""
    eager, compiled = run_ranks(1, _gate_compiles_with_and_without_fix)[0]
    assert eager == 0 and compiled >= 1, (eager, compiled)
