"""Context parallelism in the verl engine (tests/verl/test_verl_rl.py, the dp2 launch): after the
DP=2 (CP=1) comparisons of rl_bodies, the same processes tear megatron's groups down and build
verl's ``TrainingWorker`` at CP=2 (DP=1), padded and packed, actor (``ppo_loss``) and critic
(``value_loss``), on the DP=2 run's rows in the order that gives every optimizer step the same
rows (each mini-batch: DP rank 0's share, then DP rank 1's). Returned per rank: the CP=1 tensors
of both DP ranks in that order, and what the CP=2 workers give.
"""
from __future__ import annotations

from functools import partial

import torch

from tests.verl import rl_bodies as B

CP = {"context_parallel_size": 2}


def _in_step_order(shares: list[dict], dp: int) -> dict:
    """{key: [ROWS, ...]} from each DP rank's rows, mini-batch after mini-batch."""
    steps = B._steps(dp)
    return {k: torch.cat([share[k][s] for s in steps for share in shares]) for k in shares[0]}


def _gathered(local: dict) -> list[dict]:
    out: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, local)
    return out


def cp_after_dp(actor: dict, critic: dict, actor_dir: str, critic_dir: str) -> dict:
    """The CP=2 runs beside the DP=2 results ``actor`` / ``critic`` (rl_bodies' actor_body /
    critic_body at DP=2, every rank an output rank)."""
    from megatron.core import parallel_state

    dp = parallel_state.get_data_parallel_world_size()
    shares = _gathered({"actor": {**actor["rows"], **{f"cp1_{m}_{k}": actor[m][k] for m in ("padded", "packed")
                                                     for k in ("log_probs", "entropy")}},
                        "critic": {**critic["rows"], **{f"cp1_{m}_values": critic[m]["values"]
                                                        for m in ("padded", "packed")}}})
    rows = {role: _in_step_order([s[role] for s in shares], dp) for role in ("actor", "critic")}
    parallel_state.destroy_model_parallel()
    return {"rows": rows, "actor": _cp_actor(actor_dir, rows["actor"]), "critic": _cp_critic(critic_dir, rows["critic"])}


def _cp_actor(model_dir: str, rows: dict) -> dict:
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig as VerlActorConfig
    from verl.workers.utils.losses import ppo_loss

    verl_loss = partial(ppo_loss, config=VerlActorConfig(
        strategy="mcore_rl", rollout_n=1, ppo_mini_batch_size=B.MINI, ppo_micro_batch_size_per_gpu=B.MICRO,
        clip_ratio_low=B.CLIP_LOW, clip_ratio_high=B.CLIP_HIGH, clip_ratio_c=B.CLIP_C,
        entropy_coeff=B.ENTROPY_COEFF, use_kl_loss=True, kl_loss_coef=B.KL_COEFF, kl_loss_type="low_var_kl",
        calculate_entropy=True))
    result = {}
    for mode, packed in (("padded", False), ("packed", True)):
        worker = B._verl_worker("language_model", model_dir, CP, packed, 10)
        td = B._to_verl(rows, (), calculate_entropy=True, compute_loss=False, temperature=B.TEMPERATURE)
        out = worker.infer_batch(td)
        result[mode] = {"log_probs": B._response_view(worker, out, td, "log_probs"),
                        "entropy": B._response_view(worker, out, td, "entropy"),
                        "src": worker.engine.is_mp_src_rank_with_outputs()}
        worker.set_loss_fn(verl_loss)
        td = B._to_verl(rows, ("old_log_probs", "advantages", "ref_log_prob"), temperature=B.TEMPERATURE,
                        calculate_entropy=True, global_batch_size=B.MINI, mini_batch_size=B.MINI, epochs=1, seed=42,
                        dataloader_kwargs={"shuffle": False}, compute_loss=True)
        out = worker.train_mini_batch(td)
        result[mode]["metrics"] = None if out is None else B._plain(tu.get(out, "metrics"))
    return result


def _cp_critic(model_dir: str, rows: dict) -> dict:
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import CriticConfig as VerlCriticConfig
    from verl.workers.utils.losses import value_loss

    verl_loss = partial(value_loss, config=VerlCriticConfig(
        strategy="mcore_rl", rollout_n=1, ppo_mini_batch_size=B.MINI, ppo_micro_batch_size_per_gpu=B.MICRO,
        cliprange_value=B.CLIP_VALUE))
    result = {}
    for mode, packed in (("padded", False), ("packed", True)):
        worker = B._verl_worker("value_model", model_dir, CP, packed, 10)
        td = B._to_verl(rows, (), compute_loss=False)
        out = worker.infer_batch(td)
        result[mode] = {"values": B._response_view(worker, out, td, "values"),
                        "src": worker.engine.is_mp_src_rank_with_outputs()}
        worker.set_loss_fn(verl_loss)
        td = B._to_verl(rows, ("values", "returns"), global_batch_size=B.MINI, mini_batch_size=B.MINI, epochs=1,
                        seed=42, dataloader_kwargs={"shuffle": False})
        out = worker.train_mini_batch(td)
        result[mode]["metrics"] = None if out is None else B._plain(tu.get(out, "metrics"))
    return result
