"""Tiny DeepSeek-V3 / GLM-4.5 checkpoints with multi-token-prediction layers, and the bodies MTP
tests run in N-rank worlds. transformers ignores MTP weights, so they are written into the
safetensors file here with the Hub's names and shapes: MTP layer i is HF layer
num_hidden_layers + i (its decoder layer taken from a random model one layer deeper),
enorm / hnorm / shared_head.norm random around 1, eh_proj random, embed_tokens and
shared_head.head equal to the main model's (as the published checkpoints hold them)."""
from __future__ import annotations

import json
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file

from tests.tiny import tiny_config, tiny_hf_model


def mtp_tensors(model_type: str, hf, depth: int, seed: int, **overrides) -> dict[str, torch.Tensor]:
    """HF tensors of ``depth`` MTP layers for the tiny model ``hf`` (random, fixed by ``seed``)."""
    n, h = hf.config.num_hidden_layers, hf.config.hidden_size
    deeper = tiny_hf_model(tiny_config(model_type, **{**overrides, "num_hidden_layers": n + depth}), seed=seed + 1)
    g = torch.Generator().manual_seed(seed)
    with tempfile.TemporaryDirectory() as tmp:  # the Hub's names (per-expert tensors), as saved
        deeper.save_pretrained(tmp)
        state = load_file(os.path.join(tmp, "model.safetensors"))
    main = hf.state_dict()
    out = {}
    for i in range(depth):
        layer = f"model.layers.{n + i}."
        out.update({k: v.clone() for k, v in state.items() if k.startswith(layer)})
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            out[f"{layer}{norm}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
        out[f"{layer}eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
        out[f"{layer}embed_tokens.weight"] = main["model.embed_tokens.weight"].clone()
        out[f"{layer}shared_head.head.weight"] = main["lm_head.weight"].clone()
    return out


def save_mtp_model(directory: str | os.PathLike, model_type: str, depth: int = 1, seed: int = 0,
                   declare: bool = True, **overrides) -> tuple[str, object, dict]:
    """A tiny HF model with ``depth`` MTP layers saved in ``directory`` (``declare``: the config
    says num_nextn_predict_layers=depth, else the field is absent); returns (directory, HF
    model, the MTP tensors)."""
    hf = tiny_hf_model(tiny_config(model_type, **overrides), seed=seed)
    hf.save_pretrained(directory)
    extra = mtp_tensors(model_type, hf, depth, seed, **overrides)
    path = os.path.join(directory, "model.safetensors")
    save_file({**load_file(path), **extra}, path, metadata={"format": "pt"})
    cfg_path = os.path.join(directory, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop("num_nextn_predict_layers", None)
    if declare:
        cfg["num_nextn_predict_layers"] = depth
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return str(directory), hf, extra


def off_forward_equal(mtp_dir: str, layout_kwargs: dict, batch: dict) -> dict:
    """Logits and loss of the model built with its MTP layers (not run: mtp_train unset) and
    without them (``ModelArgs.with_mtp(False)``), same weights, on every rank; the MTP block's
    placement; the HF round trip of the MTP-built model."""
    from megatron.core import parallel_state

    from mcore_rl.models.builder import build_model
    from mcore_rl.models.forward import run_schedule
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import load_hf
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import share_from_last_stage
    from tests.steps import _output_loss, roundtrip_mismatch

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout)
    out = {}
    for name, build in (("with", True), ("without", False)):
        args = model_args_from_hf(mtp_dir).with_mtp(build)
        chunks = build_model(args, layout, "actor", active_platform())
        load_hf(chunks, args, "actor", mtp_dir)
        if build:
            out["mismatch"] = roundtrip_mismatch(chunks, args, "actor", mtp_dir)
            out["mtp_here"] = [hasattr(c, "mtp") for c in chunks]
        res = run_schedule(chunks, [batch], _output_loss("actor", args.vocab_size), forward_only=False)
        out[name] = share_from_last_stage(res[0]["output"] if res else None)
    out["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    return out
