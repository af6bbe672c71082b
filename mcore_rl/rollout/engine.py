"""The rollout engine contract, the weight sync from the trainer, and a rollout shared by ranks.

A rollout engine generates responses with the log-probs of the sampled tokens under its own
model (raw logits at the sampling temperature, no top-k/top-p) and takes new weights as an
iterable of (HF name, full tensor). Where engines live: one per model replica (data-parallel
index), on the replica's first rank (``group.replica_group``); that rank generates and broadcasts
the batch (``group.RolloutGroup``), and every rank runs the weight sync (``sync_weights``,
collective: ``export_hf_buckets`` gathers TP/PP/EP shards bucket by bucket, so the trainer never
holds a full copy; the engine rank copies each bucket into its model). Memory: one full model in the engine's dtype on that rank, plus one
bucket in transit on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Iterable, Protocol

import torch

from mcore_rl.errors import McoreRLError

Tensor = torch.Tensor
DEFAULT_SYNC_BUCKET_BYTES = 256 << 20


class RolloutError(McoreRLError, ValueError):
    """A rollout request or weight update that cannot work; the message names the value and the fix."""


@dataclass
class Rollout:
    """Generated rows: ``input_ids``/``attention_mask`` [B, P + R] (left-padded prompt, then the
    response, right-padded after its end-of-sequence token), ``responses`` [B, R] and
    ``rollout_log_probs`` [B, R] (0 at padding; None when the engine does not report them) and
    ``routed_experts`` [B, P + R, MoE layers, top_k] (an MoE policy's routing, for router
    replay R3; None when not asked for or not reported)."""

    input_ids: Tensor
    attention_mask: Tensor
    responses: Tensor
    rollout_log_probs: Tensor | None = None
    routed_experts: Tensor | None = None

    def batch(self) -> dict[str, Tensor]:
        """The trainer's batch keys (``rollout_log_probs`` included when present)."""
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        return {k: v for k, v in out.items() if v is not None}


class RolloutEngine(Protocol):
    """What the trainer calls on a rollout engine."""

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> Rollout:
        """Samples one response per prompt (token ids, no padding) at ``temperature``."""
        ...

    def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]]) -> int:
        """Copies full HF-named tensors into the engine's model; returns how many it took."""
        ...


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Tensor, Tensor]:
    """input_ids and attention_mask [B, max prompt length], prompts right-aligned."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise RolloutError(f"every prompt needs at least one token; got lengths {[len(p) for p in prompts]}.")
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # host: the engine moves it to its device
    mask = torch.zeros(len(prompts), width, dtype=torch.long)  # host: the engine moves it to its device
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)  # host: token ids from a Python list
        mask[i, width - len(p):] = 1
    return ids, mask


def sync_weights(engine: RolloutEngine | None, chunks: list, args, bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES,
                 mxfp4: bool = False) -> int:
    """Collective: the actor's weights into ``engine`` (None on ranks without one), bucket by
    bucket from ``export_hf_buckets``; returns the tensors the engine took (0 without one).
    A LoRA actor sends merged weights, W + alpha/rank * B A, each computed on its own shard as
    it is exported (one extra weight shard in transit, no merged copy of the model).
    ``mxfp4`` (every rank alike; for an engine that serves gpt-oss's MXFP4 experts natively):
    the experts go as ``<name>_blocks`` + ``<name>_scales``, as ``merge --dtype mxfp4`` writes."""
    from mcore_rl.models.hf_weights import export_hf_buckets
    from mcore_rl.lora.layers import merged_tensor_of

    taken = 0
    merged = merged_tensor_of(chunks)  # every parameter as it is without adapters
    for bucket in export_hf_buckets(chunks, args, "actor", bucket_bytes, tensor_of=merged, mxfp4=mxfp4):
        if engine is not None:
            taken += engine.update_weights(bucket)
        del bucket  # freed before the next bucket fills: one bucket alive, not two
    return taken


def broadcast_rollout(rollout: Rollout | None, src: int, group=None, device=None) -> Rollout:
    """Collective over ``group``: every rank gets ``src``'s rollout (shapes first, then tensors)."""
    mine = torch.distributed.get_rank() == src
    head = torch.zeros(4, dtype=torch.long, device=device)
    if mine:
        has_lp = rollout.rollout_log_probs is not None
        head = torch.tensor([*rollout.input_ids.shape, rollout.responses.shape[1], int(has_lp)], device=device)
    torch.distributed.broadcast(head, src, group=group)
    b, s, r, has_lp = (int(x) for x in head)
    out = Rollout(*(t.to(device) if mine else torch.empty(shape, dtype=dt, device=device)
                    for t, shape, dt in ((rollout.input_ids if mine else None, (b, s), torch.long),
                                         (rollout.attention_mask if mine else None, (b, s), torch.long),
                                         (rollout.responses if mine else None, (b, r), torch.long))))
    for t in (out.input_ids, out.attention_mask, out.responses):
        torch.distributed.broadcast(t, src, group=group)
    if has_lp:
        lp = rollout.rollout_log_probs.float().to(device) if mine else torch.empty(b, r, device=device)
        torch.distributed.broadcast(lp, src, group=group)
        out.rollout_log_probs = lp
    return out
