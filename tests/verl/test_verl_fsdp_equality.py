"""mcore_rl against verl's own FSDP2 engine (verl/workers/engine/fsdp/transformer_impl.py), both
driven by verl, on CPU in fp32, on a model whose pad token is a real token of the data (SmolLM2's
tokenizer: pad = eos = ``<|im_end|>``, which ends every chat turn; transformers' ``padding_idx``
gives its embedding row no gradient through the lookup, mcore_rl/models/padding_idx.py does the
same on megatron's embedding).

- verl's SFT trainer (``torchrun -m verl.trainer.sft_trainer``): FSDP2 at DP=2 (packed rows)
  against mcore_rl at DP=2 (padded rows) and at TP=2 + SP (packed rows): the logged loss and grad
  norm of 3 steps at lr 1e-3 (parameters move: the loss falls) within 1e-5 relative.
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
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl")

from tests.dist import run_ranks  # noqa: E402
from tests.verl import fsdp_bodies as F  # noqa: E402
from tests.verl.ppo_fixtures import TOKENIZER_FILES, save_chat_model  # noqa: E402
from tests.verl.verl_fixtures import save_sft_parquet  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REL = 1e-5
FSDP = ("engine.strategy=fsdp2", "+engine.mixed_precision.param_dtype=fp32",
        "+engine.mixed_precision.reduce_dtype=fp32", "+engine.mixed_precision.buffer_dtype=fp32",
        "engine.use_torch_compile=False", "+model.override_config.attn_implementation=eager")
MCORE = ("hydra.searchpath=[pkg://mcore_rl.integrations.verl.hydra]", "engine=mcore_rl", "optim=megatron",
         "engine.dtype=float32")
MCORE_LAYOUTS = {
    "dp2_padded": ("model.use_remove_padding=False",),
    "tp2_sp_packed": ("engine.tensor_model_parallel_size=2", "engine.sequence_parallel=True",
                      "model.use_remove_padding=True"),
}


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


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fsdp_sft")
    return {"model": save_chat_model(str(d / "model")), "train": save_sft_parquet(str(d / "train.parquet")),
            "dir": str(d)}


def sft(inputs: dict, ckpt: str, engine: tuple[str, ...], env: dict | None = None) -> list[tuple[float, float]]:
    """verl's SFT trainer on 2 CPU processes, 3 steps of 8 chats (2 micro-batches of 2 per rank),
    lr 1e-3; returns the logged (train loss, grad norm) by step."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "verl.trainer.sft_trainer",
           *engine, f"model.path={inputs['model']}", "model.enable_gradient_checkpointing=False",
           f"data.train_files={inputs['train']}", "data.val_files=null", "data.train_batch_size=8",
           "data.micro_batch_size_per_gpu=2", "data.use_dynamic_bsz=False", "data.max_length=128",
           "data.num_workers=0", "optim.lr=1e-3", "optim.lr_warmup_steps=0", "optim.weight_decay=0",
           "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.total_training_steps=3",
           f"trainer.default_local_dir={ckpt}", "trainer.logger=[console]", "trainer.device=cpu"]
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "WANDB_MODE": "disabled", **(env or {})}
    proc = subprocess.run(cmd, cwd=inputs["dir"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    found = re.findall(r"step:(\d+) - .*?train/loss:([0-9.e+-]+) - train/grad_norm:([0-9.e+-]+)",
                       proc.stdout + proc.stderr)
    return [(float(v), float(g)) for _, (v, g) in sorted({int(s): (v, g) for s, v, g in found}.items())]


@pytest.fixture(scope="module")
def fsdp_sft(sft_inputs, tmp_path_factory):
    """The reference: verl's FSDP2 engine at DP=2 (its registration is picked by VERL_ENGINE_DEVICE)."""
    out = sft(sft_inputs, str(tmp_path_factory.mktemp("fsdp_ckpt")), FSDP, {"VERL_ENGINE_DEVICE": "cuda"})
    assert len(out) == 3 and out[-1][0] < 0.95 * out[0][0], out  # parameters move: the loss falls
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
    config = OmegaConf.create({"pad_mode": "no_padding", "max_length": 128})  # as sft() runs it
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


@pytest.mark.parametrize("layout", list(MCORE_LAYOUTS))
def test_sft_trainer_mcore_rl_equals_fsdp(sft_inputs, fsdp_sft, tmp_path, layout):
    ours = sft(sft_inputs, str(tmp_path / "ckpt"), MCORE + MCORE_LAYOUTS[layout])
    assert len(ours) == len(fsdp_sft) == 3
    diffs = {what: [_rel(o[i], f[i]) for o, f in zip(ours, fsdp_sft)] for i, what in enumerate(("loss", "grad_norm"))}
    print(f"\n{layout}: relative difference to FSDP per step " + "; ".join(
        f"{k} " + " ".join(f"{d:.1e}" for d in v) for k, v in diffs.items()))
    assert max(max(v) for v in diffs.values()) <= REL, (layout, diffs, ours, fsdp_sft)


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
