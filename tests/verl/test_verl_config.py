"""verl configs read by the mcore_rl engine, no processes: the optimizer's LR schedule equals what
verl's Megatron path builds (verl's own ``get_megatron_optimizer_param_scheduler`` on a stand-in
optimizer), refused optimizer keys, the schedule after a checkpoint load, router replay in the
engine group, verl's LoRA keys (model.lora.* read, FSDP-only keys refused), and a verl Megatron
script's overrides composed with ``model_engine=mcore_rl``."""
from __future__ import annotations

import contextlib
import dataclasses

import pytest

pytest.importorskip("verl")

from tests.verl.verl_fixtures import save_tiny_model  # noqa: E402

SEARCH_PATH = "hydra.searchpath=[pkg://mcore_rl.integrations.verl.hydra]"


@contextlib.contextmanager
def config_error(*texts: str):
    """A VerlConfigError whose message contains each of ``texts``; Hydra's instantiate wraps errors raised
    while it builds a config (InstantiationException, the VerlConfigError as its cause)."""
    from hydra.errors import InstantiationException

    from mcore_rl.integrations.verl.config import VerlConfigError

    with pytest.raises((VerlConfigError, InstantiationException)) as raised:
        yield
    error = raised.value if isinstance(raised.value, VerlConfigError) else raised.value.__cause__
    assert isinstance(error, VerlConfigError), repr(raised.value)
    for text in texts:
        assert text in str(error), f"{text!r} not in {error}"


class _Groups:
    """What megatron's OptimizerParamScheduler touches of an optimizer: its param groups."""

    def __init__(self) -> None:
        self.param_groups = [{"lr": None, "weight_decay": None}]


def _sequence(scheduler, groups: _Groups, steps: int) -> list[tuple[float, float]]:
    """(lr, weight decay) at construction and after each of ``steps`` steps (verl's
    lr_scheduler_step is ``step(1)``)."""
    out = []
    for i in range(steps + 1):
        if i:
            scheduler.step(1)
        out.append((groups.param_groups[0]["lr"], groups.param_groups[0]["weight_decay"]))
    return out


def _ours(config):
    from mcore_rl.integrations.verl.verl_optim import optim_config
    from mcore_rl.rl.engine import build_scheduler

    groups = _Groups()
    return build_scheduler(groups, optim_config(config, use_distributed_optimizer=True)), groups


def _verls(config):
    from verl.utils.megatron.optimizer import get_megatron_optimizer_param_scheduler

    groups = _Groups()
    return get_megatron_optimizer_param_scheduler(groups, config), groups


SCHEDULES = {  # verl optim keys -> a schedule over total_training_steps=12
    "ratio_with_warmup_steps_0": dict(lr_warmup_steps=0, lr_warmup_steps_ratio=0.25, lr_decay_style="linear",
                                      min_lr=1e-5),
    "ratio_over_decay_steps": dict(lr_warmup_steps=-1, lr_warmup_steps_ratio=0.3, lr_decay_steps=8,
                                   lr_decay_style="cosine"),
    "explicit_steps_win_over_ratio": dict(lr_warmup_steps=3, lr_warmup_steps_ratio=0.5, lr_warmup_init=1e-4,
                                          lr_decay_style="constant"),
    "wsd_cosine": dict(lr_warmup_steps=2, lr_decay_style="WSD", lr_wsd_decay_steps=4, lr_wsd_decay_style="cosine",
                       min_lr=1e-4),
    "wsd_exponential": dict(lr_warmup_steps_ratio=0.2, lr_decay_style="WSD", lr_wsd_decay_steps=5, min_lr=1e-4),
    "inverse_square_root": dict(lr_warmup_steps=2, lr_decay_style="inverse-square-root", min_lr=1e-4),
    "weight_decay_incr_cosine": dict(lr_warmup_steps=1, weight_decay=0.1, weight_decay_incr_style="cosine"),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_lr_schedule_is_verls_megatron_schedule(name):
    from verl.workers.config import McoreOptimizerConfig

    config = McoreOptimizerConfig(lr=1e-3, total_training_steps=12, **SCHEDULES[name])
    ours, verls = _sequence(*_ours(config), 15), _sequence(*_verls(config), 15)
    assert ours == verls, f"{name}: ours {ours}\nverl's {verls}"
    assert len({lr for lr, _ in verls}) > 2, f"{name}: a schedule that does not move proves nothing"


REFUSED = {  # optim key=value -> the key the error must name
    "optimizer": ({"optimizer": "muon"}, "optim.optimizer"),
    "precision_aware": ({"use_precision_aware_optimizer": True}, "optim.use_precision_aware_optimizer"),
    "exp_avg_dtype": ({"exp_avg_dtype": "bf16"}, "optim.exp_avg_dtype"),
    "muon_momentum": ({"muon_momentum": 0.9}, "optim.muon_momentum"),
    "muon_layer_wise": ({"use_layer_wise_distributed_optimizer": True}, "optim.use_layer_wise_distributed_optimizer"),
    "override": ({"override_optimizer_config": {"decoupled_weight_decay": False}}, "optim.override_optimizer_config"),
    "underscore_isr": ({"lr_decay_style": "inverse_square_root"}, "optim.lr_decay_style"),
    "wsd_without_steps": ({"lr_decay_style": "WSD"}, "optim.lr_wsd_decay_steps"),
    "wsd_style": ({"lr_wsd_decay_style": "step"}, "optim.lr_wsd_decay_style"),
    "wd_incr_style": ({"weight_decay_incr_style": "step"}, "optim.weight_decay_incr_style"),
    "warmup_too_long": ({"lr_warmup_steps": 12}, "lr_warmup_steps=12"),
    # fully-async builds its workers before it knows the step count: the fix is named
    "no_step_count": ({"total_training_steps": -1}, "set actor_rollout_ref.actor.optim.total_training_steps"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_optimizer_keys_without_meaning_here_are_refused(name):
    from verl.workers.config import McoreOptimizerConfig

    from mcore_rl.integrations.verl.config import VerlConfigError
    from mcore_rl.integrations.verl.verl_optim import optim_config

    changes, key = REFUSED[name]
    with pytest.raises(VerlConfigError, match=key.replace(".", r"\.")):
        optim_config(McoreOptimizerConfig(**{"lr": 1e-3, "total_training_steps": 12, **changes}), True)


def test_adam_overrides_and_betas_reach_the_optimizer():
    from verl.workers.config import McoreOptimizerConfig

    from mcore_rl.integrations.verl.verl_optim import optim_config

    o = optim_config(McoreOptimizerConfig(lr=1e-3, total_training_steps=12, betas=(0.8, 0.99),
                                          override_optimizer_config={"adam_beta2": 0.95, "adam_eps": 1e-6}), True)
    assert (o.betas, o.eps) == ((0.8, 0.95), 1e-6)


@pytest.mark.parametrize("use_checkpoint", [False, True])
def test_schedule_after_a_checkpoint_load_is_verls(use_checkpoint):
    """mcore_rl's checkpoint load (the checkpoint's schedule) then, for verl's default, the
    config's schedule at the loaded step; against megatron's own load_state_dict with verl's flags."""
    from verl.workers.config import McoreOptimizerConfig

    from mcore_rl.checkpoint.state import load_scheduler
    from mcore_rl.integrations.verl.verl_optim import config_schedule_after_load

    saved_by, _ = _ours(McoreOptimizerConfig(lr=1e-3, total_training_steps=12, lr_warmup_steps=2))
    for _ in range(3):
        saved_by.step(1)
    saved = saved_by.state_dict()
    config = McoreOptimizerConfig(lr=2e-3, total_training_steps=20, lr_warmup_steps=5, lr_decay_style="cosine",
                                  use_checkpoint_opt_param_scheduler=use_checkpoint)
    ours, ours_groups = _ours(config)
    configured = ours.state_dict()
    with pytest.warns(UserWarning, match="using the checkpoint's value"):
        load_scheduler(ours, saved, "ckpt")
    if not use_checkpoint:
        config_schedule_after_load(ours, configured)
    verls, verls_groups = _verls(config)
    verls.load_state_dict(saved)
    assert verls.num_steps == ours.num_steps == 3
    assert _sequence(ours, ours_groups, 6) == _sequence(verls, verls_groups, 6)
    assert (verls.max_lr == 2e-3) != use_checkpoint  # the flag decides something here


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("cfg") / "model"))


def _compose(model_dir: str, *overrides: str, engine: str = "mcore_rl"):
    """verl's PPO config as ``python -m verl.trainer.main_ppo`` composes it."""
    from hydra import compose, initialize_config_module

    base = [f"actor_rollout_ref.model.path={model_dir}", f"critic.model.path={model_dir}",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
            "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=1", "critic.ppo_micro_batch_size_per_gpu=1"]
    engine_choice = [SEARCH_PATH, "model_engine=mcore_rl"] if engine == "mcore_rl" else ["model_engine=megatron"]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        return compose(config_name="ppo_trainer", overrides=[*engine_choice, *base, *overrides])


def _with(cfg, override: str):
    """A copy of a composed config with one command-line override applied as Hydra applies it
    ('+' adds a key; without it the key must exist), without composing again."""
    import copy

    import yaml
    from omegaconf import OmegaConf

    key, value = override.split("=", 1)
    cfg = copy.deepcopy(cfg)
    OmegaConf.update(cfg, key.lstrip("+"), yaml.safe_load(value), force_add=key.startswith("+"))
    return cfg


@pytest.fixture(scope="module")
def plain(model_dir):
    """verl's PPO config with model_engine=mcore_rl."""
    return _compose(model_dir)


@pytest.fixture(scope="module")
def script(model_dir):
    """verl's PPO config with model_engine=mcore_rl and the Megatron script's overrides below."""
    return _compose(model_dir, *SCRIPT)


def _ref_config(cfg):
    """ActorRolloutRefWorker's renames of the reference section (on a copy), then the dataclass."""
    import copy

    from omegaconf import open_dict
    from verl.utils.config import omega_conf_to_dataclass

    cfg = copy.deepcopy(cfg)
    ref = cfg.actor_rollout_ref.ref
    with open_dict(ref):
        for old, new in {"log_prob_micro_batch_size": "ppo_micro_batch_size",
                         "log_prob_use_dynamic_bsz": "use_dynamic_bsz",
                         "log_prob_micro_batch_size_per_gpu": "ppo_micro_batch_size_per_gpu",
                         "log_prob_max_token_len_per_gpu": "ppo_max_token_len_per_gpu"}.items():
            ref[new] = ref.pop(old)
        ref.ppo_mini_batch_size = cfg.actor_rollout_ref.actor.ppo_mini_batch_size
    return omega_conf_to_dataclass(ref)


def _engines(cfg) -> dict:
    """The engine configs verl's workers build: actor, reference, critic."""
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    validate_config(cfg, use_reference_policy=True, use_critic=True)  # main_ppo's first call
    return {"actor": omega_conf_to_dataclass(cfg.actor_rollout_ref.actor).engine, "ref": _ref_config(cfg).engine,
            "critic": omega_conf_to_dataclass(cfg.critic).engine}


def test_router_replay_is_a_structured_engine_key(model_dir):
    """``...mcore_rl.router_replay.mode=R2`` without '+' (it arrived as a dict with '+')."""
    from verl.workers.config import EngineRouterReplayConfig

    engines = _engines(_compose(model_dir, "actor_rollout_ref.actor.mcore_rl.router_replay.mode=R2",
                                "critic.mcore_rl.router_replay.mode=R3"))
    assert isinstance(engines["actor"].router_replay, EngineRouterReplayConfig)
    assert (engines["actor"].router_replay.mode, engines["critic"].router_replay.mode) == ("R2", "R3")


# verl's FSDP-engine LoRA keys away from their defaults: (override, the model.lora key named instead)
FSDP_LORA = [("actor_rollout_ref.model.lora_rank=8", "lora.rank"),
             ("actor_rollout_ref.model.lora_alpha=32", "lora.alpha"),
             ("actor_rollout_ref.model.target_modules=[q_proj]", "lora.target_modules"),
             ("actor_rollout_ref.model.lora_adapter_path=/adapters/a", "lora.adapter_path"),
             ("critic.model.lora_rank=4", "lora.rank")]


@pytest.mark.parametrize("override, instead", FSDP_LORA, ids=[o.split("=")[0].split(".", 1)[1] for o, _ in FSDP_LORA])
def test_fsdp_lora_keys_are_refused_naming_model_lora(plain, override, instead):
    key = override.split("=")[0]
    where = key.rsplit(".", 1)[0]
    with config_error(f"{key}=", "FSDP-engine LoRA key", f"{where}.{instead}"):
        _engines(_with(plain, override))


@pytest.mark.parametrize("override, message", [
    ("actor_rollout_ref.model.lora.type=dora", "actor_rollout_ref.model.lora.type='dora'"),
    ("actor_rollout_ref.model.lora.type=vlm_lora", "actor_rollout_ref.model.lora.type='vlm_lora'"),
    ("actor_rollout_ref.model.lora.target_modules=[q_proj]", "entry 'q_proj' names no linear"),
    ("critic.model.lora.dropout=1.5", "critic.model.lora.dropout=1.5"),
])
def test_model_lora_settings_mcore_rl_cannot_run_are_refused(plain, override, message):
    rank = "critic.model.lora.rank=4" if override.startswith("critic") else "actor_rollout_ref.model.lora.rank=8"
    with config_error(message):
        _engines(_with(_with(plain, rank), override))


def test_model_lora_passes_verls_validation(plain):
    """main_ppo's validate_config and the engine configs with model.lora.* set (actor and critic)."""
    cfg = _with(_with(_with(plain, "actor_rollout_ref.model.lora.rank=8"), "actor_rollout_ref.model.lora.merge=True"),
                "critic.model.lora.rank=4")
    assert set(_engines(cfg)) == {"actor", "ref", "critic"}


def test_model_lora_reaches_the_engine_with_fsdp_defaults_ignored(model_dir):
    """verl's model config as its workers build it (FSDP keys at their defaults, always
    present) with model.lora.* set: the engine's LoraConfig carries them; refusals come before
    any process group is touched (the SFT trainer's path too)."""
    from verl.workers.config import HFModelConfig

    from mcore_rl.integrations.verl.config import McoreRLEngineConfig, VerlConfigError
    from mcore_rl.integrations.verl.verl_lora import lora_config

    model = HFModelConfig(path=model_dir, lora={"rank": 8, "alpha": 16, "type": "canonical_lora", "merge": True,
                                                "target_modules": ["linear_q", "linear_fc2"], "dropout": 0.0})
    assert (model.lora_rank, model.lora_alpha, model.target_modules) == (0, 16, "all-linear")  # verl's defaults
    got = lora_config(model, "model", seed=7)
    assert (got.rank, got.alpha, got.type, got.merge, got.target_modules, got.seed) == (
        8, 16, "canonical_lora", True, ("linear_q", "linear_fc2"), 7)
    assert not lora_config(HFModelConfig(path=model_dir), "model").enabled
    from mcore_rl.integrations.verl.engine import McoreRLEngineWithLMHead

    for bad in (dict(lora_rank=16), dict(lora={"rank": 8, "type": "dora"}), dict(lora_adapter_path="/adapters/a")):
        with pytest.raises(VerlConfigError, match=r"model\.lora"):
            McoreRLEngineWithLMHead(HFModelConfig(path=model_dir, **bad), McoreRLEngineConfig(), None, None)


# A verl Megatron PPO script's overrides (keys of verl's examples/*/run_*megatron*.sh that verl
# 0.9.1's config has; sizes made small), as it runs with model_engine=megatron.
SCRIPT = [
    "algorithm.adv_estimator=gae", "data.max_prompt_length=1024", "data.max_response_length=512",
    "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
    "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
    "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.model.enable_gradient_checkpointing=True",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.virtual_pipeline_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.context_parallel_size=1",
    "actor_rollout_ref.actor.megatron.expert_model_parallel_size=2",
    "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
    "actor_rollout_ref.actor.megatron.param_offload=True", "actor_rollout_ref.actor.megatron.optimizer_offload=True",
    "actor_rollout_ref.actor.megatron.use_mbridge=True", "actor_rollout_ref.actor.megatron.seed=7",
    "actor_rollout_ref.actor.megatron.router_replay.mode=R2",
    "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_granularity=full",
    "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=uniform",
    "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers=2",
    "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
    "actor_rollout_ref.ref.megatron.context_parallel_size=1", "actor_rollout_ref.ref.megatron.param_offload=True",
    "critic.optim.lr=1e-5", "critic.model.enable_gradient_checkpointing=False",
    "critic.megatron.tensor_model_parallel_size=2", "critic.megatron.pipeline_model_parallel_size=2",
    "critic.megatron.use_distributed_optimizer=False", "critic.megatron.param_offload=True",
    "critic.megatron.optimizer_offload=True", "critic.megatron.dtype=bfloat16",
]


def test_verl_megatron_script_runs_on_mcore_rl(model_dir, script):
    """The same overrides under verl's own Megatron engine (they are verl's keys), then with
    model_engine=mcore_rl and the search path: the mcore_rl engine configs carry their values."""
    from verl.utils.config import omega_conf_to_dataclass

    verls = omega_conf_to_dataclass(_compose(model_dir, *SCRIPT, engine="megatron").actor_rollout_ref.actor)
    assert (verls.strategy, verls.engine.tensor_model_parallel_size) == ("megatron", 2)
    e = _engines(script)
    layout = lambda c: (c.tensor_model_parallel_size, c.pipeline_model_parallel_size,  # noqa: E731
                        c.virtual_pipeline_model_parallel_size, c.expert_model_parallel_size,
                        c.expert_tensor_parallel_size, c.context_parallel_size, c.sequence_parallel)
    assert layout(e["actor"]) == (2, 2, 2, 2, 1, 1, True)
    assert (e["actor"].param_offload, e["actor"].optimizer_offload, e["actor"].seed) == (True, True, 7)
    assert (e["actor"].router_replay.mode, e["actor"].recompute_granularity, e["actor"].recompute_num_layers) == \
        ("R2", "full", 2)
    assert (e["actor"].forward_only, e["actor"].dtype, e["actor"].use_distributed_optimizer) == \
        (False, "bfloat16", True)
    # the reference: forward only, the actor's layout and seed (one process holds both engines)
    assert layout(e["ref"]) == layout(e["actor"]) and e["ref"].forward_only and e["ref"].param_offload
    assert (e["ref"].seed, e["ref"].optimizer_offload) == (7, False)
    # a script that sets only the actor's keys: the reference follows them (as in verl's megatron_ref.yaml)
    ref = _ref_config(_compose(model_dir, *(o for o in SCRIPT if not o.startswith("actor_rollout_ref.ref.")))).engine
    assert layout(ref) == layout(e["actor"]) and ref.param_offload and ref.seed == 7
    assert layout(e["critic"]) == (2, 2, None, 1, None, 1, True)
    assert (e["critic"].param_offload, e["critic"].optimizer_offload, e["critic"].use_distributed_optimizer) == \
        (True, True, False)
    assert e["critic"].recompute_granularity is None and e["critic"].seed == 42


# Keys refused with the script above (one at a time), and the key each error names. Keys without
# meaning in mcore_rl: any value but verl's default; mapped keys: values mcore_rl cannot run.
REFUSED_KEYS = {
    "actor_rollout_ref.actor.megatron.vanilla_mbridge=True": "actor_rollout_ref.actor.megatron.vanilla_mbridge",
    "actor_rollout_ref.actor.megatron.use_mbridge=False": "actor_rollout_ref.actor.megatron.use_mbridge",
    "actor_rollout_ref.actor.megatron.use_megatron_fsdp=True": "actor_rollout_ref.actor.megatron.use_megatron_fsdp",
    "actor_rollout_ref.actor.megatron.use_dist_checkpointing=True":
        "actor_rollout_ref.actor.megatron.use_dist_checkpointing",
    "actor_rollout_ref.actor.megatron.dist_checkpointing_path=/ckpt/mcore":
        "actor_rollout_ref.actor.megatron.dist_checkpointing_path",
    "actor_rollout_ref.actor.megatron.distrib_optim_fully_reshardable_mem_efficient=True":
        "actor_rollout_ref.actor.megatron.distrib_optim_fully_reshardable_mem_efficient",
    "+actor_rollout_ref.actor.megatron.override_mcore_model_config.rotary_base=5":
        "actor_rollout_ref.actor.megatron.override_mcore_model_config.rotary_base",
    "actor_rollout_ref.actor.megatron.dynamic_context_parallel=True":
        "actor_rollout_ref.actor.megatron.dynamic_context_parallel",
    "actor_rollout_ref.actor.megatron.qat.enable=True": "actor_rollout_ref.actor.megatron.qat.enable",
    "actor_rollout_ref.actor.megatron.dtype=float16": "actor_rollout_ref.actor.megatron.dtype",
    "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend=fused":
        "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend",
    "+actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage=1":
        "actor_rollout_ref.actor.megatron.override_transformer_config.num_layers_in_first_pipeline_stage",
    "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method=block":
        "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_method",
    "+actor_rollout_ref.actor.megatron.override_ddp_config.grad_reduce_in_fp32=True":
        "actor_rollout_ref.actor.megatron.override_ddp_config.grad_reduce_in_fp32",
    "actor_rollout_ref.actor.megatron.pad_to_length=True": "actor_rollout_ref.actor.megatron.pad_to_length",
    "actor_rollout_ref.actor.megatron.entropy_from_logits_with_chunking=True":
        "actor_rollout_ref.actor.megatron.entropy_from_logits_with_chunking",
    # the script replays routes (router_replay.mode=R2): not with CP (both values named)
    "actor_rollout_ref.actor.megatron.context_parallel_size=2":
        "engine.router_replay.mode='R2' with engine.context_parallel_size=2",
    "actor_rollout_ref.ref.megatron.use_dist_checkpointing=True":
        "actor_rollout_ref.ref.megatron.use_dist_checkpointing",
    "critic.megatron.use_megatron_fsdp=True": "critic.megatron.use_megatron_fsdp",
    "critic.megatron.dtype=float16": "critic.megatron.dtype",
    # the same key under mcore_rl and megatron, two values: both named
    "actor_rollout_ref.actor.mcore_rl.tensor_model_parallel_size=4":
        "actor_rollout_ref.actor.mcore_rl.tensor_model_parallel_size=4 and "
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
}


@pytest.mark.parametrize("override", list(REFUSED_KEYS))
def test_megatron_keys_without_meaning_here_are_refused(script, override):
    with config_error(REFUSED_KEYS[override]):
        _engines(_with(script, override))


def test_fully_reshardable_optimizer_checkpoints_select_model_space(script):
    """verl's ``dist_ckpt_optim_fully_reshardable=True`` (resume at any layout) selects mcore_rl's
    gather-free any-layout format; the default stays dp_reshardable; a conflict with the
    mcore_rl key is an error naming both."""
    default = _engines(script)["actor"]
    assert default.optimizer_sharding == "dp_reshardable"
    chosen = _engines(_with(script, "actor_rollout_ref.actor.megatron.dist_ckpt_optim_fully_reshardable=True"))
    assert chosen["actor"].optimizer_sharding == "model_space"
    both = _with(_with(script, "actor_rollout_ref.actor.megatron.dist_ckpt_optim_fully_reshardable=True"),
                 "actor_rollout_ref.actor.mcore_rl.optimizer_sharding=fully_reshardable")
    with config_error("actor_rollout_ref.actor.megatron.dist_ckpt_optim_fully_reshardable"):
        _engines(both)


def test_every_megatron_key_is_classified():
    """Each field of verl's McoreEngineConfig and each key of its megatron.yaml is in exactly one
    of megatron_keys' tables (a key verl adds shows up here)."""
    from verl.workers.config import McoreEngineConfig

    from mcore_rl.integrations.verl import megatron_keys as M

    tables = [set(M.MAPPED), set(M.SET_BY_VERL), set(M.INERT), set(M.CONVERTED)]
    keys = {f.name for f in dataclasses.fields(McoreEngineConfig)} | set(M.verl_defaults())
    for key in keys:
        assert sum(key in t for t in tables) == 1, key
    assert set(M.verl_defaults()["override_transformer_config"]) - {"attention_backend"} == set(M.RECOMPUTE)


def test_a_batch_with_images_is_refused():
    """The engine runs a vision-language checkpoint's language model only: multimodal inputs
    in a verl micro-batch are refused naming them, before any model input is built."""
    import torch
    from tensordict import TensorDict

    from mcore_rl.integrations.verl.verl_batches import model_inputs
    from mcore_rl.rl.batch import BatchError

    ids = torch.nested.nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], layout=torch.jagged)
    mb = TensorDict({"input_ids": ids, "pixel_values": torch.zeros(2, 3)}, batch_size=[2])
    with pytest.raises(BatchError, match=r"multimodal inputs \['pixel_values'\]: the mcore_rl engine runs and trains "
                                         "the language model"):
        model_inputs([mb], None, packed=True)


def test_empty_multimodal_entries_of_a_text_batch_pass():
    """verl's agent loop adds ``multi_modal_inputs`` with an empty dict per row to text batches
    (main_ppo on a text dataset): those pass; a row with an image tensor in it is refused."""
    import numpy as np
    import torch
    from tensordict import NonTensorStack, TensorDict

    from mcore_rl.integrations.verl.verl_batches import _check_text_only
    from mcore_rl.rl.batch import BatchError

    ids = torch.nested.nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], layout=torch.jagged)
    for empty in (NonTensorStack({}, {}), np.array([{}, {}], dtype=object)):
        _check_text_only(TensorDict({"input_ids": ids, "multi_modal_inputs": empty}, batch_size=[2]))
    image = NonTensorStack({}, {"pixel_values": torch.zeros(4, 3)})
    with pytest.raises(BatchError, match=r"multimodal inputs \['multi_modal_inputs'\]"):
        _check_text_only(TensorDict({"input_ids": ids, "multi_modal_inputs": image}, batch_size=[2]))


def test_context_parallel_reaches_the_engines(script):
    """megatron.context_parallel_size of the actor and the critic (router replay off) and the
    SFT trainer's engine.context_parallel_size reach the mcore_rl engine configs."""
    from mcore_rl.integrations.verl.config import McoreRLEngineConfig

    cfg = _with(script, "actor_rollout_ref.actor.megatron.router_replay.mode=disabled")
    for override in ("actor_rollout_ref.actor.megatron.context_parallel_size=2", "critic.megatron.context_parallel_size=2"):
        cfg = _with(cfg, override)
    e = _engines(cfg)
    assert (e["actor"].context_parallel_size, e["critic"].context_parallel_size) == (2, 2)
    assert McoreRLEngineConfig(context_parallel_size=2).context_parallel_size == 2
    with config_error("engine.context_parallel_size=0"):
        McoreRLEngineConfig(context_parallel_size=0)


def test_hf_export_keys_reach_the_engine_and_bad_values_are_refused(script):
    """``engine.hf_dtype`` / ``hf_export_threads`` / ``hf_export_supersede`` (the background HF
    export of a save with ``hf_model``) reach the engine config; a dtype merge does not write or
    a thread count below 1 is an error naming the key."""
    default = _engines(script)["actor"]
    assert (default.hf_dtype, default.hf_export_threads, default.hf_export_supersede) == (None, 1, True)
    chosen = _engines(_with(_with(_with(script, "actor_rollout_ref.actor.mcore_rl.hf_dtype=bf16"),
                                  "actor_rollout_ref.actor.mcore_rl.hf_export_threads=2"),
                            "actor_rollout_ref.actor.mcore_rl.hf_export_supersede=false"))["actor"]
    assert (chosen.hf_dtype, chosen.hf_export_threads, chosen.hf_export_supersede) == ("bf16", 2, False)
    with config_error("engine.hf_dtype='int8'"):
        _engines(_with(script, "actor_rollout_ref.actor.mcore_rl.hf_dtype=int8"))
    with config_error("engine.hf_export_threads=0"):
        _engines(_with(script, "actor_rollout_ref.actor.mcore_rl.hf_export_threads=0"))
