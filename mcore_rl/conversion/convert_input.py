"""The converter's checks of its input (HF directory) and output path, without torch or megatron:
``hf_to_mcore.py`` runs them before its heavy imports, so bad input fails in a fraction of a
second, and ``convert()`` runs them again for library callers.

Every file name read from the HF directory (an index's ``weight_map``, the listing) goes through
``paths.contained``; shard headers are checked against the file size (a truncated copy is named).
"""
from __future__ import annotations

import json
import math
import os
from typing import Literal

from mcore_rl.errors import CheckpointError, McoreRLError
from mcore_rl.fileio.files import hf_side_files
from mcore_rl.fileio.output_dir import check_replaceable, input_overlap, refuse_file, settle_output
from mcore_rl.fileio.paths import contained
from mcore_rl.fileio.safetensors_header import check_safetensors
from mcore_rl.mapping.mxfp4_import import plan_quantized
from mcore_rl.mapping.hf_io import SafetensorsFormatError, read_weight_map
from mcore_rl.models.registry import WRAPPERS
from mcore_rl.fileio.safetensors_write import HF_DTYPE_NAMES  # noqa: F401 - callers import it from here

INDEX_FILE = "model.safetensors.index.json"
DtypeName = Literal["fp32", "bf16", "fp16"]
# converter --dtype -> the name transformers writes in config.json ("dtype" / "torch_dtype")


class ConvertError(CheckpointError):
    """Bad converter input (missing or damaged HF files, an occupied output, a wrong split)."""


def read_config(hf_dir: str) -> dict:
    """config.json of ``hf_dir`` as a dict; errors name a missing directory or a damaged file."""
    if not os.path.isdir(hf_dir):
        raise ConvertError(f"--hf_model_path {hf_dir!r} is not a directory; pass the HF model directory "
                           "(config.json + *.safetensors).")
    path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(path):
        raise ConvertError(f"{hf_dir!r} has no config.json; pass a HF model directory.")
    try:
        with open(path) as f:
            config = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConvertError(f"{path} is not valid JSON ({e}); fix or re-export the file.") from None
    if not isinstance(config, dict):
        raise ConvertError(f"{path} holds a JSON {type(config).__name__}, not an object; it is not a HF config.")
    return config


def role_from_config(hf_dir: str) -> Literal["actor", "critic"]:
    """``*ForCausalLM`` (or a vision-language wrapper's class) -> actor,
    ``*ForTokenClassification`` / ``*ForSequenceClassification`` -> critic, from config.json
    ``architectures``."""
    config = read_config(hf_dir)
    archs = config.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConvertError(f"{hf_dir}/config.json: architectures={archs!r} is not a list of class names (e.g. "
                           "[\"LlamaForCausalLM\"]); fix it, or pass --role actor|critic.")
    wrapper = WRAPPERS.get(config.get("model_type"))  # a vision-language wrapper: its text model is an actor
    for name in archs:
        if name.endswith("ForCausalLM") or (wrapper is not None and name == wrapper.hf_class):
            return "actor"
        if name.endswith(("ForTokenClassification", "ForSequenceClassification")):
            return "critic"
    raise ConvertError(f"{hf_dir}/config.json: architectures={archs!r} name neither a *ForCausalLM (actor) "
                       "nor a *ForTokenClassification / *ForSequenceClassification (critic); pass --role "
                       "actor|critic.")


class DtypeWarning(McoreRLError, UserWarning):
    """config.json states a dtype the weights are not stored in (the weights' dtype is kept).
    An McoreRLError too: where warnings are turned into errors it is a refusal like the others."""


def stated_dtype(hf_dir: str) -> DtypeName | None:
    """The dtype config.json states (``dtype``, else ``torch_dtype``) as a --dtype name; None
    when neither is set; an error for a dtype the converter cannot write."""
    config = read_config(hf_dir)
    stated = config.get("dtype") or config.get("torch_dtype")
    if stated is None:
        return None
    by_hf = {v: k for k, v in HF_DTYPE_NAMES.items()}
    if not isinstance(stated, str) or stated.removeprefix("torch.") not in by_hf:
        raise ConvertError(f"{hf_dir}/config.json states dtype {stated!r}, which the converter cannot keep; "
                           f"pass --dtype {'|'.join(HF_DTYPE_NAMES)}.")
    return by_hf[stated.removeprefix("torch.")]  # type: ignore[return-value]


_FLOAT_NAMES = {"F32": "fp32", "BF16": "bf16", "F16": "fp16"}
# tensors the model holds in fp32 whatever --dtype says (megatron's router keeps its expert bias fp32)
_KEPT_FP32 = ("e_score_correction_bias",)


def stored_tensors(hf_dir: str) -> tuple[dict[str, list[tuple[str, int]]], str | None]:
    """The tensors read as stored, by --dtype name: [(name, elements)]; and the quantized format
    the checkpoint holds weights in ("FP8", "MXFP4" or None; those weights, dequantized, their
    scales and blocks are not among the tensors). Other safetensors float types are refused:
    the converter writes fp32, bf16 or fp16."""
    entries: dict[str, dict] = {}
    for path in shard_files(hf_dir):
        entries.update(check_shard(path))
    plan, mx = plan_quantized(entries, hf_dir)
    plain = {n: e for n, e in entries.items() if n not in plan.scales and n not in plan.hidden | mx.hidden}
    floats = {e["dtype"] for e in plain.values() if e["dtype"].startswith(("F", "BF", "C"))}
    other = sorted(floats - set(_FLOAT_NAMES))
    if other:
        raise ConvertError(f"{hf_dir}: tensors stored as {other}, which the converter does not read; it "
                           "converts fp32, bf16 and fp16 weights (and FP8 weights with their scales): convert "
                           "the model to one of them first.")
    out: dict[str, list[tuple[str, int]]] = {}
    for name, e in plain.items():
        if e["dtype"] in _FLOAT_NAMES:
            out.setdefault(_FLOAT_NAMES[e["dtype"]], []).append((name, math.prod(e["shape"])))
    return out, "FP8" if plan.scales else "MXFP4" if mx.tensors else None


def stored_dtypes(hf_dir: str) -> set[str]:
    """The floating-point dtypes the shards store their tensors in, as --dtype names (FP8
    weights and their scales left out: ``stored_tensors``)."""
    return set(stored_tensors(hf_dir)[0])


def _fp8_dtype(hf_dir: str, tensors: dict[str, list[tuple[str, int]]],
               fmt: str = "FP8") -> tuple[DtypeName, list[str]]:
    """An FP8 (or MXFP4: ``fmt``) checkpoint's default: the dtype of most other weights'
    elements (DeepSeek, Qwen3, GLM, gpt-oss: bf16), to which the fp32 products are rounded once
    (MXFP4 values are exact in bf16); and notes on other tensors rounded."""
    if not tensors:
        return "fp32", []
    width = {"fp16": 0, "bf16": 1, "fp32": 2}
    chosen: DtypeName = max(tensors, key=lambda d: (sum(n for _, n in tensors[d]), width[d]))  # type: ignore
    rounded = sorted(name for d, named in tensors.items() if d != chosen  # widening to fp32 is exact
                     for name, _ in named if chosen != "fp32" and not (d == "fp32" and name.endswith(_KEPT_FP32)))
    if not rounded:
        return chosen, []
    return chosen, [f"{hf_dir} holds {fmt} weights: they are dequantized in fp32 and rounded once to {chosen}, the "
                    f"dtype of most other weights; {len(rounded)} tensors stored in another dtype "
                    f"({rounded[:3]}) are rounded to {chosen} too; pass --dtype fp32 to keep every value exact"]


def resolve_dtype(hf_dir: str) -> tuple[DtypeName, str | None]:
    """The dtype the converter writes by default and a warning, if any: the weights' own dtype
    (never rounded); mixed float dtypes give the widest (fp32 when bf16 and fp16 are mixed, as
    neither holds the other); a config.json stating another dtype is named in the warning.
    FP8 and MXFP4 checkpoints (``_fp8_dtype``): the dtype of most of their other weights."""
    tensors, quantized = stored_tensors(hf_dir)
    stored = set(tensors)
    stated = stated_dtype(hf_dir)
    notes = []
    if quantized:
        chosen, notes = _fp8_dtype(hf_dir, tensors, quantized)
    elif not stored:  # no floating-point tensor at all: what the config says, else fp32
        chosen: DtypeName = stated or "fp32"
    else:
        chosen = next(iter(stored)) if len(stored) == 1 else "fp32"  # type: ignore[assignment]
    if len(stored) > 1 and not quantized:
        notes.append(f"the weights in {hf_dir} are stored in {sorted(stored)}; writing {chosen} (no tensor rounded)")
    if stated is not None and stated != chosen:
        notes.append(f"{hf_dir}/config.json states dtype {HF_DTYPE_NAMES[stated]} but the weights are stored in "
                     f"{'/'.join(sorted(stored))}; writing {chosen}, the weights' own, and the output's config "
                     f"says {HF_DTYPE_NAMES[chosen]}; pass --dtype {stated} to round them to the config's dtype")
    return chosen, "; ".join(notes) + "." if notes else None


def input_dtype(hf_dir: str) -> DtypeName:
    """The dtype the converter writes by default: the weights' own (``resolve_dtype``)."""
    return resolve_dtype(hf_dir)[0]


def shard_files(hf_dir: str) -> list[str]:
    """The safetensors files the checkpoint consists of (absolute paths, each inside ``hf_dir``);
    an index naming a missing file or a file outside the directory errors."""
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index):
        try:
            weight_map = read_weight_map(index)
        except SafetensorsFormatError as e:
            raise ConvertError(f"{e} (Or re-export the model with save_pretrained, or remove the index if one "
                               "*.safetensors file holds every tensor.)") from None
        paths = {name: contained(hf_dir, name, index, hub_cache=True) for name in set(weight_map.values())}
        missing = sorted(n for n, p in paths.items() if not os.path.isfile(p))
        if missing:
            raise ConvertError(f"{index} names shard files that do not exist: {missing}; copy the "
                               "complete checkpoint (every file the index lists).")
        return [paths[n] for n in sorted(paths)]
    names = sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors"))
    if not names:
        raise ConvertError(f"no *.safetensors weights in {hf_dir!r}; save the HF model with "
                           "save_pretrained(..., safe_serialization=True).")
    return [contained(hf_dir, n, f"the listing of {hf_dir}", hub_cache=True) for n in names]


def check_shard(path: str) -> dict:
    """A safetensors file whose header is not a JSON object of tensor entries, whose offsets do
    not match their dtype and shape or do not tile the data, or that promises more bytes than
    the file holds (a truncated copy), is refused; returns its tensor entries."""
    try:
        return check_safetensors(path)
    except CheckpointError as e:
        raise ConvertError(str(e)) from None


def check_input(hf_dir: str) -> list[str]:
    """Validates the HF directory (config.json, side files inside it, every shard named and complete,
    every tensor an index names present in the file it names); returns the shards."""
    read_config(hf_dir)
    hf_side_files(hf_dir)  # a tokenizer / config file linked out of the directory: refused before any write
    shards = shard_files(hf_dir)
    held = {path: check_shard(path) for path in shards}
    index = os.path.join(hf_dir, INDEX_FILE)
    if os.path.isfile(index):
        weight_map = read_weight_map(index)  # shard_files checked it
        absent = sorted(f"{name} ({file})" for name, file in weight_map.items()
                        if name not in held[contained(hf_dir, file, index, hub_cache=True)])
        if absent:
            raise ConvertError(f"{index} names tensors their files do not hold: {absent[:6]}"
                               f"{f' and {len(absent) - 6} more' if len(absent) > 6 else ''}; the index does not "
                               "match the shards: copy the complete checkpoint again or re-export it.")
    # FP8 weights and their scales, MXFP4 blocks and theirs (another quantization method: refused), from the headers
    plan_quantized({k: v for entries in held.values() for k, v in entries.items()}, hf_dir)
    return shards


def check_output(path: str, hf_dir: str, overwrite: bool) -> None:
    """Settles what an interrupted run left beside ``path``, then refuses a file, an output that
    overlaps the input on resolved paths (the same directory, inside it or containing it, or
    what a link under the input points at: even with ``overwrite``), a non-empty directory
    unless ``overwrite``, and with it anything but an earlier converter output
    (``fileio.output_dir``)."""
    settle_output(path, ConvertError)
    refuse_file(path, f"--output_path {path!r}", ConvertError)
    via = input_overlap(path, hf_dir)
    if via is not None:
        raise ConvertError(f"--output_path {path!r} overlaps --hf_model_path {hf_dir!r}{via} (the same directory, "
                           "or one inside the other); write the output to a directory outside the input "
                           "(--overwrite never replaces the input).")
    check_replaceable(path, overwrite, "model_dir", f"--output_path {path!r}", ConvertError)


def preflight(hf_dir: str, output_path: str, overwrite: bool, dtype: str | None, role: str | None) -> None:
    """Every check the CLI can make before importing torch/megatron, in the order a user fixes them."""
    check_input(hf_dir)
    if role is None:
        role_from_config(hf_dir)
    if dtype is None:
        resolve_dtype(hf_dir)  # a dtype it cannot write fails here; the warning is convert()'s
    check_output(output_path, hf_dir, overwrite)
    model_type = read_config(hf_dir).get("model_type")
    if not isinstance(model_type, str):
        raise ConvertError(f"{hf_dir}/config.json has no 'model_type'; it is not a HF model config.")
    from mcore_rl.models.registry import lookup_arch  # imports torch: the last check

    lookup_arch(model_type)
