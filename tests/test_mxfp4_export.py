"""MXFP4 export (issue #39, export side): ``merge --dtype mxfp4`` and the weight sync's option.

Unit level: which tensors are written as MXFP4 (the converter's record, else the published
rule) and the ``quantization_config`` (the published ``modules_to_not_convert``). On a tiny
gpt-oss (3 layers, H = I = 64, 4 experts) converted once in one spawned rank: MXFP4 -> mcore ->
MXFP4 gives the same bytes for every block the exporter's rule writes (it is idempotent) and
every canonical block; a non-canonical source block (largest code magnitude below 4, which
another rule may write) comes back re-encoded with the same values (measured), the tensors the source left bf16 stay bf16; from bf16 the error is measured;
transformers loads the export on CPU (it dequantizes itself, no flag needed) to the engine's
log-probs on the same checkpoint; NaN is refused naming tensor and block, nothing written; the
weight sync's MXFP4 buckets are the merge's bytes.
"""
from __future__ import annotations

import pytest
import torch

L0 = "model.layers.0."
GATE_UP, DOWN = L0 + "mlp.experts.gate_up_proj", L0 + "mlp.experts.down_proj"


def _specs(**shapes):
    from mcore_rl.fileio.safetensors_write import TensorSpec

    return [TensorSpec(n, s, torch.float32) for n, s in shapes.items()]


def test_the_record_picks_the_tensors_else_the_published_rule():
    from mcore_rl.conversion.merge_mxfp4 import MXFP4_STORED, mxfp4_formats, out_specs
    from mcore_rl.errors import CheckpointError

    specs = _specs(**{GATE_UP: (4, 64, 96), DOWN: (4, 48, 64), L0 + "mlp.experts.gate_up_proj_bias": (4, 96),
                      L0 + "self_attn.sinks": (4,), "model.layers.1.mlp.experts.down_proj": (4, 48, 64),
                      "lm_head.weight": (200, 64)})
    # without a record: the experts whose input dim is whole blocks (48 is not: down_proj stays)
    assert [n for n, f in mxfp4_formats(specs, None).items() if f is None] == [GATE_UP]
    assert all(f == torch.bfloat16 for f in mxfp4_formats(specs, None).values() if f is not None)
    stored = {s.name: "BF16" for s in specs} | {GATE_UP: MXFP4_STORED, "lm_head.weight": "F32"}
    formats = mxfp4_formats(specs, stored)
    assert formats[GATE_UP] is None and formats["lm_head.weight"] == torch.float32
    assert formats[L0 + "self_attn.sinks"] == torch.bfloat16
    written = {s.name: (s.shape, s.dtype) for s in out_specs(specs, formats)}
    assert written[GATE_UP + "_blocks"] == ((4, 96, 2, 16), torch.uint8)
    assert written[GATE_UP + "_scales"] == ((4, 96, 2), torch.uint8) and GATE_UP not in written
    with pytest.raises(CheckpointError, match=r"does not record 'model\.layers\.0\.self_attn\.sinks'"):
        mxfp4_formats(specs, {k: v for k, v in stored.items() if not k.endswith("sinks")})
    with pytest.raises(CheckpointError, match=r"records 'model\.layers\.0\.mlp\.experts\.down_proj' as MXFP4, but "
                                              r"its shape \[4, 48, 64\] has no whole blocks of 32"):
        mxfp4_formats(specs, {**stored, DOWN: MXFP4_STORED})
    with pytest.raises(CheckpointError, match=r"dtype 'F8' is not one of"):
        mxfp4_formats(specs, {**stored, DOWN: "F8"})


def test_quantization_config_is_the_published_one_plus_unquantized_experts():
    from mcore_rl.conversion.merge_mxfp4 import quantization_config

    published = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
    experts = {f"model.layers.{i}.mlp.experts.{p}": None for i in range(12) for p in ("gate_up_proj", "down_proj")}
    assert quantization_config({**experts, "lm_head.weight": torch.bfloat16}) == \
        {"modules_to_not_convert": published, "quant_method": "mxfp4"}
    plain = {"model.layers.10.mlp.experts.gate_up_proj": torch.bfloat16,
             "model.layers.10.mlp.experts.down_proj": torch.bfloat16,
             "model.layers.2.mlp.experts.down_proj": torch.bfloat16}  # layer 2's gate_up_proj is still MXFP4
    assert quantization_config({**experts, **plain})["modules_to_not_convert"] == \
        published + ["model.layers.10.mlp.experts"]


# ---- a tiny gpt-oss, converted once (one spawned rank) and merged back ------------------------------
# intermediate 64: both expert stacks have whole blocks of 32 along their input dim (H = I = 64)
# the MXFP4 source: layer 0's experts left bf16 (listed in modules_to_not_convert), layer 1's
# quantized from fp32 by the exporter's rule with every other row's codes cut to magnitudes <= 1.5
# (non-canonical blocks, as another rule might write), layer 2's by the rule as it is
CFG = dict(num_hidden_layers=3, intermediate_size=64)
NAN_AT = ("model.layers.1.mlp.experts.gate_up_proj", (2, 40, 7))  # [expert, col (hidden), row (2I)]
PLAIN, CANONICAL = "model.layers.0.", "model.layers.2."
PUBLISHED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def _write(directory: str, tensors: dict, config: dict) -> None:
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(directory)
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


def _engine_body(jobs: list, exported: str, batch: dict) -> dict:
    """One rank: convert each (hf, out) with the defaults; merge the bf16 one's output back as
    MXFP4 into ``exported``; the fp32 engine's log-probs on ``batch`` from the MXFP4 source and
    from ``exported`` (read back through the MXFP4 import), and the MXFP4 weight sync of the first."""
    from mcore_rl.conversion.convert import ConvertOptions, convert
    from mcore_rl.conversion.merge import merge
    from mcore_rl.models.builder import BuildOptions
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf_buckets
    from mcore_rl.models.moe import MoEOptions
    from mcore_rl.parallel import ParallelLayout, destroy_parallel_state, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.actor import Actor, ActorConfig
    from mcore_rl.rl.engine import ModelEngine
    from tests.steps import EXACT_MOE

    out = {}
    for hf, dst in jobs:
        convert(ConvertOptions(hf, dst), progress=False)
    merge(jobs[1][1], exported, dtype="mxfp4")
    for hf in (jobs[0][0], exported):
        destroy_parallel_state()  # the converter's
        initialize_parallel_state(ParallelLayout(), seed=1)
        args = model_args_from_hf(hf)
        engine = ModelEngine(args, ParallelLayout(), "actor", active_platform(),
                             BuildOptions(moe=MoEOptions(**EXACT_MOE)), None, hf)
        actor = Actor(engine, ActorConfig(micro_batch_size=4, ppo_mini_batch_size=4))
        out[hf] = {"log_probs": actor.compute_log_prob(batch)["log_probs"]}
        if hf == jobs[0][0]:
            out[hf]["buckets"] = [[(n, t.clone()) for n, t in b]
                                  for b in export_hf_buckets(engine.model, args, "actor", 40_000, mxfp4=True)]
    return out


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    """A tiny fp32 gpt-oss; ``mx``: its experts as MXFP4 by the exporter's rule, the rest bf16,
    with the published quantization_config; ``bf16``: all of it bf16 (no record: the rule picks);
    ``nan``: bf16 with one NaN in an expert. Each converted (defaults: bf16), the engine's
    log-probs and MXFP4 weight sync from the first two."""
    import json
    import os

    from safetensors.torch import load_file

    from mcore_rl.mapping.mxfp4 import quantize_mxfp4
    from tests.dist import run_ranks
    from tests.tiny import rl_batch, tiny_config, tiny_hf_model

    base = str(tmp_path_factory.mktemp("oss"))
    hf = os.path.join(base, "hf")
    tiny_hf_model(tiny_config("gpt_oss", **CFG)).save_pretrained(hf)
    orig = load_file(os.path.join(hf, "model.safetensors"))
    with open(os.path.join(hf, "config.json")) as f:
        config = {**json.load(f), "dtype": "bfloat16", "torch_dtype": "bfloat16"}
    mx = {}
    for name, t in orig.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and not name.startswith(PLAIN):
            b, s = quantize_mxfp4(t, name)
            if not name.startswith(CANONICAL):  # non-canonical blocks on every other row (scale > 0)
                b[:, ::2] &= 0x33
            mx[name + "_blocks"], mx[name + "_scales"] = b, s
        else:
            mx[name] = t.bfloat16()
    bf16 = {k: v.bfloat16() for k, v in orig.items()}
    nan = dict(bf16)
    nan[NAN_AT[0]] = bf16[NAN_AT[0]].clone()
    nan[NAN_AT[0]][NAN_AT[1]] = float("nan")
    dirs = {n: os.path.join(base, n) for n in ("mx", "bf16", "nan")}
    _write(dirs["mx"], mx, {**config, "quantization_config": {"modules_to_not_convert": PUBLISHED + [PLAIN + "mlp.experts"],
                                                               "quant_method": "mxfp4"}})
    _write(dirs["bf16"], bf16, config)
    _write(dirs["nan"], nan, config)
    batch = rl_batch(config["vocab_size"], batch=4, prompt=8, response=6, seed=5)
    jobs = [(dirs[n], os.path.join(base, f"conv_{n}")) for n in ("mx", "bf16", "nan")]
    exported = os.path.join(base, "exported_bf16")
    ran = run_ranks(1, _engine_body, jobs, exported, batch, daemon=False)[0]
    return {"base": base, "mx": mx, "bf16": bf16, "batch": batch, "ran": ran, "src": dirs, "exported": exported,
            **{f"conv_{n}": os.path.join(base, f"conv_{n}") for n in ("mx", "bf16", "nan")}}


def _read(target) -> tuple[dict, dict]:
    import json
    import os

    from safetensors.torch import load_file

    with open(os.path.join(target, "config.json")) as f:
        return load_file(os.path.join(target, "model.safetensors")), json.load(f)


def _canonical(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Per block [*lead, rows, G]: scale byte 0, or a largest code magnitude of 4 or 6 (codes
    6, 7): the blocks a value-reading exporter can give back byte for byte (mxfp4.py)."""
    top = torch.maximum(blocks & 7, (blocks >> 4) & 7).amax(-1)
    return (scales == 0) | (top >= 6)


def test_round_trip_gives_the_same_bytes(oss, tmp_path):
    """MXFP4 -> converter (bf16) -> merge --dtype mxfp4: exactly the source's MXFP4 tensors are
    MXFP4 (layer 0's experts stay bf16 and listed, as the source had them); every block the
    exporter's rule wrote (layer 2, and layer 1's odd rows) and every canonical block comes back
    byte for byte; a non-canonical block (layer 1's even rows) comes back with the same values,
    a smaller exponent (measured share below); the rest bf16 as stored."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.mapping.mxfp4 import dequantize_mxfp4

    summary = merge(oss["conv_mx"], str(tmp_path / "out"), dtype="mxfp4")
    out, config = _read(tmp_path / "out")
    assert sorted(out) == sorted(oss["mx"])
    moved = total = 0
    for name, want in oss["mx"].items():
        assert out[name].dtype == want.dtype, name
        if not name.endswith("_blocks"):
            assert name.endswith("_scales") or torch.equal(out[name], want), name
            continue
        stem = name.removesuffix("_blocks")
        b, s = out[name], out[stem + "_scales"]
        wb, ws = want, oss["mx"][stem + "_scales"]
        assert torch.equal(dequantize_mxfp4(b, s), dequantize_mxfp4(wb, ws)), stem
        same = (b == wb).all(-1) & (s == ws)
        keep = _canonical(wb, ws)
        assert torch.equal(same, keep), stem  # exactly the canonical blocks keep their bytes
        assert not name.startswith(CANONICAL) or bool(same.all()), stem
        moved, total = moved + int((~same).sum()), total + same.numel()
    print(f"non-canonical source blocks re-encoded on the way back: {moved}/{total}")
    assert moved > 0
    assert sum(n.endswith("_blocks") for n in out) == 4 and "mxfp4 (4 tensors) + bfloat16" in summary.line()
    assert out[PLAIN + "mlp.experts.down_proj"].dtype == torch.bfloat16
    assert config["quantization_config"] == {"modules_to_not_convert": PUBLISHED + [PLAIN + "mlp.experts"],
                                             "quant_method": "mxfp4"}
    assert config["dtype"] == "bfloat16"


def test_from_bf16_the_experts_are_quantized_and_the_error_is_measured(oss, tmp_path):
    """bf16 source (no record) -> merge --dtype mxfp4: the experts, quantized by the codec's rule
    from the checkpoint's values (the same bytes as quantize_mxfp4 on them), the rest bf16; the
    error stated: per value at most half the top E2M1 step, 2^k, of a block whose max >= 3.5 * 2^k."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.mapping.mxfp4 import dequantize_mxfp4, quantize_mxfp4

    merge(oss["conv_bf16"], str(tmp_path / "out"), dtype="mxfp4")
    out, config = _read(tmp_path / "out")
    assert config["quantization_config"]["modules_to_not_convert"] == PUBLISHED
    worst = rms = 0.0
    for name, w in oss["bf16"].items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            assert out[name].dtype == torch.bfloat16 and torch.equal(out[name], w), name
            continue
        blocks, scales = out[name + "_blocks"], out[name + "_scales"]
        want = quantize_mxfp4(w, name)
        assert torch.equal(blocks, want[0]) and torch.equal(scales, want[1]), name
        err = (dequantize_mxfp4(blocks, scales) - w.float()).transpose(-1, -2)  # [E, rows, cols]
        amax = w.float().transpose(-1, -2).abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
        rel = (err.unflatten(-1, (-1, 32)).abs() / amax)
        worst, rms = max(worst, rel.max().item()), max(rms, (err.pow(2).mean() / w.float().pow(2).mean()).sqrt().item())
    print(f"bf16 -> MXFP4: worst |error| / block max {worst:.3f}, relative RMS error {rms:.3f}")
    assert 0 < worst <= 1 / 3 and 0 < rms < 0.2


def _hf_model(directory):
    from transformers import AutoModelForCausalLM

    # on CPU transformers 5.24 dequantizes MXFP4 itself (no triton kernels: it switches
    # Mxfp4Config.dequantize on and warns), into the parameters' dtype: fp32 here
    return AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def test_transformers_loads_the_export_to_the_engine_log_probs(oss, tmp_path):
    """transformers reads an exported MXFP4 directory on CPU into exactly our dequantized
    experts, to the log-probs of the engine on the same checkpoint within 1e-4: the MXFP4 source's
    round trip, and a bf16 source quantized on export (read back by the engine through the MXFP4
    import); the latter's distance to the unquantized source is the quantization error, stated."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.mapping.mxfp4 import dequantize_mxfp4
    from tests.tiny import hf_log_probs

    batch, ran = oss["batch"], oss["ran"]
    merge(oss["conv_mx"], str(tmp_path / "mx"), dtype="mxfp4")
    lps = {}
    for key, directory in (("mx", tmp_path / "mx"), ("bf16", oss["exported"])):
        model = _hf_model(directory)
        out, _ = _read(directory)
        state = model.state_dict()
        for name in (n.removesuffix("_blocks") for n in out if n.endswith("_blocks")):
            assert torch.equal(state[name], dequantize_mxfp4(out[name + "_blocks"], out[name + "_scales"])), name
        lps[key] = hf_log_probs(model, batch)[0]
    engine_mx, engine_bf = ran[oss["src"]["mx"]]["log_probs"], ran[oss["exported"]]["log_probs"]
    quant = (lps["bf16"] - hf_log_probs(_hf_model(oss["src"]["bf16"]), batch)[0]).abs().max().item()
    print(f"log-probs, transformers on the MXFP4 export vs the engine: {(lps['mx'] - engine_mx).abs().max().item():.1e} "
          f"(MXFP4 source), {(lps['bf16'] - engine_bf).abs().max().item():.1e} (bf16 source quantized on export, "
          f"whose quantization moved the log-probs by up to {quant:.3f})")
    assert torch.allclose(lps["mx"], engine_mx, rtol=0, atol=1e-4)
    assert torch.allclose(lps["bf16"], engine_bf, rtol=0, atol=1e-4) and quant > 1e-3


def test_nan_is_refused_naming_tensor_and_block_and_nothing_is_written(oss, tmp_path, capsys):
    from converters.mcore_to_hf import main
    from mcore_rl.conversion.merge import merge
    from mcore_rl.mapping.mxfp4 import MXFP4Error

    target = tmp_path / "out"
    with pytest.raises(MXFP4Error, match=r"model\.layers\.1\.mlp\.experts\.gate_up_proj: 1 NaN/inf value\(s\) in "
                                         r"expert 2's up_proj\.weight, the first nan in block \[2, 7, 1\] of "
                                         r"model\.layers\.1\.mlp\.experts\.gate_up_proj_scales \(the weight's "
                                         r"\[2, 40, 7\]\)"):
        merge(oss["conv_nan"], str(target), dtype="mxfp4")
    assert not target.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    assert main(["merge", "--local_dir", oss["conv_nan"], "--target_dir", str(target), "--dtype", "mxfp4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "block [2, 7, 1]" in err, err
    assert not target.exists()
    assert main(["merge", "--local_dir", oss["conv_mx"], "--target_dir", str(target), "--dtype", "mxfp4",
                 "--scale_fmt", "ue8m0"]) == 2
    assert "apply to --dtype fp8 only" in capsys.readouterr().err and not target.exists()
    assert main(["merge", "--local_dir", oss["conv_mx"], "--target_dir", str(target), "--dtype", "mxfp4"]) == 0
    assert "mxfp4 (4 tensors)" in capsys.readouterr().out


def test_weight_sync_sends_what_the_merge_writes(oss, tmp_path):
    """export_hf_buckets(mxfp4=True) of the fp32 engine on the MXFP4 source: the merge's names
    and bytes (blocks, scales; the rest bf16 values held in fp32), except that without the
    converter's record the sync quantizes every experts stack (the published rule: layer 0's
    too); each stack's blocks and scales side by side in one bucket, within the bound (40 kB)
    unless alone."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.mapping.mxfp4_quant import as_mxfp4

    merge(oss["conv_mx"], str(tmp_path / "out"), dtype="mxfp4")
    merged, _ = _read(tmp_path / "out")
    for stack in (PLAIN + "mlp.experts.gate_up_proj", PLAIN + "mlp.experts.down_proj"):
        merged.update(as_mxfp4(stack, merged.pop(stack)))
    buckets = oss["ran"][oss["src"]["mx"]]["buckets"]
    names = [n for b in buckets for n, _ in b]
    assert sorted(names) == sorted(merged) and len(names) == len(set(names))
    for bucket in buckets:
        for i, (name, t) in enumerate(bucket):
            want = merged[name]
            got = t if t.dtype == torch.uint8 else t.to(want.dtype)
            assert got.dtype == want.dtype and torch.equal(got, want), name
            if name.endswith("_scales"):
                assert bucket[i - 1][0] == name.removesuffix("_scales") + "_blocks", name
        nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
        assert nbytes <= 40_000 or len({n.removesuffix("_blocks").removesuffix("_scales") for n, _ in bucket}) == 1
    assert sum(n.endswith("_blocks") for n in names) == 6  # no record here: every experts stack


def test_check_arch_refuses_other_models():
    from mcore_rl.conversion.merge_mxfp4 import Mxfp4ExportError, check_arch

    check_arch("gpt_oss", "x")
    with pytest.raises(Mxfp4ExportError, match=r"ckpt: merge --dtype mxfp4 writes gpt-oss experts .* this model is "
                                               r"'llama'.*merge with --dtype bf16"):
        check_arch("llama", "ckpt")
