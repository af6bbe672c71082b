"""MXFP4 codec (issue 39): ``mapping.mxfp4`` against transformers' own dequantization
(``integrations/mxfp4.py``) on the same random bytes, against this file's own slow reading of
the published layout (one byte at a time: low nibble first, ``E2M1[code] * 2^(scale - 127)``,
then transposed), the exporter's rule against a slow scalar quantizer written here, byte round
trips of canonical blocks, value round trips of every other block, and refusals naming the
tensor and the block. Milliseconds: no model, no file."""
from __future__ import annotations

import math

import pytest
import torch

from mcore_rl.mapping.casts import CastOverflowError
from mcore_rl.mapping.mxfp4 import MXFP4Error, dequantize_mxfp4, packed_shapes, quantize_mxfp4, unpacked_shape

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # magnitudes; bit 3 of a code is the sign


def _random(shape: tuple[int, ...], seed: int, low: int = 0, high: int = 253) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks [*shape, 16] and scales [*shape] (scale bytes low..high - 1: finite in fp32)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (*shape, 16), dtype=torch.uint8, generator=g),
            torch.randint(low, high, shape, dtype=torch.uint8, generator=g))


def slow_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The published layout, one byte at a time in Python floats: [E, rows, G, 16] -> [E, G*32, rows]."""
    e, rows, groups, _ = blocks.shape
    out = torch.zeros(e, groups * 32, rows, dtype=torch.float64)
    for x in range(e):
        for r in range(rows):
            for g in range(groups):
                factor = math.ldexp(1.0, int(scales[x, r, g]) - 127)
                for j in range(16):
                    byte = int(blocks[x, r, g, j])
                    for half, code in enumerate((byte & 0xF, byte >> 4)):  # the low nibble is the first value
                        value = math.copysign(E2M1[code & 7], -1.0 if code & 8 else 1.0) * factor
                        out[x, g * 32 + 2 * j + half, r] = value
    return out


def slow_quantize_block(values: list[float]) -> tuple[list[int], int]:
    """The exporter's rule for one block of 32 floats, by scalar arithmetic: (codes, scale byte)."""
    amax = max(abs(v) for v in values)
    k = -127
    if amax > 0:
        k = math.floor(math.log2(amax / 7.0))
        while amax >= 7.0 * 2.0**k:  # log2 rounding: settle the smallest k with amax < 7 * 2^k
            k += 1
        while k > -127 and amax < 7.0 * 2.0 ** (k - 1):
            k -= 1
        k = max(k, -127)
    codes = []
    for v in values:
        y = abs(v) / 2.0**k
        best = min(range(8), key=lambda c: (abs(E2M1[c] - y), c % 2))  # nearest, ties to the even code
        codes.append(best | (8 if math.copysign(1.0, v) < 0 else 0))
    return codes, k + 127


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_equals_transformers_bit_for_bit(dtype):
    """Same random bytes (every scale 0..252, 4 experts, rows not a multiple of anything): the
    same bits as transformers' convert_moe_packed_tensors, also when the codec's chunks are small."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _random((4, 37, 3), seed=1)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    for chunk in (1 << 20, 96, 1):  # whole, a few rows, one row per step
        got = dequantize_mxfp4(blocks, scales, dtype, chunk=chunk)
        assert got.shape == ref.shape == (4, 96, 37) and got.dtype == dtype
        assert torch.equal(_bits(got), _bits(ref)), chunk


def test_dequantize_equals_the_slow_reading_of_the_layout():
    """A 2x5 grid of 2 blocks, with lead dims [2, 1]: fp32 bit for bit as the Python reading (-0.0 included)."""
    blocks, scales = _random((2, 5, 2), seed=2, low=100, high=160)
    blocks[0, 0, 0, 0] = 0x08  # the first value -0.0, the second +0.0
    ref = slow_dequantize(blocks, scales).float()
    got = dequantize_mxfp4(blocks, scales)
    assert torch.equal(_bits(got), _bits(ref)) and torch.signbit(got[0, 0, 0]) and not torch.signbit(got[0, 1, 0])
    lead = dequantize_mxfp4(blocks.reshape(2, 1, 5, 2, 16), scales.reshape(2, 1, 5, 2))
    assert lead.shape == (2, 1, 64, 5) and torch.equal(lead.reshape(2, 64, 5), got)
    flat = dequantize_mxfp4(blocks[0], scales[0])  # no lead dimension: [rows, G, 16] -> [G*32, rows]
    assert torch.equal(flat, got[0])
    assert unpacked_shape(tuple(blocks.shape)) == (2, 64, 5) and packed_shapes((2, 64, 5)) == (
        (2, 5, 2, 16), (2, 5, 2))


def test_quantize_follows_the_stated_rule():
    """Random normals at several magnitudes (block maxima land anywhere in [3.5, 7) * 2^k), exact
    ties, 7 * 2^k exactly and just below it, -0.0, an all-zero block and tiny blocks: the bytes of
    the slow scalar quantizer, value by value."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 128, 6, generator=g) * torch.tensor([1e-3, 1.0, 300.0, 7.0, 1e-38, 2.0]).view(1, 1, 6)
    w[0, 0:8, 1] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # ties; amax 6: scale 2^0
    w[0, 8:32, 1] = 0.0
    w[0, 8, 1] = -0.0
    w[1, 0:32, 1] = torch.tensor([7.0] + [0.75] * 31)  # 7 exactly: 2^1, 3.5 -> 4 (ties even), 0.375 -> 0.5
    w[1, 32:64, 1] = torch.tensor([7.0 * (1 - 2**-20)] + [5.0] * 31)  # just below 7: 2^0, the max -> 6
    w[0, 32:64, 2] = 0.0  # all zero: scale byte 0
    w[0, 64:96, 2] = -0.0
    w[1, 96:128, 0] = torch.tensor(2.0**-130)  # below 7 * 2^-127: scale byte 0, the values round to 2^-128 = 0.5 * 2^-127
    blocks, scales = quantize_mxfp4(w)
    assert blocks.shape == (2, 6, 4, 16) and scales.shape == (2, 6, 4)
    for e in range(2):
        for r in range(6):
            for grp in range(4):
                codes, scale = slow_quantize_block(w[e, grp * 32:(grp + 1) * 32, r].tolist())
                packed = [codes[2 * j] | (codes[2 * j + 1] << 4) for j in range(16)]
                assert (blocks[e, r, grp].tolist(), int(scales[e, r, grp])) == (packed, scale), (e, r, grp)
    assert int(scales[0, 1, 0]) == 127 and int(scales[1, 1, 0]) == 128 and int(scales[0, 2, 1]) == 0
    assert int(scales[1, 1, 1]) == 127 and int(blocks[1, 1, 1, 0]) == 0x67  # 6.0 (code 7), 5.0 -> 4.0 (code 6)
    assert blocks[0, 1, 0, :4].tolist() == [0x20, 0x42, 0x64, 0x76]  # 0.25->0, 0.75->1, 1.25->1, 1.75->2, ...
    assert int(blocks[0, 1, 0, 4]) == 0x08 and set(blocks[0, 2, 2].tolist()) == {0x88}  # -0.0 keeps its sign


def test_canonical_blocks_round_trip_byte_for_byte_and_others_by_value():
    """Random bytes and scales: dequantize -> quantize -> dequantize gives the same values; the
    bytes come back exactly for canonical blocks (scale 0, or largest magnitude code 6/7), and
    every block comes back canonical (quantize is idempotent)."""
    blocks, scales = _random((3, 50, 4), seed=4)
    blocks[0, :10] &= 0x33  # largest magnitudes 1.5: not canonical, a smaller exponent returns
    blocks[1, :5] = 0  # all zero with a non-zero scale: returns with scale 0
    for dtype in (torch.float32, torch.bfloat16):
        values = dequantize_mxfp4(blocks, scales, dtype)
        b2, s2 = quantize_mxfp4(values)
        assert torch.equal(_bits(dequantize_mxfp4(b2, s2, dtype)), _bits(values))
        mags = torch.stack((blocks & 7, (blocks >> 4) & 7), -1).amax(dim=(-1, -2))
        canonical = (scales == 0) | (mags >= 6)
        assert 0 < int(canonical.sum()) < canonical.numel()
        assert torch.equal(b2[canonical], blocks[canonical]) and torch.equal(s2[canonical], scales[canonical])
        assert bool((s2[~canonical] < scales[~canonical]).all())  # a smaller exponent, never a larger
        assert torch.equal(quantize_mxfp4(dequantize_mxfp4(b2, s2, dtype))[0], b2)


def test_bf16_weights_requantize_within_the_format_error():
    """From bf16 normals: every value within half an E2M1 step of its block (|x - q| <= 2^k / 2
    for |x/2^k| <= 4, <= 2^k above), and the block's amax never saturates (|q| >= amax - 2^k)."""
    w = torch.randn(4, 96, 40, generator=torch.Generator().manual_seed(5)).bfloat16()
    blocks, scales = quantize_mxfp4(w)
    back = dequantize_mxfp4(blocks, scales)
    step = torch.ldexp(torch.ones(scales.shape), scales.int() - 127).repeat_interleave(32, dim=-1).transpose(-1, -2)
    err = (back - w.float()).abs()
    y = w.float().abs() / step
    assert bool((err <= torch.where(y <= 4, 0.5, 1.0) * step).all())
    assert bool((back.abs() <= 6 * step).all())


def test_refusals_name_the_tensor_and_the_block():
    blocks, scales = _random((2, 3, 2), seed=6, low=120, high=130)
    bad = scales.clone()
    bad[1, 2, 1] = 0xFF
    with pytest.raises(MXFP4Error, match=r"'w': scale byte 0xFF \(NaN in E8M0\) of block \[1, 2, 1\] \(the weight's "
                                         r"\[1, 32:64, 2\]\)"):
        dequantize_mxfp4(blocks, bad, name="'w'")
    big = scales.clone()
    big[0, 1, 0] = 254
    blocks[0, 1, 0, 0] = 0x07  # 6 * 2^127
    with pytest.raises(MXFP4Error, match=r"'w': block \[0, 1, 0\] .* with scale 2\^127 holds values beyond float32"):
        dequantize_mxfp4(blocks, big, name="'w'")
    one = torch.zeros(2, 1, 2, 16, dtype=torch.uint8)
    one[1, 0, 1, 3] = 0x70  # the value [1, 32 + 7, 0]: 6 * 2^14 = 98304 > 65504
    with pytest.raises(CastOverflowError, match=r"'w': 1 value\(s\) beyond float16's range \+-65504, the first "
                                                r"98304 in block \[1, 0, 1\] \(the weight's \[1, 32:64, 0\]\)"):
        dequantize_mxfp4(one, torch.full((2, 1, 2), 127 + 14, dtype=torch.uint8), torch.float16, name="'w'")
    assert dequantize_mxfp4(one, torch.full((2, 1, 2), 127 + 14, dtype=torch.uint8), torch.bfloat16)[1, 39, 0] == 98304
    for b, s, says in ((blocks.int(), scales, "uint8, got torch.int32"), (blocks, scales[..., :1], "do not fit"),
                       (blocks[..., :8], scales, "do not fit"), (blocks[0, 0], scales[0, 0], "do not fit")):
        with pytest.raises(MXFP4Error, match=f"'w': MXFP4 blocks .*{says}|'w': .*{says}"):
            dequantize_mxfp4(b, s, name="'w'")
    w = torch.zeros(2, 64, 3)
    for value in (float("nan"), float("inf"), -float("inf")):
        w[1, 40, 2] = value
        with pytest.raises(MXFP4Error, match=rf"'w': 1 NaN/inf value\(s\), the first {value} in block \[1, 2, 1\] "
                                             r"\(the weight's \[1, 32:64, 2\]\)"):
            quantize_mxfp4(w, name="'w'", chunk=64)
    with pytest.raises(MXFP4Error, match=r"cols a multiple of 32, got shape \[2, 48, 3\]"):
        quantize_mxfp4(torch.zeros(2, 48, 3), name="'w'")
