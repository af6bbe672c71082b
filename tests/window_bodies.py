"""Tiny models with an active sliding window (mistral, qwen2, qwen3, mixtral, qwen3_moe, gpt_oss
with its sinks; windows of 3, 4, 5, 6 and 8 tokens, each built from another seed), their transformers references, and
the body that tests/test_context_parallel.py runs in its worlds (layouts named ``win_*``).

Windowed layers differ per model and sit unevenly over PP=2's two stages (2 layers each), so a
stage that numbers its layers from 0 instead of its offset gets the other stage's pattern:
qwen2 ``max_window_layers=1`` windows layers 1-3 (stage 0: full, windowed); qwen3's explicit
``layer_types`` window layers 0 and 3 (stage 1: full, windowed)."""
from __future__ import annotations

import json

import torch

from tests.tiny import hf_log_probs, padded_batch, tiny_config, tiny_hf_model

QWEN3_TYPES = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]
WINDOWED = {  # name -> (model_type, config overrides, seed)
    "mistral_w3": ("mistral", dict(sliding_window=3), 1),
    "qwen2_w5": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1), 2),
    "qwen3_w8": ("qwen3", dict(use_sliding_window=True, sliding_window=8, layer_types=QWEN3_TYPES, head_dim=8), 3),
    "mixtral_w4": ("mixtral", dict(sliding_window=4), 4),
    "qwen3_moe_w6": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=6), 5),  # every layer
    # sinks in every attention path (padded, packed, CP); layers 0 and 2 windowed
    "gpt_oss_w5": ("gpt_oss", dict(sliding_window=5), 6),
}
NO_SDPA = ("gpt_oss",)  # transformers refuses SDPA for these (sinks live in its eager kernel only)
# expert biases need expert-TP 1 (mcore_rl refuses etp > 1 for them; etp defaults to tp)
LAYOUT_EXTRA = {"gpt_oss": dict(etp=1)}
# the same models without their window (the HF configs' switch off)
NO_WINDOW = {"mistral": dict(sliding_window=None), "mixtral": dict(sliding_window=None),
             "qwen3_moe": dict(use_sliding_window=False),
             "qwen2": dict(use_sliding_window=False),
             # sliding layer types without a window: transformers 5.24's cache raises (TypeError)
             "qwen3": dict(use_sliding_window=False, layer_types=["full_attention"] * 4),
             "gpt_oss": dict(layer_types=["full_attention"] * 4)}


def windowed_config(name: str, window: bool = True):
    """The transformers config of WINDOWED[name] (``window=False``: the same without its window)."""
    model_type, overrides, _ = WINDOWED[name]
    return tiny_config(model_type, **{**overrides, **({} if window else NO_WINDOW[model_type])})


def save_windowed(base) -> dict:
    """Saves every WINDOWED model (causal LM) under ``base``; returns name -> directory. qwen2's
    config.json loses the ``layer_types`` transformers writes, as published Qwen2.5 files have
    none: mcore_rl derives the windowed layers from ``max_window_layers``."""
    dirs = {}
    for name, (model_type, overrides, seed) in WINDOWED.items():
        path = base / name
        tiny_hf_model(windowed_config(name), seed=seed).save_pretrained(path)
        if model_type == "qwen2" and "layer_types" not in overrides:
            raw = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({k: v for k, v in raw.items() if k != "layer_types"}))
        dirs[name] = str(path)
    return dirs


def references(name: str, logits_batch: dict, rl_batch: dict) -> dict:
    """transformers (fp32) for WINDOWED[name]: eager and SDPA logits [b, s, vocab] of
    ``logits_batch``, eager response log-probs [B, R] of ``rl_batch``, and the same model's
    eager logits without the window."""
    from transformers import AutoModelForCausalLM

    seed = WINDOWED[name][2]
    eager = tiny_hf_model(windowed_config(name), seed=seed)
    out = {"log_probs": hf_log_probs(eager, rl_batch)[0]}
    with torch.no_grad():
        out["eager"] = eager(**logits_batch).logits
        others = (("sdpa", windowed_config(name)), ("no_window", windowed_config(name, False)))
        for key, config in others[1:] if WINDOWED[name][0] in NO_SDPA else others:
            other = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa" if key == "sdpa" else "eager")
            other.load_state_dict(eager.state_dict())
            out[key] = other.eval()(**logits_batch).logits
    return out


LOGITS_BATCH = dict(vocab_size=200, batch=4, seq=16)  # padded_batch: left, right and both-sided padding


def window_layout(dirs: dict, layout_kwargs: dict, batch: dict) -> dict:
    """Every windowed model at ``layout_kwargs``: full logits [4, 16, vocab] of padded_batch;
    for padded and packed micro-batches (4 rows each: streams of 4 sequences) the response
    log-probs [B, R] of ``batch``, one update's metrics and the HF-named full gradients of that
    update (SGD at lr 0: the weights stay, the gradients stay in main_grad). Rank 0 returns
    them, the other ranks nothing."""
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.parallel import ParallelLayout, destroy_parallel_state, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine, OptimConfig
    from tests.test_context_parallel import _full_logits

    options = BuildOptions(moe=MoEOptions(router_dtype="fp64", load_balancing="none", aux_loss_coeff=0.0))
    optim = OptimConfig(name="sgd", lr=0.0, clip_grad=1e9, use_distributed_optimizer=False)
    out = {}
    for name, d in dirs.items():
        destroy_parallel_state()
        layout = ParallelLayout(**{**layout_kwargs, **LAYOUT_EXTRA.get(WINDOWED[name][0], {})})
        initialize_parallel_state(layout, seed=1)
        args = model_args_from_hf(d)
        engine = ModelEngine(args, layout, "actor", active_platform(), options, optim, d)
        res = {"logits": _full_logits(engine, padded_batch(**LOGITS_BATCH))}
        for mode in ("padded", "packed"):
            actor = Actor(engine, ActorConfig(micro_batch_size=4, ppo_mini_batch_size=8, entropy_coeff=0.01,
                                              use_remove_padding=mode == "packed"))
            res[mode] = {"log_probs": actor.compute_log_prob(batch)["log_probs"], "metrics": actor.update_policy(batch),
                         "grads": export_hf(engine.model, args, "actor", tensor_of=lambda p: p.main_grad.clone())}
        out[name] = res
    return out if torch.distributed.get_rank() == 0 else {}
