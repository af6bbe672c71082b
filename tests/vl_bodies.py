"""Tiny published-layout Qwen3.5 checkpoints (vision-language wrappers, fused experts) and the
bodies tests/test_vl.py runs inside rank worlds."""
from __future__ import annotations

import os
import warnings

import torch

from tests.hybrid_bodies import EXPERTS, HYBRID
from tests.tiny import BASE

VISION = dict(depth=1, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64, patch_size=4,
              temporal_patch_size=2, spatial_merge_size=2, in_channels=3, num_position_embeddings=16)
# name -> (wrapper model_type, text overrides, experts fused in the safetensors)
VL = {"dense": ("qwen3_5", {}, False), "moe_fused": ("qwen3_5_moe", EXPERTS, True),
      "moe": ("qwen3_5_moe", EXPERTS, False)}  # per expert, as transformers' save_pretrained writes them


def tiny_vl_model(model_type: str, text: dict, seed: int = 0):
    """A random Qwen3_5[Moe]ForConditionalGeneration (eager attention, non-trivial norms)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model(model_type, text_config={**BASE, **HYBRID, "eos_token_id": 1, **text},
                                  vision_config=VISION)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def fuse_experts(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> the published layout: ``experts.gate_up_proj`` [E, 2I, H] (gate rows
    then up rows per expert) and ``experts.down_proj`` [E, H, I]. Written here from the layout
    transformers' qwen2_moe conversion reads, not with mcore_rl's code."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    bases = sorted({k.split(".mlp.experts.")[0] for k in tensors if ".mlp.experts." in k})
    for base in bases:
        e = f"{base}.mlp.experts"
        out[f"{e}.gate_up_proj"] = torch.stack([
            torch.cat([tensors[f"{e}.{i}.gate_proj.weight"], tensors[f"{e}.{i}.up_proj.weight"]])
            for i in range(num_experts)])
        out[f"{e}.down_proj"] = torch.stack([tensors[f"{e}.{i}.down_proj.weight"] for i in range(num_experts)])
    return out


def save_vl(base, name: str, **text_overrides) -> tuple[str, object]:
    """Saves VL[name] (text config + ``text_overrides``) under ``base/name`` (+ an
    ``mtp.fc.weight`` the text model does not read; experts fused when asked); returns
    (directory, model)."""
    from safetensors.torch import load_file, save_file

    model_type, text, fused = VL[name]
    model = tiny_vl_model(model_type, {**text, **text_overrides})
    path = os.path.join(base, name)
    model.save_pretrained(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    tensors["mtp.fc.weight"] = torch.randn(BASE["hidden_size"], 2 * BASE["hidden_size"])
    if fused:
        tensors = fuse_experts(tensors, EXPERTS["num_experts"])
    save_file(tensors, file, metadata={"format": "pt"})
    return path, model


def convert_noting_warnings(jobs: list[tuple[str, str]]) -> dict:
    """Converts each (hf_dir, out_dir) in this world; out_dir -> the converter's warnings."""
    from mcore_rl.conversion.convert import ConvertOptions, convert

    out = {}
    for hf, dst in jobs:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            convert(ConvertOptions(hf, dst), progress=False)
        out[dst] = [str(w.message) for w in seen if "NaN" in str(w.message)]
    return out


def load_both_ways(pairs: dict[str, tuple[str, str]]) -> dict:
    """TP=2 x PP=2 (EP=2 for MoE) + SP: each (model_dir, hf_dir) loaded into an actor engine
    from the model directory and, again, from the HF directory with ``load_hf``; rank 0 returns
    both exports."""
    from mcore_rl.checkpoint.model_dir import load_model_dir
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf, load_hf
    from mcore_rl.parallel import ParallelLayout, destroy_parallel_state, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine

    out = {}
    for name, (model_dir, hf_dir) in pairs.items():
        args = model_args_from_hf(hf_dir)
        layout = ParallelLayout(tp=2, pp=2, ep=2 if args.moe else 1, etp=1, sequence_parallel=True)
        destroy_parallel_state()
        initialize_parallel_state(layout)
        engine = ModelEngine(args, layout, "actor", active_platform())
        exports = []
        for load in (lambda: load_model_dir(model_dir, engine), lambda: load_hf(engine.model, args, "actor", hf_dir)):
            for p in engine.model[0].parameters():  # the load must set every one
                p.data.fill_(7.0)
            load()
            exports.append(export_hf(engine.model, args, "actor"))
        out[name] = exports if torch.distributed.get_rank() == 0 else None
    return out


def train_and_save(cfg, steps: int) -> dict:
    """The main job from a VL directory: build, ``steps`` GRPO steps, a checkpoint of the actor;
    rank 0 returns the live actor's HF export and how many of its parameters moved."""
    from mcore_rl.job.loop import build, checkpoint_manager, setup_rollout, starts, train_step
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.platform import active_platform

    begin = starts(cfg)
    actor, critic = build(cfg, active_platform(), begin)
    task, rollouts = setup_rollout(cfg, actor, begin)
    before = {n: p.detach().clone() for c in actor.engine.model for n, p in c.named_parameters()}
    for step in range(steps):
        train_step(cfg, actor, critic, task, rollouts, step)
    moved = sum(not torch.equal(before[n], p) for c in actor.engine.model for n, p in c.named_parameters())
    ckpt = checkpoint_manager(cfg, {"actor": begin[0].hf_files})
    ckpt.save(steps, {"actor": actor.engine}, {"step": steps, "history": []})
    ckpt.close()
    export = export_hf(actor.engine.model, actor.engine.args, "actor")
    return {"export": export, "moved": moved, "params": len(before)} if torch.distributed.get_rank() == 0 else None
