"""Rounding weights to a narrower float dtype without a silent overflow.

``t.to(torch.float16)`` turns every value beyond fp16's +-65504 into +-inf (and fp32 -> bf16 a
value beyond bf16's ~3.39e38) without a word; the converter (``--dtype fp16``), the merge, the
FP8 dequantization and the rollout weight sync round through ``cast_checked``, which refuses
that naming the tensor, the value, where it is and the fix. Values already NaN or inf in the
input are not created by the cast: ``first_nonfinite`` finds them for the caller to report.
No megatron import.
"""
from __future__ import annotations

import torch

from mcore_rl.errors import McoreRLError

Tensor = torch.Tensor


class CastOverflowError(McoreRLError, ValueError):
    """A finite weight beyond the range of the float dtype it is rounded to (it would become inf)."""


class NonFiniteWarning(McoreRLError, UserWarning):
    """Weights that are NaN or inf in the input, copied as they are (nothing rounded made them).
    An McoreRLError too: where warnings are turned into errors it is a refusal like the others."""


def wider_dtypes(dtype: torch.dtype, flag: str = "--dtype") -> str:
    """The fix for an overflow into ``dtype``: the flag values that hold the value."""
    return f"pass {flag} fp32" if dtype == torch.bfloat16 else f"pass {flag} bf16 or {flag} fp32"


def describe_nonfinite(found: dict[str, tuple[int, tuple[int, ...], float]], where: str) -> str:
    """One line naming the tensors of ``found`` (name -> ``first_nonfinite``) and the first value."""
    name = sorted(found)[0]
    count, index, value = found[name]
    return (f"{where}: {len(found)} tensor(s) hold NaN/inf values, copied as they are: {sorted(found)[:4]}"
            f"{' ...' if len(found) > 4 else ''} ({name}: {count} value(s), the first {value} at {list(index)}); "
            "the checkpoint is damaged or from a diverged run")


def _narrows(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether rounding ``src`` floats to ``dst`` floats can overflow (``dst``'s range is smaller)."""
    if not (src.is_floating_point and dst.is_floating_point) or src == dst:
        return False
    return torch.finfo(dst).max < torch.finfo(src).max


def _first(mask: Tensor) -> tuple[int, ...]:
    """Index of the first True of ``mask`` (row-major)."""
    return tuple(int(i) for i in torch.nonzero(mask)[0])


def first_nonfinite(t: Tensor) -> tuple[int, tuple[int, ...], float] | None:
    """(how many, the first's index, its value) of the NaN/inf values of ``t``; None when all are finite."""
    if not t.is_floating_point() or bool(torch.isfinite(t).all()):
        return None
    bad = ~torch.isfinite(t)
    where = _first(bad)
    return int(bad.sum()), where, t[where].item()


def cast_checked(t: Tensor, dtype: torch.dtype, name: str, fix: str) -> Tensor:
    """``t`` [any shape] rounded to ``dtype`` (``t`` itself when it has that dtype). A finite value
    that becomes inf is a CastOverflowError naming ``name``, the value, its index, ``dtype``'s
    largest value and ``fix`` (e.g. "pass --dtype bf16"). NaN/inf already in ``t`` pass as they
    are. Cost: one extra pass over the result (an ``isinf``), a second only on an overflow."""
    if t.dtype == dtype:
        return t
    out = t.to(dtype)
    if not _narrows(t.dtype, dtype) or not bool(torch.isinf(out).any()):
        return out
    lost = torch.isinf(out) & torch.isfinite(t)
    if bool(lost.any()):
        where = _first(lost)
        limit = torch.finfo(dtype).max
        raise CastOverflowError(
            f"{name}: {int(lost.sum())} value(s) beyond {str(dtype).removeprefix('torch.')}'s range +-{limit:.6g}, "
            f"the first {t[where].item():.6g} at {list(where)}, would be written as inf; {fix}.")
    return out
