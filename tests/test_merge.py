"""converters/mcore_to_hf.py merge: checkpoints written by CheckpointManager.save from trained tiny
engines (TP=2 llama; TP=2 qwen2 with tied embeddings; PP=2 x VPP=2 qwen3; EP=2 qwen2_moe with a
shared expert and mixtral; a TP=2 llama critic whose huggingface/config.json is a causal LM's)
merge into HF dirs whose tensors are bit-identical to the saving engine's own ``export_hf``, that
load with transformers' Auto classes and give the engine's log-probs / values; small
max_shard_size gives shards + index; the CLI runs without megatron and torch.distributed; bad
inputs are errors naming the problem.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.dist import run_ranks
from tests.merge_bodies import hf_dir_for, save_trained, train_batch
from tests.tiny import hf_log_probs, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = {  # name: (model_type, role, layout, config overrides)
    "llama_tp2": ("llama", "actor", dict(tp=2), {}),
    "qwen2_tp2_tied": ("qwen2", "actor", dict(tp=2), dict(tie_word_embeddings=True)),
    "qwen3_pp2_vpp2": ("qwen3", "actor", dict(pp=2, vpp=2), {}),
    "qwen2_moe_ep2": ("qwen2_moe", "actor", dict(ep=2), {}),
    "mixtral_ep2": ("mixtral", "actor", dict(ep=2), {}),
    # trained MLA + sigmoid router (correction bias, a dense first layer): per-layer keys on disk
    "deepseek_v3_ep2": ("deepseek_v3", "actor", dict(ep=2), {}),
    "llama_critic": ("llama", "critic", dict(tp=2), {}),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """name -> (model dir, engine export, engine scores, batch)."""
    tmp = str(tmp_path_factory.mktemp("merge"))
    batch = train_batch(200)
    out = {}
    for name, (model_type, role, layout, overrides) in CASES.items():
        hf = hf_dir_for(os.path.join(tmp, name), model_type, role, **overrides)
        source = None
        if role == "critic":  # started from a causal LM: the merge must make the config a critic's
            source = os.path.join(tmp, name, "causal_config")
            tiny_config(model_type, num_hidden_layers=4, **overrides).save_pretrained(source)
        root = os.path.join(tmp, name, "ckpt")
        ref = run_ranks(2, save_trained, hf, layout, role, root, batch, source, daemon=False)[0]
        out[name] = (os.path.join(root, "global_step_1", role), ref["export"], ref["scores"], batch)
    return out


def _merge(local_dir, target, **kw):
    from mcore_rl.conversion.merge import merge

    return merge(local_dir, str(target), **kw)


def _load(target, role):
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    cls = AutoModelForCausalLM if role == "actor" else AutoModelForTokenClassification
    return cls.from_pretrained(str(target), attn_implementation="eager").eval()


@pytest.mark.parametrize("name", list(CASES))
def test_merge_equals_engine_export_and_scores(saved, tmp_path, name):
    from safetensors import safe_open

    from mcore_rl.mapping.hf_io import SafetensorsReader

    local, export, scores, batch = saved[name]
    role = CASES[name][1]
    summary = _merge(local, tmp_path / "hf", max_shard_size="5GB")
    merged = SafetensorsReader(tmp_path / "hf")
    assert sorted(merged) == sorted(export), set(merged) ^ set(export)
    differ = [k for k in export if not torch.equal(merged[k], export[k])]
    assert not differ, f"{name}: merged tensors differ from the engine's export: {differ[:6]}"
    assert summary.tensors == len(export) and summary.shards == 1
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
    if name == "qwen2_tp2_tied":
        assert "lm_head.weight" not in merged
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    model = _load(tmp_path / "hf", role)
    mask = batch["attention_mask"][:, -scores.shape[1]:].float()
    if role == "actor":
        assert config["architectures"][0].endswith("ForCausalLM")
        ours = hf_log_probs(model, batch)[0]
    else:
        assert config["architectures"] == ["LlamaForTokenClassification"] and config["num_labels"] == 1
        with torch.no_grad():
            ours = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ours = ours[:, -scores.shape[1] - 1:-1, 0] * mask
    err = ((ours - scores) * mask).abs().max().item()
    assert err <= 1e-4 and scores.abs().max() > 0.1, f"{name}: max |HF - engine| = {err}"


def test_rules_agree_with_weight_map(saved):
    """The merge enumerates the table as WeightMap(tp=1) does (mapping/weights.py imports megatron)."""
    from mcore_rl.conversion.merge_io import canonical_rules, open_model_dir
    from mcore_rl.models.hf_weights import weight_map

    for name, (local, _, _, _) in saved.items():
        model = open_model_dir(local)
        wmap = weight_map(model.args, model.role, 1)
        names = []
        for canonical, hf_names, transform in canonical_rules(model.args, model.role):
            assert wmap.rule(canonical) == (hf_names, transform), canonical
            names += hf_names
        assert len(names) == len(set(names)) and set(names) == wmap.hf_keys(), name


def test_small_shards_index_and_load(saved, tmp_path):
    from safetensors import safe_open

    from mcore_rl.fileio.safetensors_write import TensorSpec

    local, export, scores, batch = saved["qwen2_moe_ep2"]
    limit = 64 * 1024  # the 51 KiB embedding fits; the 200x64 fp32 lm_head too; many shards
    summary = _merge(local, tmp_path / "hf", max_shard_size=limit)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert summary.shards == len(files) > 3 and sorted(os.listdir(tmp_path / "hf")) == sorted(
        files + ["config.json", "generation_config.json", "mcore_rl_export.json", "model.safetensors.index.json"])
    total = 0
    for file in files:
        with safe_open(str(tmp_path / "hf" / file), framework="pt") as f:
            keys = list(f.keys())
            assert all(index["weight_map"][k] == file for k in keys)
            size = sum(TensorSpec(k, tuple(f.get_slice(k).get_shape()), export[k].dtype).nbytes for k in keys)
            assert size <= limit or len(keys) == 1, (file, size)
            total += size
            for k in keys:
                assert torch.equal(f.get_tensor(k), export[k]), k
    assert index["metadata"]["total_size"] == total == sum(v.numel() * v.element_size() for v in export.values())
    mask = batch["attention_mask"][:, -scores.shape[1]:].float()
    ours = hf_log_probs(_load(tmp_path / "hf", "actor"), batch)[0]
    assert ((ours - scores) * mask).abs().max() <= 1e-4


def _cli(*args: str) -> subprocess.CompletedProcess:
    """The CLI in a fresh interpreter; afterwards prints whether megatron or torch.distributed's
    process group were touched."""
    code = ("import runpy, sys\n"
            f"sys.argv = ['mcore_to_hf.py', *{list(args)!r}]\n"
            "try:\n    runpy.run_path('converters/mcore_to_hf.py', run_name='__main__')\n"
            "except SystemExit as e:\n    rc = e.code\n"
            "import torch.distributed as d\n"
            "print('MEGATRON', sorted(m for m in sys.modules if m.startswith('megatron'))[:3])\n"
            "print('DIST_INIT', d.is_available() and d.is_initialized())\n"
            "sys.exit(rc)\n")
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_cli_merge_and_test_without_megatron(saved, tmp_path):
    from safetensors.torch import save_file

    local, export, _, _ = saved["qwen3_pp2_vpp2"]
    run = _cli("merge", "--local_dir", local, "--target_dir", str(tmp_path / "hf"), "--max_shard_size", "1MB")
    assert run.returncode == 0, run.stderr
    assert "MEGATRON []" in run.stdout and "DIST_INIT False" in run.stdout, run.stdout
    assert "merged 47 tensors" in run.stdout and "peak RSS" in run.stdout, run.stdout
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ref = tmp_path / "ref"
    ref.mkdir()
    save_file({k: v.contiguous() for k, v in export.items()}, str(ref / "model.safetensors"))
    run = _cli("test", "--local_dir", local, "--test_hf_dir", str(ref))
    assert run.returncode == 0 and "OK:" in run.stdout and "MEGATRON []" in run.stdout, run.stdout + run.stderr
    assert "model.layers.*.self_attn.q_proj.weight" in run.stdout
    bad = dict(export)
    bad["model.layers.2.mlp.up_proj.weight"] = bad["model.layers.2.mlp.up_proj.weight"].clone()
    bad["model.layers.2.mlp.up_proj.weight"][3, 5] += 1e-3
    save_file({k: v.contiguous() for k, v in bad.items()}, str(ref / "model.safetensors"))
    run = _cli("test", "--local_dir", local, "--test_hf_dir", str(ref))
    assert run.returncode == 1 and "MISMATCH max|diff| 1.000e-03  model.layers.*.mlp.up_proj.weight" \
        in run.stdout, run.stdout + run.stderr


def test_errors_name_the_problem(saved, tmp_path):
    from mcore_rl.conversion.merge import MergeError
    from mcore_rl.fileio.torch_dist_read import TorchDistReadError
    from mcore_rl.errors import McoreRLError

    local, _, _, _ = saved["llama_critic"]
    step = os.path.dirname(local)
    with pytest.raises(MergeError, match=r"is not a model directory: no mcore_rl.json; it holds model "
                                         r"dirs \['critic'\]") as e:
        _merge(step, tmp_path / "a")
    assert isinstance(e.value, McoreRLError)
    with pytest.raises(MergeError, match="model_class='causal_lm' for a critic: a critic has a value head"):
        _merge(local, tmp_path / "b", model_class="causal_lm")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("x")
    with pytest.raises(MergeError, match="is not empty; pass --overwrite"):
        _merge(local, tmp_path / "c")
    with pytest.raises(MergeError, match=r"was not written by this command: it holds \['keep.txt'\] and no "
                                         r"mcore_rl_export.json record; --overwrite replaces only"):
        _merge(local, tmp_path / "c", overwrite=True)  # not an earlier merge: kept
    os.remove(tmp_path / "c" / "keep.txt")
    _merge(local, tmp_path / "c")  # empty: written
    (tmp_path / "c" / "model-00001-of-00009.safetensors").write_text("stale")
    with pytest.raises(MergeError, match=r"holds \['model-00001-of-00009.safetensors'\], which its "
                                         r"mcore_rl_export.json does not list"):
        _merge(local, tmp_path / "c", overwrite=True)
    os.remove(tmp_path / "c" / "model-00001-of-00009.safetensors")
    _merge(local, tmp_path / "c", overwrite=True)  # an earlier merge: the directory is replaced as a whole
    assert sorted(os.listdir(tmp_path / "c")) == ["config.json", "mcore_rl_export.json", "model.safetensors"]

    copy = tmp_path / "copy"  # a role dir copied out of its step (no record): the reader's own checks
    shutil.copytree(local, copy)
    meta = json.loads((copy / "mcore_rl.json").read_text())
    (copy / "mcore_rl.json").write_text(json.dumps({**meta, "contents": ["optimizer"]}))
    with pytest.raises(MergeError, match=r"contents \['optimizer'\] hold no 'model' weights"):
        _merge(str(copy), tmp_path / "d", verify=False)
    (copy / "mcore_rl.json").write_text(json.dumps(meta))
    shard = copy / "dist_ckpt" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(3000)  # past the first ShardedObjects, into the model tensors
    with pytest.raises(TorchDistReadError, match=r"__1_0.distcp is truncated: '.*' needs bytes"):
        _merge(str(copy), tmp_path / "e", verify=False)
    os.remove(shard)
    with pytest.raises(TorchDistReadError, match=r"__1_0.distcp is missing: it holds"):
        _merge(str(copy), tmp_path / "f", verify=False)
    os.remove(copy / "dist_ckpt" / ".metadata")
    with pytest.raises(TorchDistReadError, match=r"is not a torch_dist checkpoint: .*\.metadata does not exist"):
        _merge(str(copy), tmp_path / "g", verify=False)


def test_config_of_another_architecture_names_missing_and_unconsumed(saved, tmp_path):
    """Every expected HF tensor must come from the checkpoint and every model key must be consumed."""
    from mcore_rl.conversion.merge import MergeError

    for name, model_type, message in [
        ("llama_tp2", "qwen2", r"expected tensors missing: \[.decoder.layers.0.self_attention.linear_qkv.bias"),
        ("qwen2_tp2_tied", "llama", r"checkpoint keys no mapping row consumes: "
                                    r"\['decoder.layers.self_attention.linear_qkv.bias'\]"),
    ]:
        copy = tmp_path / name
        shutil.copytree(saved[name][0], copy)
        config = json.loads((copy / "huggingface" / "config.json").read_text())
        (copy / "huggingface" / "config.json").write_text(json.dumps({**config, "model_type": model_type}))
        with pytest.raises(MergeError, match=message):
            _merge(str(copy), tmp_path / f"out_{name}", verify=False)  # a copy out of its step: no record
        assert not (tmp_path / f"out_{name}").exists()  # checked before anything is written


def test_reader_parts_and_objects(saved):
    from mcore_rl.fileio.torch_dist_read import TorchDistReader, TorchDistReadError

    local, export, _, _ = saved["mixtral_ep2"]
    reader = TorchDistReader(os.path.join(local, "dist_ckpt"))
    key = "decoder.layers.mlp.experts.experts.linear_fc2.weight"
    assert reader.info(key).shape == (4, 4, 64, 48)
    part = reader.read(key, (2, 3))  # layer 2, expert 3 (written by EP rank 1)
    assert torch.equal(part, export["model.layers.2.block_sparse_moe.experts.3.w2.weight"])
    layer = reader.read(key, (1,))
    assert torch.equal(layer[0], export["model.layers.1.block_sparse_moe.experts.0.w2.weight"])
    (rng,) = reader.read_object("rng_state/shard_1_2")  # a ShardedObject, via weights_only unpickling
    assert rng["coords"]["rank"] == 1 and torch.is_tensor(rng["torch"])
    with pytest.raises(TorchDistReadError, match=r"index \(4,\) is outside"):
        reader.read(key, (4,))


def test_writer_plans_like_hf(tmp_path):
    from safetensors.torch import load_file

    from mcore_rl.fileio.safetensors_write import (SafetensorsWriteError, ShardedSafetensorsWriter,
                                                       TensorSpec, parse_size)

    assert (parse_size("5GB"), parse_size("2MiB"), parse_size("1.5KB"), parse_size(10)) == (
        5 * 10**9, 2 * 2**20, 1500, 10)
    with pytest.raises(SafetensorsWriteError, match=r"max_shard_size='5 gigs' is not a size"):
        parse_size("5 gigs")
    tensors = {"big": torch.ones(40, dtype=torch.bfloat16), "a": torch.arange(10.0), "c": torch.arange(3),
               "d": torch.tensor([True, False])}
    specs = [TensorSpec(k, tuple(v.shape), v.dtype) for k, v in tensors.items()]
    writer = ShardedSafetensorsWriter(str(tmp_path), specs, 60)  # big: 80 B (> limit), a: 40 B, c+d: 26 B
    assert [[s.name for s in shard] for shard in writer.shards] == [["big"], ["a"], ["c", "d"]]
    with pytest.raises(SafetensorsWriteError, match=r"got a \(10,\) torch.float32, the plan's next tensor is big"):
        writer.write("a", tensors["a"])
    for k, v in tensors.items():
        writer.write(k, v)
    writer.close()
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 40 + 80 + 24 + 2
    for file in set(index["weight_map"].values()):
        for k, v in load_file(str(tmp_path / file)).items():
            assert torch.equal(v, tensors[k]) and index["weight_map"][k] == file
