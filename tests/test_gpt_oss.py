"""gpt-oss pieces checked without a model build: the fused expert layout against transformers'
own expert arithmetic and bit-exact both ways, YaRN frequencies and attention factor against
transformers', the tiny test model exercising what the parity tests rely on (both clamps fire,
the window and the sinks change the output), and the refusals of what megatron-core cannot
express. Parity with transformers: tests/test_moe.py (world 1, EP=2), tests/test_packing.py
(TP=2+SP, PP=2, TP=2xEP=2, packed vs padded, critic); round trips: tests/test_convert.py;
routing replay: tests/test_routing_replay.py."""
from __future__ import annotations

import pytest
import torch

from mcore_rl.models.hf_config import ConfigError, model_args_from_hf
from tests.tiny import tiny_config, tiny_hf_model

YARN = dict(rope_type="yarn", factor=4.0, beta_fast=8.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=16, rope_theta=10000.0)


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(tiny_config("gpt_oss"))


def _megatron_expert(x: torch.Tensor, view, prefix: str, e: int, limit: float) -> torch.Tensor:
    """One expert as megatron's MLP computes it from the per-expert tensors the mapping table
    reads: fc1 = [gate; up] rows (+ bias), clamped quick_gelu(gate) * (up + 1), fc2 (+ bias)."""
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    p = f"{prefix}.{e}"
    fc1 = torch.cat([view[f"{p}.gate_proj.weight"], view[f"{p}.up_proj.weight"]])
    b1 = torch.cat([view[f"{p}.gate_proj.bias"], view[f"{p}.up_proj.bias"]])
    gate, up = torch.chunk(x @ fc1.t() + b1, 2, dim=-1)
    act = quick_gelu(gate.clamp(max=limit)) * (up.clamp(-limit, limit) + 1.0)
    return act @ view[f"{p}.down_proj.weight"].t() + view[f"{p}.down_proj.bias"]


def test_fused_experts_view_computes_transformers_experts_and_fuses_back_bit_exact(hf):
    """HF's interleaved, transposed ``gate_up_proj`` [E, H, 2I] with its bias, ``down_proj`` [E, I, H]
    with its bias, seen per expert (hf_layout.FusedExperts), give megatron's expert the outputs of
    transformers' own GptOssExperts arithmetic; fusing the per-expert tensors gives back every
    fused tensor bit for bit."""
    from mcore_rl.models.expert_layouts import LAYOUTS
    from mcore_rl.models.hf_layout import FusedExperts, fuse_stream

    layout = LAYOUTS["gpt_oss"]
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    experts = hf.model.layers[0].mlp.experts
    view = FusedExperts(state, 4, 48, 64, "tiny", layout)
    prefix = "model.layers.0.mlp.experts"
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(0))
    for e in range(4):
        with torch.no_grad():
            ref = experts._apply_gate(x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e])
            ref = ref @ experts.down_proj[e] + experts.down_proj_bias[e]
        assert ref.abs().max() > 0.1
        assert (_megatron_expert(x, view, prefix, e, experts.limit) - ref).abs().max() <= 1e-6
    per_expert = [(k, view[k]) for k in view if k.startswith(prefix + ".")]
    fused = dict(fuse_stream(per_expert, 4, layout.stack, layout))
    assert sorted(fused) == sorted(f"{prefix}.{k}" for k in layout.kinds)
    for name, tensor in fused.items():
        assert tensor.shape == state[name].shape and torch.equal(tensor, state[name]), name


def test_tiny_model_fires_both_clamps_and_its_window_and_sinks_matter(hf):
    """The parity tests see the clamps, the window and the sinks: with the tiny config some
    gate values lie above the limit and some up values outside it, and transformers' logits
    change when the window is removed or the sinks are pushed to -inf."""
    from tests.tiny import padded_batch

    batch = padded_batch(200)
    seen = {"gate": 0, "up": 0}
    limit = hf.config.swiglu_limit

    def counting(original):
        def apply_gate(gate_up: torch.Tensor) -> torch.Tensor:  # before the clamps: gate even, up odd columns
            seen["gate"] += int((gate_up[..., ::2] > limit).sum())
            seen["up"] += int((gate_up[..., 1::2].abs() > limit).sum())
            return original(gate_up)
        return apply_gate

    for layer in hf.model.layers:
        layer.mlp.experts._apply_gate = counting(layer.mlp.experts._apply_gate)
    try:
        with torch.no_grad():
            ref = hf(**batch).logits
    finally:
        for layer in hf.model.layers:
            del layer.mlp.experts._apply_gate
    assert seen["gate"] > 0 and seen["up"] > 0, seen
    assert batch["input_ids"].shape[1] > hf.config.sliding_window
    real = batch["attention_mask"].bool()
    no_window = tiny_hf_model(tiny_config("gpt_oss", sliding_window=128))  # longer than the batch
    no_window.load_state_dict(hf.state_dict())
    with torch.no_grad():
        assert (no_window(**batch).logits - ref)[real].abs().max() > 1e-2
        sinks = {n: p.clone() for n, p in hf.named_parameters() if n.endswith("sinks")}
        try:
            for n, p in hf.named_parameters():
                if n.endswith("sinks"):
                    p.fill_(-float("inf"))
            assert (hf(**batch).logits - ref)[real].abs().max() > 1e-2
        finally:
            for n, p in hf.named_parameters():
                if n in sinks:
                    p.copy_(sinks[n])


@pytest.mark.parametrize("rope", [
    YARN,
    {**YARN, "truncate": True},
    {**YARN, "beta_fast": 32.0, "factor": 32.0, "original_max_position_embeddings": 4096},  # gpt-oss-20b's
    {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0},
    {**YARN, "factor": None},  # max_position_embeddings / original, as HF derives it
])
def test_yarn_matches_transformers(rope):
    """inv_freq bit for bit and the cos/sin factor megatron's attention applies (from the yarn_*
    attributes set on the config instance) equal to transformers' attention_scaling."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        _yarn_get_concentration_factor_from_config,
    )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from mcore_rl.models.rope import inv_freq, yarn_config_attributes

    cfg = tiny_config("gpt_oss", rope_parameters=rope)
    want, scaling = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    args = model_args_from_hf(cfg)
    assert torch.equal(inv_freq(args.rope), want)
    megatron = _yarn_get_concentration_factor_from_config(SimpleNamespace(**yarn_config_attributes(args.rope)))
    assert megatron == pytest.approx(scaling, rel=1e-12) and scaling != 1.0


@pytest.mark.parametrize("overrides,message", [
    (dict(swiglu_alpha=1.5), r"swiglu_alpha=1.5 is not supported: megatron-core's quick_gelu hard-codes the "
                             r"sigmoid gain 1.702"),
    (dict(attention_bias=False), r"attention_bias=False is not supported: megatron-core has one switch"),
    (dict(swiglu_limit=-1.0), r"swiglu_limit=-1.0 must be a finite number > 0"),
    (dict(rope_parameters={**YARN, "attention_factor": 2.0}),
     r"YaRN attention_factor=2.0 differs from the factor derived from factor=4.0"),
])
def test_what_megatron_cannot_express_is_refused(overrides, message):
    from mcore_rl.errors import McoreRLError

    with pytest.raises(McoreRLError, match=message):
        model_args_from_hf(tiny_config("gpt_oss", **overrides))


def test_expert_tensor_parallel_is_refused():
    from mcore_rl.models.builder import check_divisibility
    from mcore_rl.parallel import LayoutError, ParallelLayout

    args = model_args_from_hf(tiny_config("gpt_oss"))
    check_divisibility(args, ParallelLayout(tp=2, sequence_parallel=True, etp=1))
    with pytest.raises(LayoutError, match=r"etp\(2\) > 1 with gpt_oss's expert biases.*set etp=1"):
        check_divisibility(args, ParallelLayout(tp=2, sequence_parallel=True))  # etp defaults to tp


def test_fp8_export_of_fused_experts_is_refused():
    """The bucketed export fuses gpt-oss' experts; block FP8 scales are per matrix: refused."""
    from mcore_rl.mapping.fp8_quant import BlockFp8
    from mcore_rl.models.hf_weights import export_hf_buckets

    with pytest.raises(ConfigError, match=r"FP8 export of gpt_oss: its experts are exported fused"):
        export_hf_buckets([], model_args_from_hf(tiny_config("gpt_oss")), "actor", fp8=BlockFp8())


def _quick_gelu_graphs() -> int:
    """Graphs torch.compile makes for one call of the activation a gpt-oss config holds."""
    from torch._dynamo.utils import counters

    from mcore_rl.models.builder import ACTIVATIONS

    before = counters["stats"]["unique_graphs"]
    x = torch.randn(7, 5)
    assert torch.equal(ACTIVATIONS["quick_gelu"]()(x), x * torch.sigmoid(1.702 * x))
    return counters["stats"]["unique_graphs"] - before


def _quick_gelu_with_and_without_fix() -> tuple[int, int]:
    from mcore_rl.platform.fixes import revert_fix

    eager = _quick_gelu_graphs()
    revert_fix("quick_gelu_eager_on_cpu")
    return eager, _quick_gelu_graphs()


def test_quick_gelu_runs_eagerly_on_cpu():
    """Fix quick_gelu_eager_on_cpu: the activation the builder gives gpt-oss is not compiled
    (megatron's jit_fuser would run inductor in every CPU process: 3.8-7 s); reverted, it is."""
    from tests.dist import run_ranks

    eager, compiled = run_ranks(1, _quick_gelu_with_and_without_fix)[0]
    assert eager == 0 and compiled >= 1, (eager, compiled)
