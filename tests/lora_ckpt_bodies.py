"""Bodies for the adapter-only LoRA checkpoint tests (tests/test_lora_ckpt.py), run inside N-rank
worlds (tests/dist.py): LoRA engines with dropout (hidden and adapter) trained through Actor /
Critic, saved and resumed through CheckpointManager."""
from __future__ import annotations

import os
import warnings

import torch

from tests.ckpt_bodies import ROWS, manager, optimizer_fingerprint, train

LORA = dict(rank=4, alpha=16.0, dropout=0.1, lora_A_init_method="kaiming", lora_B_init_method="normal", seed=3)
FULLY = "fully_reshardable"


def build(hf_dir: str, layout_kwargs: dict, seed: int, role: str = "actor", lora: dict | None = LORA,
          weights: bool = True, moe: dict | None = None):
    """A trainable engine (LoRA unless ``lora`` is None; hidden dropout 0.1; Adam with warmup and
    decay; ``moe``: MoEOptions) of ``hf_dir``'s model, its weights loaded unless ``weights=False``
    (the random init), and its Actor / Critic (2 optimizer steps per update)."""
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.lora.config import LoraConfig
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.critic import Critic, CriticConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout, seed=seed)
    from mcore_rl.models.moe import MoEOptions

    options = BuildOptions(hidden_dropout=0.1, lora=LoraConfig(**lora) if lora else LoraConfig(),
                           moe=MoEOptions(**(moe or {})))
    optim = OptimConfig(lr=0.02, eps=1e-3, warmup_steps=2, total_steps=6, decay_style="linear")
    engine = ModelEngine(model_args_from_hf(hf_dir), layout, role, active_platform(), options, optim,
                         hf_dir if weights else None)
    sizes = dict(micro_batch_size=2, ppo_mini_batch_size=ROWS // 2)
    model = Actor(engine, ActorConfig(**sizes)) if role == "actor" else Critic(engine, CriticConfig(**sizes))
    return engine, model


def destroy() -> None:
    from mcore_rl.parallel.layout import destroy_parallel_state

    destroy_parallel_state()


def _adapter_map(engine):
    from mcore_rl.mapping.peft import AdapterMap
    from mcore_rl.models.hf_weights import weight_map
    from mcore_rl.lora.build import adapter_sites

    return AdapterMap(weight_map(engine.args, engine.role, engine.layout.tp), adapter_sites(engine.model))


def adapters_full(engine) -> dict[str, torch.Tensor]:
    """The adapters as full PEFT-named tensors (clones), the same on every rank."""
    from mcore_rl.mapping.weights import export_hf_weights

    return {k: v.clone() for k, v in export_hf_weights(engine.model, _adapter_map(engine), adapters=True).items()}


def adapter_opt_state(engine, key: str) -> dict[str, torch.Tensor]:
    """The DistributedOptimizer's ``key`` state (fp32 ``param``, ``exp_avg``, ``exp_avg_sq``) of
    every adapter as a full PEFT-named tensor: DP shards placed and summed, TP/PP gathered."""
    from mcore_rl.mapping.weights import export_hf_weights

    full = {}
    for opt in _optimizers(engine):
        for model_param in [p for buffer in opt.buffers for p in buffer.params]:  # same order on every DP rank
            flat = torch.zeros(model_param.numel(), dtype=torch.float32)
            if model_param in opt.model_param_group_index_map:
                span = opt._get_model_param_range_map(model_param)["param"]
                flat[span.start:span.end] = opt._get_main_param_and_optimizer_states(model_param)[key].float()
            torch.distributed.all_reduce(flat, group=opt.data_parallel_group)
            full[model_param] = flat.view(model_param.shape)
    return export_hf_weights(engine.model, _adapter_map(engine), tensor_of=lambda p: full[p], adapters=True)


def _optimizers(engine) -> list:
    return getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])


def base_full(engine) -> dict[str, torch.Tensor]:
    from tests.ckpt_bodies import hf_params

    return hf_params(engine)


def state_of(engine) -> dict:
    """Full adapters, adapter optimizer state, Adam steps and scheduler steps (same on every rank)."""
    out = {"adapters": adapters_full(engine)}
    for key in ("param", "exp_avg", "exp_avg_sq"):
        out[f"opt/{key}"] = adapter_opt_state(engine, key)
    out["adam_steps"] = sorted({float(s["step"]) for o in _optimizers(engine) for s in o.optimizer.state.values()})
    out["scheduler_steps"] = engine.scheduler.num_steps
    return out


def save_run(hf_dir: str, layout: dict, root: str, space_root: str | None = None) -> dict:
    """1 update (2 optimizer steps), a save (fully reshardable; also model_space under
    ``space_root``), 1 more update: the reference of every resume."""
    engine, actor = build(hf_dir, layout, seed=1)
    train(actor, range(1))
    at_save = {"opt": optimizer_fingerprint(engine), **state_of(engine)}
    manager(root, optimizer_sharding=FULLY).save(1, {"actor": engine}, {"step": 1})
    if space_root:
        manager(space_root, optimizer_sharding="model_space").save(1, {"actor": engine}, {"step": 1})
    metrics = train(actor, range(1, 2))
    out = {"at_save": at_save, "metrics": metrics, "adapters_after": adapters_full(engine),
           "base_after": base_full(engine)}
    destroy()
    return out


def resume_run(hf_dir: str, layout: dict, root: str, reshards: list[tuple[dict, str]]) -> dict:
    """A fresh world (other init seed): resume ``root`` at the saving layout, 1 update; then each
    of ``reshards`` (layout, root): resume, the loaded state and the warnings."""
    engine, actor = build(hf_dir, layout, seed=77)
    out = {"opt_fresh": optimizer_fingerprint(engine)}
    out["state"] = manager(root).resume({"actor": engine})
    out["opt_loaded"] = optimizer_fingerprint(engine)
    out["metrics"] = train(actor, range(1, 2))
    out["adapters_after"], out["base_after"] = adapters_full(engine), base_full(engine)
    destroy()
    out["resharded"] = []
    for other, reshard_root in reshards:
        engine, _ = build(hf_dir, other, seed=78)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            manager(reshard_root).resume({"actor": engine})
        out["resharded"].append({"loaded": state_of(engine), "warnings": [str(w.message) for w in caught]})
        destroy()
    return out


def _step_bytes(step_dir: str) -> int:
    return sum(os.path.getsize(os.path.join(d, n)) for d, _, names in os.walk(step_dir) for n in names)


def _saved(step_dir: str, role: str = "actor") -> tuple[list[str], dict[str, int]]:
    """The keys of a step's dist_ckpt and the element count of each optimizer tensor; whether
    its common state holds the LR scheduler."""
    import math

    from mcore_rl.fileio.safe_load import restricted_unpickling
    from mcore_rl.fileio.torch_dist_read import TorchDistReader

    dist = os.path.join(step_dir, role, "dist_ckpt")
    reader = TorchDistReader(dist)
    try:
        numel = {k: math.prod(i.shape) for k, i in reader.tensors.items() if k.startswith("optimizer")}
        keys = sorted(reader.keys())
    finally:
        reader.close()
    with restricted_unpickling():
        common = torch.load(os.path.join(dist, "common.pt"), map_location="cpu")
    return keys, numel, "lr_scheduler" in common


def _attempt(engine, root: str) -> str:
    """Resumes ``root`` into ``engine``: the CheckpointError's message ('' when it loaded)."""
    from mcore_rl.errors import CheckpointError

    try:
        manager(root).resume({"actor": engine})
    except CheckpointError as e:
        return str(e)
    return ""


def _refusal(hf_dir: str, root: str, weights: bool = True, lora: dict | None = LORA) -> dict:
    """A fresh engine refusing ``root``: the message and whether its adapters stayed as built."""
    engine, _ = build(hf_dir, {}, seed=5, lora=lora, weights=weights)
    before = adapters_full(engine) if lora else {}
    message = _attempt(engine, root)
    after = adapters_full(engine) if lora else {}
    destroy()
    return {"message": message, "untouched": all(torch.equal(v, after[k]) for k, v in before.items())}


def _saved_engine(hf_dir: str, root: str, lora: dict | None = LORA, start_dir: str | None = None) -> dict:
    """One update and a save of step 1 under ``root``; ``start_dir``: a model directory loaded
    as the start (the engine built without weights). The adapters at the save."""
    from mcore_rl.checkpoint.model_dir import load_model_dir

    engine, actor = build(hf_dir, {}, seed=1, lora=lora, weights=start_dir is None)
    if start_dir is not None:
        load_model_dir(start_dir, engine)
    train(actor, range(1))
    manager(root).save(1, {"actor": engine}, {"step": 1})
    out = {"adapters": adapters_full(engine) if lora else {}, "base": engine.base,
           "adapter_numel": sum(p.numel() for n, p in engine.model[0].named_parameters() if ".lora." in n)}
    destroy()
    return out


def checks_run(hf_a: str, hf_b: str, hf_copy: str, tmp: str) -> dict:
    """World 1: sizes and keys of a full and an adapter-only step of the same model; the
    refusals (another base, other settings, no adapters, a full step, another kind of base);
    resumes onto a copy of the base and onto a model-directory base."""
    full, lora = f"{tmp}/full", f"{tmp}/lora"
    _saved_engine(hf_a, full, lora=None)
    saved = _saved_engine(hf_a, lora)
    keys, numel, scheduler = _saved(f"{lora}/global_step_1")
    out = {"bytes_full": _step_bytes(f"{full}/global_step_1"), "bytes_lora": _step_bytes(f"{lora}/global_step_1"),
           "keys_lora": keys, "opt_numel": numel, "has_scheduler": scheduler, "base": saved["base"],
           "adapter_numel": saved["adapter_numel"]}
    out["other_base"] = _refusal(hf_b, lora)
    out["other_alpha"] = _refusal(hf_a, lora, lora=dict(LORA, alpha=32.0))
    out["no_adapters"] = _refusal(hf_a, lora, lora=None)
    out["full_step"] = _refusal(hf_a, full)
    engine, _ = build(hf_copy, {}, seed=5)  # the same base, moved
    from mcore_rl.mapping.hf_io import SafetensorsReader

    base_hf = SafetensorsReader(hf_a)
    out["copy"] = {"message": _attempt(engine, lora), "adapters": adapters_full(engine), "saved": saved["adapters"],
                   "base_hf": {k: base_hf[k] for k in base_hf}}
    destroy()
    # a model directory as the base: the full step's actor, loaded into LoRA engines without weights
    start = f"{full}/global_step_1/actor"
    saved_m = _saved_engine(hf_a, f"{tmp}/lora_m", start_dir=start)
    engine, _ = build(hf_a, {}, seed=5, weights=False)
    from mcore_rl.checkpoint.model_dir import load_model_dir

    load_model_dir(start, engine)
    out["mcore"] = {"base": saved_m["base"], "message": _attempt(engine, f"{tmp}/lora_m"),
                    "adapters": adapters_full(engine), "saved": saved_m["adapters"]}
    destroy()
    out["mcore_vs_hf"] = _refusal(hf_a, f"{tmp}/lora_m")
    out["merge"] = {}
    for name, step in (("hf_base", lora),):  # (the model-directory base here has no huggingface/: unmergeable)
        out["merge"][name] = _offline_merge(f"{step}/global_step_1/actor", f"{tmp}/merged_{name}")
    out["merge_dtypes"] = _merge_dtypes(f"{lora}/global_step_1/actor", tmp)
    out["edited"] = _edited_base_refused(hf_a, lora, tmp)
    return out


def double_between_samples(hf_dir: str) -> str:
    """Doubles, in place, a tensor of ``hf_dir``'s model.safetensors that lies between the
    three 64 KiB samples the base identity used to take (same size, other content); its name."""
    import json
    import struct

    path = os.path.join(hf_dir, "model.safetensors")
    size, sample = os.path.getsize(path), 64 << 10
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    mid = (size - sample) // 2
    for name, entry in sorted(header.items()):
        if name == "__metadata__" or entry["dtype"] != "F32":
            continue
        lo, hi = (8 + n + o for o in entry["data_offsets"])
        if sample <= lo and hi <= mid:
            with open(path, "r+b") as f:
                f.seek(lo)
                t = torch.frombuffer(bytearray(f.read(hi - lo)), dtype=torch.float32)
                f.seek(lo)
                f.write((t * 2).numpy().tobytes())
            return name
    raise AssertionError(f"no fp32 tensor of {path} between the samples")


def _edited_base_refused(hf_a: str, lora: str, tmp: str) -> dict:
    """The base edited between the samples after the adapter-only save: the resume's and the
    merge's refusals (their messages) and whether the merge left a target."""
    from mcore_rl.conversion.merge import MergeError

    tensor = double_between_samples(hf_a)
    out = {"tensor": tensor, **_refusal(hf_a, lora)}
    target = f"{tmp}/merged_edited"
    try:
        _offline_merge(f"{lora}/global_step_1/actor", target)
        out["merge"] = ""
    except MergeError as e:
        out["merge"] = str(e)
    out["merge_target"] = os.path.exists(target)
    return out


def _merge_dtypes(local_dir: str, tmp: str) -> dict:
    """The adapter-only step merged with ``dtype`` bf16 (its tensors, config.json dtype) beside
    the merge without (config.json dtype), and the message refusing ``dtype`` fp8."""
    import json

    from mcore_rl.conversion.merge import MergeError, merge

    out = {"bf16": _offline_merge(local_dir, f"{tmp}/merged_bf16", dtype="bf16", max_shard_size=SMALL_SHARDS)}
    out["bf16_shards"] = {n: os.path.getsize(f"{tmp}/merged_bf16/{n}") for n in os.listdir(f"{tmp}/merged_bf16")
                          if n.endswith(".safetensors")}
    index = f"{tmp}/merged_bf16/model.safetensors.index.json"  # absent when one shard was written
    out["bf16_index"] = {}
    if os.path.isfile(index):
        with open(index) as f:
            out["bf16_index"] = json.load(f)["weight_map"]
    for name in ("merged_bf16", "merged_hf_base"):
        with open(f"{tmp}/{name}/config.json") as f:
            out[f"{name}_config"] = json.load(f)["dtype"]
    try:
        merge(local_dir, f"{tmp}/merged_fp8", dtype="fp8")
        out["fp8"] = ""
    except MergeError as e:
        out["fp8"] = str(e)
    out["fp8_target"] = os.path.exists(f"{tmp}/merged_fp8")
    return out


SMALL_SHARDS = 64 << 10  # bytes: the tiny model's merge in several shards


def _offline_merge(local_dir: str, target: str, dtype: str | None = None, max_shard_size: int | str = "5GB") -> dict:
    """converters' merge of an adapter-only step with its base: the HF tensors it wrote."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.mapping.hf_io import SafetensorsReader

    merge(local_dir, target, dtype=dtype, max_shard_size=max_shard_size)
    written = SafetensorsReader(target)
    return {k: written[k] for k in written}


HF_MODEL = ("model", "optimizer", "extra", "hf_model")


def _exported(role_dir: str, target: str) -> dict:
    """The role's background HF export (the manager closed: exports done): its state (checksums
    verified), its files and ``mcore_to_hf.py merge``'s of the step (into ``target``) but the
    records, the names that differ in bytes, its config.json and its tensors."""
    import filecmp
    import json

    from mcore_rl.checkpoint.hf_export_record import export_state, hf_dir_of
    from mcore_rl.fileio.output_dir import EXPORT_RECORD
    from mcore_rl.mapping.hf_io import SafetensorsReader

    hf = hf_dir_of(role_dir)
    state = export_state(role_dir, verify=True)
    _offline_merge(role_dir, target)
    ours, theirs = (sorted(set(os.listdir(d)) - {EXPORT_RECORD}) for d in (hf, target))
    differ = [n for n in ours if n not in theirs or not filecmp.cmp(os.path.join(hf, n), os.path.join(target, n),
                                                                     shallow=False)]
    written = SafetensorsReader(hf)
    with open(os.path.join(hf, "config.json")) as f:
        config = json.load(f)
    return {"state": state, "files": ours, "merge_files": theirs, "differ": differ, "config": config,
            "tensors": {k: written[k].clone() for k in written}, "dir": hf}


def _critic_leg(hf_critic: str, tmp: str) -> dict:
    """A LoRA critic (value head trained in full) saved with ``hf_model`` (its merged weights
    exported in the background), merged offline, resumed."""
    from mcore_rl.lora.layers import merged_tensor_of
    from mcore_rl.models.hf_weights import export_hf

    import shutil

    root, source = f"{tmp}/critic", f"{tmp}/critic_hf_files"  # the run's HF files: a chat template the base lacks
    os.makedirs(source)
    shutil.copyfile(os.path.join(hf_critic, "config.json"), os.path.join(source, "config.json"))
    with open(os.path.join(source, "chat_template.jinja"), "w") as f:
        f.write("{{ messages }}\n")
    engine, critic = build(hf_critic, {}, seed=1, role="critic")
    train(critic, range(1))
    saver = manager(root, hf_sources={"critic": source}, save_contents=HF_MODEL)
    saver.save(1, {"critic": engine}, {"step": 1})
    saver.close()  # waits for the export
    out = {"at_save": {"adapters": adapters_full(engine), "base": base_full(engine)},
           "merged": {k: v.clone() for k, v in export_hf(engine.model, engine.args, "critic",
                                                           merged_tensor_of(engine.model)).items()}}
    out["keys"] = _saved(f"{root}/global_step_1", "critic")[0]
    out["export"] = _exported(f"{root}/global_step_1/critic", f"{tmp}/critic_merged")
    out["offline"] = out["export"].pop("tensors")
    destroy()
    engine, _ = build(hf_critic, {}, seed=77, role="critic")
    manager(root).resume({"critic": engine})
    out["loaded"] = {"adapters": adapters_full(engine), "base": base_full(engine)}
    destroy()
    return out


def _moe_leg(hf_moe: str, tmp: str) -> dict:
    """A LoRA glm4_moe actor whose router correction bias moves in training: saved with
    ``hf_model`` (exported in the background; transformers' log-probs of the export against the
    engine's), resumed."""
    from transformers import AutoModelForCausalLM

    from tests.ckpt_bodies import step_batch
    from tests.steps import EXACT_MOE
    from tests.tiny import hf_log_probs

    moe = dict(EXACT_MOE, expert_bias_update_rate=0.01)
    engine, actor = build(hf_moe, {}, seed=1, moe=moe)
    train(actor, range(1))
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.lora.layers import merged_tensor_of

    saver = manager(f"{tmp}/moe", hf_sources={"actor": hf_moe}, save_contents=HF_MODEL)
    saver.save(1, {"actor": engine}, {"step": 1})
    saver.close()  # waits for the export
    at_save = base_full(engine)
    merged = {k: v.clone() for k, v in export_hf(engine.model, engine.args, "actor",
                                                 merged_tensor_of(engine.model)).items()}
    exported = _exported(f"{tmp}/moe/global_step_1/actor", f"{tmp}/moe_merged")
    offline = exported.pop("tensors")
    batch = step_batch(engine.args.vocab_size, 5)
    mine = actor.compute_log_prob(batch)["log_probs"]
    hf = AutoModelForCausalLM.from_pretrained(exported["dir"], attn_implementation="eager",
                                              dtype=torch.float32).eval()
    exported["log_prob_gap"] = float((hf_log_probs(hf, batch)[0] - mine).abs().max())
    destroy()
    engine, _ = build(hf_moe, {}, seed=77, moe=moe)
    fresh = base_full(engine)
    manager(f"{tmp}/moe").resume({"actor": engine})
    out = {"at_save": at_save, "fresh": fresh, "loaded": base_full(engine), "merged": merged, "offline": offline,
           "export": exported}
    destroy()
    return out


def extras_run(hf_critic: str, hf_moe: str, tmp: str) -> dict:
    """World 1: the critic and MoE legs."""
    return {"critic": _critic_leg(hf_critic, tmp), "moe": _moe_leg(hf_moe, tmp)}
