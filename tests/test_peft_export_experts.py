"""PEFT export of routed-expert adapters on gate_up only, down only and both: the
adapter_config.json lists exactly the adapted expert parameters, and peft 0.21 loads each
directory to the engine's log-probs (one world, three engines)."""
from __future__ import annotations

import copy
import json

from peft import PeftModel

from tests.dist import run_ranks
from tests.lora_bodies import export_expert_parts
from tests.tiny import hf_log_probs, rl_batch, tiny_config, tiny_hf_model

TOL = 1e-5
ACTOR = dict(temperature=1.0, micro_batch_size=2, ppo_mini_batch_size=4)
EXPERTS = "*.mlp.experts.local_experts.*."
VARIANTS = {  # name -> (target_modules, the target_parameters peft must see)
    "gate_up": ([EXPERTS + "linear_fc1"], ["mlp.experts.gate_up_proj"]),
    "down": ([EXPERTS + "linear_fc2", "linear_proj"], ["mlp.experts.down_proj"]),
    "both": ([EXPERTS + "linear_fc1", EXPERTS + "linear_fc2"], ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}


def test_expert_parts_export_loads_in_peft(tmp_path):
    hf = tiny_hf_model(tiny_config("qwen3_moe", num_hidden_layers=2))
    hf.save_pretrained(tmp_path / "hf")
    batch = rl_batch(200, batch=4, prompt=6, response=4)
    variants = {name: targets for name, (targets, _) in VARIANTS.items()}
    got = run_ranks(1, export_expert_parts, str(tmp_path / "hf"), variants, batch, ACTOR, str(tmp_path))[0]
    base, _ = hf_log_probs(hf, batch)
    for name, (_, params) in VARIANTS.items():
        config = json.loads((tmp_path / name / "adapter_config.json").read_text())
        assert config["target_parameters"] == params, name
        assert (got[name] - base).abs().max() > 1e-3, name  # the adapters matter far above TOL
        peft_lp, _ = hf_log_probs(PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / name)), batch)
        assert (got[name] - peft_lp).abs().max() <= TOL, name
