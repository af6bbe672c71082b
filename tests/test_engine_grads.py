"""A training step's gradients do not depend on what the previous step left behind: after an
optimizer step, the next backward gives the same main_grad as a repeat of it, for every
optimizer kind (megatron's non-distributed optimizers alias param.grad to main_grad after a step;
a backward into that alias counted the gradient twice before ModelEngine.run cleared param.grad)."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import padded_batch, tiny_config, tiny_hf_model

OPTIMIZERS = {
    "adam_distributed": dict(name="adam", use_distributed_optimizer=True),
    "adam": dict(name="adam", use_distributed_optimizer=False),
    "sgd": dict(name="sgd", use_distributed_optimizer=False),
}


def _grads_after_step(hf_dir: str, optim: dict, dtype: str) -> list[torch.Tensor]:
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout()
    initialize_parallel_state(layout)
    options = BuildOptions(params_dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
    engine = ModelEngine(model_args_from_hf(hf_dir), layout, "actor", active_platform(), options,
                         OptimConfig(lr=1e-2, **optim), hf_weights=hf_dir)
    micro = [padded_batch(200, batch=2, seq=12, seed=s) for s in (1, 2)]

    def loss_fn(mb: dict, output: torch.Tensor):
        loss = output.float().square().mean() * 1e-3
        return loss, {"loss": loss.detach()}

    def grads() -> list[torch.Tensor]:
        engine.run(micro, loss_fn, False)
        return [p.main_grad.detach().clone() for chunk in engine.model for p in chunk.parameters()]

    engine.train(True)
    grads()
    engine.step()
    after_step, repeat = grads(), grads()
    return [torch.stack([a.float().norm(), r.float().norm(), (a - r).float().abs().max()])
            for a, r in zip(after_step, repeat)]


CASES = [("adam_distributed", "fp32"), ("adam_distributed", "bf16"), ("adam", "fp32"), ("adam", "bf16"),
         ("sgd", "fp32")]


@pytest.mark.parametrize("optimizer,dtype", CASES)
def test_gradients_after_a_step_are_not_counted_twice(tmp_path, optimizer, dtype):
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(tmp_path)
    stats = run_ranks(1, _grads_after_step, str(tmp_path), OPTIMIZERS[optimizer], dtype)[0]
    assert max(float(s[0]) for s in stats) > 0  # the loss has gradients
    for norm_after_step, norm_repeat, diff in stats:
        assert float(diff) == 0.0, (optimizer, dtype, float(norm_after_step), float(norm_repeat))
