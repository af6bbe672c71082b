"""The job's rollout engines seen from every rank: one call returns the whole batch everywhere,
one call refreshes the engines from the actor.

A per-replica engine (``collective = False``, e.g. transformers) lives on its model replica's
first rank (the replica: the TP x CP x PP ranks of one data-parallel index). Replica d
generates rows [d*B/dp, (d+1)*B/dp) of the batch, broadcasts them inside the replica and the
data-parallel group gathers all rows. A collective engine (the builtin sampler) is called on
every rank with the whole batch.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mcore_rl.rollout.engine import DEFAULT_SYNC_BUCKET_BYTES, Rollout, RolloutEngine, RolloutError, \
    broadcast_rollout, sync_weights

Tensor = torch.Tensor


def replica_group() -> tuple[int, object]:
    """Collective (every rank, once): (this replica's first global rank, a process group of the
    replica's ranks). Built from each rank's data-parallel index, so CP ranks are included."""
    from megatron.core import parallel_state

    world = torch.distributed.get_world_size()
    dp_index = [None] * world
    torch.distributed.all_gather_object(dp_index, parallel_state.get_data_parallel_rank())
    mine = None
    for d in sorted(set(dp_index)):  # every rank creates every group, in one order
        ranks = [r for r in range(world) if dp_index[r] == d]
        group = torch.distributed.new_group(ranks)
        if d == dp_index[torch.distributed.get_rank()]:
            mine = (min(ranks), group)
    return mine


def _left_pad_to(rollout: Rollout, prompt_width: int, pad_id: int) -> Rollout:
    """The rollout with its prompt side left-padded to ``prompt_width`` columns."""
    extra = prompt_width + rollout.responses.shape[1] - rollout.input_ids.shape[1]
    if extra == 0:
        return rollout
    return Rollout(F.pad(rollout.input_ids, (extra, 0), value=pad_id), F.pad(rollout.attention_mask, (extra, 0)),
                   rollout.responses, rollout.rollout_log_probs)


class RolloutGroup:
    """``engine``: this rank's engine (None on ranks without one; a collective engine on every
    rank). ``pad_id`` fills the prompt side when replicas' prompts differ in length.
    ``replica``: ``replica_group()`` when the caller already made it (collective otherwise).
    ``mxfp4``: the weight sync sends gpt-oss's experts as MXFP4 blocks + scales (for engines that
    serve MXFP4 natively; off by default, see ``sync_weights``)."""

    def __init__(self, engine: RolloutEngine | None, pad_id: int, device: torch.device,
                 bucket_bytes: int = DEFAULT_SYNC_BUCKET_BYTES, replica: tuple | None = None,
                 mxfp4: bool = False) -> None:
        self.engine, self.pad_id, self.device, self.bucket_bytes = engine, pad_id, device, bucket_bytes
        self.mxfp4 = mxfp4
        self.collective = bool(getattr(engine, "collective", False))
        if not self.collective and replica is None:
            replica = replica_group()
        self.src, self.group = replica or (None, None)
        if not self.collective and (engine is None) != (torch.distributed.get_rank() != self.src):
            raise RolloutError(f"rank {torch.distributed.get_rank()}: a per-replica rollout engine belongs on the "
                               f"replica's first rank ({self.src}) only; build it there and pass None elsewhere.")

    def generate(self, prompts: list[list[int]], max_new_tokens: int, temperature: float, seed: int) -> Rollout:
        """Collective: one response per prompt; every rank gets the whole batch on ``device``."""
        if self.collective:
            return self.engine.generate(prompts, max_new_tokens, temperature, seed)
        from megatron.core import parallel_state

        dp, d = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
        if len(prompts) % dp:
            raise RolloutError(f"{len(prompts)} prompts do not split over {dp} data-parallel replicas; make "
                               "prompts_per_step * samples_per_prompt a multiple of the data-parallel size.")
        share = len(prompts) // dp
        mine = None
        if self.engine is not None:
            mine = self.engine.generate(prompts[d * share:(d + 1) * share], max_new_tokens, temperature,
                                        seed * 1_000_003 + d)  # distinct samples per replica
            mine = _left_pad_to(mine, max(len(p) for p in prompts), self.pad_id)
        mine = broadcast_rollout(mine, self.src, group=self.group, device=self.device)
        return _gather_rows(mine) if dp > 1 else mine

    def sync(self, chunks: list, args) -> int:
        """Collective: the actor's weights into every per-replica engine (nothing for a
        collective engine, which reads them); returns the tensors this rank's engine took."""
        if self.collective:
            return 0
        return sync_weights(self.engine, chunks, args, self.bucket_bytes, self.mxfp4)


def _gather_rows(part: Rollout) -> Rollout:
    """Every replica's rows in data-parallel order (equal shapes in every replica)."""
    from mcore_rl.rl.engine import gather_dp

    log_probs = None if part.rollout_log_probs is None else gather_dp(part.rollout_log_probs)
    return Rollout(gather_dp(part.input_ids), gather_dp(part.attention_mask), gather_dp(part.responses), log_probs)
