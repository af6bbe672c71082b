"""Published Qwen3.5 checkpoints: vision-language wrappers (``Qwen3_5ForConditionalGeneration``,
text model under ``model.language_model.``, a vision tower, ``mtp.*``) and Qwen3.5-MoE's fused
experts (``experts.gate_up_proj`` [E, 2I, H]). HF -> model directory -> HF is byte-identical for
every tensor (vision and MTP tensors carried through, experts fused back), the merged directory
loads in transformers as the same class with the source's logits, the model directory and the HF
directory load at TP=2 x PP=2 (EP=2); a critic of a wrapper, a fused tensor of the wrong shape or
with NaN, and vision training are refused naming the value."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.dist import run_ranks
from tests.test_convert import _verify
from tests.vl_bodies import VL, convert_noting_warnings, load_both_ways, save_vl, train_and_save


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    base = tmp_path_factory.mktemp("vl")
    return {name: save_vl(str(base), name) for name in VL}


def _tensors(directory: str) -> dict[str, torch.Tensor]:
    from mcore_rl.mapping.hf_io import SafetensorsReader

    reader = SafetensorsReader(directory)
    return {k: reader[k] for k in reader}


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _nan_copy(src: str, dst: str) -> None:
    """``src`` with a NaN in expert 1's gate rows of layer 2's fused gate_up_proj."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    file = os.path.join(dst, "model.safetensors")
    tensors = load_file(file)
    tensors["model.language_model.layers.2.mlp.experts.gate_up_proj"][1, 3, 5] = float("nan")
    save_file(tensors, file, metadata={"format": "pt"})


def test_round_trip_is_byte_identical_and_loads_as_the_same_class(vl, tmp_path):
    from transformers import AutoModelForImageTextToText

    from converters.verify_logits import TOL
    from mcore_rl.conversion.merge import compare, merge
    from mcore_rl.errors import CheckpointError
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_layout import CARRIED_FILE, hf_view

    out = {n: str(tmp_path / f"out_{n}") for n in vl}
    nan_src = str(tmp_path / "nan_src")
    _nan_copy(vl["moe_fused"][0], nan_src)
    warned = run_ranks(1, convert_noting_warnings, [*((vl[n][0], out[n]) for n in vl), (nan_src, str(tmp_path / "nan"))])[0]
    assert warned[out["dense"]] == [] and warned[out["moe_fused"]] == []
    assert "model.language_model.layers.2.mlp.experts.gate_up_proj[1] (gate rows)" in warned[str(tmp_path / "nan")][0]
    loaded = run_ranks(4, load_both_ways, {n: (out[n], vl[n][0]) for n in vl})[0]
    batch = {"input_ids": torch.randint(1, 200, (2, 12), generator=torch.Generator().manual_seed(3)),
             "attention_mask": torch.ones(2, 12, dtype=torch.long)}
    for name, (hf_dir, model) in vl.items():
        source = _tensors(hf_dir)
        assert any(k.startswith("model.visual.") for k in source) and "mtp.fc.weight" in source
        assert any(k.endswith("experts.gate_up_proj") for k in source) == VL[name][2]
        args = model_args_from_hf(hf_dir)
        language = hf_view({k: v for k, v in source.items() if k.startswith(("model.language_model.", "lm_head."))},
                           args, hf_dir)
        for i, export in enumerate(loaded[name]):  # from the model directory, then from the HF directory
            assert set(export) == set(language), (name, i, sorted(set(export) ^ set(language))[:4])
            bad = [k for k in language if not torch.equal(export[k], language[k])]
            assert bad == [], (name, i, bad[:4])
        merged_dir = str(tmp_path / f"merged_{name}")
        merge(out[name], merged_dir)
        merged = _tensors(merged_dir)
        assert set(merged) == set(source), sorted(set(merged) ^ set(source))[:6]
        differ = [k for k in source if merged[k].dtype != source[k].dtype or _raw(merged[k]) != _raw(source[k])]
        assert differ == [], f"{name}: {differ[:6]} differ after the round trip"
        diffs, problems = compare(out[name], hf_dir)  # mcore_to_hf.py test: against the source's names
        assert problems == [] and diffs and set(diffs.values()) == {0.0}, (name, problems[:4])
        with open(os.path.join(merged_dir, "config.json")) as f:
            assert json.load(f)["architectures"] == [type(model).__name__]
        assert not os.path.exists(os.path.join(merged_dir, "mcore_rl_carried.safetensors"))
        again = AutoModelForImageTextToText.from_pretrained(merged_dir, attn_implementation="eager").eval()
        assert type(again) is type(model)
        with torch.no_grad():
            want, got = model(**batch).logits, again(**batch).logits
        assert want.abs().max() > 0.1 and torch.equal(got, want), name
    torn = tmp_path / "torn"  # the carried file is in the directory's record: a changed byte is named
    shutil.copytree(out["dense"], torn)
    with open(torn / "huggingface" / CARRIED_FILE, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        byte = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(CheckpointError, match=rf"huggingface/{CARRIED_FILE} has checksum"):
        merge(str(torn), str(tmp_path / "merged_torn"))
    checks = run_ranks(1, _verify, {n: (out[n], vl[n][0]) for n in vl})[0]  # hf_to_mcore.py --test
    for name, (diff, cos) in checks.items():
        assert diff <= TOL and cos > 0.9999, f"{name}: max |diff| {diff:.3g}, cosine {cos:.6f}"


def test_refusals_name_the_value(vl, tmp_path, caplog):
    """A critic of a wrapper, LoRA on the vision tower, a fused expert tensor of the wrong shape
    or stored twice; the carried tensors a load leaves out are said, and a checkpoint step of a
    run started from the HF directory gets them (``carry_from_hf``)."""
    import logging

    from safetensors.torch import load_file, save_file

    from mcore_rl.conversion.convert_input import role_from_config
    from mcore_rl.lora.config import LoraConfig, LoraConfigError
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from mcore_rl.models.hf_config import ConfigError, model_args_from_hf
    from mcore_rl.models.hf_layout import HFLayoutError, carry_from_hf, carried_names, hf_view, log_ignored, read_carried

    dense, fused = vl["dense"][0], vl["moe_fused"][0]
    args = model_args_from_hf(dense)
    assert role_from_config(dense) == "actor"
    with pytest.raises(ConfigError, match=r"'qwen3_5' \(Qwen3_5ForConditionalGeneration\) is a vision-language "
                                          r"checkpoint: mcore_rl builds it as an actor only, not as a critic"):
        args.hf_rows("critic")
    with pytest.raises(LoraConfigError, match=r"'model\.visual\.\*' names a vision tower"):
        LoraConfig(rank=4, target_modules=("linear_qkv", "model.visual.*"))
    moe = model_args_from_hf(fused)
    bad = tmp_path / "bad"
    bad.mkdir()
    tensors = load_file(os.path.join(fused, "model.safetensors"))
    name = "model.language_model.layers.1.mlp.experts.down_proj"
    tensors[name] = torch.zeros(4, 64, 49)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(HFLayoutError, match=rf"'{name}' has shape \[4, 64, 49\].* needs \[4, 64, 48\]"):
        hf_view(SafetensorsReader(bad), moe, str(bad))
    tensors[name] = torch.zeros(4, 64, 48)
    twice = {**tensors, "model.language_model.layers.0.mlp.experts.3.up_proj.weight": torch.zeros(48, 64)}
    with pytest.raises(HFLayoutError, match=r"both fused and per expert, e\.g\. "
                                            r"'model\.language_model\.layers\.0\.mlp\.experts\.3\.up_proj\.weight'"):
        hf_view(twice, moe, "twice")
    reader = SafetensorsReader(fused)
    carried = carried_names(reader, moe.wrapper)
    with caplog.at_level(logging.INFO, logger="mcore_rl"):
        log_ignored(carried, moe.wrapper, fused)
    assert f"ignoring {len(carried)} tensors of Qwen3_5MoeForConditionalGeneration" in caplog.text
    assert "1 others: ['mtp']" in caplog.text
    step_hf = tmp_path / "step_hf"
    step_hf.mkdir()
    carry_from_hf(fused, str(step_hf))
    assert read_carried(str(step_hf)) == (carried, {"experts": "fused"})


def test_transformers_rollout_takes_the_wrappers_names(vl):
    """The job's transformers rollout loads a VL directory as its text model (AutoModelForCausalLM:
    Qwen3_5ForCausalLM, names without the wrapper's prefix); the weight sync sends the wrapper's
    names (``model.language_model.*``, as export_hf spells them): each reaches its parameter."""
    from mcore_rl.rollout.hf_generate import TransformersRollout

    hf_dir, model = vl["dense"]
    rollout = TransformersRollout(hf_dir, eos_id=1, pad_id=0)
    assert type(rollout.model).__name__ == "Qwen3_5ForCausalLM"
    sent = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()
            if k.startswith(("model.language_model.", "lm_head."))}
    assert rollout.update_weights(sent.items()) == len(sent)
    assert all(bool((p == 0.25).all()) for p in rollout.model.parameters())


def test_main_job_trains_from_a_vl_directory_and_its_step_merges_complete(tmp_path):
    """GRPO from the fused-expert Qwen3.5-MoE VL directory (EP=2, builtin rollouts): the
    language model trains; the saved step merges into a Qwen3_5MoeForConditionalGeneration whose
    vision and MTP tensors are the source's bytes, experts fused, language tensors the live ones."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.job.schema import load_job_config

    hf_dir, _ = save_vl(str(tmp_path), "moe_fused", vocab_size=4)  # the toy task's reward varies
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = load_job_config(os.path.join(root, "configs", "grpo_demo.yaml"), [
        f"output_dir={tmp_path / 'run'}", "progress_bar=false", f"model.hf_dir={hf_dir}", "layout.tp=1",
        "layout.ep=2", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=8",
        "actor.micro_batch_size=8", "actor.ppo_mini_batch_size=16", "actor_optim.lr=1e-2",
        "actor_optim.warmup_steps=0", "checkpoint.save_contents=[model,optimizer,extra,hf_model]"])
    live = run_ranks(2, train_and_save, cfg, 1)[0]
    assert live["moved"] >= live["params"] // 2, live
    merge(str(tmp_path / "run" / "checkpoints" / "global_step_1" / "actor"), str(tmp_path / "merged"))
    merged, source = _tensors(str(tmp_path / "merged")), _tensors(hf_dir)
    assert set(merged) == set(source)
    carried = [k for k in source if k.startswith(("model.visual.", "mtp."))]
    assert carried and all(_raw(merged[k]) == _raw(source[k]) for k in carried)
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_layout import hf_view

    view = hf_view(merged, model_args_from_hf(hf_dir), "merged")
    assert set(live["export"]) == set(view) - set(carried)
    assert all(torch.equal(view[k], t) for k, t in live["export"].items())
    with open(tmp_path / "merged" / "config.json") as f:
        assert json.load(f)["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    # the step's hf_model content (huggingface/, exported in the background from the saved step):
    # the same complete checkpoint, byte for byte what merge wrote (experts fused as the source)
    from transformers import AutoModelForImageTextToText

    step_hf = tmp_path / "run" / "checkpoints" / "global_step_1" / "actor" / "huggingface"
    models = [AutoModelForImageTextToText.from_pretrained(d) for d in (tmp_path / "merged", step_hf)]
    assert type(models[1]).__name__ == "Qwen3_5MoeForConditionalGeneration"
    sds = [m.state_dict() for m in models]
    assert sds[0].keys() == sds[1].keys() and all(torch.equal(v, sds[1][k]) for k, v in sds[0].items())
    written = sorted(set(os.listdir(tmp_path / "merged")) - {"mcore_rl_export.json"})
    assert "model.safetensors.index.json" in written or "model.safetensors" in written, written
    assert all((step_hf / n).read_bytes() == (tmp_path / "merged" / n).read_bytes() for n in written)
    assert {n for n in os.listdir(step_hf) if n.startswith("model")} == {n for n in written if n.startswith("model")}
