"""Bodies for the merge tests (tests/dist.py worlds): a tiny engine trained one step, saved by
CheckpointManager, plus its own HF export and log-probs/values (the references a merge must match)."""
from __future__ import annotations

import os

import torch

from tests.tiny import rl_batch, tiny_config, tiny_hf_model


def hf_dir_for(tmp: str, model_type: str, role: str, **overrides) -> str:
    """A tiny HF model (4 layers) saved under ``tmp`` once; the merge copies its config."""
    path = os.path.join(tmp, f"hf_{model_type}_{role}")
    if not os.path.isdir(path):
        tiny_hf_model(tiny_config(model_type, num_hidden_layers=4, **overrides), role).save_pretrained(path)
    return path


def save_trained(hf_dir: str, layout_kwargs: dict, role: str, root: str, batch: dict,
                 hf_source: str | None = None) -> dict:
    """Builds ``role`` from ``hf_dir`` in ``layout_kwargs``, trains one step (weights leave the HF
    init), saves global_step_1 with CheckpointManager (huggingface/ files from ``hf_source``,
    default ``hf_dir``); returns the engine's HF export and its log-probs (actor) or values
    (critic) on ``batch``."""
    from mcore_rl.checkpoint.config import CheckpointConfig
    from mcore_rl.checkpoint.manager import CheckpointManager
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.critic import Critic, CriticConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig
    from tests.ckpt_util import writer_processes_allowed
    from tests.steps import EXACT_MOE

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout, seed=7)
    args = model_args_from_hf(hf_dir)
    engine = ModelEngine(args, layout, role, active_platform(), BuildOptions(moe=MoEOptions(**EXACT_MOE)),
                         OptimConfig(lr=0.05, warmup_steps=0), hf_dir)
    sizes = dict(micro_batch_size=2, ppo_mini_batch_size=batch["input_ids"].shape[0])
    model = Actor(engine, ActorConfig(**sizes)) if role == "actor" else Critic(engine, CriticConfig(**sizes))
    (model.update_policy if role == "actor" else model.update_critic)(batch)
    manager = CheckpointManager(CheckpointConfig(root=root, save_contents=("model", "optimizer", "extra")),
                                hf_sources={role: hf_source or hf_dir})
    with writer_processes_allowed():
        manager.save(1, {role: engine}, {"step": 1})
    manager.close()
    exported = {k: v.clone() for k, v in export_hf(engine.model, args, role).items()}
    scores = model.compute_log_prob(batch)["log_probs"] if role == "actor" else model.compute_values(batch)
    return {"export": exported, "scores": scores}


def train_batch(vocab: int) -> dict:
    """8 rows with update inputs; advantages/returns large enough that one step moves weights."""
    batch = rl_batch(vocab, batch=8, prompt=6, response=4, seed=11)
    g = torch.Generator().manual_seed(12)
    shape = batch["responses"].shape
    mask = batch["attention_mask"][:, -4:].float()
    batch.update(old_log_probs=(-5.0 + torch.randn(shape, generator=g)) * mask,
                 advantages=torch.randn(shape, generator=g) * mask,
                 values=torch.randn(shape, generator=g) * mask, returns=torch.randn(shape, generator=g) * mask)
    return batch
