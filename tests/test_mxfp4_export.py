"""MXFP4 export (issue #39, export side): ``merge --dtype mxfp4`` and the weight sync's option.

Unit level: which tensors are written as MXFP4 (the converter's record, else the published
rule), the ``quantization_config`` (the published ``modules_to_not_convert``), NaN/inf refused
naming the tensor and the block, a stack quantized in chunks equal to one call.
"""
from __future__ import annotations

import pytest
import torch

L0 = "model.layers.0."
GATE_UP, DOWN = L0 + "mlp.experts.gate_up_proj", L0 + "mlp.experts.down_proj"


def _specs(**shapes):
    from mcore_rl.fileio.safetensors_write import TensorSpec

    return [TensorSpec(n, s, torch.float32) for n, s in shapes.items()]


def test_the_record_picks_the_tensors_else_the_published_rule():
    from mcore_rl.conversion.merge_mxfp4 import MXFP4_STORED, mxfp4_formats, out_specs
    from mcore_rl.errors import CheckpointError

    specs = _specs(**{GATE_UP: (4, 64, 96), DOWN: (4, 48, 64), L0 + "mlp.experts.gate_up_proj_bias": (4, 96),
                      L0 + "self_attn.sinks": (4,), "model.layers.1.mlp.experts.down_proj": (4, 48, 64),
                      "lm_head.weight": (200, 64)})
    # without a record: the experts whose input dim is whole blocks (48 is not: down_proj stays)
    assert [n for n, f in mxfp4_formats(specs, None).items() if f is None] == [GATE_UP]
    assert all(f == torch.bfloat16 for f in mxfp4_formats(specs, None).values() if f is not None)
    stored = {s.name: "BF16" for s in specs} | {GATE_UP: MXFP4_STORED, "lm_head.weight": "F32"}
    formats = mxfp4_formats(specs, stored)
    assert formats[GATE_UP] is None and formats["lm_head.weight"] == torch.float32
    assert formats[L0 + "self_attn.sinks"] == torch.bfloat16
    written = {s.name: (s.shape, s.dtype) for s in out_specs(specs, formats)}
    assert written[GATE_UP + "_blocks"] == ((4, 96, 2, 16), torch.uint8)
    assert written[GATE_UP + "_scales"] == ((4, 96, 2), torch.uint8) and GATE_UP not in written
    with pytest.raises(CheckpointError, match=r"does not record 'model\.layers\.0\.self_attn\.sinks'"):
        mxfp4_formats(specs, {k: v for k, v in stored.items() if not k.endswith("sinks")})
    with pytest.raises(CheckpointError, match=r"records 'model\.layers\.0\.mlp\.experts\.down_proj' as MXFP4, but "
                                              r"its shape \[4, 48, 64\] has no whole blocks of 32"):
        mxfp4_formats(specs, {**stored, DOWN: MXFP4_STORED})
    with pytest.raises(CheckpointError, match=r"dtype 'F8' is not one of"):
        mxfp4_formats(specs, {**stored, DOWN: "F8"})


def test_quantization_config_is_the_published_one_plus_unquantized_experts():
    from mcore_rl.conversion.merge_mxfp4 import quantization_config

    published = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    experts = {f"model.layers.{i}.mlp.experts.{p}": None for i in range(12) for p in ("gate_up_proj", "down_proj")}
    assert quantization_config({**experts, "lm_head.weight": torch.bfloat16}) == \
        {"modules_to_not_convert": published, "quant_method": "mxfp4"}
    plain = {"model.layers.10.mlp.experts.gate_up_proj": torch.bfloat16,
             "model.layers.10.mlp.experts.down_proj": torch.bfloat16,
             "model.layers.2.mlp.experts.down_proj": torch.bfloat16}  # layer 2's gate_up_proj is still MXFP4
    assert quantization_config({**experts, **plain})["modules_to_not_convert"] == \
        published + ["model.layers.10.mlp.experts"]
