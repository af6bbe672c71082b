"""LoRA bodies run inside N-rank worlds (tests/dist.py) and the peft + transformers references."""
from __future__ import annotations

import copy

import torch

from tests.steps import EXACT_MOE

OPTIM = dict(name="adam", lr=0.05, eps=1.0, clip_grad=1.0)


def build_engine(hf_dir: str, layout_kwargs: dict, lora: dict, moe: bool = False, recompute=None,
                 optim: dict | None = OPTIM):
    """A LoRA ModelEngine (actor) loaded from ``hf_dir`` at ``layout_kwargs``."""
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.lora.config import LoraConfig
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    from megatron.core import parallel_state

    layout = ParallelLayout(**layout_kwargs)
    if not parallel_state.model_parallel_is_initialized():  # a second engine in the same world
        initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    options = BuildOptions(lora=LoraConfig(**lora), recompute=recompute,
                           moe=MoEOptions(**EXACT_MOE) if moe else MoEOptions())
    return ModelEngine(args, layout, "actor", active_platform(), options,
                       OptimConfig(**optim) if optim else None, hf_dir)


def peft_tensors(engine) -> dict[str, torch.Tensor]:
    """The engine's adapters as PEFT-named full tensors, on every rank."""
    from mcore_rl.mapping.peft import AdapterMap, to_peft_tensors
    from mcore_rl.mapping.weights import export_hf_weights
    from mcore_rl.models.hf_weights import weight_map
    from mcore_rl.lora.build import adapter_sites

    amap = AdapterMap(weight_map(engine.args, "actor", engine.layout.tp), adapter_sites(engine.model))
    tensors = to_peft_tensors(export_hf_weights(engine.model, amap, adapters=True), engine.args.arch.model_type)
    # clones: tensors that needed no gather are views of the parameters, which training changes
    return {k: v.clone() for k, v in tensors.items()}


def lora_update(hf_dir: str, layout_kwargs: dict, lora: dict, batch: dict, actor: dict, moe: bool = False,
                recompute=None) -> dict:
    """log-probs with adapters and with adapters off (reference), one update_policy, adapters
    before and after (PEFT names), the base weights after (HF names) and the metrics."""
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.rl.actor import Actor, ActorConfig

    engine = build_engine(hf_dir, layout_kwargs, lora, moe, recompute)
    act = Actor(engine, ActorConfig(**actor))
    out = {"log_probs": act.compute_log_prob(batch)["log_probs"], "ref_log_probs": act.compute_ref_log_prob(batch),
           "peft_before": peft_tensors(engine)}
    out["metrics"] = act.update_policy(batch)
    out["peft_after"] = peft_tensors(engine)
    out["base_after"] = export_hf(engine.model, engine.args, "actor")
    return out


def peft_model(hf, lora: dict, tensors: dict[str, torch.Tensor]):
    """A peft LoRA model over a copy of ``hf`` holding ``tensors`` (PEFT names) as its adapters."""
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    experts = [k for k in tensors if ".mlp.experts." in k]
    targets = sorted({k.split(".")[-3] for k in tensors if k not in experts})
    parameters = sorted({f"mlp.experts.{p}" for p, needle in (("gate_up_proj", "base_layer.lora_"), ("down_proj", "experts.lora_"))
                         if any(needle in k for k in experts)})
    config = LoraConfig(r=lora["rank"], lora_alpha=lora["alpha"], target_modules=targets, lora_dropout=0.0,
                        target_parameters=parameters or None)
    model = get_peft_model(copy.deepcopy(hf), config)
    result = set_peft_model_state_dict(model, tensors)
    if result.unexpected_keys:
        raise AssertionError(f"peft did not take {result.unexpected_keys[:4]}")
    return model.eval()


def peft_state(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def lora_ref_with_replay(hf_dir: str, lora: dict, batch: dict, actor: dict) -> dict:
    """R2 replay: the actor's routes (recorded with adapters on), the LoRA reference with and
    without them, and a frozen-base engine (no LoRA) replaying the same routes."""
    from mcore_rl.models.routing import ROUTED_EXPERTS
    from mcore_rl.rl.actor import Actor, ActorConfig

    config = ActorConfig(**{**actor, "router_replay": "R2"})
    act = Actor(build_engine(hf_dir, {}, lora, moe=True), config)
    recorded = act.compute_log_prob(batch)
    routed = {**batch, ROUTED_EXPERTS: recorded[ROUTED_EXPERTS]}
    out = {"ref_fresh": act.compute_ref_log_prob(batch), "ref_replay": act.compute_ref_log_prob(routed)}
    base = Actor(build_engine(hf_dir, {}, dict(rank=0), moe=True, optim=None), config)
    out["base_replay"] = base._forward_log_probs(base.engine, routed, False, replay_routing=True)["log_probs"]
    out["base_fresh"] = base.compute_log_prob(batch)["log_probs"]
    return out


def lora_roundtrip(hf_dir: str, layout_kwargs: dict, lora: dict, batch: dict, actor: dict, out_dir: str,
                   moe: bool = False, steps: int = 2) -> dict:
    """Start from a PEFT adapter (lora['adapter_path']): log-probs, ``steps`` updates, then the
    adapter exported as PEFT (out_dir/peft) and merged HF weights (out_dir/merged); log-probs after."""
    import os

    from mcore_rl.lora.config import LoraConfig
    from mcore_rl.conversion.lora_export import save_merged_hf, save_peft_adapter
    from mcore_rl.rl.actor import Actor, ActorConfig

    engine = build_engine(hf_dir, layout_kwargs, lora, moe)
    act = Actor(engine, ActorConfig(**actor))
    out = {"before": act.compute_log_prob(batch)["log_probs"]}
    for _ in range(steps):
        act.update_policy(batch)
    out["after"] = act.compute_log_prob(batch)["log_probs"]
    save_peft_adapter(engine.model, engine.args, "actor", LoraConfig(**lora), os.path.join(out_dir, "peft"), hf_dir)
    save_merged_hf(engine.model, engine.args, "actor", os.path.join(out_dir, "merged"))
    return out


def adapted_names(hf_dir: str, layout_kwargs: dict, lora: dict, moe: bool = False) -> list[str]:
    """Canonical names of every adapted linear, gathered from all ranks, sorted."""
    import torch

    from mcore_rl.lora.build import adapter_sites

    engine = build_engine(hf_dir, layout_kwargs, lora, moe, optim=None)
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, sorted(adapter_sites(engine.model)))
    return sorted({n for names in gathered for n in names})


def assert_equal_to_one_rank(results: list[dict], one: dict, tol: float) -> None:
    """Every rank's ``lora_update`` result equals the single rank's: log-probs, reference,
    adapters before and after the step (within ``tol``) and the grad norm (relative ``tol``)."""
    diff = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
    for rank, got in enumerate(results):
        for key in ("log_probs", "ref_log_probs"):
            assert diff(got[key], one[key]) <= tol, f"rank {rank}: {key}"
        for key in ("peft_before", "peft_after"):
            worst = max((diff(got[key][k], v), k) for k, v in one[key].items())
            assert worst[0] <= tol, f"rank {rank}: {key} {worst[1]} differs by {worst[0]:.3g}"
        norm, want = got["metrics"]["actor/grad_norm"], one["metrics"]["actor/grad_norm"]
        assert abs(norm - want) <= tol * want, f"rank {rank}: grad norm {norm} != {want}"


def assert_matches_peft_step(hf, hf_dir: str, batch: dict, lora: dict, ours: dict, tol: float) -> None:
    """``ours`` (a ``lora_update`` result) against peft's step from the same adapters: adapters
    after the step (PEFT names, within ``tol``), the grad norm (relative ``tol``), the step moved
    them, and every base tensor (HF names as the file stores them) bit-identical."""
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from tests.test_actor_update import reference_update

    diff = lambda a, b: (a.double() - b.double()).abs().max().item()  # noqa: E731
    model = peft_model(hf, lora, ours["peft_before"])
    ref = reference_update(model, batch)
    want = peft_state(model)
    assert set(want) == set(ours["peft_after"])
    worst = max((diff(ours["peft_after"][k], v), k) for k, v in want.items())
    assert worst[0] <= tol, f"{worst[1]} differs from peft's step by {worst[0]:.3g}"
    assert max(diff(ours["peft_after"][k], v) for k, v in ours["peft_before"].items()) > 1e-3  # it moved
    got_norm, want_norm = ours["metrics"]["actor/grad_norm"], ref["metrics"]["actor/grad_norm"]
    assert abs(got_norm - want_norm) <= tol * want_norm
    base = SafetensorsReader(hf_dir)
    assert set(base) == set(ours["base_after"])
    assert all(torch.equal(ours["base_after"][k], base[k]) for k in base)


def import_sweep(hf_dir: str, cases: dict[str, str], batch: dict, actor: dict) -> dict:
    """One model built once; every adapter directory of ``cases`` (name -> path) imported into
    it in turn: name -> ('ok', log-probs) | ('refused', error type, message) | ('crash', traceback).
    Also a seeded LoRA whose targets match no layer, trainable: ('refused', ...) expected."""
    import traceback

    from mcore_rl.errors import McoreRLError
    from mcore_rl.models.hf_weights import weight_map
    from mcore_rl.lora.build import attach_adapters, linear_sites
    from mcore_rl.lora.config import LoraConfig
    from mcore_rl.rl.actor import Actor, ActorConfig

    engine = build_engine(hf_dir, {}, dict(rank=1), optim=None)
    act = Actor(engine, ActorConfig(**actor))
    wmap = weight_map(engine.args, "actor", 1)
    out = {}
    for name, path in cases.items():
        for chunk in engine.model:
            for _, module in linear_sites(chunk):
                module.lora = None
        try:
            attach_adapters(engine.model, LoraConfig(rank=1, adapter_path=path), wmap, torch.float32)
            out[name] = ("ok", act.compute_log_prob(batch)["log_probs"])
        except McoreRLError as e:
            out[name] = ("refused", type(e).__name__, str(e))
        except Exception:  # noqa: BLE001 - what the sweep looks for
            out[name] = ("crash", traceback.format_exc())
    try:
        build_engine(hf_dir, {}, dict(rank=2, target_modules=["*.layers.7.*"]))
        out["no_trainable_parameter"] = ("ok", None)
    except McoreRLError as e:
        out["no_trainable_parameter"] = ("refused", type(e).__name__, str(e))
    except Exception:  # noqa: BLE001
        out["no_trainable_parameter"] = ("crash", traceback.format_exc())
    return out


def export_expert_parts(hf_dir: str, variants: dict[str, list[str]], batch: dict, actor: dict, out_dir: str) -> dict:
    """For each variant (name -> target_modules), a qwen3_moe LoRA engine with random non-zero
    adapters exported as PEFT (out_dir/<name>); name -> its log-probs."""
    import os

    from mcore_rl.lora.config import LoraConfig
    from mcore_rl.conversion.lora_export import save_peft_adapter
    from mcore_rl.rl.actor import Actor, ActorConfig

    out = {}
    for name, targets in variants.items():
        lora = dict(rank=2, alpha=64.0, lora_A_init_method="normal", lora_B_init_method="normal",
                    target_modules=targets)
        engine = build_engine(hf_dir, {}, lora, moe=True, optim=None)
        out[name] = Actor(engine, ActorConfig(**actor)).compute_log_prob(batch)["log_probs"]
        save_peft_adapter(engine.model, engine.args, "actor", LoraConfig(**lora), os.path.join(out_dir, name), hf_dir)
    return out


def import_each(hf_dir: str, paths: dict[str, str], batch: dict, actor: dict, moe: bool = False) -> dict:
    """name -> ('ok', log-probs) | ('refused', message) | ('crash', traceback) of an engine built
    with lora.adapter_path=paths[name]."""
    import traceback

    from mcore_rl.errors import McoreRLError
    from mcore_rl.rl.actor import Actor, ActorConfig

    out = {}
    for name, path in paths.items():
        try:
            engine = build_engine(hf_dir, {}, dict(rank=1, adapter_path=path), moe=moe, optim=None)
            out[name] = ("ok", Actor(engine, ActorConfig(**actor)).compute_log_prob(batch)["log_probs"])
        except McoreRLError as e:
            out[name] = ("refused", str(e))
        except Exception:  # noqa: BLE001 - what the caller looks for
            out[name] = ("crash", traceback.format_exc())
    return out


def export_then_import(hf_dir: str, variants: dict[str, list[str]], batch: dict, actor: dict, out_dir: str,
                       mutate) -> dict:
    """``export_expert_parts``, then ``mutate(out_dir)`` -> {name: adapter directory} imported
    with ``import_each`` (one world): {'exported': ..., 'imported': ...}."""
    exported = export_expert_parts(hf_dir, variants, batch, actor, out_dir)
    return {"exported": exported, "imported": import_each(hf_dir, mutate(out_dir), batch, actor, moe=True)}
