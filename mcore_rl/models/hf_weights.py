"""HF weights in memory: load a HF checkpoint into model chunks, read HF tensors back out."""
from __future__ import annotations

import os
from typing import Callable, Iterator, Mapping

import torch

from mcore_rl.mapping.hf_io import SafetensorsReader
from mcore_rl.mapping.transforms import Dims
from mcore_rl.mapping.weights import WeightMap, iter_hf_buckets, load_hf_weights
from mcore_rl.models.builder import Role, padded_vocab_size
from mcore_rl.models.hf_config import ConfigError, ModelArgs


def weight_map(args: ModelArgs, role: Role, tp: int, with_head: bool = True) -> WeightMap:
    """The mapping rows and sizes for ``args`` built as ``role`` with TP size ``tp``;
    ``with_head=False`` leaves the role's head out (it keeps its fresh initialisation)."""
    dims = Dims(
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        vocab_size=args.vocab_size,
        padded_vocab_size=padded_vocab_size(args.vocab_size, tp),
    )
    table = args.arch.table
    rows = table.rows(role)
    head = table.lm_head if role == "actor" else table.value_head
    if not with_head:
        rows = {k: v for k, v in rows.items() if k not in head}
    return WeightMap(
        model_type=args.arch.model_type,
        rows=rows,
        dims=dims,
        num_layers=args.num_layers,
        tied_embeddings=args.tie_embeddings and role == "actor",
        dense_only=frozenset(table.dense_mlp),
        moe_only=frozenset(table.moe_mlp),
        moe_layers=args.moe.moe_layers if args.moe else None,
        num_experts=args.moe.num_experts if args.moe else 0,
        skipped=frozenset() if with_head else frozenset(head),
    )


def load_hf(
    chunks: list[torch.nn.Module],
    args: ModelArgs,
    role: Role,
    source: str | os.PathLike | Mapping[str, torch.Tensor],
    init_value_head: bool = False,
) -> None:
    """Loads HF weights (a directory of safetensors, or name -> tensor) into this rank's chunks.

    ``init_value_head=True`` (critic only) starts a critic from a causal-LM checkpoint: the
    trunk is loaded, the LM head ignored and the value head keeps its initialisation.
    """
    from megatron.core import parallel_state

    if init_value_head and role != "critic":
        raise ConfigError("init_value_head=True is for role='critic' only; an actor keeps its LM head.")
    if isinstance(source, (str, os.PathLike)):
        source = SafetensorsReader(source)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    wmap = weight_map(args, role, tp, with_head=not init_value_head)
    ignore = {"lm_head.weight"} if init_value_head else set()
    load_hf_weights(chunks, wmap, source, ignore=ignore)


DEFAULT_BUCKET_BYTES = 512 << 20


def export_hf_buckets(
    chunks: list[torch.nn.Module],
    args: ModelArgs,
    role: Role,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p.data,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full HF tensors of a live sharded model in buckets of at most ``bucket_bytes`` (a larger
    tensor alone), the same on every rank, e.g. to feed co-located rollout engines.
    Collective: every rank iterates to the end. See ``mapping.weights.iter_hf_buckets``."""
    from megatron.core import parallel_state

    tp = parallel_state.get_tensor_model_parallel_world_size()
    return iter_hf_buckets(chunks, weight_map(args, role, tp), bucket_bytes, tensor_of)


def export_hf(
    chunks: list[torch.nn.Module],
    args: ModelArgs,
    role: Role,
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p.data,
) -> dict[str, torch.Tensor]:
    """The full HF state dict (or, with ``tensor_of=lambda p: p.main_grad``, the gradients under
    HF names) on every rank: ``export_hf_buckets`` collected into one dict."""
    buckets = export_hf_buckets(chunks, args, role, tensor_of=tensor_of)
    return {name: tensor for bucket in buckets for name, tensor in bucket}
