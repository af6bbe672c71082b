"""GGUF (llama.cpp) checkpoints -> HF-named fp32 tensors, dequantized explicitly.

The names are a table written as data (one regex for the layer index only); a tensor without an
entry is an error naming it. llama.cpp's converter reorders the rows of ``q_proj`` and ``k_proj``
of llama-family models per head (interleaved rotary halves, ``[h, 2, d/2] -> [h, d/2, 2]``);
``unpermute_rotary_rows`` undoes it, so the result is the HF model's own layout.
Quantized blocks (Q4_0, Q4_1, Q8_0, K-quants, ...) are dequantized by the ``gguf`` package into
fp32, once: what comes out is the model every later comparison uses.
"""
from __future__ import annotations

import re
from typing import Any, Iterator

import torch

from mcore_rl.errors import McoreRLError

Tensor = torch.Tensor

# GGUF name -> HF name for llama-family decoders; "{}" is the layer index
LLAMA_GGUF_TO_HF: dict[str, str] = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{}.attn_norm.weight": "model.layers.{}.input_layernorm.weight",
    "blk.{}.attn_q.weight": "model.layers.{}.self_attn.q_proj.weight",
    "blk.{}.attn_k.weight": "model.layers.{}.self_attn.k_proj.weight",
    "blk.{}.attn_v.weight": "model.layers.{}.self_attn.v_proj.weight",
    "blk.{}.attn_output.weight": "model.layers.{}.self_attn.o_proj.weight",
    "blk.{}.ffn_norm.weight": "model.layers.{}.post_attention_layernorm.weight",
    "blk.{}.ffn_gate.weight": "model.layers.{}.mlp.gate_proj.weight",
    "blk.{}.ffn_up.weight": "model.layers.{}.mlp.up_proj.weight",
    "blk.{}.ffn_down.weight": "model.layers.{}.mlp.down_proj.weight",
}
# GGUF tables per ``general.architecture``; the rotary rows of these tensors are reordered
GGUF_TABLES: dict[str, dict[str, str]] = {"llama": LLAMA_GGUF_TO_HF}
ROTARY_PERMUTED = {"attn_q.weight": "head_count", "attn_k.weight": "head_count_kv"}
_LAYER = re.compile(r"^blk\.(\d+)\.")


class GGUFError(McoreRLError, ValueError):
    """A GGUF file mcore_rl cannot read into HF tensors; the message names the value and the fix."""


def hf_name(gguf_name: str, table: dict[str, str]) -> str:
    """The HF name of ``gguf_name`` (layer index carried over); an unmapped name is an error."""
    match = _LAYER.match(gguf_name)
    key = _LAYER.sub("blk.{}.", gguf_name) if match else gguf_name
    if key not in table:
        raise GGUFError(f"GGUF tensor {gguf_name!r} has no HF name in the mapping table; known: "
                        f"{sorted(table)[:6]}...; add it to mcore_rl/mapping/gguf.py.")
    return table[key].format(match.group(1)) if match else table[key]


def unpermute_rotary_rows(weight: Tensor, heads: int) -> Tensor:
    """[heads * d, in] with each head's rows in llama.cpp's interleaved order -> HF's order
    (first all even rotary components, then all odd ones: ``[h, d/2, 2] -> [h, 2, d/2]``)."""
    rows = weight.shape[0]
    if rows % (2 * heads):
        raise GGUFError(f"a rotary projection of {rows} rows does not split into {heads} heads of even "
                        "size; the GGUF metadata's head counts do not match the weights.")
    d_half = rows // heads // 2
    return weight.reshape(heads, d_half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    if field is None:
        raise GGUFError(f"the GGUF file has no {key!r} field; it is not a complete llama.cpp model file.")
    return field.contents()


def gguf_architecture(reader: Any) -> str:
    """``general.architecture`` of an open ``gguf.GGUFReader``, checked against the tables."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_TABLES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; supported: {sorted(GGUF_TABLES)}.")
    return arch


def read_gguf_tensors(reader: Any) -> Iterator[tuple[str, Tensor]]:
    """(HF name, fp32 tensor in HF layout) for every tensor of an open ``gguf.GGUFReader``, one
    at a time (peak memory: one dequantized tensor)."""
    from gguf.quants import dequantize

    arch = gguf_architecture(reader)
    table = GGUF_TABLES[arch]
    heads = {k: int(_field(reader, f"{arch}.attention.{v}")) for k, v in ROTARY_PERMUTED.items()}
    for t in reader.tensors:
        name = hf_name(t.name, table)
        try:
            values = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        except NotImplementedError as e:
            raise GGUFError(f"GGUF tensor {t.name!r} has quantization {t.tensor_type.name}, which the installed "
                            f"gguf package cannot dequantize ({e}); upgrade gguf.") from e
        for suffix, count in heads.items():
            if t.name.endswith(suffix):
                values = unpermute_rotary_rows(values, count)
        yield name, values
