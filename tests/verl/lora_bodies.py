"""Rank bodies of tests/verl/test_verl_lora.py: verl's ActorRolloutRefWorker (role actor_rollout)
with ``model.lora.*`` on the mcore_rl engine and its CPU rollout server (in this process, called
as Ray would call it), driven by verl's own ``compute_log_prob`` (``no_lora_adapter``: verl's
``ref_in_actor``), ``update_actor`` and ``update_weights`` (verl's LoRA sync protocol)."""
from __future__ import annotations

import asyncio

import torch

from tests.verl import rl_bodies as B

LORA = {"rank": 4, "alpha": 8}
LR = 0.02  # adapters move far enough in one step that their effect dwarfs the tolerances


class _Local:
    """A server's methods called as a Ray actor handle calls them (``handle.m.remote(...)``
    awaited), recording (method, first argument)."""

    def __init__(self, server, calls: list):
        self._server, self._calls = server, calls

    def __getattr__(self, name):
        method = getattr(self._server, name)
        calls = self._calls

        class _Remote:
            @staticmethod
            def remote(*args, **kwargs):
                calls.append((name, args[0] if args else None))
                return method(*args, **kwargs)

        return _Remote


def _worker(model_dir: str, merge: bool, adapter_path: str | None):
    """verl's actor+rollout worker at TP=2 (rollout TP=2: one replica, rank 0 pushes), its
    rollout server in this process on rank 0 (random weights until the first sync)."""
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from mcore_rl.integrations.verl.rollout_server import RolloutServer

    settings = {**LORA, "merge": merge, **({"adapter_path": adapter_path} if adapter_path else {})}
    lora = [f"actor_rollout_ref.model.lora.{k}={v}" for k, v in settings.items()]
    cfg = B.ppo_config(model_dir, *lora, "actor_rollout_ref.actor.mcore_rl.tensor_model_parallel_size=2",
                       "critic.mcore_rl.tensor_model_parallel_size=2", f"actor_rollout_ref.actor.optim.lr={LR}",
                       "actor_rollout_ref.rollout.name=mcore_rl",
                       "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
                       "actor_rollout_ref.rollout.load_format=dummy", "actor_rollout_ref.rollout.dtype=float32",
                       "actor_rollout_ref.rollout.prompt_length=16", "actor_rollout_ref.rollout.response_length=8",
                       "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=1")
    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor_rollout")
    worker.init_model()
    calls: list = []
    server = None
    if worker.rollout.is_pusher:
        server = RolloutServer(cfg.actor_rollout_ref.rollout, omega_conf_to_dataclass(cfg.actor_rollout_ref.model), 0)
        worker.rollout._server = _Local(server, calls)
    return worker, server, calls


def _log_probs(worker, rows: dict, **meta) -> torch.Tensor | None:
    td = B._to_verl(rows, (), calculate_entropy=False, compute_loss=False, temperature=B.TEMPERATURE, **meta)
    return B._response_view(worker, worker.compute_log_prob(td), td, "log_probs")


def _update(worker, rows: dict, old: torch.Tensor, seed: int) -> None:
    rows = dict(rows)
    rows.update(B.update_inputs(old, old, rows["response_mask"], seed))
    td = B._to_verl(rows, ("old_log_probs", "advantages", "ref_log_prob"), temperature=B.TEMPERATURE,
                    calculate_entropy=True, global_batch_size=B.MINI, mini_batch_size=B.MINI, epochs=1, seed=42,
                    dataloader_kwargs={"shuffle": False}, compute_loss=True)
    worker.update_actor(td)


def _synced(worker, server, calls: list, rows: dict, step: int) -> dict:
    """verl's update_weights (naive: the colocated path), then what the rollout server's model
    gives the rows and what it was sent."""
    from tests.tiny import hf_log_probs

    calls.clear()
    asyncio.run(worker.update_weights(global_steps=step, mode="naive"))
    if server is None:
        return {}
    syncs, current = [], None
    for name, arg in calls:
        if name == "begin_weight_update":
            current = {"peft": arg is not None, "names": []}
            syncs.append(current)
        elif name == "update_weights_bucket":
            current["names"] += [n for n, _ in arg]
            current.setdefault("tensors", {}).update({n: t.clone() for n, t in arg})
    server_lp, _ = hf_log_probs(server.engine.model, rows, B.TEMPERATURE)
    return {"syncs": syncs, "server": server_lp, "steps": server.global_steps,
            "adapted": sorted(server.adapters.active), "params": sorted(server.engine.params)}


def _one_worker(model_dir: str, merge: bool, rows_seed: int, second_sync: bool, adapter_path: str | None) -> dict:
    worker, server, calls = _worker(model_dir, merge, adapter_path)
    engine = worker.actor.engine.engine
    rows = B.global_batch(engine.args.vocab_size, rows_seed)
    # seeded adapters (B = 0) start at the frozen base; imported ones elsewhere
    out = {"rows": rows, "start": _log_probs(worker, rows), "base": _log_probs(worker, rows, no_lora_adapter=True)}
    _update(worker, rows, out["start"] if out["start"] is not None else torch.zeros(rows["responses"].shape),
            rows_seed + 1)
    out["trained"] = _log_probs(worker, rows)
    out["ref"] = _log_probs(worker, rows, no_lora_adapter=True)  # verl's ref_in_actor
    out["first"] = _synced(worker, server, calls, rows, 1)
    if not merge:  # verl's checkpoint-engine path asks without arguments (engine_workers.update_weights)
        stream, peft = worker.actor.engine.get_per_tensor_param()
        out["ce"] = {"base": [n for n, _ in stream], "peft": peft is not None and stream.peft_config == dict(peft)}
        stream, _ = worker.actor.engine.get_per_tensor_param()
        out["ce"]["full"] = {n: t.clone() for n, t in stream.with_adapters()} if server is not None else \
            [n for n, _ in stream.with_adapters()]
    out["trainable"] = sorted(n for c in engine.model for n, p in c.named_parameters() if p.requires_grad)
    if not second_sync:
        return out
    # a second step and sync: adapter-only for merge=False (the base is there), replacing the first
    _update(worker, rows, out["trained"] if out["trained"] is not None else torch.zeros(rows["responses"].shape),
            rows_seed + 2)
    out["trained2"] = _log_probs(worker, rows)
    out["second"] = _synced(worker, server, calls, rows, 2)
    return out


def lora_sync_body(model_dir: str, adapter_dir: str, seed: int) -> dict:
    """The unmerged protocol (verl's default; two steps and syncs) starting from a PEFT adapter
    (``lora.adapter_path``), the merged one (one sync) from seeded adapters; one worker each."""
    B._env()
    return {"unmerged": _one_worker(model_dir, False, seed, True, adapter_dir),
            "merged": _one_worker(model_dir, True, seed, False, None)}


# ---- verl's SFT trainer (SFTTrainer + fit, as run_sft runs them after joining the process group) ----
def sft_config(inputs: dict, ckpt: str, steps: int, *overrides: str):
    """verl's SFT config (sft_trainer_engine.yaml) as ``python -m verl.trainer.sft_trainer``
    composes it, with model.lora.rank=8 on the mcore_rl engine (tests/verl/test_verl_sft.py's sizes)."""
    from hydra import compose, initialize_config_module

    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="sft_trainer_engine", overrides=[
            "hydra.searchpath=[pkg://mcore_rl.integrations.verl.hydra]", "engine=mcore_rl", "optim=megatron",
            "engine.dtype=float32", f"model.path={inputs['model']}", "model.enable_gradient_checkpointing=False",
            "model.lora.rank=8", "model.lora.alpha=16", f"data.train_files={inputs['train']}", "data.val_files=null",
            "data.train_batch_size=8", "data.micro_batch_size_per_gpu=2", "data.use_dynamic_bsz=False",
            "data.max_length=64", "data.num_workers=0", "model.use_remove_padding=True", "optim.lr=1e-2",
            "optim.lr_warmup_steps=0", "trainer.test_freq=-1", "trainer.save_freq=1",
            f"trainer.total_training_steps={steps}", f"trainer.default_local_dir={ckpt}", "trainer.logger=[console]",
            "trainer.device=cpu", *overrides])


def _state(engine) -> dict:
    """Adapters (PEFT names), the base weights and the live merged model ``W + s B A`` (HF names,
    export_hf) and the trainable names."""
    from mcore_rl.lora.layers import merged_tensor_of
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.conversion.lora_export import peft_adapter_tensors

    model = engine.engine
    return {"adapters": {n: t.clone() for n, t in peft_adapter_tensors(model.model, model.args, "actor").items()},
            "base": {n: t.clone() for n, t in export_hf(model.model, model.args, "actor").items()},
            "merged": {n: t.clone() for n, t in export_hf(model.model, model.args, "actor",
                                                           merged_tensor_of(model.model)).items()},
            "trainable": sorted(n for c in model.model for n, p in c.named_parameters() if p.requires_grad)}


def sft_lora_body(inputs: dict, root: str) -> dict:
    """2 SFT steps saving each with ``hf_model`` (the adapter-only steps' merged HF weights exported
    in the background); then a second trainer resumes from step 1 and trains step 2."""
    B._env()
    from verl.trainer.sft_trainer import SFTTrainer

    first = SFTTrainer(sft_config(inputs, f"{root}/a", 2, "checkpoint.save_contents=[model,optimizer,extra,hf_model]"))
    start = _state(first.engine)
    first.fit()
    straight = _state(first.engine)
    resumed = SFTTrainer(sft_config(inputs, f"{root}/b", 2, "trainer.resume_mode=resume_path",
                                    f"trainer.resume_from_path={root}/a/global_step_1"))
    at_resume = resumed.resume_global_step
    resumed.fit()
    return {"start": start, "straight": straight, "resumed": _state(resumed.engine), "at_resume": at_resume}
