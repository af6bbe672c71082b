"""The main job end to end (short versions of configs/*.yaml): GRPO and PPO learn the toy task's
first steps, write metrics.jsonl / reward.png / config.yaml, start from a HF directory, and the
README's torchrun entry point runs quietly; the job schema's derived values and errors."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from mcore_rl.config_loader import ConfigError
from mcore_rl.job.schema import JobConfig, load_job_config
from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cfg: JobConfig) -> list:
    from mcore_rl.job.loop import run

    return run(cfg)


def _short(name: str, tmp_path, *overrides: str) -> JobConfig:
    path = os.path.join(ROOT, "configs", f"{name}.yaml")
    return load_job_config(path, [f"output_dir={tmp_path}", "progress_bar=false", *overrides])


CP2 = ("layout.tp=1", "layout.cp=2")
PACKED = ("actor.use_remove_padding=true", "critic.use_remove_padding=true")


@pytest.mark.parametrize("name,steps,layout", [("grpo_demo", 60, ()), ("ppo_demo", 60, ()), ("ppo_demo", 60, CP2),
                                               # DeepSeek-V3 at EP=2 replaying the old policy's routing
                                               ("grpo_deepseek_demo", 100, ())])
def test_demo_learns(name, steps, layout, tmp_path):
    cfg = _short(name, tmp_path, f"steps={steps}", *layout)
    history = run_ranks(2, _run, cfg)[0]
    rewards = [m["reward"] for m in history]
    assert rewards[0] <= 0.1  # a random policy: chance is 1/16
    assert sum(rewards[-10:]) / 10 >= 0.3  # the full config reaches >= 0.9 (see README)
    lines = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert [m["step"] for m in lines] == list(range(steps))
    required = {"step", "reward", "actor/pg_loss", "actor/ppo_kl", "entropy", "actor/grad_norm", "time_s"}
    assert required <= set(lines[-1])
    if name == "ppo_demo":
        assert {"critic/vf_loss", "critic/grad_norm"} <= set(lines[-1])
    assert (tmp_path / "reward.png").stat().st_size > 1000
    assert load_job_config(tmp_path / "config.yaml") == cfg


# a threshold count (a ratio crossing its clip bound) flips with the last bit of its ratio
COUNTS = ("actor/pg_clipfrac", "actor/pg_clipfrac_lower", "critic/vf_clipfrac")


def test_packed_cp_job_follows_the_padded_one(tmp_path):
    """PPO at CP=2 with packed rows (remove-padding, actor and critic): the first 5 steps equal the
    padded CP=2 job's, shown to learn above: the same samples (rewards, lengths exactly), losses,
    grad norms, entropies and values within 1e-5 (they agree to ~1e-7 over 60 steps)."""
    from mcore_rl.job.loop import wall_clock

    runs = [run_ranks(2, _run, _short("ppo_demo", tmp_path / name, "steps=5", *CP2, *extra))[0]
            for name, extra in (("padded", ()), ("packed", PACKED))]
    padded, packed = ([{k: v for k, v in m.items() if not wall_clock(k) and k not in COUNTS} for m in run]
                      for run in runs)
    assert len(padded) == len(packed) == 5
    for a, b in zip(padded, packed):
        assert a.keys() == b.keys() and {"critic/vf_loss", "actor/pg_loss", "actor/grad_norm"} <= a.keys()
        assert (a["reward"], a["response_length"]) == (b["reward"], b["response_length"]), (a, b)
        differ = {k: (a[k], b[k]) for k in a if abs(a[k] - b[k]) > 1e-5 * max(1.0, abs(a[k]))}
        assert not differ, (a["step"], differ)


def test_rollout_routing_replay_job(tmp_path):
    """R3: the builtin rollout records routing, the update replays it (3 steps, EP=2)."""
    cfg = _short("grpo_deepseek_demo", tmp_path, "steps=3", "actor.router_replay=R3")
    history = run_ranks(2, _run, cfg)[0]
    assert len(history) == 3 and all(m["actor/grad_norm"] > 0 for m in history)


def test_starts_from_hf_directory(tmp_path):
    model_dir = tmp_path / "hf"
    tiny_hf_model(tiny_config("qwen2", vocab_size=16, num_hidden_layers=2)).save_pretrained(model_dir)
    cfg = _short("grpo_demo", tmp_path / "out", "steps=3", f"model.hf_dir={model_dir}",
                 "actor.use_kl_loss=true", "actor.kl_loss_coeff=0.01")
    history = run_ranks(2, _run, cfg)[0]
    assert len(history) == 3 and "kl_to_ref" in history[0] and "actor/kl_loss" in history[0]


def test_torchrun_entry_point_is_quiet(straight_job):
    """What a user sees from launch/run.sh (the checkpoint tests' straight 10-step run, saving
    every 2 steps, tests/job_runs.py): layout, progress bar, checkpoint notices, summary; no
    third-party warnings, rank 1 silent."""
    output = open(f"{straight_job}.run10.log").read()
    lines = output.splitlines()  # the progress bar's updates (after a carriage return) count apart
    bar = [line for line in lines if line.startswith("grpo: ")]
    assert bar and all(re.match(r"grpo: +\d+%\|.*\| \d+/10 \[", line) for line in bar), output
    assert len(lines) - len(bar) <= 12, output  # layout, storage mode, 3 retentions, summary: 8
    assert not re.search(r"Warning|warnings\.warn", output), output
    assert lines[0].startswith("grpo (fp32): tp=2, pp=1"), output
    summary = [line for line in lines if line.startswith("done: 10 steps in ")]
    assert len(summary) == 1 and f"outputs in {straight_job}/ (metrics.jsonl" in output, output
    assert re.search(r"per step: rollout \d+\.\d\d s, old_log_prob \d+\.\d\d s, update \d+\.\d\d s, "
                     r"weight_sync \d+\.\d\d s; \d+ tokens/s", output), output
    assert re.search(r"reward 0\.\d{3} at step 0, 0\.\d{3} over the first 5 steps, 0\.\d{3} over the last 5 steps",
                     summary[0]), output


@pytest.mark.parametrize("args,message", [
    (["configs/grpo_demo.yaml", "rollout.engin=transformers"], "error: unknown key 'rollout.engin'"),
    (["configs/grpo_demo.yaml", "rollout.engine=vllm"], "error: rollout.engine: expected one of 'builtin', 'transformers'"),
    (["configs/no_such.yaml"], "error: "),
])
def test_launcher_config_mistake_is_one_line(args, message):
    done = subprocess.run(["bash", "launch/run.sh", "2", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]})
    assert done.returncode == 2, done.stderr[-2000:]
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines


def test_quiet_rank_still_shows_its_traceback():
    code = ("import sys; sys.path.insert(0, 'launch'); import train; train.quiet_third_party(1); "
            "import warnings; warnings.warn('noise'); print('hidden'); raise RuntimeError('rank 1 failed')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert "Traceback" in done.stderr and "RuntimeError: rank 1 failed" in done.stderr
    assert "noise" not in done.stderr


def test_unknown_config_key_names_its_path(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'actor.clip_ratio_hgh'"):
        _short("grpo_demo", tmp_path, "actor.clip_ratio_hgh=0.3")


def test_written_config_keeps_following(tmp_path):
    # the resolved config.yaml is a starting point for the next run: values that followed others
    # keep following when that run overrides what they follow
    from mcore_rl.job.schema import dump_job_config

    cfg = _short("ppo_demo", tmp_path, "steps=7", "critic_optim.total_steps=50")
    path = tmp_path / "config.yaml"
    path.write_text(dump_job_config(cfg))
    assert load_job_config(path) == cfg
    again = load_job_config(path, ["steps=12", "rollout.temperature=0.5"])
    assert (again.actor_optim.total_steps, again.critic_optim.total_steps) == (12, 50)
    assert again.actor.temperature == 0.5


def test_derived_values_follow_unless_set(tmp_path):
    cfg = _short("ppo_demo", tmp_path, "steps=7", "rollout.temperature=0.6")
    assert cfg.actor.temperature == 0.6  # log-probs at the rollout's temperature
    assert cfg.actor_optim.total_steps == 7 and cfg.critic_optim.total_steps == 7
    cfg = _short("ppo_demo", tmp_path, "steps=7", "actor_optim.total_steps=50", "actor.temperature=1.0")
    assert cfg.actor_optim.total_steps == 50 and cfg.critic_optim.total_steps == 7
    with pytest.raises(ConfigError, match=re.escape(
            "actor.temperature=0.5 differs from rollout.temperature=1.0: the job samples and computes "
            "the actor's log-probs at one temperature; set rollout.temperature only")):
        _short("grpo_demo", tmp_path, "actor.temperature=0.5")


@pytest.mark.parametrize("overrides, message", [
    (["model.tiny.num_experts=4"], "model.tiny: invalid TinyModelConfig: num_experts=4 is not read by "
                                   "model_type='llama' (only by qwen2_moe, qwen3_moe, mixtral, gpt_oss, glm4_moe, deepseek_v3, qwen3_next, qwen3_5_moe_text); remove it"),
    (["model.tiny.model_type=qwen3_moe"], "model.tiny: invalid TinyModelConfig: model_type='qwen3_moe' needs "
                                          "num_experts, num_experts_per_tok, moe_intermediate_size"),
    (["model.tiny.model_type=mixtral", "model.tiny.num_experts=4", "model.tiny.num_experts_per_tok=2",
      "model.tiny.moe_intermediate_size=8"], "moe_intermediate_size=8 is not read by model_type='mixtral'"),
    (["model.dtype=fp16"], "model.dtype: expected one of 'fp32', 'bf16', got 'fp16' (str)"),
    (["model.moe.dispatcher=flex"], "model.moe.dispatcher: expected one of 'alltoall', 'allgather', got 'flex'"),
    (["model.moe.aux_loss_coeff=0.1"], "model: invalid ModelConfig: aux_loss_coeff=0.1 has no effect with "
                                       "load_balancing='none'"),
    (["layout.ep=two"], "layout.ep: expected int, got 'two' (str)"),
    (["rollout.temperature=0"], "rollout: invalid RolloutConfig: temperature=0.0 must be > 0"),
    (["actor.dispatch=sharded"], "actor.dispatch='sharded': the main job passes the whole batch on "
                                 "every rank; set actor.dispatch=global"),
    (["rollout.prompts_per_step=0"], "rollout: invalid RolloutConfig: prompts_per_step=0 must be >= 1"),
    (["rollout.samples_per_prompt=0"], "rollout: invalid RolloutConfig: samples_per_prompt=0 must be >= 1"),
    (["task.response_length=0"], "task: invalid TaskConfig: response_length=0 must be >= 1"),
    (["task.prompt_length=0"], "task: invalid TaskConfig: prompt_length=0 must be >= 1"),
    (["steps=-1"], "<top level>: invalid JobConfig: steps=-1 must be >= 0"),
    (["rollout.engine=vllm"], "rollout.engine: expected one of 'builtin', 'transformers', got 'vllm'"),
    (["rollout.sync_bucket_mb=0"], "rollout: invalid RolloutConfig: sync_bucket_mb=0 must be >= 1"),
    (["task.name=math"], "task.name: expected one of 'toy', 'arithmetic', got 'math'"),
    (["task.arithmetic.operations=[/]"], "task.arithmetic: invalid ArithmeticConfig: operations=['/']: each must be one of"),
    (["task.arithmetic.eval_questions=-1"], "eval_questions=-1 must be >= 0"),
    (["actor.router_replay=R3", "rollout.engine=transformers"],
     "actor.router_replay=R3 replays the rollout's routing, which rollout.engine=transformers does not report"),
    (["actor.router_replay=R5"], "actor.router_replay: expected one of 'disabled', 'R2', 'R3', got 'R5'"),
    (["model.tiny.model_type=deepseek_v3", "model.tiny.num_experts=4", "model.tiny.num_experts_per_tok=2",
      "model.tiny.moe_intermediate_size=8"], "model_type='deepseek_v3' (multi-latent attention) has no KV "
                                             "groups: set num_key_value_heads=4"),
    (["model.tiny.model_type=deepseek_v3", "model.tiny.num_key_value_heads=4", "model.tiny.num_experts=4",
      "model.tiny.num_experts_per_tok=2"], "model_type='deepseek_v3' needs moe_intermediate_size, "
                                           "first_k_dense_replace, n_group, topk_group, q_lora_rank"),
    (["model.tiny.kv_lora_rank=8"], "kv_lora_rank=8 is not read by model_type='llama' (only by deepseek_v3)"),
    (["model.tiny.linear_num_key_heads=2"],
     "linear_num_key_heads=2 is not read by model_type='llama' (only by qwen3_5_text, qwen3_next, qwen3_5_moe_text)"),
    (["model.tiny.model_type=qwen3_5_text"], "model_type='qwen3_5_text' needs linear_num_key_heads, "
     "linear_num_value_heads, linear_key_head_dim, linear_value_head_dim"),
    (["model.tiny.sliding_window=4"], "sliding_window=4 is not read by model_type='llama' (only by mistral, mixtral, "
                                      "gpt_oss); remove it"),
    (["model.tiny.model_type=gpt_oss"], "model_type='gpt_oss' needs num_experts, num_experts_per_tok"),
    (["model.tiny.model_type=gpt_oss", "model.tiny.num_experts=4", "model.tiny.num_experts_per_tok=2",
      "model.tiny.moe_intermediate_size=8"], "moe_intermediate_size=8 is not read by model_type='gpt_oss'"),
])
def test_schema_errors_name_the_key(tmp_path, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        _short("grpo_demo", tmp_path, *overrides)
