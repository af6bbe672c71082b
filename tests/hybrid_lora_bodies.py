"""Bodies for tests/test_lora_hybrid.py (LoRA on Qwen3.5 / Qwen3-Next: Gated DeltaNet projections
and gated attention), run inside N-rank worlds (tests/dist.py)."""
from __future__ import annotations

import torch

from tests.lora_bodies import lora_update

# 2 layers: a Gated DeltaNet layer, then gated full attention (2 GDN key heads, 4 value heads)
HYBRID_LAYERS = dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])


def updates(cases: list[tuple[str, str, dict, dict, dict, dict, bool]]) -> dict:
    """``lora_update`` for each (name, HF dir, layout, lora, batch, actor, moe) in one world: name -> result."""
    from mcore_rl.parallel.layout import destroy_parallel_state

    out = {}
    for name, hf_dir, layout, lora, batch, actor, moe in cases:
        out[name] = lora_update(hf_dir, layout, lora, batch, actor, moe)
        destroy_parallel_state()
    return out


def save_merge_resume(hf_dir: str, lora: dict, root: str, moe: bool) -> dict:
    """A LoRA actor trained 1 update and saved adapter-only at this world's layout (TP=2); its live
    merged HF export and adapters (PEFT names); then resumed at TP=1 (DP=2): the adapters loaded."""
    from mcore_rl.lora.layers import merged_tensor_of
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel.layout import destroy_parallel_state
    from tests.ckpt_bodies import manager, train
    from tests.lora_ckpt_bodies import adapters_full, build
    from tests.steps import EXACT_MOE

    moe_options = EXACT_MOE if moe else None
    engine, actor = build(hf_dir, dict(tp=2, sequence_parallel=True), seed=1, lora=lora, moe=moe_options)
    train(actor, range(1))
    manager(root, optimizer_sharding="fully_reshardable").save(1, {"actor": engine}, {"step": 1})
    out = {"adapters": adapters_full(engine),
           "merged": {k: v.clone() for k, v in export_hf(engine.model, engine.args, "actor",
                                                           merged_tensor_of(engine.model)).items()}}
    destroy_parallel_state()
    engine, _ = build(hf_dir, {}, seed=77, lora=lora, moe=moe_options)
    manager(root).resume({"actor": engine})
    out["resumed"] = adapters_full(engine)
    destroy_parallel_state()
    return out
