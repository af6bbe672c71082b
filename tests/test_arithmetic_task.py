"""The main job's arithmetic task (real tokenizer and chat template of the prepared SmolLM2):
held-out questions never trained on, seeded prompts, the exact-match reward, refusals; and a
short job on it with per-replica transformers engines (tiny model with SmolLM2's tokenizer)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from mcore_rl.job.arithmetic_task import ArithmeticConfig, ArithmeticTask, last_integer, questions
from tests.dist import run_ranks
from tests.real_model import smollm2_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.join(smollm2_dir(), "hf"))


def _responses(tokenizer, texts: list[str], width: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, width] of ``texts`` + end-of-turn, right-padded, and their mask."""
    ids = torch.full((len(texts), width), tokenizer.pad_token_id)
    mask = torch.zeros(len(texts), width, dtype=torch.long)
    for i, t in enumerate(texts):
        row = tokenizer(t, add_special_tokens=False)["input_ids"][: width - 1] + [tokenizer.eos_token_id]
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1
    return ids, mask


@pytest.mark.parametrize("config", [ArithmeticConfig(), ArithmeticConfig(max_operand=7, operations=("*",), held_out_percent=40)])
def test_held_out_questions_are_never_trained_on(tokenizer, config):
    train, held = questions(config)
    assert not {q for q, _ in train} & {q for q, _ in held}
    share = len(held) / (len(train) + len(held))
    assert abs(share - config.held_out_percent / 100) < 0.08, share
    task = ArithmeticTask(config, tokenizer, seed=3)
    held_ids = {tuple(p) for p in task.held_out().token_ids}
    assert len(held_ids) == len(held)
    for step in range(20):
        assert not {tuple(p) for p in task.train_prompts(step, 16).token_ids} & held_ids
    # the same draw for a seed and step, another for another seed
    again = ArithmeticTask(config, tokenizer, seed=3).train_prompts(5, 16)
    assert again.token_ids == task.train_prompts(5, 16).token_ids
    assert ArithmeticTask(config, tokenizer, seed=4).train_prompts(5, 16).token_ids != again.token_ids


def test_default_split_has_enough_held_out_questions():
    assert len(questions(ArithmeticConfig())[1]) >= 100


def test_prompts_use_the_chat_template(tokenizer):
    task = ArithmeticTask(ArithmeticConfig(system_prompt="Be brief."), tokenizer, seed=1)
    prompts = task.train_prompts(0, 2)
    text = tokenizer.decode(prompts.token_ids[0])
    question = [q for q, a in questions(ArithmeticConfig())[0] if str(a) == prompts.references[0]]
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and text.endswith("<|im_start|>assistant\n")
    assert any(q in text for q in question)
    assert task.eos_id == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_reward_is_an_exact_match_of_the_last_integer(tokenizer):
    from mcore_rl.job.prompts import Prompts

    task = ArithmeticTask(ArithmeticConfig(), tokenizer, seed=1)
    cases = {"19": 1.0, "The answer is 19.": 1.0, "12 + 7 = 19": 1.0, " 19 \n": 1.0, "19 or 20": 0.0,
             "190": 0.0, "1 9": 0.0, "nineteen": 0.0, "": 0.0, "-19": 0.0}
    ids, mask = _responses(tokenizer, list(cases))
    prompts = Prompts([[1]] * len(cases), ["19"] * len(cases))
    assert task.score(prompts, ids, mask).tolist() == list(cases.values())
    metrics = task.eval_metrics(prompts, ids, mask)
    assert metrics == pytest.approx({"accuracy": 0.4, "number_only_accuracy": 0.2})  # "19" and " 19 \n"
    # masked tokens are not read: the answer after the end of the response does not count
    mask[0, 0] = 0
    assert task.score(prompts, ids, mask)[0] == 0.0
    assert last_integer("3 - 5 = -2") == "-2" and last_integer("none") is None


@pytest.mark.parametrize("kwargs,message", [
    (dict(operations=("/",)), r"operations=\['/'\]: each must be one of"),
    (dict(held_out_percent=0), "held_out_percent=0 must be in 1..99"),
    (dict(max_operand=0), "max_operand=0 must be >= 1"),
])
def test_bad_task_config_names_the_value(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ArithmeticConfig(**kwargs)


def test_tokenizer_without_chat_template_is_refused(tmp_path, tokenizer):
    from mcore_rl.job.task import TaskConfig, make_task

    tokenizer.save_pretrained(tmp_path)
    for name in ("chat_template.jinja", "chat_template.json"):
        if (tmp_path / name).exists():
            (tmp_path / name).unlink()
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has no chat template"):
        make_task(TaskConfig(name="arithmetic"), 1, 49152, str(tmp_path))
    with pytest.raises(ValueError, match="needs a tokenizer with a chat template"):
        make_task(TaskConfig(name="arithmetic"), 1, 49152, None)


def test_model_directory_carries_the_chat_template(tokenizer):
    """A job started from converters/hf_to_mcore.py's output (model.mcore_dir) formats prompts as
    one started from the HF directory: the chat template travels with the HF files."""
    from mcore_rl.job.task import TaskConfig, make_task

    from_hf = make_task(TaskConfig(name="arithmetic"), 1, len(tokenizer), os.path.join(smollm2_dir(), "hf"))
    from_mcore = make_task(TaskConfig(name="arithmetic"), 1, len(tokenizer),
                           os.path.join(smollm2_dir(), "mcore", "huggingface"))
    assert from_mcore.train_prompts(0, 4).token_ids == from_hf.train_prompts(0, 4).token_ids


def _job(cfg):
    from mcore_rl.job.loop import run

    return run(cfg)


def test_job_on_the_arithmetic_task_with_transformers_engines(tmp_path, tokenizer):
    from mcore_rl.job.schema import load_job_config
    from tests.tiny import tiny_config, tiny_hf_model

    model_dir = tmp_path / "hf"  # a tiny llama with SmolLM2's vocabulary, tokenizer and chat template
    tiny_hf_model(tiny_config("llama", vocab_size=len(tokenizer), num_hidden_layers=2)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    cfg = load_job_config(os.path.join(ROOT, "configs", "grpo_smollm2.yaml"), [
        f"output_dir={tmp_path / 'out'}", "progress_bar=false", "steps=2", f"model.hf_dir={model_dir}",
        "task.response_length=4", "task.arithmetic.eval_questions=6", "rollout.prompts_per_step=2",
        "rollout.samples_per_prompt=2", "actor.micro_batch_size=2", "actor.ppo_mini_batch_size=4",
        # a random model scores 0 (no advantage): the entropy bonus moves the policy, so a stale engine shows
        "actor.entropy_coeff=0.5", "actor_optim.lr=1e-2", "actor_optim.warmup_steps=0"])
    history = run_ranks(2, _job, cfg)[0]
    assert len(history) == 2 and history[0]["actor/grad_norm"] > 0
    for m in history:
        assert m["rollout_corr/max_abs_log_prob_diff"] <= 1e-4, m  # engines synced every step
        assert {"rollout_corr/kl", "rollout_corr/k3_kl", "rollout_corr/log_ppl_diff", "rollout_corr/chi2_token",
                "timing/rollout_s", "timing/weight_sync_s", "timing/old_log_prob_s", "timing/update_s",
                "tokens_per_s"} <= set(m)
    evals = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert [evals["before"]["step"], evals["after"]["step"]] == [0, 2]
    assert evals["before"]["questions"] == 6 and 0 <= evals["after"]["accuracy"] <= 1
