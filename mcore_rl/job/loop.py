"""The main job, top to bottom: set up ranks, build actor (+ reference, + critic), the task and
the rollout engines, evaluate on held-out prompts, then per step generate -> reward -> log-probs
-> advantages -> updates -> weight sync -> log, and evaluate again. Sampling and the actor's
log-probs both use ``rollout.temperature``. Rank 0 prints the layout, a progress bar and a
closing summary, and writes metrics.jsonl, eval.json, reward.png and the resolved config under
output_dir; every rank runs the same loop."""
from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import replace
from typing import Any, Mapping

import torch

from mcore_rl.checkpoint.manager import CheckpointManager
from mcore_rl.config_loader import ConfigError
from mcore_rl.job.rollouts import build_rollouts, evaluate
from mcore_rl.job.schema import JobConfig, TinyModelConfig, dump_job_config
from mcore_rl.job.start import Start, actor_start, critic_start
from mcore_rl.job.task import Task, make_task
from mcore_rl.models.builder import BuildOptions
from mcore_rl.models.hf_config import ModelArgs, load_hf_config, model_args_from_hf
from mcore_rl.parallel import initialize_parallel_state
from mcore_rl.platform import Platform, init_distributed, setup_platform
from mcore_rl.rl import losses
from mcore_rl.models.routing import ROUTED_EXPERTS
from mcore_rl.rl.actor import Actor
from mcore_rl.rl.batch import response_mask
from mcore_rl.rl.critic import Critic
from mcore_rl.rl.engine import ModelEngine
from mcore_rl.rollout.group import RolloutGroup
from mcore_rl.rollout.metrics import rollout_corr_metrics

Tensor = torch.Tensor


def tiny_hf_config(cfg: TinyModelConfig):
    """The embedded tiny model's transformers config."""
    from transformers import AutoConfig

    kwargs = cfg.hf_kwargs()
    if cfg.model_type in ("mistral", "mixtral"):
        kwargs.setdefault("sliding_window", None)  # not HF's default 4096: no window (it would never cut)
    return AutoConfig.for_model(cfg.model_type, tie_word_embeddings=False, **kwargs)


def tiny_hf_model(cfg: TinyModelConfig):
    """The embedded tiny model as a transformers CausalLM with random weights from ``cfg.seed``."""
    from transformers import AutoModelForCausalLM

    hf_config = tiny_hf_config(cfg)
    torch.manual_seed(cfg.seed)
    return AutoModelForCausalLM.from_config(hf_config)  # host: HF weights, loaded shard by shard


def tiny_model(cfg: TinyModelConfig) -> tuple[ModelArgs, dict[str, Tensor]]:
    """ModelArgs and random weights of the embedded tiny model under their on-disk (Hub) names,
    the same on every rank. transformers 5 fuses MoE experts in memory and splits them per
    expert when saving (the layout the mapping tables read); the same conversion is used here."""
    from transformers.core_model_loading import revert_weight_conversion

    model = tiny_hf_model(cfg)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = dict(revert_weight_conversion(model, state))
    return model_args_from_hf(model.config).for_weights(state, "the tiny model"), state


def build_options(cfg: JobConfig, role: str = "actor") -> BuildOptions:
    """Numerics of every model in the job: parameter dtype, dropout, MoE options and the pad
    token's embedding gradient; ``role``'s LoRA adapters (``actor.lora`` / ``critic.lora``)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.model.dtype]
    return BuildOptions(params_dtype=dtype, hidden_dropout=cfg.model.hidden_dropout, moe=cfg.model.moe,
                        pad_embedding_grad=cfg.model.pad_embedding_grad, lora=getattr(cfg, role).lora)


def uses_reference(cfg: JobConfig) -> bool:
    """Whether a KL term needs reference log-probs (KL loss or KL penalty in the reward)."""
    return cfg.actor.use_kl_loss or cfg.algorithm.kl_in_reward_coeff > 0


def build(cfg: JobConfig, platform: Platform,
          begin: tuple[Start, Start | None] | None = None) -> tuple[Actor, Critic | None]:
    """Actor (with a frozen reference when a KL term is on; with LoRA the reference is the
    actor's own frozen base, adapters off, and no second model is built) and, for PPO, a
    critic, from ``begin`` = ``starts(cfg)`` (computed when not given)."""
    layout = cfg.layout
    initialize_parallel_state(layout, seed=cfg.seed)
    start, critic_from = begin or starts(cfg)
    options = build_options(cfg, "actor")
    # the checkpoint's MTP layers, unless left out (actor.mtp.enable=false)
    args = start.args.with_mtp(cfg.actor.mtp.enable)
    policy = ModelEngine(args, layout, "actor", platform, options, cfg.actor_optim, start.hf)
    start.load_into(policy)
    ref = None
    if uses_reference(cfg) and not cfg.actor.lora.enabled:
        ref = ModelEngine(args, layout, "actor", platform, options, None, start.hf)
        start.load_into(ref)
    # log-probs at the temperature the rollout samples with
    actor = Actor(policy, replace(cfg.actor, temperature=cfg.rollout.temperature), ref)
    if critic_from is None:
        return actor, None
    value = ModelEngine(critic_from.args, layout, "critic", platform, build_options(cfg, "critic"), cfg.critic_optim,
                        critic_from.hf, init_value_head=critic_from.init_value_head and critic_from.hf is not None)
    critic_from.load_into(value)
    return actor, Critic(value, cfg.critic)


def starts(cfg: JobConfig) -> tuple[Start, Start | None]:
    """Where the actor (and reference) and, for PPO, the critic start (see ``job/start.py``)."""
    tiny = None
    if not (cfg.model.hf_dir or cfg.model.mcore_dir):
        tiny = (*tiny_model(cfg.model.tiny), tiny_hf_config(cfg.model.tiny))
    actor = actor_start(cfg.model.hf_dir, cfg.model.mcore_dir, tiny)
    if cfg.algorithm.name != "ppo":
        if cfg.model.critic_dir:
            raise ConfigError(f"model.critic_dir={cfg.model.critic_dir!r} with algorithm.name="
                              f"{cfg.algorithm.name!r}, which has no critic: drop model.critic_dir or use ppo.")
        return actor, None
    return actor, critic_start(cfg.model.critic_dir, actor)


def advantages(cfg: JobConfig, batch: dict, scores: Tensor, critic: Critic | None) -> dict:
    """Adds advantages (and, for PPO, values and returns) [B, R] to the batch."""
    mask = response_mask(batch).float()
    if critic is None:  # GRPO: rewards normalised within each prompt's group of samples
        groups = torch.arange(cfg.rollout.prompts_per_step, device=scores.device)
        groups = groups.repeat_interleave(cfg.rollout.samples_per_prompt)
        per_seq = losses.grpo_advantages(scores, groups, cfg.algorithm.norm_adv_by_std)
        return {"advantages": losses.broadcast_to_tokens(per_seq, mask)}
    token_rewards = torch.zeros_like(mask)
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)
    token_rewards[last] = scores[last.any(-1)]  # the score lands on the last response token
    if "ref_log_prob" in batch and cfg.algorithm.kl_in_reward_coeff > 0:
        token_rewards -= cfg.algorithm.kl_in_reward_coeff * (batch["old_log_probs"] - batch["ref_log_prob"]) * mask
    values = critic.compute_values(batch)
    adv, returns = losses.compute_gae(token_rewards, values, mask, cfg.algorithm.gamma, cfg.algorithm.lam)
    return {"advantages": losses.whiten(adv, mask), "values": values, "returns": returns}


def rollout(cfg: JobConfig, actor: Actor, task: Task, rollouts: RolloutGroup, step: int,
            times: dict) -> tuple[dict, Tensor, Tensor, dict]:
    """Samples this step's batch at ``rollout.temperature``, scores it and adds the log-probs
    (and reference log-probs) the update uses; returns (batch, scores [B], entropy [B, R],
    rollout-versus-training mismatch metrics). Phase seconds go into ``times``."""
    clock = time.perf_counter()
    prompts = task.train_prompts(step, cfg.rollout.prompts_per_step).repeat(cfg.rollout.samples_per_prompt)
    batch = rollouts.generate(prompts.token_ids, cfg.task.response_length, cfg.rollout.temperature,
                              seed=cfg.seed * 7919 + step).batch()
    rollout_log_probs = batch.pop("rollout_log_probs", None)  # a diagnostic, not an update input
    scores = task.score(prompts, batch["responses"], response_mask(batch))
    times["rollout"] = time.perf_counter() - clock
    clock = time.perf_counter()
    computed = actor.compute_log_prob(batch, with_entropy=True)
    batch["old_log_probs"] = computed["log_probs"]
    if ROUTED_EXPERTS in computed:  # router replay R2: the update routes as the old policy did
        batch[ROUTED_EXPERTS] = computed[ROUTED_EXPERTS]
    if uses_reference(cfg):  # a reference engine, or a LoRA actor's frozen base (adapters off)
        batch["ref_log_prob"] = actor.compute_ref_log_prob(batch)
    times["old_log_prob"] = time.perf_counter() - clock
    mismatch = {}
    if rollout_log_probs is not None:
        mismatch = rollout_corr_metrics(batch["old_log_probs"], rollout_log_probs, response_mask(batch))
    return batch, scores, computed["entropy"], mismatch


def train_step(cfg: JobConfig, actor: Actor, critic: Critic | None, task: Task, rollouts: RolloutGroup,
               step: int) -> dict[str, Any]:
    """One RL step; returns its metrics (the same on every rank)."""
    start, times = time.perf_counter(), {}
    batch, scores, entropy, mismatch = rollout(cfg, actor, task, rollouts, step, times)
    batch.update(advantages(cfg, batch, scores, critic))
    metrics = {"step": step, "reward": float(scores.mean())}
    mask = response_mask(batch).float()
    metrics["entropy"] = float((entropy * mask).sum() / mask.sum())
    metrics["response_length"] = float(mask.sum(-1).mean())
    if "ref_log_prob" in batch:
        metrics["kl_to_ref"] = float(((batch["old_log_probs"] - batch["ref_log_prob"]) * mask).sum() / mask.sum())
    metrics.update(mismatch)
    clock = time.perf_counter()
    metrics.update(actor.update_policy(batch))
    if critic is not None:
        metrics.update(critic.update_critic(batch))
    times["update"] = time.perf_counter() - clock
    clock = time.perf_counter()
    rollouts.sync(actor.engine.model, actor.engine.args)  # the next rollout samples the updated policy
    times["weight_sync"] = time.perf_counter() - clock
    metrics["time_s"] = time.perf_counter() - start
    metrics.update({f"timing/{k}_s": v for k, v in times.items()})
    metrics["tokens_per_s"] = float(batch["attention_mask"].sum()) / metrics["time_s"]
    return metrics


def wall_clock(key: str) -> bool:
    """Whether a metric measures time (it differs between runs that compute the same thing)."""
    return key in ("time_s", "tokens_per_s") or key.startswith("timing/")


def plot_rewards(history: list[dict], path: str) -> None:
    """reward per step as a PNG (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([m["step"] for m in history], [m["reward"] for m in history], marker=".")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: JobConfig) -> list[dict]:
    """Runs the whole job in this rank (call under torchrun); returns the per-step metrics."""
    platform = setup_platform()
    init_distributed(platform)
    rank0 = torch.distributed.get_rank() == 0
    log_package_events(torch.distributed.get_rank())
    begin = starts(cfg)
    actor, critic = build(cfg, platform, begin)
    task, rollouts = setup_rollout(cfg, actor, begin)
    if rank0:
        layout = actor.engine.layout.describe(torch.distributed.get_world_size())
        print(f"{cfg.algorithm.name} ({cfg.model.dtype}): {layout}; task {cfg.task.name}, rollout engine "
              f"{cfg.rollout.engine}", flush=True)
        os.makedirs(cfg.output_dir, exist_ok=True)
        with open(os.path.join(cfg.output_dir, "config.yaml"), "w") as f:
            f.write(dump_job_config(cfg))
    start = time.perf_counter()
    hf_files = {"actor": begin[0].hf_files, "critic": (begin[1] or begin[0]).hf_files}
    ckpt = checkpoint_manager(cfg, hf_files)
    history = _resume(cfg, ckpt, _engines(actor, critic), rank0)
    if history:  # resumed: the engines take the checkpoint's weights
        rollouts.sync(actor.engine.model, actor.engine.args)
    evals = {"before": _evaluate(cfg, task, rollouts, len(history), rank0)}
    history = _loop(cfg, actor, critic, task, rollouts, rank0, ckpt, history)
    evals["after"] = _evaluate(cfg, task, rollouts, len(history), rank0)
    if rank0:
        plot_rewards(history, os.path.join(cfg.output_dir, "reward.png"))
        if evals["before"] is not None:
            with open(os.path.join(cfg.output_dir, "eval.json"), "w") as f:
                json.dump(evals, f, indent=1)
        print(summary(history, time.perf_counter() - start, cfg.output_dir), flush=True)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    return history


def setup_rollout(cfg: JobConfig, actor: Actor, begin: tuple[Start, Start | None] | None = None
                  ) -> tuple[Task, RolloutGroup]:
    """Collective: the job's task and rollout engines for ``actor`` (started from ``begin`` =
    ``starts(cfg)``, computed when not given), the engines synced with the actor's weights."""
    hf_source = (begin or starts(cfg))[0].hf_files  # a HF directory (config, tokenizer) or a config
    task = make_task(cfg.task, cfg.seed, actor.engine.args.vocab_size,
                     hf_source if isinstance(hf_source, str) else None)
    rollouts = build_rollouts(cfg.rollout.engine, actor, task, load_hf_config(hf_source), cfg.model.dtype,
                              cfg.rollout.sync_bucket_mb)
    rollouts.sync(actor.engine.model, actor.engine.args)
    return task, rollouts


def _evaluate(cfg: JobConfig, task: Task, rollouts: RolloutGroup, step: int, rank0: bool) -> dict | None:
    """Greedy held-out evaluation at ``step`` (collective); rank 0 prints it."""
    clock = time.perf_counter()
    result = evaluate(task, rollouts, cfg.task.response_length)
    if result is None:
        return None
    result = {"step": step, **result, "seconds": time.perf_counter() - clock}
    if rank0:
        scores = ", ".join(f"{k} {v:.3f}" for k, v in result.items() if k.endswith("accuracy"))
        print(f"held-out greedy evaluation at step {step} ({result['questions']} questions): {scores}", flush=True)
    return result


def log_package_events(rank: int) -> None:
    """mcore_rl's INFO log lines (checkpoint storage mode, node-local sync, retention) go to
    stderr, prefixed by the rank; without a handler Python would drop everything below WARNING."""
    logger = logging.getLogger("mcore_rl")
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"[rank {rank}] %(name)s: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)


def checkpoint_manager(cfg: JobConfig, hf_files: dict) -> CheckpointManager:
    """The job's checkpoint manager; each role's HF config (``hf_files``: role -> HF directory
    or config) goes into every checkpoint."""
    return CheckpointManager(cfg.checkpoint, os.path.join(cfg.output_dir, "checkpoints"), hf_files)


def _engines(actor: Actor, critic: Critic | None) -> dict:
    return {"actor": actor.engine, **({"critic": critic.engine} if critic is not None else {})}


def _resume(cfg: JobConfig, ckpt: CheckpointManager, engines: dict, rank0: bool) -> list[dict]:
    """Loads the newest complete checkpoint (per resume_mode); returns the metrics history up to
    it and cuts metrics.jsonl after its last step (a fresh run starts the file anew)."""
    state = ckpt.resume(engines)
    history = list(state["history"]) if state else []
    if rank0:
        with open(os.path.join(cfg.output_dir, "metrics.jsonl"), "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in history)
        if state:
            print(f"resumed from step {state['step']} ({ckpt.step_dir(state['step'])})", flush=True)
    return history


def _save_due(cfg: JobConfig, done: int) -> bool:
    freq = cfg.checkpoint.save_freq
    return freq > 0 and (done % freq == 0 or done == cfg.steps)


def _loop(cfg: JobConfig, actor: Actor, critic: Critic | None, task: Task, rollouts: RolloutGroup,
          rank0: bool, ckpt: CheckpointManager, history: list[dict]) -> list[dict]:
    from tqdm import tqdm

    engines = _engines(actor, critic)
    path = os.path.join(cfg.output_dir, "metrics.jsonl")
    bar = tqdm(range(len(history), cfg.steps), disable=not (rank0 and cfg.progress_bar), desc=cfg.algorithm.name)
    for step in bar:
        metrics = train_step(cfg, actor, critic, task, rollouts, step)
        history.append(metrics)
        if rank0:
            with open(path, "a") as f:
                f.write(json.dumps(metrics) + "\n")
            bar.set_postfix(reward=f"{metrics['reward']:.3f}", last5=f"{_last5(history):.3f}")
        if _save_due(cfg, step + 1):
            ckpt.save(step + 1, engines, {"step": step + 1, "history": history})
        else:
            ckpt.poll()  # an async save finished on every rank gets its marker and tracker
    ckpt.close()  # the last (async) save is complete before the job ends
    return history


def summary(history: list[Mapping], seconds: float, output_dir: str) -> str:
    """The closing lines: steps, first and last-5 rewards, mean phase times and tokens per
    second, training time, where the outputs are."""
    if not history:
        return f"done: 0 steps; outputs in {output_dir}/"
    phases = [k for k in history[-1] if k.startswith("timing/")]  # in the order a step runs them
    mean = lambda key: sum(m.get(key, 0.0) for m in history) / len(history)  # noqa: E731
    times = ", ".join(f"{k[len('timing/'):-2]} {mean(k):.2f} s" for k in phases)
    return (f"done: {len(history)} steps in {seconds:.1f} s; reward {history[0]['reward']:.3f} "
            f"at step 0, {_first5(history):.3f} over the first {min(5, len(history))} steps, {_last5(history):.3f} "
            f"over the last {min(5, len(history))} steps\nper step: {times}; {mean('tokens_per_s'):.0f} tokens/s\n"
            f"outputs in {output_dir}/ (metrics.jsonl, reward.png, config.yaml)")


def _first5(history: list[Mapping]) -> float:
    head = history[:5]
    return sum(m["reward"] for m in head) / len(head)


def _last5(history: list[Mapping]) -> float:
    tail = history[-5:]
    return sum(m["reward"] for m in tail) / len(tail)
