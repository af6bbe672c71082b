"""Issue #29, the command-line contract and round trips (defects 10-13): every failure of a
converter is one ``error:`` line, exit code 2, nothing left behind (usage errors, config.json
values of the wrong type or range, safetensors headers that do not describe their data, a full
disk); a reward model comes back as the class it was; the converter keeps the weights' dtype
whatever config.json says; the main job ends a refused checkpoint with one line, exit code 2."""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import warnings

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _start(script: str, *argv: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "converters", script), *argv], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _one_error_line(proc: subprocess.Popen, *texts: str) -> str:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2 and err.count("\n") == 1 and err.startswith("error: "), \
        f"exit {proc.returncode}\nstdout: {out[-2000:]}\nstderr: {err[-3000:]}"
    assert all(t in err for t in texts), err
    return err


def _convert(jobs: list[tuple[str, str]]) -> dict[str, tuple[str, list[str]]]:
    """In one rank world: each (hf_dir, out_dir) converted with the defaults; out_dir -> (dtype
    written, warnings given)."""
    from mcore_rl.conversion.convert import ConvertOptions, convert

    out = {}
    for hf, dst in jobs:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dtype = convert(ConvertOptions(hf, dst), progress=False).dtype
        out[dst] = (dtype, [str(w.message) for w in seen if type(w.message).__name__ == "DtypeWarning"])
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny fp32 llama (config: float32) and the same weights under a config saying bfloat16; a
    LlamaForSequenceClassification reward model (transformers' own, bias-free score); a token
    classification critic (random score bias): each saved by transformers and converted."""
    from transformers import LlamaForSequenceClassification

    base = tmp_path_factory.mktemp("cli_errors")
    hf, hf_bf16_config, rm, critic = (str(base / n) for n in ("hf", "hf_bf16_config", "rm", "critic"))
    tiny_hf_model(tiny_config("llama", num_hidden_layers=1)).save_pretrained(hf)
    tiny_hf_model(tiny_config("llama", num_hidden_layers=1)).save_pretrained(hf_bf16_config)
    config = json.loads(open(os.path.join(hf_bf16_config, "config.json")).read())
    assert config["dtype"] == "float32"
    config["dtype"] = "bfloat16"
    with open(os.path.join(hf_bf16_config, "config.json"), "w") as f:
        json.dump(config, f)
    rm_config = tiny_config("llama", num_hidden_layers=1, num_labels=1, pad_token_id=0)
    torch.manual_seed(5)
    LlamaForSequenceClassification(rm_config).save_pretrained(rm)
    tiny_hf_model(tiny_config("llama", num_hidden_layers=1), role="critic").save_pretrained(critic)
    dirs = {"hf": hf, "hf_bf16_config": hf_bf16_config, "rm": rm, "critic": critic}
    outs = {f"{k}_out": str(base / f"{k}_out") for k in dirs}
    written = run_ranks(1, _convert, [(dirs[k], outs[f"{k}_out"]) for k in dirs])[0]
    return {**dirs, **outs, "written": written, "base": str(base)}


# ---- defect 10: one error line ------------------------------------------------------------------
def _header_damage(src: str, dst: str, mode: str) -> None:
    """A copy of the safetensors file ``src`` whose header lies about its first tensor (``int_norm``:
    about ``model.norm.weight``'s dtype)."""
    raw = open(src, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header, data = json.loads(raw[8:8 + n]), raw[8 + n:]
    first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    entry = header[first]
    begin, end = entry["data_offsets"]
    if mode == "offsets":
        entry["data_offsets"] = [begin, end - 4]
    elif mode == "shape":
        entry["shape"] = [entry["shape"][0] + 1, *entry["shape"][1:]]
    elif mode == "dtype":
        entry["dtype"] = "F16"
    elif mode == "negative":
        entry["shape"] = [-1, *entry["shape"][1:]]
    elif mode == "int_norm":  # the F32 bytes of model.norm.weight declared I32: same size, values read as ints
        assert header["model.norm.weight"]["dtype"] == "F32"
        header["model.norm.weight"]["dtype"] = "I32"
    elif mode == "gap":
        for v in header.values():
            if isinstance(v, dict) and "data_offsets" in v and v is not entry:
                v["data_offsets"] = [x + 4 for x in v["data_offsets"]]
        data = data[:end] + b"\0" * 4 + data[end:]
    text = json.dumps(header).encode()
    tail = b"\0" * 8 if mode == "trailing" else b""
    with open(dst, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data + tail)


def test_bad_headers_and_config_values_are_named(models, tmp_path):
    """config.json sizes of the wrong type or range and safetensors headers whose offsets do not
    match dtype and shape (or do not tile the data) are refused naming the key / entry and value,
    in the library and, through both converters, as one error line with nothing written."""
    from mcore_rl.conversion.convert_input import ConvertError, check_shard, role_from_config
    from mcore_rl.models.hf_config import ConfigError, model_args_from_hf

    good = json.loads(open(os.path.join(models["hf"], "config.json")).read())
    cases = {"hidden_size": ("64", "hidden_size='64' (str) must be an integer >= 1"),
             "num_hidden_layers": (0, "num_hidden_layers=0 (int) must be an integer >= 1"),
             "vocab_size": (True, "vocab_size=True (bool) must be an integer >= 1"),
             "rms_norm_eps": (-1e-6, "rms_norm_eps=-1e-06 (float) must be a finite number > 0"),
             "max_position_embeddings": (1.5, "max_position_embeddings=1.5 (float) must be an integer >= 1"),
             "attention_dropout": (1.0, "attention_dropout=1.0 (float) must be a number in [0, 1)"),
             "num_key_value_heads": (3, "num_attention_heads=4 is not a multiple of num_key_value_heads=3"),
             "tie_word_embeddings": ("no", "tie_word_embeddings='no' (str) must be true or false"),  # bool("no")
             "rope_theta": ("1e4", "rope_theta='1e4' (str) must be a finite number > 0")}
    for key, (value, text) in cases.items():
        d = tmp_path / f"cfg_{key}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**good, key: value}))
        with pytest.raises(ConfigError) as e:
            model_args_from_hf(str(d))
        assert text in str(e.value) and "config.json (model_type 'llama')" in str(e.value), (key, str(e.value))
    (tmp_path / "cfg_tie_word_embeddings" / "config.json").write_text(json.dumps({**good, "architectures": 5}))
    with pytest.raises(ConvertError, match=r"architectures=5 is not a list of class names"):
        role_from_config(str(tmp_path / "cfg_tie_word_embeddings"))
    shard = os.path.join(models["hf"], "model.safetensors")
    texts = {"offsets": "data_offsets [0, 51196] span 51196 bytes, its dtype F32 and shape [200, 64] need 51200",
             "shape": "its dtype F32 and shape [201, 64] need 51456", "dtype": "its dtype F16 and shape [200, 64]",
             "negative": "shape [-1, 64]", "gap": "starts at data byte 51204, the entries before it end at 51200",
             "trailing": "8 bytes after the last tensor the header names"}
    for mode, text in texts.items():
        _header_damage(shard, str(tmp_path / f"{mode}.safetensors"), mode)
        with pytest.raises(ConvertError) as e:
            check_shard(str(tmp_path / f"{mode}.safetensors"))
        assert text in str(e.value), (mode, str(e.value))
    # an index naming a tensor its file does not hold (the writer's error blamed the disk)
    from safetensors.torch import save_file

    from mcore_rl.conversion.convert_input import check_input

    mixed = tmp_path / "index_lies"
    mixed.mkdir()
    (mixed / "config.json").write_text(json.dumps(good))
    os.link(shard, mixed / "model.safetensors")
    save_file({"x": torch.ones(2)}, str(mixed / "other.safetensors"))
    names = list(json.loads(open(shard, "rb").read()[8:8 + struct.unpack("<Q", open(shard, "rb").read(8))[0]]))
    weight_map = {n: "model.safetensors" for n in names if n != "__metadata__"}
    weight_map["model.norm.weight"] = "other.safetensors"
    (mixed / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ConvertError, match=r"names tensors their files do not hold: \['model.norm.weight "
                                           r"\(other.safetensors\)'\]"):
        check_input(str(mixed))
    # the commands: the config value and the header named, nothing written
    bad_cfg, bad_st = tmp_path / "bad_cfg", tmp_path / "bad_st"
    for d in (bad_cfg, bad_st):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({**good, "hidden_size": "64"} if d == bad_cfg else good))
    os.link(shard, bad_cfg / "model.safetensors")
    _header_damage(shard, str(bad_st / "model.safetensors"), "offsets")
    int_norm = tmp_path / "int_norm"  # issue #37 item 12: an I32 header entry where a float weight belongs
    int_norm.mkdir()
    (int_norm / "config.json").write_text(json.dumps(good))
    _header_damage(shard, str(int_norm / "model.safetensors"), "int_norm")
    runs = [(_start("hf_to_mcore.py", "--hf_model_path", str(int_norm), "--output_path", str(tmp_path / "o3")),
             ("tensor 'model.norm.weight' is stored as I32, an integer dtype, where the model expects a float weight",)),
            (_start("mcore_to_hf.py", "merge", "--local_dir", models["hf_out"], "--target_dir", str(tmp_path / "o4"),
                    "--dtype", "fp8", "--fp8_block_size", "99999999999999999999"),  # issue #37 item 11
             ("fp8 block size '99999999999999999999': give ROWSxCOLS of integers in 1..2147483647",)),(_start("hf_to_mcore.py", "--hf_model_path", str(bad_cfg), "--output_path", str(tmp_path / "o1")),
             ("hidden_size='64' (str) must be an integer >= 1",)),
            (_start("hf_to_mcore.py", "--hf_model_path", str(bad_st), "--output_path", str(tmp_path / "o2")),
             ("model.safetensors: header entry", "need 51200")),
            (_start("mcore_to_hf.py", "test", "--local_dir", models["hf_out"]),
             ("error: mcore_to_hf.py test: the following arguments are required: --test_hf_dir "
              "(see mcore_to_hf.py test --help)",))]
    for proc, text in runs:
        _one_error_line(proc, *text)
    assert not any(os.path.exists(tmp_path / o) for o in ("o1", "o2", "o3", "o4"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def _tmpfs(path: str, size: str) -> bool:
    """Mounts a tmpfs of ``size`` at ``path`` where this process may (root); False elsewhere."""
    os.makedirs(path)
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                          capture_output=True).returncode == 0


def test_full_disk_during_merge_is_one_line_and_leaves_nothing(models, tmp_path):
    """ENOSPC while the merge writes (the fault hook; and a real 64 KiB tmpfs where this machine
    lets the test mount one): one error line naming the output, exit 2, no staging left."""
    target, small = tmp_path / "faulted" / "merged", str(tmp_path / "small")
    os.makedirs(target.parent)
    mounted, runs = _tmpfs(small, "64k"), []
    try:
        runs.append(_start("mcore_to_hf.py", "merge", "--local_dir", models["hf_out"], "--target_dir", str(target),
                           env={"MCORE_RL_CKPT_IO_FAULT": "write:ENOSPC"}))
        if mounted:
            runs.append(_start("mcore_to_hf.py", "merge", "--local_dir", models["hf_out"], "--target_dir",
                               f"{small}/m"))
        _one_error_line(runs[0], f"merging {models['hf_out']!r} into {str(target)!r} failed: [Errno 28] No space")
        assert os.listdir(target.parent) == []
        if mounted:
            _one_error_line(runs[1], f"into '{small}/m' failed: [Errno 28] No space left on device")
            assert os.listdir(small) == []
    finally:
        for proc in runs:  # none may hold the mount when it goes
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        if mounted:
            subprocess.run(["umount", small], check=True)


# ---- defect 11: a reward model keeps its class ----------------------------------------------------
def test_reward_model_round_trip_keeps_its_class(models, tmp_path):
    """LlamaForSequenceClassification (saved by transformers) -> convert -> merge loads in
    transformers as the same class with identical pooled logits; ``test`` against the original
    passes; --model_class token_classification still gives the token classifier; a critic with a
    non-zero score bias is refused as a sequence classifier (it has no bias to hold it)."""
    import transformers

    from mcore_rl.conversion.merge import MergeError, compare, merge

    merge(models["rm_out"], str(tmp_path / "rm"))
    named = json.loads((tmp_path / "rm" / "config.json").read_text())["architectures"]
    assert named == ["LlamaForSequenceClassification"], named
    back = getattr(transformers, named[0]).from_pretrained(tmp_path / "rm").eval()  # the class the config names
    original = transformers.LlamaForSequenceClassification.from_pretrained(models["rm"]).eval()
    ids = torch.randint(1, 200, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    with torch.no_grad():
        want = original(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask).logits
        got = back(input_ids=ids.masked_fill(mask == 0, 0), attention_mask=mask).logits
    assert got.shape == want.shape == (3, 1) and torch.equal(got, want)
    diffs, problems = compare(models["rm_out"], models["rm"])
    assert problems == [] and diffs and max(diffs.values()) == 0.0, (diffs, problems)
    merge(models["rm_out"], str(tmp_path / "tok"), model_class="token_classification")
    config = json.loads((tmp_path / "tok" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForTokenClassification"] and config["num_labels"] == 1
    merge(models["critic_out"], str(tmp_path / "critic"))  # the critic's own class (auto)
    assert json.loads((tmp_path / "critic" / "config.json").read_text())["architectures"] == \
        ["LlamaForTokenClassification"]
    with pytest.raises(MergeError, match=r"the value head's bias is \[.*\], not 0: LlamaForSequenceClassification "
                                         "has no score bias"):
        merge(models["critic_out"], str(tmp_path / "seq"), model_class="sequence_classification")
    assert not os.path.exists(tmp_path / "seq")


# ---- defect 12: the weights' dtype ------------------------------------------------------------------
def test_dtype_follows_the_weights_not_the_config(models, tmp_path):
    """fp32 weights under a config saying bfloat16 convert to fp32 (nothing rounded) with one
    warning naming both; the output's config and the merged model's say float32 and hold the
    source tensors bit for bit."""
    from safetensors.torch import load_file

    from mcore_rl.conversion.merge import merge

    out = models["hf_bf16_config_out"]
    dtype, notes = models["written"][out]
    assert dtype == "fp32" and len(notes) == 1 and "states dtype bfloat16 but the weights are stored in fp32" \
        in notes[0] and "pass --dtype bf16" in notes[0], models["written"][out]
    assert models["written"][models["hf_out"]] == ("fp32", [])  # config and weights agree: no warning
    stated = json.loads(open(os.path.join(out, "huggingface", "config.json")).read())
    assert stated["dtype"] == stated["torch_dtype"] == "float32"
    merge(out, str(tmp_path / "m"))
    assert json.loads((tmp_path / "m" / "config.json").read_text())["dtype"] == "float32"
    source, merged = load_file(os.path.join(models["hf_bf16_config"], "model.safetensors")), \
        load_file(tmp_path / "m" / "model.safetensors")
    assert set(source) == set(merged) and all(torch.equal(source[k], merged[k]) for k in source)


# ---- defect 13: the main job -----------------------------------------------------------------------
def test_job_ends_a_refused_checkpoint_with_one_line(models, tmp_path):
    """launch/run.sh with 2 ranks and model.mcore_dir = a checkpoint whose .metadata names files
    outside it: exactly one line ``error: ... do not load it`` (not one per rank, no traceback, no
    torchrun report), exit code 2."""
    import dataclasses
    import pickle
    import shutil

    bad = tmp_path / "refused"
    shutil.copytree(models["hf_out"], bad)
    path = bad / "dist_ckpt" / ".metadata"
    meta = pickle.loads(path.read_bytes())  # noqa: S301 - this test's own checkpoint
    meta.storage_data = {k: dataclasses.replace(v, relative_path="../../outside/" + v.relative_path)
                         for k, v in meta.storage_data.items()}
    path.write_bytes(pickle.dumps(meta))
    env = {**os.environ, "PYTHONPATH": ROOT,
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    done = subprocess.run(["bash", "launch/run.sh", "2", "configs/grpo_demo.yaml", "steps=1", "progress_bar=false",
                           f"output_dir={tmp_path / 'job'}", f"model.mcore_dir={bad}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, f"exit {done.returncode}\n" + "\n".join(lines[-60:])
    assert lines[0].startswith("error: ") and "names the file '../../outside/" in lines[0] \
        and "do not load it" in lines[0], lines
