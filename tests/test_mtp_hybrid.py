"""Multi-token-prediction layers of Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (``mtp.*``: one fc and
norm set, a gated full-attention decoder layer under ``mtp.layers.0``) on megatron-core's
MultiTokenPredictionBlock: the count from the tensors when the config is silent (a disagreement
and a second layer refused), converted, loaded at TP=2 x PP=2 (EP=2 for MoE) and merged back
bit-exact; off by default (outputs identical to the model built without it); the MTP loss equal
to an independent reference at world 1 and TP=2."""
from __future__ import annotations

import logging

import pytest
import torch

from mcore_rl.models.hf_config import model_args_from_hf
from mcore_rl.models.mtp import MtpConfigError, resolve_mtp_layers
from tests.dist import run_ranks
from tests.mtp_hybrid_bodies import FIELD, each_model, save_hybrid_mtp
from tests.test_convert import _assert_same_hf, _convert_all, _load_and_export
from tests.tiny import padded_batch

NAMES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
QWEN = dict(prefix="mtp.layers.{mtp}")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """name -> (directory, HF model, deeper model, MTP tensors); qwen3_5 declares its count,
    the MoE models are silent (as published configs)."""
    return {n: save_hybrid_mtp(tmp_path_factory.mktemp(n), n, seed=i, declare=n == "qwen3_5")
            for i, n in enumerate(NAMES)}


def test_count_from_tensors_refusals_and_skip(models, tmp_path, caplog):
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from mcore_rl.mapping.weights import check_hf_keys
    from mcore_rl.models.hf_weights import weight_map

    for name, (d, _, _, extra) in models.items():
        args = model_args_from_hf(d)
        assert args.mtp_layers == 1, name
        wmap = weight_map(args, "actor", 2)
        mtp_keys = {k for k in wmap.hf_keys() if k.startswith("mtp.")}
        assert mtp_keys == set(extra), (name, sorted(mtp_keys ^ set(extra))[:5])
        assert not any("linear_attn" in k for k in mtp_keys)  # a full-attention layer
        keys = set(SafetensorsReader(d))
        with caplog.at_level(logging.WARNING, logger="mcore_rl"):  # left out: its tensors skipped
            check_hf_keys(weight_map(args.with_mtp(False), "actor", 2), keys)
        assert f"skipping {len(extra)} tensors of multi-token-prediction layers [0]" in caplog.text
    keys = {"mtp.fc.weight", "mtp.layers.0.input_layernorm.weight", "model.layers.4.input_layernorm.weight"}
    assert resolve_mtp_layers(None, keys, 4, FIELD, "x", **QWEN) == 1  # model.layers.4 is not MTP here
    with pytest.raises(MtpConfigError, match=r"mtp_num_hidden_layers=2 but the checkpoint holds 1 .*mtp\.layers\.0"):
        resolve_mtp_layers(2, keys, 4, FIELD, "x", **QWEN)
    with pytest.raises(MtpConfigError, match=r"\[mtp\.layers\.1\.\*\] .* not consecutive from mtp\.layers\.0"):
        resolve_mtp_layers(None, {"mtp.layers.1.input_layernorm.weight"}, 4, FIELD, "x", **QWEN)
    d, *_ = save_hybrid_mtp(tmp_path / "bad", "qwen3_5", declare=2)  # a config that disagrees with its tensors
    with pytest.raises(MtpConfigError, match=rf"{d}/config.json: mtp_num_hidden_layers=2 but .* holds 1"):
        model_args_from_hf(d)
    # two MTP layers share Qwen's one fc / norm set: counted, refused when built, skipped when left out
    d, *_ = save_hybrid_mtp(tmp_path / "two", "qwen3_5", depth=2)
    args = model_args_from_hf(d)
    assert args.mtp_layers == 2
    with pytest.raises(MtpConfigError, match=r"'qwen3_5_text': the checkpoint has 2 .* share one projection"):
        weight_map(args, "actor", 1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mcore_rl"):
        check_hf_keys(weight_map(args.with_mtp(False), "actor", 1), set(SafetensorsReader(d)))
    assert "multi-token-prediction layers [0, 1]" in caplog.text


def test_converted_loaded_at_tp2_pp2_ep2_and_merged_bit_exact(models, tmp_path):
    """HF -> converter -> loaded at TP=2 x PP=2 (EP=2 for MoE) -> export_hf, and -> merge: every
    tensor, mtp.* included, bit-identical; the dist checkpoint holds the MTP keys."""
    from mcore_rl.mapping.hf_io import SafetensorsReader

    from mcore_rl.conversion.merge import merge

    dirs = {n: str(tmp_path / f"out_{n}") for n in models}
    run_ranks(1, _convert_all, [(models[n][0], dirs[n]) for n in models])
    results = run_ranks(4, _load_and_export, dirs)[0]
    for name, d in dirs.items():
        hf_dir, _, _, extra = models[name]
        exported, keys = results[name]
        assert set(extra) <= set(exported), name
        _assert_same_hf(name, exported, hf_dir)
        assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.0.enorm.weight",
                "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight"} <= set(keys), name
        target = tmp_path / f"merged_{name}"
        merge(d, str(target))
        merged = dict(SafetensorsReader(str(target)))
        _assert_same_hf(f"{name} merged", merged, hf_dir)


@pytest.mark.parametrize("world,layout,names", [(1, {}, NAMES), (2, dict(pp=2), ("qwen3_next",))],
                         ids=["single", "pp2"])
def test_off_forward_equals_model_without_mtp(models, world, layout, names):
    """Built, not trained on: logits and every gradient identical (torch.equal) to the model built
    without the MTP layer; the HF round trip of the MTP-built model exact; with PP=2 the block
    sits on the last stage only."""
    from tests.mtp_bodies import off_forward_equal

    dirs = {n: models[n][0] for n in names}
    for rank, out in enumerate(run_ranks(world, each_model, off_forward_equal, dirs, layout, padded_batch(200))):
        for name, r in out.items():
            assert r["mismatch"] == [], (name, rank, r["mismatch"])
            assert r["mtp_here"] == [r["pp_rank"] == world - 1], (name, rank)
            assert torch.equal(r["with"], r["without"]) and r["with"].abs().max() > 0.1, (name, rank)
            grads = r["with_grads"]
            assert grads.keys() == r["without_grads"].keys() and len(grads) > 5, (name, rank, len(grads))
            for key, g in grads.items():
                assert torch.equal(g, r["without_grads"][key]), f"{name} rank {rank}: gradient of {key}"


@pytest.mark.parametrize("world,layout", [(1, {}), (2, dict(tp=2, sequence_parallel=True))], ids=["single", "tp2"])
def test_mtp_loss_equals_independent_reference(models, world, layout):
    """With mtp.enable_train the MTP loss equals a plain-torch implementation from the HF weights
    (transformers' gated full-attention decoder layer for the MTP's) within 1e-5; the MTP loss
    alone gives gradients to the MTP layer and, through the trunk's hidden state, to the trunk."""
    from tests.mtp_hybrid_bodies import hybrid_mtp_train_losses, reference_hybrid_mtp_loss

    batch = padded_batch(200)
    refs = {n: reference_hybrid_mtp_loss(hf, deeper, extra, batch) for n, (_, hf, deeper, extra) in models.items()}
    dirs = {n: models[n][0] for n in models}
    for rank, out in enumerate(run_ranks(world, each_model, hybrid_mtp_train_losses, dirs, layout, batch)):
        for name, r in out.items():
            diff = (r["losses"][0] - refs[name]).abs().max().item()
            assert diff <= 1e-5, f"{name} rank {rank}: MTP loss {r['losses'][0].tolist()} vs {refs[name].tolist()}"
            assert len(r["grads"]) == 3 and all(g > 0 for g in r["grads"].values()), (name, r["grads"])
