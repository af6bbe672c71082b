"""Bodies that tests run inside N-rank worlds (tests/dist.py): build, load, step, export."""
from __future__ import annotations

import torch

from mcore_rl.rl.engine import gather_dp, share_from_last_stage
from tests.tiny import padded_batch


# parity/invariance MoE settings: fp64 router logits so that top-k ties cannot flip between
# layouts, no load-balancing loss so the loss is the same function everywhere
EXACT_MOE = dict(router_dtype="fp64", load_balancing="none", aux_loss_coeff=0.0)


GLOBAL_MICRO_BATCHES = 4  # a single rank runs all; with PP=2 and DP=1 the schedules reach steady state


def global_micro_batches(vocab_size: int) -> list[dict]:
    """The step's micro-batches over all DP ranks (each different data)."""
    return [padded_batch(vocab_size, seed=s) for s in range(1, GLOBAL_MICRO_BATCHES + 1)]


def dp_slice(micro_batches: list) -> list:
    """This DP rank's contiguous share. Megatron divides each micro-batch loss by the local count
    and DDP averages over DP, so DP ranks x local micro-batches give the single rank's 1/global
    scale exactly; a missing DP reduction leaves each rank with only its own share of the grad."""
    from megatron.core import parallel_state

    rank = parallel_state.get_data_parallel_rank()
    size = parallel_state.get_data_parallel_world_size()
    if len(micro_batches) % size != 0:
        raise ValueError(f"{len(micro_batches)} micro-batches do not split over DP={size}")
    per_rank = len(micro_batches) // size
    return micro_batches[rank * per_rank : (rank + 1) * per_rank]


def _build(hf_dir: str, layout_kwargs: dict, role: str, recompute=None, moe: dict | None = None):
    from mcore_rl.models.builder import BuildOptions, build_model
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import load_hf
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    options = BuildOptions(recompute=recompute, moe=MoEOptions(**{**EXACT_MOE, **(moe or {})}))
    chunks = build_model(args, layout, role, active_platform(), options)
    load_hf(chunks, args, role, hf_dir)
    return args, chunks


def _output_loss(role: str, vocab_size: int):
    """A loss touching every output: logits (all of the real vocab) or values, with fixed weights."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def loss_fn(batch: dict, out: torch.Tensor):
        if role == "actor":
            out = gather_from_tensor_model_parallel_region(out)[..., :vocab_size]
        g = torch.Generator().manual_seed(int(batch["input_ids"].sum()))
        weights = torch.randn(out.shape, generator=g) / out.shape[-1] ** 0.5
        mask = batch["attention_mask"].unsqueeze(-1).to(out.dtype)
        loss = (out * weights * mask).sum() / mask.sum()
        return loss, {"output": out.detach()}

    return loss_fn


def forward_outputs(
    hf_dir: str, layout_kwargs: dict, role: str, batch: dict, moe: dict | None = None, chunks=None
) -> torch.Tensor:
    """Forward only: [b, s, vocab] logits (actor) or [b, s, 1] values (critic) on every rank.
    ``chunks``: an already built (args, chunks) pair to use instead of building one."""
    from mcore_rl.models.forward import run_schedule

    args, chunks = chunks or _build(hf_dir, layout_kwargs, role, moe=moe)
    for c in chunks:
        c.eval()
    res = run_schedule(chunks, [batch], _output_loss(role, args.vocab_size), forward_only=True)
    return share_from_last_stage(res[0]["output"] if res else None)


def roundtrip_mismatch(chunks, args, role: str, hf_dir: str) -> list[str]:
    """HF names whose tensor exported from ``chunks`` (TP/EP-gathered) is not bit-equal to the
    file's, or that exist on one side only."""
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from mcore_rl.models.hf_weights import export_hf

    source, exported = SafetensorsReader(hf_dir), export_hf(chunks, args, role)
    return sorted(
        k for k in set(source) | set(exported)
        if k not in exported or k not in source or not torch.equal(exported[k], source[k])
    )


def outputs_and_roundtrip(hf_dir: str, layout_kwargs: dict, batch: dict) -> dict:
    """Actor logits [b, s, vocab] of one forward on every rank, and the HF round trip."""
    args, chunks = _build(hf_dir, layout_kwargs, "actor")
    mismatch = roundtrip_mismatch(chunks, args, "actor", hf_dir)
    return {"logits": forward_outputs(hf_dir, layout_kwargs, "actor", batch, chunks=(args, chunks)),
            "roundtrip_mismatch": mismatch}


def outputs_of_models(dirs: dict, layout_kwargs: dict, role: str, batch: dict) -> dict:
    """forward_outputs for several HF directories in one world (saves a process per model)."""
    from megatron.core import parallel_state

    out = {}
    for name, d in dirs.items():
        out[name] = forward_outputs(d, layout_kwargs, role, batch)
        parallel_state.destroy_model_parallel()
    return out


def train_step(
    hf_dir: str, layout_kwargs: dict, role: str = "actor", recompute=None, moe: dict | None = None
) -> dict:
    """Load HF weights, check the HF round trip, one forward/backward over this DP rank's share
    of GLOBAL_MICRO_BATCHES (different data on each DP rank), megatron's finalize_model_grads;
    returns the outputs of all micro-batches (gathered over DP, [n, b, s, V]) and HF-named full
    gradients (TP/EP-gathered)."""
    from megatron.core.distributed import finalize_model_grads

    from mcore_rl.models.ddp import wrap_with_ddp
    from mcore_rl.models.forward import run_schedule
    from mcore_rl.models.hf_weights import export_hf

    args, chunks = _build(hf_dir, layout_kwargs, role, recompute=recompute, moe=moe)
    mismatch = roundtrip_mismatch(chunks, args, role, hf_dir)
    # all-reduce (not the distributed optimizer's reduce-scatter): every rank then holds the full
    # DP-reduced gradient, which is what the comparison reads
    model = wrap_with_ddp(chunks, use_distributed_optimizer=False)
    for m in model:
        m.zero_grad_buffer()
    batches = dp_slice(global_micro_batches(args.vocab_size))
    res = run_schedule(model, batches, _output_loss(role, args.vocab_size), forward_only=False)
    finalize_model_grads(model)
    outputs = gather_dp(share_from_last_stage(torch.stack([r["output"] for r in res]) if res else None))
    # a frozen parameter (e.g. a frozen router) has no gradient buffer: report zeros
    grads = export_hf(model, args, role, tensor_of=lambda p: getattr(p, "main_grad", torch.zeros_like(p)))
    return {"outputs": outputs, "grads": grads, "roundtrip_mismatch": mismatch}
