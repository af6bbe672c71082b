"""The main job's checkpoints leave for HF and come back: a few PPO steps (actor + critic) saved by
the checkpoint manager, merged with mcore_to_hf, score the same in transformers as the live
sharded actor/critic; a job started from those model directories (model.mcore_dir /
model.critic_dir, at another layout) or from a converter's output computes what they computed."""
from __future__ import annotations

import os

import pytest
import torch

from mcore_rl.job.schema import JobConfig, load_job_config
from tests.dist import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOL = 1e-4  # fp32 on both sides
CASES = {  # name -> (tiny model overrides, training layout, reload layout)
    "qwen2": (["model.tiny.model_type=qwen2"], ["layout.tp=2", "layout.sequence_parallel=true"],
              ["layout.tp=1", "layout.pp=2"]),
    "qwen2_moe": (["model.tiny.model_type=qwen2_moe", "model.tiny.num_experts=4", "model.tiny.num_experts_per_tok=2",
                   "model.tiny.moe_intermediate_size=32", "model.tiny.shared_expert_intermediate_size=48",
                   "model.moe.router_dtype=fp64"], ["layout.tp=1", "layout.ep=2"], ["layout.tp=2", "layout.ep=1", "layout.sequence_parallel=true"]),
}


def _config(tmp_path, *overrides: str) -> JobConfig:
    return load_job_config(os.path.join(ROOT, "configs", "ppo_demo.yaml"), [
        f"output_dir={tmp_path}", "progress_bar=false", "seed=3", "task.response_length=3",
        "rollout.prompts_per_step=4", "rollout.temperature=0.7", "actor.micro_batch_size=8",
        "actor.ppo_mini_batch_size=16", "critic.micro_batch_size=8", "critic.ppo_mini_batch_size=16",
        "actor_optim.lr=1e-2", "critic_optim.lr=1e-2", *overrides])


def _batch(vocab: int) -> dict:
    """4 rows, prompts left-padded and responses right-padded, different on each row."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (4, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    mask[1, -1] = 0
    mask[2, :1] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, -3:].clone()}


def _score(actor, critic) -> dict:
    batch = _batch(actor.engine.args.vocab_size)
    out = {"log_probs": actor.compute_log_prob(batch)["log_probs"]}
    if critic is not None:
        out["values"] = critic.compute_values(batch)
    return out


def _train_and_save(cfg: JobConfig, steps: int) -> dict:
    """The job's build and steps, then the job's checkpoint manager saves step ``steps``; returns
    the live models' scores of ``_batch`` and the actor's local parameters before training."""
    from mcore_rl.job.loop import build, checkpoint_manager, setup_rollout, starts, train_step
    from mcore_rl.platform import active_platform

    begin = starts(cfg)
    actor, critic = build(cfg, active_platform(), begin)
    task, rollouts = setup_rollout(cfg, actor, begin)
    before = {n: p.detach().clone() for c in actor.engine.model for n, p in c.named_parameters()}
    for step in range(steps):
        train_step(cfg, actor, critic, task, rollouts, step)
    moved = [n for c in actor.engine.model for n, p in c.named_parameters() if not torch.equal(before[n], p)]
    ckpt = checkpoint_manager(cfg, {"actor": begin[0].hf_files, "critic": begin[1].hf_files})
    ckpt.save(steps, {"actor": actor.engine, "critic": critic.engine}, {"step": steps, "history": []})
    ckpt.close()
    return {**_score(actor, critic), "moved": len(moved), "params": len(before)}


def _start_and_score(cfg: JobConfig) -> dict:
    """A job built from ``cfg``'s start points; its scores of ``_batch`` and local parameters."""
    from mcore_rl.job.loop import build
    from mcore_rl.platform import active_platform

    actor, critic = build(cfg, active_platform())
    params = {f"actor.{n}": p.detach().clone() for c in actor.engine.model for n, p in c.named_parameters()}
    if critic is not None:
        params.update({f"critic.{n}": p.detach().clone() for c in critic.engine.model for n, p in c.named_parameters()})
    return {**_score(actor, critic), "params": params}


def _hf_scores(merged_actor: str, merged_critic: str, temperature: float) -> dict:
    """transformers' log-probs of the responses at ``temperature`` and values [4, 3]."""
    import transformers

    batch = _batch(transformers.AutoConfig.from_pretrained(merged_actor).vocab_size)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    lm = transformers.AutoModelForCausalLM.from_pretrained(merged_actor, dtype=torch.float32).eval()
    vm = transformers.AutoModelForTokenClassification.from_pretrained(merged_critic, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = lm(input_ids=ids, attention_mask=mask).logits[:, -4:-1].float() / temperature
        values = vm(input_ids=ids, attention_mask=mask).logits[:, -4:-1, 0].float()
        # the merged directory is a drop-in HF model: it generates (greedy, 4 new tokens)
        generated = lm.generate(input_ids=ids[3:, :5], attention_mask=mask[3:, :5], max_new_tokens=4,
                                min_new_tokens=4, do_sample=False)
    log_probs = torch.log_softmax(logits, -1).gather(-1, ids[:, -3:, None])[..., 0]
    real = mask[:, -3:].bool()
    return {"log_probs": torch.where(real, log_probs, 0.0), "values": torch.where(real, values, 0.0),
            "generated": tuple(generated.shape)}


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= tol


@pytest.mark.parametrize("name", list(CASES))
def test_trained_checkpoint_merges_to_hf_and_restarts_the_job(name, tmp_path):
    from mcore_rl.conversion.merge import merge

    model, train_layout, reload_layout = CASES[name]
    cfg = _config(tmp_path / "run", *model, *train_layout)
    live = run_ranks(2, _train_and_save, cfg, 2)[0]
    assert live["moved"] == live["params"], "training must change every actor parameter"
    step = tmp_path / "run" / "checkpoints" / "global_step_2"
    for role in ("actor", "critic"):
        merge(str(step / role), str(tmp_path / f"hf_{role}"))
    hf = _hf_scores(str(tmp_path / "hf_actor"), str(tmp_path / "hf_critic"), cfg.rollout.temperature)
    assert hf["generated"] == (1, 9)
    for key in ("log_probs", "values"):
        assert (live[key] != 0).sum() >= 10, key  # real tokens scored
        assert _close(live[key], hf[key], TOL), f"{name} {key}: {(live[key] - hf[key]).abs().max():.3g}"

    # the job restarted from the model directories, at another layout, scores the same
    again = _config(tmp_path / "again", *model, *reload_layout, f"model.mcore_dir={step / 'actor'}",
                    f"model.critic_dir={step / 'critic'}")
    got = run_ranks(2, _start_and_score, again)[0]
    for key in ("log_probs", "values"):
        assert _close(got[key], live[key], 1e-5), f"{name} {key}: {(got[key] - live[key]).abs().max():.3g}"


def test_job_starts_from_a_converter_output_and_a_critic_from_an_actor_dir(tmp_path):
    """model.mcore_dir = hf_to_mcore's output builds the same actor (bit for bit) as model.hf_dir
    = its HF source; model.critic_dir = that actor directory gives the critic the actor's trunk."""
    from tests.test_convert import _convert_all
    from tests.tiny import tiny_config, tiny_hf_model

    hf, out = tmp_path / "hf", tmp_path / "mcore"
    tiny_hf_model(tiny_config("qwen3", num_hidden_layers=2, vocab_size=16)).save_pretrained(hf)
    run_ranks(1, _convert_all, [(str(hf), str(out))])
    from_hf = _config(tmp_path / "a", "layout.tp=2", f"model.hf_dir={hf}")
    from_mcore = _config(tmp_path / "b", "layout.tp=2", f"model.mcore_dir={out}", f"model.critic_dir={out}")
    a = run_ranks(2, _start_and_score, from_hf)[0]
    b = run_ranks(2, _start_and_score, from_mcore)[0]
    actor = [k for k in a["params"] if k.startswith("actor.")]
    assert actor and all(torch.equal(a["params"][k], b["params"][k]) for k in actor)
    assert torch.equal(a["log_probs"], b["log_probs"])
    trunk = [k for k in b["params"] if k.startswith("critic.") and ".output_layer." not in k]
    assert len(trunk) == len(actor) - 1  # all but the LM head
    for k in trunk:
        assert torch.equal(b["params"][k], b["params"]["actor." + k[len("critic."):]]), k
    # the value head is not the (zero-loss) LM head: a fresh [1, hidden] init
    head = [v for k, v in b["params"].items() if k.startswith("critic.") and k.endswith("output_layer.weight")]
    assert [tuple(h.shape)[0] for h in head] == [1]


def _build_error(cfg: JobConfig) -> str:
    from mcore_rl.job.loop import starts

    try:
        starts(cfg)
    except Exception as e:  # noqa: BLE001 (the test checks type and message)
        from mcore_rl.errors import McoreRLError

        return f"{'ok' if isinstance(e, McoreRLError) else type(e).__name__}: {e}"
    return "no error"


def test_bad_start_points_are_refused(tmp_path):
    from tests.test_convert import _convert_all
    from tests.tiny import tiny_config, tiny_hf_model

    hf, out = tmp_path / "hf", tmp_path / "mcore"
    tiny_hf_model(tiny_config("llama", num_hidden_layers=1)).save_pretrained(hf)
    critic_hf = tmp_path / "critic_hf"
    tiny_hf_model(tiny_config("llama", num_hidden_layers=1), role="critic").save_pretrained(critic_hf)
    run_ranks(1, _convert_all, [(str(critic_hf), str(out))])
    cases = {
        "both": ([f"model.hf_dir={hf}", f"model.mcore_dir={out}"], "are both set; the actor starts from one"),
        "critic_as_actor": ([f"model.mcore_dir={out}"], "holds role 'critic'; it must be an actor model directory"),
        "hf_as_mcore": ([f"model.mcore_dir={hf}"], "holds a HF model; it must be an actor model directory"),
        "mcore_as_hf": ([f"model.hf_dir={out}"], "is a model directory (mcore_rl.json); pass it as model.mcore_dir"),
        "missing": ([f"model.mcore_dir={tmp_path / 'nope'}"], "is not a directory; pass a HF model directory"),
        "step_dir": ([f"model.mcore_dir={tmp_path}"], "holds neither mcore_rl.json (a model directory) nor config.json"),
        "grpo_critic": (["algorithm.name=grpo", f"model.critic_dir={out}"], "which has no critic: drop model.critic_dir"),
    }
    errors = {k: _build_error(_config(tmp_path, *v[0])) for k, v in cases.items()}  # no ranks needed
    for name, (_, text) in cases.items():
        assert errors[name].startswith("ok: ") and text in errors[name], f"{name}: {errors[name]}"


def test_critic_starts_from_a_sequence_classification_reward_model(tmp_path):
    """model.critic_dir = a HF *ForSequenceClassification reward model (score without bias): the
    job's critic (TP=2) computes the reward model's per-token scores."""
    from transformers import AutoModelForSequenceClassification

    from tests.tiny import tiny_config, tiny_hf_model

    tiny_hf_model(tiny_config("qwen2", num_hidden_layers=2)).save_pretrained(tmp_path / "lm")
    config = tiny_config("qwen2", num_hidden_layers=2, num_labels=1)
    config.pad_token_id = 0
    torch.manual_seed(5)
    rm = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()
    assert rm.score.bias is None
    rm.save_pretrained(tmp_path / "rm")
    cfg = _config(tmp_path / "run", "layout.tp=2", f"model.hf_dir={tmp_path / 'lm'}", f"model.critic_dir={tmp_path / 'rm'}")
    got = run_ranks(2, _start_and_score, cfg)[0]
    batch = _batch(config.vocab_size)
    with torch.no_grad():
        hidden = rm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        ref = rm.score(hidden)[:, -4:-1, 0]
    ref = torch.where(batch["attention_mask"][:, -3:].bool(), ref, 0.0)
    assert ref.abs().max() > 0.05
    assert _close(got["values"], ref, TOL), f"{(got['values'] - ref).abs().max():.3g}"
