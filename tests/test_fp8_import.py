"""FP8 checkpoints imported (issue 30): the test quantizes tiny models itself, with dimensions that
are not multiples of the block size, block sizes other than 128, scales in F32 (power-of-two,
ue8m0), BF16 and F16:
- DeepSeek-V3 (MLA, experts, F32 correction bias) and Qwen3-MoE as block FP8 (quant_method fp8);
- GLM-4.5 as compressed-tensors per-channel FP8, written by hand (no compressed-tensors package);
- a Qwen3 as per-tensor FP8 with static activation scales (AutoFP8 style);
- the same DeepSeek as model_type kimi_k2 with tiktoken.model and tokenization_kimi.py.
Each is dequantized independently here (block reshapes, not the reader's band loop) into an fp32
directory: the converter's output equals the conversion of that directory bit for bit (fp32) and
as one rounding of the fp32 products (the default bf16); load_hf's logits equal transformers' on
it at world 1 and EP=2. Every refusal (other methods, missing or misshapen scales) is tested, and
(issue #37) damaged values: NaN/inf/negative/overflowing scales, zero scales of non-zero blocks,
NaN FP8 encodings, integer dtypes where a float weight belongs; ``--test`` of an FP8 input."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_rl.mapping.fp8_dequant import QuantizationError
from mcore_rl.mapping.hf_io import SafetensorsReader
from tests.dist import run_ranks
from tests.steps import outputs_of_models
from tests.test_convert import _raw_tensors
from tests.tiny import padded_batch, tiny_config, tiny_hf_model

E4M3_MAX = 448.0
BLOCK_FP8 = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic")
GLM_CT = dict(quant_method="compressed-tensors", format="float-quantized", quantization_status="compressed",
              kv_cache_scheme=None, ignore=["lm_head", "model.layers.0.self_attn.o_proj"],
              config_groups={"group_0": {"targets": ["Linear"], "weights": dict(
                  num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False),
                  "input_activations": dict(num_bits=8, type="float", strategy="token", dynamic=True)}})
MODELS = {  # name -> (model_type, overrides, quantization_config, kind, scale dtype)
    "deepseek_v3": ("deepseek_v3", {}, dict(BLOCK_FP8, weight_block_size=[24, 40], scale_fmt="ue8m0"),
                    "block", torch.float32),
    "qwen3_moe": ("qwen3_moe", {}, dict(BLOCK_FP8, weight_block_size=[40, 24]), "block", torch.bfloat16),
    "glm4_moe": ("glm4_moe", {}, GLM_CT, "channel", torch.bfloat16),
    "qwen3_tensor": ("qwen3", dict(head_dim=24), dict(quant_method="fp8", activation_scheme="static"),
                     "tensor", torch.float16),
}
NOT_QUANTIZED = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight", "model.layers.0.self_attn.o_proj")


def _quantized(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".weight") and t.dim() == 2 and not any(s in name for s in NOT_QUANTIZED)


def _scale(amax: torch.Tensor, dtype: torch.dtype, pow2: bool) -> torch.Tensor:
    """The standard rule: amax / 448 (an all-zero group: 1), optionally rounded up to a power of 2."""
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (torch.exp2(torch.ceil(torch.log2(s))) if pow2 else s).to(dtype)


def _blocks(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[R, C] zero-padded to block multiples, as [nR, b0, nC, b1]."""
    (r, c), (b0, b1) = t.shape, block
    padded = torch.zeros(math.ceil(r / b0) * b0, math.ceil(c / b1) * b1, dtype=t.dtype)
    padded[:r, :c] = t
    return padded.reshape(padded.shape[0] // b0, b0, padded.shape[1] // b1, b1)


def quantize(w: torch.Tensor, kind: str, sdtype: torch.dtype, block=None, pow2=False):
    """(FP8 weight, scale, the independent fp32 dequantization of the two)."""
    w = w.float()
    if kind == "block":
        blocks = _blocks(w, block)
        s = _scale(blocks.abs().amax(dim=(1, 3)), sdtype, pow2)
        qb = (blocks / s.float()[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        rows, cols = qb.shape[0] * qb.shape[1], qb.shape[2] * qb.shape[3]
        deq = (qb.float() * s.float()[:, None, :, None]).reshape(rows, cols)[: w.shape[0], : w.shape[1]]
        return qb.reshape(rows, cols)[: w.shape[0], : w.shape[1]].contiguous(), s, deq.contiguous()
    s = _scale(w.abs().amax(dim=1, keepdim=True) if kind == "channel" else w.abs().amax(), sdtype, pow2)
    q = (w / s.float()).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, s, q.float() * s.float()


def write_fp8(src: str, dst: str, ref: str, model_type: str, quant: dict, kind: str, sdtype) -> None:
    """``dst``: src quantized (other tensors bf16, correction bias F32); ``ref``: its fp32 values."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, plain = {}, {}
    suffix = "weight_scale_inv" if kind == "block" else "weight_scale"
    for name, t in tensors.items():
        if _quantized(name, t):
            q, s, deq = quantize(t, kind, sdtype, quant.get("weight_block_size"), quant.get("scale_fmt") == "ue8m0")
            out[name], out[name.removesuffix("weight") + suffix], plain[name] = q, s, deq
            if kind == "tensor":
                out[name.removesuffix("weight") + "input_scale"] = torch.tensor(0.25)
        else:
            out[name] = t if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
            plain[name] = out[name].float()
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    for d, tensors_, extra in ((dst, out, dict(quantization_config=quant, dtype="bfloat16", model_type=model_type)),
                               (ref, plain, dict(dtype="float32"))):
        os.makedirs(d)
        save_file(tensors_, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**config, **extra}, f)


@pytest.fixture(scope="module")
def fp8_dirs(tmp_path_factory):
    """name -> (FP8 directory, dequantized fp32 directory); kimi_k2: the DeepSeek FP8 as Kimi-K2."""
    base = tmp_path_factory.mktemp("fp8")
    dirs = {}
    for name, (model_type, overrides, quant, kind, sdtype) in MODELS.items():
        src = str(base / f"src_{name}")
        tiny_hf_model(tiny_config(model_type, num_hidden_layers=2, **overrides)).save_pretrained(src)
        dirs[name] = (str(base / f"fp8_{name}"), str(base / f"ref_{name}"))
        write_fp8(src, *dirs[name], model_type, quant, kind, sdtype)
    src = str(base / "src_deepseek_v3")
    write_fp8(src, str(base / "fp8_kimi"), str(base / "ref_kimi"), "kimi_k2", MODELS["deepseek_v3"][2], "block",
              torch.float32)
    for side in ("tiktoken.model", "tokenization_kimi.py"):
        (base / "fp8_kimi" / side).write_text(f"# {side}\n")
    dirs["kimi_k2"] = (str(base / "fp8_kimi"), dirs["deepseek_v3"][1])
    return base, dirs


def test_converted_fp8_equals_the_independent_dequantization(fp8_dirs, tmp_path):
    from mcore_rl.conversion.convert_input import resolve_dtype

    base, dirs = fp8_dirs
    bf16 = ("deepseek_v3", "qwen3_moe")
    for name in bf16:  # the default for an FP8 model: its other weights' dtype, no warning
        assert resolve_dtype(dirs[name][0]) == ("bf16", None), name
    jobs = [(fp8, str(tmp_path / f"{n}_fp32")) for n, (fp8, _) in dirs.items()]
    jobs += [(dirs[n][1], str(tmp_path / f"{n}_ref_fp32")) for n in MODELS]
    jobs += [(dirs[n][0], str(tmp_path / f"{n}_bf16")) for n in bf16]  # dtype None: the default
    jobs += [(dirs[n][1], str(tmp_path / f"{n}_ref_bf16")) for n in bf16]  # --dtype bf16 of fp32 values
    run_ranks(1, _convert_fp8, jobs)
    ep2 = str(tmp_path / "deepseek_v3_ep2")
    run_ranks(2, _convert_fp8, [(dirs["deepseek_v3"][0], ep2)], dict(ep=2))
    pairs = [(f"{n}_fp32", f"{n}_ref_fp32") for n in MODELS] + [("kimi_k2_fp32", "deepseek_v3_ref_fp32")]
    pairs += [(f"{n}_bf16", f"{n}_ref_bf16") for n in bf16] + [("deepseek_v3_ep2", "deepseek_v3_ref_fp32")]
    raw = run_ranks(1, _raw_tensors, [str(tmp_path / d) for pair in pairs for d in pair])[0]
    for i, (got_name, want_name) in enumerate(pairs):
        got, want = raw[2 * i], raw[2 * i + 1]
        assert set(got) == set(want), got_name
        for key in want:
            assert got[key].dtype == want[key].dtype, (got_name, key, got[key].dtype, want[key].dtype)
            assert torch.equal(got[key], want[key]), f"{got_name}: {key} differs from the dequantization"
    ds_bf16 = raw[2 * pairs.index(("deepseek_v3_bf16", "deepseek_v3_ref_bf16"))]
    bias = [k for k in ds_bf16 if k.endswith("router.expert_bias")]  # F32 in the checkpoint: kept fp32
    assert bias and all(ds_bf16[k].dtype == torch.float32 for k in bias), bias
    assert ds_bf16["embedding.word_embeddings.weight"].dtype == torch.bfloat16
    kimi_hf = tmp_path / "kimi_k2_fp32" / "huggingface"
    assert sorted(os.listdir(kimi_hf)) == ["config.json", "tiktoken.model", "tokenization_kimi.py"]


def _convert_fp8(jobs: list[tuple[str, str]], split: dict | None = None) -> None:
    """``tests.test_convert._convert_all`` with the default dtype for outputs named *_bf16 of FP8."""
    from mcore_rl.conversion.convert import ConvertOptions, convert

    for hf, dst in jobs:
        dtype = "bf16" if dst.endswith("ref_bf16") else None if dst.endswith("bf16") else "fp32"
        summary = convert(ConvertOptions(hf, dst, dtype=dtype, **(split or {})), progress=False)
        assert summary.dtype == ("bf16" if dst.endswith("bf16") else "fp32"), (dst, summary.dtype)
        assert summary.peak_live_params == 1  # streamed: one parameter (one expert) at a time


@pytest.mark.parametrize("world, layout", [(1, {}), (2, dict(ep=2))])
def test_load_hf_of_fp8_gives_transformers_logits_of_the_dequantized_model(fp8_dirs, world, layout):
    from transformers import AutoModelForCausalLM

    _, dirs = fp8_dirs
    batch = padded_batch(200)
    names = [n for n in MODELS if world == 1 or n != "qwen3_tensor"]  # EP: the MoE models
    outputs = run_ranks(world, outputs_of_models, {n: dirs[n][0] for n in names}, layout, "actor", batch)[0]
    real = batch["attention_mask"].bool()
    for name in names:
        hf = AutoModelForCausalLM.from_pretrained(dirs[name][1], dtype=torch.float32, attn_implementation="eager")
        with torch.no_grad():
            ref = hf.eval()(**batch).logits
        diff = (outputs[name][..., :200] - ref)[real].abs().max().item()
        assert diff <= 1e-4, f"{name} at {layout}: logits differ from transformers by {diff:.3g}"


# ---- refusals: from the headers, before any tensor is read --------------------------------------
def _small(tmp_path, tensors: dict, quant: dict | None, model_type: str = "llama") -> str:
    d = tmp_path / "hf"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    with open(d / "config.json", "w") as f:
        json.dump({"model_type": model_type, **({"quantization_config": quant} if quant else {})}, f)
    return str(d)


BLOCK = dict(BLOCK_FP8, weight_block_size=[8, 16])
_Q, _S, _DEQ = quantize(torch.randn(20, 50), "block", torch.float32, (8, 16))  # scale [3, 4]
REFUSED = {  # name -> (tensors, quantization_config, what the error names)
    "scale_dropped": ({"a.weight": _Q}, BLOCK, "FP8 tensor 'a.weight' has no scale 'a.weight_scale_inv'"),
    "scale_transposed": ({"a.weight": _Q, "a.weight_scale_inv": _S.T.contiguous()}, BLOCK,
                         r"scale 'a.weight_scale_inv' has shape \[4, 3\], its FP8 weight 'a.weight' \[20, 50\]"),
    "scale_per_channel_for_blocks": ({"a.weight": _Q, "a.weight_scale_inv": torch.ones(20, 1)}, BLOCK,
                                     r"needs one of \[\[3, 4\]\]"),
    "scale_int": ({"a.weight": _Q, "a.weight_scale_inv": torch.ones(3, 4, dtype=torch.int32)}, BLOCK,
                  "scale 'a.weight_scale_inv' is stored as I32"),
    "no_config": ({"a.weight": _Q, "a.weight_scale_inv": _S}, None, "no quantization_config"),
    "orphan_scale": ({"a.weight": _DEQ.bfloat16(), "a.weight_scale_inv": _S}, BLOCK,
                     "scale 'a.weight_scale_inv' belongs to no FP8 weight .'a.weight' is BF16"),
    "e5m2": ({"a.weight": _DEQ.to(torch.float8_e5m2)}, BLOCK, r"stored as \['F8_E5M2'\]"),
    "gptq": ({"a.qweight": torch.zeros(4, 4, dtype=torch.int32)}, dict(quant_method="gptq", bits=4),
             "quant_method='gptq'"),
    "awq": ({"a.qweight": torch.zeros(4, 4, dtype=torch.int32)}, dict(quant_method="awq", bits=4), "'awq'"),
    "bitsandbytes": ({"a.weight": torch.zeros(4, 4, dtype=torch.uint8)},
                     dict(quant_method="bitsandbytes", load_in_4bit=True), "'bitsandbytes'"),
    # issue 39: MXFP4 is imported (tests/test_mxfp4_import.py); a U8 tensor that is not blocks + scales is not a weight
    "mxfp4_u8_weight": ({"a.weight": torch.zeros(4, 4, dtype=torch.uint8)}, dict(quant_method="mxfp4"),
                        "tensor 'a.weight' is stored as U8, an integer dtype"),
    "int8_compressed_tensors": ({"a.weight": torch.zeros(4, 4, dtype=torch.int8)}, dict(
        GLM_CT, config_groups={"group_0": {"weights": dict(num_bits=8, type="int", strategy="channel")}}),
        "type='int', num_bits=8"),
    "fp8_e5m2_fmt": ({"a.weight": _Q}, dict(BLOCK, fmt="e5m2"), "fmt='e5m2'"),
    "ct_group_strategy": ({"a.weight": _Q}, dict(GLM_CT, config_groups={"g": {"weights": dict(
        num_bits=8, type="float", strategy="group", group_size=16)}}), "weight strategy 'group'"),
    # issue #37 item 12: an integer or bool dtype where the model expects a float weight, with and
    # without FP8 beside it; an FP8 payload is legal only beside its scale (scale_dropped above)
    "int_in_float_slot": ({"model.norm.weight": torch.ones(50, dtype=torch.int32)}, None,
                          r"tensor 'model.norm.weight' is stored as I32, an integer dtype, where the model expects a "
                          "float weight"),
    "int_beside_fp8": ({"a.weight": _Q, "a.weight_scale_inv": _S, "model.norm.weight": torch.ones(50, dtype=torch.int64),
                        "b.bias": torch.zeros(3, dtype=torch.bool)}, BLOCK,
                       r"tensor 'b.bias' is stored as BOOL \(and 1 more: \['model.norm.weight'\]\), an integer dtype"),
    "uint8_in_float_slot": ({"model.embed_tokens.weight": torch.ones(4, 4, dtype=torch.uint8)}, None,
                            "'model.embed_tokens.weight' is stored as U8"),
    "e8m0_scale_under_fp8": ({"a.weight": _Q, "a.weight_scale_inv": torch.full(
        (3, 4), 255, dtype=torch.uint8).view(torch.float8_e8m0fnu)}, BLOCK, r"stored as \['F8_E8M0'\]"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refused_by_the_reader_and_the_converter_preflight(case, tmp_path):
    from mcore_rl.conversion.convert_input import check_input, resolve_dtype

    tensors, quant, match = REFUSED[case]
    d = _small(tmp_path, tensors, quant)
    for check in (SafetensorsReader, check_input, resolve_dtype):
        with pytest.raises(QuantizationError, match=match):
            check(d)


_W = torch.randn(20, 50, generator=torch.Generator().manual_seed(5))
_W[:8, :16] = 0.0  # block [0, 0] all zero: a zero scale there is legal
_QB, _SB, _DB = quantize(_W, "block", torch.float32, (8, 16))
_QC, _SC, _DC = quantize(_W, "channel", torch.bfloat16)
_QT, _ST, _DT = quantize(_W, "tensor", torch.float16)
SCHEMES = {  # name -> (weight, scale, dequantized, config, where element [13, 40] is, index of its scale)
    "block": (_QB, _SB, _DB, BLOCK, r"\[13, 40\] in block \[1, 2\]", (1, 2)),
    "channel": (_QC, _SC, _DC, GLM_CT, r"\[13, 40\]", (13, 0)),
    "tensor": (_QT, _ST, _DT, dict(quant_method="fp8", activation_scheme="static"), r"\[13, 40\]", ()),
}
_SCALES = r"1 scale\(s\) NaN, inf or negative, the first {} scales {}; a scale is finite and >= 0"
_WHAT = {"block": r"block \[1, 2\] \(rows 8\.\., cols 32\.\.\)", "channel": "row 13", "tensor": "the whole tensor"}
DAMAGED = {  # issue #37 item 5: name -> (edit of (q, scale), what the error says; {at}: the element, {what}: scale's)
    "scale_nan": (lambda q, s, i: s.__setitem__(i, float("nan")), _SCALES.format("nan", "{what}")),
    "scale_inf": (lambda q, s, i: s.__setitem__(i, float("inf")), _SCALES.format("inf", "{what}")),
    "scale_negative": (lambda q, s, i: s.__setitem__(i, -0.5), _SCALES.format("-0.5", "{what}")),
    "scale_zero_on_nonzero": (lambda q, s, i: s.__setitem__(i, 0.0),
                              r"non-zero FP8 value\(s\) have a zero scale .* the first at \[\d+, \d+\]"),
    "scale_overflow": (lambda q, s, i: s.__setitem__(i, 6e4 if s.dtype == torch.float16 else 1e37),
                       r"times its scale .* overflows float32: the scale is damaged|beyond float16's range"),
    "payload_nan": (lambda q, s, i: q.view(torch.uint8).__setitem__((13, 40), 0xFF),
                    r"1 FP8 value\(s\) are NaN encodings \(0x7F/0xFF\), the first at {at}"),
}


@pytest.mark.parametrize("damage", DAMAGED)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_damaged_scales_and_fp8_values_are_refused_naming_the_block(damage, scheme, tmp_path):
    """A NaN, inf, negative, zero (on non-zero values) or overflowing scale, or a NaN encoding
    among the FP8 values, is a QuantizationError naming the tensor and the block (or row), not
    NaN/inf/sign-flipped/zeroed weights (undamaged: test_reader_dequantizes_exactly_when_fp8_has_a_scale)."""
    from mcore_rl.mapping.casts import CastOverflowError

    q, scale, _, quant, at, index = SCHEMES[scheme]
    edit, says = DAMAGED[damage]
    q, scale = q.clone(), scale.clone()
    if damage == "scale_overflow":  # 448 x 1e37 leaves float32; an F16 scale (at most 65504): 448 x 6e4 leaves fp16
        q.view(torch.uint8)[13, 40] = 0x7E
    edit(q, scale, index)
    d = _small(tmp_path, {"a.weight": q, "a.weight_scale" + ("_inv" if scheme == "block" else ""): scale}, quant)
    reader = SafetensorsReader(d, dequant_dtype=torch.float32 if scale.dtype != torch.float16 else torch.float16)
    with pytest.raises((QuantizationError, CastOverflowError), match=r"'a.weight': .*" + says.format(
            at=at, what=_WHAT[scheme])):
        reader["a.weight"]


def test_zero_scale_of_an_all_zero_block_is_legal_and_fp16_overflow_is_refused(tmp_path):
    """A zero scale of an all-zero block reads as that block's zeros; a product beyond fp16's
    +-65504 read as fp16 is refused naming the tensor, the value and the fix (bf16/fp32)."""
    from mcore_rl.mapping.casts import CastOverflowError

    scale = _SB.clone()
    scale[0, 0] = 0.0
    d = _small(tmp_path, {"a.weight": _QB, "a.weight_scale_inv": scale}, BLOCK)
    assert torch.equal(SafetensorsReader(d)["a.weight"], _DB)
    scale[1, 2] = 1000.0  # 1000 x the block's FP8 values (up to 448): beyond 65504
    (tmp_path / "big").mkdir()
    d = _small(tmp_path / "big", {"a.weight": _QB, "a.weight_scale_inv": scale}, BLOCK)
    assert bool(torch.isfinite(SafetensorsReader(d, dequant_dtype=torch.bfloat16)["a.weight"]).all())
    with pytest.raises(CastOverflowError, match=r"'a.weight': \d+ value\(s\) beyond float16's range \+-65504, the "
                                                r"first .* at \[\d+, \d+\], would be written as inf; read it in bf16 or fp32"):
        SafetensorsReader(d, dequant_dtype=torch.float16)["a.weight"]


def test_reader_dequantizes_exactly_when_fp8_has_a_scale(tmp_path):
    """Per block, per channel ([R, 1] and [R]), per tensor; rounded once to the dtype asked for;
    scales and activation scales hidden; other tensors in their own dtype; never the raw values."""
    w = torch.randn(20, 50)
    qc, sc, deq_c = quantize(w, "channel", torch.float16)
    qt, st, deq_t = quantize(w, "tensor", torch.bfloat16)
    cases = [({"a.weight": _Q, "a.weight_scale_inv": _S}, BLOCK, _DEQ),
             ({"a.weight": qc, "a.weight_scale": sc}, GLM_CT, deq_c),
             ({"a.weight": qc, "a.weight_scale": sc.reshape(20)}, GLM_CT, deq_c),
             ({"a.weight": qt, "a.weight_scale": st, "a.input_scale": torch.tensor(1.0)},
              dict(quant_method="fp8", activation_scheme="static"), deq_t)]
    for i, (tensors, quant, want) in enumerate(cases):
        tensors = {**tensors, "b.bias": torch.randn(3, dtype=torch.float64)}
        (tmp_path / str(i)).mkdir()
        d = _small(tmp_path / str(i), tensors, quant)
        for dtype in (torch.float32, torch.bfloat16):
            reader = SafetensorsReader(d, dequant_dtype=dtype)
            assert sorted(reader) == ["a.weight", "b.bias"] and "a.weight_scale" not in reader, (i, list(reader))
            got = reader["a.weight"]
            assert got.dtype == dtype and torch.equal(got, want.to(dtype)), (i, dtype)
            assert not torch.equal(got.float(), tensors["a.weight"].float())  # not the raw FP8 values
            assert reader["b.bias"].dtype == torch.float64


def test_tokenizer_code_linked_out_of_the_directory_is_refused(tmp_path):
    from mcore_rl.fileio.files import hf_side_files
    from mcore_rl.fileio.paths import UnsafePathError

    outside = tmp_path / "evil.py"
    outside.write_text("import os\n")
    d = _small(tmp_path, {"a.weight": torch.ones(2, 2)}, None)
    (tmp_path / "hf" / "tiktoken.model").write_text("x")
    assert [n for n, _ in hf_side_files(d)] == ["config.json", "tiktoken.model"]
    os.symlink(outside, tmp_path / "hf" / "tokenization_kimi.py")
    with pytest.raises(UnsafePathError, match="tokenization_kimi.py"):
        hf_side_files(d)


def test_cli_refuses_in_one_line_and_tests_fp8_against_its_dequantized_model(fp8_dirs, tmp_path):
    """hf_to_mcore.py: another method is one ``error:`` line naming it; a NaN scale found while
    converting (exit 0 with NaN weights before issue #37) is one line naming tensor and block,
    nothing written; ``--test`` of an FP8 input (refused before issue #37) compares with
    transformers' model of its dequantized weights and passes."""
    import shutil
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(root, "converters", "hf_to_mcore.py")
    gptq = _small(tmp_path, {"a.qweight": torch.zeros(4, 4, dtype=torch.int32)}, dict(quant_method="gptq"))
    fp8 = fp8_dirs[1]["qwen3_moe"][0]
    damaged = shutil.copytree(fp8, tmp_path / "damaged")
    tensors = load_file(os.path.join(fp8, "model.safetensors"))
    scale = "model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"
    tensors[scale][0, 1] = float("nan")
    save_file(tensors, str(damaged / "model.safetensors"), metadata={"format": "pt"})
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    runs = {name: subprocess.Popen([sys.executable, script, "--hf_model_path", src, "--output_path",
                                    str(tmp_path / f"out_{name}"), *extra], env=env, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
            for name, src, extra in (("gptq", gptq, []), ("damaged", str(damaged), []), ("test", fp8, ["--test"]))}
    said = {name: proc.communicate(timeout=600) + (proc.returncode,) for name, proc in runs.items()}
    for name, text in (("gptq", "quant_method='gptq'"),
                       ("damaged", "'model.layers.1.mlp.experts.2.down_proj.weight': 1 scale(s) NaN, inf or negative, "
                                   "the first nan scales block [0, 1] (rows 0.., cols 24..)")):
        out, err, code = said[name]
        assert code == 2 and text in err and not os.path.exists(tmp_path / f"out_{name}"), err[-2000:]
        assert len([line for line in err.splitlines() if line.startswith("error:")]) == 1, err
    out, err, code = said["test"]
    assert code == 0 and "PASS" in out, out[-2000:] + err[-2000:]


def test_kimi_k2_shaped_config_reads_as_deepseek_v3(tmp_path):
    """The fields of Kimi-K2-Instruct's config.json (model_type kimi_k2, YaRN under the old key
    ``type``, 384 experts, one group; written here from the published file's fields, not
    downloaded) give DeepSeek-V3's ModelArgs."""
    from mcore_rl.models.hf_config import model_args_from_hf

    config = dict(architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", hidden_size=7168,
                  intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=64,
                  num_key_value_heads=64, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8,
                  first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.827, norm_topk_prob=True,
                  scoring_func="sigmoid", topk_method="noaux_tc", q_lora_rank=1536, kv_lora_rank=512,
                  qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, vocab_size=163840,
                  max_position_embeddings=131072, rope_theta=50000.0, num_nextn_predict_layers=0,
                  rope_scaling=dict(type="yarn", factor=32.0, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                                    mscale_all_dim=1.0, original_max_position_embeddings=4096),
                  quantization_config=dict(BLOCK_FP8, weight_block_size=[128, 128]), torch_dtype="bfloat16")
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    args = model_args_from_hf(str(tmp_path))
    assert args.arch.model_type == "deepseek_v3" and args.moe.num_experts == 384
    assert args.mla.q_lora_rank == 1536 and args.rope.rope_type == "yarn" and args.rope.factor == 32.0
