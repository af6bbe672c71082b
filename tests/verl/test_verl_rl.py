"""verl's RL losses through verl's TrainingWorker on mcore_rl, against mcore_rl's own Actor and
Critic on the same rows (bodies: rl_bodies.py). One 2-process launch per layout covers the
actor and the critic, each with remove-padding off and on:

- infer_batch log-probs / entropy / values equal Actor.compute_log_prob / Critic.compute_values;
- train_mini_batch with verl's ppo_loss (clip, dual clip, entropy bonus, KL loss) / value_loss
  (value clip), two optimizer steps of several micro-batches: parameters equal the Actor's /
  Critic's update, grad norms and losses equal theirs, and verl's metrics equal what verl's
  definitions give on the rows (computed here independently, from the pre-update log-probs);
- get_per_tensor_param yields export_hf's tensors, lazily; transformers loads them and scores
  the rows as the engine does.
"""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("verl")

from tests.dist import run_ranks  # noqa: E402
from tests.verl import rl_bodies as B  # noqa: E402
from tests.verl.verl_fixtures import save_tiny_model  # noqa: E402

TOL = 1e-5
HF_TOL = 1e-4  # transformers' kernels vs megatron's (tests/test_hf_parity.py)
LAYOUTS = {  # name -> (model type, engine layout)
    "tp2_sp": ("qwen2", {"tensor_model_parallel_size": 2, "sequence_parallel": True}),
    # megatron's non-distributed optimizer too (its param.grad aliasing once doubled gradients)
    "pp2": ("llama", {"pipeline_model_parallel_size": 2, "use_distributed_optimizer": False}),
    "dp2": ("qwen2", {}),
    "ep2_moe": ("qwen3_moe", {"expert_model_parallel_size": 2}),
}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, tmp_path_factory) -> list[dict]:
    model_type, layout = LAYOUTS[request.param]
    d = tmp_path_factory.mktemp(request.param)
    actor = save_tiny_model(str(d / "actor"), model_type, seed=1)
    critic = save_tiny_model(str(d / "critic"), model_type, role="critic", seed=2)
    return run_ranks(2, B.rl_body, actor, critic, layout, 7, request.param == "dp2")


def _with_outputs(run: list[dict], role: str) -> list[dict]:
    """The ranks verl collects outputs from (is_mp_src_rank_with_outputs): one per DP rank."""
    ranks = [r for r in run if r[role]["padded"]["metrics"] is not None]
    assert sorted(r["dp_rank"] for r in ranks) == list(range(run[0]["dp"]))
    return ranks


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    diff = float((a - b).abs().max())
    assert diff <= tol, f"{what}: max difference {diff:.3g} > {tol}"


def test_infer_batch_equals_own_actor_and_critic(run):
    for r in _with_outputs(run, "actor"):
        own, mask = r["actor"]["own"], r["actor"]["rows"]["attention_mask"][:, -B.RESPONSE:].bool()
        assert own["log_probs"][mask].abs().max() > 1.0  # not a comparison of zeros
        for mode in ("padded", "packed"):
            got = r["actor"][mode]
            _close(got["log_probs"], own["log_probs"], TOL, f"{mode} log_probs")
            _close(got["entropy"], own["entropy"], TOL, f"{mode} entropy")
        _close(r["actor"]["ref_log_probs"], own["log_probs"], TOL, "forward-only reference log_probs")
    for r in _with_outputs(run, "critic"):
        own = r["critic"]["own"]["values"]
        assert own.abs().max() > 0.1
        for mode in ("padded", "packed"):
            _close(r["critic"][mode]["values"], own, TOL, f"{mode} values")


def test_update_equals_own_actor_and_critic(run):
    for role, loss in (("actor", "pg_loss"), ("critic", "vf_loss")):
        for r in run:  # every rank's parameter shards
            assert r[role]["moved"] > 10 * TOL, f"{role}: the update barely moved the parameters"
            for mode in ("padded", "packed"):
                assert r[role][mode]["param_diff"] <= TOL, (role, mode, r[role][mode]["param_diff"])
        if role == "actor":  # model.enable_gradient_checkpointing (packed worker only) -> full recompute
            assert [run[0]["actor"][m]["recompute"] for m in ("padded", "packed")] == ["None", "full"]
        for r in _with_outputs(run, role):
            own = r[role]["own_steps"]
            for mode in ("padded", "packed"):
                m = r[role][mode]["metrics"]
                assert m["grad_norm"] == pytest.approx([s[f"{role}/grad_norm"] for s in own], rel=TOL), (role, mode)
                assert m[f"{role}/{loss}"] == pytest.approx([s[f"{role}/{loss}"] for s in own], abs=TOL)
                # verl steps the schedule once per train_mini_batch and reports the lr after it
                # (verl's default linear decay over total_training_steps=10)
                assert m["lr"] == [pytest.approx(B.LR * (1 - 1 / 10))]


def _row_stats(rows: dict, log_probs: torch.Tensor, entropy: torch.Tensor, row: int) -> dict[str, float]:
    """verl's vanilla-PPO statistics of one row (one micro-batch: MICRO = 1), from their
    definitions: ratio clip [1 - low, 1 + high], dual clip c for negative advantages."""
    m = rows["response_mask"][row].bool()
    lp, old, adv = log_probs[row][m].double(), rows["old_log_probs"][row][m].double(), rows["advantages"][row][m].double()
    ratio = torch.exp(lp - old)
    unclipped, clipped = -adv * ratio, -adv * ratio.clamp(1 - B.CLIP_LOW, 1 + B.CLIP_HIGH)
    loss = torch.maximum(unclipped, clipped)
    capped = torch.minimum(loss, -adv * B.CLIP_C)
    ref = rows["ref_log_prob"][row][m].double()
    kl = (torch.exp(ref - lp) - (ref - lp) - 1).clamp(-10, 10)  # low_var_kl (k3)
    return {"clipfrac": float((clipped > unclipped).double().mean()), "ppo_kl": float((old - lp).mean()),
            "clipfrac_lower": float(((loss > -adv * B.CLIP_C) & (adv < 0)).double().mean()),
            "pg_sum": float(torch.where(adv < 0, capped, loss).sum()), "tokens": int(m.sum()),
            "entropy_sum": float(entropy[row][m].double().sum()), "kl_sum": float(kl.sum())}


def test_actor_metrics_mean_what_verl_means(run):
    """The first optimizer step's metrics (its forward runs at the starting weights)."""
    stats = []
    for r in _with_outputs(run, "actor"):
        a, first = r["actor"], B.MINI // r["dp"]
        stats += [_row_stats(a["rows"], a["own"]["log_probs"], a["own"]["entropy"], i) for i in range(first)]
    tokens = sum(s["tokens"] for s in stats)
    expect = {  # micro-batch means averaged (verl's Metric MEAN); losses as global token means
        "actor/pg_clipfrac": sum(s["clipfrac"] for s in stats) / len(stats),
        "actor/ppo_kl": sum(s["ppo_kl"] for s in stats) / len(stats),
        "actor/pg_clipfrac_lower": sum(s["clipfrac_lower"] for s in stats) / len(stats),
        "actor/pg_loss": sum(s["pg_sum"] for s in stats) / tokens,
        "actor/entropy_loss": sum(s["entropy_sum"] for s in stats) / tokens,
        "kl_loss": sum(s["kl_sum"] for s in stats) / tokens,
    }
    assert expect["actor/pg_clipfrac"] > 0.05 and expect["actor/pg_clipfrac_lower"] > 0  # both clips act
    for r in _with_outputs(run, "actor"):
        for mode in ("padded", "packed"):
            got = r["actor"][mode]["metrics"]
            for key, value in expect.items():
                assert got[key][0] == pytest.approx(value, abs=TOL), (mode, key, got[key], value)


def test_critic_metrics_mean_what_verl_means(run):
    """vf_loss = 0.5 * token mean of max((v - R)^2, (clip(v, old +- c) - R)^2) over the first
    step's rows; vf_clipfrac and vpred_mean one entry per micro-batch (row)."""
    clipfrac, vpred, total, tokens = [], [], 0.0, 0
    for r in _with_outputs(run, "critic"):
        rows, values = r["critic"]["rows"], r["critic"]["own"]["values"]
        for i in range(B.MINI // r["dp"]):
            m = rows["response_mask"][i].bool()
            v, old, ret = values[i][m].double(), rows["values"][i][m].double(), rows["returns"][i][m].double()
            plain, clipped = (v - ret) ** 2, (torch.clamp(v, old - B.CLIP_VALUE, old + B.CLIP_VALUE) - ret) ** 2
            clipfrac.append(float((clipped > plain).double().mean()))
            vpred.append(float(v.mean()))
            total, tokens = total + float(torch.maximum(plain, clipped).sum()), tokens + int(m.sum())
    assert max(clipfrac) > 0  # the value clip acts
    first = len(clipfrac)  # entries of the first step (the list holds both steps)
    for r in _with_outputs(run, "critic"):
        for mode in ("padded", "packed"):
            got = r["critic"][mode]["metrics"]
            assert got["critic/vf_loss"][0] == pytest.approx(0.5 * total / tokens, abs=TOL)
            assert sorted(got["critic/vf_clipfrac"][:first]) == pytest.approx(sorted(clipfrac), abs=TOL)
            assert sorted(got["critic/vpred_mean"][:first]) == pytest.approx(sorted(vpred), abs=TOL)


def test_get_per_tensor_param_is_export_hf_and_transformers_reproduces_it(run):
    for r in run:
        e = r["actor"]["export"]
        assert e["lazy"] and e["extra"] is None and e["same_as_export_hf"] and e["names"] > 10, e
    for r in _with_outputs(run, "actor"):
        e, mask = r["actor"]["export"], r["actor"]["rows"]["attention_mask"][:, -B.RESPONSE:].bool()
        assert not math.isnan(float(e["hf_log_probs"].sum()))
        _close(e["hf_log_probs"][mask], e["engine_log_probs"][mask], HF_TOL, "transformers vs engine log_probs")


def test_engines_of_one_process_share_their_layout(run):
    for r in run:
        assert "already runs an mcore_rl engine" in r["other_layout"] and "'tp'" in r["other_layout"], r["other_layout"]


def _cp2(run: list[dict]) -> list[dict]:
    """The CP=2 results of the dp2 launch (cp_bodies), one per rank (= CP rank at DP=1)."""
    if "cp2" not in run[0]:
        pytest.skip("CP=2 runs after the dp2 layout's comparisons, in its launch")
    return [r["cp2"] for r in run]


def test_cp2_outputs_are_whole_on_the_output_rank_and_equal_cp1(run):
    """infer_batch at CP=2 (padded and packed): CP rank 0 gets the whole log-probs, entropy and
    values of every row, equal to the CP=1 (DP=2) run's; CP rank 1 gets none."""
    cp = _cp2(run)
    for role, keys in (("actor", ("log_probs", "entropy")), ("critic", ("values",))):
        rows = cp[0]["rows"][role]
        lengths = rows["attention_mask"].sum(-1)
        assert lengths.max() > 2 * 2 * 2 and len(set(lengths.tolist())) > 3, lengths  # CP splits; rows differ
        for mode in ("padded", "packed"):
            assert [c[role][mode]["src"] for c in cp] == [True, False]
            for key in keys:
                assert cp[1][role][mode][key] is None
                got, want = cp[0][role][mode][key], rows[f"cp1_{mode}_{key}"]
                assert want.abs().max() > 0.1
                _close(got, want, TOL, f"{role} {mode} {key} at CP=2")


def test_cp2_update_metrics_and_grad_norms_equal_cp1(run):
    """train_mini_batch at CP=2 with verl's ppo_loss / value_loss: every metric (grad norms, losses,
    clip fractions, ...) of both optimizer steps equals the CP=1 (DP=2) run's on the same rows."""
    cp = _cp2(run)
    for role in ("actor", "critic"):
        for mode in ("padded", "packed"):
            assert cp[1][role][mode]["metrics"] is None
            got, want = cp[0][role][mode]["metrics"], run[0][role][mode]["metrics"]
            assert set(got) == set(want) and len(got["grad_norm"]) == 2, (set(got) ^ set(want), got)
            keys = sorted(k for k in want if k != "mfu" and not k.startswith(("perf/", "timing")))  # not speed, memory
            print(role, mode, keys)
            for key in keys:
                g, w = (sorted(v) if isinstance(v, list) else [v] for v in (got[key], want[key]))
                assert g == pytest.approx(w, rel=TOL, abs=TOL), (role, mode, key, got[key], want[key])
