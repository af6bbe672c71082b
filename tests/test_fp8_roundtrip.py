"""FP8 round trip (issue 30): a tiny DeepSeek-V3 stored as block FP8 by the exporter's own rule
(``fp8_quant.quantize_block_fp8``; 24x40 blocks, dimensions not block multiples, float32 scales)
with one linear weight left in BF16 (so the source, not ``is_quantized``'s rule, must decide), the
router and norms BF16 and the correction bias F32 -> ``hf_to_mcore --dtype fp32`` -> ``merge
--dtype fp8``: the same FP8 bytes and scales (compared as uint8 views), every other tensor in its
source dtype with its source values, the same tensor names."""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import load_file, save_file

from tests.dist import run_ranks
from tests.test_convert import _convert_all
from tests.tiny import tiny_config, tiny_hf_model

BLOCK = (24, 40)
LEFT_BF16 = "model.layers.1.self_attn.o_proj.weight"  # a linear weight the source did not quantize


def _write_source(src: str, dst: str) -> dict[str, torch.Tensor]:
    from mcore_rl.mapping.fp8_quant import SCALE_SUFFIX, BlockFp8, is_quantized, quantize_block_fp8

    fmt, out = BlockFp8(block=BLOCK), {}
    for name, t in load_file(os.path.join(src, "model.safetensors")).items():
        if name != LEFT_BF16 and is_quantized(name, tuple(t.shape)):
            out[name], out[name + SCALE_SUFFIX] = quantize_block_fp8(t.float(), fmt, name)
        else:
            out[name] = t.float() if name.endswith("e_score_correction_bias") else t.to(torch.bfloat16)
    assert out[LEFT_BF16].dtype == torch.bfloat16 and sum(t.dtype == torch.float8_e4m3fn for t in out.values()) > 10
    os.makedirs(dst)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    config.update(dtype="bfloat16", quantization_config=fmt.quantization_config())
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    return out


def test_fp8_import_then_fp8_merge_gives_back_the_same_bytes_and_dtypes(tmp_path):
    from mcore_rl.conversion.merge import merge
    from mcore_rl.mapping.fp8_quant import BlockFp8

    src, fp8_dir, conv, merged = (str(tmp_path / n) for n in ("src", "fp8", "conv", "merged"))
    tiny_hf_model(tiny_config("deepseek_v3", num_hidden_layers=2)).save_pretrained(src)
    source = _write_source(src, fp8_dir)
    run_ranks(1, _convert_all, [(fp8_dir, conv)])  # fp32: the dequantized products, exactly
    merge(conv, merged, dtype="fp8", fp8=BlockFp8(block=BLOCK))
    out = load_file(os.path.join(merged, "model.safetensors"))
    assert sorted(out) == sorted(source)
    for name, want in source.items():
        got = out[name]
        assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, want.dtype)
        if want.dtype == torch.float8_e4m3fn:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        else:
            assert torch.equal(got, want), name
    with open(os.path.join(merged, "config.json")) as f:
        assert json.load(f)["quantization_config"]["weight_block_size"] == list(BLOCK)
