"""mcore_rl against verl's own FSDP2 engine (verl/workers/engine/fsdp/transformer_impl.py), both
driven by verl, on CPU in fp32, on a model whose pad token is a real token of the data (SmolLM2's
tokenizer: pad = eos = ``<|im_end|>``, which ends every chat turn; transformers' ``padding_idx``
gives its embedding row no gradient through the lookup, mcore_rl/models/padding_idx.py does the
same on megatron's embedding).

- verl's SFT trainer (its ``SFTTrainer``, every case in ONE launch of 2 processes:
  tests/verl/sft_runner.py): the logged loss and grad norm of 3 steps (parameters move: the loss
  falls) within 1e-5 relative. The llama: FSDP2 at DP=2 (packed rows) against mcore_rl at DP=2
  (padded rows) and at TP=2 + SP (packed rows), lr 1e-3. A tiny Qwen3.5 (dense) and Qwen3-Next
  (routed + shared experts): Gated DeltaNet and gated attention layers with 1 KV head, FSDP2 at DP=2
  on padded rows (its packed path carries the GDN state from one sequence into the next: measured
  here) against mcore_rl packed at DP=2 and at TP=2 + SP (fewer KV heads than TP), lr 1e-4. A tiny
  gpt-oss (random sinks, a sliding window of 6 on every other layer, chats of 18 to 38 tokens,
  experts with biases, a word-level tokenizer): FSDP2 at DP=2 on padded rows (transformers'
  gpt-oss masks ignore the position ids: its packed path attends across sequences, measured
  here) against mcore_rl at TP=2 + SP (packed rows, expert-TP 1) and EP=2 (padded rows), lr 1e-3; and verl's
  TrainingWorker on mcore_rl against transformers' eager forward (fsdp_bodies.gpt_oss_engine_body).
- verl's TrainingWorker with ``ppo_loss`` and ``value_loss`` (bodies: fsdp_bodies.py): FSDP2 at
  DP=2 (padded rows) against mcore_rl at TP=2 + SP (packed rows), one update of two optimizer
  steps: log-probs / entropy / values before it, verl's metrics and grad norms (1e-5 relative),
  the parameters after it (1e-5 absolute).

verl's FSDP engine on CPU: ``VERL_ENGINE_DEVICE=cuda`` (verl's registry switch: its FSDP engines
are registered for cuda / npu only), ``model.override_config.attn_implementation=eager`` (no
flash-attention here), ``engine.strategy=fsdp2``, ``engine.mixed_precision`` fp32 for param /
reduce / buffer dtypes (else bf16 autocast), ``engine.use_torch_compile=False`` (no compiler
here). FSDP runs its packed path in the SFT trainer (verl's default ``model.use_remove_padding``:
transformers 5.10 masks packed sequences apart by their position ids, eager attention too) and
padded rows in the TrainingWorker comparisons. Both engines: Adam(W) without weight decay
(megatron exempts norms and biases from it, torch's AdamW does not), constant lr, grad clip 1.
verl's value-model loader needs the test-only patch ``fsdp_bodies.eager_value_head`` (it
hard-codes flash-attention 2).
"""
from __future__ import annotations

import os
import time

import pytest
import torch

pytest.importorskip("verl")

from tests.dist import run_ranks  # noqa: E402
from tests.hybrid_bodies import EXPERTS, HYBRID  # noqa: E402
from tests.verl import fsdp_bodies as F  # noqa: E402
from tests.verl import sft_runner  # noqa: E402
from tests.verl.ppo_fixtures import TOKENIZER_FILES, save_chat_model  # noqa: E402
from tests.verl.verl_fixtures import save_sft_parquet, save_tiny_model  # noqa: E402

REL = 1e-5
FSDP = ("engine.strategy=fsdp2", "+engine.mixed_precision.param_dtype=fp32",
        "+engine.mixed_precision.reduce_dtype=fp32", "+engine.mixed_precision.buffer_dtype=fp32",
        "engine.use_torch_compile=False", "+model.override_config.attn_implementation=eager")
MCORE = ("hydra.searchpath=[pkg://mcore_rl.integrations.verl.hydra]", "engine=mcore_rl", "optim=megatron",
         "engine.dtype=float32")
PADDED = "model.use_remove_padding=False"
MCORE_LAYOUTS = {
    "dp2_padded": (PADDED,),
    "tp2_sp_packed": ("engine.tensor_model_parallel_size=2", "engine.sequence_parallel=True",
                      "model.use_remove_padding=True"),
    # context parallelism: every chat (44 to 74 tokens) split into 2 * 2 chunks, both ranks one DP rank
    "cp2_packed": ("engine.context_parallel_size=2", "model.use_remove_padding=True"),
    "cp2_padded": ("engine.context_parallel_size=2", PADDED),
}
# Gated DeltaNet + gated attention (tests/hybrid_bodies.py sizes: layer_types [linear, full, linear,
# linear], 4 GDN key heads: 2 per rank at TP=2), 1 KV head (fewer than TP=2), initializer_range 0.05:
# at tests/tiny.py's 0.1 transformers' own fp32 gradients of the tiny Qwen3.5 are 1.0e-5 (grad norm)
# from its float64 ones, the whole tolerance; at 0.05, < 1e-7
HYBRID_SFT = {
    "qwen3_5": ("qwen3_5_text", {**HYBRID, "num_key_value_heads": 1, "initializer_range": 0.05}),
    "qwen3_next": ("qwen3_next", {**HYBRID, **EXPERTS, "mlp_only_layers": [2], "num_key_value_heads": 1,
                                  "initializer_range": 0.05}),
}
# lr 1e-4 (as tests/verl/fsdp_bodies.py): at 1e-3 Adam's first steps amplify the engines' fp32
# rounding in the tiny Qwen3.5 to up to 9.1e-6 of grad norm by step 3 (seeds 0-2; first step
# <= 3e-7); at 1e-4, <= 4.1e-6 for both models and seeds 0-2
HYBRID_LR = 1e-4
# mcore_rl packs (GDN state restarted per sequence; verl's FSDP reference runs padded rows); at TP=2
# also verl's default gradient checkpointing (mcore_rl: full recompute of GDN and attention layers)
HYBRID_LAYOUTS = {
    "dp2_packed": ("model.use_remove_padding=True",),
    "tp2_sp_packed_recompute": MCORE_LAYOUTS["tp2_sp_packed"] + ("model.enable_gradient_checkpointing=True",),
}
# gpt-oss: attention sinks (random, N(0, 1): HF initialises them near 0), 4 layers alternating a
# sliding window of 6 tokens and full attention, 4 experts top-2 with biases, YaRN (original
# context 32 of 128, truncate false), with verl_fixtures' word-level tokenizer (vocab 64; chats of
# 6 to 16 words: 18 to 38 tokens). Not SmolLM2's 49152 tokens: the logged grad norm is itself an
# fp32 reduction, and over an untied [49152, 64] LM head it moves by 2e-5 with how it is split
# (measured: torch's fp32 norm of the same gradients 6.1397781, their float64 norm 6.1399049;
# FSDP at DP=2 and mcore_rl at TP=2 norm halves of it, mcore_rl at DP=2 the whole), while the
# gradients agree within 7e-7 per tensor. swiglu_limit 7.0: verl's transformers (5.10) hard-codes
# limit 7.0 and alpha 1.702, it reads neither from the config
GPT_OSS = {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 48, "head_dim": 16,
           "sliding_window": 6, "swiglu_limit": 7.0,
           "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0,
                               "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 10000.0}}
# verl's FSDP reference runs padded rows: transformers' GptOssModel builds its masks without the
# position ids, so its packed path attends across the sequences of a stream (the probe below)
GPT_OSS_LAYOUTS = {
    # megatron's experts with biases need expert-TP 1 (mcore_rl refuses etp = tp = 2)
    "tp2_sp_packed": MCORE_LAYOUTS["tp2_sp_packed"] + ("engine.expert_tensor_parallel_size=1",),
    "ep2_padded": ("engine.expert_model_parallel_size=2", "model.use_remove_padding=False"),
}
PROBES = {"qwen3_5": 7, "gpt_oss": 8}  # model -> seed of its FSDP packing probe


def save_chat_critic(directory: str, seed: int = 2) -> str:
    """A tiny ``LlamaForTokenClassification`` (num_labels 1) with SmolLM2's tokenizer."""
    import shutil

    from tests.real_model import smollm2_dir
    from tests.tiny import tiny_config, tiny_hf_model

    os.makedirs(directory, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(smollm2_dir(), "hf", name), directory)
    config = tiny_config("llama", vocab_size=49152, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         max_position_embeddings=256)
    tiny_hf_model(config, "critic", seed).save_pretrained(directory)
    return directory


def save_gpt_oss(directory: str) -> str:
    """A tiny ``GptOssForCausalLM`` (GPT_OSS) with verl_fixtures' tokenizer, random sinks and biases."""
    from transformers import AutoModelForCausalLM

    save_tiny_model(directory, model_type="gpt_oss", **GPT_OSS)
    model = AutoModelForCausalLM.from_pretrained(directory)
    torch.manual_seed(3)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_()
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory):
    """The llama with SmolLM2's tokenizer and its chats of 3 to 8 words (44 to 74 tokens); the
    gpt-oss (GPT_OSS) and its chats."""
    d = tmp_path_factory.mktemp("fsdp_sft")
    return {"model": save_chat_model(str(d / "model")), "train": save_sft_parquet(str(d / "train.parquet")),
            "gpt_oss": save_gpt_oss(str(d / "gpt_oss")),
            "gpt_oss_train": save_sft_parquet(str(d / "gpt_oss.parquet"), n_words=(6, 16))}


@pytest.fixture(scope="module")
def hybrid_inputs(tmp_path_factory):
    """The hybrids of HYBRID_SFT with SmolLM2's tokenizer (its pad id <|im_end|> a real token, a
    padding_idx row in both engines) and chats of 6 to 16 words: most rows 60 to 110 tokens."""
    d = tmp_path_factory.mktemp("hybrid_sft")
    models = {name: save_chat_model(str(d / name), model_type=model_type, **overrides)
              for name, (model_type, overrides) in HYBRID_SFT.items()}
    return {**models, "train": save_sft_parquet(str(d / "train.parquet"), n_words=(6, 16))}


def sft_overrides(model: str, train: str, ckpt: str, engine: tuple[str, ...], lr: float = 1e-3) -> list[str]:
    """verl's SFT trainer: 3 steps of 8 chats (2 micro-batches of 2 per rank) at ``lr``, no
    gradient checkpointing unless ``engine`` (last: it wins) turns it on."""
    return [f"model.path={model}", "model.enable_gradient_checkpointing=False",
            f"data.train_files={train}", "data.val_files=null", "data.train_batch_size=8",
            "data.micro_batch_size_per_gpu=2", "data.use_dynamic_bsz=False", "data.max_length=128",
            "data.num_workers=0", f"optim.lr={lr}", "optim.lr_warmup_steps=0", "optim.weight_decay=0",
            "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.total_training_steps=3",
            f"trainer.default_local_dir={ckpt}", "trainer.device=cpu", *engine]


def sft_cases(sft_inputs: dict, hybrid_inputs: dict) -> dict[str, tuple[str, str, tuple[str, ...], float]]:
    """'model/engine' -> (model dir, train parquet, engine overrides, lr): verl's FSDP2 engine (the
    reference: packed rows for the llama, padded rows for the hybrids and gpt-oss) and mcore_rl's layouts."""
    llama, gpt_oss = (sft_inputs["model"], sft_inputs["train"]), (sft_inputs["gpt_oss"], sft_inputs["gpt_oss_train"])
    cases = {"llama/fsdp": (*llama, FSDP, 1e-3), "gpt_oss/fsdp": (*gpt_oss, FSDP + (PADDED,), 1e-3)}
    cases.update({f"llama/{name}": (*llama, MCORE + layout, 1e-3) for name, layout in MCORE_LAYOUTS.items()})
    cases.update({f"gpt_oss/{name}": (*gpt_oss, MCORE + layout, 1e-3) for name, layout in GPT_OSS_LAYOUTS.items()})
    for model in HYBRID_SFT:
        hybrid = (hybrid_inputs[model], hybrid_inputs["train"])
        cases[f"{model}/fsdp"] = (*hybrid, FSDP + (PADDED,), HYBRID_LR)
        cases.update({f"{model}/{name}": (*hybrid, MCORE + layout, HYBRID_LR)
                      for name, layout in HYBRID_LAYOUTS.items()})
    return cases


@pytest.fixture(scope="module")
def sft_runs(sft_inputs, hybrid_inputs, tmp_path_factory) -> dict:
    """Every SFT case, the FSDP packing probes (PROBES) and the gpt-oss engine body in ONE launch
    of 2 processes (tests/verl/sft_runner.py): 'model/engine' -> [(loss, grad norm)] by step, or
    the error text; 'probe/<model>' -> fsdp_bodies.fsdp_packing_probe's result, 'gpt_oss_engine'
    -> fsdp_bodies.gpt_oss_engine_body's (or the error text)."""
    d = str(tmp_path_factory.mktemp("sft_runs"))
    plan = [{"case": case, "sft": sft_overrides(model, train, f"{d}/ckpt{i}", engine, lr),
             "metrics": f"{d}/metrics{i}.jsonl"}
            for i, (case, (model, train, engine, lr)) in enumerate(sft_cases(sft_inputs, hybrid_inputs).items())]
    models = {"qwen3_5": hybrid_inputs["qwen3_5"], "gpt_oss": sft_inputs["gpt_oss"]}
    plan += [{"case": f"probe/{m}", "call": "tests.verl.fsdp_bodies:fsdp_packing_probe", "args": [models[m], seed],
              "out": f"{d}/probe_{m}.pt"} for m, seed in PROBES.items()]
    plan.append({"case": "gpt_oss_engine", "call": "tests.verl.fsdp_bodies:gpt_oss_engine_body",
                 "args": [sft_inputs["gpt_oss"], 9], "out": f"{d}/gpt_oss_engine.pt"})
    started = time.time()
    proc = sft_runner.launch(plan, d, timeout_s=1500)
    print(f"\n{len(plan)} runs in one launch: {time.time() - started:.0f} s")
    out = {e["case"]: sft_runner.read_sft(e["metrics"]) for e in plan if "sft" in e}
    for e in (e for e in plan if "call" in e):
        out[e["case"]] = torch.load(e["out"]) if os.path.isfile(e["out"]) else f"no result\n{_tail(e['out'], proc)}"
    out["log"] = proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def _tail(path: str, proc) -> str:
    error = path + ".error"
    return open(error).read() if os.path.isfile(error) else proc.stdout[-3000:] + proc.stderr[-6000:]


def _steps(runs: dict, case: str) -> list[tuple[float, float]]:
    out = runs[case]
    assert isinstance(out, list) and len(out) == 3, f"{case}: {out}\n{runs['log']}"
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def test_sft_data_holds_the_pad_token_inside_the_loss_context(sft_inputs):
    """verl's own SFT dataset on the parquet: <|im_end|> (the pad id) is an input every loss token
    attends to, and a loss target."""
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    tok = AutoTokenizer.from_pretrained(sft_inputs["model"])
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    config = OmegaConf.create({"pad_mode": "no_padding", "max_length": 128})  # as sft_overrides runs it
    data = MultiTurnSFTDataset(sft_inputs["train"], tok, config)
    in_context = targets = 0
    for i in range(len(data)):
        ids, loss = data[i]["input_ids"], data[i]["loss_mask"].bool()
        last = int(loss.nonzero().max())
        in_context += int((ids[:last] == tok.pad_token_id).sum())  # inputs before a loss token
        targets += int((ids[loss] == tok.pad_token_id).sum())
    print(f"\n{len(data)} chats: <|im_end|> (pad id {tok.pad_token_id}) {in_context} times as an input before "
          f"a loss token, {targets} times as a loss target")
    assert in_context >= 2 * len(data) and targets >= len(data), (in_context, targets, len(data))


def test_hybrid_sft_inputs_hold_what_the_comparison_needs(hybrid_inputs):
    """The hybrids mix both layer kinds, have 1 KV head (fewer than TP=2: gated attention relies
    on the platform fix gated_attention_gate_follows_query) and >= 2 Gated DeltaNet key heads per
    TP rank, Qwen3-Next its routed and shared experts; most chats are longer than the delta rule's
    chunk of 64 tokens (verl's own SFT dataset on the parquet)."""
    from omegaconf import OmegaConf
    from transformers import AutoConfig, AutoTokenizer
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    for name in HYBRID_SFT:
        c = AutoConfig.from_pretrained(hybrid_inputs[name])
        assert set(c.layer_types) == {"linear_attention", "full_attention"}, (name, c.layer_types)
        assert c.num_key_value_heads == 1 and c.linear_num_key_heads // 2 >= 2, name
    nxt = AutoConfig.from_pretrained(hybrid_inputs["qwen3_next"])
    assert nxt.model_type == "qwen3_next" and nxt.num_experts > 1 and nxt.shared_expert_intermediate_size > 0
    tok = AutoTokenizer.from_pretrained(hybrid_inputs["qwen3_5"])
    data = MultiTurnSFTDataset(hybrid_inputs["train"], tok, OmegaConf.create({"pad_mode": "no_padding",
                                                                              "max_length": 128}))
    lengths = [len(data[i]["input_ids"]) for i in range(len(data))]
    print(f"\nhybrid chats: {sum(n > 64 for n in lengths)} of {len(lengths)} longer than 64 tokens "
          f"({min(lengths)} to {max(lengths)})")
    assert sum(n > 64 for n in lengths) >= len(lengths) // 2 and min(lengths) < 64, lengths


def test_gpt_oss_sft_inputs_hold_what_the_comparison_needs(sft_inputs):
    """The tiny gpt-oss alternates windowed and full layers, its sinks are far from 0, every chat
    (verl's own SFT dataset on the parquet) is 3 windows long or more, and transformers' own logits
    (eager) of the longest chat change when the window or the sinks are taken away."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from verl.utils.dataset.multiturn_sft_dataset import MultiTurnSFTDataset

    model = AutoModelForCausalLM.from_pretrained(sft_inputs["gpt_oss"]).eval()
    c = model.config
    assert c._attn_implementation == "eager" and c.layer_types == ["sliding_attention", "full_attention"] * 2
    assert min(float(layer.self_attn.sinks.abs().max()) for layer in model.model.layers) > 0.5
    tok = AutoTokenizer.from_pretrained(sft_inputs["gpt_oss"])
    data = MultiTurnSFTDataset(sft_inputs["gpt_oss_train"], tok, OmegaConf.create({"pad_mode": "no_padding",
                                                                                   "max_length": 128}))
    ids = [data[i]["input_ids"].tolist() for i in range(len(data))]
    print(f"\ngpt-oss chats: {min(map(len, ids))} to {max(map(len, ids))} tokens, window {c.sliding_window}")
    assert min(len(x) for x in ids) >= 3 * c.sliding_window, min(len(x) for x in ids)
    longest = torch.tensor([max(ids, key=len)])
    with torch.no_grad():
        reference = model(longest).logits
        c.sliding_window = 10 ** 4
        no_window = model(longest).logits
        c.sliding_window = GPT_OSS["sliding_window"]
        for layer in model.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        no_sinks = model(longest).logits
    assert (no_window - reference).abs().max() > 1e-2 and (no_sinks - reference).abs().max() > 1e-2


SFT_COMPARISONS = [("llama", layout) for layout in MCORE_LAYOUTS] + [
    (model, layout) for model in HYBRID_SFT for layout in HYBRID_LAYOUTS] + [
    ("gpt_oss", layout) for layout in GPT_OSS_LAYOUTS]


@pytest.mark.parametrize("model,layout", SFT_COMPARISONS)
def test_sft_trainer_mcore_rl_equals_fsdp(sft_runs, model, layout):
    """verl's SFT trainer logs the same loss and grad norm per step with engine=mcore_rl as with
    verl's FSDP2 engine (packed rows for the llama, padded rows for the hybrids and gpt-oss: see
    test_verl_fsdp_packed_path_leaks_gdn_state_between_sequences and
    test_verl_fsdp_packed_path_attends_across_gpt_oss_sequences)."""
    fsdp, ours = _steps(sft_runs, f"{model}/fsdp"), _steps(sft_runs, f"{model}/{layout}")
    falls = 0.995 if model in HYBRID_SFT else 0.95  # parameters move: the loss falls (hybrids at lr 1e-4)
    assert ours[-1][0] < falls * ours[0][0] and fsdp[-1][0] < falls * fsdp[0][0], (ours, fsdp)
    diffs = {what: [_rel(o[i], f[i]) for o, f in zip(ours, fsdp)] for i, what in enumerate(("loss", "grad_norm"))}
    print(f"\n{model} {layout}: relative difference to FSDP per step " + "; ".join(
        f"{k} " + " ".join(f"{d:.1e}" for d in v) for k, v in diffs.items()))
    assert max(max(v) for v in diffs.values()) <= REL, (model, layout, diffs, ours, fsdp)


def test_verl_fsdp_packed_path_leaks_gdn_state_between_sequences(sft_runs):
    """Why the hybrids' reference runs on padded rows: verl's FSDP engine with
    use_remove_padding=True runs transformers' Gated DeltaNet over the whole packed stream of a
    micro-batch (verl 0.9.1 patches it for the vision-language wrappers, model_type qwen3_5 /
    qwen3_5_moe, only; for qwen3_5_text and Qwen3-Next not at all), so every sequence after the
    first starts from its predecessor's recurrent state. The tiny Qwen3.5's response log-probs,
    packed vs padded, by the row's place in a pack of 4."""
    probe = sft_runs["probe/qwen3_5"]
    assert isinstance(probe, dict), probe
    assert probe["engines"] == ["FSDPEngineWithLMHead"] * 2, probe["engines"]
    first, later = probe["by_place"][0], probe["by_place"][1:]
    print("\nverl FSDP packed vs padded, max |log-prob difference| by place in the pack: "
          + " ".join(f"{d:.3g}" for d in probe["by_place"]) + f" (rows of {probe['lengths']} tokens)")
    assert first <= 1e-5 and min(later) > 1e-2, probe["by_place"]


def test_verl_fsdp_packed_path_attends_across_gpt_oss_sequences(sft_runs):
    """Why gpt-oss's reference runs on padded rows: transformers' GptOssModel builds its causal
    and sliding-window masks without the position ids (transformers 5.10 and 5.24), so on verl's
    packed path (use_remove_padding=True: one stream per micro-batch, no attention mask) every
    sequence after the first attends to its predecessors. Response log-probs, packed vs padded,
    by the row's place in a pack of 4."""
    probe = sft_runs["probe/gpt_oss"]
    assert isinstance(probe, dict), probe
    print("\ngpt-oss, verl FSDP packed vs padded, max |log-prob difference| by place in the pack: "
          + " ".join(f"{d:.3g}" for d in probe["by_place"]))
    assert probe["by_place"][0] <= 1e-5 and min(probe["by_place"][1:]) > 1e-2, probe["by_place"]


def test_gpt_oss_engine_scores_as_transformers_and_updates(sft_runs):
    """verl's TrainingWorker on mcore_rl (DP=2, packed rows) with a tiny gpt-oss: response
    log-probs of rows of 16 tokens (left-padded prompts, past the window of 6) equal transformers'
    eager forward of the same directory; an update of two optimizer steps with verl's ppo_loss
    moves them, and transformers given the exported weights scores the rows as the engine does."""
    r = sft_runs["gpt_oss_engine"]
    assert isinstance(r, dict), r
    mask = r["mask"].bool()
    hf, before, after = r["hf"][mask], r["before"][mask], r["export"]["engine_log_probs"][mask]
    assert float((before - hf).abs().max()) <= 1e-4 and hf.abs().max() > 1.0
    assert float((r["hf_no_window"][mask] - hf).abs().max()) > 1e-2  # the window acts on these rows
    assert len(r["metrics"]["grad_norm"]) == 2 and min(r["metrics"]["grad_norm"]) > 0, r["metrics"]
    assert float((after - before).abs().max()) > 1e-3  # the update moved the policy
    assert float((r["export"]["hf_log_probs"][mask] - after).abs().max()) <= 1e-4


def test_fsdp_on_cpu_needs_the_registry_switch_and_the_eager_value_head(tmp_path, monkeypatch):
    """Why the workarounds exist: without VERL_ENGINE_DEVICE verl finds no FSDP engine on the CPU
    platform, and its value-model loader fails for want of flash-attention 2."""
    import verl.utils.model as model_utils
    from transformers import AutoConfig
    from verl.workers.engine.base import EngineRegistry

    monkeypatch.delenv("VERL_ENGINE_DEVICE", raising=False)
    with pytest.raises(ValueError, match="No engine registered for device='cpu'"):
        EngineRegistry.get_engine_cls("language_model", "fsdp2")
    monkeypatch.setenv("VERL_ENGINE_DEVICE", "cuda")
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__ == "FSDPEngineWithLMHead"
    critic, verl_loader = save_chat_critic(str(tmp_path / "critic")), model_utils.load_valuehead_model
    config = AutoConfig.from_pretrained(critic, attn_implementation="eager")
    with pytest.raises(RuntimeError, match="not a value head model") as failed:
        verl_loader(critic, torch.float32, config, False)
    assert "FlashAttention2" in str(failed.value.__cause__)
    with F.eager_value_head():
        model = model_utils.load_valuehead_model(critic, torch.float32, config, False)
    assert type(model).__name__ == "LlamaForTokenClassification" and model.config._attn_implementation == "eager"
    assert model_utils.load_valuehead_model is verl_loader  # put back


@pytest.fixture(scope="module")
def ppo(tmp_path_factory) -> list[dict]:
    d = tmp_path_factory.mktemp("fsdp_ppo")
    actor = save_chat_model(str(d / "actor"), seed=1)
    critic = save_chat_critic(str(d / "critic"))
    return run_ranks(2, F.fsdp_and_mcore_body, actor, critic, 7)


def _compare_metrics(fsdp: dict, mcore: dict, keys: tuple[str, ...], absolute: tuple[str, ...] = ()) -> float:
    """Prints the relative difference per metric and entry (optimizer step, or micro-batch for
    verl's per-micro-batch metrics); the ``absolute`` ones as differences (means of values of
    either sign). Returns the largest."""
    diffs = {}
    for key in keys + absolute:
        assert len(fsdp[key]) == len(mcore[key]) >= 1, (key, fsdp[key], mcore[key])
        diffs[key] = [abs(m - f) if key in absolute else _rel(m, f) for m, f in zip(mcore[key], fsdp[key])]
    print("\n".join(f"  {k}: " + " ".join(f"{d:.1e}" for d in v) for k, v in diffs.items()))
    return max(max(v) for v in diffs.values())


def _check_inputs(r: dict) -> None:
    """The pad id is a real token (inside the attention mask) of prompts and responses."""
    batch, pad_id = r["batch"], r["pad_id"]
    real = batch["attention_mask"].bool()
    prompt, response = batch["input_ids"][:, :F.R.PROMPT], batch["input_ids"][:, F.R.PROMPT:]
    pads_prompt = int((prompt[real[:, :F.R.PROMPT]] == pad_id).sum())
    pads_response = int((response[real[:, F.R.PROMPT:]] == pad_id).sum())
    print(f"\npad id {pad_id} as a real token: {pads_prompt} in prompts, {pads_response} in responses")
    assert pads_prompt >= F.ROWS and pads_response >= 4, (pads_prompt, pads_response)


def test_ppo_loss_mcore_rl_equals_fsdp(ppo):
    r = ppo[0]["actor"]  # rank 0: an output rank of both engines (FSDP DP rank 0, mcore TP rank 0)
    assert r["engines"] == ["FSDPEngineWithLMHead", "McoreRLEngineWithLMHead"], r["engines"]
    _check_inputs(r)
    mask, order = r["batch"]["response_mask"].bool(), r["order"]
    for key in ("log_probs", "entropy"):
        fsdp, mcore = r[f"fsdp_{key}"][order], r[f"mcore_{key}"]
        assert float((fsdp - mcore)[mask[order]].abs().max()) <= REL * float(fsdp[mask[order]].abs().max()), key
    fsdp, mcore = r["fsdp"], r["mcore"]
    assert len(fsdp["grad_norm"]) == 2 and fsdp["lr"] == mcore["lr"]
    assert min(fsdp["actor/pg_clipfrac"]) > 0.05 and min(fsdp["actor/pg_clipfrac_lower"]) > 0.05  # both clips act
    print(f"actor, relative difference to FSDP per step; parameters {r['params']['diff']:.3g} "
          f"(moved {r['params']['moved']:.3g})")
    worst = _compare_metrics(fsdp, mcore, ("actor/pg_loss", "actor/pg_clipfrac", "actor/pg_clipfrac_lower",
                                           "actor/ppo_kl", "actor/entropy_loss", "kl_loss", "loss", "grad_norm"))
    assert worst <= REL, worst
    for rank in ppo:  # every rank exports the whole model
        p = rank["actor"]["params"]
        assert set(p["names"][0]) - set(p["names"][1]) == {"lm_head.weight"}  # tied: FSDP names both
        assert p["moved"] > 10 * REL and p["diff"] <= REL, p["diff"]


def test_value_loss_mcore_rl_equals_fsdp(ppo):
    r = ppo[0]["critic"]
    assert r["engines"] == ["FSDPEngineWithValueHead", "McoreRLEngineWithValueHead"], r["engines"]
    _check_inputs(r)
    mask, order = r["batch"]["response_mask"].bool(), r["order"]
    fsdp_v, mcore_v = r["fsdp_values"][order], r["mcore_values"]
    assert float((fsdp_v - mcore_v)[mask[order]].abs().max()) <= REL * float(fsdp_v[mask[order]].abs().max())
    fsdp, mcore = r["fsdp"], r["mcore"]
    assert len(fsdp["grad_norm"]) == 2 and max(fsdp["critic/vf_clipfrac"]) > 0  # the value clip acts
    # vpred_mean: a mean of values of both signs (one is 0.006 from values ~1): compared absolutely
    print(f"critic, difference to FSDP per step (vf_clipfrac, vpred_mean: per micro-batch; vpred_mean "
          f"absolute); parameters {r['params']['diff']:.3g} (moved {r['params']['moved']:.3g})")
    worst = _compare_metrics(fsdp, mcore, ("critic/vf_loss", "critic/vf_clipfrac", "loss", "grad_norm"),
                             absolute=("critic/vpred_mean",))
    assert worst <= REL, worst
    for rank in ppo:
        p = rank["critic"]["params"]
        assert p["names"][0] == p["names"][1] and p["moved"] > 10 * REL and p["diff"] <= REL, p["diff"]
