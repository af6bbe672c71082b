"""The main job's rollout side: which engine generates (``rollout.engine``), where it lives, its
first weight sync, and the held-out evaluation."""
from __future__ import annotations

import torch

from mcore_rl.job.prompts import Prompts
from mcore_rl.job.task import Task
from mcore_rl.platform import active_platform
from mcore_rl.rl.actor import Actor
from mcore_rl.rollout.builtin import BuiltinRollout
from mcore_rl.rollout.group import RolloutGroup, replica_group
from mcore_rl.rollout.hf_generate import TransformersRollout

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _builtin(actor: Actor, task: Task, hf_config, dtype: str, replica_first: bool) -> BuiltinRollout:
    return BuiltinRollout(actor, task.eos_id, task.pad_id, record_routing=actor.config.router_replay == "R3")


def _transformers(actor: Actor, task: Task, hf_config, dtype: str, replica_first: bool) -> TransformersRollout | None:
    """On the replica's first rank only: a transformers model of the actor's architecture
    (random weights until the first sync)."""
    if not replica_first:
        return None
    return TransformersRollout(hf_config, _DTYPES[dtype], active_platform().device(),
                               eos_id=task.eos_id, pad_id=task.pad_id)


ENGINES = {"builtin": _builtin, "transformers": _transformers}


def build_rollouts(name: str, actor: Actor, task: Task, hf_config, dtype: str, bucket_mb: int) -> RolloutGroup:
    """Collective: the job's engines (``name`` in ENGINES) for the actor; ``hf_config``: the
    actor's transformers config. A per-replica engine holds random weights until the caller's
    first ``sync`` (after any resume, so it starts from the weights the actor trains)."""
    replica = replica_group()
    engine = ENGINES[name](actor, task, hf_config, dtype, replica[0] == torch.distributed.get_rank())
    return RolloutGroup(engine, task.pad_id, active_platform().device(), bucket_mb << 20, replica)


def evaluate(task: Task, rollouts: RolloutGroup, max_new_tokens: int) -> dict[str, float] | None:
    """Collective: greedy answers to the task's held-out prompts, scored; None without any."""
    held: Prompts | None = task.held_out()
    if held is None:
        return None
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    count = len(held.token_ids)
    rows = held.token_ids + held.token_ids[: (-count) % dp]  # whole shares per replica; extra rows dropped below
    out = rollouts.generate(rows, max_new_tokens, 0.0, seed=0)
    mask = out.attention_mask[:count, -out.responses.shape[1]:]
    metrics = task.eval_metrics(held, out.responses[:count], mask)
    return {"questions": count, **metrics}
