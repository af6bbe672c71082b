"""converters/hf_to_mcore.py as a command: --test compares logits with transformers in a fresh
process (passes on a correct conversion, fails when the weights differ), and bad input is refused
with a message naming the value and the fix."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(script: str, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, os.path.join(ROOT, "converters", script), *argv], env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_test_flag_passes_and_a_weight_corruption_fails(tmp_path):
    from safetensors.torch import load_file, save_file

    hf, out = tmp_path / "hf", tmp_path / "out"
    tiny_hf_model(tiny_config("qwen3", num_hidden_layers=2, head_dim=24)).save_pretrained(hf)
    r = _python("hf_to_mcore.py", "--hf_model_path", str(hf), "--output_path", str(out), "--test")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "verify: max abs diff" in r.stdout and "PASS" in r.stdout, r.stdout
    assert "tensors" in r.stdout and "peak RSS" in r.stdout
    assert sorted(os.listdir(out)) == ["dist_ckpt", "huggingface", "mcore_rl.json"]
    assert json.loads((out / "mcore_rl.json").read_text())["contents"] == ["model"]

    # the same checkpoint against HF weights with one tensor changed by 1%: the check must fail
    bad = tmp_path / "hf_bad"
    bad.mkdir()
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] *= 1.01
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    (bad / "config.json").write_text((hf / "config.json").read_text())
    r = _python("verify_logits.py", str(out), str(bad))
    assert r.returncode == 1, r.stdout + r.stderr[-3000:]
    assert "FAIL" in r.stdout, r.stdout

    # the output is not empty now: refused without --overwrite, exit code 2, the fix named
    r = _python("hf_to_mcore.py", "--hf_model_path", str(hf), "--output_path", str(out))
    assert r.returncode == 2, r.stderr[-3000:]
    assert "is not empty; pass --overwrite" in r.stderr


def _errors(cases: dict[str, tuple[str, str, dict]]) -> dict[str, str]:
    """Each case converted in a world of one; the error type and message it raised."""
    from mcore_rl.checkpoint.convert import ConvertOptions, convert

    out = {}
    for name, (hf, dst, extra) in cases.items():
        try:
            convert(ConvertOptions(hf, dst, **extra), progress=False)
            out[name] = "no error"
        except Exception as e:  # noqa: BLE001 (the test checks type and message)
            from mcore_rl.errors import McoreRLError

            out[name] = f"{'ok' if isinstance(e, McoreRLError) else type(e).__name__}: {e}"
    return out


def _unwritten_coverage(hf: str) -> str:
    """A resolver that wrote nothing must fail the coverage check (HF tensors unused)."""
    from mcore_rl.checkpoint.convert import HFShardResolver, check_coverage
    from mcore_rl.mapping.hf_io import SafetensorsReader
    from mcore_rl.mapping.weights import canonical_params
    from mcore_rl.models.builder import BuildOptions, build_model
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import weight_map
    from mcore_rl.parallel import ParallelLayout, initialize_parallel_state
    from mcore_rl.platform import active_platform

    initialize_parallel_state(ParallelLayout())
    args = model_args_from_hf(hf)
    chunks = build_model(args, ParallelLayout(), "actor", active_platform(), BuildOptions(meta_device=True))
    assert all(p.is_meta for c in chunks for p in c.parameters())
    source = SafetensorsReader(hf)
    resolver = HFShardResolver(chunks, weight_map(args, "actor", 1), source)
    resolver.used_hf = set(source) - {"model.norm.weight"}  # every HF tensor but one was written
    resolver.written = {n for c in chunks for n, _ in canonical_params(c)}
    try:
        check_coverage(resolver, chunks, source)
    except Exception as e:  # noqa: BLE001
        return str(e)
    return "no error"


def _damaged_copies(hf, tmp_path) -> dict:
    """HF directories with one defect each (config and weights copied from ``hf``)."""
    from safetensors.torch import load_file, save_file

    config = json.loads((hf / "config.json").read_text())
    tensors = load_file(hf / "model.safetensors")
    dirs = {}
    for name in ("no_weights", "index_missing", "truncated", "unknown_arch", "unknown_role", "extra_tensor"):
        d = tmp_path / name
        d.mkdir()
        cfg = dict(config)
        if name == "unknown_arch":
            cfg["model_type"] = "gpt2"
        if name == "unknown_role":
            cfg["architectures"] = ["LlamaModel"]
        (d / "config.json").write_text(json.dumps(cfg))
        extra = {"model.extra.weight": torch.ones(3)} if name == "extra_tensor" else {}
        if name != "no_weights":
            save_file({**tensors, **extra}, d / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
        if name == "index_missing":
            index = {"weight_map": {k: "model-00002-of-00002.safetensors" for k in tensors}}
            (d / "model.safetensors.index.json").write_text(json.dumps(index))
        if name == "truncated":
            path = d / "model-00001-of-00001.safetensors"
            path.write_bytes(path.read_bytes()[:-100])
        dirs[name] = str(d)
    return dirs


def test_bad_input_is_refused_with_the_value_and_the_fix(tmp_path):
    hf = tmp_path / "hf"
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(hf)
    bad = _damaged_copies(hf, tmp_path)
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("x")
    new = str(tmp_path / "new")
    cases = {name: (d, new, {}) for name, d in bad.items()}
    cases["missing_dir"] = (str(tmp_path / "nope"), new, {})
    cases["occupied"] = (str(hf), str(occupied), {})
    cases["world"] = (str(hf), new, dict(tp=2, ep=3))
    errors = run_ranks(1, _errors, cases)[0]
    expect = {
        "missing_dir": f"--hf_model_path {str(tmp_path / 'nope')!r} is not a directory",
        "no_weights": "no *.safetensors weights in",
        "index_missing": "names shard files that do not exist: ['model-00002-of-00002.safetensors']",
        "truncated": "model-00001-of-00001.safetensors is truncated",
        "unknown_arch": "unknown architecture model_type='gpt2'; supported:",
        "unknown_role": "architectures=['LlamaModel'] name neither a *ForCausalLM (actor) nor a "
                        "*ForTokenClassification (critic); pass --role actor|critic",
        "extra_tensor": "model.extra.weight",
        "occupied": "is not empty; pass --overwrite",
        "world": "--tp 2 x --pp 1 x --ep 3 = 6 != WORLD_SIZE 1",
    }
    for name, text in expect.items():
        assert errors[name].startswith("ok: ") and text in errors[name], f"{name}: {errors[name]}"
    assert (occupied / "keep.txt").exists()  # a refusal writes nothing in the way
    assert not os.path.exists(new)
    message = run_ranks(1, _unwritten_coverage, str(hf))[0]
    assert "HF tensors never written into the checkpoint: ['model.norm.weight']" in message, message
