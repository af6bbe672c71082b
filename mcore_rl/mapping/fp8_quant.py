"""Block FP8 export (DeepSeek-V3 style): which HF tensors are quantized, and the quantizer.

A quantized HF weight ``W`` [R, C] is written as ``float8_e4m3fn`` with ``<name>_scale_inv``
float32 [ceil(R/b0), ceil(C/b1)], one scale per b0 x b1 block (edge blocks are the cut rest;
they are scaled as if zero-padded). A block larger than the weight is the weight: it is clamped
to the weight's shape per dimension, which leaves the scale shape (ceil(R/b0) = 1 there) and
every reader's arithmetic as they are, and costs nothing for the padding it no longer makes.
Block sizes are integers in 1 .. 2^31 - 1 (``MAX_BLOCK``: readers keep them in 32-bit ints). Per block, in fp32: ``s = amax / 448`` (``ue8m0``: ``s``
rounded up to a power of two), an all-zero block ``s = 1``; ``q = RNE(clamp(W / s, -448, 448))``
by division, rounded to the e4m3 grid here (ties to even, subnormals included) so the final cast
to float8 is exact and never depends on torch's own float8 rounding or saturation (its cast turns
inf into 448 silently). ``W ~ q * s``: the reader multiplies by ``_scale_inv``.
A NaN or inf in a tensor is an error naming the tensor and the block.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from mcore_rl.errors import McoreRLError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
MAX_BLOCK = 2**31 - 1  # the largest block side written to config.json (readers' int32)
ScaleFmt = Literal["float", "ue8m0"]
# The linear projections of decoder layers that block FP8 checkpoints (DeepSeek-V3/R1/V3.1,
# Kimi-K2, Qwen3-FP8) quantize: attention q/k/v/o and MLA's q_a/q_b/kv_a_with_mqa/kv_b, MLP
# gate/up/down (dense, routed and shared experts), Mixtral's expert w1/w2/w3. Everything else
# (embeddings, lm_head / score, norms, the router ``mlp.gate``, ``shared_expert_gate``,
# ``e_score_correction_bias``, biases) keeps its dtype.
_QUANTIZED = re.compile(r"^model\.layers\.\d+\..*\.(\w+_proj|kv_a_proj_with_mqa|w[123])\.weight$")


class Fp8QuantError(McoreRLError, ValueError):
    """A tensor that cannot be quantized to block FP8 (NaN/inf values, a bad block size)."""


@dataclass(frozen=True)
class BlockFp8:
    """Block FP8 export format: ``block`` (rows, cols) per scale, ``scale_fmt`` float32 scales
    (``float``: amax / 448) or ``ue8m0`` (rounded up to a power of two, as DeepSeek-V3.1)."""

    block: tuple[int, int] = (128, 128)
    scale_fmt: ScaleFmt = "float"

    def __post_init__(self) -> None:
        if len(self.block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= MAX_BLOCK
                                           for b in self.block):
            raise Fp8QuantError(f"fp8 block size {self.block!r}: give two integers (rows, cols) in 1..{MAX_BLOCK}, "
                                "e.g. 128x128; a block larger than a weight covers the whole weight.")
        if self.scale_fmt not in ("float", "ue8m0"):
            raise Fp8QuantError(f"scale_fmt={self.scale_fmt!r}; use 'float' (amax/448) or 'ue8m0' (powers of two).")

    def quantization_config(self) -> dict:
        """The ``quantization_config`` of config.json (transformers' / vLLM's block FP8 reading)."""
        config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(self.block),
                  "activation_scheme": "dynamic"}
        if self.scale_fmt == "ue8m0":
            config["scale_fmt"] = "ue8m0"
        return config

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """[ceil(R/b0), ceil(C/b1)] of a weight [R, C]."""
        return (-(-shape[0] // self.block[0]), -(-shape[1] // self.block[1]))


def parse_block(text: str) -> tuple[int, int]:
    """``"128x128"``, ``"128,64"`` or ``"128"`` (square) -> (rows, cols) of integers in
    1..``MAX_BLOCK`` (ASCII digits only); else Fp8QuantError naming the text."""
    parts = [p for p in re.split(r"[x,\s]+", str(text).strip().lower()) if p]
    values = tuple(int(p) for p in parts) if all(re.fullmatch(r"[0-9]{1,12}", p) for p in parts) else ()
    if len(values) == 1:
        values = values * 2
    if len(values) != 2 or not all(0 < v <= MAX_BLOCK for v in values):
        raise Fp8QuantError(f"fp8 block size {text!r}: give ROWSxCOLS of integers in 1..{MAX_BLOCK}, e.g. 128x128 "
                            "(or 128 64); a block larger than a weight covers the whole weight.")
    return values  # type: ignore[return-value]


def is_quantized(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the HF tensor ``name`` of ``shape`` is written as block FP8 (see ``_QUANTIZED``)."""
    return len(shape) == 2 and _QUANTIZED.match(name) is not None


def _check_finite(w: torch.Tensor, fmt: BlockFp8, name: str, row0: int = 0) -> None:
    """NaN/inf in ``w`` (rows ``row0``.. of the tensor ``name``): Fp8QuantError naming the first."""
    bad = ~torch.isfinite(w)
    if bool(bad.any()):
        r, c = (int(i) for i in bad.nonzero()[0])
        raise Fp8QuantError(
            f"{name}: {int(bad.sum())} NaN/inf value(s), the first {w[r, c].item()} at [{row0 + r}, {c}] in block "
            f"[{(row0 + r) // fmt.block[0]}, {c // fmt.block[1]}] of {fmt.block}; FP8 cannot hold them (a cast would "
            "saturate inf to 448 silently): fix the checkpoint (a diverged run?) or merge without --dtype fp8.")


def block_scales(amax: torch.Tensor, scale_fmt: ScaleFmt) -> torch.Tensor:
    """float32 scales of blocks with max |w| ``amax``: amax / 448 (ue8m0: rounded up to a power
    of two), 1 for an all-zero block, the smallest float32 where amax / 448 underflows to 0."""
    s = amax / FP8_MAX
    if scale_fmt == "ue8m0":
        mant, exp = torch.frexp(s)  # s = mant * 2^exp, mant in [0.5, 1): a power of two iff mant == 0.5
        s = torch.ldexp(torch.ones_like(s), torch.where(mant == 0.5, exp - 1, exp))
    tiny = torch.finfo(torch.float32).smallest_normal * 2.0**-23  # host: smallest subnormal
    return torch.where(amax == 0, 1.0, torch.where(s > 0, s, tiny))


def round_to_e4m3(y: torch.Tensor) -> torch.Tensor:
    """``y`` (fp32, |y| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32: normal
    values keep 3 mantissa bits, below 2^-6 the subnormal step 2^-9."""
    _, exp = torch.frexp(y)  # |y| in [2^(exp-1), 2^exp)
    step = torch.clamp(exp - 4, min=-9)  # 2^step: the e4m3 spacing at |y|
    return torch.ldexp(torch.round(torch.ldexp(y, -step)), step)  # torch.round: half to even


def quantize_block_fp8(w: torch.Tensor, fmt: BlockFp8, name: str = "tensor",
                       chunk_elements: int = 1 << 22) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [R, C] -> (q [R, C] float8_e4m3fn, scale_inv [ceil(R/b0), ceil(C/b1)] float32) with
    ``w ~ q * scale_inv`` per block (module docstring). NaN/inf: Fp8QuantError naming ``name``.
    Rows of blocks are quantized ``chunk_elements`` at a time (at least one block row): the
    fp32 temporaries stay ~7 x 4 bytes per chunk element, whatever the tensor's size."""
    if w.dim() != 2:
        raise Fp8QuantError(f"{name}: block FP8 quantizes 2-D weights, got shape {tuple(w.shape)}.")
    (rows, cols) = w.shape
    block = (max(1, min(fmt.block[0], rows)), max(1, min(fmt.block[1], cols)))  # a block is at most the weight
    b0 = block[0]
    q = torch.empty(rows, cols, dtype=FP8_DTYPE)  # host: file format
    scale = torch.empty(fmt.scale_shape((rows, cols)), dtype=torch.float32)  # host: file format
    step = b0 * max(1, chunk_elements // max(1, b0 * cols))
    for row0 in range(0, rows, step):
        part = w[row0:row0 + step].detach().to(torch.float32)
        _check_finite(part, fmt, name, row0)
        q_part, s_part = _quantize_rows(part, block, fmt.scale_fmt)
        q[row0:row0 + step] = q_part
        scale[row0 // b0:row0 // b0 + s_part.shape[0]] = s_part
    return q, scale


def _quantize_rows(w: torch.Tensor, block: tuple[int, int], scale_fmt: ScaleFmt) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk of block rows (fp32, finite) in blocks ``block`` (clamped to the weight): (q
    float8_e4m3fn, its rows of scales)."""
    (rows, cols), (b0, b1) = w.shape, block
    nr, nc = -(-rows // b0), -(-cols // b1)
    padded = F.pad(w, (0, nc * b1 - cols, 0, nr * b0 - rows)).view(nr, b0, nc, b1)
    amax = padded.abs().amax(dim=(1, 3)) if w.numel() else torch.zeros(nr, nc)  # host: file format
    scale = block_scales(amax, scale_fmt)
    y = torch.clamp(padded / scale[:, None, :, None], -FP8_MAX, FP8_MAX)
    del padded
    q = round_to_e4m3(y).view(nr * b0, nc * b1)[:rows, :cols]
    return q.to(FP8_DTYPE), scale
