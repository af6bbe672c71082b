"""MXFP4 checkpoints read in HF-name space (gpt-oss): a parameter ``X`` stored as ``X_blocks`` +
``X_scales`` (``mxfp4_format``) is presented as ``X``, dequantized (``mxfp4.dequantize_mxfp4``)
when read, before the mapping; the blocks and scales themselves are hidden.

``quantization_config`` ``{"quant_method": "mxfp4", "modules_to_not_convert": [...]}``: every
pair is checked from the safetensors headers before any tensor is read: blocks without their
scales or scales without their blocks, a dtype other than U8, blocks not [..., rows, G, 16] or
scales not [..., rows, G] of the same leading shape, ``X`` stored both plain and as blocks, and
a module ``modules_to_not_convert`` lists (transformers' matching: a regex from the start up to
a module boundary, or a suffix) stored as blocks are MXFP4Errors naming the tensor. Under an
mxfp4 config every name ending in ``_blocks`` / ``_scales`` is such a part. Without any
``quantization_config``, U8 ``*_blocks`` tensors are refused naming the missing config. Other
quantization methods are ``fp8_dequant``'s (refused unless FP8). Values (a scale byte 0xFF, a
value beyond the target dtype) are checked when a tensor is read, naming tensor and block.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from mcore_rl.mapping.fp8_dequant import FP8Plan, config_of_directory, plan_fp8, scheme_from_config
from mcore_rl.mapping.mxfp4 import MXFP4Error, unpacked_shape
from mcore_rl.mapping.mxfp4_format import BLOCKS_SUFFIX, BYTES_PER_BLOCK, SCALES_SUFFIX

METHOD = "mxfp4"
STORED_MXFP4 = "MXFP4"  # the hf_stored_dtypes record of a tensor the source stored as blocks + scales
_BOUNDARY = r"(?:(?<=\.)|(?=\.|$))"


@dataclass(frozen=True)
class MXFP4Plan:
    """Which HF parameters a checkpoint stores as MXFP4: ``tensors`` X -> (X_blocks, X_scales),
    ``shapes`` X -> the dequantized shape [*lead, cols, rows]; ``hidden``: the parts' names.
    ``active``: the config declares quant_method mxfp4 (even when no tensor is stored so)."""

    active: bool = False
    tensors: dict[str, tuple[str, str]] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    hidden: frozenset[str] = frozenset()


def _patterns(q: Mapping[str, Any], where: str) -> list[tuple[str, re.Pattern]]:
    """``modules_to_not_convert`` compiled (None: none); a non-list, a non-string entry or an
    invalid regex is an MXFP4Error naming it."""
    listed = q.get("modules_to_not_convert")
    if listed is None:
        return []
    if not isinstance(listed, list) or not all(isinstance(p, str) and p for p in listed):
        raise MXFP4Error(f"{where}: quantization_config.modules_to_not_convert={listed!r} is not a list of module "
                         "names; fix config.json.")
    out = []
    for p in listed:
        try:
            out.append((p, re.compile(rf"(?:{p}){_BOUNDARY}")))
        except re.error as e:
            raise MXFP4Error(f"{where}: quantization_config.modules_to_not_convert entry {p!r} is not a valid "
                             f"pattern ({e}); fix config.json.") from None
    return out


def _listed(name: str, patterns: list[tuple[str, re.Pattern]]) -> str | None:
    """The pattern that keeps ``name`` (a parameter; its module is the name less the last part)
    unquantized, as transformers' should_convert_module matches it; None when none does."""
    module = name.rsplit(".", 1)[0]
    for key, p in patterns:
        if any(p.match(n) or n.endswith(key) for n in (module, name)):
            return key
    return None


def _pairs(entries: Mapping[str, Mapping[str, Any]], where: str) -> dict[str, tuple[str, str]]:
    """X -> (X_blocks, X_scales) for every part name; a part without its partner is refused."""
    pairs = {}
    for name in sorted(entries):
        for suffix, other in ((BLOCKS_SUFFIX, SCALES_SUFFIX), (SCALES_SUFFIX, BLOCKS_SUFFIX)):
            if name.endswith(suffix):
                base = name[: -len(suffix)]
                if base + other not in entries:
                    raise MXFP4Error(f"{where}: MXFP4 {suffix[1:]} {name!r} without its {other[1:]} {base + other!r}; "
                                     "the checkpoint is incomplete: copy it again.")
                pairs[base] = (base + BLOCKS_SUFFIX, base + SCALES_SUFFIX)
    return pairs


def _check_pair(base: str, blocks: Mapping[str, Any], scales: Mapping[str, Any], where: str) -> None:
    names = (base + BLOCKS_SUFFIX, base + SCALES_SUFFIX)
    for name, entry in zip(names, (blocks, scales)):
        if entry["dtype"] != "U8":
            raise MXFP4Error(f"{where}: MXFP4 tensor {name!r} is stored as {entry['dtype']}; blocks and scales are "
                             "U8: the header is damaged or the tensor is not MXFP4: copy the checkpoint again.")
    b, s = list(blocks["shape"]), list(scales["shape"])
    if len(b) < 3 or b[-1] != BYTES_PER_BLOCK or b[:-1] != s:
        raise MXFP4Error(f"{where}: MXFP4 blocks {names[0]!r} {b} and scales {names[1]!r} {s} do not fit (blocks "
                         f"[..., rows, G, {BYTES_PER_BLOCK}], scales [..., rows, G]); the checkpoint is damaged: copy "
                         "it again.")


def plan_mxfp4(entries: Mapping[str, Mapping[str, Any]], config: Mapping[str, Any] | None,
               where: str) -> MXFP4Plan:
    """The MXFP4 parameters of a checkpoint from its headers (``entries``: name -> {dtype,
    shape}) and config.json (``config``), checked as the module docstring says."""
    q = config.get("quantization_config") if isinstance(config, Mapping) else None
    if not isinstance(q, Mapping) or q.get("quant_method") != METHOD:
        stray = sorted(n for n, e in entries.items() if n.endswith(BLOCKS_SUFFIX) and e["dtype"] == "U8")
        if stray and q is None:
            raise MXFP4Error(f"{where}: tensors stored as MXFP4 blocks ({stray[:3]}) but config.json has no "
                             "quantization_config saying quant_method 'mxfp4'; copy the model's original config.json.")
        return MXFP4Plan()
    patterns = _patterns(q, where)
    pairs = _pairs(entries, where)
    shapes = {}
    for base, (blocks, scales) in pairs.items():
        _check_pair(base, entries[blocks], entries[scales], where)
        if base in entries:
            raise MXFP4Error(f"{where}: {base!r} is stored both as a tensor and as MXFP4 blocks {blocks!r}; the "
                             "checkpoint is inconsistent: copy it again.")
        key = _listed(base, patterns)
        if key is not None:
            raise MXFP4Error(f"{where}: {base!r} is stored as MXFP4 blocks {blocks!r}, but quantization_config."
                             f"modules_to_not_convert lists it ({key!r}); config.json does not match the checkpoint: "
                             "copy the model's original config.json.")
        shapes[base] = unpacked_shape(tuple(entries[blocks]["shape"]))
    hidden = frozenset(n for pair in pairs.values() for n in pair)
    return MXFP4Plan(True, pairs, shapes, hidden)


def plan_quantized(entries: Mapping[str, Mapping[str, Any]], directory: str) -> tuple[FP8Plan, MXFP4Plan]:
    """The FP8 and MXFP4 plans of the checkpoint in ``directory`` (``entries``: every shard's
    header entries): MXFP4 parts are planned first and left out of the FP8 plan, whose checks
    (other methods refused, integer dtypes in float slots) cover every other tensor."""
    config = config_of_directory(directory)
    where = directory
    scheme = scheme_from_config(config, f"{directory}/config.json") if config is not None else None
    mx = plan_mxfp4(entries, config, where)
    fp8 = plan_fp8({k: v for k, v in entries.items() if k not in mx.hidden}, scheme, where)
    return fp8, mx
