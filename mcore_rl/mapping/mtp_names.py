"""HF names of multi-token-prediction (MTP) layers: where a checkpoint keeps an MTP layer's
decoder layer (``MappingTable.mtp_layer_prefix``: DeepSeek-V3 / GLM-4.5 number it as HF layer
``num_hidden_layers + i``, Qwen3-Next / Qwen3.5 keep it under ``mtp.layers.{i}``), which depth a
tensor belongs to, which tensors are MTP ones. Pure string work (the converters' start-up reads
the count through it)."""
from __future__ import annotations

from typing import Iterable

DEFAULT_PREFIX = "model.layers.{layer}"  # DeepSeek-V3 / GLM-4.5: MTP layer i is HF layer num_layers + i


def mtp_layer_prefix(prefix: str, num_layers: int, depth: int) -> str:
    """The HF prefix (no trailing dot) of MTP layer ``depth``'s decoder layer under the table's
    ``prefix`` template (``MappingTable.mtp_layer_prefix``)."""
    return prefix.format(layer=num_layers + depth, mtp=depth)


def own_namespace(prefix: str) -> str | None:
    """'mtp.' for a prefix outside ``model.*`` (every tensor under it is an MTP one), else None."""
    return None if prefix.startswith("model.") else prefix.split(".", 1)[0] + "."


def mtp_depth(key: str, num_layers: int, prefix: str = DEFAULT_PREFIX) -> int | None:
    """The MTP depth (0-based) whose decoder layer HF tensor ``key`` belongs to (None: none)."""
    head = prefix.split("{", 1)[0]
    if not key.startswith(head):
        return None
    index = key[len(head):].split(".", 1)[0]
    if not index.isdigit() or "." not in key[len(head):]:
        return None
    base = num_layers if "{layer}" in prefix else 0
    return int(index) - base if int(index) >= base else None


def is_mtp_key(key: str, num_layers: int, count: int, prefix: str = DEFAULT_PREFIX) -> bool:
    """Whether HF tensor ``key`` belongs to one of ``count`` MTP layers (a namespace of their
    own, Qwen's ``mtp.*``: any tensor in it)."""
    space = own_namespace(prefix)
    if space is not None:
        return key.startswith(space)
    depth = mtp_depth(key, num_layers, prefix)
    return depth is not None and depth < count


def mtp_layers_in(keys: Iterable[str], num_layers: int, prefix: str = DEFAULT_PREFIX) -> list[int]:
    """Sorted MTP depths (0-based) whose decoder-layer HF tensors (``prefix``) are in ``keys``."""
    return sorted({d for k in keys if (d := mtp_depth(k, num_layers, prefix)) is not None})
