"""Multi-token-prediction (MTP) layers of DeepSeek-V3 and GLM-4.5 on megatron-core's
MultiTokenPredictionBlock: the count (config or tensors, a disagreement refused), converted,
loaded at TP=2 x PP=2 x EP=2, merged back bit-exact; off by default in the forward (outputs
bit-identical to the model built without them, at world 1 and PP=2)."""
from __future__ import annotations

import logging

import pytest
import torch

from mcore_rl.models.hf_config import model_args_from_hf
from mcore_rl.models.mtp import MtpConfigError, resolve_mtp_layers
from tests.dist import run_ranks
from tests.mtp_bodies import off_forward_equal, save_mtp_model
from tests.test_convert import _assert_same_hf, _convert_all, _load_and_export
from tests.tiny import padded_batch


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory):
    """deepseek_v3 (declared num_nextn_predict_layers=1, 2 layers) and glm4_moe (count from the
    tensors only: the config is silent), each with one MTP layer."""
    ds = save_mtp_model(tmp_path_factory.mktemp("ds_mtp"), "deepseek_v3", num_hidden_layers=2)
    glm = save_mtp_model(tmp_path_factory.mktemp("glm_mtp"), "glm4_moe", declare=False, num_hidden_layers=2)
    return {"deepseek_v3": ds, "glm4_moe": glm}


def test_mtp_count_from_config_or_tensors(mtp_models, caplog):
    assert model_args_from_hf(mtp_models["deepseek_v3"][0]).mtp_layers == 1
    assert model_args_from_hf(mtp_models["glm4_moe"][0]).mtp_layers == 1  # config silent
    keys = {"model.layers.4.enorm.weight", "model.layers.5.enorm.weight", "model.norm.weight"}
    assert resolve_mtp_layers(None, keys, 4, "num_nextn_predict_layers", "x") == 2
    with pytest.raises(MtpConfigError,
                       match=r"num_nextn_predict_layers=1 but the checkpoint holds 2 .*\[model\.layers\.4\.\*, model\.layers\.5\.\*\]"):
        resolve_mtp_layers(1, keys, 4, "num_nextn_predict_layers", "x")
    with pytest.raises(MtpConfigError, match=r"\[model\.layers\.5\.\*\] \(after num_hidden_layers=4\), not consecutive"):
        resolve_mtp_layers(None, {"model.layers.5.enorm.weight"}, 4, "num_nextn_predict_layers", "x")
    with caplog.at_level(logging.WARNING, logger="mcore_rl"):  # transformers' save_pretrained drops them
        assert resolve_mtp_layers(1, {"model.norm.weight"}, 4, "num_nextn_predict_layers", "x") == 0
    assert "holds no multi-token-prediction tensors" in caplog.text
    assert resolve_mtp_layers(2, None, 4, "num_nextn_predict_layers", "x") == 2  # a config object alone


def test_mtp_converted_loaded_at_tp2_pp2_ep2_and_merged_bit_exact(mtp_models, tmp_path):
    """HF -> converter (one rank, and EP=2) -> loaded at TP=2 x PP=2 x EP=2 -> export_hf, and ->
    merge: every tensor, MTP ones included, bit-identical; the dist checkpoint holds the MTP keys."""
    from mcore_rl.mapping.hf_io import SafetensorsReader

    from mcore_rl.conversion.merge import merge

    jobs = [(d, str(tmp_path / f"out_{n}")) for n, (d, _, _) in mtp_models.items()]
    run_ranks(1, _convert_all, jobs)
    run_ranks(2, _convert_all, [(mtp_models["deepseek_v3"][0], str(tmp_path / "ds_ep2"))], dict(ep=2))
    dirs = {n: str(tmp_path / f"out_{n}") for n in mtp_models} | {"ds_ep2": str(tmp_path / "ds_ep2")}
    results = run_ranks(4, _load_and_export, dirs)[0]
    for name, d in dirs.items():
        hf_dir, _, extra = mtp_models["deepseek_v3" if name == "ds_ep2" else name]
        exported, keys = results[name]
        assert set(extra) <= set(exported), name
        _assert_same_hf(name, exported, hf_dir)
        assert "mtp.layers.0.eh_proj.weight" in keys and "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in keys
        target = tmp_path / f"merged_{name}"
        merge(d, str(target))
        merged = dict(SafetensorsReader(str(target)))
        _assert_same_hf(f"{name} merged", merged, hf_dir)
    assert results["ds_ep2"][1] == results["deepseek_v3"][1]


@pytest.mark.parametrize("world,layout", [(1, {}), (2, dict(pp=2))], ids=["single", "pp2"])
def test_mtp_off_forward_equals_model_without_mtp(mtp_models, world, layout):
    """Built but not trained on: logits and every gradient of one forward/backward identical
    (torch.equal) to the model built without MTP layers; with PP=2 the block sits on the last
    stage only (with its copy of the word embedding, which gets no gradient here)."""
    batch = padded_batch(200)
    for name, (d, _, _) in mtp_models.items():
        for rank, r in enumerate(run_ranks(world, off_forward_equal, d, layout, batch)):
            assert r["mismatch"] == [], (name, rank, r["mismatch"])
            assert r["mtp_here"] == [r["pp_rank"] == world - 1], (name, rank)
            assert torch.equal(r["with"], r["without"]), f"{name} rank {rank}"
            assert r["with"].abs().max() > 0.1
            grads = r["with_grads"]
            assert grads.keys() == r["without_grads"].keys() and len(grads) > 5, (name, rank, len(grads))
            for key, g in grads.items():
                assert torch.equal(g, r["without_grads"][key]), f"{name} rank {rank}: gradient of {key}"


@pytest.fixture(scope="module")
def ds_two_depths(tmp_path_factory):
    """deepseek_v3 with two MTP layers (the second fed by the first) and its reference model."""
    from tests.mtp_bodies import deeper_model

    d, hf, extra = save_mtp_model(tmp_path_factory.mktemp("ds_mtp2"), "deepseek_v3", depth=2, seed=4,
                                  num_hidden_layers=2)
    return d, hf, extra, deeper_model("deepseek_v3", hf, 2, 4, num_hidden_layers=2)


@pytest.mark.parametrize("world,layout", [(1, {}), (2, dict(tp=2, sequence_parallel=True))], ids=["single", "tp2"])
def test_mtp_loss_equals_independent_reference(ds_two_depths, world, layout):
    """With mtp.enable_train the per-depth MTP losses equal a plain-torch implementation from the
    HF weights within 1e-5 (padding rows and positions excluded); the MTP loss alone gives the
    trunk and eh_proj gradients, and detach_encoder keeps it from the trunk."""
    from tests.mtp_bodies import mtp_train_losses, reference_mtp_losses

    d, hf, extra, deeper = ds_two_depths
    batch = padded_batch(200)
    ref = reference_mtp_losses(hf, deeper, extra, batch, 2)
    for rank, r in enumerate(run_ranks(world, mtp_train_losses, d, layout, batch)):
        diff = (r["losses"][0] - ref).abs().max().item()
        assert diff <= 1e-5, f"rank {rank}: MTP losses {r['losses'][0].tolist()} vs reference {ref.tolist()}"
        assert all(g > 0 for g in r["grads"].values()), r["grads"]
    if world == 1:  # packed micro-batches refused; detach_encoder: the same losses, no gradient into the trunk
        from tests.mtp_bodies import mtp_packed_refused

        rows = dict(batch, responses=batch["input_ids"][:, -4:])
        assert run_ranks(1, mtp_packed_refused, d, rows)[0].startswith("MtpConfigError: MTP training on packed")
        detached = run_ranks(1, mtp_train_losses, d, {}, batch, True)[0]
        assert (detached["losses"][0] - ref).abs().max().item() <= 1e-5
        trunk = [g for n, g in detached["grads"].items() if "decoder" in n]
        assert trunk == [0.0] and all(g > 0 for n, g in detached["grads"].items() if "eh_proj" in n)


def test_mtp_kill_resume_keeps_weights_and_optimizer_state(tmp_path):
    """PP=2 (the MTP layer and its embedding copy on the last stage), MTP training on: 2 steps,
    save, 2 steps == a fresh world (other seed) resumed + 2 steps: the optimizer state loaded
    bit-identical, metrics (actor/mtp_loss included) and every parameter, MTP ones included."""
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from tests.mtp_bodies import mtp_resume_run, mtp_save_run

    # every stage with routed experts: a stage without any cannot save its (empty) expert optimizer
    # without apex/TE (megatron's DistributedOptimizer.state_dict asserts one Adam step), MTP or not
    hf_dir = save_mtp_model(tmp_path / "hf", "deepseek_v3", num_hidden_layers=2, first_k_dense_replace=0)[0]
    root = str(tmp_path / "ckpt")
    ref = run_ranks(2, mtp_save_run, hf_dir, dict(pp=2), root, daemon=False)
    res = run_ranks(2, mtp_resume_run, hf_dir, dict(pp=2), root, daemon=False)
    eh = "model.layers.2.eh_proj.weight"
    assert not torch.equal(ref[0]["params"][eh], SafetensorsReader(hf_dir)[eh])  # the MTP layer trained
    assert all("actor/mtp_loss" in m and m["actor/mtp_loss"] > 0 for m in ref[0]["metrics"])
    for rank in range(2):
        a, b = ref[rank], res[rank]
        assert b["state"] == {"step": 2} and a["opt_at_save"].keys() == b["opt_loaded"].keys()
        bad = [k for k, v in a["opt_at_save"].items() if not torch.equal(v, b["opt_loaded"][k])]
        assert not bad, f"rank {rank}: optimizer state differs after load: {bad[:5]}"
        assert any(not torch.equal(v, a["opt_at_save"][k]) for k, v in b["opt_fresh"].items())
        assert a["metrics"] == b["metrics"], (rank, a["metrics"], b["metrics"])
        bad = [k for k in a["params"] if not torch.equal(a["params"][k], b["params"][k])]
        assert not bad and eh in a["params"], f"rank {rank}: parameters differ after resume: {bad[:5]}"


def test_config_object_args_checked_against_weights(mtp_models):
    """Args read from a transformers config object that declares an MTP layer, for weights
    without it (a transformers model in memory holds none): loading names the fix;
    ``for_weights`` counts what the weights hold."""
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from mcore_rl.mapping.weights import MappingError, check_hf_keys
    from mcore_rl.models.hf_weights import weight_map
    from tests.tiny import tiny_config

    cfg = tiny_config("deepseek_v3", num_hidden_layers=2, num_nextn_predict_layers=1)
    full = set(SafetensorsReader(mtp_models["deepseek_v3"][0]))
    base = {k for k in full if not k.startswith("model.layers.2.")}
    args = model_args_from_hf(cfg)
    assert args.mtp_built == 1
    with pytest.raises(MappingError, match=r"'model\.layers\.2\..*multi-token-prediction layers the config declares"):
        check_hf_keys(weight_map(args, "actor", 1), base)
    assert args.for_weights(base).mtp_built == 0 and args.for_weights(full).mtp_built == 1
    check_hf_keys(weight_map(args.for_weights(base), "actor", 1), base)


@pytest.mark.parametrize("values,match", [
    (dict(enable=False, enable_train=True), r"mtp.enable_train=true with mtp.enable=false"),
    (dict(enable=False, enable_rollout=True), r"mtp.enable_rollout=true with mtp.enable=false: .* set mtp.enable=true"),
    (dict(mtp_loss_scaling_factor=-1), r"mtp_loss_scaling_factor=-1 must be a number >= 0"),
])
def test_mtp_switches_that_cannot_be_honoured_are_refused(values, match):
    """A rollout engine asking for MTP weights the model would not build (so the sync could not
    send them) is refused, as training them is."""
    from mcore_rl.models.mtp import MtpConfig

    with pytest.raises(MtpConfigError, match=match):
        MtpConfig(**values)
