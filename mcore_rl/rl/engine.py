"""ModelEngine: one model's chunks, DDP, optimizer and LR scheduler, and the schedule runner
that actor and critic share. Micro-batches are moved to the platform's device; results computed
on the last pipeline stage are shared with every rank of the pipeline group as tensor
broadcasts (a small integer header describes names, dtypes and shapes: no pickling)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Literal, Mapping

import torch
from megatron.core import parallel_state
from megatron.core.distributed import finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

from mcore_rl.fileio.base_identity import hf_dir_identity, no_base_identity, tensors_identity
from mcore_rl.mapping.hf_io import SafetensorsReader
from mcore_rl.models.builder import BuildOptions, Role, build_model
from mcore_rl.models.ddp import wrap_with_ddp
from mcore_rl.lora.layers import lora_modules
from mcore_rl.models.forward import LossFn, run_schedule
from mcore_rl.models.micro_batch import MicroBatch, as_micro_batch
from mcore_rl.models.hf_config import ModelArgs
from mcore_rl.models.hf_weights import load_hf
from mcore_rl.models.routing import EngineRouting
from mcore_rl.parallel.layout import ParallelLayout
from mcore_rl.platform import Platform, active_platform
from mcore_rl.rl.batch import BatchError
from mcore_rl.models.hf_config import ConfigError

Tensor = torch.Tensor


DecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
WSDDecayStyle = Literal["linear", "cosine", "exponential", "minus_sqrt"]


@dataclass(frozen=True)
class OptimConfig:
    """Adam (or SGD) with megatron's DistributedOptimizer, grad clipping and an LR schedule
    (megatron's OptimizerParamScheduler): linear warmup from ``warmup_init_lr`` to ``lr`` over
    ``warmup_steps``, then ``decay_style`` down to ``min_lr`` at ``total_steps``; ``WSD`` holds
    ``lr`` and anneals over the last ``wsd_decay_steps`` in ``wsd_decay_style``."""

    name: Literal["adam", "sgd"] = "adam"
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    clip_grad: float = 1.0
    warmup_steps: int = 0
    warmup_init_lr: float = 0.0
    total_steps: int = 1000
    decay_style: DecayStyle = "constant"
    wsd_decay_steps: int | None = None
    wsd_decay_style: WSDDecayStyle = "exponential"
    use_distributed_optimizer: bool = True

    def __post_init__(self) -> None:
        if self.name == "sgd" and self.use_distributed_optimizer:
            raise ConfigError(
                "name='sgd' needs use_distributed_optimizer=False (megatron's DistributedOptimizer "
                "supports Adam only)."
            )
        if not 0.0 <= self.min_lr <= self.lr or not 0.0 <= self.warmup_init_lr <= self.lr:
            raise ConfigError(f"min_lr={self.min_lr} and warmup_init_lr={self.warmup_init_lr} must lie in "
                              f"[0, lr={self.lr}].")
        if self.decay_style == "WSD" and not self.wsd_decay_steps:
            raise ConfigError(f"decay_style='WSD' needs wsd_decay_steps (the annealing steps at the end), got "
                              f"{self.wsd_decay_steps}.")


def build_scheduler(optimizer, optim: OptimConfig) -> OptimizerParamScheduler:
    """megatron's OptimizerParamScheduler for ``optim`` on a megatron optimizer (anything with
    ``param_groups``); constant weight decay. Sets the step-0 learning rate."""
    return OptimizerParamScheduler(
        optimizer,
        init_lr=optim.warmup_init_lr,
        max_lr=optim.lr,
        min_lr=optim.min_lr,
        lr_warmup_steps=optim.warmup_steps,
        lr_decay_steps=max(optim.total_steps, optim.warmup_steps + 1),
        lr_decay_style=optim.decay_style,
        start_wd=optim.weight_decay,
        end_wd=optim.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
        wsd_decay_steps=optim.wsd_decay_steps,
        lr_wsd_decay_style=optim.wsd_decay_style,
    )


class ModelEngine:
    """Chunks of one model on this rank; trainable when ``optim`` is given, frozen otherwise."""

    def __init__(
        self,
        args: ModelArgs,
        layout: ParallelLayout,
        role: Role,
        platform: Platform,
        options: BuildOptions = BuildOptions(),
        optim: OptimConfig | None = None,
        hf_weights: str | Mapping[str, Tensor] | None = None,
        init_value_head: bool = False,
    ) -> None:
        """``hf_weights``: a HF directory (or HF name -> tensor) loaded before the optimizer
        copies the parameters. ``init_value_head=True`` (critic only) starts a critic from a
        causal LM: the trunk is loaded, ``lm_head`` ignored, the value head keeps its init.

        With LoRA (``options.lora``), ``base`` records what the frozen base weights came from
        (``fileio.base_identity``; a model directory loaded later replaces it): adapter-only
        checkpoints record it and a resume checks it."""
        self.args, self.layout, self.role, self.platform = args, layout, role, platform
        self.lora_config = options.lora
        # run before an offload/onload moves the state (a checkpoint manager waits for its write)
        self.before_state_moves: list[Callable[[], None]] = []
        chunks = build_model(args, layout, role, platform, options)
        if hf_weights is not None:
            load_hf(chunks, args, role, hf_weights, init_value_head=init_value_head)
        self.base = base_identity_of(hf_weights) if options.lora.enabled else None
        self.config = chunks[0].config
        self.routing = (  # MoE routing record / replay, scoped to this engine
            EngineRouting(chunks, args.moe.moe_layers, args.moe.top_k, args.moe.num_experts,
                          layout.sequence_parallel)
            if args.moe else None
        )
        self.optimizer = self.scheduler = None
        if optim is None:
            for c in chunks:
                c.eval().requires_grad_(False)
            self.model = chunks
            return
        _check_trainable(chunks, role, options)
        self.model = wrap_with_ddp(chunks, optim.use_distributed_optimizer)
        self.optimizer = get_megatron_optimizer(_megatron_optim_config(optim, options), self.model)
        self.scheduler = build_scheduler(self.optimizer, optim)

    @torch.no_grad()
    def load_hf_weights(self, source: str | Mapping[str, Tensor], init_value_head: bool = False) -> None:
        """Loads HF weights into a built engine and refreshes the optimizer's copies.

        The one path for weights that arrive after the optimizer exists: megatron's optimizer
        keeps fp32 main copies (bf16) that would otherwise write the old weights back at the
        next step.
        """
        load_hf(self.model, self.args, self.role, source, init_value_head=init_value_head)
        if self.lora_config.enabled:
            self.base = base_identity_of(source)
        self.refresh_optimizer_params()

    @property
    def has_adapters(self) -> bool:
        """True for a LoRA engine (adapters on a frozen base)."""
        return any(True for _ in lora_modules(self.model))

    def refresh_optimizer_params(self) -> None:
        """Re-copies the model parameters into the optimizer's main (fp32) parameters; call after
        any in-place change of the weights that the optimizer did not make."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()

    # ---- schedule ------------------------------------------------------------------------
    def check_micro_batches(self, count: int) -> None:
        """Megatron's interleaved schedule needs a multiple of PP micro-batches (>= PP)."""
        pp, vpp = self.layout.pp, self.layout.vpp
        if vpp and (count < pp or count % pp != 0):
            raise BatchError(
                f"{count} micro-batches with pp({pp}) and vpp({vpp}): the interleaved schedule "
                f"needs a multiple of {pp}; change the micro-batch size or the batch."
            )

    @property
    def seq_multiple(self) -> int:
        """What padded sequence lengths must divide by: TP when sequence parallel is on, times
        2 * CP with context parallelism (each CP rank holds two chunks of s / (2 * cp))."""
        tp = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
        cp = self.config.context_parallel_size
        return tp * (2 * cp if cp > 1 else 1)

    @property
    def experts_span_dp(self) -> bool:
        """MoE layers whose expert group (ETP x EP) reaches past the TP group run collectives
        with other DP ranks in every forward: those ranks must run equally many micro-batches."""
        c = self.config
        if not c.num_moe_experts:
            return False
        etp = c.expert_tensor_parallel_size or c.tensor_model_parallel_size
        return c.expert_model_parallel_size * etp > c.tensor_model_parallel_size

    @property
    def needs_equal_tokens_over_dp(self) -> bool:
        """The allgather dispatcher gathers equal-sized token blocks over the expert group, so
        coupled DP ranks must also give their micro-batches one shape."""
        return self.experts_span_dp and self.config.moe_token_dispatcher_type == "allgather"

    def run(self, micro_batches: list[MicroBatch | dict], loss_fn: LossFn, forward_only: bool) -> list[dict]:
        """Forward (and backward) through megatron's schedule on the platform's device;
        loss_fn's results (dicts of tensors) from the last stage, on every rank of the
        pipeline group (in micro-batch order)."""
        self.check_micro_batches(len(micro_batches))
        device = self.platform.device()
        micro_batches = [as_micro_batch(mb).to(device) for mb in micro_batches]
        if not forward_only:
            for m in self.model:
                # after a step megatron's non-distributed optimizers leave param.grad aliasing
                # main_grad; a backward into that alias would count the gradient twice
                for p in m.parameters():
                    p.grad = None
                m.zero_grad_buffer()
        res = run_schedule(self.model, micro_batches, loss_fn, forward_only, self.routing)
        return share_from_last_stage(res if res else None)

    def step(self) -> dict[str, float]:
        """Reduce grads (DP, SP norms, tied embeddings), clip, Adam step, advance the LR."""
        finalize_model_grads(self.model)
        ok, grad_norm, _ = self.optimizer.step()
        lr = self.optimizer.param_groups[0]["lr"]
        if ok:  # as Megatron-LM: a skipped step (fp16 overflow) does not advance the schedule
            self.scheduler.step(increment=1)
        return {"grad_norm": float(grad_norm or 0.0), "lr": float(lr), "update_ok": float(ok)}

    def train(self, mode: bool = True) -> None:
        for m in self.model:
            m.train(mode)


def _check_trainable(chunks: list[torch.nn.Module], role: Role, options: BuildOptions) -> None:
    """A trainable engine needs a trainable parameter on this rank (megatron's optimizer would
    be empty and its first step fail far from the cause)."""
    if any(p.requires_grad for c in chunks for p in c.parameters()):
        return
    lora = options.lora
    where = (f"lora.adapter_path={lora.adapter_path!r} adapts" if lora.adapter_path
             else f"lora.target_modules={list(lora.target_modules)} match")
    raise ConfigError(f"the {role} engine has no trainable parameter on this rank: {where} no linear of the "
                      "layers it holds (with pipeline parallelism every stage needs an adapted layer); target "
                      "more linears, lower pp, or build it without an optimizer (frozen).")


def base_identity_of(source: str | os.PathLike | Mapping[str, Tensor] | None) -> dict:
    """The identity (``fileio.base_identity``) of HF weights ``source``: a directory (or a reader
    of one), in-memory tensors, or None (nothing loaded: the random init)."""
    if source is None:
        return no_base_identity()
    if isinstance(source, SafetensorsReader):
        return hf_dir_identity(source.directory)
    if isinstance(source, (str, os.PathLike)):
        return hf_dir_identity(source)
    return tensors_identity(source)


def _megatron_optim_config(optim: OptimConfig, options: BuildOptions) -> OptimizerConfig:
    dtype = options.params_dtype
    return OptimizerConfig(
        optimizer=optim.name,
        sgd_momentum=0.0,
        lr=optim.lr,
        min_lr=optim.min_lr,
        weight_decay=optim.weight_decay,
        adam_beta1=optim.betas[0],
        adam_beta2=optim.betas[1],
        adam_eps=optim.eps,
        clip_grad=optim.clip_grad,
        use_distributed_optimizer=optim.use_distributed_optimizer,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
    )


_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool)


def share_from_last_stage(obj):
    """The last pipeline stage's results on every PP rank, sent as tensors (no pickling).

    ``obj``: a tensor, or a list of dicts of tensors with the same keys and shapes (one per
    micro-batch, as the schedule returns them); the other stages pass None. Returns the same
    structure on every stage, on the platform's device.
    """
    group = parallel_state.get_pipeline_model_parallel_group()
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return obj
    last = torch.distributed.get_global_rank(group, size - 1)
    is_last = parallel_state.get_pipeline_model_parallel_rank() == size - 1
    device = active_platform().device()
    named = _flatten(obj) if is_last else {}
    header = _encode_header(obj, named, device) if is_last else None
    length = torch.tensor([header.numel() if is_last else 0], dtype=torch.int64, device=device)
    torch.distributed.broadcast(length, src=last, group=group)
    if not is_last:
        header = torch.empty(int(length.item()), dtype=torch.int64, device=device)
    torch.distributed.broadcast(header, src=last, group=group)
    kind, specs = _decode_header(header)
    out = {}
    for name, dtype, shape in specs:
        wire = torch.uint8 if dtype == torch.bool else dtype  # gloo has no bool broadcast
        t = named[name].to(wire).contiguous() if is_last else torch.empty(shape, dtype=wire, device=device)
        torch.distributed.broadcast(t, src=last, group=group)
        out[name] = t.to(dtype)
    return _unflatten(kind, out)


def _flatten(obj) -> dict[str, Tensor]:
    if isinstance(obj, Tensor):
        return {"": obj}
    return {k: torch.stack([mb[k] for mb in obj]) for k in obj[0]}


def _unflatten(kind: int, named: dict[str, Tensor]):
    if kind == 0:
        return named[""]
    count = next(iter(named.values())).shape[0]
    return [{k: v[i] for k, v in named.items()} for i in range(count)]


def _encode_header(obj, named: dict[str, Tensor], device) -> Tensor:
    """[kind, n, then per tensor: name length, name bytes, dtype code, ndim, shape]."""
    values = [0 if isinstance(obj, Tensor) else 1, len(named)]
    for name, t in named.items():
        raw = list(name.encode())
        values += [len(raw), *raw, _DTYPES.index(t.dtype), t.dim(), *t.shape]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _decode_header(header: Tensor) -> tuple[int, list]:
    values = header.tolist()
    kind, count, pos, specs = values[0], values[1], 2, []
    for _ in range(count):
        n = values[pos]
        name = bytes(values[pos + 1 : pos + 1 + n]).decode()
        pos += 1 + n
        dtype, ndim = _DTYPES[values[pos]], values[pos + 1]
        specs.append((name, dtype, tuple(values[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return kind, specs


def dp_rank_size() -> tuple[int, int]:
    return (
        parallel_state.get_data_parallel_rank(),
        parallel_state.get_data_parallel_world_size(),
    )


def gather_dp(tensor: Tensor) -> Tensor:
    """Concatenates each DP rank's [rows, ...] piece in rank order (same shapes everywhere)."""
    rank, size = dp_rank_size()
    if size == 1:
        return tensor
    parts = [torch.empty_like(tensor) for _ in range(size)]  # same device as the tensor
    torch.distributed.all_gather(parts, tensor.contiguous(), group=parallel_state.get_data_parallel_group())
    return torch.cat(parts)


def all_reduce_dp(value: Tensor, op=torch.distributed.ReduceOp.SUM) -> Tensor:
    value = value.clone()
    if dp_rank_size()[1] > 1:
        torch.distributed.all_reduce(value, op=op, group=parallel_state.get_data_parallel_group())
    return value

