"""verl's optimizer config (``optim=megatron``: ``McoreOptimizerConfig``) -> mcore_rl's ``OptimConfig``,
key by key with the meaning verl's Megatron engine gives it (``verl/utils/megatron/optimizer.py``,
verl 0.9.1), or refused with an error naming the key.

The LR schedule is megatron's ``OptimizerParamScheduler`` built as verl builds it: decay over
``lr_decay_steps`` (else ``total_training_steps``); warmup ``lr_warmup_steps`` when > 0, else
``int(lr_warmup_steps_ratio * decay steps)``; warmup from ``lr_warmup_init``; WSD annealing over
``lr_wsd_decay_steps`` in ``lr_wsd_decay_style``. On a checkpoint load the schedule's values come
from the config (``use_checkpoint_opt_param_scheduler=False``, verl's default) or the checkpoint.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

from mcore_rl.integrations.verl.engine_config import VerlConfigError
from mcore_rl.rl.engine import OptimConfig

log = logging.getLogger("mcore_rl.integrations.verl")

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")
WD_INCR_STYLES = ("constant", "linear", "cosine")  # verl passes start = end weight decay: no effect
# megatron OptimizerConfig keys override_optimizer_config may set: same meaning in mcore_rl
OVERRIDABLE = {"adam_beta1", "adam_beta2", "adam_eps"}
# keys that only act with a feature mcore_rl does not run: their default is accepted, another
# value refused (why: the feature)
INERT = {
    "use_precision_aware_optimizer": "megatron's precision-aware optimizer (TransformerEngine's FusedAdam)",
    "main_grads_dtype": "use_precision_aware_optimizer", "exp_avg_dtype": "use_precision_aware_optimizer",
    "exp_avg_sq_dtype": "use_precision_aware_optimizer",
    "use_layer_wise_distributed_optimizer": "optimizer=muon", "use_layer_wise_param_layout": "optimizer=muon",
    "muon_momentum": "optimizer=muon", "muon_nesterov": "optimizer=muon", "muon_split_qkv": "optimizer=muon",
    "muon_scale_mode": "optimizer=muon", "muon_coefficient_type": "optimizer=muon",
    "muon_num_ns_steps": "optimizer=muon", "muon_tp_mode": "optimizer=muon",
    "muon_fp32_matmul_prec": "optimizer=muon", "muon_extra_scale_factor": "optimizer=muon",
    "muon_scalar_optimizer": "optimizer=muon", "muon_match_adamw_update_rms": "optimizer=muon",
}


def _field_defaults(config) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(config):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def _refuse_inert(o) -> None:
    defaults = _field_defaults(o)
    for key, needs in INERT.items():
        value = getattr(o, key, defaults.get(key))
        if key in defaults and value != defaults[key]:
            raise VerlConfigError(f"optim.{key}={value!r}: it acts only with {needs}, which the mcore_rl engine does "
                                  f"not run; remove it (default {defaults[key]!r}).")


def _schedule(o, total: int) -> dict[str, Any]:
    """Warmup / decay steps and styles, by verl's rule (see the module doc)."""
    decay = o.lr_decay_steps if o.lr_decay_steps is not None else total
    if decay < 1:
        raise VerlConfigError(f"optim.lr_decay_steps={o.lr_decay_steps} (total_training_steps={total}): the "
                              "schedule needs at least one decay step.")
    warmup = o.lr_warmup_steps
    if o.lr_warmup_steps_ratio is not None and (warmup is None or warmup <= 0):
        warmup = int(o.lr_warmup_steps_ratio * decay)
    warmup = int(warmup or 0)
    if warmup >= decay:
        raise VerlConfigError(f"optim warmup of {warmup} steps (lr_warmup_steps={o.lr_warmup_steps}, "
                              f"lr_warmup_steps_ratio={o.lr_warmup_steps_ratio}) is not shorter than the {decay} "
                              f"decay steps (lr_decay_steps={o.lr_decay_steps}, total_training_steps={total}); "
                              "shorten the warmup.")
    style = o.lr_decay_style
    if style not in DECAY_STYLES:
        hint = " (megatron spells it 'inverse-square-root')" if style == "inverse_square_root" else ""
        raise VerlConfigError(f"optim.lr_decay_style={style!r}{hint}; choose one of {list(DECAY_STYLES)}.")
    wsd_steps = o.lr_wsd_decay_steps
    if style == "WSD" and not wsd_steps:
        raise VerlConfigError(f"optim.lr_decay_style='WSD' needs optim.lr_wsd_decay_steps (the annealing steps), "
                              f"got {wsd_steps}.")
    if o.lr_wsd_decay_style not in WSD_STYLES:
        raise VerlConfigError(f"optim.lr_wsd_decay_style={o.lr_wsd_decay_style!r}; choose one of {list(WSD_STYLES)}.")
    if o.weight_decay_incr_style not in WD_INCR_STYLES:
        raise VerlConfigError(f"optim.weight_decay_incr_style={o.weight_decay_incr_style!r}; choose one of "
                              f"{list(WD_INCR_STYLES)}.")
    return dict(warmup_steps=warmup, total_steps=int(decay), decay_style=style, wsd_decay_steps=wsd_steps,
                wsd_decay_style=o.lr_wsd_decay_style)


def _adam_overrides(o) -> dict[str, Any]:
    """``override_optimizer_config``: megatron OptimizerConfig keys verl applies last; Adam's
    betas and eps are honoured, anything else refused."""
    override = dict(o.override_optimizer_config or {})
    unknown = sorted(set(override) - OVERRIDABLE)
    if unknown:
        raise VerlConfigError(f"optim.override_optimizer_config sets {unknown}: the mcore_rl engine builds its own "
                              f"megatron optimizer config and honours only {sorted(OVERRIDABLE)} there; remove the "
                              "others.")
    betas = (float(override.get("adam_beta1", o.betas[0])), float(override.get("adam_beta2", o.betas[1])))
    return {"betas": betas, **({"eps": float(override["adam_eps"])} if "adam_eps" in override else {})}


def optim_config(optimizer_config, use_distributed_optimizer: bool) -> OptimConfig:
    """verl's ``McoreOptimizerConfig`` -> mcore_rl's ``OptimConfig``. ``betas`` are Adam's betas
    (verl's Megatron path leaves megatron's 0.9 / 0.999 whatever they say: a difference only when
    they are set to something else)."""
    from verl.workers.config import McoreOptimizerConfig

    o = optimizer_config
    if not isinstance(o, McoreOptimizerConfig):
        raise VerlConfigError(f"the mcore_rl engine reads verl's McoreOptimizerConfig (optim=megatron), got "
                              f"{type(o).__name__}; select optim=megatron.")
    total = int(o.total_training_steps)
    if total < 1:
        raise VerlConfigError(f"optim.total_training_steps={total}: the LR schedule needs the step count before "
                              "initialize(). verl's main_ppo and one-step-off trainers set it; fully-async builds its "
                              "workers before it knows it: set actor_rollout_ref.actor.optim.total_training_steps "
                              "(and critic.optim.total_training_steps) to the run's trainer steps.")
    name = str(o.optimizer).lower()
    if name not in ("adam", "adamw", "sgd"):
        raise VerlConfigError(f"optim.optimizer={o.optimizer!r}; the mcore_rl engine runs adam (AdamW) and sgd.")
    _refuse_inert(o)
    return OptimConfig(
        name="sgd" if name == "sgd" else "adam", lr=float(o.lr), min_lr=float(o.min_lr),
        warmup_init_lr=float(o.lr_warmup_init), weight_decay=float(o.weight_decay), clip_grad=float(o.clip_grad),
        use_distributed_optimizer=use_distributed_optimizer and name != "sgd",
        **_schedule(o, total), **_adam_overrides(o))


# the scheduler values a checkpoint carries besides its step count (megatron's state_dict)
SCHEDULE_KEYS = ("max_lr", "min_lr", "lr_warmup_steps", "lr_decay_steps", "lr_decay_style", "start_wd", "end_wd",
                 "wd_incr_style", "wd_incr_steps")


def config_schedule_after_load(scheduler, configured: dict[str, Any]) -> list[str]:
    """verl's default ``use_checkpoint_opt_param_scheduler=False``: after a load took the
    checkpoint's schedule, the config's values (``configured``: the scheduler's ``state_dict()``
    before the load) replace it, the loaded step count stays. Returns the keys that changed."""
    loaded = scheduler.state_dict()
    changed = [k for k in SCHEDULE_KEYS if k in configured and loaded.get(k) != configured[k]]
    for key in SCHEDULE_KEYS:
        if key in configured:
            setattr(scheduler, key, configured[key])
    scheduler.step(0)  # the learning rate and weight decay of the loaded step under the config's schedule
    return changed
