"""mcore_rl's engines behind verl's ``BaseEngine`` interface (verl 0.9.1,
``verl/workers/engine/base.py``; semantics of ``megatron/transformer_impl.py``).

A verl engine holds one ``ModelEngine`` (megatron-core chunks, DDP, distributed optimizer, LR
schedule). verl's batches (TensorDicts with jagged ``input_ids``) are split into micro-batches by
verl's own ``prepare_micro_batches``, run through megatron's schedule by ``run_schedule``
(padded or packed, ``verl_batches``), and verl's ``loss_function`` is called on each
micro-batch's output in verl's layout; the results are put back in order by verl's
``postprocess_batch_func``. Checkpoints go through mcore_rl's ``CheckpointManager``
(``verl_checkpoints``).
"""
from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from megatron.core import parallel_state as mpu
from megatron.core.distributed import finalize_model_grads
from tensordict import TensorDict
from verl.utils import tensordict_utils as tu
from verl.workers.engine.base import BaseEngine, BaseEngineCtx
from verl.workers.engine.utils import detach_tree, postprocess_batch_func, prepare_micro_batches

from mcore_rl.errors import McoreRLError
from mcore_rl.integrations.verl import (ray_nodes, verl_batches, verl_checkpoints, verl_lora, verl_mtp, verl_optim,
                                       verl_routing)
from mcore_rl.integrations.verl.engine_config import McoreRLEngineSettings, VerlConfigError
from mcore_rl.models.builder import BuildOptions, Role
from mcore_rl.models.forward import run_schedule
from mcore_rl.models.micro_batch import MicroBatch
from mcore_rl.models.mtp_model import mtp_training
from mcore_rl.models.hf_config import model_args_from_hf
from mcore_rl.models.hf_weights import export_hf_buckets
from mcore_rl.lora.layers import adapters_disabled, merged_tensor_of
from mcore_rl.models.routing import ROUTED_EXPERTS
from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
from mcore_rl.platform import setup_platform
from mcore_rl.rl.engine import ModelEngine
from mcore_rl.rl.offload import PARTS, PartOffloader

log = logging.getLogger("mcore_rl.integrations.verl")
Tensor = torch.Tensor
# ``to()``'s word for the compute device (verl's worker uses it too): on the CPU platform verl's
# get_device_name() is 'cpu' as well, which ``to()`` reads as "offload"
ON_DEVICE = "device"


class McoreRLEngine(BaseEngine):
    """One model (policy or value model) of a verl worker on mcore_rl. Built in two steps, as
    verl's engines: the constructor sets up the parallel state (verl asks for DP rank and size
    before ``initialize``), ``initialize()`` builds the model, optimizer and LR schedule."""

    role: Role = "actor"

    def __init__(self, model_config, engine_config: McoreRLEngineSettings, optimizer_config, checkpoint_config,
                 **_kwargs: Any) -> None:
        super().__init__()
        if not isinstance(engine_config, McoreRLEngineSettings):
            raise VerlConfigError(f"the mcore_rl engine needs engine=mcore_rl (McoreRLEngineConfig), got "
                                  f"{type(engine_config).__name__}.")
        # model.lora.* (verl's Megatron keys); FSDP-only LoRA keys refused before any process group use
        self.lora = verl_lora.lora_config(model_config, "model", seed=engine_config.seed)
        self.mtp = verl_mtp.mtp_config(model_config, "model")  # model.mtp.*: MTP layers built / trained
        check_context_parallel(engine_config.context_parallel_size, self.mtp)
        self.model_config, self.engine_config = model_config, engine_config
        verl_checkpoints.check_checkpoint_config(checkpoint_config)  # refused now, not at the first save
        self.optimizer_config, self.checkpoint_config = optimizer_config, checkpoint_config
        self.platform = setup_platform(None)  # cpu or cuda, as torch sees this process
        if not torch.distributed.is_initialized():
            raise McoreRLError("the mcore_rl engine needs torch.distributed initialized (verl's trainer does it).")
        c = engine_config
        self.layout = ParallelLayout(
            tp=c.tensor_model_parallel_size, pp=c.pipeline_model_parallel_size,
            vpp=c.virtual_pipeline_model_parallel_size, cp=c.context_parallel_size,
            ep=c.expert_model_parallel_size, etp=c.expert_tensor_parallel_size, sequence_parallel=c.sequence_parallel)
        self.layout.validate(torch.distributed.get_world_size())
        _join_parallel_state(self.layout, c.seed)
        ray_nodes.set_node_identity()  # checkpoints' node-local disks under Ray (no torchrun env)
        self.engine: ModelEngine | None = None
        self.hf_source: str | None = None  # HF config/tokenizer copied into checkpoints' huggingface/
        self.mode: str | None = None
        self._placement: PartOffloader | None = None  # which state parts are in host memory
        self._plan: verl_lora.SyncPlan | None = None  # LoRA's adapter-only sync (get_per_tensor_param)

    # ---- build -----------------------------------------------------------------------------
    def initialize(self) -> None:
        """Builds the model from ``model_config.local_path`` (a HF directory) at the layout; with
        an optimizer and LR schedule unless ``forward_only``."""
        if self.engine is not None:
            return
        path = self.model_config.local_path
        start = verl_checkpoints.model_start(path, self.role)
        self.hf_source = start.hf_dir
        c = self.engine_config
        # the engine's recompute_granularity, else verl's switch (model.enable_gradient_checkpointing, default on)
        recompute = c.recompute_granularity or (
            "full" if getattr(self.model_config, "enable_gradient_checkpointing", False) else None)
        options = BuildOptions(params_dtype=torch.bfloat16 if c.is_bf16 else torch.float32, recompute=recompute,
                               recompute_num_layers=c.recompute_num_layers or 1, lora=self.lora)
        optim = None if c.forward_only else verl_optim.optim_config(self.optimizer_config,
                                                                    c.use_distributed_optimizer)
        # verl's hf_config carries the tokenizer's pad id (HFModelConfig): its FSDP engine's padding_idx
        args = model_args_from_hf(start.hf_dir).with_pad_token_id(
            getattr(self.model_config.hf_config, "pad_token_id", None), "verl's model_config.hf_config.pad_token_id"
        )
        args = args.with_mtp(self.mtp.enable)
        check_context_parallel(c.context_parallel_size, self.mtp, args)
        self.engine = ModelEngine(args, self.layout, self.role, self.platform,
                                  options, optim, hf_weights=start.hf_dir, init_value_head=start.init_value_head)
        self._placement = PartOffloader(self.engine)
        _check_router_replay(self.engine, self.engine_config.router_replay.mode)
        if start.mcore_dir is not None:
            verl_checkpoints.load_model_dir_into(start.mcore_dir, self.engine)
        if self.engine_config.forward_only:
            self.to("cpu", model=self.is_param_offload_enabled, optimizer=False, grad=False)
        else:
            self.to("cpu", model=self.is_param_offload_enabled, optimizer=self.is_optimizer_offload_enabled,
                    grad=self.is_param_offload_enabled)

    @property
    def is_param_offload_enabled(self) -> bool:
        return bool(self.engine_config.param_offload)

    @property
    def is_optimizer_offload_enabled(self) -> bool:
        return bool(self.engine_config.optimizer_offload)

    def train_mode(self, **kwargs: Any) -> BaseEngineCtx:
        return _ModeCtx(self, "train", **kwargs)

    def eval_mode(self, **kwargs: Any) -> BaseEngineCtx:
        return _ModeCtx(self, "eval", **kwargs)

    # ---- optimizer -------------------------------------------------------------------------
    def _trainable(self) -> ModelEngine:
        if self.engine is None or self.engine.optimizer is None:
            raise McoreRLError("this mcore_rl engine has no optimizer (not initialized, or forward_only=True).")
        return self.engine

    def optimizer_zero_grad(self) -> None:
        engine = self._trainable()
        engine.optimizer.zero_grad()
        for chunk in engine.model:
            chunk.zero_grad_buffer()

    def optimizer_step(self) -> float:
        """Reduces the gradients (DP, SP, tied embeddings), clips, steps; returns the grad norm
        before clipping (the LR schedule moves in ``lr_scheduler_step``)."""
        engine = self._trainable()
        finalize_model_grads(engine.model)
        ok, grad_norm, _ = engine.optimizer.step()
        if not ok:
            raise McoreRLError(f"the optimizer skipped its step (grad norm {grad_norm}): non-finite gradients.")
        return float(grad_norm or 0.0)

    def lr_scheduler_step(self) -> float:
        engine = self._trainable()
        engine.scheduler.step(increment=1)
        return float(engine.optimizer.param_groups[0]["lr"])

    # ---- placement ---------------------------------------------------------------------------
    def to(self, device: str, model: bool = True, optimizer: bool = True, grad: bool = True) -> None:
        """Moves the named parts of the state (``model``: parameters, ``grad``: gradients,
        ``optimizer``: fp32 main parameters and optimizer state) to host memory (``device='cpu'``)
        or back to the compute device (any other ``device``; ``ON_DEVICE`` on every platform).
        Each part moves only if it is not there already; the others stay where they are. On the
        CPU platform the same storages are freed (correct, only not useful)."""
        super().to(device=device, model=model, optimizer=optimizer, grad=grad)
        if self._placement is None:
            return
        parts = [part for part, asked in zip(PARTS, (model, grad, optimizer)) if asked]
        if device == "cpu":
            self._placement.offload(parts)
        else:
            self._placement.onload(parts)

    @property
    def offloaded(self) -> frozenset[str]:
        """The parts of the state (``PARTS``) now in host memory."""
        return self._placement.offloaded if self._placement is not None else frozenset()

    @contextmanager
    def _state_on_device(self):
        """Everything on the device for a checkpoint; afterwards the offloaded parts go back."""
        away = self.offloaded
        if away:
            self._placement.onload(away)
        try:
            yield
        finally:
            if away:
                self._placement.offload(away)

    # ---- parallel groups ---------------------------------------------------------------------
    def get_data_parallel_rank(self) -> int:
        return mpu.get_data_parallel_rank()

    def get_data_parallel_size(self) -> int:
        return mpu.get_data_parallel_world_size()

    def get_data_parallel_group(self):
        return mpu.get_data_parallel_group()

    def is_mp_src_rank_with_outputs(self) -> bool:
        return (mpu.get_tensor_model_parallel_rank() == 0 and mpu.get_context_parallel_rank() == 0
                and mpu.get_pipeline_model_parallel_rank() == mpu.get_pipeline_model_parallel_world_size() - 1)

    # ---- forward / backward ----------------------------------------------------------------
    def forward_backward_batch(self, data: TensorDict, loss_function: Callable | None, forward_only: bool = False) -> dict:
        """verl's contract: the batch's loss-mask tokens (summed over DP) as ``batch_num_tokens``,
        ``dp_size``, ``sp_size`` and ``num_micro_batch`` are set on the batch; ``loss_function``
        is called per micro-batch; its loss is multiplied by the micro-batch count (megatron's
        schedule divides by it). Returns ``{'loss', 'metrics', 'model_output'}`` on the last
        pipeline stage (verl's ``postprocess_batch_func``), ``{}`` elsewhere."""
        if self.engine is None:
            raise McoreRLError("initialize() the mcore_rl engine before running batches.")
        device = self.platform.device()
        tu.assign_non_tensor(data, sp_size=self.engine_config.context_parallel_size)
        loss_mask = data["loss_mask"]
        tokens = (loss_mask.values().sum() if loss_mask.is_nested else loss_mask.sum()).to(device)
        torch.distributed.all_reduce(tokens, group=self.get_data_parallel_group())
        tu.assign_non_tensor(data, batch_num_tokens=tokens.item(), dp_size=self.get_data_parallel_size())
        vpp = self.layout.vpp if self.layout.vpp and self.layout.vpp > 1 else None
        micro, indices = prepare_micro_batches(data=data, dp_group=self.get_data_parallel_group(),
                                               num_batches_divided_by=self.layout.pp if vpp else None,
                                               same_micro_num_in_dp=True)
        for mb in micro:
            tu.assign_non_tensor(mb, num_micro_batch=len(micro))
        tu.assign_non_tensor(data, num_micro_batch=len(micro))
        micro = [mb.to(device) for mb in micro]
        inputs = verl_batches.model_inputs(micro, self.engine, bool(self.engine_config.use_remove_padding))
        act = verl_routing.action(self.engine_config.router_replay.mode, data, forward_only,
                                  tu.get_non_tensor_data(data, key="enable_routing_replay", default=None))
        if act is not None:
            inputs, total = verl_routing.attach_token_ids(inputs, micro)
            verl_routing.begin(self.engine.routing, act, micro, total)
        by_input = {id(x): mb for x, mb in zip(inputs, micro)}

        def loss_fn(inp: MicroBatch, output: Tensor):
            mb = by_input[id(inp)]
            model_output = self._model_output(output, inp, mb, forward_only)
            if loss_function is None:
                loss, metrics, scaled = torch.tensor(1.0, device=device), {}, None
            else:
                loss, metrics = loss_function(model_output=model_output, data=mb,
                                              dp_group=self.get_data_parallel_group())
                scaled = loss * mb["num_micro_batch"]
            out = {"loss": loss.detach().item(), "metrics": metrics, "model_output": detach_tree(model_output)}
            return (loss if scaled is None else scaled), out

        try:
            with mtp_training(self.engine.model, verl_mtp.OFF if forward_only else self.mtp):
                results = run_schedule(self.engine.model, inputs, loss_fn, forward_only, self.engine.routing)
        except BaseException:
            if act is not None:
                self.engine.routing.end(combine=False)
            raise
        routes = self.engine.routing.end() if act is not None else None  # collective when recording
        if not mpu.is_pipeline_last_stage(ignore_virtual=True):
            return {}
        if routes is not None:  # R2's record: verl's layout, put in order with the log-probs
            for result, mb_routes in zip(results, verl_routing.per_micro_batch(routes, micro)):
                result["model_output"][ROUTED_EXPERTS] = mb_routes
        return postprocess_batch_func(output_lst=results, indices=indices, data=data)

    def _model_output(self, output: Tensor, inp: MicroBatch, mb: TensorDict, forward_only: bool) -> dict[str, Tensor]:
        raise NotImplementedError

    # ---- checkpoints and weights -------------------------------------------------------------
    def save_checkpoint(self, local_path: str, hdfs_path: str | None = None, global_step: int = 0,
                        max_ckpt_to_keep: int | None = None, **_kwargs: Any) -> None:
        """Saves model, optimizer, RNG and LR schedule (``checkpoint.save_contents``) as
        mcore_rl's ``global_step_<N>/<role>/`` step; see ``verl_checkpoints``."""
        with self._state_on_device():
            verl_checkpoints.save(self, local_path, hdfs_path, global_step, max_ckpt_to_keep)

    def load_checkpoint(self, local_path: str, hdfs_path: str | None = None, del_local_after_load: bool = True,
                        **_kwargs: Any) -> None:
        """Loads ``checkpoint.load_contents`` from a step saved by ``save_checkpoint`` (at any
        layout). The checkpoint is never deleted, whatever ``del_local_after_load`` says. The LR
        schedule's values: the config's (``optim.use_checkpoint_opt_param_scheduler=False``, verl's
        default) or the checkpoint's; its step count is the checkpoint's."""
        scheduler = self.engine.scheduler if self.engine is not None else None
        keep_config = scheduler is not None and not self.optimizer_config.use_checkpoint_opt_param_scheduler
        configured = scheduler.state_dict() if keep_config else None
        with self._state_on_device(), warnings.catch_warnings():
            if keep_config:  # the checkpoint's values are replaced below
                warnings.filterwarnings("ignore", message=".*lr scheduler .*using the checkpoint's value")
            verl_checkpoints.load(self, local_path, hdfs_path, del_local_after_load)
        if keep_config:
            changed = verl_optim.config_schedule_after_load(scheduler, configured)
            if changed:
                log.info("optim.use_checkpoint_opt_param_scheduler=False: the config's %s replace the checkpoint's",
                         changed)

    def get_per_tensor_param(self, base_sync_done: bool = False,
                             **_kwargs: Any) -> tuple[Iterator[tuple[str, Tensor]], dict | None]:
        """(generator of (name, full tensor), PEFT config or None), one parameter's tensors at a
        time. Without LoRA: ``export_hf``'s tensors, None. With LoRA (verl's protocol, see
        ``verl_lora``): ``lora.merge=True`` the merged weights ``W + s B A``, None;
        ``lora.merge=False`` the base weights without adapters (``base_sync_done=False``; an
        ``AdapterWeights`` whose ``with_adapters()`` adds the factors, for checkpoint engines) or
        only the adapter factors under PEFT names (``base_sync_done=True``), with verl's
        PEFT-config dict either way. Collective: every rank must run the generator to its end."""
        if self.engine is None:
            raise McoreRLError("initialize() the mcore_rl engine before exporting its weights.")
        self.to(ON_DEVICE, model=True, optimizer=False, grad=False)  # verl offloads them again after the sync
        engine = self.engine
        lora = self.lora.enabled
        peft_config = None
        if lora and not self.lora.merge:
            plan = self._sync_plan()
            peft_config = verl_lora.peft_config_for_rollout(self.lora, plan)
            if base_sync_done:
                return verl_lora.adapter_tensors(engine, plan), peft_config
        tensor_of = merged_tensor_of(engine.model) if lora and self.lora.merge else (lambda p: p.data)

        def tensors() -> Iterator[tuple[str, Tensor]]:
            for bucket in export_hf_buckets(engine.model, engine.args, self.role, bucket_bytes=1, tensor_of=tensor_of):
                yield from bucket

        if peft_config is not None:  # verl's checkpoint-engine path asks without arguments: base + adapters
            return verl_lora.AdapterWeights(tensors(), peft_config,
                                            lambda: verl_lora.adapter_tensors(engine, plan)), peft_config
        return tensors(), peft_config

    def _sync_plan(self) -> verl_lora.SyncPlan:
        """The adapter-only sync's rank and scaling (collective, once); refuses routed-expert
        adapters, which that sync cannot send."""
        if self._plan is None:
            self._plan = verl_lora.sync_plan(self.engine, self.platform.device())
        if self._plan.experts:
            raise VerlConfigError("model.lora.merge=False with adapters on routed experts: verl's adapter-only weight "
                                  "sync has no per-tensor PEFT form for them (peft stacks a layer's experts); set "
                                  "model.lora.merge=True (merged weights), or leave the routed experts out of "
                                  "model.lora.target_modules.")
        return self._plan

    def disable_adapter(self):
        """verl's reference policy on a LoRA actor (``no_lora_adapter``, ``ref_in_actor``): inside
        the context the adapters are off and the engine computes the frozen base."""
        if self.engine is None:
            raise McoreRLError("initialize() the mcore_rl engine before disabling its adapters.")
        return adapters_disabled(self.engine.model)


def check_context_parallel(cp: int, mtp: Any, args: Any = None) -> None:
    """Refuses what the engine cannot run at ``cp`` > 1 (naming both settings): MTP training
    (``model.mtp.enable_train``) and models with Gated DeltaNet layers (``args``: the model's
    ``ModelArgs``, when known); router replay is refused by the engine config itself."""
    if cp <= 1:
        return
    if mtp.enable and mtp.enable_train:
        raise VerlConfigError(f"model.mtp.enable_train=True with engine.context_parallel_size={cp}: mcore_rl trains "
                              "MTP layers without context parallelism only; set context_parallel_size=1 or "
                              "model.mtp.enable_train=False.")
    hybrid = getattr(args, "hybrid", None)
    if hybrid is not None and any(hybrid.linear_layers):
        raise VerlConfigError(f"engine.context_parallel_size={cp} with {args.arch.model_type}'s Gated DeltaNet layers "
                              "(layer_types 'linear_attention'): their recurrent state would cross context-parallel "
                              "ranks; set context_parallel_size=1 (packed rows, model.use_remove_padding=True, keep "
                              "long rows cheap).")


def _check_router_replay(engine: ModelEngine, mode: str) -> None:
    if mode == "disabled":
        return
    if engine.routing is None:
        raise VerlConfigError(f"engine.router_replay.mode={mode!r} needs an MoE model; "
                              f"{engine.args.arch.model_type} is dense. Set it to 'disabled'.")
    if engine.config.recompute_granularity and engine.layout.pp > 1:
        raise VerlConfigError(f"engine.router_replay.mode={mode!r} with activation recomputation and pp="
                              f"{engine.layout.pp}: a recomputed forward would replay another micro-batch's "
                              "routes. Set model.enable_gradient_checkpointing=False or pp=1.")


def _layout_sizes(layout: ParallelLayout) -> dict[str, int]:
    return {"tp": layout.tp, "pp": layout.pp, "vpp": layout.vpp if layout.vpp and layout.vpp > 1 else None,
            "ep": layout.ep, "cp": layout.cp}


def _join_parallel_state(layout: ParallelLayout, seed: int) -> None:
    """Sets up megatron's parallel groups for the first engine of a process; later engines (verl's
    actor and reference in one worker) reuse them and must ask for the same layout."""
    if not mpu.model_parallel_is_initialized():
        initialize_parallel_state(layout, seed=seed)
        return
    vpp = mpu.get_virtual_pipeline_model_parallel_world_size()
    have = {"tp": mpu.get_tensor_model_parallel_world_size(), "pp": mpu.get_pipeline_model_parallel_world_size(),
            "vpp": vpp if vpp and vpp > 1 else None, "ep": mpu.get_expert_model_parallel_world_size(), "cp": mpu.get_context_parallel_world_size()}
    if have != _layout_sizes(layout):
        raise VerlConfigError(f"this process already runs an mcore_rl engine at {have}; another engine asks for "
                              f"{_layout_sizes(layout)}. Engines sharing a process (actor and ref) need one layout: "
                              "give them the same engine parallel sizes.")


class _ModeCtx(BaseEngineCtx):
    """verl's train/eval context: the model's mode, offload per the engine's flags (verl's
    ``_context_switch``; see ``to``), and in train mode the gradients zeroed on exit (verl's
    ``zero_grad_on_exit``). Entering names the compute device ``ON_DEVICE``: verl's
    ``get_device_name()`` is 'cpu' on the CPU platform, which would read as an offload."""

    def __enter__(self):
        self.engine.mode = self.mode
        self._context_switch(ON_DEVICE)
        for chunk in self.engine.engine.model:
            chunk.train(self.mode == "train")

    def __exit__(self, exc_type, exc_value, traceback):
        if self.mode == "train" and (self.zero_grad_on_exit or exc_type is not None) \
                and self.engine.engine.optimizer is not None:
            self.engine.optimizer_zero_grad()
        super().__exit__(exc_type, exc_value, traceback)


class McoreRLEngineWithLMHead(McoreRLEngine):
    """The policy (and reference): ``model_output`` = ``log_probs`` (+ ``entropy`` when the batch
    asks ``calculate_entropy``), jagged like ``input_ids``: position t scores token t + 1."""

    role: Role = "actor"

    def _model_output(self, output: Tensor, inp: MicroBatch, mb: TensorDict, forward_only: bool) -> dict[str, Tensor]:
        entropy = bool(tu.get_non_tensor_data(mb, key="calculate_entropy", default=False))
        return verl_batches.lm_outputs(output, inp, mb, self.engine.args.vocab_size, entropy, forward_only)


class McoreRLEngineWithValueHead(McoreRLEngine):
    """The value model: ``model_output`` = ``values``, jagged like ``input_ids``."""

    role: Role = "critic"

    def _model_output(self, output: Tensor, inp: MicroBatch, mb: TensorDict, forward_only: bool) -> dict[str, Tensor]:
        return verl_batches.value_outputs(output, inp, mb)
