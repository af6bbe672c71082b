"""Rank bodies of tests/verl/test_verl_rl.py: verl's ``TrainingWorker`` (strategy mcore_rl) with
verl's ``ppo_loss`` / ``value_loss``, fed as verl's PPO trainer feeds its actor and critic, next to
mcore_rl's own ``Actor`` / ``Critic`` on the same rows and the same starting weights.

Each body returns, per rank, the tensors the test compares (None where a rank holds no output).
"""
from __future__ import annotations

import os
from functools import partial

import torch

from tests.tiny import rl_batch

ROWS, PROMPT, RESPONSE = 8, 10, 6  # global rows; per DP rank ROWS // dp
MINI = 4  # global rows per optimizer step: two steps per update
MICRO = 1  # rows per micro-batch: several micro-batches per step
# Adam's first steps turn rounding in near-zero gradients into update differences of ~2% of the
# learning rate (measured: linear in lr from 2e-3 to 1e-5); at 1e-4 two steps move parameters by
# 2e-4 while the engines agree within 1e-5
LR, TEMPERATURE = 1e-4, 0.7
CLIP_LOW, CLIP_HIGH, CLIP_C = 0.2, 0.28, 3.0
ENTROPY_COEFF, KL_COEFF, CLIP_VALUE = 0.01, 0.1, 0.3


def rows_of(batch: dict, dp_rank: int, dp: int) -> dict:
    """This DP rank's contiguous share of the rows (as verl's dispatch splits a batch)."""
    n = ROWS // dp
    return {k: v[dp_rank * n:(dp_rank + 1) * n] for k, v in batch.items()}


def global_batch(vocab_size: int, seed: int) -> dict:
    """verl's padded rollout batch: prompts left-padded, responses right-padded, positions."""
    b = rl_batch(vocab_size, ROWS, PROMPT, RESPONSE, seed)
    mask = b["attention_mask"]
    b["prompts"] = b["input_ids"][:, :PROMPT].clone()
    b["response_mask"] = mask[:, PROMPT:].clone()
    b["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0) * mask
    return b


def update_inputs(log_probs: Tensor, values: Tensor, mask: Tensor, seed: int) -> dict:
    """old_log_probs / ref_log_prob away from the current policy (so clipping and the KL act),
    advantages, old values and returns, [b, R]; zero outside the response mask."""
    g = torch.Generator().manual_seed(seed)
    noise = lambda scale: torch.randn(mask.shape, generator=g) * scale  # noqa: E731
    m = mask.float()
    # noise 0.8: ratios beyond 1 +- 0.28 for most tokens; every third token (the first of each
    # response among them) a ratio of e^1.5 > 3 with a negative advantage: the dual clip acts
    old, adv = log_probs + noise(0.8), noise(1.0)
    dual = (torch.arange(mask.shape[1]) % 3 == 0).expand_as(mask)
    old, adv = torch.where(dual, log_probs - 1.5, old), torch.where(dual, -adv.abs() - 0.1, adv)
    return {"old_log_probs": old * m, "ref_log_prob": (log_probs + noise(0.3)) * m,
            "advantages": adv * m, "values": (values + noise(0.4)) * m, "returns": noise(1.0) * m}


Tensor = torch.Tensor


def _verl_worker(model_type: str, path: str, layout: dict, remove_padding: bool, steps: int,
                 forward_only: bool = False):
    """A TrainingWorker built as verl's ActorRolloutRefWorker builds its actor (and the PPO
    trainer its critic): verl's configs, strategy mcore_rl, reset() = engine.initialize()."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreOptimizerConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    from mcore_rl.integrations.verl import McoreRLEngineConfig

    engine = McoreRLEngineConfig(dtype="float32", use_dynamic_bsz=False, micro_batch_size_per_gpu=MICRO,
                                 infer_micro_batch_size_per_gpu=MICRO, forward_only=forward_only, **layout)
    optim = McoreOptimizerConfig(lr=LR, lr_warmup_steps=0, total_training_steps=steps, weight_decay=0.01,
                                 clip_grad=1.0)
    # the packed worker also recomputes activations (verl's enable_gradient_checkpointing)
    model = HFModelConfig(path=path, use_remove_padding=remove_padding, enable_gradient_checkpointing=remove_padding)
    worker = TrainingWorker(TrainingWorkerConfig(model_type=model_type, model_config=model, engine_config=engine,
                                                 optimizer_config=optim, checkpoint_config=CheckpointConfig()))
    worker.reset()
    return worker


def _to_verl(rows: dict, keys: tuple[str, ...], **meta) -> "TensorDict":
    """verl's trainer step: padded rows -> TensorDict -> ``left_right_2_no_padding`` + meta."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    base = ("input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask")
    td = tu.get_tensordict({k: rows[k] for k in base + keys}, non_tensor_dict=meta)
    return left_right_2_no_padding(td)


def _response_view(worker, output, td, key: str) -> Tensor | None:
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    if output is None:
        return None
    return no_padding_2_padding(tu.get(output, key), td).float()


def _local_params(chunks) -> list[Tensor]:
    return [p.detach().clone() for chunk in chunks for p in chunk.parameters()]


def _max_diff(a: list[Tensor], b: list[Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def _env() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # verl's Worker reads them; the group exists
    os.environ.setdefault("MASTER_PORT", "29500")


def _plain(metrics: dict) -> dict:
    """verl's metrics as numbers / lists of numbers (Metric objects reduced as verl logs them)."""
    from verl.utils.metric import Metric

    def one(v):
        if isinstance(v, Metric):
            return float(v.aggregate())
        if isinstance(v, torch.Tensor):
            return float(v)
        if isinstance(v, list):
            return [one(x) for x in v]
        return float(v) if isinstance(v, (int, float)) else repr(v)

    return {k: one(v) for k, v in metrics.items()}


def _own_engine(path: str, layout: dict, role: str, steps: int):
    """mcore_rl's own ModelEngine with the optimizer verl's config above asks for, and verl's pad
    id: HFModelConfig sets the config's pad_token_id from the tokenizer (its engines' padding_idx)."""
    from transformers import AutoTokenizer

    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.parallel import ParallelLayout
    from mcore_rl.platform import setup_platform
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    names = {"tensor_model_parallel_size": "tp", "pipeline_model_parallel_size": "pp",
             "virtual_pipeline_model_parallel_size": "vpp", "expert_model_parallel_size": "ep",
             "sequence_parallel": "sequence_parallel"}
    layout = dict(layout)
    distributed = layout.pop("use_distributed_optimizer", True)
    par = ParallelLayout(**{names[k]: v for k, v in layout.items()})
    optim = OptimConfig(lr=LR, weight_decay=0.01, clip_grad=1.0, total_steps=steps, decay_style="constant",
                        use_distributed_optimizer=distributed)
    args = model_args_from_hf(path).with_pad_token_id(AutoTokenizer.from_pretrained(path).pad_token_id)
    return ModelEngine(args, par, role, setup_platform(None),
                       BuildOptions(params_dtype=torch.float32), optim, hf_weights=path)


def _ranks():
    from megatron.core import parallel_state as mpu

    return mpu.get_data_parallel_rank(), mpu.get_data_parallel_world_size()


def _steps(dp: int) -> list[slice]:
    """This DP rank's local rows of each mini-batch (verl's make_iterator without shuffle)."""
    n = MINI // dp
    return [slice(i * n, (i + 1) * n) for i in range(ROWS // MINI)]


def rl_body(actor_dir: str, critic_dir: str, layout: dict, seed: int, then_cp2: bool = False) -> dict:
    """One launch per layout: the actor's and the critic's comparisons (below); with
    ``then_cp2`` (a DP=2 layout) the same rows at CP=2 afterwards (cp_bodies)."""
    actor = actor_body(actor_dir, layout, seed)
    critic = critic_body(critic_dir, layout, seed)
    dp_rank, dp = _ranks()
    out = {"dp_rank": dp_rank, "dp": dp, "actor": actor, "critic": critic,
           "other_layout": _other_layout_refused(actor_dir, layout)}
    if then_cp2:
        from tests.verl.cp_bodies import cp_after_dp

        out["cp2"] = cp_after_dp(actor, critic, actor_dir, critic_dir)
    return out


def _other_layout_refused(path: str, layout: dict) -> str:
    """A further engine in this process (verl's actor + ref) at another TP size: the error."""
    from mcore_rl.integrations.verl.config import VerlConfigError

    other = {"tensor_model_parallel_size": 1 if layout.get("tensor_model_parallel_size", 1) == 2 else 2,
             "pipeline_model_parallel_size": 1}
    try:
        _verl_worker("language_model", path, other, False, 10)
    except VerlConfigError as e:
        return str(e)
    return "no error"


def actor_body(model_dir: str, layout: dict, seed: int) -> dict:
    """verl's TrainingWorker (remove-padding off, on) and mcore_rl's Actor: log-probs, entropy,
    one update of two optimizer steps with verl's ppo_loss (clip, dual clip, entropy, KL)."""
    _env()
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import ActorConfig as VerlActorConfig
    from verl.workers.utils.losses import ppo_loss

    from mcore_rl.rl.actor import Actor, ActorConfig

    verl_loss = partial(ppo_loss, config=VerlActorConfig(
        strategy="mcore_rl", rollout_n=1, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=MICRO,
        clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH, clip_ratio_c=CLIP_C, entropy_coeff=ENTROPY_COEFF,
        use_kl_loss=True, kl_loss_coef=KL_COEFF, kl_loss_type="low_var_kl", calculate_entropy=True))
    workers = [_verl_worker("language_model", model_dir, layout, rp, 10) for rp in (False, True)]
    dpr, dp = _ranks()
    rows = rows_of(global_batch(workers[0].engine.engine.args.vocab_size, seed), dpr, dp)
    engine = _own_engine(model_dir, layout, "actor", 10)
    start = _local_params(engine.model)
    actor = Actor(engine, ActorConfig(
        temperature=TEMPERATURE, micro_batch_size=MICRO, ppo_mini_batch_size=MINI, clip_ratio_low=CLIP_LOW,
        clip_ratio_high=CLIP_HIGH, dual_clip_c=CLIP_C, entropy_coeff=ENTROPY_COEFF, use_kl_loss=True,
        kl_loss_coeff=KL_COEFF, kl_loss_type="low_var_kl", dispatch="sharded"))
    own = actor.compute_log_prob(rows, with_entropy=True)
    rows.update(update_inputs(own["log_probs"], torch.zeros_like(own["log_probs"]), rows["response_mask"], seed + 1))
    own_steps = [actor.update_policy({k: v[s] for k, v in rows.items()}) for s in _steps(dp)]
    result = {"rows": rows, "own": own, "own_steps": own_steps, "moved": _max_diff(_local_params(engine.model), start)}
    for rp, worker in zip(("padded", "packed"), workers):
        td = _to_verl(rows, (), calculate_entropy=True, compute_loss=False, temperature=TEMPERATURE)
        out = worker.infer_batch(td)
        result[rp] = {"log_probs": _response_view(worker, out, td, "log_probs"),
                      "entropy": _response_view(worker, out, td, "entropy")}
        worker.set_loss_fn(verl_loss)
        td = _to_verl(rows, ("old_log_probs", "advantages", "ref_log_prob"), temperature=TEMPERATURE,
                      calculate_entropy=True, global_batch_size=MINI, mini_batch_size=MINI, epochs=1, seed=42,
                      dataloader_kwargs={"shuffle": False}, compute_loss=True)
        out = worker.train_mini_batch(td)
        result[rp]["metrics"] = None if out is None else _plain(tu.get(out, "metrics"))
        result[rp]["param_diff"] = _max_diff(_local_params(worker.engine.engine.model), _local_params(engine.model))
        result[rp]["recompute"] = str(worker.engine.engine.config.recompute_granularity)
    result["export"] = _exported(workers[1], rows)
    # verl's reference policy: a forward-only engine beside the actor's, still at the start weights
    ref = _verl_worker("language_model", model_dir, layout, True, 10, forward_only=True)
    td = _to_verl(rows, (), calculate_entropy=False, compute_loss=False, temperature=TEMPERATURE)
    result["ref_log_probs"] = _response_view(ref, ref.infer_batch(td), td, "log_probs")
    return result


def critic_body(model_dir: str, layout: dict, seed: int) -> dict:
    """verl's TrainingWorker for a value model (remove-padding off, on) with verl's value_loss,
    and mcore_rl's Critic: values and one update of two optimizer steps (value clipping)."""
    _env()
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import CriticConfig as VerlCriticConfig
    from verl.workers.utils.losses import value_loss

    from mcore_rl.rl.critic import Critic, CriticConfig

    verl_loss = partial(value_loss, config=VerlCriticConfig(
        strategy="mcore_rl", rollout_n=1, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=MICRO,
        cliprange_value=CLIP_VALUE))
    workers = [_verl_worker("value_model", model_dir, layout, rp, 10) for rp in (False, True)]
    dpr, dp = _ranks()
    rows = rows_of(global_batch(workers[0].engine.engine.args.vocab_size, seed), dpr, dp)
    engine = _own_engine(model_dir, layout, "critic", 10)
    start = _local_params(engine.model)
    critic = Critic(engine, CriticConfig(micro_batch_size=MICRO, ppo_mini_batch_size=MINI,
                                         cliprange_value=CLIP_VALUE, dispatch="sharded"))
    values = critic.compute_values(rows)
    extra = update_inputs(torch.zeros_like(values), values, rows["response_mask"], seed + 2)
    rows.update(values=extra["values"], returns=extra["returns"])
    own_steps = [critic.update_critic({k: v[s] for k, v in rows.items()}) for s in _steps(dp)]
    result = {"rows": rows, "own": {"values": values}, "own_steps": own_steps,
              "moved": _max_diff(_local_params(engine.model), start)}
    for rp, worker in zip(("padded", "packed"), workers):
        td = _to_verl(rows, (), compute_loss=False)
        out = worker.infer_batch(td)
        result[rp] = {"values": _response_view(worker, out, td, "values")}
        worker.set_loss_fn(verl_loss)
        td = _to_verl(rows, ("values", "returns"), global_batch_size=MINI, mini_batch_size=MINI, epochs=1, seed=42,
                      dataloader_kwargs={"shuffle": False})
        out = worker.train_mini_batch(td)
        result[rp]["metrics"] = None if out is None else _plain(tu.get(out, "metrics"))
        result[rp]["param_diff"] = _max_diff(_local_params(worker.engine.engine.model), _local_params(engine.model))
    return result


def _exported(worker, rows: dict) -> dict:
    """get_per_tensor_param against export_hf, and a transformers model given its tensors
    scoring the rows as the engine does (after the update)."""
    import inspect

    from mcore_rl.models.hf_weights import export_hf
    from tests.tiny import hf_log_probs

    td = _to_verl(rows, (), calculate_entropy=False, compute_loss=False, temperature=TEMPERATURE)
    out = worker.infer_batch(td)
    log_probs = _response_view(worker, out, td, "log_probs")
    generator, extra = worker.engine.get_per_tensor_param()
    lazy = inspect.isgenerator(generator)
    pairs = list(generator)
    engine = worker.engine.engine
    reference = export_hf(engine.model, engine.args, "actor")
    same = [n for n, _ in pairs] == list(reference) and all(torch.equal(t, reference[n]) for n, t in pairs)
    result = {"lazy": lazy, "extra": extra, "same_as_export_hf": same, "names": len(pairs)}
    if log_probs is not None:  # as a rollout engine loads them: HF names on disk, transformers' own loader
        import shutil
        import tempfile

        from safetensors.torch import save_file
        from transformers import AutoModelForCausalLM

        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(os.path.join(worker.model_config.local_path, "config.json"), tmp)
            save_file({n: t.contiguous() for n, t in pairs}, os.path.join(tmp, "model.safetensors"))
            model = AutoModelForCausalLM.from_pretrained(tmp, attn_implementation="eager", dtype=torch.float32)
        hf, _ = hf_log_probs(model.eval(), rows, TEMPERATURE)
        result["hf_log_probs"], result["engine_log_probs"] = hf, log_probs
    return result


def ppo_config(model_dir: str, *overrides: str):
    """verl's PPO trainer config (ppo_trainer.yaml) with model_engine=mcore_rl, composed by Hydra
    as ``python -m verl.trainer.main_ppo`` composes it."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=[
            "hydra.searchpath=[pkg://mcore_rl.integrations.verl.hydra]", "model_engine=mcore_rl",
            f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}",
            "actor_rollout_ref.model.enable_gradient_checkpointing=False",
            "actor_rollout_ref.actor.mcore_rl.dtype=float32", "actor_rollout_ref.actor.use_dynamic_bsz=False",
            f"actor_rollout_ref.actor.ppo_mini_batch_size={MINI}",
            f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={MICRO}",
            f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={MICRO}",
            f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={MICRO}",
            "actor_rollout_ref.actor.optim.total_training_steps=10", "actor_rollout_ref.actor.use_kl_loss=True",
            f"critic.ppo_micro_batch_size_per_gpu={MICRO}", "critic.optim.total_training_steps=10",
            "critic.mcore_rl.dtype=float32", *overrides])


def ppo_workers_body(model_dir: str, seed: int) -> dict:
    """verl's ActorRolloutRefWorker (roles 'actor' and 'ref', one process, as verl colocates
    them) built from the composed PPO config: old and reference log-probs, one actor update."""
    _env()
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine_workers import ActorRolloutRefWorker

    # one process here (verl puts the critic in its own): the critic takes the actor's layout
    cfg = ppo_config(model_dir, "actor_rollout_ref.actor.mcore_rl.tensor_model_parallel_size=2",
                     "critic.mcore_rl.tensor_model_parallel_size=2")
    actor = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    actor.init_model()
    ref = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="ref")
    ref.init_model()
    rows = global_batch(actor.actor.engine.engine.args.vocab_size, seed)
    td = _to_verl(rows, (), calculate_entropy=True, compute_loss=False, temperature=TEMPERATURE)
    old = _response_view(actor, actor.compute_log_prob(td), td, "log_probs")
    td = _to_verl(rows, (), calculate_entropy=False, compute_loss=False, temperature=TEMPERATURE)
    reference = _response_view(ref, ref.compute_ref_log_prob(td), td, "log_probs")
    base = old if old is not None else torch.zeros(rows["responses"].shape)
    rows.update(update_inputs(base, base, rows["response_mask"], seed + 1))
    td = _to_verl(rows, ("old_log_probs", "advantages", "ref_log_prob"), temperature=TEMPERATURE,
                  calculate_entropy=True, global_batch_size=MINI, mini_batch_size=MINI, epochs=1, seed=42,
                  dataloader_kwargs={"shuffle": False}, compute_loss=True)
    out = actor.update_actor(td)
    return {**_ppo_critic(cfg, rows), "old": old, "ref": reference, "metrics": None if out is None else _plain(tu.get(out, "metrics")),
            "engines": [type(w.engine).__name__ for w in (actor.actor, ref.ref)],
            "ref_forward_only": ref.ref.engine.engine.optimizer is None,
            "tp": ref.ref.engine.layout.tp, "lr": (cfg.actor_rollout_ref.actor.optim.lr,
                                                   cfg.actor_rollout_ref.actor.optim.lr_decay_style)}


def _ppo_critic(cfg, rows: dict) -> dict:
    """The critic as verl's PPO trainer builds it (ray_trainer: CriticConfig -> TrainingWorker
    with value_loss): values, then one update."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import value_loss

    critic_cfg = omega_conf_to_dataclass(cfg.critic)
    critic_cfg.engine.infer_max_token_len_per_gpu = critic_cfg.ppo_infer_max_token_len_per_gpu
    critic_cfg.engine.max_token_len_per_gpu = critic_cfg.ppo_max_token_len_per_gpu
    worker = TrainingWorker(TrainingWorkerConfig(
        model_type="value_model", model_config=critic_cfg.model, engine_config=critic_cfg.engine,
        optimizer_config=critic_cfg.optim, checkpoint_config=critic_cfg.checkpoint))
    worker.reset()
    worker.set_loss_fn(partial(value_loss, config=critic_cfg))
    td = _to_verl(rows, (), compute_loss=False)
    values = _response_view(worker, worker.infer_batch(td), td, "values")
    td = _to_verl(rows, ("values", "returns"), global_batch_size=MINI, mini_batch_size=MINI, epochs=1, seed=42,
                  dataloader_kwargs={"shuffle": False})
    out = worker.train_mini_batch(td)
    return {"critic_values": values, "critic_metrics": None if out is None else _plain(tu.get(out, "metrics")),
            "critic_engine": type(worker.engine).__name__}
