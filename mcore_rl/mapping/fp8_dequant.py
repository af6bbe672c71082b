"""FP8 checkpoints read in HF-name space: each FP8 weight is dequantized with its scale, one
tensor at a time, before the mapping fuses QKV or fc1.

Formats (``quantization_config`` in config.json):
- ``quant_method: "fp8"`` with ``weight_block_size [b0, b1]`` (DeepSeek-V3/R1/V3.1, Kimi-K2,
  Qwen3-*-FP8): ``X.weight`` F8_E4M3 [R, C] with ``X.weight_scale_inv`` [ceil(R/b0), ceil(C/b1)];
  the value is ``w * scale`` of its block (edge blocks cut). ``scale_fmt: "ue8m0"`` scales are
  powers of two stored as floats: the same arithmetic.
- ``quant_method: "fp8"`` without a block size (AutoFP8): ``X.weight_scale``, one per tensor.
- ``quant_method: "compressed-tensors"`` with float 8-bit weights (GLM-4.5/4.6-FP8):
  ``X.weight_scale`` [R, 1] or [R] per output channel (strategy ``channel``), one per tensor
  (``tensor``), or per block (``block`` with ``block_structure``).
A tensor is dequantized exactly when it is stored as FP8 and its scale exists; every other tensor
passes through in its own dtype; activation scales (``X.input_scale``) are dropped. Arithmetic is
fp32 (the FP8 value and the scale are exact in it), then one rounding to the target dtype.
Every other quantization method is refused naming it (MXFP4 is ``mxfp4_import``'s), and so is
an integer or bool tensor where the model expects a float weight (FP8 payloads are legal only
beside their scale).
Values are checked while dequantized (block-FP8 releases carry no checksums): a NaN, inf or
negative scale, a zero scale of a block holding non-zero values (zero scales of all-zero blocks
are legal: the block is zeros either way), a NaN encoding among the FP8 values (0x7F/0xFF), a
product beyond float32, or one beyond the target dtype (fp16's +-65504) are refused naming the
tensor and the block.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from mcore_rl.errors import McoreRLError
from mcore_rl.mapping.casts import cast_checked

FP8_WEIGHT_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}  # the FP8 safetensors dtype dequantized
OTHER_FP8 = ("F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ", "F8_E8M0")
SCALE_DTYPES = ("F32", "BF16", "F16")
INTEGER_DTYPES = ("BOOL", "U8", "I8", "I16", "U16", "I32", "U32", "I64", "U64")  # never a float weight's
ACTIVATION_SCALES = (".input_scale",)  # static activation scales: inference only, dropped
_FORMATS = ("float-quantized", "naive-quantized", None)  # compressed-tensors formats holding FP8 as is


class QuantizationError(McoreRLError, ValueError):
    """A quantized checkpoint mcore_rl cannot read, or FP8 tensors whose scales do not fit them."""


@dataclass(frozen=True)
class FP8Scheme:
    """How a checkpoint's FP8 weights are scaled (from ``quantization_config``)."""

    method: str  # "fp8" | "compressed-tensors"
    scale_suffix: str  # the scale of "X.weight" is "X.<scale_suffix>"
    strategies: frozenset[str]  # of "block", "channel", "tensor"
    block: tuple[int, int] | None = None  # (rows, cols) of one block when "block" is a strategy


def _refuse(where: str, what: str) -> QuantizationError:
    return QuantizationError(
        f"{where}: {what}; mcore_rl imports FP8 checkpoints only (quant_method 'fp8' with e4m3 weights, or "
        "'compressed-tensors' with float 8-bit weights): dequantize the model to bf16 with its quantizer's own "
        "tooling, or use its unquantized release.")


def _block(value: Any, where: str, field: str) -> tuple[int, int]:
    ok = (isinstance(value, list) and len(value) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in value))
    if not ok:
        raise QuantizationError(f"{where}: {field}={value!r} is not [rows, cols] of positive integers; fix "
                                "config.json.")
    return value[0], value[1]


def _fp8_method(q: dict, where: str) -> FP8Scheme:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(where, f"quant_method 'fp8' with fmt={fmt!r} (only e4m3 is read)")
    if q.get("scale_fmt") not in (None, "ue8m0"):
        raise _refuse(where, f"quant_method 'fp8' with scale_fmt={q.get('scale_fmt')!r} (read: none, 'ue8m0')")
    if q.get("weight_block_size") is None:  # AutoFP8: one scale per tensor (or per channel)
        return FP8Scheme("fp8", "weight_scale", frozenset({"tensor", "channel"}))
    block = _block(q["weight_block_size"], where, "quantization_config.weight_block_size")
    return FP8Scheme("fp8", "weight_scale_inv", frozenset({"block"}), block)


def _compressed_tensors(q: dict, where: str) -> FP8Scheme:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _refuse(where, f"compressed-tensors without config_groups (got {groups!r})")
    sparsity = q.get("sparsity_config")
    if isinstance(sparsity, dict) and sparsity.get("format") not in (None, "dense"):
        raise _refuse(where, f"compressed-tensors with sparsity format {sparsity.get('format')!r}")
    strategies, blocks = set(), set()
    for name, group in groups.items():
        w = group.get("weights") if isinstance(group, dict) else None
        fmt = group.get("format", q.get("format")) if isinstance(group, dict) else q.get("format")
        if not isinstance(w, dict) or w.get("type") != "float" or w.get("num_bits") != 8 or fmt not in _FORMATS:
            got = (f"type={w.get('type')!r}, num_bits={w.get('num_bits')!r}, format={fmt!r}"
                   if isinstance(w, dict) else f"weights={w!r}")
            raise _refuse(where, f"compressed-tensors group {name!r} quantizes weights as {got}, not float 8-bit")
        strategy = w.get("strategy")
        if strategy not in ("channel", "tensor", "block"):
            raise _refuse(where, f"compressed-tensors group {name!r} with weight strategy {strategy!r} (read: "
                                 "channel, tensor, block)")
        strategies.add(strategy)
        if strategy == "block":
            blocks.add(_block(w.get("block_structure"), where, f"config_groups.{name}.weights.block_structure"))
    if len(blocks) > 1:
        raise _refuse(where, f"compressed-tensors groups with different block structures {sorted(blocks)}")
    return FP8Scheme("compressed-tensors", "weight_scale", frozenset(strategies), next(iter(blocks), None))


_METHODS = {"fp8": _fp8_method, "compressed-tensors": _compressed_tensors}


def scheme_from_config(config: Mapping[str, Any], where: str) -> FP8Scheme | None:
    """The FP8 scheme a config.json's ``quantization_config`` declares; None without one and for
    ``mxfp4`` (``mxfp4_import`` plans it). Other methods (gptq, awq, bitsandbytes, int8
    compressed-tensors, ...) are refused."""
    q = config.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise _refuse(where, f"quantization_config is a JSON {type(q).__name__}, not an object")
    method = q.get("quant_method")
    if method == "mxfp4":
        return None
    if method not in _METHODS:
        raise _refuse(where, f"quantization_config.quant_method={method!r}")
    return _METHODS[method](q, where)


def config_of_directory(directory: str) -> dict | None:
    """``directory``/config.json as a dict (None when absent or not a JSON object); unreadable
    JSON is a QuantizationError naming the file."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError, UnicodeDecodeError, RecursionError) as e:
        raise QuantizationError(f"{path} is not readable JSON ({type(e).__name__}: {e}); fix or copy it "
                                "again.") from None
    return config if isinstance(config, dict) else None


def scheme_of_directory(directory: str) -> FP8Scheme | None:
    """``scheme_from_config`` of ``directory``/config.json (None when the directory has none)."""
    config = config_of_directory(directory)
    return scheme_from_config(config, os.path.join(directory, "config.json")) if config is not None else None


def expected_scale_shapes(shape: tuple[int, ...], scheme: FP8Scheme) -> list[tuple[int, ...]]:
    """The scale shapes the scheme allows for a weight of ``shape`` [..., R, C]."""
    out: list[tuple[int, ...]] = []
    if len(shape) < 2:
        return [(), (1,)] if "tensor" in scheme.strategies else []
    *lead, rows, cols = shape
    if "block" in scheme.strategies:
        out.append((*lead, -(-rows // scheme.block[0]), -(-cols // scheme.block[1])))  # exact for any int
    if "channel" in scheme.strategies and not lead:
        out += [(rows, 1), (rows,)]
    if "tensor" in scheme.strategies:
        out += [(), (1,)]
    return out


@dataclass(frozen=True)
class FP8Plan:
    """Which tensors of a checkpoint are dequantized (weight -> its scale) and which are hidden
    from its readers (scales, activation scales)."""

    scheme: FP8Scheme | None
    scales: dict[str, str]  # FP8 weight name -> scale name
    hidden: frozenset[str]


def plan_fp8(entries: Mapping[str, Mapping[str, Any]], scheme: FP8Scheme | None, where: str) -> FP8Plan:
    """Checks a checkpoint's FP8 tensors against their scales from the safetensors headers
    (``entries``: name -> {dtype, shape}) before any tensor is read: an FP8 tensor without a
    scale, a scale of another shape than its weight's blocks / channels, a scale of another dtype
    or without an FP8 weight is refused naming it; so is a tensor stored as an integer or bool
    dtype outside the scales (``_check_float_slots``)."""
    fp8 = sorted(n for n, e in entries.items() if e["dtype"] in FP8_WEIGHT_DTYPES)
    other = sorted(n for n, e in entries.items() if e["dtype"] in OTHER_FP8)
    if other:
        raise QuantizationError(f"{where}: tensors stored as {sorted({entries[n]['dtype'] for n in other})} "
                                f"({other[:3]}); mcore_rl dequantizes F8_E4M3 weights only: convert the model "
                                "to bf16 first.")
    if scheme is None:
        if fp8:
            raise QuantizationError(f"{where}: tensors stored as FP8 ({fp8[:3]}{' ...' if len(fp8) > 3 else ''}) "
                                    "but config.json has no quantization_config saying how they are scaled; "
                                    "copy the model's original config.json.")
        _check_float_slots(entries, set(), where)
        return FP8Plan(None, {}, frozenset())
    suffix = "." + scheme.scale_suffix
    scales = {}
    for name in fp8:
        scale = name.removesuffix(".weight") + suffix
        if not name.endswith(".weight") or scale not in entries:
            raise QuantizationError(f"{where}: FP8 tensor {name!r} has no scale {scale!r}; reading its raw FP8 "
                                    "values as weights would be wrong: copy the complete checkpoint again.")
        _check_scale(name, entries[name]["shape"], scale, entries[scale], scheme, where)
        scales[name] = scale
    orphans = sorted(n for n in entries if n.endswith(suffix) and n not in scales.values())
    if orphans:
        weight = orphans[0].removesuffix(suffix) + ".weight"
        stored = entries[weight]["dtype"] if weight in entries else "absent"
        raise QuantizationError(f"{where}: scale {orphans[0]!r} belongs to no FP8 weight ({weight!r} is "
                                f"{stored}); the checkpoint is inconsistent: copy it again.")
    hidden = set(scales.values()) | {n for n in entries if n.endswith(ACTIVATION_SCALES)}
    _check_float_slots(entries, hidden, where)
    return FP8Plan(scheme, scales, frozenset(hidden))


def _check_float_slots(entries: Mapping[str, Mapping[str, Any]], hidden: set[str], where: str) -> None:
    """Every tensor a reader hands out is a float weight of the model (an unknown name is refused
    by the mapping): one stored as an integer or bool dtype (a damaged header, a quantized
    checkpoint without its config) would be cast and rounded silently, so it is refused here."""
    ints = sorted(n for n, e in entries.items() if n not in hidden and e["dtype"] in INTEGER_DTYPES)
    if ints:
        raise QuantizationError(
            f"{where}: tensor {ints[0]!r} is stored as {entries[ints[0]]['dtype']}"
            f"{f' (and {len(ints) - 1} more: {ints[1:4]})' if len(ints) > 1 else ''}, an integer dtype, where the "
            "model expects a float weight; its values would be cast and rounded: the header is damaged or the "
            "checkpoint is quantized without a quantization_config saying how: use the model's float release "
            "or copy the checkpoint again.")


def _check_scale(name: str, shape: list[int], scale: str, entry: Mapping[str, Any], scheme: FP8Scheme,
                 where: str) -> None:
    if entry["dtype"] not in SCALE_DTYPES:
        raise QuantizationError(f"{where}: scale {scale!r} is stored as {entry['dtype']}; scales are read as "
                                f"{'/'.join(SCALE_DTYPES)}: convert the checkpoint's scales first.")
    allowed = expected_scale_shapes(tuple(shape), scheme)
    if tuple(entry["shape"]) not in allowed:
        raise QuantizationError(
            f"{where}: scale {scale!r} has shape {list(entry['shape'])}, its FP8 weight {name!r} {list(shape)} "
            f"needs one of {[list(s) for s in allowed]} ({scheme.method}, {'/'.join(sorted(scheme.strategies))}"
            f"{f', block {list(scheme.block)}' if scheme.block else ''}); the scale does not belong to this "
            "weight or config.json's quantization_config does not match the checkpoint.")


_DAMAGED = "the checkpoint's file is damaged (block-FP8 releases carry no checksums): download it again"
_NARROW_FIX = "read it in bf16 or fp32 (hf_to_mcore.py --dtype bf16|fp32)"


def _at(index: tuple[int, ...], row0: int, block: tuple[int, int] | None) -> str:
    """``[..., row, col]`` of an element (``row0`` added to its row), and its block when blocked."""
    *lead, r, c = index
    where = f"[{', '.join(map(str, (*lead, row0 + r, c)))}]"
    if block is None:
        return where
    return f"{where} in block [{', '.join(map(str, (*lead, (row0 + r) // block[0], c // block[1])))}]"


def _check_scale_values(s: torch.Tensor, name: str, what: Callable[[tuple[int, ...]], str]) -> None:
    """A NaN, inf or negative scale (fp32 ``s``) is refused naming what the first one scales."""
    bad = ~torch.isfinite(s) | (s < 0)
    if bool(bad.any()):
        where = tuple(int(i) for i in torch.nonzero(bad)[0]) if s.dim() else ()
        raise QuantizationError(f"{name}: {int(bad.sum())} scale(s) NaN, inf or negative, the first {s[where].item()} "
                                f"scales {what(where)}; a scale is finite and >= 0: {_DAMAGED}.")


def _product(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype, name: str, row0: int,
             block: tuple[int, int] | None, zeros: bool) -> torch.Tensor:
    """``q`` (float8 [..., r, C], rows ``row0``.. of the weight) times ``s`` (fp32, broadcast to
    ``q``) in fp32, rounded to ``dtype``, checked: a NaN encoding among the FP8 values, a zero
    scale on non-zero values (``zeros``: some scale is 0; a zero scale of an all-zero block is
    legal, it gives the block's zeros), a product beyond float32 (an overflowing scale) and a
    value beyond ``dtype`` (``casts.cast_checked``) are refused naming the element and block."""
    bits = q.view(torch.uint8) & 0x7F  # the magnitude bits; e4m3fn's NaN is S.1111.111, it has no inf
    for bad, what in ((bits == 0x7F, "FP8 value(s) are NaN encodings (0x7F/0xFF)"),
                      ((s.expand(q.shape) == 0) & (bits != 0) if zeros else None,
                       "non-zero FP8 value(s) have a zero scale (the block would read as zeros)")):
        if bad is not None and bool(bad.any()):
            where = tuple(int(i) for i in torch.nonzero(bad)[0])
            raise QuantizationError(f"{name}: {int(bad.sum())} {what}, the first at {_at(where, row0, block)}; "
                                    f"{_DAMAGED}.")
    prod = q.float() * s
    if not bool(torch.isfinite(prod).all()):
        where = tuple(int(i) for i in torch.nonzero(~torch.isfinite(prod))[0])
        raise QuantizationError(f"{name}: FP8 value {q[where].float().item()} times its scale "
                                f"{s.expand(q.shape)[where].item():.6g} at {_at(where, row0, block)} overflows "
                                f"float32: the scale is damaged; {_DAMAGED}.")
    return cast_checked(prod, dtype, name, _NARROW_FIX)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, scheme: FP8Scheme,
               dtype: torch.dtype = torch.float32, name: str = "the weight") -> torch.Tensor:
    """``weight`` (float8_e4m3fn [..., R, C]) times ``scale`` (per block [..., ceil(R/b0),
    ceil(C/b1)], per channel [R, 1] / [R], per tensor [] / [1]) in fp32, rounded once to ``dtype``.
    Block rows are done one band of b0 rows at a time: memory is the output plus one band.
    Values are checked (``_check_scale_values``, ``_product``): a damaged scale or FP8 value, or
    a product ``dtype`` cannot hold, is a QuantizationError / CastOverflowError naming it."""
    shape, wshape = tuple(scale.shape), tuple(weight.shape)
    if shape not in expected_scale_shapes(wshape, scheme):
        raise QuantizationError(f"scale of {name} has shape {list(shape)}, the weight {list(wshape)} needs one of "
                                f"{[list(s) for s in expected_scale_shapes(wshape, scheme)]}.")
    s = scale.float()
    zeros = bool((s == 0).any())
    blocks = len(wshape) >= 2 and "block" in scheme.strategies and shape == expected_scale_shapes(wshape, scheme)[0]
    if not blocks:  # per tensor [] / [1], or per channel [R, 1] / [R]
        tensor = shape in ((), (1,))
        _check_scale_values(s, name, lambda i: "the whole tensor" if tensor else f"row {i[0]}")
        per = s.reshape(()) if tensor else s.reshape(wshape[0], 1)
        return _product(weight, per, dtype, name, 0, None, zeros)
    b0, b1 = scheme.block[0], min(scheme.block[1], max(1, wshape[-1]))  # a block wider than the weight is the weight
    _check_scale_values(s, name, lambda i: f"block {list(i)} (rows {i[-2] * b0}.., cols {i[-1] * b1}..)")
    out = torch.empty(wshape, dtype=dtype)  # host: file format
    for i in range(shape[-2]):
        band = slice(i * b0, (i + 1) * b0)
        row_scale = s[..., i, :].repeat_interleave(b1, dim=-1)[..., : wshape[-1]].unsqueeze(-2)
        out[..., band, :] = _product(weight[..., band, :], row_scale, dtype, name, i * b0, scheme.block, zeros)
    return out
