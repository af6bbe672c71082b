"""Tiny HF models built from configs (nothing downloaded) and batches with left/right padding."""
from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

BASE = dict(
    vocab_size=200,  # not a multiple of 128 * tp: exercises vocab padding
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    initializer_range=0.1,  # 5x HF default: layout bugs show far above fp32 rounding (~1e-6)
)


MOE = {  # 4 experts, top-2; expert ffn != dense ffn so a mix-up shows as a shape error
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      shared_expert_intermediate_size=80, norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                      norm_topk_prob=True, head_dim=24),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48),
    # sigmoid router, correction bias, shared expert, a dense first layer, partial rotary
    "glm4_moe": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                     n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True,
                     use_qk_norm=True, head_dim=24, partial_rotary_factor=0.5, num_nextn_predict_layers=0),
    # MLA (low-rank query, v narrower than q/k), groups of 4 experts (topk 2 = 2 * topk_group 1)
    "deepseek_v3": dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=32,
                        kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12,
                        num_key_value_heads=4, num_nextn_predict_layers=0),
    # gpt-oss: 4 experts top-2 (expert ffn is intermediate_size), sliding (even) and full layers
    # with a window of 5 tokens (shorter than the test sequences), YaRN with truncate=false and an
    # original context inside the sequences, a low SwiGLU limit so that both clamps fire
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, head_dim=16,
                    sliding_window=5, swiglu_limit=1.0,
                    rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=8.0, beta_slow=1.0, truncate=False,
                                         original_max_position_embeddings=16, rope_theta=10000.0)),
}
# hybrids: Gated DeltaNet sizes (HF's defaults are full-size); MoE hybrids also their experts
_GDN = dict(head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=8)
_HYBRID_EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48,
                       shared_expert_intermediate_size=80)
MOE.update(qwen3_5_text=_GDN, qwen3_next={**_GDN, **_HYBRID_EXPERTS}, qwen3_5_moe_text={**_GDN, **_HYBRID_EXPERTS})


def tiny_config(model_type: str, **overrides):
    """A transformers config for ``model_type`` with BASE sizes (+ MOE sizes) and ``overrides``."""
    kwargs = {**BASE, **MOE.get(model_type, {}), **overrides}
    if model_type in ("mistral", "mixtral"):
        kwargs.setdefault("sliding_window", None)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_hf_model(config, role: str = "actor", seed: int = 0):
    """Random HF model (CausalLM for the actor, TokenClassification num_labels=1 for the critic)."""
    torch.manual_seed(seed)
    if role == "actor":
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    else:
        config.num_labels = 1
        model = AutoModelForTokenClassification.from_config(config, attn_implementation="eager")
    with torch.no_grad():  # non-trivial norms and biases so their mapping is tested too
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a trained router's balancing bias
                b.copy_(torch.randn_like(b) * 0.05)
    return model.eval()


def saved_variants(tmp_path_factory, variants: dict) -> dict:
    """name -> (HF directory, model) for ``variants`` {name: (model_type, config overrides)}."""
    models = {}
    for name, (model_type, overrides) in variants.items():
        hf = tiny_hf_model(tiny_config(model_type, **overrides))
        d = tmp_path_factory.mktemp(name)
        hf.save_pretrained(d)
        models[name] = (str(d), hf)
    return models


def padded_batch(vocab_size: int, batch: int = 4, seq: int = 16, seed: int = 1) -> dict:
    """input_ids [b, s] and attention_mask [b, s]: rows left-padded, right-padded and full."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[0, :5] = 0  # left padding
    mask[1, -4:] = 0  # right padding
    if batch > 3:
        mask[3, :2] = 0
        mask[3, -3:] = 0  # both sides
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask}


def rl_batch(vocab_size: int, batch: int = 8, prompt: int = 10, response: int = 6, seed: int = 3) -> dict:
    """A trainer's batch: left-padded prompts then right-padded responses ([B, P + R])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_size, (batch, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    for row in range(batch):
        mask[row, : int(torch.randint(0, prompt - 1, (1,), generator=g))] = 0  # left padding
        keep = int(torch.randint(1, response + 1, (1,), generator=g))
        mask[row, prompt + keep :] = 0  # right padding of the response
    ids = ids.masked_fill(mask == 0, 0)
    return {"input_ids": ids, "attention_mask": mask, "responses": ids[:, prompt:].clone()}


def hf_log_probs(model, batch: dict, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference [B, R] log-probs and entropies from a HF causal LM (full-vocab softmax)."""
    r = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, -r - 1 : -1].double() / temperature
    logp = torch.log_softmax(logits, -1)
    mask = batch["attention_mask"][:, -r:].double()
    lp = logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1) * mask
    ent = -(logp.exp() * logp).sum(-1) * mask
    return lp.float(), ent.float()


def saved_tiny_llama(directory, num_hidden_layers: int = 4) -> str:
    """A tiny random llama written with save_pretrained into ``directory``; returns its path."""
    tiny_hf_model(tiny_config("llama", num_hidden_layers=num_hidden_layers)).save_pretrained(directory)
    return str(directory)
