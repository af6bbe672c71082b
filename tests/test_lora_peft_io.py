"""PEFT adapters in and out: an adapter peft wrote (random A and B, rank_pattern/alpha_pattern,
routed experts via target_parameters) imported as the fused type by rank expansion or as
canonical LoRA, trained 2 steps at world 1 and TP=2, exported as a PEFT adapter that
transformers + peft load to the engine's log-probs, and as merged HF weights that reproduce
them without peft."""
from __future__ import annotations

import copy
import os
import shutil

import pytest
from transformers import AutoModelForCausalLM

from tests.dist import run_ranks
from tests.lora_bodies import lora_roundtrip
from tests.test_actor_update import ACTOR, make_batch
from tests.tiny import hf_log_probs, tiny_config, tiny_hf_model

TOL = 1e-5
CASES = {  # name -> (model_type, peft LoraConfig kwargs, our lora, world, layout)
    "llama_fused_patterns": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj",
                             "up_proj", "down_proj"], rank_pattern={"o_proj": 2, "up_proj": 3}, alpha_pattern={"v_proj": 3, "down_proj": 3}),
                             dict(rank=1), 1, {}),
    "llama_canonical_tp2": ("llama", dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                            "gate_proj", "up_proj", "down_proj"]), dict(rank=1, type="canonical_lora"), 2, dict(tp=2)),
    "qwen3_moe_experts_ep2": ("qwen3_moe", dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj",
                              "o_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                              dict(rank=1), 2, dict(ep=2)),
}


def _peft_adapter(hf, kwargs: dict, directory: str) -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(hf), LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs))
    model.save_pretrained(directory)


@pytest.mark.parametrize("case", CASES)
def test_peft_adapter_round_trip(case, tmp_path):
    from peft import PeftModel

    model_type, peft_kwargs, lora, world, layout = CASES[case]
    hf = tiny_hf_model(tiny_config(model_type, num_hidden_layers=2))
    hf.save_pretrained(tmp_path / "hf")
    _peft_adapter(hf, peft_kwargs, str(tmp_path / "adapter"))
    batch = make_batch(hf)
    lora = dict(lora, adapter_path=str(tmp_path / "adapter"))
    got = run_ranks(world, lora_roundtrip, str(tmp_path / "hf"), layout, lora, batch, ACTOR, str(tmp_path / "out"),
                    model_type != "llama")[0]
    t = ACTOR["temperature"]
    start, _ = hf_log_probs(PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "adapter")), batch, t)
    assert (got["before"] - start).abs().max() <= TOL  # the import is exact
    assert (got["after"] - got["before"]).abs().max() > 1e-3  # training moved the adapters
    trained, _ = hf_log_probs(PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "out" / "peft")), batch, t)
    assert (got["after"] - trained).abs().max() <= TOL
    merged_dir = tmp_path / "out" / "merged"
    for name in os.listdir(tmp_path / "hf"):
        if name.endswith(".json") and "index" not in name:
            shutil.copy(tmp_path / "hf" / name, merged_dir / name)
    merged, _ = hf_log_probs(AutoModelForCausalLM.from_pretrained(merged_dir).eval(), batch, t)
    assert (got["after"] - merged).abs().max() <= TOL
