"""MXFP4 import (issue 39): ``X_blocks`` + ``X_scales`` read as ``X`` by the streaming reader.

The bytes are written by this file's own packing of the published layout (``pack``: exponent
``ceil(log2(amax / 6))``, nearest table entry, low nibble first, then the ``[*lead, rows,
cols/32, 16]`` layout) and read back by its own unpacking (``unpack``), which is cross-checked
against transformers' ``convert_moe_packed_tensors`` on the same bytes. The reader (keys, shapes,
stored dtypes, ``read_part``, index files with blocks and scales in different shards) and the
converter (a tiny llama whose MLP projections are MXFP4, gpt-oss style ``modules_to_not_convert``
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
            assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=dtype), unpack(blocks, scales).to(dtype))
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


# ---- a tiny llama whose MLP projections are MXFP4 (gpt-oss's own architecture: tests/test_gpt_oss*) ----
def _mxfp4_llama(src: str, dst: str, ref: str, quant: dict) -> None:
    """``dst``: ``src``'s MLP projections as MXFP4, every other tensor bf16; ``ref``: its values in fp32."""
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, plain = {}, {}
    for name, t in tensors.items():
        if ".mlp." in name and name.endswith("_proj.weight"):  # HF [out, in] read as [cols, rows]: out % 32 == 0
            out[name + "_blocks"], out[name + "_scales"] = pack(t)
            plain[name] = unpack(out[name + "_blocks"], out[name + "_scales"]).float().contiguous()
        else:
            out[name] = t.bfloat16()
            plain[name] = out[name].float()
    config = json.load(open(os.path.join(src, "config.json")))
    _write(dst, out, quant, config=dict(config, dtype="bfloat16"))
    _write(ref, plain, None, config=dict(config, dtype="float32"))


def _convert(jobs: list[tuple[str, str, str | None]]) -> list[str]:
    from mcore_rl.conversion.convert import ConvertOptions, convert

    return [convert(ConvertOptions(hf, dst, dtype=dtype), progress=False).dtype for hf, dst, dtype in jobs]


def test_converted_mxfp4_equals_the_test_dequantization(tmp_path):
    """fp32: the converter's weights equal the test's unpacking bit for bit; the default (bf16,
    the other weights' dtype) is its one rounding; mcore_rl.json records the MXFP4 tensors. The
    command line refuses a 0xFF scale (naming tensor and block) and blocks for a name the model
    lacks, in one line each, nothing written."""
    from mcore_rl.conversion.convert_input import resolve_dtype

    src, mx, ref = (str(tmp_path / n) for n in ("src", "mx", "ref"))
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(src)
    _mxfp4_llama(src, mx, ref, MXFP4)
    assert resolve_dtype(mx) == ("bf16", None)
    down = "model.layers.1.mlp.down_proj.weight"
    bad = {"nan_scale": (down + "_scales", (40, 1), 0xFF, f"'{down}': scale byte 0xFF (NaN in E8M0) of block [40, 1] "
                                                       "(the weight's [32:64, 40])"),
           "unknown": ("model.layers.1.mlp.extra_proj.weight", None, None,
                       "HF tensors with no row in the llama mapping table: ['model.layers.1.mlp.extra_proj.weight']")}
    procs = {}
    for case, (name, index, value, _) in bad.items():
        tensors = load_file(os.path.join(mx, "model.safetensors"))
        if index is not None:
            tensors[name][index] = value
        else:
            tensors[name + "_blocks"], tensors[name + "_scales"] = (tensors[down + p].clone() for p in ("_blocks", "_scales"))
        _write(tmp_path / case, tensors, MXFP4, config=json.load(open(os.path.join(mx, "config.json"))))
        procs[case] = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "converters", "hf_to_mcore.py"), "--hf_model_path", str(tmp_path / case),
             "--output_path", str(tmp_path / f"out_{case}")], env={**os.environ, "PYTHONPATH": ROOT,
                                                                    "OMP_NUM_THREADS": "1"},
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = [str(tmp_path / n) for n in ("mx_fp32", "mx_bf16", "ref_fp32")]
    written = run_ranks(1, _convert, [(mx, outs[0], "fp32"), (mx, outs[1], None), (ref, outs[2], "fp32")])[0]
    assert written == ["fp32", "bf16", "fp32"]
    got32, got16, want = run_ranks(1, _raw_tensors, outs)[0]
    assert set(got32) == set(want) == set(got16)
    for key, w in want.items():
        assert got32[key].dtype == torch.float32 and torch.equal(got32[key], w), key
        assert got16[key].dtype == torch.bfloat16 and torch.equal(got16[key], w.bfloat16()), key
    stored = json.load(open(os.path.join(outs[0], "mcore_rl.json")))["hf_stored_dtypes"]
    assert stored[down] == "MXFP4" and stored["model.embed_tokens.weight"] == "BF16" and down + "_blocks" not in stored
    assert sum(v == "MXFP4" for v in stored.values()) == 6  # 3 projections x 2 layers
    for case, (_, _, _, says) in bad.items():
        out, err = procs[case].communicate(timeout=600)
        _one_line(procs[case].returncode, err, says, str(tmp_path / f"out_{case}"))
