"""Block FP8 export (issue #30, export side): ``merge --dtype fp8`` and its quantizer.

The quantizer is compared byte for byte (uint8 views: float8 has no ``equal`` on CPU) with an
independent one written here (python loops over blocks, nearest e4m3 value by table lookup, ties
to the even code), on edge blocks, block sizes other than 128, an all-zero block, exact rounding
ties and ue8m0 scales; NaN/inf are refused. A tiny llama is converted (fp32), merged as FP8 with
a block that does not divide its dims (48x40) and with one that does (32x32): transformers loads
the latter on CPU (it dequantizes there) to the weights dequantized here and the log-probs of
that; FP8 -> dequantized fp32 HF dir -> converter -> merge --dtype fp8 gives the same bytes and
scales; from bf16 the requantization error is measured. A block larger than a weight is clamped
to it (issue #37): the same bytes, scale shape and readback at 10^6 x 10^6 in milliseconds.
"""
from __future__ import annotations

import json
import math
import os
import shutil

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import hf_log_probs, rl_batch, tiny_config, tiny_hf_model

E4M3 = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
CODES = [c for c in range(128) if math.isfinite(E4M3[c])]  # non-negative finite codes 0..126, ascending
EDGE, EVEN = (48, 40), (32, 32)  # tiny llama dims 32/64/96: 48x40 leaves edge blocks, 32x32 divides


def ref_quantize(w: torch.Tensor, block: tuple[int, int], ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent block FP8: (q bytes uint8 [R, C], scales float32 [ceil(R/b0), ceil(C/b1)])."""
    w = w.float()
    rows, cols = w.shape
    nr, nc = -(-rows // block[0]), -(-cols // block[1])
    scales = torch.empty(nr, nc)
    out = torch.empty(rows, cols, dtype=torch.uint8)
    grid = torch.tensor([E4M3[c].item() for c in CODES])
    for i in range(nr):
        for j in range(nc):
            part = w[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]]
            amax = part.abs().max()
            s = amax / torch.tensor(448.0)
            if ue8m0 and amax > 0:
                s = torch.tensor(2.0 ** math.ceil(math.log2(s.item())))
            s = s if amax > 0 else torch.tensor(1.0)
            scales[i, j] = s
            y = (part / s).clamp(-448, 448).flatten()
            mag = y.abs()
            hi = torch.searchsorted(grid, mag).clamp(max=len(grid) - 1)
            lo = (hi - 1).clamp(min=0)
            d_lo, d_hi = mag - grid[lo], grid[hi] - mag
            pick = torch.where(d_lo < d_hi, lo, torch.where(d_hi < d_lo, hi, torch.where(lo % 2 == 0, lo, hi)))
            pick = torch.where(grid[hi] == mag, hi, pick)
            code = torch.tensor(CODES)[pick] | (torch.signbit(y).to(torch.int64) << 7)
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] = code.view(part.shape).to(torch.uint8)
    return out, scales


def dequant(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """q * scale per block, edge blocks cut, in fp32."""
    s = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[:q.shape[0], :q.shape[1]]
    return q.float() * s


def _tricky(rows: int, cols: int, block: tuple[int, int], seed: int) -> torch.Tensor:
    """Random weights; block [0, 0] all zero (one -0.0); block [1, 0] exact ties and subnormal
    ties around its max 448 (scale 1); a tiny last element."""
    b0, b1 = block
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.05
    w[:b0, :b1] = 0.0
    w[(0, 1) if b1 > 1 else (1, 0)] = -0.0
    ties = torch.tensor([448.0, 10.5, 11.5, -10.5, 3 * 2.0**-10, 2.0**-10, 440.0, -9.5, 0.0, 200.0, 232.0, -2.0**-7,
                         2.0**-10 + 2.0**-15])  # the last: above a subnormal tie, a double rounding's victim
    region = w[b0:2 * b0, :b1]
    region.zero_()
    flat = region.reshape(-1).clone()
    flat[:len(ties)] = ties
    region.copy_(flat.view(region.shape))
    w[-1, -1] = 1e-30
    return w


@pytest.mark.parametrize("shape,block", [((70, 90), (32, 64)), ((130, 257), (128, 128)), ((33, 47), (16, 1)),
                                         ((64, 64), (7, 128))])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_quantizer_matches_an_independent_one(shape, block, ue8m0):
    from mcore_rl.mapping.fp8_quant import BlockFp8, quantize_block_fp8

    w = _tricky(*shape, block, seed=shape[0])
    q, scale = quantize_block_fp8(w, BlockFp8(block, "ue8m0" if ue8m0 else "float"))
    ref_q, ref_scale = ref_quantize(w, block, ue8m0)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    assert torch.equal(scale, ref_scale), (scale - ref_scale).abs().max()
    assert torch.equal(q.view(torch.uint8), ref_q), int((q.view(torch.uint8) != ref_q).sum())
    q1, scale1 = quantize_block_fp8(w, BlockFp8(block, "ue8m0" if ue8m0 else "float"), chunk_elements=1)
    assert torch.equal(q1.view(torch.uint8), ref_q) and torch.equal(scale1, ref_scale)  # one block row at a time
    assert scale[0, 0] == 1.0 and (ue8m0 or scale[1, 0] == 1.0)  # the all-zero block; the ties' block
    if ue8m0:
        assert torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))  # powers of two
    err = (dequant(q, scale, block) - w).abs()
    assert bool((err <= dequant(torch.full_like(q, 16.0), scale, block)).all())  # within half a step at 448


def test_the_scale_divides():
    """Blocks [448 s, 10.5 s, 11.5 s, ...] with s of 16 significant bits (every product exact):
    x / s lands on the ties exactly (ties to even), x * (1 / s) beside them in some blocks."""
    from mcore_rl.mapping.fp8_quant import BlockFp8, quantize_block_fp8

    g = torch.Generator().manual_seed(3)
    s = torch.ldexp(torch.randint(2**15, 2**16, (256, 1), generator=g).float(), torch.tensor(-24))
    w = s * torch.tensor([448.0, 10.5, 11.5, -10.5, 104.0, 3.25, 0.8125])
    q, scale = quantize_block_fp8(w, BlockFp8((1, 7)))
    ref_q, ref_scale = ref_quantize(w, (1, 7))
    assert torch.equal(scale, s) and torch.equal(scale, ref_scale)
    assert torch.equal(q.view(torch.uint8), ref_q), int((q.view(torch.uint8) != ref_q).sum())


def test_other_rules_come_back_as_values_not_bytes():
    """Not byte-exact, measured: a checkpoint quantized by transformers' reciprocal rule (scale
    448 / amax, q = x * scale, scale_inv = 1 / scale) requantizes to the same bytes but some of
    its scales (6-10% measured) move by float32 roundings; ue8m0 (ours too) is not idempotent where a block's max
    rounds down to 224 * s: the same values come back with half the scale and doubled codes."""
    from mcore_rl.mapping.fp8_quant import BlockFp8, quantize_block_fp8

    b = (32, 32)
    w = torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.02
    w[:32, :32] = w[:32, :32].clamp(-0.15, 0.15) * 0.02
    w[0, 0] = 229.4 * 2.0**-16  # ue8m0 scale 2^-16, max / scale 229.4 rounds to 224
    blocks = w.view(8, 32, 8, 32)
    scale = 448.0 / blocks.abs().amax(dim=(1, 3))
    q = torch.clamp(blocks * scale[:, None, :, None], -448, 448).to(torch.float8_e4m3fn).view(256, 256)
    held = dequant(q, 1.0 / scale, b)
    q2, s2 = quantize_block_fp8(held, BlockFp8(b))
    moved = float((s2 != 1.0 / scale).float().mean())
    rel = ((dequant(q2, s2, b) - held).abs() / held.abs().clamp(min=1e-30)).max().item()
    print(f"reciprocal rule: {moved:.1%} of scales moved, values rel. {rel:.1e}")
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and 0 < moved < 0.5 and rel <= 2.0**-22
    fmt = BlockFp8(b, "ue8m0")
    q, s = quantize_block_fp8(w, fmt)
    held = dequant(q, s, b)
    q2, s2 = quantize_block_fp8(held, fmt)
    assert torch.equal(dequant(q2, s2, b), held) and s[0, 0] == 2.0**-16 and s2[0, 0] == 2.0**-17
    changed = s2 != s
    print(f"ue8m0: {int(changed.sum())} of {changed.numel()} blocks re-encoded")
    assert torch.equal(s2[changed], s[changed] / 2)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_are_refused_naming_the_block(bad):
    from mcore_rl.mapping.fp8_quant import BlockFp8, Fp8QuantError, quantize_block_fp8

    w = torch.randn(70, 90)
    w[40, 70] = bad
    for chunk in (1 << 22, 1):  # the whole tensor at once; one block row at a time
        with pytest.raises(Fp8QuantError, match=r"layers\.0\.x\.weight: 1 NaN/inf .* at \[40, 70\] in block \[1, 1\]"):
            quantize_block_fp8(w, BlockFp8((32, 64)), "layers.0.x.weight", chunk_elements=chunk)


def test_block_options_and_which_tensors():
    from mcore_rl.mapping.fp8_quant import BlockFp8, Fp8QuantError, is_quantized, parse_block

    assert parse_block("128x128") == (128, 128) and parse_block("48 40") == (48, 40) and parse_block("64") == (64, 64)
    assert parse_block("2147483647x1") == (2**31 - 1, 1)  # the largest side readers keep in an int32
    for bad in ("0x128", "ax4", "1x2x3", "", "-1", "1.5", "99999999999999999999", "2147483648x1", "1_000",
                "\u0661\u0662\u0668"):  # non-positive, non-integer, huge (issue #37 item 11), not ASCII digits
        with pytest.raises(Fp8QuantError, match=r"block size .*: give ROWSxCOLS of integers in 1\.\.2147483647"):
            parse_block(bad)
    for bad in ((2**31, 1), (True, 128), (128, 0)):
        with pytest.raises(Fp8QuantError, match=r"give two integers \(rows, cols\) in 1\.\.2147483647"):
            BlockFp8(bad)
    with pytest.raises(Fp8QuantError, match="scale_fmt"):
        BlockFp8((128, 128), "e8m0")
    L = "model.layers.3."
    yes = ["self_attn.q_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.q_a_proj",
           "mlp.experts.5.down_proj", "mlp.shared_experts.up_proj", "block_sparse_moe.experts.1.w3", "mlp.gate_proj"]
    no = ["mlp.gate", "mlp.shared_expert_gate", "input_layernorm", "self_attn.q_a_layernorm", "self_attn.k_norm"]
    assert all(is_quantized(L + n + ".weight", (64, 64)) for n in yes)
    assert not any(is_quantized(L + n + ".weight", (64, 64)) for n in no)
    assert not any(is_quantized(n, (200, 64)) for n in ("model.embed_tokens.weight", "lm_head.weight", "score.weight"))
    assert not is_quantized(L + "self_attn.q_proj.bias", (64,)) and not is_quantized(L + "mlp.gate.e_score_correction_bias", (8,))


@pytest.mark.parametrize("block", [(10**6, 10**6), (10**6, 32), (16, 10**6), (2**31 - 1, 2**31 - 1)])
def test_a_block_larger_than_the_weight_is_the_weight(block):
    """Issue #37 item 10: a block side beyond the weight's is clamped to it (no padding to the
    block's area: 10^6 x 10^6 takes milliseconds): the bytes and scales of the clamped block, the
    scale shape HF/DeepSeek readers compute from the unclamped one, and fp8_dequant reading it
    back under the unclamped block size gives the clamped block's values."""
    from mcore_rl.mapping.fp8_dequant import FP8Scheme, dequantize
    from mcore_rl.mapping.fp8_quant import BlockFp8, quantize_block_fp8

    clamped = (min(block[0], 70), min(block[1], 90))
    w = _tricky(70, 90, (35, 45), seed=7)  # zero, tie and subnormal regions inside the one block
    fmt = BlockFp8(block)
    q, scale = quantize_block_fp8(w, fmt, chunk_elements=1)
    ref_q, ref_scale = ref_quantize(w, clamped)
    assert scale.shape == fmt.scale_shape((70, 90)) == (-(-70 // block[0]), -(-90 // block[1]))
    assert torch.equal(scale, ref_scale) and torch.equal(q.view(torch.uint8), ref_q)
    back = dequantize(q, scale, FP8Scheme("fp8", "weight_scale_inv", frozenset({"block"}), block))
    assert torch.equal(back, dequant(q, scale, clamped))


def _convert(jobs):
    from mcore_rl.conversion.convert import ConvertOptions, convert

    for hf, dst, dtype in jobs:
        convert(ConvertOptions(hf, dst, dtype=dtype), progress=False)


def _save(tensors: dict, src: str, dst: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(dst)
    for name in os.listdir(src):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(src, name), dst)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny llama (fp32), its FP8 form (quantized by the exporter's rule, EDGE blocks) written
    back dequantized in fp32 and in bf16, each converted; + the FP8 bytes and scales."""
    from safetensors.torch import load_file

    from mcore_rl.mapping.fp8_quant import BlockFp8, is_quantized, quantize_block_fp8

    base = str(tmp_path_factory.mktemp("fp8"))
    hf = os.path.join(base, "hf")
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(hf)
    orig = load_file(os.path.join(hf, "model.safetensors"))
    fp8, deq = {}, {}
    for name, w in orig.items():
        if is_quantized(name, tuple(w.shape)):
            fp8[name] = quantize_block_fp8(w, BlockFp8(EDGE), name)
            deq[name] = dequant(*fp8[name], EDGE)
        else:
            deq[name] = w
    ds = os.path.join(base, "hf_ds")  # MLA, a dense layer and an MoE layer, a router with correction bias
    tiny_hf_model(tiny_config("deepseek_v3", num_hidden_layers=2)).save_pretrained(ds)
    _save(deq, hf, os.path.join(base, "hf_deq"))
    _save({k: v.bfloat16() for k, v in deq.items()}, hf, os.path.join(base, "hf_deq_bf16"))
    jobs = [(os.path.join(base, n), os.path.join(base, f"conv_{n}"), d)
            for n, d in (("hf", "fp32"), ("hf_deq", "fp32"), ("hf_deq_bf16", "bf16"), ("hf_ds", "fp32"))]
    run_ranks(1, _convert, jobs, daemon=False)
    return {"base": base, "orig": orig, "fp8": fp8,
            **{n: os.path.join(base, f"conv_{n}") for n in ("hf", "hf_deq", "hf_deq_bf16", "hf_ds")}}


def _read(target) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    with open(os.path.join(target, "config.json")) as f:
        return load_file(os.path.join(target, "model.safetensors")), json.load(f)


def _merge(local, target, **kw):
    from mcore_rl.conversion.merge import merge

    return merge(local, str(target), **kw)


def test_merge_fp8_writes_block_fp8_with_edge_blocks(dirs, tmp_path):
    from mcore_rl.mapping.fp8_quant import BlockFp8, is_quantized

    _merge(dirs["hf"], tmp_path / "fp32")
    summary = _merge(dirs["hf"], tmp_path / "fp8", dtype="fp8", fp8=BlockFp8(EDGE))
    plain, _ = _read(tmp_path / "fp32")
    out, config = _read(tmp_path / "fp8")
    assert config["quantization_config"] == {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(EDGE),
                                             "activation_scheme": "dynamic"}
    assert config["dtype"] == "float32" and "float8_e4m3fn 48x40" in summary.line()
    quantized = [n for n in plain if is_quantized(n, tuple(plain[n].shape))]
    assert len(quantized) == 14 and set(out) == set(plain) | {n + "_scale_inv" for n in quantized}
    for name, w in plain.items():
        if name not in quantized:  # embeddings, norms, lm_head: as the fp32 merge
            assert out[name].dtype == torch.float32 and torch.equal(out[name], w), name
            continue
        ref_q, ref_scale = ref_quantize(w, EDGE)
        assert out[name].dtype == torch.float8_e4m3fn and torch.equal(out[name].view(torch.uint8), ref_q), name
        assert torch.equal(out[name + "_scale_inv"], ref_scale), name


def test_merge_with_a_block_larger_than_every_weight_reads_back(dirs, tmp_path):
    """``merge --dtype fp8`` at 10^6 x 10^6 (one scale per weight, a traceback before issue #37):
    config.json keeps the block asked for, every scale is [1, 1], and the import reads the
    weights back as the per-weight quantization's values."""
    from mcore_rl.mapping.fp8_quant import BlockFp8
    from mcore_rl.mapping.hf_io import SafetensorsReader

    huge = (10**6, 10**6)
    _merge(dirs["hf"], tmp_path / "huge", dtype="fp8", fp8=BlockFp8(huge))
    out, config = _read(tmp_path / "huge")
    assert config["quantization_config"]["weight_block_size"] == list(huge)
    scales = [n for n in out if n.endswith("_scale_inv")]
    assert len(scales) == 14 and all(out[n].shape == (1, 1) for n in scales)
    reader = SafetensorsReader(str(tmp_path / "huge"))
    for name in (n.removesuffix("_scale_inv") for n in scales):
        w = dirs["orig"][name]
        ref_q, ref_scale = ref_quantize(w, tuple(w.shape))
        assert torch.equal(reader[name], dequant(ref_q.view(torch.float8_e4m3fn), ref_scale, tuple(w.shape))), name


def test_round_trip_gives_the_same_bytes_and_scales(dirs, tmp_path):
    """FP8 (exporter's rule) -> dequantized fp32 -> converter -> merge --dtype fp8: identical."""
    from mcore_rl.mapping.fp8_quant import BlockFp8

    _merge(dirs["hf_deq"], tmp_path / "fp8", dtype="fp8", fp8=BlockFp8(EDGE))
    out, _ = _read(tmp_path / "fp8")
    for name, w in dirs["orig"].items():
        if name in dirs["fp8"]:
            q, scale = dirs["fp8"][name]
            assert torch.equal(out[name].view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(out[name + "_scale_inv"], scale), name
        else:
            assert out[name].dtype == w.dtype and torch.equal(out[name], w), name


def test_requantization_error_from_bf16(dirs, tmp_path):
    """FP8 -> dequantized, rounded to bf16 -> converter (bf16) -> merge --dtype fp8: measured."""
    from mcore_rl.mapping.fp8_quant import BlockFp8

    _merge(dirs["hf_deq_bf16"], tmp_path / "fp8", dtype="fp8", fp8=BlockFp8(EDGE))
    out, config = _read(tmp_path / "fp8")
    assert config["dtype"] == "bfloat16"
    changed = 0
    worst_scale = worst_rel = 0.0
    for name, (q, scale) in dirs["fp8"].items():
        q2, s2 = out[name], out[name + "_scale_inv"]
        changed += int((q2.view(torch.uint8) != q.view(torch.uint8)).sum())
        worst_scale = max(worst_scale, ((s2 - scale).abs() / scale).max().item())
        held = dequant(q, scale, EDGE).bfloat16().float()  # what the bf16 checkpoint holds
        nonzero = held != 0
        rel = (dequant(q2, s2, EDGE) - held)[nonzero].abs() / held[nonzero].abs()
        worst_rel = max(worst_rel, rel.max().item())
    total = sum(q.numel() for q, _ in dirs["fp8"].values())
    print(f"bf16 requantization: {changed}/{total} fp8 bytes changed, scales rel. {worst_scale:.2e}, "
          f"dequantized vs the bf16 weights rel. {worst_rel:.2e}")
    # bf16's 8 significant bits hold e4m3's 4 with room: every byte comes back; the scale moves
    # with the block max's bf16 rounding (<= 2^-8), so does each value (+ its own rounding)
    assert changed == 0
    assert 0 < worst_scale <= 2.0**-8 and worst_rel <= 2.0**-7


# deepseek_v3 dims (rows 24..112, cols 16..96) are multiples of 8 x 16; llama's of 32 x 32
@pytest.mark.parametrize("source,block,quantized", [("hf", EVEN, 14), ("hf_ds", (8, 16), 40)])
def test_transformers_loads_the_fp8_export(dirs, tmp_path, source, block, quantized):
    """Block-multiple dims: transformers 5.24 dequantizes on CPU (q * scale_inv in fp32) to the
    weights dequantized here, the other tensors as written (DeepSeek's router and correction
    bias stay fp32); log-probs are those of that model, within the measured FP8 error."""
    from transformers import AutoModelForCausalLM

    from mcore_rl.mapping.fp8_quant import BlockFp8

    _merge(dirs[source], tmp_path / "fp32")
    _merge(dirs[source], tmp_path / "fp8", dtype="fp8", fp8=BlockFp8(block))
    out, _ = _read(tmp_path / "fp8")
    ours = {n: dequant(t, out[n + "_scale_inv"], block) for n, t in out.items() if t.dtype == torch.float8_e4m3fn}
    assert len(ours) == quantized and not any(k.endswith(("mlp.gate.weight", "correction_bias")) for k in ours)
    plain = {n: ours.get(n, t) for n, t in out.items() if not n.endswith("_scale_inv")}
    _save(plain, str(tmp_path / "fp32"), str(tmp_path / "mine"))  # dequantized here, in fp32
    load = lambda d: AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,  # noqa: E731
                                                          attn_implementation="eager").eval()
    fp32_model, fp8_model, mine = (load(tmp_path / d) for d in ("fp32", "fp8", "mine"))
    state, want = fp8_model.state_dict(), mine.state_dict()
    assert state.keys() == want.keys()
    differ = [k for k in want if state[k].dtype != want[k].dtype or not torch.equal(state[k], want[k])]
    assert not differ, differ
    batch = rl_batch(200, batch=4, prompt=6, response=6, seed=5)
    lp32, lp8, lp_mine = (hf_log_probs(m, batch)[0] for m in (fp32_model, fp8_model, mine))
    err = (lp_mine - lp32).abs().max().item()
    print(f"{source} FP8 {block} log-prob error vs fp32: {err:.3e}")
    # measured 0.19 (llama) / 0.35 (deepseek_v3) nats, random tiny models (init range 0.1): the bound
    # is that of our own dequantization, whose weights transformers must load exactly (above)
    assert 0 < err < 0.5 and (lp8 - lp32).abs().max().item() <= err + 1e-6
    assert torch.allclose(lp8, lp_mine, rtol=0, atol=1e-6)


def test_cli_options_and_quantization_config_dropped(dirs, tmp_path, capsys):
    from converters.mcore_to_hf import main

    target = tmp_path / "ue8m0"
    assert main(["merge", "--local_dir", dirs["hf"], "--target_dir", str(target), "--dtype", "fp8",
                 "--fp8_block_size", "48", "40", "--scale_fmt", "ue8m0"]) == 0
    out, config = _read(target)
    assert config["quantization_config"]["scale_fmt"] == "ue8m0"
    assert config["quantization_config"]["weight_block_size"] == [48, 40]
    scale = out["model.layers.0.mlp.down_proj.weight_scale_inv"]
    assert scale.shape == (2, 3) and torch.equal(torch.frexp(scale)[0], torch.full_like(scale, 0.5))
    for argv, says in ((["--scale_fmt", "ue8m0"], "apply to --dtype fp8 only"),
                       (["--dtype", "fp8", "--fp8_block_size", "0x128"], "block size '0x128'")):
        capsys.readouterr()
        assert main(["merge", "--local_dir", dirs["hf"], "--target_dir", str(tmp_path / "x"), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and says in err and err.count("\n") == 1, err
    assert not os.path.exists(tmp_path / "x")
    # a model dir whose huggingface/config.json came from an FP8 checkpoint: a bf16 merge drops it
    fp8_sourced = tmp_path / "fp8_sourced"
    shutil.copytree(dirs["hf"], fp8_sourced)
    path = fp8_sourced / "huggingface" / "config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}))
    _merge(str(fp8_sourced), tmp_path / "bf16", dtype="bf16", verify=False)
    assert "quantization_config" not in _read(tmp_path / "bf16")[1]


def _fp8_buckets(hf_dir: str, bound: int) -> list:
    from mcore_rl.mapping.fp8_quant import BlockFp8
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf_buckets
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine

    layout = ParallelLayout(tp=2)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, "actor", active_platform(), hf_weights=hf_dir)
    buckets = export_hf_buckets(engine.model, args, "actor", bucket_bytes=bound, fp8=BlockFp8(EDGE))
    return [[(name, t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t.clone()) for name, t in b]
            for b in buckets]


def test_online_export_sends_what_the_merge_writes(dirs, tmp_path):
    """TP=2 engine, export_hf_buckets(fp8=...): the merge's bytes and scales, each weight with its
    scale in one bucket, the bound (q_proj + k_proj + their scales fit 8200 B, + v_proj does not;
    without its scales it would) counts the scales."""
    from mcore_rl.mapping.fp8_quant import BlockFp8

    bound = 8200
    ranks = run_ranks(2, _fp8_buckets, os.path.join(dirs["base"], "hf"), bound)
    _merge(dirs["hf"], tmp_path / "fp8", dtype="fp8", fp8=BlockFp8(EDGE))
    merged, _ = _read(tmp_path / "fp8")
    buckets = ranks[0]
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(merged) and len(names) == len(set(names))
    for bucket in buckets:
        for i, (name, t) in enumerate(bucket):
            want = merged[name]
            want = want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want
            assert t.dtype == want.dtype and torch.equal(t, want), name
            if name.endswith("_scale_inv"):
                assert i > 0 and bucket[i - 1][0] == name.removesuffix("_scale_inv"), name
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        single = len(bucket) == 1 or (len(bucket) == 2 and bucket[1][0].endswith("_scale_inv"))
        assert single or nbytes <= bound, ([n for n, _ in bucket], nbytes)
    assert [n for n, _ in ranks[1][0]] == [n for n, _ in buckets[0]]
    q_bucket = next(b for b in buckets if b[0][0] == "model.layers.0.self_attn.q_proj.weight")
    assert [n.split(".")[-2:] for n, _ in q_bucket] == [["q_proj", "weight"], ["q_proj", "weight_scale_inv"],
                                                        ["k_proj", "weight"], ["k_proj", "weight_scale_inv"]]
