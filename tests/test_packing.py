"""Packed (padding-free) micro-batches equal padded ones: log-probs, entropy, values and one
actor and critic update (metrics, parameters) within 1e-5, for fixed and dynamic grouping, at
TP=2 + SP, PP=2 and EP=2 (MoE), on rows with left and right padding; attention never crosses a
sequence boundary in the stream; the micro-batcher's packed plan. gpt-oss (sinks, a window of 5
tokens on its first layer, shorter than most sequences) packed at TP=2 + SP, PP=2 and TP=2 x EP=2
equals padded, and every gpt-oss layout's log-probs and values equal transformers'."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.test_context_parallel import check_equal, make_batch, run_all, save_models

PACKED = dict(use_remove_padding=True)
LAYOUTS = {  # name -> (layout, batching); world 4; padded references end with "ref"
    "ref": ({}, None),
    "packed": ({}, PACKED),
    "packed_dynamic": ({}, dict(PACKED, max_tokens_per_micro_batch=24)),
    "packed_tp2_sp": (dict(tp=2, sequence_parallel=True), PACKED),
    "packed_pp2": (dict(pp=2), dict(PACKED, max_tokens_per_micro_batch=24)),
    "packed_cp2": (dict(cp=2), PACKED),
    "packed_cp2_tp2_sp": (dict(cp=2, tp=2, sequence_parallel=True), dict(PACKED, max_tokens_per_micro_batch=24)),
    "moe_ref": ({}, None),
    "moe_packed_ep2": (dict(ep=2), PACKED),
    "moe_packed_cp2_ep2": (dict(cp=2, ep=2), PACKED),
    "oss_ref": ({}, None),
    "oss_packed_tp2_sp": (dict(tp=2, sequence_parallel=True, etp=1), PACKED),
    "oss_packed_pp2": (dict(pp=2), dict(PACKED, max_tokens_per_micro_batch=48)),
    "oss_packed_tp2_ep2": (dict(tp=2, ep=2, sequence_parallel=True, etp=1), PACKED),
}
TOL_HF = 1e-4  # against transformers (fp32, eager attention)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    dirs = save_models(tmp_path_factory.mktemp("packing"))
    batches = [make_batch(200, 9, 6), make_batch(200, 2, 1)]
    return run_ranks(4, run_all, dirs, LAYOUTS, batches), batches, dirs


@pytest.mark.parametrize("name", [n for n in LAYOUTS if not n.endswith("ref")])
def test_packed_equals_padded(results, name):
    ranks, batches, _ = results
    model = name.split("_")[0]
    check_equal(ranks[0], name, f"{model}_ref" if f"{model}_ref" in LAYOUTS else "ref", batches)


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n.startswith("oss")])
def test_gpt_oss_matches_transformers(results, name):
    """Logits of a padded batch as per-token log-probs, the log-probs of both update batches
    (prompts and responses longer than the window) and the critic's values against
    GptOssForCausalLM / GptOssForTokenClassification."""
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    from tests.tiny import hf_log_probs, padded_batch

    ranks, batches, dirs = results
    got = ranks[0][name]
    actor = AutoModelForCausalLM.from_pretrained(dirs["oss"], attn_implementation="eager").eval()
    critic = AutoModelForTokenClassification.from_pretrained(dirs["oss"] + "_critic", attn_implementation="eager").eval()
    batch = padded_batch(200, batch=4, seq=16)
    real = batch["attention_mask"].bool()
    with torch.no_grad():
        want = torch.log_softmax(actor(**batch).logits.double(), -1)
    diff = (torch.log_softmax(got["logits"].double(), -1) - want)[real].abs().max().item()
    assert diff <= TOL_HF, f"{name}: per-token log-probs differ from transformers by {diff:.3g}"
    for b, scores in zip(batches, got["scores"]):
        r = b["responses"].shape[1]
        mask = b["attention_mask"][:, -r:].bool()
        lp, _ = hf_log_probs(actor, b)
        with torch.no_grad():
            values = critic(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, -r - 1:-1, 0]
        assert (scores["log_probs"] - lp)[mask].abs().max() <= TOL_HF and lp[mask].abs().max() > 0.1, name
        assert (scores["values"] - values)[mask].abs().max() <= TOL_HF and values[mask].abs().max() > 0.1, name


def _boundary(hf_dir: str) -> dict:
    """Log-probs of a packed batch, and of the same batch with row 0's tokens changed."""
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine

    initialize_parallel_state(ParallelLayout(), seed=1)
    engine = ModelEngine(model_args_from_hf(hf_dir), ParallelLayout(), "actor", active_platform(), hf_weights=hf_dir)
    actor = Actor(engine, ActorConfig(micro_batch_size=8, use_remove_padding=True))
    batch = make_batch(200, 9, 6)
    changed = {k: v.clone() for k, v in batch.items()}
    changed["input_ids"][0] = torch.where(changed["attention_mask"][0].bool(), (changed["input_ids"][0] + 1) % 200, 0)
    changed["responses"] = changed["input_ids"][:, -6:].clone()
    return {"a": actor.compute_log_prob(batch)["log_probs"], "b": actor.compute_log_prob(changed)["log_probs"]}


def test_packed_at_cp2_equals_packed_at_cp1(results):
    ranks, batches, _ = results
    check_equal(ranks[0], "packed_cp2", "packed", batches)


def test_attention_stays_inside_each_sequence(results, tmp_path):
    """All 8 rows in one stream: changing row 0 changes row 0 only."""
    dirs = save_models(tmp_path)
    out = run_ranks(1, _boundary, dirs["dense"])[0]
    assert not torch.equal(out["a"][0], out["b"][0])
    assert torch.equal(out["a"][1:], out["b"][1:]), (out["a"][1:] - out["b"][1:]).abs().max()


def test_packed_plan_streams():
    """The plan packs each group's real tokens row after row into streams of one length."""
    from mcore_rl.rl.batch import BatchError
    from mcore_rl.rl.microbatcher import MicroBatchSpec, plan_micro_batches

    batch = make_batch(200, 9, 6)
    lengths = batch["attention_mask"].sum(1).tolist()
    plan = plan_micro_batches(batch, MicroBatchSpec(collate="packed", max_tokens=24, seq_multiple=4))
    streams = {mb.packed.ids.shape for mb in plan.batches}
    assert len(streams) == 1 and next(iter(streams))[1] % 4 == 0
    seen = []
    for mb, rows in zip(plan.batches, plan.rows):
        assert sum(lengths[i] for i in rows) <= 24  # the budget counts real tokens, not padding
        cu = mb.packed.cu_seqlens.tolist()
        assert cu[: len(rows) + 1] == [0, *torch.tensor([lengths[i] for i in rows]).cumsum(0).tolist()]
        real = mb["attention_mask"].bool()
        assert torch.equal(mb.packed.ids[0, mb.packed.index[real]], mb["input_ids"][real])
        seen += rows
    assert sorted(seen) == list(range(8))
    padded = plan_micro_batches(batch, MicroBatchSpec(max_tokens=24, seq_multiple=4))
    assert len(plan.batches) < len(padded.batches)  # the same budget holds more rows packed
    # under CP=2 every sequence takes a multiple of 4 places: a budget below a row's is refused
    need = -(-max(lengths) // 4) * 4
    with pytest.raises(BatchError, match=rf"max_tokens_per_micro_batch={need - 1} is below one row's length "
                                         rf"\({need} tokens"):
        plan_micro_batches(batch, MicroBatchSpec(collate="packed", max_tokens=need - 1, seq_multiple=4, pack_multiple=4))
