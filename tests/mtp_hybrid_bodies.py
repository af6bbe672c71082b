"""Tiny Qwen3-Next / Qwen3.5 (dense and MoE) checkpoints with their multi-token-prediction layer,
and an independent reference of its loss. transformers ignores ``mtp.*`` tensors, so they are
written into the safetensors file here with the names vLLM and SGLang load: ``mtp.fc`` [H, 2H],
``mtp.pre_fc_norm_embedding`` / ``mtp.pre_fc_norm_hidden`` / ``mtp.norm`` (zero-centred, random
around 0) and ``mtp.layers.0.*``, a full-attention decoder layer taken from a random model one
layer deeper whose extra layer is ``full_attention``."""
from __future__ import annotations

import json
import os
import tempfile

import torch
from safetensors.torch import load_file, save_file

from tests.hybrid_bodies import VARIANTS
from tests.tiny import tiny_config, tiny_hf_model

FIELD = "mtp_num_hidden_layers"


def deeper_hybrid(model_type: str, hf, seed: int, **overrides):
    """The random model whose layer num_hidden_layers (gated full attention) is the MTP layer's."""
    n = hf.config.num_hidden_layers
    types = [*hf.config.layer_types, "full_attention"]
    return tiny_hf_model(tiny_config(model_type, **{**overrides, "num_hidden_layers": n + 1, "layer_types": types}),
                         seed=seed + 1)


def hybrid_mtp_tensors(hf, deeper, seed: int, depth: int = 1) -> dict[str, torch.Tensor]:
    """The ``mtp.*`` tensors: ``depth`` decoder layers (copies of ``deeper``'s layer n) under
    ``mtp.layers.{i}``, one projection and three norms."""
    n, h = hf.config.num_hidden_layers, hf.config.hidden_size
    with tempfile.TemporaryDirectory() as tmp:  # the Hub's names (per-expert tensors), as saved
        deeper.save_pretrained(tmp)
        state = load_file(os.path.join(tmp, "model.safetensors"))
    layer = f"model.layers.{n}."
    out = {f"mtp.layers.{i}.{k[len(layer):]}": v.clone() for i in range(depth) for k, v in state.items()
           if k.startswith(layer)}
    g = torch.Generator().manual_seed(seed)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{norm}.weight"] = 0.1 * torch.randn(h, generator=g)
    out["mtp.fc.weight"] = 0.2 * torch.randn(h, 2 * h, generator=g)
    return out


def save_hybrid_mtp(directory, name: str, seed: int = 0, declare: bool | int = False,
                    depth: int = 1) -> tuple[str, object, object, dict]:
    """Variant ``name`` of tests/hybrid_bodies.VARIANTS saved in ``directory`` with its MTP
    tensors (``declare``: the config's mtp_num_hidden_layers, an int to write that value; False:
    absent, as in published configs); returns (directory, HF model, deeper model, MTP tensors)."""
    model_type, overrides = VARIANTS[name]
    hf = tiny_hf_model(tiny_config(model_type, **overrides), seed=seed)
    hf.save_pretrained(directory)
    deeper = deeper_hybrid(model_type, hf, seed, **overrides)
    extra = hybrid_mtp_tensors(hf, deeper, seed, depth)
    path = os.path.join(directory, "model.safetensors")
    save_file({**load_file(path), **extra}, path, metadata={"format": "pt"})
    cfg_path = os.path.join(directory, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg.pop(FIELD, None)
    if declare is not False:
        cfg[FIELD] = depth if declare is True else declare
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2)
    return str(directory), hf, deeper, extra


def reference_hybrid_mtp_loss(hf, deeper, extra: dict, batch: dict) -> torch.Tensor:
    """[1] the MTP loss from the HF weights in plain torch (fp32), independent of megatron: each
    row's real tokens alone; the trunk's normed output h (transformers' model); x = mtp.fc of
    [norm_e(embed(t[i+1])) ; norm_h(h[i])] with Qwen's zero-centred RMSNorm (x * (1 + w)); the
    decoder layer (transformers' gated full-attention layer holding the MTP layer's weights), a
    causal mask, positions from 0; mtp.norm; the main LM head; cross-entropy on t[i+2], averaged
    over every row's valid positions."""
    n, eps = hf.config.num_hidden_layers, hf.config.rms_norm_eps
    layer = deeper.model.layers[n]
    assert layer.block_type == "full_attention"

    def norm(x, w):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) * (1 + w)

    total, count = torch.zeros((), dtype=torch.float64), 0
    embed, head = hf.model.embed_tokens.weight, hf.lm_head.weight
    with torch.no_grad():
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            t = ids[mask.bool()]
            length = t.numel() - 1  # MTP positions i = 0 .. L-2 (token i+1 exists)
            if length <= 1:
                continue
            h = hf.model(input_ids=t[None]).last_hidden_state
            x = torch.cat([norm(embed[t[1:]][None], extra["mtp.pre_fc_norm_embedding.weight"]),
                           norm(h[:, :length], extra["mtp.pre_fc_norm_hidden.weight"])], -1) @ extra["mtp.fc.weight"].T
            causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
            pos = torch.arange(length)[None]
            out = layer(x, position_embeddings=hf.model.rotary_emb(x, pos), attention_mask=causal, position_ids=pos)
            y = norm(out[0] if isinstance(out, tuple) else out, extra["mtp.norm.weight"])
            logits = y @ head.T
            total += torch.nn.functional.cross_entropy(logits[0, : length - 1].double(), t[2:], reduction="sum")
            count += length - 1
    return (total / count).float()[None]


def each_model(body, dirs: dict, *args) -> dict:
    """``body(directory, *args)`` for every model of ``dirs`` in this world, the parallel state
    torn down between them."""
    from megatron.core import parallel_state

    out = {}
    for name, d in dirs.items():
        out[name] = body(d, *args)
        parallel_state.destroy_model_parallel()
    return out


def hybrid_mtp_train_losses(mtp_dir: str, layout_kwargs: dict, batch: dict) -> dict:
    """tests/mtp_bodies.mtp_train_losses (the MTP loss alone through the schedule, scaling 0.3),
    plus the MTP layer's and the trunk's first full-attention layer's gradient sums."""
    from tests.mtp_bodies import mtp_train_losses

    return mtp_train_losses(mtp_dir, layout_kwargs, batch, grad_suffixes=(
        "eh_proj.weight", "mtp.layers.0.transformer_layer.self_attention.linear_qkv.weight",
        "decoder.layers.1.self_attention.linear_qkv.weight"))
