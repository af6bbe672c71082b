"""verl's ``model.lora.*`` on the mcore_rl engine, driven by verl's own worker code (bodies:
lora_bodies.py; one 2-process launch, actor TP=2, rollout TP=2 on the CPU rollout server):

- only adapters train (every trainable parameter is an adapter factor);
- verl's reference with ``ref_in_actor`` (``no_lora_adapter`` -> ``engine.disable_adapter()``)
  gives the frozen base's log-probs, bit for bit before and after training (seeded adapters,
  B = 0: also the policy's before training), while the adapters move the policy far away;
- verl's ``update_weights``: with ``lora.merge=False`` the first sync sends the base weights
  (HF names) then the adapters (PEFT names, verl's peft config; started from a PEFT adapter with
  rank_pattern/alpha_pattern: per-module scalings folded into B), the second only the adapters;
  with ``merge=True`` merged weights under HF names. After each sync the rollout
  server's model scores the rows as the trainer does;
- verl's SFT trainer saving adapter-only steps with ``hf_model``: the background export writes the
  merged weights (``mcore_to_hf.py merge`` of the step, the live ``W + s B A``).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

# imported once here, before tests/dist.py forks the ranks (each would import them otherwise)
import verl.trainer.sft_trainer  # noqa: E402,F401
import verl.workers.engine_workers  # noqa: E402,F401

import mcore_rl.integrations.verl.engine  # noqa: E402,F401
from tests.dist import run_ranks  # noqa: E402
from tests.verl.lora_bodies import lora_sync_body  # noqa: E402
from tests.verl.verl_fixtures import save_tiny_model  # noqa: E402

HF_TOL = 1e-4  # transformers' kernels vs megatron's (tests/verl/test_verl_rl.py)
# linears of a qwen2 decoder layer, as PEFT names them (lora.target_modules: verl's default, all four)
LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("verl_lora")
    model_dir = save_tiny_model(str(d / "model"), seed=1)
    # a PEFT adapter whose modules differ in rank and scaling (adapter-only syncs fold them into B)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), LoraConfig(
        r=4, lora_alpha=8, target_modules=[p for names in LINEARS.values() for p in names], lora_dropout=0.0,
        rank_pattern={"o_proj": 2}, alpha_pattern={"v_proj": 3, "down_proj": 3}, init_lora_weights=False))
    peft.save_pretrained(str(d / "adapter"))
    return run_ranks(2, lora_sync_body, model_dir, str(d / "adapter"), 5)


def _outputs(ranks: list[dict], protocol: str) -> dict:
    """The rank holding verl's outputs (TP rank 0 of the only DP rank), which is also the
    replica's pushing rank (its server lives there)."""
    held = [r[protocol] for r in ranks if r[protocol]["start"] is not None]
    assert len(held) == 1 and held[0]["first"], "outputs and the server expected on rank 0"
    return held[0]


def _diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask].abs().max())


@pytest.mark.parametrize("protocol", ["unmerged", "merged"])
def test_only_adapters_train_and_the_reference_is_the_frozen_base(ranks, protocol):
    for r in ranks:
        trainable = r[protocol]["trainable"]
        assert trainable and all(".lora." in n for n in trainable), trainable
    out = _outputs(ranks, protocol)
    mask = out["rows"]["attention_mask"][:, -out["rows"]["responses"].shape[1]:].bool()
    moved = _diff(out["trained"], out["start"], mask)
    assert moved > 0.05, f"one step moved the policy by {moved} only: the adapters barely act"
    # ref_in_actor's reference: the frozen base, before and after training, bit for bit
    assert torch.equal(out["ref"][mask], out["base"][mask]), "the reference moved with training"
    if protocol == "merged":  # seeded adapters (B = 0) start exactly at the base
        assert torch.equal(out["start"][mask], out["base"][mask])
    else:  # the imported PEFT adapter acts from the start
        assert _diff(out["start"], out["base"], mask) > 0.05


def test_unmerged_sync_sends_base_then_adapters_then_adapters_only(ranks):
    out = _outputs(ranks, "unmerged")
    first, second = out["first"]["syncs"], out["second"]["syncs"]
    assert [s["peft"] for s in first] == [False, True] and [s["peft"] for s in second] == [True]
    base, adapters = first[0]["names"], first[1]["names"]
    # HF names of the rollout model (the server itself checks that every parameter was replaced)
    assert set(base) <= set(out["first"]["params"]) and not any("lora" in n for n in base)
    layers = {n.split(".layers.")[1].split(".")[0] for n in adapters}
    expected = {f"base_model.model.model.layers.{i}.{block}.{p}.lora_{f}.weight"
                for i in layers for block, names in LINEARS.items() for p in names for f in "AB"}
    assert len(layers) > 1 and set(adapters) == expected and sorted(second[0]["names"]) == sorted(adapters)
    assert len(out["second"]["adapted"]) == len(expected) // 2  # replaced, not added to
    # verl's checkpoint-engine path (get_per_tensor_param() without arguments): iterated, the base
    # as the colocated first sync; with_adapters(), what the mcore_rl checkpoint engine sends: the
    # base, then the adapter factors, equal to what the colocated protocol's two syncs sent
    ce = out["ce"]
    assert ce["base"] == base and ce["peft"]
    sent = {**first[0]["tensors"], **first[1]["tensors"]}
    assert list(ce["full"]) == base + adapters
    assert all(torch.equal(ce["full"][n], sent[n]) for n in sent), "the checkpoint-engine stream differs"


@pytest.mark.parametrize("protocol", ["unmerged", "merged"])
def test_rollout_server_scores_as_the_trainer_after_each_sync(ranks, protocol):
    out = _outputs(ranks, protocol)
    mask = out["rows"]["attention_mask"][:, -out["rows"]["responses"].shape[1]:].bool()
    for sync, trained in (("first", "trained"), ("second", "trained2"))[:2 if protocol == "unmerged" else 1]:
        got = out[sync]
        assert got["steps"] == (1 if sync == "first" else 2)
        diff = _diff(got["server"], out[trained], mask)
        assert diff <= HF_TOL, f"{protocol} {sync} sync: rollout vs trainer log-probs differ by {diff}"
        # the check discriminates: the base alone is far from the trained policy
        assert _diff(out["ref"], out[trained], mask) > 100 * HF_TOL
    if protocol == "merged":
        assert [s["peft"] for s in out["first"]["syncs"]] == [False] and out["first"]["adapted"] == []
        assert set(out["first"]["syncs"][0]["names"]) <= set(out["first"]["params"])


@pytest.fixture(scope="module")
def sft(tmp_path_factory) -> tuple[list[dict], str]:
    from tests.verl.lora_bodies import sft_lora_body
    from tests.verl.verl_fixtures import save_sft_parquet

    d = tmp_path_factory.mktemp("verl_lora_sft")
    inputs = {"model": save_tiny_model(str(d / "model")), "train": save_sft_parquet(str(d / "train.parquet"))}
    return run_ranks(2, sft_lora_body, inputs, str(d / "ckpt")), str(d / "ckpt")


def test_sft_trainer_with_lora_trains_adapters_only_saves_and_resumes(sft):
    """verl's SFT trainer (model.lora.rank=8, DP=2): only adapter factors are trainable, the base
    weights are bit-identical after two steps while every adapter B moved from zero, and a
    trainer resuming from step 1's checkpoint reaches step 2's adapters and base bit for bit;
    the steps verl saved through the engine are mcore_rl's adapter-only checkpoints."""
    import json

    ranks, root = sft
    for step in ("a/global_step_1", "a/global_step_2", "b/global_step_2"):
        with open(f"{root}/{step}/actor/mcore_rl.json") as f:
            assert json.load(f)["lora"]["adapter_only"] is True, step
    for r in ranks:
        start, straight, resumed = r["start"], r["straight"], r["resumed"]
        assert straight["trainable"] and all(".lora." in n for n in straight["trainable"])
        assert straight["base"].keys() == start["base"].keys()
        assert all(torch.equal(straight["base"][n], t) for n, t in start["base"].items()), "a base weight changed"
        b_factors = [n for n in start["adapters"] if "lora_B" in n]
        assert b_factors and all(not start["adapters"][n].any() and straight["adapters"][n].any() for n in b_factors)
        assert r["at_resume"] == 1
        assert resumed["adapters"].keys() == straight["adapters"].keys()
        assert all(torch.equal(resumed["adapters"][n], t) for n, t in straight["adapters"].items()), "resume differs"
        assert all(torch.equal(resumed["base"][n], t) for n, t in start["base"].items())


def test_sft_trainer_with_lora_exports_merged_hf_weights(sft):
    """Saved with ``hf_model``, the adapter-only step 2 gets its merged HF weights in the
    background (``model/huggingface/``): complete, byte for byte ``mcore_to_hf.py merge`` of the
    step, and its tensors are the trainer's live merged model ``W + s B A`` (fp64 merge rounded
    once vs the engine's fp32: within float rounding)."""
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from tests.verl.export_checks import assert_exported

    ranks, root = sft
    hf = assert_exported(f"{root}/a/global_step_2/actor", 2)
    written, live = SafetensorsReader(hf), ranks[0]["straight"]["merged"]
    assert set(written) == set(live), sorted(set(written) ^ set(live))
    moved = [n for n, t in live.items() if not torch.equal(t, ranks[0]["start"]["base"][n])]
    assert moved  # the adapters moved the merged weights off the base
    worst = max(float((written[n].double() - t.double()).abs().max()) for n, t in live.items())
    assert worst <= 1e-6, worst
