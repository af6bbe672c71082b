"""converters/hf_to_mcore.py as a command: --test compares logits with transformers in a fresh
process (passes on a correct conversion, fails when the weights differ), and bad input is refused
with a message naming the value and the fix: as a command, one ``error:`` line, exit code 2, no
traceback and no file written (also when the writer fails: the old output stays)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(script: str, *argv: str, flags: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *flags, os.path.join(ROOT, "converters", script), *argv], env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_test_flag_passes_and_a_weight_corruption_fails(tmp_path):
    from safetensors.torch import load_file, save_file

    hf, out = tmp_path / "hf", tmp_path / "out"
    tiny_hf_model(tiny_config("qwen3", num_hidden_layers=2, head_dim=24)).save_pretrained(hf)
    r = _python("hf_to_mcore.py", "--hf_model_path", str(hf), "--output_path", str(out), "--test",
                flags=("-X", "importtime"))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    # a lean start-up: the converter itself imports no transformers (--test's check may, in its process)
    imported = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert "torch" in imported and not any(m.split(".")[0] == "transformers" for m in imported)
    assert "verify: max abs diff" in r.stdout and "PASS" in r.stdout, r.stdout
    assert "tensors" in r.stdout and "peak RSS" in r.stdout and "start-up" in r.stdout, r.stdout
    assert sorted(os.listdir(out)) == ["RECORD", "dist_ckpt", "huggingface", "mcore_rl.json"]
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
    assert r.stderr.splitlines() == [l for l in r.stderr.splitlines() if l.startswith("error: ")] and \
        "is not empty; pass --overwrite" in r.stderr, r.stderr


def _errors(cases: dict[str, tuple[str, str, dict]]) -> dict[str, str]:
    """Each case converted in a world of one; the error type and message it raised."""
    from mcore_rl.conversion.convert import ConvertOptions, convert

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
    from mcore_rl.conversion.convert import HFShardResolver, check_coverage
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
                        "*ForTokenClassification / *ForSequenceClassification (critic); pass --role actor|critic",
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


def _tree(root) -> dict[str, int]:
    """Every path under ``root`` (relative) with its size (-1: a directory, -2: a link)."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(dirpath, name)
            kind = -2 if os.path.islink(path) else -1 if os.path.isdir(path) else os.path.getsize(path)
            out[os.path.relpath(path, root)] = kind
    return out


def _start(tmp, script: str, *argv: str) -> subprocess.Popen:
    """The CLI in a fresh interpreter, temporary files under ``tmp/tmp`` (so the check sees them)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp / "tmp")}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "converters", script), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _bad_inputs(tmp_path) -> dict[str, tuple[list[str], str]]:
    """name -> (CLI arguments, text the error line must hold): every kind of bad input."""
    from safetensors.torch import save_file

    hf = tmp_path / "hf"
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(hf)
    bad = _damaged_copies(hf, tmp_path)
    for name, header in (("header_list", b"[]"), ("header_number", b"3")):  # JSON, but not an object
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text((hf / "config.json").read_text())
        (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
        bad[name] = str(d)
    escape = tmp_path / "escape"  # an index naming a valid shard outside its directory
    escape.mkdir()
    (escape / "config.json").write_text((hf / "config.json").read_text())
    save_file({"x": torch.ones(2)}, str(tmp_path / "x.safetensors"))
    (escape / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../x.safetensors"}}))
    box = tmp_path / "box"  # an output that contains its input
    (box / "hf").mkdir(parents=True)
    for f in hf.iterdir():
        (box / "hf" / f.name).write_bytes(f.read_bytes())
    (tmp_path / "link").symlink_to(hf, target_is_directory=True)
    (tmp_path / "a_file").write_text("x")
    new, h = str(tmp_path / "new"), ["--hf_model_path"]
    return {
        "missing_dir": (h + [str(tmp_path / "nope"), "--output_path", new], "is not a directory"),
        "unknown_arch": (h + [bad["unknown_arch"], "--output_path", new], "unknown architecture model_type='gpt2'"),
        "missing_shard": (h + [bad["index_missing"], "--output_path", new], "names shard files that do not exist"),
        "truncated_shard": (h + [bad["truncated"], "--output_path", new],
                            "model-00001-of-00001.safetensors is truncated"),
        "header_list": (h + [bad["header_list"], "--output_path", new], "unreadable safetensors header"),
        "header_number": (h + [bad["header_number"], "--output_path", new], "unreadable safetensors header"),
        "index_escape": (h + [str(escape), "--output_path", new], "names the file '../x.safetensors', which leaves"),
        "output_file": (h + [str(hf), "--output_path", str(tmp_path / "a_file")], "is a file; pass a directory"),
        "output_is_input": (h + [str(hf), "--output_path", str(hf), "--overwrite"], "overlaps --hf_model_path"),
        "output_inside": (h + [str(hf), "--output_path", str(hf / "sub"), "--overwrite"], "overlaps --hf_model_path"),
        "output_contains": (h + [str(box / "hf"), "--output_path", str(box), "--overwrite"], "overlaps"),
        "output_links_to_input": (h + [str(hf), "--output_path", str(tmp_path / "link"), "--overwrite"], "overlaps"),
        "merge_missing_dir": (["merge", "--local_dir", str(tmp_path / "nope"), "--target_dir", new],
                              "is not a model directory: no mcore_rl.json"),
        "merge_not_a_model": (["merge", "--local_dir", str(hf), "--target_dir", new],
                              "is not a model directory: no mcore_rl.json"),
    }


def test_bad_input_gives_one_error_line_exit_2_and_writes_nothing(tmp_path):
    """Both CLIs in fresh processes: exactly one stderr line ``error: ...`` naming the value, exit
    code 2, no traceback, no warning, no file created or removed (an overlapping output is refused
    even with --overwrite: the input survives); a mistyped flag too (argparse's message, one line)."""
    cases = _bad_inputs(tmp_path)
    (tmp_path / "tmp").mkdir()
    before = _tree(tmp_path)
    runs = {name: _start(tmp_path, "mcore_to_hf.py" if argv[0] == "merge" else "hf_to_mcore.py", *argv)
            for name, (argv, _) in cases.items()}
    runs["typo_flag"] = _start(tmp_path, "hf_to_mcore.py", "--hf_model_pth", str(tmp_path / "hf"),
                               "--output_path", str(tmp_path / "new"))
    done = {name: (p.wait(timeout=300), *p.communicate()) for name, p in runs.items()}
    for name, (text_argv, text) in cases.items():
        code, out, err = done[name]
        assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and text in err, \
            f"{name}: exit {code}\nstdout: {out[-2000:]}\nstderr: {err[-3000:]}"
    code, _, err = done["typo_flag"]
    assert code == 2 and err == ("error: hf_to_mcore.py: the following arguments are required: --hf_model_path "
                                 "(see hf_to_mcore.py --help)\n"), err  # one line too, the usage named
    assert _tree(tmp_path) == before  # nothing written, nothing removed (inputs intact)


def test_failure_inside_the_writer_keeps_the_old_output(tmp_path):
    """A tensor whose shape contradicts the config fails inside the checkpoint writer (torch wraps
    it in a CheckpointException): one error line naming it, exit code 2, the old output given to
    --overwrite as it was, no staging directory or store file left."""
    from safetensors.torch import load_file, save_file

    hf, bad, old = tmp_path / "hf", tmp_path / "bad", tmp_path / "old"
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(hf)
    bad.mkdir()
    (bad / "config.json").write_text((hf / "config.json").read_text())
    tensors = load_file(hf / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, bad / "model.safetensors", metadata={"format": "pt"})
    (old / "dist_ckpt").mkdir(parents=True)
    (old / "dist_ckpt" / "__0_0.distcp").write_bytes(b"old shard")
    (old / "mcore_rl.json").write_text("{}")
    (tmp_path / "tmp").mkdir()
    before = _tree(tmp_path)
    p = _start(tmp_path, "hf_to_mcore.py", "--hf_model_path", str(bad), "--output_path", str(old), "--overwrite")
    code, (out, err) = p.wait(timeout=300), p.communicate()
    assert code == 2 and err.count("\n") == 1 and err.startswith(
        "error: decoder.final_layernorm.weight: HF tensors ['model.norm.weight'] give shape (63,)"), err
    assert "Traceback" not in err and "the config does not match the weights" in err, err
    assert _tree(tmp_path) == before
