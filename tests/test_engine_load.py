"""Defect 1 of the hardening issue: weights loaded into a bf16 engine after its optimizer exists
must survive the first optimizer step (megatron's fp32 main copies would write the old weights
back). Both load paths keep the trunk equal to the HF weights through an lr=0 update."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import rl_batch, tiny_config, tiny_hf_model


def _critic_after_lr0_update(hf_dir: str, late_load: bool) -> dict:
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.critic import Critic, CriticConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(tp=2, sequence_parallel=True)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    options = BuildOptions(params_dtype=torch.bfloat16)
    optim = OptimConfig(lr=0.0)
    if late_load:  # built with random weights, HF weights arrive after the optimizer
        engine = ModelEngine(args, layout, "critic", active_platform(), options, optim)
        engine.load_hf_weights(hf_dir, init_value_head=True)
    else:
        engine = ModelEngine(args, layout, "critic", active_platform(), options, optim, hf_dir, init_value_head=True)
    critic = Critic(engine, CriticConfig(micro_batch_size=4, ppo_mini_batch_size=8))
    batch = rl_batch(200, batch=8)
    values = critic.compute_values(batch)
    batch.update(values=values, returns=values + 1.0)
    critic.update_critic(batch)
    return {k: v for k, v in export_hf(engine.model, args, "critic").items() if not k.startswith("score")}


@pytest.mark.parametrize("late_load", [False, True], ids=["at_build", "after_optimizer"])
def test_loaded_weights_survive_the_first_step(late_load, tmp_path):
    from mcore_rl.mapping.hf_io import SafetensorsReader

    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(tmp_path)
    trunk = run_ranks(2, _critic_after_lr0_update, str(tmp_path), late_load)[0]
    source = SafetensorsReader(tmp_path)
    assert set(trunk) == set(source) - {"lm_head.weight"}
    for name, tensor in trunk.items():
        assert torch.equal(tensor, source[name].to(torch.bfloat16)), name
