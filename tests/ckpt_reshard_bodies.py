"""Bodies for the reshard tests (tests/test_ckpt_reshard.py), run inside N-rank worlds
(tests/dist.py): save a trained engine through CheckpointManager in one layout, then load it in
another and report model and optimizer state under HF names, the step counts, the warnings and
one more training step.

No dropout anywhere (hidden and attention), fp64 MoE router, no balancing loss and the
``global`` dispatch (every DP rank takes its own slice of one global batch): the next update is
then the same function in every layout, so its result can be compared with the saving layout's."""
from __future__ import annotations

import os
import warnings

import torch

from tests.ckpt_bodies import manager, opt_state_hf, optimizer_fingerprint, train
from tests.steps import EXACT_MOE
from tests.tiny import tiny_config, tiny_hf_model

SAVED_STEPS = 2  # updates before the save: Adam's exp_avg/exp_avg_sq are non-trivial
OPT_KEYS = ("param", "exp_avg", "exp_avg_sq")  # fp32 main params and Adam moments


def hf_dir(tmp: str, model_type: str, **config) -> str:
    """A tiny 2-layer HF model without dropout under ``tmp`` (made once, in the test process)."""
    path = os.path.join(tmp, f"hf_{model_type}" + "".join(f"_{k}" for k in sorted(config)))
    if not os.path.isdir(path):
        cfg = tiny_config(model_type, num_hidden_layers=2, attention_dropout=0.0, **config)
        tiny_hf_model(cfg).save_pretrained(path)
    return path


def build(hf: str, layout_kwargs: dict, seed: int):
    """A trainable fp32 actor engine (Adam, warmup 2 of 6 steps, linear decay) without dropout;
    one optimizer step per update (ppo_mini_batch_size = all rows)."""
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig
    from tests.ckpt_bodies import ROWS

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout, seed=seed)
    args = model_args_from_hf(hf)
    options = BuildOptions(params_dtype=torch.float32, hidden_dropout=0.0, moe=MoEOptions(**EXACT_MOE))
    optim = OptimConfig(lr=0.02, eps=1e-3, warmup_steps=2, total_steps=6, decay_style="linear")
    engine = ModelEngine(args, layout, "actor", active_platform(), options, optim, hf)
    return engine, Actor(engine, ActorConfig(micro_batch_size=2, ppo_mini_batch_size=ROWS))


def snapshot(engine) -> dict:
    """Full HF-named model params and optimizer state (``opt/<key>``), Adam step values and the
    scheduler's step count: the same on every rank."""
    from tests.ckpt_bodies import hf_params

    out = {"model": hf_params(engine)}
    for key in OPT_KEYS:
        out[f"opt/{key}"] = opt_state_hf(engine, key)
    states = [s for o in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
              for s in o.optimizer.state.values()]
    out["adam_steps"] = sorted({float(s["step"]) for s in states})
    out["adam_params"] = len(states)
    out["scheduler_steps"] = engine.scheduler.num_steps
    return out


def space_stats(engine) -> dict[str, int]:
    """Where model_space's mechanisms act on this rank (optimizer_space.param_pieces): params
    whose DP range is a part of the local shard (``cut``), boxes shorter than a row of their
    tensor (``partial_rows``), boxes of TP replicas this rank does not write (``tp_replicas``),
    params saved through a factory (``factories``: swiglu fc1), boxes of experts."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    from mcore_rl.checkpoint import optimizer_space as space
    from mcore_rl.checkpoint.state import model_state

    entries = space._model_entries(model_state(engine))
    stats = dict(cut=0, partial_rows=0, tp_replicas=0, factories=0, experts=0)
    for opt in space._distributed(engine.optimizer):
        for param, start, stop in space._ranges(opt):
            pieces = space.param_pieces(entries[id(param)], param, start, stop, 0, "")
            stats["cut"] += stop - start < param.numel()
            stats["partial_rows"] += sum(param.dim() > 1 and p.shape[-param.dim() + 1:] != tuple(param.shape[1:]) for p in pieces)
            stats["tp_replicas"] += sum(p.replica_id[1] != 0 for p in pieces)
            stats["factories"] += isinstance(entries[id(param)], ShardedTensorFactory)
            stats["experts"] += sum(".experts." in p.key for p in pieces)
    return stats


def tied_copy_gap(engine) -> float | None:
    """Tied embeddings with PP > 1: max |first stage's embedding - last stage's output copy|
    (the copy has its own optimizer state, skipped by the HF export); None otherwise."""
    from megatron.core import parallel_state as ps

    from mcore_rl.mapping.weights import unwrap

    if not engine.args.tie_embeddings or ps.get_pipeline_model_parallel_world_size() == 1:
        return None
    gap = None
    if ps.is_pipeline_first_stage():
        gap = unwrap(engine.model[0]).embedding.word_embeddings.weight.detach().clone()
    if ps.is_pipeline_last_stage():  # the embedding group: first and last stage
        gap = -unwrap(engine.model[-1]).output_layer.weight.detach().clone()
    torch.distributed.all_reduce(gap, group=ps.get_embedding_group())
    return float(gap.abs().max())


def _destroy() -> None:
    from mcore_rl.parallel.layout import destroy_parallel_state

    destroy_parallel_state()


def save_both(hf: str, layout_kwargs: dict, roots: dict[str, str]) -> dict:
    """SAVED_STEPS updates, a save per sharding type (``roots``: sharding -> root), then the
    reference: one more update in this layout. Returns the state at save and after the update."""
    engine, actor = build(hf, layout_kwargs, seed=1)
    train(actor, range(SAVED_STEPS))
    for sharding, root in roots.items():
        manager(root, optimizer_sharding=sharding).save(SAVED_STEPS, {"actor": engine}, {"step": SAVED_STEPS})
    out = {"at_save": snapshot(engine), "space": space_stats(engine)}
    out["next_metrics"] = train(actor, range(SAVED_STEPS, SAVED_STEPS + 1))[0]
    after = snapshot(engine)
    out.update(next_model=after["model"], next_adam_steps=after["adam_steps"])
    _destroy()
    return out


def save_worlds(jobs: list[tuple[str, dict, dict[str, str]]]) -> dict:
    """``save_both`` for several (hf_dir, layout, roots) in one world (one process start)."""
    return {i: save_both(hf, layout, roots) for i, (hf, layout, roots) in enumerate(jobs)}


def load_and_step(hf: str, layout_kwargs: dict, root: str) -> dict:
    """A fresh engine (other init seed) in this layout: resume from ``root``, report its state,
    the warnings, whether the RNG moved; then one update."""
    engine, actor = build(hf, layout_kwargs, seed=77)
    rng_before = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = manager(root).resume({"actor": engine})
    out = {"trainer_state": state, "warnings": [str(w.message) for w in caught],
           "rng_restored": not torch.equal(rng_before, torch.get_rng_state()),
           "loaded": snapshot(engine), "tied_gap_loaded": tied_copy_gap(engine),
           "local": optimizer_fingerprint(engine), "space": space_stats(engine)}
    out["next_metrics"] = train(actor, range(SAVED_STEPS, SAVED_STEPS + 1))[0]
    after = snapshot(engine)
    out.update(next_model=after["model"], next_adam_steps=after["adam_steps"], adam_params=after["adam_params"],
               tied_gap_next=tied_copy_gap(engine))
    return out


def refused(hf: str, layout_kwargs: dict, root: str) -> dict:
    """Resuming a dp_reshardable ``root`` in this layout: the error, and whether model and
    optimizer state stayed untouched."""
    from mcore_rl.errors import CheckpointError

    engine, actor = build(hf, layout_kwargs, seed=77)
    train(actor, range(5, 6))  # an optimizer state of its own, which must survive the refusal
    before = snapshot(engine)
    try:
        manager(root).resume({"actor": engine})
        message = "NO ERROR"
    except CheckpointError as e:
        message = str(e)
    after = snapshot(engine)
    untouched = all(torch.equal(before[part][k], after[part][k])
                    for part in ("model", *(f"opt/{k}" for k in OPT_KEYS)) for k in after[part])
    same_steps = (before["adam_steps"], before["scheduler_steps"]) == (after["adam_steps"], after["scheduler_steps"])
    return {"message": message, "untouched": untouched and same_steps}


def load_with_fix_reverted(hf: str, layout_kwargs: dict, root: str, fix: str) -> dict:
    """``load_and_step`` with the platform fix ``fix`` reverted (for the rest of this process):
    its result, or the error megatron raises."""
    from mcore_rl.platform.fixes import revert_fix

    revert_fix(fix)
    try:
        return load_and_step(hf, layout_kwargs, root)
    except Exception as e:  # the defect's own error
        return {"error": f"{type(e).__name__}: {e}"}


def load_worlds(jobs: list[tuple[str, str, dict, str]]) -> dict:
    """Per job (kind, hf_dir, layout, root) in one world; kind ``load``, ``refuse`` or
    ``revert:<fix name>`` (load with that platform fix reverted; put those last). Each job builds
    its own parallel state."""
    out = {}
    for i, (kind, hf, layout, root) in enumerate(jobs):
        if kind.startswith("revert:"):
            out[i] = load_with_fix_reverted(hf, layout, root, kind.removeprefix("revert:"))
        else:
            out[i] = (load_and_step if kind == "load" else refused)(hf, layout, root)
        _destroy()
    return out
