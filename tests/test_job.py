"""The main job end to end (short versions of configs/*.yaml): GRPO and PPO learn the toy task's
first steps, write metrics.jsonl / reward.png / config.yaml, start from a HF directory, and the
README's torchrun entry point runs."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mcore_rl.config_loader import load_config
from mcore_rl.job.schema import JobConfig
from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(cfg: JobConfig) -> list:
    from mcore_rl.job.loop import run

    return run(cfg)


def _short(name: str, tmp_path, *overrides: str) -> JobConfig:
    path = os.path.join(ROOT, "configs", f"{name}.yaml")
    return load_config(JobConfig, path, [f"output_dir={tmp_path}", "progress_bar=false", *overrides])


@pytest.mark.parametrize("name,steps", [("grpo_demo", 60), ("ppo_demo", 60)])
def test_demo_learns(name, steps, tmp_path):
    cfg = _short(name, tmp_path, f"steps={steps}")
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
    assert load_config(JobConfig, tmp_path / "config.yaml") == cfg


def test_starts_from_hf_directory(tmp_path):
    model_dir = tmp_path / "hf"
    tiny_hf_model(tiny_config("qwen2", vocab_size=16, num_hidden_layers=2)).save_pretrained(model_dir)
    cfg = _short("grpo_demo", tmp_path / "out", "steps=3", f"model.hf_dir={model_dir}",
                 "actor.use_kl_loss=true", "actor.kl_loss_coeff=0.01")
    history = run_ranks(2, _run, cfg)[0]
    assert len(history) == 3 and "kl_to_ref" in history[0] and "actor/kl_loss" in history[0]


def test_torchrun_entry_point(tmp_path):
    env = {**os.environ, "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    cmd = ["bash", "launch/run.sh", "2", "configs/grpo_demo.yaml", "steps=2", f"output_dir={tmp_path}"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(open(tmp_path / "metrics.jsonl").readlines()) == 2


def test_unknown_config_key_names_its_path(tmp_path):
    from mcore_rl.config_loader import ConfigError

    with pytest.raises(ConfigError, match=r"unknown key 'actor.clip_ratio_hgh'"):
        _short("grpo_demo", tmp_path, "actor.clip_ratio_hgh=0.3")
