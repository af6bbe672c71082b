"""A tiny random HF model and the mcore model loaded from its weights give the same outputs
(max abs diff <= 1e-4, fp32) at every real token of a batch with left and right padding."""
from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.steps import outputs_and_roundtrip, outputs_of_models
from tests.tiny import saved_variants, padded_batch, tiny_config, tiny_hf_model

TOL = 1e-4
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=4.0, low_freq_factor=2.0, high_freq_factor=8.0,
    original_max_position_embeddings=16, rope_theta=500000.0,
)
VARIANTS = {  # name -> (model_type, config overrides)
    "llama": ("llama", {}),
    "llama_mha": ("llama", dict(num_key_value_heads=4)),
    "llama_tied": ("llama", dict(tie_word_embeddings=True)),
    "llama_headdim": ("llama", dict(head_dim=24)),
    "llama_rope_linear": ("llama", dict(rope_parameters=dict(rope_type="linear", factor=3.0, rope_theta=10000.0))),
    "llama_rope_llama3": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "mistral": ("mistral", dict(sliding_window=4096)),
    "mistral_tied": ("mistral", dict(tie_word_embeddings=True)),
    "qwen2": ("qwen2", {}),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=24)),
    "qwen3_tied": ("qwen3", dict(tie_word_embeddings=True, head_dim=8)),
}
CRITICS = ("llama", "qwen2", "qwen3", "mistral")


@pytest.fixture(scope="module")
def actor_models(tmp_path_factory):
    return saved_variants(tmp_path_factory, VARIANTS)


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def actor_outputs(request, actor_models):
    batch = padded_batch(200)
    dirs = {k: d for k, (d, _) in actor_models.items()}
    tp = request.param
    return batch, run_ranks(tp, outputs_of_models, dirs, dict(tp=tp), "actor", batch)[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_actor_logits_match_hf(variant, actor_models, actor_outputs):
    batch, outputs = actor_outputs
    _, hf = actor_models[variant]
    with torch.no_grad():
        ref = hf(**batch).logits
    real = batch["attention_mask"].bool()
    ours = outputs[variant][..., : ref.shape[-1]]
    diff = (ours - ref)[real].abs().max().item()
    assert diff <= TOL, f"{variant}: logits differ from HF by {diff:.3g}"
    assert ref[real].abs().max() > 0.1  # the comparison is not between near-zero tensors


@pytest.mark.parametrize("tp", [1, 2])
def test_critic_values_match_hf_token_classification(tp, tmp_path):
    batch = padded_batch(200)
    dirs, refs = {}, {}
    for model_type in CRITICS:
        hf = tiny_hf_model(tiny_config(model_type), role="critic")
        with torch.no_grad():
            hf.score.bias.fill_(0.25)  # a non-zero bias must come through
            refs[model_type] = hf(**batch).logits
        (tmp_path / model_type).mkdir()
        hf.save_pretrained(tmp_path / model_type)
        dirs[model_type] = str(tmp_path / model_type)
    outputs = run_ranks(tp, outputs_of_models, dirs, dict(tp=tp), "critic", batch)[0]
    real = batch["attention_mask"].bool()
    for model_type, ref in refs.items():
        assert outputs[model_type].shape == ref.shape  # [b, s, 1]
        diff = (outputs[model_type] - ref)[real].abs().max().item()
        assert diff <= TOL, f"{model_type} critic: values differ from HF by {diff:.3g}"


KV_BELOW_TP = {  # name -> (model_type, overrides, tp): fewer KV heads than TP ranks
    "llama_kv1_tp2": ("llama", dict(num_key_value_heads=1), 2),
    "qwen2_kv2_tp4": ("qwen2", dict(num_key_value_heads=2), 4),  # QKV bias too
}


@pytest.mark.parametrize("name", KV_BELOW_TP)
def test_tp_above_kv_heads_matches_hf(name, tmp_path):
    """megatron shares each KV head over tp / kv_heads ranks (all-gather of the fused qkv)."""
    model_type, overrides, tp = KV_BELOW_TP[name]
    hf = tiny_hf_model(tiny_config(model_type, **overrides))
    hf.save_pretrained(tmp_path)
    batch = padded_batch(200)
    with torch.no_grad():
        ref = hf(**batch).logits
    real = batch["attention_mask"].bool()
    for rank, out in enumerate(run_ranks(tp, outputs_and_roundtrip, str(tmp_path), dict(tp=tp), batch)):
        assert out["roundtrip_mismatch"] == [], f"rank {rank}: HF round trip differs"
        diff = (out["logits"][..., :200] - ref)[real].abs().max().item()
        assert diff <= TOL, f"{name} rank {rank}: logits differ from HF by {diff:.3g}"


def test_critic_from_sequence_classification_reward_model(tmp_path):
    """A *ForSequenceClassification reward model (num_labels=1, score head without bias) starts a
    critic: per-token values equal the HF head on the HF trunk's hidden states (bias 0); two
    labels are refused."""
    from transformers import AutoModelForSequenceClassification

    batch = padded_batch(200)
    config = tiny_config("qwen2", num_labels=1)
    config.pad_token_id = 0
    torch.manual_seed(3)
    hf = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager").eval()
    assert hf.score.bias is None  # the reward head this case is about
    with torch.no_grad():
        hidden = hf.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        ref = hf.score(hidden)  # [b, s, 1]
    hf.save_pretrained(tmp_path / "rm")
    out = run_ranks(1, outputs_of_models, {"qwen2": str(tmp_path / "rm")}, {}, "critic", batch)[0]["qwen2"]
    real = batch["attention_mask"].bool()
    diff = (out - ref)[real].abs().max().item()
    assert diff <= TOL, f"values differ from the reward model's head by {diff:.3g}"
    assert ref[real].abs().max() > 0.05

    config2 = tiny_config("qwen2", num_labels=2)
    AutoModelForSequenceClassification.from_config(config2).save_pretrained(tmp_path / "rm2")
    with pytest.raises(AssertionError, match=r"score.weight has 2 outputs \(num_labels=2\); a critic's value head has one"):
        run_ranks(1, outputs_of_models, {"qwen2": str(tmp_path / "rm2")}, {}, "critic", batch)
