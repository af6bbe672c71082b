"""Context parallelism on padded batches: logits, log-probs, entropy, values, one update of the actor
and of the critic (parameters after the optimizer step, grad norms, loss metrics) with CP=2,
CP=2 x TP=2 + SP, CP=2 x PP=2, CP=2 x PP=2 x VPP=2 and CP=2 x EP=2 (MoE) equal CP=1 within 1e-5; sequence lengths
not divisible by 2 * cp and sequences shorter than 2 * cp work; no decoder layer ever sees the
whole sequence under CP. Sliding windows (tests/window_bodies.py): five windowed architectures
equal transformers at world 1, TP=2+SP, PP=2 and CP=2 (windows by global position), padded and
packed, and packed gradients equal padded ones."""
from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state

from tests.dist import run_ranks
from tests.tiny import padded_batch, rl_batch, tiny_config, tiny_hf_model
from tests.window_bodies import LOGITS_BATCH, WINDOWED, references, save_windowed, window_layout

TOL = 1e-5
DENSE = {  # name -> layout (world 4; CP=1 reference first)
    "ref": dict(),
    "cp2": dict(cp=2),
    "cp2_tp2_sp": dict(cp=2, tp=2, sequence_parallel=True),
    "cp2_pp2": dict(cp=2, pp=2),
}
MOE = {"moe_ref": dict(), "moe_cp2_ep2": dict(cp=2, ep=2)}
DEEP = {"deep_ref": dict(), "deep_cp2_pp2_vpp2": dict(cp=2, pp=2, vpp=2)}  # 4 layers: 2 chunks per stage
# DeepSeek-V3: multi-latent attention under CP with TP + SP (and its sigmoid router, EP 1)
MLA = {"mla_ref": dict(), "mla_cp2_tp2_sp": dict(cp=2, tp=2, sequence_parallel=True)}
# sliding windows (tests/window_bodies.py): every windowed model per layout; world 1 in "single"'s world
WIN = {"win_tp2_sp": dict(tp=2, sequence_parallel=True), "win_pp2": dict(pp=2), "win_cp2": dict(cp=2)}


def make_batch(vocab: int, prompt: int, response: int) -> dict:
    """An update batch: rows with left-padded prompts and right-padded responses, random
    old log-probs, advantages, values and returns (different per token)."""
    batch = rl_batch(vocab, batch=8, prompt=prompt, response=response, seed=prompt)
    g = torch.Generator().manual_seed(7)
    shape = batch["responses"].shape
    batch.update(old_log_probs=-torch.rand(shape, generator=g) * 3, advantages=torch.randn(shape, generator=g),
                 values=torch.randn(shape, generator=g), returns=torch.randn(shape, generator=g))
    return batch


def _run_layout(hf_dir: str, layout_kwargs: dict, batches: list[dict], batching: dict | None = None) -> dict:
    # the critic loads a *ForTokenClassification model (``hf_dir``_critic): a fresh value head
    # would be initialised differently at each layout
    """Actor and critic at ``layout_kwargs``: scores of every batch, then one update each on the
    first; the largest sequence dim any decoder layer saw; full HF parameters after the updates."""
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.parallel import ParallelLayout, destroy_parallel_state, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.critic import Critic, CriticConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    destroy_parallel_state()
    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout, seed=1)
    args = model_args_from_hf(hf_dir)
    options = BuildOptions(moe=MoEOptions(router_dtype="fp64", load_balancing="none", aux_loss_coeff=0.0))
    # eps = 1: Adam's first step lr * g / (|g| + eps) is smooth in g, so parameters differ by about
    # the gradient difference (with a small eps it is lr * sign(g): rounding -> lr-sized jumps)
    optim = OptimConfig(lr=1.0, eps=1.0, clip_grad=1.0)
    actor = Actor(ModelEngine(args, layout, "actor", active_platform(), options, optim, hf_dir),
                  ActorConfig(micro_batch_size=2, ppo_mini_batch_size=8, loss_agg_mode="seq-mean-token-mean",
                              entropy_coeff=0.01, clip_ratio_low=0.1, **(batching or {})))
    critic = Critic(ModelEngine(args, layout, "critic", active_platform(), options, optim, hf_dir + "_critic"),
                    CriticConfig(micro_batch_size=4, ppo_mini_batch_size=8, cliprange_value=0.2, **(batching or {})))
    seen = []
    for engine in (actor.engine, critic.engine):
        for chunk in engine.model:
            for layer in chunk.module.decoder.layers:
                layer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw.get("hidden_states", a[0] if a else None).shape[0]),
                                                with_kwargs=True)
    out = {"scores": [], "logits": _full_logits(actor.engine, padded_batch(200, batch=4, seq=16))}
    for batch in batches:
        lp = actor.compute_log_prob(batch, with_entropy=True)
        out["scores"].append({**lp, "values": critic.compute_values(batch)})
    out["actor_metrics"] = actor.update_policy(batches[0])
    out["critic_metrics"] = critic.update_critic(batches[0])
    out["seen"] = max(seen)
    out["params"] = {**export_hf(actor.engine.model, args, "actor"),
                     **{f"critic.{k}": v for k, v in export_hf(critic.engine.model, args, "critic").items()}}
    return out if torch.distributed.get_rank() == 0 else {"seen": out["seen"]}


def _full_logits(engine, batch: dict) -> torch.Tensor:
    """[b, s, vocab] logits of every position (TP-gathered, CP pieces put back in column order)."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from mcore_rl.models.context_parallel import cp_columns, cp_rank_size

    def loss_fn(mb: dict, out: torch.Tensor):
        out = gather_from_tensor_model_parallel_region(out)[..., :engine.args.vocab_size].contiguous()
        rank, size = cp_rank_size()
        s = mb["input_ids"].shape[1]
        full = out.new_zeros(out.shape[0], s, out.shape[2])
        parts = [torch.empty_like(out) for _ in range(size)]
        torch.distributed.all_gather(parts, out, group=parallel_state.get_context_parallel_group())
        for r, part in enumerate(parts):
            full[:, cp_columns(s, r, size)] = part
        return out.sum() * 0.0, {"logits": full}

    engine.train(False)
    halves = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2)]  # VPP: >= PP micro-batches
    return torch.cat([r["logits"] for r in engine.run(halves, loss_fn, True)])


def run_all(hf_dirs: dict, layouts: dict, batches: list[dict]) -> dict:
    """``_run_layout`` per name -> layout kwargs or (layout kwargs, batching overrides); the
    name's first word picks the model ("moe", "deep"; else "dense"); "win_*": ``window_layout``
    of every windowed model (``hf_dirs["win"]``: name -> directory) on the first batch."""
    out = {}
    for name, spec in layouts.items():
        layout, batching = spec if isinstance(spec, tuple) else (spec, None)
        if name.startswith("win_"):
            out[name] = window_layout(hf_dirs["win"], layout, batches[0])
            continue
        out[name] = _run_layout(hf_dirs.get(name.split("_")[0], hf_dirs["dense"]), layout, batches, batching)
    return out


def save_models(base) -> dict:
    """A 2-layer llama, a qwen3_moe, a 4-layer llama, a 2-layer deepseek_v3 and a 2-layer gpt_oss
    (a windowed and a full layer) (causal LM + token-classification critic each): {"dense" |
    "moe" | "deep" | "mla" | "oss": dir}."""
    dirs = {}
    for name, model_type, layers in (("dense", "llama", 2), ("moe", "qwen3_moe", 2), ("deep", "llama", 4),
                                     ("mla", "deepseek_v3", 2), ("oss", "gpt_oss", 2)):
        path = base / name
        tiny_hf_model(tiny_config(model_type, num_hidden_layers=layers)).save_pretrained(path)
        tiny_hf_model(tiny_config(model_type, num_hidden_layers=layers), role="critic").save_pretrained(f"{path}_critic")
        dirs[name] = str(path)
    return dirs


def check_equal(out: dict, name: str, ref: str, batches: list[dict]) -> None:
    """Scores, update metrics and parameters after the update of ``name`` equal ``ref``'s."""
    got, ref_out = out[name], out[ref]
    real = padded_batch(200, batch=4, seq=16)["attention_mask"].bool()
    diff = _max_diff(got["logits"][real], ref_out["logits"][real])
    assert diff <= TOL, f"{name} logits: {diff:.3g}"
    for i, (a, b) in enumerate(zip(got["scores"], ref_out["scores"])):
        for key in ("log_probs", "entropy", "values"):
            assert a[key].shape == batches[i]["responses"].shape
            assert _max_diff(a[key], b[key]) <= TOL, f"{name} batch {i} {key}: {_max_diff(a[key], b[key]):.3g}"
        assert (b["log_probs"] != 0).any()
    for role in ("actor", "critic"):
        m, r = got[f"{role}_metrics"], ref_out[f"{role}_metrics"]
        assert set(m) == set(r)
        for k in r:
            assert abs(m[k] - r[k]) <= TOL * max(1.0, abs(r[k])), f"{name} {k}: {m[k]} vs {r[k]}"
    params = ref_out["params"]
    moved = [k for k in params if not torch.equal(params[k], got["params"][k])]
    assert moved, "identical parameters: the comparison would not see an update"
    for k, v in params.items():
        assert _max_diff(got["params"][k], v) <= TOL, f"{name} {k}: {_max_diff(got['params'][k], v):.3g}"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    base = tmp_path_factory.mktemp("cp")
    dirs = {**save_models(base), "win": save_windowed(base / "win")}
    # s = 15 (not a multiple of 2 * cp = 4: padded), and s = 3 (< 2 * cp tokens)
    batches = [make_batch(200, 9, 6), make_batch(200, 2, 1)]
    ranks = run_ranks(4, run_all, dirs, {**DENSE, **MOE, **DEEP, **MLA, **WIN}, batches)
    ranks[0].update(run_ranks(1, run_all, dirs, {"single": {}, "win_single": {}}, batches)[0])
    return ranks, batches


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


@pytest.mark.parametrize("name", [n for n in {**DENSE, **MOE, **DEEP, **MLA} if not n.endswith("ref")])
def test_cp_equals_cp1(results, name):
    ranks, batches = results
    kind = name.split("_")[0]
    check_equal(ranks[0], name, f"{kind}_ref" if kind in ("moe", "deep", "mla") else "ref", batches)


def test_cp2_equals_a_single_rank(results):
    ranks, batches = results
    check_equal(ranks[0], "cp2", "single", batches)


def test_no_rank_holds_the_whole_sequence(results):
    ranks, _ = results
    s = 16  # the longest batch padded to a multiple of 2 * cp (x tp with sequence parallel)
    for rank in ranks:
        for name, out in rank.items():
            if name.startswith("win_"):  # window_layout records no sizes
                continue
            want = s if name.endswith(("ref", "single")) else s // 2
            assert out["seen"] <= want, f"{name}: a decoder layer saw {out['seen']} > {want} tokens"
    assert ranks[0]["cp2_tp2_sp"]["seen"] == s // 4  # CP and sequence parallel both split


def test_impossible_layouts_are_refused():
    from mcore_rl.parallel import LayoutError, ParallelLayout

    with pytest.raises(LayoutError, match=r"tp\(1\) \* pp\(1\) \* cp\(3\) = 3 does not divide"):
        ParallelLayout(cp=3).validate(4)


@pytest.fixture(scope="module")
def window_refs(results) -> dict:
    """transformers' outputs of every windowed model (tests/window_bodies.py ``references``)."""
    return {name: references(name, padded_batch(**LOGITS_BATCH), results[1][0]) for name in WINDOWED}


def _next_token_log_probs(logits: torch.Tensor, ids: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """log p(token t+1 | ..t) at every t where both tokens are real: [n] (fp64)."""
    lp = torch.log_softmax(logits[:, :-1, :200].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return lp[real[:, 1:] & real[:, :-1]]


def _close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    diff = _max_diff(a, b)
    assert diff <= tol, f"{what} differ by {diff:.3g} (> {tol:g})"


def test_windows_are_active_and_sdpa_agrees(window_refs):
    """transformers' eager and SDPA attention agree on every windowed model, and the same model
    without its window scores the tokens differently (the window cuts in these batches)."""
    batch = padded_batch(**LOGITS_BATCH)
    real = batch["attention_mask"].bool()
    for name, ref in window_refs.items():
        eager, full = (_next_token_log_probs(ref[k], batch["input_ids"], real) for k in ("eager", "no_window"))
        if "sdpa" in ref:  # not for gpt-oss: transformers has no SDPA path for its sinks
            _close(_next_token_log_probs(ref["sdpa"], batch["input_ids"], real), eager, 1e-5,
                   f"{name}: transformers' SDPA and eager log-probs")
        assert _max_diff(full, eager) > 0.05, f"{name}: the window changes nothing ({_max_diff(full, eager):.3g})"


@pytest.mark.parametrize("layout", ["win_single", *WIN])
def test_windowed_models_match_transformers(results, window_refs, layout):
    """Per model: logits and next-token log-probs of a padded batch within 1e-4 of transformers
    (eager), response log-probs of padded and of packed micro-batches (4 sequences a stream,
    left- and right-padded rows) within 1e-4 of transformers and 1e-5 of each other, the
    packed update's gradients and metrics within 1e-5 of the padded one's; away from world 1,
    logits and gradients within 1e-5 of world 1's."""
    ranks, _ = results
    batch = padded_batch(**LOGITS_BATCH)
    real = batch["attention_mask"].bool()
    for name, ref in window_refs.items():
        got, at = ranks[0][layout][name], f"{name} at {layout}:"
        _close(got["logits"][real], ref["eager"][real], 1e-4, f"{at} logits and transformers'")
        lp = [_next_token_log_probs(x, batch["input_ids"], real) for x in (got["logits"], ref["eager"])]
        _close(*lp, 1e-4, f"{at} next-token log-probs and transformers'")
        padded, packed = got["padded"], got["packed"]
        for mode in ("padded", "packed"):
            _close(got[mode]["log_probs"], ref["log_probs"], 1e-4, f"{at} {mode} response log-probs and transformers'")
        _close(packed["log_probs"], padded["log_probs"], TOL, f"{at} packed and padded log-probs")
        assert set(packed["grads"]) == set(padded["grads"])
        for key, g in padded["grads"].items():
            _close(packed["grads"][key], g, TOL, f"{at} packed and padded gradients of {key}")
        assert max(float(g.abs().max()) for g in padded["grads"].values()) > 1e-3  # the update has gradients
        for k, v in padded["metrics"].items():
            assert abs(packed["metrics"][k] - v) <= TOL * max(1.0, abs(v)), f"{at} packed metric {k}"
        if layout != "win_single":
            single = ranks[0]["win_single"][name]
            _close(got["logits"][real], single["logits"][real], TOL, f"{at} logits and world 1's")
            for key, g in single["padded"]["grads"].items():
                _close(padded["grads"][key], g, TOL, f"{at} gradients of {key} and world 1's")
