"""The main job drives other layouts and numerics: a MoE actor with expert parallelism (ep=2,
world 2) and attention dropout, a bf16 GRPO run and a bf16 PPO run whose critic trunk starts
from the HF weights."""
from __future__ import annotations

import math
import os

import torch

from mcore_rl.job.schema import JobConfig, load_job_config
from tests.dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOE = ["model.tiny.model_type=qwen3_moe", "model.tiny.num_experts=4", "model.tiny.num_experts_per_tok=2",
       "model.tiny.moe_intermediate_size=32", "model.tiny.head_dim=16", "model.moe.router_dtype=fp64",
       "layout.tp=1", "layout.ep=2"]


def _config(name: str, tmp_path, *overrides: str) -> JobConfig:
    path = os.path.join(ROOT, "configs", f"{name}.yaml")
    return load_job_config(path, [f"output_dir={tmp_path}", "progress_bar=false", "rollout.prompts_per_step=8",
                                  "actor.micro_batch_size=16", "actor.ppo_mini_batch_size=32",
                                  "critic.micro_batch_size=16", "critic.ppo_mini_batch_size=32", *overrides])


def _local_params(engine) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().clone() for c in engine.model for n, p in c.named_parameters()}


def _train(cfg: JobConfig, steps: int) -> dict:
    """Builds the job's models, runs ``steps`` job steps; returns metrics and what moved."""
    from mcore_rl.job.loop import build, setup_rollout, train_step
    from mcore_rl.platform import active_platform

    actor, critic = build(cfg, active_platform())
    task, rollouts = setup_rollout(cfg, actor)
    before = _local_params(actor.engine)
    history = [train_step(cfg, actor, critic, task, rollouts, step) for step in range(steps)]
    after = _local_params(actor.engine)
    experts = [n for n in before if ".experts." in n and "weight" in n]
    return {
        "history": history,
        "dtypes": sorted({str(p.dtype) for c in actor.engine.model for p in c.parameters()}),
        "expert_weights": {n: before[n] for n in experts},
        "moved": sorted(n for n in before if not torch.equal(before[n], after[n])),
        "dropout": (actor.engine.config.attention_dropout, actor.engine.config.hidden_dropout),
    }


def test_moe_job_with_expert_parallelism(tmp_path):
    cfg = _config("grpo_demo", tmp_path, *MOE, "model.tiny.attention_dropout=0.1", "model.hidden_dropout=0.2")
    assert (cfg.layout.ep, cfg.layout.tp, cfg.model.tiny.num_experts) == (2, 1, 4)
    ranks = run_ranks(2, _train, cfg, 2)
    for r in ranks:
        assert len(r["history"]) == 2 and r["dtypes"] == ["torch.float32"]
        assert r["dropout"] == (0.1, 0.2)
        assert all(math.isfinite(m["actor/grad_norm"]) and m["actor/grad_norm"] > 0 for m in r["history"])
        assert any(".experts." in n for n in r["moved"]) and any("router" in n for n in r["moved"])
    # every rank holds 2 of the 4 experts (ep=2), different ones, and the metrics agree
    local = [r["expert_weights"] for r in ranks]
    assert set(local[0]) == set(local[1]) and len(local[0]) > 0
    assert all(not torch.equal(local[0][n], local[1][n]) for n in local[0])
    assert [m["reward"] for m in ranks[0]["history"]] == [m["reward"] for m in ranks[1]["history"]]


def test_bf16_grpo_job(tmp_path):
    cfg = _config("grpo_demo", tmp_path, "model.dtype=bf16")
    (r, _) = run_ranks(2, _train, cfg, 2)
    assert r["dtypes"] == ["torch.bfloat16"]
    assert all(math.isfinite(m["actor/pg_loss"]) and math.isfinite(m["actor/grad_norm"]) for m in r["history"])
    assert r["moved"]  # bf16 params take the fp32 main weights' update


def _critic_after_frozen_step(cfg: JobConfig) -> tuple[dict, dict]:
    """Critic trunk (HF names) after one job step with critic lr=0, and the HF weights."""
    from mcore_rl.job.loop import build, setup_rollout, tiny_model, train_step
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.platform import active_platform

    actor, critic = build(cfg, active_platform())
    train_step(cfg, actor, critic, *setup_rollout(cfg, actor), 0)
    exported = export_hf(critic.engine.model, critic.engine.args, "critic")
    return exported, tiny_model(cfg.model.tiny)[1]


def test_bf16_ppo_critic_trunk_starts_from_hf_weights(tmp_path):
    cfg = _config("ppo_demo", tmp_path, "model.dtype=bf16", "critic_optim.lr=0.0", "critic_optim.warmup_steps=0")
    exported, hf = run_ranks(2, _critic_after_frozen_step, cfg)[0]
    trunk = [n for n in exported if not n.startswith("score.")]
    assert len(trunk) == len([n for n in hf if n != "lm_head.weight"])
    for name in trunk:  # a step with lr=0 must not write back a random trunk
        assert torch.equal(exported[name], hf[name].to(torch.bfloat16)), name


def _train_chunks(cfg: JobConfig, steps: int) -> dict:
    from mcore_rl.job.loop import build, setup_rollout, train_step
    from mcore_rl.platform import active_platform

    actor, critic = build(cfg, active_platform())
    task, rollouts = setup_rollout(cfg, actor)
    before = _local_params(actor.engine), _local_params(critic.engine)
    history = [train_step(cfg, actor, critic, task, rollouts, step) for step in range(steps)]
    after = _local_params(actor.engine), _local_params(critic.engine)
    return {"history": history, "chunks": (len(actor.engine.model), len(critic.engine.model)),
            "moved": [sorted(n for n in b if not torch.equal(b[n], a[n])) for b, a in zip(before, after)]}


def test_ppo_job_with_virtual_pipeline_stages(tmp_path):
    # actor and critic both run the interleaved schedule: pp=2 x vpp=2 over 4 layers
    cfg = _config("ppo_demo", tmp_path, "layout.tp=1", "layout.pp=2", "layout.vpp=2",
                  "model.tiny.num_hidden_layers=4", "task.response_length=2")
    ranks = run_ranks(2, _train_chunks, cfg, 2)
    for r in ranks:
        assert r["chunks"] == (2, 2), r["chunks"]
        for m in r["history"]:
            assert all(math.isfinite(m[k]) for k in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm")), m
        assert r["moved"][0] and r["moved"][1], r["moved"]  # actor and critic chunks on every stage learn
    assert [m["reward"] for m in ranks[0]["history"]] == [m["reward"] for m in ranks[1]["history"]]
    assert ranks[0]["history"][-1]["critic/vf_loss"] == ranks[1]["history"][-1]["critic/vf_loss"]


def _job(cfg: JobConfig) -> list[dict]:
    from mcore_rl.job.loop import run

    return run(cfg)


def test_gpt_oss_job_samples_and_trains_past_its_window_and_resumes(tmp_path):
    """The tiny gpt-oss demo (configs/grpo_gptoss_demo.yaml: sinks, a sliding window of 4 on every
    other layer, rows of 8 + 1 tokens, 4 experts top-2, EP=2, packed) for 4 steps, saved at steps
    2 and 4: the builtin sampler's log-probs (padded rows) are the actor's (packed rows), the
    policy moves, and a job resumed from step 2 repeats steps 3 and 4 exactly."""
    from mcore_rl.job.loop import tiny_hf_config
    from mcore_rl.models.hf_config import model_args_from_hf
    from tests.job_runs import metric_lines

    keys = ("steps=4", "checkpoint.save_freq=2", "rollout.prompts_per_step=4",
            "actor.micro_batch_size=32", "actor.ppo_mini_batch_size=32")
    cfg = load_job_config(os.path.join(ROOT, "configs", "grpo_gptoss_demo.yaml"),
                          [f"output_dir={tmp_path / 'a'}", "progress_bar=false", *keys])
    args = model_args_from_hf(tiny_hf_config(cfg.model.tiny))
    assert (args.window, args.window_layers, args.attention_sinks) == (4, (True, False), True)
    assert cfg.task.prompt_length + cfg.task.response_length > args.window  # the window acts
    straight = run_ranks(2, _job, cfg)[0]
    for m in straight:
        assert m["rollout_corr/max_abs_log_prob_diff"] <= 1e-5, m  # the sampler's forward == the actor's
        assert math.isfinite(m["actor/pg_loss"]) and m["actor/grad_norm"] > 0, m
    assert straight[-1]["entropy"] != straight[0]["entropy"], straight  # the policy moved
    resumed = run_ranks(2, _job, load_job_config(tmp_path / "a" / "config.yaml", [
        f"output_dir={tmp_path / 'b'}", "checkpoint.resume_mode=path",
        f"checkpoint.resume_path={tmp_path / 'a' / 'checkpoints' / 'global_step_2'}"]))[0]
    assert [m["step"] for m in resumed] == [0, 1, 2, 3]
    assert metric_lines(str(tmp_path / "b"))[2:] == metric_lines(str(tmp_path / "a"))[2:]
