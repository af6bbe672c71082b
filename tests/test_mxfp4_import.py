"""MXFP4 import (issue 39): ``X_blocks`` + ``X_scales`` read as ``X`` by the streaming reader.

The bytes are written by this file's own packing of the published layout (``pack``: exponent
``ceil(log2(amax / 6))``, nearest table entry, low nibble first, then the ``[*lead, rows,
cols/32, 16]`` layout) and read back by its own unpacking (``unpack``), which is cross-checked
against transformers' ``convert_moe_packed_tensors`` on the same bytes. The reader (keys, shapes,
stored dtypes, ``read_part``, index files with blocks and scales in different shards) and the
converter (a tiny gpt-oss whose experts are MXFP4, the published ``modules_to_not_convert``
honoured: fp32 bit for bit, the bf16 default one rounding) equal that unpacking. Hostile headers
are refused by the reader, the preflight and the CLI (one ``error:`` line, exit 2, nothing
written): header cases all in one process, in seconds; a 0xFF scale and blocks for a name the
model lacks through the real command line."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mcore_rl.mapping.fp8_dequant import QuantizationError
from mcore_rl.mapping.hf_io import SafetensorsReader
from tests.dist import run_ranks
from tests.test_convert import _raw_tensors
from tests.tiny import tiny_config, tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TABLE = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                     dtype=torch.float64)
GPT_OSS_KEEP = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
MXFP4 = dict(quant_method="mxfp4", modules_to_not_convert=GPT_OSS_KEEP)


def pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF parameter ``w`` [*lead, cols, rows] as (blocks [*lead, rows, cols/32, 16], scales)."""
    t = w.double().transpose(-1, -2)
    groups = t.reshape(*t.shape[:-1], t.shape[-1] // 32, 32)
    amax = groups.abs().amax(-1)
    e = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6)), torch.tensor(-127.0, dtype=torch.float64))
    e = e.clamp(-127, 127)
    codes = ((groups / torch.exp2(e)[..., None])[..., None] - TABLE).abs().argmin(-1).to(torch.uint8)
    pairs = codes.reshape(*codes.shape[:-1], 16, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4), (e + 127).to(torch.uint8)


def unpack(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float64 [*lead, cols, rows] of the published layout (exact: 2 significant bits x 2^k)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], 32).long()
    values = TABLE[codes] * torch.exp2(scales.double() - 127)[..., None]
    return values.reshape(*scales.shape[:-1], -1).transpose(-1, -2)


def _write(d, tensors: dict, quant: dict | None, model_type: str = "llama", config: dict | None = None) -> str:
    os.makedirs(d)
    save_file(tensors, os.path.join(d, "model.safetensors"), metadata={"format": "pt"})
    extra = {"quantization_config": quant} if quant is not None else {}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({**(config or {"model_type": model_type}), **extra}, f)
    return str(d)


_G = torch.Generator().manual_seed(7)
_W = torch.randn(3, 64, 20, generator=_G) * torch.tensor([1e-3, 1.0, 50.0]).view(3, 1, 1)  # 3 experts, cols 64
_B, _S = pack(_W)  # [3, 20, 2, 16], [3, 20, 2]
_X = "model.layers.0.mlp.experts.gate_up_proj"


def test_test_layout_agrees_with_transformers_on_the_same_bytes():
    """This file's unpacking = transformers' own dequantization (fp32, bf16) of the same bytes,
    also of random bytes beyond what ``pack`` writes (every code, scales 60..190)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rb = torch.randint(0, 256, (2, 5, 3, 16), dtype=torch.uint8, generator=_G)
    rs = torch.randint(60, 190, (2, 5, 3), dtype=torch.uint8, generator=_G)
    for blocks, scales in ((_B, _S), (rb, rs)):
        for dtype in (torch.float32, torch.bfloat16):
            ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
            assert torch.equal(ref, unpack(blocks, scales).to(dtype))
    assert (unpack(_B, _S) - _W.double()).abs().max() <= _W.abs().max() / 4  # the packing is a quantization of _W


def test_reader_presents_mxfp4_parameters_dequantized(tmp_path):
    """Two shards with an index (blocks in one, scales in the other): the parameter in its blocks'
    place among the keys, blocks and scales hidden, its shape and stored dtype "MXFP4", values of
    the test's unpacking in fp32 and rounded once in bf16, ``read_part`` one expert."""
    bias = torch.randn(3, 64, generator=_G).bfloat16()
    d = tmp_path / "hf"
    d.mkdir()
    save_file({_X + "_blocks": _B, "model.norm.weight": torch.ones(4)}, str(d / "a.safetensors"))
    save_file({_X + "_scales": _S, _X + "_bias": bias}, str(d / "b.safetensors"))
    names = {_X + "_blocks": "a.safetensors", "model.norm.weight": "a.safetensors", _X + "_scales": "b.safetensors",
             _X + "_bias": "b.safetensors"}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    (d / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "quantization_config": MXFP4}))
    want = unpack(_B, _S)
    for dtype in (torch.float32, torch.bfloat16):
        reader = SafetensorsReader(str(d), dequant_dtype=dtype)
        assert list(reader) == [_X, "model.norm.weight", _X + "_bias"] and reader.quantized
        assert _X in reader and _X + "_blocks" not in reader and _X + "_scales" not in reader
        with pytest.raises(KeyError):
            reader[_X + "_blocks"]
        assert reader.shapes[_X] == (3, 64, 20) and reader.stored_dtypes == {
            _X: "MXFP4", "model.norm.weight": "F32", _X + "_bias": "BF16"}
        got = reader[_X]
        assert got.dtype == dtype and torch.equal(got, want.to(dtype))
        assert torch.equal(reader.read_part(_X, 2), want[2].to(dtype))
        assert torch.equal(reader[_X + "_bias"], bias) and reader["model.norm.weight"].dtype == torch.float32
    plain = _write(tmp_path / "plain", {"w": torch.ones(2)}, None)
    assert not SafetensorsReader(plain).quantized and SafetensorsReader(plain).stored_dtypes == {"w": "F32"}


_U8 = torch.uint8
HOSTILE = {  # name -> (tensors, quantization_config, what the one error line says)
    "blocks_f32": ({_X + "_blocks": _B.float(), _X + "_scales": _S}, MXFP4,
                   f"MXFP4 tensor '{_X}_blocks' is stored as F32; blocks and scales are U8"),
    "scales_bf16": ({_X + "_blocks": _B, _X + "_scales": _S.bfloat16()}, MXFP4,
                    f"MXFP4 tensor '{_X}_scales' is stored as BF16"),
    "blocks_8_bytes": ({_X + "_blocks": _B[..., :8].contiguous(), _X + "_scales": _S}, MXFP4,
                       f"MXFP4 blocks '{_X}_blocks' [3, 20, 2, 8] and scales '{_X}_scales' [3, 20, 2] do not fit"),
    "scales_other_groups": ({_X + "_blocks": _B, _X + "_scales": torch.zeros(3, 20, 3, dtype=_U8)}, MXFP4,
                            "[3, 20, 2, 16] and scales"),
    "scales_transposed": ({_X + "_blocks": _B, _X + "_scales": _S.transpose(1, 2).contiguous()}, MXFP4,
                          f"scales '{_X}_scales' [3, 2, 20] do not fit"),
    "blocks_2d": ({_X + "_blocks": _B[0, 0], _X + "_scales": _S[0, 0]}, MXFP4, "[2, 16] and scales"),
    "scales_missing": ({_X + "_blocks": _B}, MXFP4, f"MXFP4 blocks '{_X}_blocks' without its scales '{_X}_scales'"),
    "blocks_missing": ({_X + "_scales": _S}, MXFP4, f"MXFP4 scales '{_X}_scales' without its blocks '{_X}_blocks'"),
    "not_convert_lies": ({_X + "_blocks": _B, _X + "_scales": _S}, dict(MXFP4, modules_to_not_convert=[
        *GPT_OSS_KEEP, "model.layers.*.mlp.experts"]), f"'{_X}' is stored as MXFP4 blocks '{_X}_blocks', but "
        "quantization_config.modules_to_not_convert lists it ('model.layers.*.mlp.experts')"),
    "not_convert_suffix_lies": ({_X + "_blocks": _B, _X + "_scales": _S}, dict(MXFP4, modules_to_not_convert=[
        "experts"]), "modules_to_not_convert lists it ('experts')"),
    "not_convert_not_a_list": ({_X + "_blocks": _B, _X + "_scales": _S}, dict(MXFP4, modules_to_not_convert="lm_head"),
                               "modules_to_not_convert='lm_head' is not a list of module names"),
    "not_convert_bad_regex": ({_X + "_blocks": _B, _X + "_scales": _S}, dict(MXFP4, modules_to_not_convert=["a.[b"]),
                              "modules_to_not_convert entry 'a.[b' is not a valid pattern"),
    "plain_and_blocks": ({_X: _W, _X + "_blocks": _B, _X + "_scales": _S}, MXFP4,
                         f"'{_X}' is stored both as a tensor and as MXFP4 blocks"),
    "no_config": ({_X + "_blocks": _B, _X + "_scales": _S}, None,
                  "tensors stored as MXFP4 blocks (['model.layers.0.mlp.experts.gate_up_proj_blocks']) but config.json "
                  "has no quantization_config saying quant_method 'mxfp4'"),
    "u8_weight_under_mxfp4": ({_X + "_blocks": _B, _X + "_scales": _S, "model.norm.weight": torch.ones(4, dtype=_U8)},
                              MXFP4, "tensor 'model.norm.weight' is stored as U8, an integer dtype"),
    "gptq_still_refused": ({_X + "_blocks": _B, _X + "_scales": _S}, dict(quant_method="gptq"),
                           "quant_method='gptq'"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_headers_are_refused_by_the_reader_and_the_preflight(case, tmp_path):
    from mcore_rl.conversion.convert_input import check_input, resolve_dtype

    tensors, quant, says = HOSTILE[case]
    d = _write(tmp_path / "hf", tensors, quant)
    for check in (SafetensorsReader, check_input, resolve_dtype):
        with pytest.raises(QuantizationError) as e:
            check(d)
        assert says in str(e.value), (case, check.__name__, str(e.value))


_DRIVER = r"""
import contextlib, io, json, sys
sys.path.insert(0, sys.argv[1])
from hf_to_mcore import main
said = {}
for case, src, dst in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        said[case] = [main(["--hf_model_path", src, "--output_path", dst]), err.getvalue()]
print(json.dumps(said))
"""


def _one_line(code: int, err: str, says: str, out: str) -> None:
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and says in err, (code, err[-3000:])
    assert not os.path.exists(out), out


def test_cli_refuses_hostile_headers_in_one_line(tmp_path):
    """Every HOSTILE case through hf_to_mcore.py's main, one process for all: exit 2, one
    ``error:`` line naming the tensor, no traceback, no output directory."""
    cases = [(c, _write(tmp_path / c, t, q), str(tmp_path / f"out_{c}")) for c, (t, q, _) in HOSTILE.items()]
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _DRIVER, os.path.join(ROOT, "converters"), json.dumps(cases)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    said = json.loads(run.stdout.strip().splitlines()[-1])
    for case, _, out in cases:
        _one_line(*said[case], HOSTILE[case][2], out)


# ---- a tiny gpt-oss quantized by this file, converted and run ---------------------------------------
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _mxfp4_gpt_oss(src: str, dst: str, ref: str) -> None:
    """``dst``: ``src``'s expert weights as MXFP4 (as published: their biases, attention, sinks,
    router, embeddings and lm_head bf16); ``ref``: its values in fp32, an unquantized gpt-oss."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, plain = {}, {}
    for name, t in tensors.items():
        if name.endswith(EXPERTS):  # gate_up_proj [E, H, 2I], down_proj [E, I, H]: [*lead, cols, rows]
            out[name + "_blocks"], out[name + "_scales"] = pack(t)
            plain[name] = unpack(out[name + "_blocks"], out[name + "_scales"]).float().contiguous()
        else:
            out[name] = t.bfloat16()
            plain[name] = out[name].float()
    config = json.load(open(os.path.join(src, "config.json")))
    _write(dst, out, MXFP4, config=dict(config, dtype="bfloat16"))
    _write(ref, plain, None, config=dict(config, dtype="float32"))


def _convert_and_run(jobs: list[tuple[str, str, str | None]], outs: list[str], model: str, batch: dict) -> tuple:
    """One world: each (hf, out, dtype) converted; the dist_ckpt tensors of ``outs``; the logits
    of ``model`` loaded by load_hf (its MXFP4 read by the reader)."""
    from mcore_rl.conversion.convert import ConvertOptions, convert
    from tests.steps import outputs_of_models

    from megatron.core import parallel_state

    summaries = [convert(ConvertOptions(hf, dst, dtype=dtype), progress=False) for hf, dst, dtype in jobs]
    assert all(s.peak_live_params == 1 for s in summaries)  # streamed: one expert at a time
    written = [s.dtype for s in summaries]
    parallel_state.destroy_model_parallel()  # the conversions' groups
    return written, _raw_tensors(outs), outputs_of_models({"mx": model}, {}, "actor", batch)["mx"]


def _start_cli(hf: str, out: str, *extra: str) -> subprocess.Popen:
    script = os.path.join(ROOT, "converters", "hf_to_mcore.py")
    return subprocess.Popen([sys.executable, script, "--hf_model_path", hf, "--output_path", out, *extra],
                            env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_gpt_oss_in_mxfp4_converts_to_the_test_dequantization_and_transformers_logits(tmp_path):
    """A tiny gpt-oss (both layer types, window active, 4 experts) whose experts this file packs:
    the converter's fp32 weights equal the test's unpacking bit for bit, its default (bf16, the
    other weights' dtype) the one rounding of it; mcore_rl.json records the expert tensors as
    MXFP4; load_hf of the MXFP4 directory gives transformers' logits of the unpacked directory
    within 1e-4; ``hf_to_mcore.py --test`` of it passes. The command line refuses a 0xFF scale
    (naming tensor and block) and blocks for a name the model lacks, one line each, nothing
    written."""
    from transformers import AutoModelForCausalLM

    from mcore_rl.conversion.convert_input import resolve_dtype
    from tests.tiny import padded_batch

    src, mx, ref = (str(tmp_path / n) for n in ("src", "mx", "ref"))
    tiny_hf_model(tiny_config("gpt_oss", num_hidden_layers=2, intermediate_size=64)).save_pretrained(src)
    _mxfp4_gpt_oss(src, mx, ref)
    assert resolve_dtype(mx) == ("bf16", None)
    down = "model.layers.1.mlp.experts.down_proj"
    bad = {"nan_scale": (f"'{down}': scale byte 0xFF (NaN in E8M0) of block [2, 40, 1] (the weight's [2, 32:64, 40])"),
           "unknown": "HF tensors with no row in the gpt_oss mapping table: ['model.layers.1.mlp.experts.extra_proj']"}
    procs = {}
    for case in bad:
        tensors = load_file(os.path.join(mx, "model.safetensors"))
        if case == "nan_scale":
            tensors[down + "_scales"][2, 40, 1] = 0xFF
        else:
            extra = "model.layers.1.mlp.experts.extra_proj"
            for part in ("_blocks", "_scales"):
                tensors[extra + part] = tensors[down + part].clone()
        _write(tmp_path / case, tensors, MXFP4, config=json.load(open(os.path.join(mx, "config.json"))))
        procs[case] = _start_cli(str(tmp_path / case), str(tmp_path / f"out_{case}"))
    checked = _start_cli(mx, str(tmp_path / "out_test"), "--dtype", "fp32", "--test")
    outs = [str(tmp_path / n) for n in ("mx_fp32", "mx_bf16", "ref_fp32")]
    batch = padded_batch(200)
    written, (got32, got16, want), logits = run_ranks(1, _convert_and_run, [
        (mx, outs[0], "fp32"), (mx, outs[1], None), (ref, outs[2], "fp32")], outs, mx, batch)[0]
    assert written == ["fp32", "bf16", "fp32"] and set(got32) == set(want) == set(got16)
    for key, w in want.items():
        assert got32[key].dtype == torch.float32 and torch.equal(got32[key], w), key
        assert got16[key].dtype == torch.bfloat16 and torch.equal(got16[key], w.bfloat16()), key
    stored = json.load(open(os.path.join(outs[0], "mcore_rl.json")))["hf_stored_dtypes"]
    assert {k for k, v in stored.items() if v == "MXFP4"} == {f"model.layers.{i}.{e}" for i in (0, 1) for e in EXPERTS}
    assert stored["model.layers.0.mlp.experts.down_proj_bias"] == "BF16"
    hf = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        expected = hf.eval()(**batch).logits
    real = batch["attention_mask"].bool()
    diff = (logits[..., :expected.shape[-1]] - expected)[real].abs().max().item()
    assert diff <= 1e-4, f"logits differ from transformers' on the dequantized directory by {diff:.3g}"
    for case, says in bad.items():
        out, err = procs[case].communicate(timeout=600)
        _one_line(procs[case].returncode, err, says, str(tmp_path / f"out_{case}"))
    out, err = checked.communicate(timeout=600)
    assert checked.returncode == 0 and "PASS" in out, out[-2000:] + err[-2000:]
