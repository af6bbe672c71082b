"""Rank bodies of tests/verl/test_verl_fsdp_equality.py: verl's ``TrainingWorker`` on verl's own
FSDP2 engine (DP=2, padded rows, eager attention, fp32) and on mcore_rl (TP=2 + SP, packed) in the same two
processes, fed the same rows as verl's PPO trainer feeds them, with verl's ``ppo_loss`` and
``value_loss``.

verl's FSDP engine on CPU needs two things verl 0.9.1 does not give it:
- ``VERL_ENGINE_DEVICE=cuda``: verl registers its FSDP engines for cuda and npu only; the variable
  is verl's own switch for the registry lookup (``EngineRegistry.get_engine_cls``). Nothing else
  reads it: the engine's tensors and collectives follow verl's platform (mcore_rl's CPU platform:
  device 'cpu', gloo).
- ``eager_value_head`` (below): verl's value-model loader asks transformers for flash-attention 2.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from functools import partial

import torch

from tests.verl import rl_bodies as R

ROWS, MINI, MICRO, DP = R.ROWS, R.MINI, R.MICRO, 2  # DP: the FSDP engine's data-parallel size
LR = 1e-4  # as tests/verl/rl_bodies.py: Adam's first steps amplify rounding in near-zero gradients
MCORE_LAYOUT = {"tensor_model_parallel_size": 2, "sequence_parallel": True}
FP32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
PATCHED_VERL = "0.9.1"  # the release eager_value_head was read from


@contextmanager
def eager_value_head():
    """Test-only patch ``eager_value_head`` of ``verl.utils.model.load_valuehead_model`` (verl
    0.9.1): verl loads every value model with ``attn_implementation="flash_attention_2"``
    (hard-coded, not configurable), which needs the flash-attn package and a GPU. The replacement
    loads the same ``AutoModelForTokenClassification`` with the attention the HF config names
    (eager, from ``model.override_config``); with any other verl version it refuses."""
    import verl
    import verl.utils.model as model_utils
    from transformers import AutoModelForTokenClassification

    if verl.__version__ != PATCHED_VERL:
        raise RuntimeError(f"eager_value_head was read from verl {PATCHED_VERL}, found {verl.__version__}")
    original = model_utils.load_valuehead_model

    def load_valuehead_model(local_path, torch_dtype, model_config, trust_remote_code):
        return AutoModelForTokenClassification.from_pretrained(
            local_path, torch_dtype=torch_dtype, config=model_config, trust_remote_code=trust_remote_code,
            attn_implementation=model_config._attn_implementation)

    model_utils.load_valuehead_model = load_valuehead_model
    try:
        yield
    finally:
        model_utils.load_valuehead_model = original


def _worker(model_type: str, path: str, fsdp: bool, remove_padding: bool | None = None, micro: int = MICRO):
    """A TrainingWorker as verl's PPO trainer builds one: FSDP2 (DP=2, padded rows unless
    ``remove_padding``, eager, fp32 everywhere) or mcore_rl (TP=2 + SP, packed rows, fp32), ``micro``
    rows per micro-batch. Same optimizer: Adam(W), constant lr, no weight decay (megatron exempts
    norms and biases from it, torch's AdamW does not), clip 1."""
    from verl.trainer.config.config import CheckpointConfig
    from verl.workers.config import (FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig, McoreOptimizerConfig,
                                     TrainingWorkerConfig)
    from verl.workers.engine_workers import TrainingWorker

    from mcore_rl.integrations.verl import McoreRLEngineConfig

    batching = dict(use_dynamic_bsz=False, micro_batch_size_per_gpu=micro, infer_micro_batch_size_per_gpu=micro)
    optim = dict(lr=LR, lr_warmup_steps=0, total_training_steps=10, weight_decay=0.0, clip_grad=1.0)
    if fsdp:
        engine = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", mixed_precision=dict(FP32),
                                  use_torch_compile=False, **batching)
        optimizer = FSDPOptimizerConfig(lr_scheduler_type="constant", **optim)
    else:
        engine = McoreRLEngineConfig(dtype="float32", **MCORE_LAYOUT, **batching)
        optimizer = McoreOptimizerConfig(lr_decay_style="constant", **optim)
    # FSDP on padded rows, mcore_rl on packed ones (the SFT test runs FSDP's packed path)
    remove_padding = not fsdp if remove_padding is None else remove_padding
    model = HFModelConfig(path=path, use_remove_padding=remove_padding, enable_gradient_checkpointing=False,
                          override_config={"attn_implementation": "eager"})
    worker = TrainingWorker(TrainingWorkerConfig(model_type=model_type, model_config=model, engine_config=engine,
                                                 optimizer_config=optimizer, checkpoint_config=CheckpointConfig()))
    worker.reset()
    return worker


def pad_rich_batch(vocab_size: int, pad_id: int, seed: int) -> dict:
    """rl_bodies' rollout batch with the pad id written as a real token into every fifth column
    (prompt and response, inside the attention mask): as an end-of-turn token occurs in chats."""
    b = R.global_batch(vocab_size, seed)
    real = b["attention_mask"].bool() & (torch.arange(b["input_ids"].shape[1]) % 5 == 2)
    b["input_ids"] = b["input_ids"].masked_fill(real, pad_id)
    b["prompts"], b["responses"] = b["input_ids"][:, :R.PROMPT].clone(), b["input_ids"][:, R.PROMPT:].clone()
    return b


def _mcore_order() -> list[int]:
    """Row order for the DP=1 engine so that its mini-batch i holds the rows the FSDP ranks hold
    in theirs (rank r's share is rows r*n .. r*n+n-1, mini-batches of MINI//DP rows), in the
    order verl gathers their metrics (rank 0's micro-batches, then rank 1's)."""
    n, per = ROWS // DP, MINI // DP
    return [r * n + i * per + j for i in range(ROWS // MINI) for r in range(DP) for j in range(per)]


def _gathered(local: torch.Tensor) -> torch.Tensor:
    """The FSDP ranks' [n, R] row shares concatenated in rank order: [ROWS, R]."""
    parts = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, local)
    return torch.cat(parts)


def _engines(*workers) -> list[str]:
    return [type(w.engine).__name__ for w in workers]


def _hf_params(worker) -> dict[str, torch.Tensor]:
    """Every rank runs the engine's get_per_tensor_param to its end (collectives inside)."""
    generator, _ = worker.engine.get_per_tensor_param()
    return {name: t.detach().float().clone() for name, t in generator}


def _param_diff(fsdp: dict, mcore: dict, start: dict) -> dict:
    """Max |FSDP - mcore_rl| over the tensors both export, and how far the update moved them."""
    common = sorted(set(fsdp) & set(mcore))
    return {"names": (sorted(fsdp), sorted(mcore)),
            "diff": max(float((fsdp[n] - mcore[n]).abs().max()) for n in common),
            "moved": max(float((mcore[n] - start[n]).abs().max()) for n in common)}


def _update(worker, rows: dict, keys: tuple[str, ...], loss, **meta):
    worker.set_loss_fn(loss)
    td = R._to_verl(rows, keys, global_batch_size=MINI, mini_batch_size=MINI, epochs=1, seed=42,
                    dataloader_kwargs={"shuffle": False}, **meta)
    out = worker.train_mini_batch(td)
    from verl.utils import tensordict_utils as tu

    return None if out is None else R._plain(tu.get(out, "metrics"))


def _infer(worker, rows: dict, key: str, **meta) -> torch.Tensor | None:
    td = R._to_verl(rows, (), compute_loss=False, **meta)
    return R._response_view(worker, worker.infer_batch(td), td, key)


def actor_body(model_dir: str, seed: int) -> dict:
    """verl's ppo_loss (clip, dual clip, entropy bonus, low-var KL loss) on both engines: the
    response log-probs / entropy before the update, then one update of two optimizer steps of
    several micro-batches (metrics, grad norms, parameters after)."""
    R._env()
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    from transformers import AutoTokenizer
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    loss = partial(ppo_loss, config=ActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=MICRO,
        clip_ratio_low=R.CLIP_LOW, clip_ratio_high=R.CLIP_HIGH, clip_ratio_c=R.CLIP_C, entropy_coeff=R.ENTROPY_COEFF,
        use_kl_loss=True, kl_loss_coef=R.KL_COEFF, kl_loss_type="low_var_kl", calculate_entropy=True))
    fsdp, mcore = _worker("language_model", model_dir, True), _worker("language_model", model_dir, False)
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    rank = torch.distributed.get_rank()
    batch = pad_rich_batch(fsdp.model_config.hf_config.vocab_size, pad_id, seed)
    local = R.rows_of(batch, rank, DP)
    meta = dict(temperature=R.TEMPERATURE, calculate_entropy=True)
    result = {"batch": batch, "pad_id": pad_id, "order": _mcore_order(), "engines": _engines(fsdp, mcore),
              "fsdp_log_probs": _gathered(_infer(fsdp, local, "log_probs", **meta)),
              "fsdp_entropy": _gathered(_infer(fsdp, local, "entropy", **meta))}
    ordered = {k: v[result["order"]] for k, v in batch.items()}
    result["mcore_log_probs"] = _infer(mcore, ordered, "log_probs", **meta)
    result["mcore_entropy"] = _infer(mcore, ordered, "entropy", **meta)
    # old / reference log-probs away from the current policy (FSDP's): ratios clip, the KL acts
    batch.update(R.update_inputs(result["fsdp_log_probs"], torch.zeros_like(result["fsdp_log_probs"]),
                                 batch["response_mask"], seed + 1))
    start = _hf_params(mcore)
    keys = ("old_log_probs", "advantages", "ref_log_prob")
    result["fsdp"] = _update(fsdp, R.rows_of(batch, rank, DP), keys, loss, compute_loss=True, **meta)
    result["mcore"] = _update(mcore, {k: v[result["order"]] for k, v in batch.items()}, keys, loss,
                              compute_loss=True, **meta)
    result["params"] = _param_diff(_hf_params(fsdp), _hf_params(mcore), start)
    return result


def critic_body(model_dir: str, seed: int) -> dict:
    """verl's value_loss (value clip) on both engines started from one saved
    ``*ForTokenClassification`` checkpoint: values, then one update of two optimizer steps."""
    R._env()
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    from transformers import AutoTokenizer
    from verl.workers.config import CriticConfig
    from verl.workers.utils.losses import value_loss

    loss = partial(value_loss, config=CriticConfig(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=MICRO,
        cliprange_value=R.CLIP_VALUE))
    with eager_value_head():
        fsdp = _worker("value_model", model_dir, True)
    mcore = _worker("value_model", model_dir, False)
    pad_id = AutoTokenizer.from_pretrained(model_dir).pad_token_id
    rank = torch.distributed.get_rank()
    batch = pad_rich_batch(fsdp.model_config.hf_config.vocab_size, pad_id, seed)
    order = _mcore_order()
    meta = dict(temperature=R.TEMPERATURE)  # verl's PPO trainer sets it on the whole batch
    result = {"batch": batch, "pad_id": pad_id, "order": order, "engines": _engines(fsdp, mcore),
              "fsdp_values": _gathered(_infer(fsdp, R.rows_of(batch, rank, DP), "values", **meta)),
              "mcore_values": _infer(mcore, {k: v[order] for k, v in batch.items()}, "values", **meta)}
    extra = R.update_inputs(torch.zeros_like(result["fsdp_values"]), result["fsdp_values"], batch["response_mask"],
                            seed + 2)
    batch.update(values=extra["values"], returns=extra["returns"])
    start = _hf_params(mcore)
    result["fsdp"] = _update(fsdp, R.rows_of(batch, rank, DP), ("values", "returns"), loss, **meta)
    result["mcore"] = _update(mcore, {k: v[order] for k, v in batch.items()}, ("values", "returns"), loss, **meta)
    result["params"] = _param_diff(_hf_params(fsdp), _hf_params(mcore), start)
    return result


def fsdp_and_mcore_body(actor_dir: str, critic_dir: str, seed: int) -> dict:
    """One launch: the actor's and the critic's comparisons."""
    return {"actor": actor_body(actor_dir, seed), "critic": critic_body(critic_dir, seed)}


def fsdp_packing_probe(model_dir: str, seed: int, pack: int = 4) -> dict:
    """How far verl's FSDP engine on its packed path (``use_remove_padding=True``: a micro-batch's
    rows concatenated into one stream) is from its padded rows, per row's place in the pack: the
    response log-probs of 2 * ``pack`` rows of 60 to 100 tokens (DP=2, one pack per rank), max
    |packed - padded| over the rows at each place (0: the first sequence of a pack)."""
    R._env()
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
    prompt, response, rows = 50, 50, DP * pack
    padded, packed = (_worker("language_model", model_dir, True, remove_padding=r, micro=pack) for r in (False, True))
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, padded.model_config.hf_config.vocab_size, (rows, prompt + response), generator=g)
    left = torch.randint(0, 11, (rows, 1), generator=g)  # prompts of 40 to 50 tokens, left-padded
    keep = torch.randint(20, response + 1, (rows, 1), generator=g)  # responses of 20 to 50, right-padded
    cols = torch.arange(prompt + response)
    mask = ((cols >= left) & (cols < prompt + keep)).long()
    ids = ids * mask
    b = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0) * mask,
         "prompts": ids[:, :prompt].clone(), "responses": ids[:, prompt:].clone(),
         "response_mask": mask[:, prompt:].clone()}
    local = {k: v[torch.distributed.get_rank() * pack:][:pack] for k, v in b.items()}
    out = {name: _gathered(_infer(w, local, "log_probs", temperature=1.0)) for name, w in
           (("padded", padded), ("packed", packed))}
    diff = ((out["packed"] - out["padded"]).abs() * b["response_mask"]).amax(-1)  # [rows]
    return {"by_place": [float(diff[place::pack].max()) for place in range(pack)],
            "lengths": b["attention_mask"].sum(-1).tolist(), "engines": _engines(padded, packed)}


def gpt_oss_engine_body(model_dir: str, seed: int) -> dict:
    """verl's TrainingWorker on mcore_rl (DP=2, packed rows) with a gpt-oss directory: this rank's
    response log-probs of rl_bodies' rows (prompts of 10, responses of 6 tokens) before an update,
    transformers' eager forward of the directory on them (also with the window taken away), verl's
    metrics of one update of two optimizer steps (ppo_loss) and rl_bodies' export check after it."""
    R._env()
    from transformers import AutoModelForCausalLM
    from verl.workers.config import ActorConfig
    from verl.workers.utils.losses import ppo_loss

    from tests.tiny import hf_log_probs

    worker = R._verl_worker("language_model", model_dir, {}, True, 10)
    dp_rank, dp = R._ranks()
    rows = R.rows_of(R.global_batch(worker.engine.engine.args.vocab_size, seed), dp_rank, dp)
    meta = dict(temperature=R.TEMPERATURE, calculate_entropy=True)
    before = _infer(worker, rows, "log_probs", **meta)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager", dtype=torch.float32).eval()
    reference = hf_log_probs(hf, rows, R.TEMPERATURE)[0]
    hf.config.sliding_window = 10 ** 4
    no_window = hf_log_probs(hf, rows, R.TEMPERATURE)[0]
    rows.update(R.update_inputs(before, torch.zeros_like(before), rows["response_mask"], seed + 1))
    loss = partial(ppo_loss, config=ActorConfig(
        strategy="mcore_rl", rollout_n=1, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=MICRO,
        clip_ratio_low=R.CLIP_LOW, clip_ratio_high=R.CLIP_HIGH, clip_ratio_c=R.CLIP_C, use_kl_loss=True,
        kl_loss_coef=R.KL_COEFF, kl_loss_type="low_var_kl", calculate_entropy=True))
    metrics = _update(worker, rows, ("old_log_probs", "advantages", "ref_log_prob"), loss, compute_loss=True, **meta)
    return {"before": before, "hf": reference, "hf_no_window": no_window, "mask": rows["response_mask"],
            "metrics": metrics, "export": R._exported(worker, rows)}
