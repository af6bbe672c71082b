"""PEFT export of routed-expert adapters on gate_up only, down only and both: the
adapter_config.json lists exactly the adapted expert parameters, and peft 0.21 loads each
directory to the engine's log-probs (one world, three engines)."""
from __future__ import annotations

import copy
import json
import math
import os
import shutil

import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from tests.dist import run_ranks
from tests.lora_bodies import export_then_import
from tests.tiny import hf_log_probs, rl_batch, tiny_config, tiny_hf_model

TOL = 1e-5
ACTOR = dict(temperature=1.0, micro_batch_size=2, ppo_mini_batch_size=4)
EXPERTS = "*.mlp.experts.local_experts.*."
VARIANTS = {  # name -> (target_modules, the target_parameters peft must see)
    "gate_up": ([EXPERTS + "linear_fc1"], ["mlp.experts.gate_up_proj"]),
    "down": ([EXPERTS + "linear_fc2", "linear_proj"], ["mlp.experts.down_proj"]),
    "both": ([EXPERTS + "linear_fc1", EXPERTS + "linear_fc2"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


L0 = "base_model.model.model.layers.0.mlp.experts."
HOSTILE = {  # name -> (exported variant, change to its tensors / config); every one refused
    "gate_up_A_narrow": ("both", lambda t, c: t.update({L0 + "base_layer.lora_A.weight": torch.randn(8, 1)})),
    "down_B_flat": ("both", lambda t, c: t.update({L0 + "lora_B.weight": torch.randn(1, 8)})),
    "three_experts": ("down", lambda t, c: t.update({L0 + "lora_A.weight": t[L0 + "lora_A.weight"][:6].clone()})),
    "nan": ("down", lambda t, c: t[L0 + "lora_B.weight"].view(-1).__setitem__(5, math.nan)),
    "one_part_listed": ("both", lambda t, c: c.update(target_parameters=["mlp.experts.gate_up_proj"])),
    "unknown_parameter": ("gate_up", lambda t, c: c.update(target_parameters=["mlp.experts.up_proj"])),
    "experts_rank_pattern": ("gate_up", lambda t, c: c.update(rank_pattern={"experts": 2})),
}


def mutated(out_dir: str) -> dict[str, str]:
    """The three exports as they are, and the HOSTILE changes of them (new directories)."""
    paths = {name: os.path.join(out_dir, name) for name in VARIANTS}
    for name, (source, change) in HOSTILE.items():
        d = os.path.join(out_dir, "hostile", name)
        shutil.copytree(paths[source], d)
        tensors = load_file(os.path.join(d, "adapter_model.safetensors"))
        config = json.load(open(os.path.join(d, "adapter_config.json")))
        change(tensors, config)
        save_file(tensors, os.path.join(d, "adapter_model.safetensors"))
        json.dump(config, open(os.path.join(d, "adapter_config.json"), "w"))
        paths[name] = d
    return paths


def test_expert_parts_export_loads_in_peft(tmp_path):
    hf = tiny_hf_model(tiny_config("qwen3_moe", num_hidden_layers=2))
    hf.save_pretrained(tmp_path / "hf")
    batch = rl_batch(200, batch=4, prompt=6, response=4)
    variants = {name: targets for name, (targets, _) in VARIANTS.items()}
    result = run_ranks(1, export_then_import, str(tmp_path / "hf"), variants, batch, ACTOR, str(tmp_path), mutated)[0]
    got, imported = result["exported"], result["imported"]
    for name in HOSTILE:  # mis-shaped, damaged or mislabelled expert adapters: one clear refusal
        assert imported[name][0] == "refused", (name, imported[name])
        assert "hostile" in imported[name][1], (name, imported[name])
    base, _ = hf_log_probs(hf, batch)
    for name, (_, params) in VARIANTS.items():
        assert imported[name][0] == "ok" and (imported[name][1] - got[name]).abs().max() <= TOL, name
        config = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert config["target_parameters"] == params, name
        assert (got[name] - base).abs().max() > 1e-3, name  # the adapters matter far above TOL
        peft_lp, _ = hf_log_probs(PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / name)), batch)
        assert (got[name] - peft_lp).abs().max() <= TOL, name
