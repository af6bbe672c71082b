"""Rank bodies of tests/verl/test_verl_offload.py: verl's call sequence of one PPO step, twice,
on an actor (verl's TrainingWorker) with offload on, a reference beside it, and a twin actor
without offload; then a checkpoint load into a fresh offloaded actor.

The sequence (verl 0.9.1, ``engine_workers.py``): initialize; ``update_weights``:
``get_per_tensor_param`` then ``to('cpu', model=True)`` (when param_offload); ``compute_log_prob``:
``infer_batch`` (eval context); ``compute_ref_log_prob``; ``update_actor``: ``train_mini_batch``
(train context, inner ``train_batch`` with auto-offload off); ``save_checkpoint`` outside any
context. Where each state part is (every tensor's storage non-empty: 'on', all empty: 'off') is
recorded after every call and inside every context (on entry of ``forward_backward_batch``).
"""
from __future__ import annotations

from functools import partial

import torch

from tests.verl import rl_bodies as B

STEPS = 2
LR, WARMUP_INIT = 1e-2, 2e-3  # bf16 weights move at these; warmup over 2 of 10 steps (ratio 0.2)
OPTIM = dict(lr_warmup_steps=0, lr_warmup_steps_ratio=0.2, lr_warmup_init=WARMUP_INIT, total_training_steps=10,
             lr_decay_style="linear", weight_decay=0.01, clip_grad=1.0)
LOADED_OPTIM = dict(lr=2 * LR, total_training_steps=20)  # the resumed run's config: another schedule


def placement(engine) -> dict[str, str]:
    """'on' / 'off' / 'mixed' / 'none' per kind, read from the tensors (not from the offloader):
    params, grads (main_grad), main_params (the torch optimizer's parameters: fp32 copies or
    shards, or views of the parameters), adam (optimizer state tensors)."""
    kinds: dict[str, list] = {"params": [], "grads": [], "main_params": [], "adam": []}
    for chunk in engine.model:
        for p in chunk.parameters():
            kinds["params"].append(p)
            if getattr(p, "main_grad", None) is not None:
                kinds["grads"].append(p.main_grad)
    opt = engine.optimizer
    for o in (getattr(opt, "chained_optimizers", None) or [opt]) if opt is not None else []:
        for group in o.optimizer.param_groups:
            kinds["main_params"] += [p for p in group["params"] if p.numel() > 0]
        for state in o.optimizer.state.values():
            kinds["adam"] += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]

    def where(tensors: list) -> str:
        present = {t.untyped_storage().nbytes() > 0 for t in tensors}
        return "none" if not present else "mixed" if len(present) == 2 else "on" if present.pop() else "off"

    return {k: where(v) for k, v in kinds.items()}


def _worker(path: str, dtype: str, param_offload: bool, optimizer_offload: bool, forward_only: bool = False,
            **optim_changes):
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreOptimizerConfig, TrainingWorkerConfig
    from verl.workers.engine_workers import TrainingWorker

    from mcore_rl.integrations.verl import McoreRLEngineConfig

    engine = McoreRLEngineConfig(dtype=dtype, use_dynamic_bsz=False, micro_batch_size_per_gpu=B.MICRO,
                                 infer_micro_batch_size_per_gpu=B.MICRO, forward_only=forward_only,
                                 param_offload=param_offload, optimizer_offload=optimizer_offload)
    optim = McoreOptimizerConfig(**{"lr": LR, **OPTIM, **optim_changes})
    model = HFModelConfig(path=path, use_remove_padding=True, enable_gradient_checkpointing=False)
    worker = TrainingWorker(TrainingWorkerConfig(model_type="language_model", model_config=model,
                                                 engine_config=engine, optimizer_config=optim,
                                                 checkpoint_config=CheckpointConfig()))
    worker.reset()
    return worker


def _recording(worker, log: list, label: str) -> None:
    """Records the placement on entry of every forward_backward_batch (inside verl's contexts)."""
    engine = worker.engine
    original = engine.forward_backward_batch

    def forward_backward_batch(*args, **kwargs):
        log.append((label, placement(engine.engine)))
        return original(*args, **kwargs)

    engine.forward_backward_batch = forward_backward_batch


def _ppo_loss():
    from verl.workers.config import ActorConfig as VerlActorConfig
    from verl.workers.utils.losses import ppo_loss

    return partial(ppo_loss, config=VerlActorConfig(
        strategy="mcore_rl", rollout_n=1, ppo_mini_batch_size=B.MINI, ppo_micro_batch_size_per_gpu=B.MICRO,
        clip_ratio_low=B.CLIP_LOW, clip_ratio_high=B.CLIP_HIGH, clip_ratio_c=B.CLIP_C, use_kl_loss=True,
        kl_loss_coef=B.KL_COEFF, kl_loss_type="low_var_kl"))


def _ppo_steps(actor, ref, rows: dict, log: list, root: str | None, offload_params: bool) -> dict:
    """verl's sequence, STEPS times (see the module doc); returns what each step computed."""
    from verl.utils import tensordict_utils as tu

    out: dict = {"export": [], "log_probs": [], "ref_log_probs": [], "metrics": []}
    engine = actor.engine
    for step in range(STEPS):
        generator, _ = engine.get_per_tensor_param()  # update_weights (naive sync)
        log.append(("exporting", placement(engine.engine)))
        out["export"].append({name: t.clone() for name, t in generator})
        if offload_params:
            engine.to("cpu", model=True, optimizer=False, grad=False)
        log.append(("after sync", placement(engine.engine)))
        td = B._to_verl(rows, (), calculate_entropy=False, compute_loss=False, temperature=B.TEMPERATURE)
        out["log_probs"].append(B._response_view(actor, actor.infer_batch(td), td, "log_probs"))
        log.append(("after eval", placement(engine.engine)))
        if ref is not None:
            out["ref_log_probs"].append(B._response_view(ref, ref.infer_batch(td), td, "log_probs"))
            log.append(("ref after eval", placement(ref.engine.engine)))
        inputs = B.update_inputs(out["log_probs"][-1] if out["log_probs"][-1] is not None else
                                 torch.zeros(rows["responses"].shape), torch.zeros(rows["responses"].shape),
                                 rows["response_mask"], 11 + step)
        td = B._to_verl({**rows, **inputs}, ("old_log_probs", "advantages", "ref_log_prob"),
                        temperature=B.TEMPERATURE, calculate_entropy=False, global_batch_size=B.MINI,
                        mini_batch_size=B.MINI, epochs=1, seed=42, dataloader_kwargs={"shuffle": False},
                        compute_loss=True)
        result = actor.train_mini_batch(td)
        out["metrics"].append(None if result is None else B._plain(tu.get(result, "metrics")))
        log.append(("after train", placement(engine.engine)))
        if step == 0 and root is not None:
            engine.save_checkpoint(f"{root}/global_step_1/actor", global_step=1)
            log.append(("after save", placement(engine.engine)))
            out["saved_scheduler"] = dict(engine.engine.scheduler.state_dict())
    engine.to("device", model=True, optimizer=False, grad=False)  # reading an offloaded tensor would crash
    out["params"] = [p.detach().clone() for chunk in engine.engine.model for p in chunk.parameters()]
    return out


def offload_body(path: str, dtype: str, param_offload: bool, optimizer_offload: bool, root: str) -> dict:
    """The sequence on an offloaded actor (+ reference) and on a twin without offload; then the
    checkpoint of step 1 loaded into a fresh offloaded actor configured with another schedule."""
    B._env()
    offload = {"param_offload": param_offload, "optimizer_offload": optimizer_offload}
    log: list = []
    actor = _worker(path, dtype, **offload)
    log.append(("after init", placement(actor.engine.engine)))
    ref = _worker(path, dtype, param_offload, False, forward_only=True)
    log.append(("ref after init", placement(ref.engine.engine)))
    twin = _worker(path, dtype, False, False)
    for worker in (actor, twin):
        worker.set_loss_fn(_ppo_loss())
    _recording(actor, log, "inside actor")
    _recording(ref, log, "inside ref")
    dp_rank, dp = B._ranks()
    rows = B.rows_of(B.global_batch(actor.engine.engine.args.vocab_size, 5), dp_rank, dp)
    moved = _ppo_steps(actor, ref, rows, log, root, param_offload)
    plain = _ppo_steps(twin, None, rows, [], None, False)
    loaded = _worker(path, dtype, **LOADED_OPTIM, **offload)
    if torch.distributed.get_rank() == 0:  # verl's trainer names the finished step (it completes it)
        with open(f"{root}/latest_checkpointed_iteration.txt", "w") as f:
            f.write("1")
    torch.distributed.barrier()
    loaded.engine.load_checkpoint(f"{root}/global_step_1/actor")
    after_load = placement(loaded.engine.engine)
    lr_after_load = loaded.engine.engine.optimizer.param_groups[0]["lr"]
    generator, _ = loaded.engine.get_per_tensor_param()
    return {"log": log, "moved": moved, "plain": plain, "after_load": after_load, "lr_after_load": lr_after_load,
            "loaded_export": {name: t.clone() for name, t in generator},
            "main_params_are_param_views": _main_params_are_param_views(twin.engine.engine)}


def _main_params_are_param_views(engine) -> bool:
    """Whether the optimizer's parameters share the model parameters' storage (megatron's
    distributed optimizer in fp32: its shards are views of DDP's parameter buffer)."""
    params = {p.untyped_storage().data_ptr() for chunk in engine.model for p in chunk.parameters()}
    opt = engine.optimizer
    mains = [p for o in (getattr(opt, "chained_optimizers", None) or [opt]) for g in o.optimizer.param_groups
             for p in g["params"] if p.numel() > 0]
    return all(p.untyped_storage().data_ptr() in params for p in mains)
