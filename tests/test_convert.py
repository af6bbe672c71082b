"""converters/hf_to_mcore: HF -> model directory for every architecture, loaded back at other
layouts (TP=2 x PP=2, EP=2 for MoE) exports the original HF tensors bit for bit; a conversion split
over ranks (TP=2 and EP=2 through torchrun; TP=2, PP=2, EP=2 and TP=2 x EP=2 through the library)
writes the same checkpoint; the logit check of ``--test`` passes for every variant."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {  # name -> (model_type, overrides, role)
    "llama": ("llama", {}, "actor"),
    "mistral": ("mistral", {}, "actor"),
    "qwen2_tied": ("qwen2", dict(tie_word_embeddings=True), "actor"),  # QKV bias, tied head
    "qwen3": ("qwen3", dict(head_dim=24), "actor"),  # qk norm
    "qwen2_moe": ("qwen2_moe", {}, "actor"),  # shared expert + its gate
    "qwen3_moe": ("qwen3_moe", {}, "actor"),
    "mixtral": ("mixtral", {}, "actor"),
    "glm4_moe": ("glm4_moe", {}, "actor"),  # sigmoid router: its correction bias is a buffer
    "deepseek_v3": ("deepseek_v3", {}, "actor"),  # MLA with a low-rank query
    "deepseek_v3_rope_halves": ("deepseek_v3", dict(rope_interleave=False, q_lora_rank=None), "actor"),
    "llama_critic": ("llama", {}, "critic"),  # role from *ForTokenClassification
    "qwen2_bf16": ("qwen2", {}, "actor"),  # converted with --dtype bf16
    # fused transposed experts with gate/up interleaved, biases, sinks (tensor-parallel split)
    "gpt_oss": ("gpt_oss", {}, "actor"),
    "gpt_oss_critic": ("gpt_oss", {}, "critic"),
}
MOE = ("qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "deepseek_v3_rope_halves", "gpt_oss",
       "gpt_oss_critic")


def _convert_all(jobs: list[tuple[str, str]], split: dict | None = None) -> dict:
    """In one rank world: convert each (hf_dir, out_dir); returns (tensors written, most
    parameters held in real memory at once) per output."""
    from mcore_rl.conversion.convert import ConvertOptions, convert

    out = {}
    for hf, dst in jobs:
        dtype = "bf16" if dst.endswith("bf16") else "fp32"
        summary = convert(ConvertOptions(hf, dst, dtype=dtype, **(split or {})), progress=False)
        out[dst] = (summary.tensors, summary.peak_live_params)
    return out


def _load_and_export(dirs: dict[str, str]) -> dict:
    """4 ranks, TP=2 x PP=2 (EP=2 for MoE, sequence parallel): each model directory loaded into
    a frozen engine of its role; rank 0 returns every export_hf and the dist-ckpt key shapes."""
    from megatron.core import dist_checkpointing

    from mcore_rl.checkpoint.model_dir import load_model_dir
    from mcore_rl.fileio.safe_load import restricted_unpickling
    from mcore_rl.checkpoint.storage import read_json
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel import ParallelLayout, destroy_parallel_state, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine

    out = {}
    for name, d in dirs.items():
        args = model_args_from_hf(os.path.join(d, "huggingface"))
        layout = ParallelLayout(tp=2, pp=2, ep=2 if args.moe else 1, etp=1, sequence_parallel=True)
        destroy_parallel_state()
        initialize_parallel_state(layout)
        role = read_json(os.path.join(d, "mcore_rl.json"))["role"]
        engine = ModelEngine(args, layout, role, active_platform())
        for p in engine.model[0].parameters():  # not the HF values: the load must set every one
            p.data.fill_(7.0)
        load_model_dir(d, engine)
        tensors = export_hf(engine.model, args, role)
        with restricted_unpickling():
            keys = {k: tuple(v.global_shape) for k, v in dist_checkpointing.load_tensors_metadata(
                os.path.join(d, "dist_ckpt")).items()}
        out[name] = (tensors, keys) if torch.distributed.get_rank() == 0 else None
    return out


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every variant saved by transformers and converted in a single-process world."""
    base = tmp_path_factory.mktemp("convert")
    jobs, hf_dirs = [], {}
    for name, (model_type, overrides, role) in VARIANTS.items():
        hf = base / f"hf_{name}"
        tiny_hf_model(tiny_config(model_type, num_hidden_layers=2, **overrides), role=role).save_pretrained(hf)
        hf_dirs[name] = str(hf)
        jobs.append((str(hf), str(base / f"out_{name}")))
    counts = run_ranks(1, _convert_all, jobs)[0]
    return base, hf_dirs, counts


def _assert_same_hf(name: str, exported: dict, hf_dir: str) -> None:
    """Bit-exact equality (bf16 conversions: the HF tensor rounded to bf16, loaded into fp32)."""
    from mcore_rl.mapping.hf_io import SafetensorsReader

    source = SafetensorsReader(hf_dir)
    assert set(exported) == set(source) - {"lm_head.weight"} or set(exported) == set(source), name
    for key in source:
        if key in exported:
            want = source[key].to(torch.bfloat16).float() if name.endswith("bf16") else source[key]
            assert not name.endswith("bf16") or not torch.equal(want, source[key])  # rounding active
            assert torch.equal(exported[key], want), f"{name}: {key} differs after the round trip"


def test_every_architecture_round_trips_bit_exact_at_another_layout(converted, tmp_path):
    base, hf_dirs, counts = converted
    for out, (tensors, live) in counts.items():  # streamed: one parameter (one expert) at a time
        assert tensors > 0 and live == 1, (out, tensors, live)
    split = {}  # the same conversions split over 2 ranks: TP=2 (dense), EP=2 (MoE) via the library
    split["llama"] = str(tmp_path / "llama_tp2")
    run_ranks(2, _convert_all, [(hf_dirs["llama"], split["llama"])], dict(tp=2))
    split["qwen2_tied"] = str(tmp_path / "qwen2_tied_pp2")  # tied head: the last stage writes no copy
    run_ranks(2, _convert_all, [(hf_dirs["qwen2_tied"], split["qwen2_tied"])], dict(pp=2))
    split["qwen3_moe"] = str(tmp_path / "qwen3_moe_ep2")
    run_ranks(2, _convert_all, [(hf_dirs["qwen3_moe"], split["qwen3_moe"])], dict(ep=2))
    split["mixtral"] = str(tmp_path / "mixtral_tp2_ep2")  # TP x EP: dense parts by TP, experts by EP
    run_ranks(4, _convert_all, [(hf_dirs["mixtral"], split["mixtral"])], dict(tp=2, ep=2))
    split["glm4_moe"] = str(tmp_path / "glm4_moe_ep2")  # dense first layer: per-layer keys
    run_ranks(2, _convert_all, [(hf_dirs["glm4_moe"], split["glm4_moe"])], dict(ep=2))
    split["deepseek_v3_rope_halves"] = str(tmp_path / "deepseek_v3_tp2")  # rope rows under TP
    run_ranks(2, _convert_all, [(hf_dirs["deepseek_v3_rope_halves"], split["deepseek_v3_rope_halves"])], dict(tp=2))
    dirs = {name: str(base / f"out_{name}") for name in VARIANTS}
    dirs.update({f"{k}_split": v for k, v in split.items()})
    results = run_ranks(4, _load_and_export, dirs)[0]
    for name in VARIANTS:
        _assert_same_hf(name, results[name][0], hf_dirs[name])
    for name in split:
        assert results[f"{name}_split"][1] == results[name][1], f"{name}: split conversion wrote other keys"
        _assert_same_hf(f"{name}_split", results[f"{name}_split"][0], hf_dirs[name])
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in results["qwen3_moe"][1]


def test_convert_then_merge_gives_back_every_hf_tensor(converted, tmp_path):
    """HF -> mcore (the converter) -> HF (the merge): every tensor bit-identical, names exact."""
    from mcore_rl.mapping.hf_io import SafetensorsReader

    from mcore_rl.conversion.merge import merge

    base, hf_dirs, _ = converted
    for name in VARIANTS:
        target = tmp_path / f"merged_{name}"
        merge(str(base / f"out_{name}"), str(target))
        merged = dict(SafetensorsReader(str(target)))
        _assert_same_hf(name, merged, hf_dirs[name])


def _verify(pairs: dict[str, tuple[str, str]]) -> dict[str, tuple[float, float]]:
    """What ``hf_to_mcore.py --test`` runs, for each (model_dir, hf_dir): (max |diff|, cosine)."""
    from converters.verify_logits import compare
    from mcore_rl.parallel import destroy_parallel_state

    out = {}
    for name, (model_dir, hf_dir) in pairs.items():
        destroy_parallel_state()
        diff, cos, _ = compare(model_dir, hf_dir)
        out[name] = (diff, cos)
    return out


def test_every_architecture_passes_the_logit_check(converted):
    """``--test`` for every variant: outputs of the converted model at TP=1 vs transformers."""
    from converters.verify_logits import TOL

    base, hf_dirs, _ = converted
    results = run_ranks(1, _verify, {n: (str(base / f"out_{n}"), hf_dirs[n]) for n in VARIANTS})[0]
    assert set(results) == set(VARIANTS)
    print({n: f"{d:.2g}" for n, (d, _) in results.items()})
    for name, (diff, cos) in results.items():
        assert diff <= TOL and cos > 0.9999, f"{name}: max |diff| {diff:.3g}, cosine {cos:.6f}"


def _run_cli(*argv: str, torchrun: int = 0) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    script = os.path.join(ROOT, "converters", "hf_to_mcore.py")
    cmd = [sys.executable, script, *argv]
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={torchrun}",
               "--standalone", script, *argv]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


def test_torchrun_tp2_and_ep2_write_the_same_checkpoint_as_one_process(converted, tmp_path):
    base, hf_dirs, _ = converted
    for name, split in (("qwen2_tied", "--tp"), ("qwen2_moe", "--ep"), ("deepseek_v3", "--ep")):
        out = tmp_path / f"{name}_torchrun"
        r = _run_cli("--hf_model_path", hf_dirs[name], "--output_path", str(out), split, "2", torchrun=2)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert "tensors" in r.stdout
        one, two = run_ranks(1, _raw_tensors, [str(base / f"out_{name}"), str(out)])[0]
        assert set(one) == set(two), name
        for key in one:
            assert torch.equal(one[key], two[key]), f"{name} {split} 2: {key}"


def _raw_tensors(model_dirs: list[str]) -> list[dict[str, torch.Tensor]]:
    """Every global tensor of each model directory's dist_ckpt, read by megatron's loader."""
    from megatron.core import dist_checkpointing

    from mcore_rl.fileio.safe_load import restricted_unpickling

    with restricted_unpickling():
        return [dist_checkpointing.load_plain_tensors(os.path.join(d, "dist_ckpt")) for d in model_dirs]
