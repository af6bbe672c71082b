"""The two model-directory layouts (``fileio.model_layout``) and their one reader: a converter
output (the ``mcore_rl`` layout, whose ``mcore_rl.json`` ``"layout"`` holds parallel sizes) and the
same model moved into verl 0.9.1's layout (``model/dist_ckpt/``, ``model/huggingface/``, verl's
``ckpt_contents.json``, ``"model_layout": "verl_v2"``) merge to the same bytes, identify as the
same LoRA base and are refused or replaced alike; verl's manifest (schema 2) names only what the
directory holds. The engines' side (verl's trainers writing the layout, verl's own helpers and
merger reading it, older steps resuming) is tests/verl/test_verl_sft.py."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from mcore_rl.checkpoint import contents_manifest, model_record
from mcore_rl.errors import CheckpointError
from mcore_rl.fileio.model_layout import LAYOUT_KEY, MCORE_RL, VERL_V2, layout_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def to_verl_v2(src: str, dst: str) -> str:
    """A copy of the converter output ``src`` in the verl_v2 layout, with its own RECORD."""
    shutil.copytree(src, dst)
    os.makedirs(os.path.join(dst, "model"))
    for layout_dir in ("dist", "hf"):
        os.rename(os.path.join(dst, getattr(MCORE_RL, layout_dir)), getattr(VERL_V2, layout_dir + "_dir")(dst))
    with open(os.path.join(dst, "mcore_rl.json")) as f:
        meta = json.load(f)
    meta.update({"schema_version": 3, LAYOUT_KEY: VERL_V2.name})
    with open(os.path.join(dst, "mcore_rl.json"), "w") as f:
        json.dump(meta, f)
    contents_manifest.write(VERL_V2, dst, contents_manifest.build(
        VERL_V2, meta["role"], 0, tuple(meta["contents"]), 1, "Qwen2ForCausalLM", False, False, False))
    os.remove(os.path.join(dst, model_record.RECORD))
    model_record.write_record(dst, meta["role"])
    return dst


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(converter output, the same model in verl_v2) of a tiny qwen2 actor."""
    from tests.tiny import tiny_config, tiny_hf_model

    base = tmp_path_factory.mktemp("layouts")
    tiny_hf_model(tiny_config("qwen2", num_hidden_layers=2), role="actor").save_pretrained(base / "hf")
    out = str(base / "old")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "converters", "hf_to_mcore.py"), "--hf_model_path",
                           str(base / "hf"), "--output_path", out], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, to_verl_v2(out, str(base / "v2"))


def test_layout_of_reads_the_recorded_name_and_old_records(dirs, tmp_path):
    old, v2 = dirs
    with open(os.path.join(old, "mcore_rl.json")) as f:
        assert isinstance(json.load(f)["layout"], dict)  # the parallel sizes: not the layout's name
    assert layout_of(old) is MCORE_RL and layout_of(v2) is VERL_V2
    assert layout_of(str(tmp_path)) is MCORE_RL  # no mcore_rl.json: the old layout
    (tmp_path / "mcore_rl.json").write_text(json.dumps({LAYOUT_KEY: "verl_v3"}))
    with pytest.raises(CheckpointError, match=r"model_layout='verl_v3' is not a layout this build reads"):
        layout_of(str(tmp_path))


def test_both_layouts_merge_to_the_same_bytes_and_are_the_same_base(dirs, tmp_path):
    from mcore_rl.checkpoint.model_record import find_record
    from mcore_rl.conversion.merge import merge
    from mcore_rl.fileio.base_identity import differences, model_dir_identity

    old, v2 = dirs
    for name, src in (("old", old), ("v2", v2)):
        merge(src, str(tmp_path / name), dtype="bf16")
    names = sorted(os.listdir(tmp_path / "old"))
    assert names == sorted(os.listdir(tmp_path / "v2")) and "model.safetensors" in names
    for name in names:
        if name != "mcore_rl_export.json":
            assert (tmp_path / "old" / name).read_bytes() == (tmp_path / "v2" / name).read_bytes(), name
    ids = [model_dir_identity(d, find_record(d).source, find_record(d).files) for d in (old, v2)]
    assert ids[1]["files"] and differences(ids[0], ids[1]) == []
    unrecorded = [model_dir_identity(d, None, None) for d in (old, v2)]
    assert unrecorded[1]["files"] and differences(unrecorded[0], unrecorded[1]) == []


def test_a_converter_replaces_either_layout_and_keeps_other_entries(dirs, tmp_path):
    from mcore_rl.fileio.output_dir import _not_model_dir

    old, v2 = dirs
    for d in (old, v2):
        assert _not_model_dir(d, sorted(os.listdir(d))) == ""
    extra = shutil.copytree(v2, str(tmp_path / "extra"))
    os.mkdir(os.path.join(extra, "dist_ckpt"))  # the other layout's entry: not this directory's
    assert "['dist_ckpt']" in _not_model_dir(extra, sorted(os.listdir(extra)))


def test_verl_manifest_names_where_each_content_is(tmp_path):
    role_dir = str(tmp_path / "actor")
    for d in (VERL_V2.dist_dir(role_dir), VERL_V2.hf_dir(role_dir)):
        os.makedirs(d)
    payload = contents_manifest.build(VERL_V2, "actor", 7, ("model", "optimizer", "extra", "hf_model"), 4,
                                      "Qwen2ForCausalLM", True, False, True)
    contents_manifest.write(VERL_V2, role_dir, payload)
    data = contents_manifest.check(VERL_V2, role_dir)
    assert (data["schema_version"], data["framework"], data["role"], data["global_step"]) == (2, "megatron", "actor", 7)
    entries = data["contents"]
    assert {k: (e["path"], e.get("key")) for k, e in entries.items()} == {
        "model": ("model/dist_ckpt", None), "optimizer": ("model/dist_ckpt", "optimizer"),
        "lr_scheduler": ("model/dist_ckpt", "lr_scheduler"), "rng_state": ("model/dist_ckpt", "rng_state"),
        "hf_config": ("model/huggingface", None), "tokenizer": ("model/huggingface", None),
        "hf_model": ("model/huggingface", None)}
    assert sorted(data["directories"]) == ["model/dist_ckpt", "model/huggingface"]
    bare = contents_manifest.build(VERL_V2, "critic", 1, ("model",), 1, None, False, False, False)
    assert sorted(bare["contents"]) == ["hf_config", "model"]
    no_hf = contents_manifest.build(VERL_V2, "critic", 1, ("model", "hf_model"), 1, None, False, False, False, False)
    assert sorted(no_hf["contents"]) == ["model"] and sorted(no_hf["directories"]) == ["model/dist_ckpt"]
    shutil.rmtree(VERL_V2.hf_dir(role_dir))
    with pytest.raises(CheckpointError, match=r"names \['model/huggingface'\], which .* does not hold"):
        contents_manifest.check(VERL_V2, role_dir)


def test_the_main_job_starts_from_either_layout(dirs):
    from mcore_rl.job.start import actor_start, critic_start

    old, v2 = dirs
    for d, layout in ((old, MCORE_RL), (v2, VERL_V2)):
        start = actor_start(None, d, None)
        assert start.hf_files == layout.hf_dir(d) and start.mcore_dir == d and start.args.num_layers == 2
        critic = critic_start(d, start)  # an actor's directory as the critic's start: a fresh value head
        assert critic.hf_files == layout.hf_dir(d) and critic.mcore_dir == d
