"""transformers' ``padding_idx`` on megatron's word embedding: the pad token's row is looked up
as any other but gets no gradient through the lookup.

transformers builds the word embedding of every supported decoder as ``nn.Embedding(vocab,
hidden, padding_idx=config.pad_token_id)`` (``ArchSpec.pad_row_field``); megatron-core's
``VocabParallelEmbedding`` has no padding_idx. Where the pad token also occurs as a real token
(SmolLM2's pad ``<|im_end|>`` ends every chat turn) megatron would train its row through the
lookup and transformers (verl's FSDP engine) would not.

A forward hook on the word embedding replaces its output at the positions whose input id is the
pad id by the same values, detached: the forward is unchanged, the backward sends those positions
nothing, so no TP rank's lookup writes into the row. A tied output projection still trains the
row (it uses the weight itself, not the lookup; with PP > 1 the last stage's copy and megatron's
all-reduce of the tied gradients are untouched), as transformers' tied ``lm_head`` does.

The hooked output's layout: [b, s, h] (the lookup's ids, under CP this rank's columns, packed:
this rank's stream places), or [s/tp, b, h] when the embedding reduce-scatters over the sequence
(sequence parallel): rank r holds sequence rows r * s/tp ... (r + 1) * s/tp - 1.
"""
from __future__ import annotations

from typing import Literal, get_args

import torch
from torch.utils.hooks import RemovableHandle

from mcore_rl.errors import McoreRLError
from mcore_rl.models.hf_config import ConfigError

Tensor = torch.Tensor
# "transformers": the pad row gets no gradient through the lookup (nn.Embedding padding_idx);
# "megatron": it does (megatron-core's VocabParallelEmbedding, no padding_idx)
PadEmbeddingGrad = Literal["transformers", "megatron"]


class EmbeddingLayoutError(McoreRLError, RuntimeError):
    """The word embedding's output is not laid out as this module expects."""


class _HoldPadRow:
    """Forward hook of a ``VocabParallelEmbedding``: output rows of pad tokens detached."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, module: torch.nn.Module, inputs: tuple, output: Tensor) -> Tensor | None:
        if not output.requires_grad:  # no backward (inference, a frozen reference model)
            return None
        hit = pad_positions(inputs[0] == self.pad_token_id, output, module)
        return torch.where(hit, output.detach(), output)


def pad_positions(is_pad: Tensor, output: Tensor, embedding: torch.nn.Module) -> Tensor:
    """``is_pad`` [b, s] (the lookup's ids) in the layout of ``embedding``'s ``output``:
    bool [b, s, 1], or [s/tp, b, 1] for this TP rank when the embedding reduce-scatters."""
    if getattr(embedding, "reduce_scatter_embeddings", False):
        rows = output.shape[0]
        rank = embedding.tp_group.rank()
        is_pad = is_pad.t()[rank * rows : (rank + 1) * rows]
    if is_pad.shape != output.shape[:2]:
        raise EmbeddingLayoutError(
            f"the word embedding's output {tuple(output.shape)} does not match its ids' pad mask "
            f"{tuple(is_pad.shape)}; megatron-core's VocabParallelEmbedding layout changed "
            "(mcore_rl/models/padding_idx.py)."
        )
    return is_pad.unsqueeze(-1)


def hold_pad_row(chunks: list[torch.nn.Module], pad_token_id: int | None,
                 mode: PadEmbeddingGrad = "transformers") -> list[RemovableHandle]:
    """Hooks the word embedding of the ``chunks`` that have one (the first pipeline stage) so
    that ``pad_token_id``'s row gets no gradient through the lookup, with ``mode`` =
    'transformers'; 'megatron' or a None pad id change nothing. Returns the hook handles."""
    if mode not in get_args(PadEmbeddingGrad):
        raise ConfigError(
            f"pad_embedding_grad={mode!r}; use 'transformers' (the pad token's embedding row gets no "
            "gradient through the lookup, as nn.Embedding(padding_idx=pad_token_id)) or 'megatron' "
            "(it does)."
        )
    if mode == "megatron" or pad_token_id is None:
        return []
    hook = _HoldPadRow(pad_token_id)
    return [
        chunk.embedding.word_embeddings.register_forward_hook(hook)
        for chunk in chunks
        if getattr(chunk, "embedding", None) is not None
    ]
