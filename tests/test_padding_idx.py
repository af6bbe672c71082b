"""The pad token's embedding row follows transformers' ``nn.Embedding(padding_idx=pad_token_id)``:
with the pad token occurring as a real, attended, in-loss token, the embedding gradient and the
grad norm equal transformers' at TP=2+SP (actor and critic), PP=2 and PP=2xVPP=2 (tied: the row
still gets the output projection's gradient) and packed; ``pad_embedding_grad='megatron'`` trains the row through
the lookup (transformers without padding_idx); the job's Actor picks the pad id up from the HF
config (packed, CP=2) and updates as transformers does; which architectures read which field."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from mcore_rl.models.registry import ARCHITECTURES
from tests.dist import run_ranks
from tests.steps import GLOBAL_MICRO_BATCHES
from tests.tiny import padded_batch, tiny_config, tiny_hf_model

PAD, VOCAB = 7, 200
TOL = 1e-5
EMBED = "model.embed_tokens.weight"
LAYOUTS = {  # name -> (model, layout, pad_embedding_grad, packed); every world has 2 ranks, DP=1
    "tp2_sp": ("untied", dict(tp=2, sequence_parallel=True), "transformers", False),
    "tp2_sp_megatron": ("untied", dict(tp=2, sequence_parallel=True), "megatron", False),
    "pp2_tied": ("tied", dict(pp=2), "transformers", False),
    "pp2_vpp2_tied": ("tied", dict(pp=2, vpp=2), "transformers", False),
    "packed_tp2_sp_tied": ("tied", dict(tp=2, sequence_parallel=True), "transformers", True),
    "critic_tp2_sp": ("critic", dict(tp=2, sequence_parallel=True), "transformers", False),
}


def with_pad_tokens(batch: dict) -> dict:
    """``batch`` with every fourth real token the pad token (attended, in the loss), and the
    padding filled with it (as trainers pad)."""
    real = batch["attention_mask"].bool()
    b, s = real.shape
    every_fourth = (torch.arange(b)[:, None] + torch.arange(s)[None]) % 4 == 0
    ids = torch.where(real & every_fourth, PAD, batch["input_ids"])
    return {**batch, "input_ids": ids.masked_fill(~real, PAD)}


def micro_batches() -> list[dict]:
    return [with_pad_tokens(padded_batch(VOCAB, seed=s)) for s in range(1, GLOBAL_MICRO_BATCHES + 1)]


def _weights(batch, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(batch["input_ids"].sum()))
    return torch.randn(shape, generator=g) / VOCAB ** 0.5


def _loss(batch, logits: torch.Tensor) -> torch.Tensor:
    """Fixed random weights on every real token's logits (of the whole vocabulary: the output
    projection's pad row is trained too); ``logits`` [n_real, vocab] in row-major order."""
    return (logits * _weights(batch, logits.shape)).sum() / logits.shape[0]


def _norm(grads) -> torch.Tensor:
    """The grad norm of all ``grads`` (a tied weight once), in fp64."""
    return torch.stack([g.double().square().sum() for g in grads]).sum().sqrt()


def _grads(hf_dir: str, layout: dict, mode: str, packed: bool, role: str) -> dict:
    """One forward/backward of micro_batches() and finalize_model_grads: the HF-named embedding
    gradient and the norm of all gradients."""
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from mcore_rl.models.builder import BuildOptions, build_model
    from mcore_rl.models.ddp import wrap_with_ddp
    from mcore_rl.models.forward import run_schedule
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf, load_hf
    from mcore_rl.models.micro_batch import MicroBatch
    from mcore_rl.models.packing import pack
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform

    layout = ParallelLayout(**layout)
    initialize_parallel_state(layout)
    args = model_args_from_hf(hf_dir)
    chunks = build_model(args, layout, role, active_platform(), BuildOptions(pad_embedding_grad=mode))
    load_hf(chunks, args, role, hf_dir)
    model = wrap_with_ddp(chunks, use_distributed_optimizer=False)
    batches = micro_batches()
    if packed:  # one stream of every row's real tokens (a multiple of TP long: sequence parallel)
        batches = [MicroBatch(b, packed=pack(b["input_ids"], b["attention_mask"], b["input_ids"].numel()))
                   for b in batches]

    def loss_fn(mb, out):
        if role == "actor":
            out = gather_from_tensor_model_parallel_region(out)[..., :VOCAB]
        real = mb["attention_mask"].bool()
        logits = out[0, mb.packed.index[real]] if mb.packed is not None else out[real]
        loss = _loss(mb, logits)
        return loss, {"loss": loss.detach()}

    run_schedule(model, batches, loss_fn, forward_only=False)
    finalize_model_grads(model)
    grads = export_hf(model, args, role, tensor_of=lambda p: p.main_grad)
    parallel_state.destroy_model_parallel()
    return {"embed": grads[EMBED], "norm": _norm(grads.values())}


def _all_layouts(dirs: dict) -> dict:
    return {name: _grads(dirs[model], layout, mode, packed, "critic" if model == "critic" else "actor")
            for name, (model, layout, mode, packed) in LAYOUTS.items()}


def _hf_model(tied: bool, role: str = "actor"):
    """A tiny llama whose pad row is nonzero (transformers' init zeroes it) and used."""
    hf = tiny_hf_model(tiny_config("llama", tie_word_embeddings=tied, pad_token_id=PAD), role)
    assert hf.model.embed_tokens.padding_idx == PAD
    with torch.no_grad():
        hf.model.embed_tokens.weight[PAD].normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    return hf


def hf_grads(hf, padding_idx: int | None) -> dict:
    """transformers' gradients of the same loss (mean over the micro-batches, as megatron's
    schedule divides each micro-batch's loss by their count)."""
    hf = copy.deepcopy(hf)  # eval: the token-classification head's dropout off (megatron's value head has none)
    hf.model.embed_tokens.padding_idx = padding_idx
    loss = 0.0
    for batch in micro_batches():
        logits = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        loss = loss + _loss(batch, logits[batch["attention_mask"].bool()]) / GLOBAL_MICRO_BATCHES
    loss.backward()
    return {"embed": hf.model.embed_tokens.weight.grad, "norm": _norm(p.grad for p in hf.parameters())}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    dirs, refs = {}, {}
    for name, tied in (("untied", False), ("tied", True), ("critic", False)):
        hf = _hf_model(tied, "critic" if name == "critic" else "actor")
        dirs[name] = str(tmp_path_factory.mktemp(name))
        hf.save_pretrained(dirs[name])
        refs[name] = {"transformers": hf_grads(hf, PAD), "megatron": hf_grads(hf, None)}
    return run_ranks(2, _all_layouts, dirs), refs


def test_pad_token_is_a_real_in_loss_token():
    for batch in micro_batches():
        assert ((batch["input_ids"] == PAD) & batch["attention_mask"].bool()).sum() >= 8


@pytest.mark.parametrize("name", LAYOUTS)
def test_embedding_gradient_equals_transformers(results, name):
    ranks, refs = results
    model, _, mode, _ = LAYOUTS[name]
    want = refs[model][mode]
    for rank, got in enumerate(r[name] for r in ranks):
        diff = (got["embed"] - want["embed"]).abs().max().item()
        assert diff <= TOL, f"{name} rank {rank}: embedding gradient differs from transformers' by {diff:.3g}"
        assert float(got["norm"]) == pytest.approx(float(want["norm"]), rel=TOL), f"{name} rank {rank}: grad norm"
        row, ref_row = got["embed"][PAD], want["embed"][PAD]
        if model == "tied" or mode == "megatron":  # the output projection (or the lookup) trains it
            assert row.abs().max() > 1e-3 and torch.allclose(row, ref_row, rtol=0, atol=TOL), name
        else:
            assert torch.equal(row, torch.zeros_like(row)) and torch.equal(ref_row, torch.zeros_like(ref_row)), name


def test_megatron_switch_trains_the_pad_row_through_the_lookup(results):
    """The two behaviours differ on the pad row only; megatron's is transformers without padding_idx."""
    ranks, refs = results
    got, transformers = ranks[0]["tp2_sp_megatron"]["embed"], ranks[0]["tp2_sp"]["embed"]
    assert torch.equal(torch.cat([got[:PAD], got[PAD + 1:]]), torch.cat([transformers[:PAD], transformers[PAD + 1:]]))
    assert got[PAD].abs().max() > 1e-3 and transformers[PAD].abs().max() == 0
    lookup = refs["untied"]["megatron"]["embed"][PAD]
    assert (got[PAD] - lookup).abs().max() <= TOL


@pytest.mark.parametrize("model_type", sorted(ARCHITECTURES))
def test_registry_follows_transformers_padding_idx(tmp_path, model_type):
    """Each architecture's pad row is the field transformers passes as padding_idx, read from
    config.json (no transformers) and from a config object alike; a negative id counts from the
    end (as torch's); an id outside the vocabulary is refused."""
    from mcore_rl.models.hf_config import ConfigError, model_args_from_hf
    from mcore_rl.models.registry import lookup_arch

    def padding_idx(pad):  # what transformers makes of it
        return tiny_hf_model(tiny_config(model_type, pad_token_id=pad)).model.embed_tokens.padding_idx

    config = tiny_config(model_type, pad_token_id=PAD)
    field = lookup_arch(model_type).pad_row_field
    assert padding_idx(PAD) == (getattr(config, field) if field else None)
    config.save_pretrained(tmp_path)
    want = PAD if field else None
    assert model_args_from_hf(tmp_path).pad_token_id == model_args_from_hf(config).pad_token_id == want
    raw = json.loads((tmp_path / "config.json").read_text())
    for value in (-1, None):  # torch counts a negative padding_idx from the end
        (tmp_path / "config.json").write_text(json.dumps({**raw, "pad_token_id": value}))
        assert model_args_from_hf(tmp_path).pad_token_id == padding_idx(value)
    if field is None:
        return
    (tmp_path / "config.json").write_text(json.dumps({**raw, "pad_token_id": VOCAB}))
    with pytest.raises(ConfigError, match=rf"pad_token_id={VOCAB} is outside the vocabulary \(vocab_size={VOCAB}\)"):
        model_args_from_hf(tmp_path)
    args = model_args_from_hf(config)
    assert args.with_pad_token_id(3).pad_token_id == 3 and args.with_pad_token_id(None).pad_token_id is None
    with pytest.raises(ConfigError, match=r"verl's pad='x' is not a token id"):
        args.with_pad_token_id("x", "verl's pad")


def test_unknown_switch_value_is_refused():
    from mcore_rl.models.hf_config import ConfigError
    from mcore_rl.models.padding_idx import hold_pad_row

    with pytest.raises(ConfigError, match=r"pad_embedding_grad='hf'; use 'transformers' .* or 'megatron'"):
        hold_pad_row([], PAD, "hf")


def _job_updates(cfgs: dict, batch: dict) -> dict:
    """The job's build (actor + reference from model.hf_dir) and one Actor update per config."""
    from megatron.core import parallel_state

    from mcore_rl.job.loop import build
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.platform import active_platform

    out = {}
    for mode, cfg in cfgs.items():
        actor, _ = build(cfg, active_platform())
        metrics = actor.update_policy(batch)
        out[mode] = {"pad": actor.engine.args.pad_token_id, "metrics": metrics,
                     "params": export_hf(actor.engine.model, actor.engine.args, "actor")}
        parallel_state.destroy_model_parallel()
    return out


def test_job_actor_update_follows_transformers_packed_cp2(tmp_path):
    """The job reads the pad id from model.hf_dir's config; its Actor's update (packed, CP=2,
    PPO clip + KL + entropy, Adam) equals the formula reference on transformers, whose untied
    pad row gets no gradient (so Adam leaves it as it was); model.pad_embedding_grad=megatron
    equals transformers without padding_idx."""
    from mcore_rl.job.schema import load_job_config
    from tests.test_actor_update import (ACTOR, OPTIM, RESPONSE, _assert_metrics, _assert_params, make_batch,
                                         reference_update)

    hf = _hf_model(tied=False)
    hf.save_pretrained(tmp_path / "hf")
    batch = make_batch(hf)
    real = batch["attention_mask"].bool()
    batch["input_ids"] = with_pad_tokens(batch)["input_ids"]
    batch["responses"] = batch["input_ids"][:, -RESPONSE:].clone()
    assert ((batch["responses"] == PAD) & real[:, -RESPONSE:] & batch["response_mask"].bool()).sum() >= 4
    overrides = [f"model.hf_dir={tmp_path / 'hf'}", f"output_dir={tmp_path / 'run'}", "algorithm.name=grpo",
                 "layout.tp=1", "layout.cp=2", "actor.use_remove_padding=true", "progress_bar=false",
                 f"rollout.temperature={ACTOR['temperature']}",
                 *(f"actor.{k}={v}" for k, v in ACTOR.items() if k != "temperature"),
                 *(f"actor_optim.{k}={v}" for k, v in OPTIM.items())]
    cfgs = {mode: load_job_config(None, [*overrides, f"model.pad_embedding_grad={mode}"])
            for mode in ("transformers", "megatron")}
    got = run_ranks(2, _job_updates, cfgs, batch)
    initial = hf.model.embed_tokens.weight.detach().clone()
    for mode, padding_idx in (("transformers", PAD), ("megatron", None)):
        reference = copy.deepcopy(hf)
        reference.model.embed_tokens.padding_idx = padding_idx
        want = reference_update(reference, batch)
        for rank, result in enumerate(got):
            ours = result[mode]
            assert ours["pad"] == PAD
            _assert_metrics(ours["metrics"], want["metrics"], TOL, f"{mode} rank {rank}")
            _assert_params(ours["params"], want["params"], f"{mode} rank {rank}")
            moved = (ours["params"][EMBED][PAD] - initial[PAD]).abs().max().item()
            assert (moved == 0.0) if mode == "transformers" else (moved > 1e-3), (mode, moved)
