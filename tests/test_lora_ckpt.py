"""Adapter-only LoRA checkpoints (issue 31): a LoRA engine's step holds adapters, optimizer, RNG
and scheduler, never the base; resume is bit-exact (dropout in the model and the adapters, so
the RNG matters), resharding to another layout loads every adapter and optimizer tensor
exactly; the base and the LoRA settings are recorded and a resume onto another base or with
other settings is refused before any state moves."""
from __future__ import annotations

import shutil

import torch

from tests.ckpt_bodies import hf_dir_for
from tests.ckpt_reshard_bodies import hf_dir
from tests.dist import run_ranks
from tests.lora_ckpt_bodies import checks_run, extras_run, resume_run, save_run
from tests.tiny import tiny_config, tiny_hf_model

TP2 = dict(tp=2, sequence_parallel=True)


def test_resume_bit_exact_and_reshard(tmp_path):
    """Saved at TP=2+SP; resumed there (bit-exact after one more update) and at PP=2 and DP=2
    (every adapter and optimizer tensor loaded exactly), also at PP=2 from a model_space save
    (whose optimizer holds only the adapters)."""
    hf = hf_dir(str(tmp_path), "llama")  # 2 layers
    root, space = str(tmp_path / "ckpt"), str(tmp_path / "ckpt_space")
    ref = run_ranks(2, save_run, hf, TP2, root, space, daemon=False)
    res = run_ranks(2, resume_run, hf, TP2, root, [(dict(pp=2), root), (dict(), root), (dict(pp=2), space)],
                    daemon=False)
    assert len(res[0]["resharded"]) == 3
    for r in range(2):
        a, b = ref[r], res[r]
        assert b["state"] == {"step": 1}
        opt = a["at_save"]["opt"]
        assert opt.keys() == b["opt_loaded"].keys() and opt
        assert all(torch.equal(opt[k], b["opt_loaded"][k]) for k in opt)
        assert any(not torch.equal(opt[k], b["opt_fresh"][k]) for k in opt)  # the load changed it
        assert a["metrics"] == b["metrics"]
        assert a["adapters_after"].keys() == b["adapters_after"].keys()
        assert all(torch.equal(v, b["adapters_after"][k]) for k, v in a["adapters_after"].items())
        assert all(torch.equal(v, b["base_after"][k]) for k, v in a["base_after"].items())
        for got in b["resharded"]:
            for part in ("adapters", "opt/param", "opt/exp_avg", "opt/exp_avg_sq"):
                want = a["at_save"][part]
                assert want.keys() == got["loaded"][part].keys() and want, part
                assert all(torch.equal(v, got["loaded"][part][k]) for k, v in want.items()), part
            assert got["loaded"]["adam_steps"] == a["at_save"]["adam_steps"]
            assert got["loaded"]["scheduler_steps"] == a["at_save"]["scheduler_steps"] > 0
            assert any("RNG state is NOT restored" in w for w in got["warnings"])


def test_adapter_only_step_base_and_settings_checked(tmp_path):
    """World 1, llama: the adapter-only step holds no base weight and is < 0.2x a full step;
    another base (same shapes, other weights), another alpha, an engine without adapters and a
    full step are refused before any state moves; a moved copy of the base and a model-directory
    base resume."""
    hf_a = hf_dir_for(str(tmp_path), "llama", "actor")
    hf_b = str(tmp_path / "other_base")
    tiny_hf_model(tiny_config("llama", num_hidden_layers=4, attention_dropout=0.1), seed=1).save_pretrained(hf_b)
    hf_copy = str(tmp_path / "moved_base")
    shutil.copytree(hf_a, hf_copy)
    out = run_ranks(1, checks_run, hf_a, hf_b, hf_copy, str(tmp_path), daemon=False)[0]
    print(f"step bytes: adapter-only {out['bytes_lora']}, full {out['bytes_full']}, "
          f"ratio {out['bytes_lora'] / out['bytes_full']:.4f}")
    assert out["bytes_lora"] < 0.2 * out["bytes_full"]
    model_keys = [k for k in out["keys_lora"] if not k.startswith(("optimizer", "rng_state", "lr_scheduler"))]
    assert model_keys and all(".lora." in k for k in model_keys), model_keys
    # the optimizer's flat buffers hold exactly the adapters' elements; RNG and scheduler are there
    opt_numel = {k.rsplit(".", 1)[1]: n for k, n in out["opt_numel"].items()}
    assert opt_numel == dict.fromkeys(("param", "exp_avg", "exp_avg_sq"), out["adapter_numel"]), opt_numel
    assert any(k.startswith("rng_state") for k in out["keys_lora"]) and out["has_scheduler"]
    assert out["base"]["kind"] == "hf" and out["base"]["path"] == hf_a
    msg = out["other_base"]["message"]
    assert f"trained on the HF model directory {hf_a}" in msg and hf_b in msg and f"model.hf_dir={hf_a}" in msg, msg
    assert "model.safetensors: other content (XXH3-128), other sampled bytes" in msg and out["other_base"]["untouched"]
    msg = out["other_alpha"]["message"]
    assert "lora.alpha: saved 16.0, now 32.0" in msg and out["other_alpha"]["untouched"], msg
    assert "holds LoRA adapters only" in out["no_adapters"]["message"], out["no_adapters"]
    msg = out["full_step"]["message"]
    assert "holds a full model (no LoRA adapters)" in msg and "model.mcore_dir" in msg and out["full_step"]["untouched"]
    assert out["copy"]["message"] == ""
    assert all(torch.equal(v, out["copy"]["adapters"][k]) for k, v in out["copy"]["saved"].items())
    assert out["mcore"]["base"]["kind"] == "mcore" and out["mcore"]["base"]["record"].endswith("global_step_1/COMPLETE")
    assert out["mcore"]["message"] == ""
    assert all(torch.equal(v, out["mcore"]["adapters"][k]) for k, v in out["mcore"]["saved"].items())
    msg = out["mcore_vs_hf"]["message"]
    assert "trained on the model directory" in msg and "(a model directory vs a HF directory)" in msg and "model.mcore_dir=" in msg, msg
    # issue #37 item 4: the base edited between its samples after the save (same size): both refuse
    edited = out["edited"]
    assert "model.safetensors: other content (XXH3-128)" in edited["message"] and edited["untouched"], edited
    assert f"its base {hf_a} is not the one the adapters were trained on (model.safetensors: other content " \
           "(XXH3-128))" in edited["merge"] and not edited["merge_target"], edited
    # the converter merges an adapter-only step with its base (HF or model directory)
    for name, merged in out["merge"].items():
        assert merged and any(not torch.equal(merged[k], v) for k, v in out["copy"]["base_hf"].items()
                              if k in merged), name
    # merge --dtype bf16 of the step: every tensor the fp32 merge's rounded to bf16; config.json names
    # the dtype (without --dtype: the step's params_dtype, fp32 here); quantized dtypes refused
    d, fp32 = out["merge_dtypes"], out["merge"]["hf_base"]
    assert d["bf16"].keys() == fp32.keys() and all(
        t.dtype == torch.bfloat16 and torch.equal(t, fp32[k].to(torch.bfloat16)) for k, t in d["bf16"].items())
    assert (d["merged_bf16_config"], d["merged_hf_base_config"]) == ("bfloat16", "float32"), d
    # ... in shards of at most --max_shard_size (a larger tensor alone), indexed
    from tests.lora_ckpt_bodies import SMALL_SHARDS

    assert len(d["bf16_shards"]) > 1 and set(d["bf16_index"]) == set(d["bf16"]), sorted(d["bf16_shards"])
    for shard in d["bf16_shards"]:
        held = [k for k, f in d["bf16_index"].items() if f == shard]
        payload = sum(d["bf16"][k].numel() * 2 for k in held)
        assert payload <= SMALL_SHARDS or len(held) == 1, (shard, payload, held)
    assert "holds LoRA adapters: its merge (base + adapters) is not quantized; drop --dtype fp8" in d["fp8"], d
    assert not d["fp8_target"]


def test_critic_value_head_moe_bias_and_merged_export(tmp_path):
    """World 1: a LoRA critic's step holds its value head (trained in full) and resumes it; a
    LoRA glm4_moe actor's router correction bias (a state buffer that training moves) is saved
    and resumed. Both saved with ``hf_model``: the background export of each adapter-only step
    is complete, byte for byte the converter's merge of the step (base + s B A, the step's own
    value head / bias), whose tensors are the live engine's merged model; transformers' log-probs
    of the actor's export are the engine's."""
    critic_hf = hf_dir_for(str(tmp_path), "llama", "critic")
    moe_hf = hf_dir_for(str(tmp_path), "glm4_moe", "actor")
    out = run_ranks(1, extras_run, critic_hf, moe_hf, str(tmp_path), daemon=False)[0]
    c = out["critic"]
    model_keys = [k for k in c["keys"] if not k.startswith(("optimizer", "rng_state"))]
    assert "output_layer.weight" in model_keys and all(".lora." in k or k.startswith("output_layer.")
                                                        for k in model_keys), model_keys
    for part in ("adapters", "base"):
        assert c["at_save"][part].keys() == c["loaded"][part].keys() and c["loaded"][part]
        assert all(torch.equal(v, c["loaded"][part][k]) for k, v in c["at_save"][part].items()), part
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(c["merged"][q], c["at_save"]["base"][q])  # merged, not the base
    _assert_close(c["offline"], c["merged"], "critic")  # the converter's merge = the live merged export
    m = out["moe"]
    _assert_close(m["offline"], m["merged"], "moe")
    for leg in (c, m):
        e = leg["export"]
        assert e["state"] == "complete" and e["files"] == e["merge_files"] and not e["differ"], e
        assert "model.safetensors" in e["files"] and e["config"]["dtype"] == e["config"]["torch_dtype"] == "float32"
    assert c["export"]["config"]["architectures"] == ["LlamaForTokenClassification"], c["export"]["config"]
    assert "chat_template.jinja" in c["export"]["files"]  # the step's own HF files (the run's), not its base's
    assert m["export"]["log_prob_gap"] <= 1e-5, m["export"]["log_prob_gap"]
    bias = [k for k in m["at_save"] if k.endswith("e_score_correction_bias")]
    assert bias and all(not torch.equal(m["at_save"][k], m["fresh"][k]) for k in bias)  # it moved
    assert all(torch.equal(v, m["loaded"][k]) for k, v in m["at_save"].items())


def _assert_close(got: dict, want: dict, what: str) -> None:
    """Offline merge (fp64 B A, rounded once) against the live one (fp32): within float rounding."""
    assert got.keys() == want.keys(), what
    worst = max(((got[k].double() - v.double()).abs().max().item(), k) for k, v in want.items())
    assert worst[0] <= 1e-6, f"{what}: {worst[1]} differs by {worst[0]:.3g}"
