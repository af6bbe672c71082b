"""HF weights in memory: load a HF checkpoint into model chunks, read HF tensors back out."""
from __future__ import annotations

import os
from typing import Callable, Iterator, Mapping

import torch

from mcore_rl.mapping.fp8_quant import BlockFp8
from mcore_rl.mapping.hf_io import SafetensorsReader
from mcore_rl.mapping.mtp import with_copies
from mcore_rl.mapping.weights import WeightMap, iter_hf_buckets, load_hf_weights
from mcore_rl.models.hf_config import ConfigError, ModelArgs
from mcore_rl.models.hf_layout import always_fused, carried_names, expert_layout, fused_buckets, hf_view, log_ignored
from mcore_rl.models.model_types import Role, padded_vocab_size


def weight_map(args: ModelArgs, role: Role, tp: int, with_head: bool = True) -> WeightMap:
    """The mapping rows and sizes for ``args`` built as ``role`` with TP size ``tp``;
    ``with_head=False`` leaves the role's head out (it keeps its fresh initialisation)."""
    dims = args.mapping_dims(padded_vocab_size(args.vocab_size, tp))
    table = args.arch.table
    rows = args.hf_rows(role)
    head = table.lm_head if role == "actor" else table.value_head
    if not with_head:
        rows = {k: v for k, v in rows.items() if k not in head}
    mtp = args.mtp_built if role == "actor" else 0
    if mtp:
        rows = with_copies(rows, table.mtp, args.num_layers, mtp, args.tie_embeddings)
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
        mtp_layers=args.mtp_layers,
        linear_layers=args.hybrid.linear_layers if args.hybrid else None,
        attention_only=frozenset(table.attention) if args.hybrid else frozenset(),
        linear_only=frozenset(table.linear_attention),
        mtp_rows=table.mtp if mtp else {},
        mtp_moe=bool(args.moe is not None and args.moe.moe_layers[-1]),
        mtp_prefix=table.mtp_layer_prefix,
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
    trunk is loaded, the LM head ignored and the value head keeps its initialisation. Otherwise
    a critic loads a ``*ForTokenClassification`` or ``*ForSequenceClassification`` directory with
    one label; a score head without bias (the sequence-classification reward head) gets bias 0.
    """
    from megatron.core import parallel_state

    if init_value_head and role != "critic":
        raise ConfigError("init_value_head=True is for role='critic' only; an actor keeps its LM head.")
    where = os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the HF tensors"
    if isinstance(source, (str, os.PathLike)):
        source = SafetensorsReader(source)
    ignore = {"lm_head.weight"} if init_value_head else set()
    if args.wrapper is not None:  # a vision-language checkpoint: its text model is loaded
        carried = carried_names(source, args.wrapper)
        log_ignored(carried, args.wrapper, where)
        ignore |= set(carried)
    source = hf_view(source, args, where)
    if role == "critic" and not init_value_head:
        source = critic_head_source(source, args)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    wmap = weight_map(args, role, tp, with_head=not init_value_head)
    load_hf_weights(chunks, wmap, source, ignore=ignore)


class _WithZeroBias(Mapping[str, torch.Tensor]):
    """A HF source plus ``score.bias`` = 0: a *ForSequenceClassification reward head has no bias."""

    def __init__(self, source: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        self.source, self.dtype = source, dtype

    def __getitem__(self, key: str) -> torch.Tensor:
        if key == "score.bias":
            return torch.zeros(1, dtype=self.dtype)  # host: a one-element source tensor
        return self.source[key]

    def __iter__(self):
        yield from self.source
        yield "score.bias"

    def __len__(self) -> int:
        return len(self.source) + 1


def critic_head_source(source: Mapping[str, torch.Tensor], args: ModelArgs) -> Mapping[str, torch.Tensor]:
    """Checks a critic's score head (one output) and gives a bias-free reward head a zero bias."""
    if "score.weight" not in source:
        return source  # the weight check names what is missing
    score = source["score.weight"]
    if score.shape[0] != 1:
        raise ConfigError(
            f"score.weight has {score.shape[0]} outputs (num_labels={score.shape[0]}); a critic's value "
            "head has one. Use a reward / value model saved with num_labels=1, or start the critic from "
            "a causal LM (init_value_head=True).")
    if args.value_head_bias and "score.bias" not in source:
        return _WithZeroBias(source, score.dtype)
    return source


DEFAULT_BUCKET_BYTES = 512 << 20


def export_hf_buckets(
    chunks: list[torch.nn.Module],
    args: ModelArgs,
    role: Role,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    tensor_of: Callable[[torch.nn.Parameter], torch.Tensor] = lambda p: p.data,
    fp8: BlockFp8 | None = None,
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Full HF tensors of a live sharded model in buckets of at most ``bucket_bytes`` (a larger
    tensor alone), the same on every rank, e.g. to feed co-located rollout engines; ``fp8``:
    the linear weights as block FP8 + ``_scale_inv`` (as ``merge --dtype fp8``).
    Collective: every rank iterates to the end. See ``mapping.weights.iter_hf_buckets``."""
    from megatron.core import parallel_state

    if fp8 is not None and always_fused(args):
        raise ConfigError(f"FP8 export of {args.arch.model_type}: its experts are exported fused, which block "
                          "FP8 does not cover; export without fp8.")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    buckets = iter_hf_buckets(chunks, weight_map(args, role, tp), bucket_bytes, tensor_of, fp8)
    if always_fused(args):  # gpt-oss: HF (and the rollout engines) know its experts only fused
        return fused_buckets(buckets, args.moe.num_experts, expert_layout(args), bucket_bytes)
    return buckets


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
