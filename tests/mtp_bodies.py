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
    """Logits and gradients (of the parameters both have) of one forward/backward of the model
    built with its MTP layers (not run: mtp_train unset) and without them
    (``ModelArgs.with_mtp(False)``), same weights, on every rank; the MTP block's placement; the
    HF round trip of the MTP-built model."""
    from megatron.core import parallel_state

    from mcore_rl.mapping.weights import canonical_params
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
        out[f"{name}_grads"] = {n: p.grad.clone() for c in chunks for n, p in canonical_params(c)
                                if p.grad is not None and not n.startswith("mtp.")}
    out["pp_rank"] = parallel_state.get_pipeline_model_parallel_rank()
    return out


def deeper_model(model_type: str, hf, depth: int, seed: int, **overrides):
    """The random model whose layers num_hidden_layers.. are the MTP layers' decoder layers."""
    n = hf.config.num_hidden_layers
    return tiny_hf_model(tiny_config(model_type, **{**overrides, "num_hidden_layers": n + depth}), seed=seed + 1)


def reference_mtp_losses(hf, deeper, extra: dict, batch: dict, depth: int) -> torch.Tensor:
    """[depth] MTP losses from the HF weights in plain torch (fp32), independent of megatron:
    each row's real tokens alone (no padding), the trunk run layer by layer with a causal mask
    and its final norm;
    per depth k the norms, eh_proj of [enorm(embed(t[i+k])), hnorm(h[i])], the decoder layer
    (transformers' module holding the MTP layer's weights), shared_head.norm (its output also
    feeds depth k+1, as megatron chains them) and .head, and the cross-entropy on t[i+k+1],
    averaged over every row's valid positions."""
    n, eps = hf.config.num_hidden_layers, hf.config.rms_norm_eps

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def run(layer, x):
        length = x.shape[1]
        mask = torch.full((length, length), float("-inf")).triu(1)[None, None]
        pos = torch.arange(length)[None]
        out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=hf.model.rotary_emb(x, pos))
        return out[0] if isinstance(out, tuple) else out

    sums, counts = torch.zeros(depth, dtype=torch.float64), torch.zeros(depth)
    embed = hf.model.embed_tokens.weight
    with torch.no_grad():
        for ids, mask in zip(batch["input_ids"], batch["attention_mask"]):
            t = ids[mask.bool()]
            h = embed[t][None]
            for layer in hf.model.layers:
                h = run(layer, h)
            h = norm(h, hf.model.norm.weight)  # the trunk's output, as its LM head and MTP layer 1 read it
            for k in range(1, depth + 1):
                p = f"model.layers.{n + k - 1}."
                length = t.numel() - k
                if length <= 1:
                    break
                x = torch.cat([norm(embed[t[k:]][None], extra[p + "enorm.weight"]),
                               norm(h[:, :length], extra[p + "hnorm.weight"])], -1) @ extra[p + "eh_proj.weight"].T
                h = norm(run(deeper.model.layers[n + k - 1], x), extra[p + "shared_head.norm.weight"])
                logits = h @ extra[p + "shared_head.head.weight"].T  # h, normed, also feeds depth k + 1
                ce = torch.nn.functional.cross_entropy(logits[0, : length - 1].double(), t[k + 1:], reduction="sum")
                sums[k - 1] += ce
                counts[k - 1] += length - 1
    return (sums / counts).float()


def mtp_train_losses(mtp_dir: str, layout_kwargs: dict, batch: dict, detach: bool = False,
                     grad_suffixes: tuple[str, ...] = ("eh_proj.weight",
                                                       "decoder.layers.0.self_attention.linear_proj.weight")) -> dict:
    """One training forward/backward with MTP training on (scaling 0.3): the per-depth MTP
    losses the model logged (last stage) and the gradient sums of the parameters named with
    ``grad_suffixes`` (whether the trunk / MTP layers got gradients)."""
    from mcore_rl.models.ddp import wrap_with_ddp
    from mcore_rl.models.forward import run_schedule
    from mcore_rl.models.mtp import MtpConfig
    from mcore_rl.rl.engine import share_from_last_stage
    from tests.steps import _build

    args, chunks = _build(mtp_dir, layout_kwargs, "actor")
    model = wrap_with_ddp(chunks, use_distributed_optimizer=False)
    cfg = MtpConfig(enable_train=True, detach_encoder=detach, mtp_loss_scaling_factor=0.3)
    for c in chunks:
        c.mtp_train = cfg if hasattr(c, "mtp") else None
    zero_loss = lambda b, out: ((out * 0).sum(), {})  # noqa: E731  the MTP loss alone
    run_schedule(model, [batch], zero_loss, forward_only=False)
    grads = {n: float(p.main_grad.abs().sum()) for c in model for n, p in c.module.named_parameters()
             if n.endswith(grad_suffixes)}
    last = [c for c in chunks if hasattr(c, "mtp")]
    losses = torch.stack(last[0].mtp_losses) if last else None
    return {"losses": share_from_last_stage(losses), "grads": grads}


def _mtp_actor(hf_dir: str, layout_kwargs: dict, seed: int):
    """A trainable DeepSeek actor with its MTP layer trained (tests/ckpt_bodies' settings)."""
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.mtp import MtpConfig
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine
    from tests.ckpt_bodies import ROWS, engine_settings

    layout = ParallelLayout(**layout_kwargs)
    initialize_parallel_state(layout, seed=seed)
    engine = ModelEngine(model_args_from_hf(hf_dir), layout, "actor", active_platform(), *engine_settings(False), hf_dir)
    config = ActorConfig(micro_batch_size=2, ppo_mini_batch_size=ROWS // 2,
                         mtp=MtpConfig(enable_train=True, mtp_loss_scaling_factor=0.5))
    return engine, Actor(engine, config)


def mtp_save_run(hf_dir: str, layout_kwargs: dict, root: str) -> dict:
    """2 steps with MTP training, a save, 2 more steps: the reference of a resume."""
    from tests.ckpt_bodies import hf_params, manager, optimizer_fingerprint, train

    engine, actor = _mtp_actor(hf_dir, layout_kwargs, seed=1)
    train(actor, range(2))
    at_save = optimizer_fingerprint(engine)
    manager(root).save(2, {"actor": engine}, {"step": 2})
    metrics = train(actor, range(2, 4))
    return {"metrics": metrics, "params": hf_params(engine), "opt_at_save": at_save}


def mtp_resume_run(hf_dir: str, layout_kwargs: dict, root: str) -> dict:
    """A fresh world (another init seed) resumed from the save, 2 steps."""
    from tests.ckpt_bodies import hf_params, manager, optimizer_fingerprint, train

    engine, actor = _mtp_actor(hf_dir, layout_kwargs, seed=77)
    fresh = optimizer_fingerprint(engine)
    state = manager(root).resume({"actor": engine})
    loaded = optimizer_fingerprint(engine)
    return {"state": state, "opt_fresh": fresh, "opt_loaded": loaded, "metrics": train(actor, range(2, 4)),
            "params": hf_params(engine)}


def mtp_packed_refused(mtp_dir: str, batch: dict) -> str:
    """The error of an MTP-training forward on a packed micro-batch."""
    from mcore_rl.models.forward import run_schedule
    from mcore_rl.models.mtp import MtpConfig
    from mcore_rl.rl.microbatcher import MicroBatchSpec, plan_micro_batches
    from tests.steps import _build

    _, chunks = _build(mtp_dir, {}, "actor")
    chunks[0].mtp_train = MtpConfig(enable_train=True)
    packed = plan_micro_batches(batch, MicroBatchSpec(collate="packed", max_tokens=200)).batches
    try:
        run_schedule(chunks, packed, lambda b, out: ((out * 0).sum(), {}), forward_only=False)
    except Exception as e:  # noqa: BLE001  the refusal, reported to the test
        return f"{type(e).__name__}: {e}"
    return "no error"
