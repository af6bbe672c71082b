"""MXFP4 (OCP microscaling, E2M1 values with one E8M0 exponent per 32) to float and back, in the
layout of the published gpt-oss checkpoints (``mxfp4_format``).

Dequantization (``dequantize_mxfp4``): every value is ``E2M1_VALUES[code] * 2 ** (scale - 127)``
computed in float32, where it is exact (two significant bits times a power of two) unless it
passes float32's largest value (a scale of 253 or 254 with codes of magnitude >= 2: refused),
then rounded once to the target dtype (exact for bf16 and fp32; fp16 can overflow: refused).
The result is the HF parameter: blocks [*lead, rows, cols / 32, 16] give [*lead, cols, rows],
the last two dimensions transposed as transformers' ``convert_moe_packed_tensors`` does.

Quantization (``quantize_mxfp4``), the exporter's rule, for each block of 32 values with
largest magnitude ``amax``:
- the exponent is the smallest ``k`` with ``amax < 7 * 2 ** k``, clamped to [-127, 127]; the
  scale byte is ``k + 127``. So ``amax / 2 ** k`` lies in [3.5, 7): the largest value takes code
  magnitude 4 or 6, the grid is as fine as it can be without an error above the nearest-value
  one (values in (6, 7) become 6, 7 is rounded up by the next exponent). An all-zero block gets
  scale byte 0 (``2 ** -127``), so does a block whose ``k`` is below -127;
- each value is divided by ``2 ** k`` (exact in float32 wherever the rounding below can tell)
  and rounded to the nearest E2M1 magnitude, ties to the even code (0.25 -> 0, 0.75 -> 1,
  1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), above 6 to 6; the sign bit is the value's
  own, so -0.0 and negative values that round to zero are code 8 (``-0.0``);
- NaN or inf anywhere is an MXFP4Error naming the tensor and the block.
The rule is idempotent: its output is canonical, and canonical blocks come back byte for byte
(``quantize_mxfp4(dequantize_mxfp4(b, s)) == (b, s)``): a scale byte of 0 (any codes), or a
scale byte in 1..252 whose largest code magnitude is 4 or 6 (codes 6, 7, 14, 15). Every other
block that dequantizes to finite values comes back with the same values in canonical form (a
smaller exponent with codes doubled, or scale 0 for an all-zero block). The OCP MX rule
(``floor(log2(amax)) - 2``, saturating at 6) writes only canonical blocks, and gives the same
bytes as this rule except where ``amax / 2 ** k`` lies in [7, 8): it clamps those to 6, this
rule rounds them to 4 with the next exponent.
"""
from __future__ import annotations

import math

import torch

from mcore_rl.mapping.casts import CastOverflowError
from mcore_rl.mapping.fp8_dequant import QuantizationError
from mcore_rl.mapping.mxfp4_format import BLOCK, BYTES_PER_BLOCK, E2M1_VALUES, SCALE_BIAS, SCALE_NAN

CHUNK = 1 << 20  # values per step: temporaries stay a few MiB whatever the tensor's size
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)  # between E2M1 magnitudes j and j + 1
_TIES_UP = (0.75, 1.75, 3.5)  # midpoints whose even neighbour is the upper code


class MXFP4Error(QuantizationError):
    """MXFP4 blocks and scales that do not fit each other, or values MXFP4 cannot hold."""


def unpacked_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The HF parameter's shape [*lead, cols, rows] of blocks [*lead, rows, cols / 32, 16]."""
    *lead, rows, groups, _ = blocks_shape
    return (*lead, groups * BLOCK, rows)


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of a HF parameter [*lead, cols, rows]: ([*lead, rows, cols / 32,
    16], [*lead, rows, cols / 32]); ``cols`` must be a multiple of 32 (``quantize_mxfp4`` checks)."""
    *lead, cols, rows = shape
    return (*lead, rows, cols // BLOCK, BYTES_PER_BLOCK), (*lead, rows, cols // BLOCK)


def _pair_table(device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[256, 2] ``dtype``: the two values of each byte, low nibble first."""
    values = torch.tensor(E2M1_VALUES, dtype=dtype, device=device)
    codes = torch.arange(256, device=device)
    return torch.stack((values[codes & 0x0F], values[codes >> 4]), dim=1)


def _powers_of_two(scales: torch.Tensor) -> torch.Tensor:
    """``2 ** (scales - 127)`` as float32 (uint8 scales, none 0xFF), built from the bits: the
    exponent field is the scale byte itself; byte 0 is the subnormal 2^-127 (bit 22)."""
    s = scales.to(torch.int32)
    bits = torch.where(s == 0, 1 << 22, s << 23)
    return bits.view(torch.float32)


def _block_at(lead: tuple[int, ...], flat: int, row: int, group: int, at: tuple[int, ...] = ()) -> str:
    """``block [*at, *lead, row, group]`` of the blocks tensor and the values it holds in the HF parameter."""
    index = [row, group]
    for size in reversed(lead):
        flat, i = divmod(flat, size)
        index.insert(0, i)
    index = [*at, *index]
    cols = f"{group * BLOCK}:{(group + 1) * BLOCK}"
    return f"block {index} (the weight's [{', '.join([*map(str, index[:-2]), cols, str(row)])}])"


def _check_pair(blocks: torch.Tensor, scales: torch.Tensor, name: str) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise MXFP4Error(f"{name}: MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}; the "
                         "checkpoint is damaged: copy it again.")
    if blocks.dim() < 3 or blocks.shape[-1] != BYTES_PER_BLOCK or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise MXFP4Error(f"{name}: MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)} do not fit "
                         f"(blocks [..., rows, G, {BYTES_PER_BLOCK}], scales [..., rows, G]); the checkpoint is "
                         "damaged: copy it again.")


def _largest_safe_scale(dtype: torch.dtype) -> int:
    """The largest scale byte whose products (at most 6 * 2^(scale - 127)) all fit ``dtype``."""
    limit = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
    safe = 0
    while safe < SCALE_NAN - 1 and 6.0 * 2.0 ** (safe + 1 - SCALE_BIAS) <= limit:
        safe += 1
    return safe


def _check_range(values: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, lead: tuple[int, ...], i: int,
                 r0: int, name: str, at: tuple[int, ...]) -> None:
    """``values`` [r, G, 32] (float32 products of the scales ``s`` [r, G], rows ``r0``.. of lead
    index ``i``) beyond float32 (MXFP4Error: the scale is damaged) or beyond ``dtype``
    (CastOverflowError: the values have two significant bits, so only the range can fail)."""
    limit = torch.finfo(dtype).max if dtype.is_floating_point else math.inf
    bad = ~torch.isfinite(values) | (values.abs() > limit)
    if not bool(bad.any()):
        return
    r, g, _ = (int(v) for v in torch.nonzero(bad)[0])
    where = _block_at(lead, i, r0 + r, g, at)
    if not bool(torch.isfinite(values[r, g]).all()):
        raise MXFP4Error(f"{name}: {where} with scale 2^{int(s[r, g]) - SCALE_BIAS} holds values beyond float32; the "
                         "scale is damaged: copy the checkpoint again.")
    raise CastOverflowError(f"{name}: {int(bad.sum())} value(s) beyond {str(dtype).removeprefix('torch.')}'s range "
                            f"+-{limit:.6g}, the first {values[bad][0].item():.6g} in {where}, would be written as "
                            "inf; read it in bf16 or fp32.")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32,
                     name: str = "the tensor", chunk: int = CHUNK, at: tuple[int, ...] = ()) -> torch.Tensor:
    """``blocks`` uint8 [*lead, rows, G, 16] and ``scales`` uint8 [*lead, rows, G] -> the HF
    parameter [*lead, G * 32, rows] in ``dtype`` (module docstring), on the blocks' device. A
    scale of 0xFF (NaN in E8M0), a value beyond float32 or one ``dtype`` cannot hold is an
    MXFP4Error / CastOverflowError naming ``name`` and the block (prefixed by ``at``, the
    leading indices of this slice in the whole tensor). ``chunk`` values at a time."""
    _check_pair(blocks, scales, name)
    *lead, rows, groups, _ = blocks.shape
    cols, n = groups * BLOCK, math.prod(lead)
    out = torch.empty((n, rows, cols), dtype=dtype, device=blocks.device)  # the blocks' order: no strided writes
    # bf16 and fp32 hold every product exactly (two significant bits times a power of two down
    # to 2^-128): computed in the output dtype; others (fp16) in fp32, then rounded once
    work = dtype if dtype in (torch.bfloat16, torch.float32) else torch.float32
    table = _pair_table(blocks.device, work)
    safe_scale = _largest_safe_scale(dtype)
    b3, s3 = blocks.reshape(n, rows, groups, BYTES_PER_BLOCK), scales.reshape(n, rows, groups)
    step = max(1, chunk // max(1, cols))
    for i in range(n):
        for r0 in range(0, rows, step):
            s = s3[i, r0:r0 + step]
            top = int(s.max())
            if top == SCALE_NAN:
                r, g = (int(v) for v in torch.nonzero(s == SCALE_NAN)[0])
                where = _block_at(tuple(lead), i, r0 + r, g, at)
                raise MXFP4Error(f"{name}: scale byte 0xFF (NaN in E8M0) of {where}; the checkpoint is damaged: copy "
                                 "it again.")
            values = table[b3[i, r0:r0 + step].long()].reshape(s.shape[0], groups, BLOCK)
            values = values * _powers_of_two(s).to(work).unsqueeze(-1)
            if top > safe_scale:  # only then can a value pass the dtype's range
                _check_range(values.float(), s, dtype, tuple(lead), i, r0, name, at)
            out[i, r0:r0 + step] = values.reshape(s.shape[0], cols)  # one rounding to dtype
    return out.reshape(*lead, rows, cols).transpose(-1, -2)  # a view: a consumer that transposes back copies nothing


def _exponents(amax: torch.Tensor) -> torch.Tensor:
    """int32 ``k`` per block (float32 ``amax`` >= 0, finite): the smallest with amax < 7 * 2^k,
    clamped to [-127, 127]; -127 for amax == 0. Exact: amax = m * 2^e, m in [0.5, 1), and
    7 * 2^k = 0.875 * 2^(k + 3), so k = e - 3, or e - 2 when m >= 0.875."""
    mant, exp = torch.frexp(amax)
    k = exp.to(torch.int32) - 3 + (mant >= 7 / 8).to(torch.int32)
    k = torch.where(amax == 0, -SCALE_BIAS, k)
    return k.clamp(-SCALE_BIAS, SCALE_BIAS)


def _round_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Magnitude codes 0..7 (uint8) of ``y`` (float32, 0 <= y <= 6): nearest, ties to even."""
    mids = torch.tensor(_MIDPOINTS, dtype=torch.float32, device=y.device)
    code = torch.bucketize(y.contiguous(), mids)  # how many midpoints lie strictly below y
    for tie in _TIES_UP:
        code += y == tie
    return code.to(torch.uint8)


def _check_finite(w: torch.Tensor, lead: tuple[int, ...], i: int, r0: int, name: str) -> None:
    """NaN/inf in ``w`` [r, G, 32] (rows ``r0``.. of lead index ``i``): MXFP4Error naming the block."""
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        r, g, j = (int(v) for v in torch.nonzero(bad)[0])
        raise MXFP4Error(f"{name}: {int(bad.sum())} NaN/inf value(s), the first {w[r, g, j].item()} in "
                         f"{_block_at(lead, i, r0 + r, g)}; MXFP4 cannot hold them: fix the checkpoint (a "
                         "diverged run?) or merge without --dtype mxfp4.")


def quantize_mxfp4(weight: torch.Tensor, name: str = "the tensor",
                   chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The HF parameter ``weight`` [*lead, cols, rows] (any float dtype, cols a multiple of 32)
    -> (blocks uint8 [*lead, rows, cols / 32, 16], scales uint8 [*lead, rows, cols / 32]) by the
    rule of the module docstring, on the weight's device. NaN/inf, a weight of fewer than 2
    dimensions or cols not a multiple of 32 is an MXFP4Error naming ``name``."""
    if weight.dim() < 2 or weight.shape[-2] % BLOCK:
        raise MXFP4Error(f"{name}: MXFP4 quantizes [..., cols, rows] with cols a multiple of {BLOCK}, got shape "
                         f"{list(weight.shape)}; write it in another dtype.")
    *lead, cols, rows = weight.shape
    groups, n = cols // BLOCK, math.prod(lead)
    bshape, sshape = packed_shapes(tuple(weight.shape))
    blocks = torch.empty((n, rows, groups, BYTES_PER_BLOCK), dtype=torch.uint8, device=weight.device)
    scales = torch.empty((n, rows, groups), dtype=torch.uint8, device=weight.device)
    w3 = weight.detach().reshape(n, cols, rows)
    step = max(1, chunk // max(1, cols))
    for i in range(n):
        for r0 in range(0, rows, step):
            w = w3[i, :, r0:r0 + step].T.to(torch.float32, memory_format=torch.contiguous_format)
            w = w.view(-1, groups, BLOCK)  # [r, G, 32]
            _check_finite(w, tuple(lead), i, r0, name)
            k = _exponents(w.abs().amax(dim=-1))
            inverse = ((SCALE_BIAS - k) << 23).view(torch.float32)  # 2^-k, k in [-127, 126]: a normal float
            codes = _round_e2m1(w.abs() * inverse.unsqueeze(-1)) | (torch.signbit(w).to(torch.uint8) << 3)
            pairs = codes.reshape(-1, groups, BYTES_PER_BLOCK, 2)
            blocks[i, r0:r0 + step] = pairs[..., 0] | (pairs[..., 1] << 4)
            scales[i, r0:r0 + step] = (k + SCALE_BIAS).to(torch.uint8)
    return blocks.reshape(bshape), scales.reshape(sshape)
