"""The one architecture registry: HF ``model_type`` -> what differs between architectures, as data."""
from __future__ import annotations

from dataclasses import dataclass

from mcore_rl.mapping.tables import LLAMA, QWEN2, QWEN3, MappingTable


class UnknownArchitectureError(ValueError):
    """A HF model_type with no registry entry."""


@dataclass(frozen=True)
class ArchSpec:
    """Per-architecture facts: HF classes, weight table and the switches the builder reads."""

    model_type: str
    hf_causal_lm: str
    hf_token_classification: str
    table: MappingTable
    qkv_bias: bool = False
    qk_norm: bool = False
    # mistral applies `sliding_window` unless it is null; qwen only with use_sliding_window=True
    sliding_window_default: bool = False


ARCHITECTURES: dict[str, ArchSpec] = {
    spec.model_type: spec
    for spec in (
        ArchSpec("llama", "LlamaForCausalLM", "LlamaForTokenClassification", LLAMA),
        ArchSpec(
            "mistral",
            "MistralForCausalLM",
            "MistralForTokenClassification",
            LLAMA,
            sliding_window_default=True,
        ),
        ArchSpec("qwen2", "Qwen2ForCausalLM", "Qwen2ForTokenClassification", QWEN2, qkv_bias=True),
        ArchSpec("qwen3", "Qwen3ForCausalLM", "Qwen3ForTokenClassification", QWEN3, qk_norm=True),
    )
}


def lookup_arch(model_type: str) -> ArchSpec:
    """The registry entry for ``model_type``; unknown types list the supported ones."""
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise UnknownArchitectureError(
            f"unknown architecture model_type={model_type!r}; supported: "
            f"{', '.join(sorted(ARCHITECTURES))}. Add an ArchSpec to mcore_rl/models/registry.py "
            "to support another."
        ) from None
