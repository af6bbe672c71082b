"""Bodies for checkpoint tests run inside N-rank worlds (tests/dist.py): build a trainable
engine with dropout, train on different batches per step, save/load through CheckpointManager."""
from __future__ import annotations

import torch

from tests.steps import EXACT_MOE
from tests.tiny import rl_batch, tiny_config, tiny_hf_model

ROWS, PROMPT, RESPONSE = 8, 6, 4


def hf_dir_for(tmp: str, model_type: str, role: str) -> str:
    """A tiny HF model with attention dropout saved under ``tmp`` (made once, in the test)."""
    import os

    path = os.path.join(tmp, f"hf_{model_type}_{role}")
    if not os.path.isdir(path):
        cfg = tiny_config(model_type, num_hidden_layers=4, attention_dropout=0.1)
        tiny_hf_model(cfg, role).save_pretrained(path)
    return path


def engine_settings(bf16: bool) -> tuple:
    """(BuildOptions, OptimConfig) of every checkpoint test engine: hidden dropout 0.1, an exact
    MoE router (correction-bias updates on), Adam with a short warmup and linear decay."""
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.rl.engine import OptimConfig

    # sigmoid routers move their correction bias every step (state the resume must restore)
    options = BuildOptions(params_dtype=torch.bfloat16 if bf16 else torch.float32, hidden_dropout=0.1,
                           moe=MoEOptions(**EXACT_MOE, expert_bias_update_rate=0.01))
    return options, OptimConfig(lr=0.02, eps=1e-3, warmup_steps=2, total_steps=6, decay_style="linear")


def build_engine(hf_dir: str, layout_kwargs: dict, role: str, bf16: bool, seed: int):
    """A trainable engine (hidden dropout 0.1) and its Actor/Critic; ``seed`` seeds init RNGs."""
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.critic import Critic, CriticConfig
    from mcore_rl.rl.engine import ModelEngine

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout, seed=seed)
    engine = ModelEngine(model_args_from_hf(hf_dir), layout, role, active_platform(), *engine_settings(bf16), hf_dir)
    sizes = dict(micro_batch_size=2, ppo_mini_batch_size=ROWS // 2)  # 2 optimizer steps per update
    if role == "actor":
        return engine, Actor(engine, ActorConfig(**sizes))
    return engine, Critic(engine, CriticConfig(**sizes))


def step_batch(vocab: int, step: int) -> dict:
    """A different batch each step, with every update input the actor and critic read."""
    batch = rl_batch(vocab, batch=ROWS, prompt=PROMPT, response=RESPONSE, seed=100 + step)
    g = torch.Generator().manual_seed(200 + step)
    shape = batch["responses"].shape
    mask = batch["attention_mask"][:, -RESPONSE:].float()
    batch.update(old_log_probs=(-5.0 + torch.randn(shape, generator=g)) * mask,
                 advantages=torch.randn(shape, generator=g) * mask,
                 values=torch.randn(shape, generator=g) * mask, returns=torch.randn(shape, generator=g) * mask)
    return batch


def train(model, steps: range) -> list[dict]:
    """update_policy / update_critic on step_batch(step) for each step; the metrics per step."""
    out = []
    for step in steps:
        batch = step_batch(model.engine.args.vocab_size, step)
        update = model.update_policy if hasattr(model, "update_policy") else model.update_critic
        out.append(update(batch))
    return out


def optimizer_fingerprint(engine) -> dict[str, torch.Tensor]:
    """Every optimizer state tensor (exp_avg, exp_avg_sq, step, main params) of this rank, keyed
    by sub-optimizer, group, param index and name (MoE: dense and expert optimizers)."""
    opts = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    out = {}
    for o, opt in enumerate(opts):
        inner = opt.optimizer
        for g, group in enumerate(inner.param_groups):
            for p, param in enumerate(group["params"]):
                out[f"{o}.{g}.{p}.param"] = param.detach().clone()
                for name, value in inner.state.get(param, {}).items():
                    out[f"{o}.{g}.{p}.{name}"] = torch.as_tensor(value).clone()
    return out


def hf_params(engine) -> dict[str, torch.Tensor]:
    from mcore_rl.models.hf_weights import export_hf

    return {k: v.float().clone() for k, v in export_hf(engine.model, engine.args, engine.role).items()}


def manager(root: str, hf_sources: dict | None = None, exports=None, **kw):
    """A CheckpointManager of ``CheckpointConfig(root=root, **kw)`` (``hf_sources``, ``exports``:
    the manager's own arguments)."""
    from mcore_rl.checkpoint.config import CheckpointConfig
    from mcore_rl.checkpoint.manager import CheckpointManager

    return CheckpointManager(CheckpointConfig(root=root, **kw), hf_sources=hf_sources, exports=exports)


def opt_state_hf(engine, key: str) -> dict[str, torch.Tensor]:
    """The DistributedOptimizer's ``key`` state (e.g. exp_avg) as full tensors under HF names:
    each DP rank's shard placed in its param's range, summed over DP, TP/EP-gathered."""
    from mcore_rl.models.hf_weights import export_hf

    full = {}
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for model_param in [p for buffer in opt.buffers for p in buffer.params]:  # same order on every DP rank
            flat = torch.zeros(model_param.numel(), dtype=torch.float32)
            if model_param in opt.model_param_group_index_map:  # this DP rank holds a piece of it
                span = opt._get_model_param_range_map(model_param)["param"]
                flat[span.start:span.end] = opt._get_main_param_and_optimizer_states(model_param)[key].float()
            torch.distributed.all_reduce(flat, group=opt.data_parallel_group)
            full[model_param] = flat.view(model_param.shape)
    return export_hf(engine.model, engine.args, engine.role, tensor_of=lambda p: full[p])


def error_of(call) -> str | None:
    """The message of the CheckpointError ``call()`` raises (None when it raises none)."""
    from mcore_rl.errors import CheckpointError

    try:
        call()
    except CheckpointError as e:
        return str(e)
    return None


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:
        return False
