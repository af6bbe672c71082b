"""Tiny hybrid models (Qwen3-Next, Qwen3.5 dense and MoE) and the bodies tests/test_hybrid.py
runs inside N-rank worlds: logits, the HF round trip, and packed vs padded forward + gradients."""
from __future__ import annotations

import torch

from tests.tiny import tiny_config, tiny_hf_model

# layer pattern with a full-attention layer second: at PP=2 the stage boundary falls between the
# kinds (stage 0: GDN + attention, stage 1: GDN + GDN); 2 GDN key heads (4 value heads) per TP
# rank at TP=2; key and value head sizes differ so a swapped size shows
HYBRID = dict(head_dim=16, linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=16,
              linear_value_head_dim=8, linear_conv_kernel_dim=4,
              layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=80)
VARIANTS = {  # name -> (model_type, config overrides)
    "qwen3_5": ("qwen3_5_text", HYBRID),
    "qwen3_next": ("qwen3_next", {**HYBRID, **EXPERTS, "mlp_only_layers": [2]}),  # one dense-MLP layer
    "qwen3_5_moe": ("qwen3_5_moe_text", {**HYBRID, **EXPERTS}),
}


def save_hybrids(base, variants: dict = VARIANTS, seed: int = 0) -> dict:
    """name -> (HF directory, HF model) of each variant, saved under ``base``."""
    out = {}
    for name, (model_type, overrides) in variants.items():
        hf = tiny_hf_model(tiny_config(model_type, **overrides), seed=seed)
        path = base / name
        hf.save_pretrained(path)
        out[name] = (str(path), hf)
    return out


def long_batch(vocab: int, seed: int = 5) -> dict:
    """[4, 100] rows longer than the delta rule's 64-token chunks: left-padded (70 tokens), a
    single token, right-padded (90) and padded on both sides (45)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (4, 100), generator=g)
    mask = torch.zeros(4, 100, dtype=torch.long)
    mask[0, 30:] = 1
    mask[1, 99:] = 1
    mask[2, :90] = 1
    mask[3, 20:65] = 1
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def logits_and_roundtrip(dirs: dict, layout_kwargs: dict, batch: dict) -> dict:
    """Per model: logits [b, s, vocab] of one forward (every rank) and the HF names whose
    exported tensor is not bit-equal to the file's."""
    from megatron.core import parallel_state

    from tests.steps import outputs_and_roundtrip

    out = {}
    for name, d in dirs.items():
        out[name] = outputs_and_roundtrip(d, layout_kwargs, batch)
        parallel_state.destroy_model_parallel()
    return out


def _real_token_loss(vocab: int, where):
    """A loss over every real token's logits with fixed per-(row, column) weights; ``where(out,
    batch)`` -> [n_real, vocab] logits in (row, column) order."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    def loss_fn(batch, out: torch.Tensor):
        logits = where(gather_from_tensor_model_parallel_region(out)[..., :vocab], batch)
        g = torch.Generator().manual_seed(11)
        weights = torch.randn(logits.shape, generator=g) / vocab**0.5
        return (logits * weights).sum() / logits.shape[0], {"logits": logits.detach()}

    return loss_fn


def _padded_tokens(out: torch.Tensor, batch) -> torch.Tensor:
    return out[batch["attention_mask"].bool()]


def _packed_tokens(out: torch.Tensor, batch) -> torch.Tensor:
    index = batch.packed.index[batch["attention_mask"].bool()]
    return out[0, index]


def packed_and_padded(dirs: dict, layout_kwargs: dict, batch: dict, budget: int) -> dict:
    """Per model and mode ('padded', 'packed' in a stream of ``budget`` tokens): real-token
    logits [n_real, vocab] and HF-named full gradients of one forward/backward."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads

    from mcore_rl.models.ddp import wrap_with_ddp
    from mcore_rl.models.forward import run_schedule
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.models.micro_batch import MicroBatch
    from mcore_rl.models.packing import pack
    from mcore_rl.rl.engine import share_from_last_stage
    from tests.steps import _build

    stream = pack(batch["input_ids"], batch["attention_mask"], budget)
    out = {}
    for name, d in dirs.items():
        args, chunks = _build(d, layout_kwargs, "actor")
        model = wrap_with_ddp(chunks, use_distributed_optimizer=False)
        for mode, mb, where in (("padded", MicroBatch(batch), _padded_tokens),
                                ("packed", MicroBatch(batch, packed=stream), _packed_tokens)):
            for m in model:
                m.zero_grad_buffer()
            res = run_schedule(model, [mb], _real_token_loss(args.vocab_size, where), forward_only=False)
            finalize_model_grads(model)
            out[f"{name}/{mode}"] = {
                "logits": share_from_last_stage(res[0]["logits"] if res else None),
                "grads": export_hf(model, args, "actor", tensor_of=lambda p: p.main_grad.clone()),
            }
        parallel_state.destroy_model_parallel()
    return out
