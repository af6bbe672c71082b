"""Data safety of the converters (issue #15): an output never replaces or overlaps its input and a
failed run leaves the old output as it was; the dtype is the input's unless asked otherwise and
config.json states it; a reward model (*ForSequenceClassification) converts like load_hf reads it;
``test`` fails on NaN/inf; a damaged or hostile ``.metadata`` (overlapping chunks, file names
leaving the checkpoint) is refused with the key or the entry named, before any outside file is read.
Issue #37: a weight beyond fp16's range under --dtype fp16 is refused (converter and merge), NaN/inf
in the input are copied and named, and --overwrite replaces the converter's own earlier output."""
from __future__ import annotations

import dataclasses
import json
import os
import pickle
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _convert(jobs: list[tuple]) -> dict[str, str]:
    """In one rank world: each (hf_dir, out_dir, ConvertOptions overrides[, label]); label (default
    out_dir) -> dtype written, or the error's text; "<label> warned" -> the NonFiniteWarnings given."""
    from mcore_rl.conversion.convert import ConvertOptions, convert

    out = {}
    for hf, dst, extra, *label in jobs:
        key = label[0] if label else dst
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                out[key] = convert(ConvertOptions(hf, dst, **extra), progress=False).dtype
            except Exception as e:  # noqa: BLE001 - the test checks the message
                out[key] = f"{type(e).__name__}: {e}"
        out[f"{key} warned"] = [str(w.message) for w in seen if type(w.message).__name__ == "NonFiniteWarning"]
    return out


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny fp32 llama converted at TP=2 (two chunks per split key), the same with a NaN and an
    inf in it, and a bf16 llama converted with the default dtype, --dtype fp16 and --dtype fp32."""
    from safetensors.torch import load_file, save_file

    base = tmp_path_factory.mktemp("safety")
    hf, hf_bad, hf_bf16, hf_big = base / "hf", base / "hf_nonfinite", base / "hf_bf16", base / "hf_big"
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(hf)
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).to(torch.bfloat16).save_pretrained(hf_bf16)
    hf_bad.mkdir()
    (hf_bad / "config.json").write_text((hf / "config.json").read_text())
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.mlp.up_proj.weight"][2, 3] = float("nan")
    tensors["model.layers.0.self_attn.o_proj.weight"][0, 0] = float("inf")
    save_file(tensors, hf_bad / "model.safetensors", metadata={"format": "pt"})
    hf_big.mkdir()  # issue #37 item 6: fp32 weights beyond fp16's +-65504 (and one just below its rounding edge)
    (hf_big / "config.json").write_text((hf / "config.json").read_text())
    tensors = load_file(hf / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = -1e5
    tensors["model.layers.1.mlp.down_proj.weight"][4, 6] = 65519.0  # rounds to 65504, not inf
    save_file(tensors, hf_big / "model.safetensors", metadata={"format": "pt"})
    out = {k: str(base / k) for k in ("tp2", "nonfinite", "bf16", "bf16_to_fp16", "bf16_to_fp32", "big",
                                      "big_to_fp16", "again")}
    run_ranks(2, _convert, [(str(hf), out["tp2"], dict(tp=2))])
    written = run_ranks(1, _convert, [(str(hf_bad), out["nonfinite"], {}), (str(hf_bf16), out["bf16"], {}),
                                      (str(hf_bf16), out["bf16_to_fp16"], dict(dtype="fp16")),
                                      (str(hf_bf16), out["bf16_to_fp32"], dict(dtype="fp32")),
                                      (str(hf_big), out["big"], {}),
                                      (str(hf_big), out["big_to_fp16"], dict(dtype="fp16")),
                                      # issue #37 item 13: into its own earlier output
                                      (str(hf), out["again"], {}, "first"),
                                      (str(hf), out["again"], dict(overwrite=True), "overwritten"),
                                      (str(hf), out["again"], {}, "without_overwrite")])[0]
    return {"hf": str(hf), "hf_nonfinite": str(hf_bad), "hf_bf16": str(hf_bf16), "hf_big": str(hf_big),
            "written": written, **out}


def _tensors(directory) -> dict[str, torch.Tensor]:
    from mcore_rl.mapping.hf_io import SafetensorsReader

    reader = SafetensorsReader(str(directory))
    return {k: reader[k] for k in reader}


def _listing(directory) -> list[str]:
    return sorted(os.listdir(directory))


# ---- output safety ---------------------------------------------------------------------------------
def test_failed_merge_keeps_the_old_target_and_leaves_nothing(dirs, tmp_path):
    """--overwrite onto an earlier merge, failing part-way (a shard truncated): the old files stay
    exactly as they were, no new shard is left beside them, no staging directory remains."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.fileio.torch_dist_read import TorchDistReadError

    target, copy = tmp_path / "target", tmp_path / "copy"
    merge(dirs["tp2"], str(target), max_shard_size=40_000)
    before = {name: (target / name).read_bytes() for name in _listing(target)}
    shutil.copytree(dirs["tp2"], copy)
    shard = copy / "dist_ckpt" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 1000)  # the last items of rank 1: read late in the merge
    with pytest.raises(TorchDistReadError, match=r"__1_0.distcp is truncated"):
        merge(str(copy), str(target), max_shard_size=40_000, overwrite=True, verify=False)  # the reader's own check
    assert {name: (target / name).read_bytes() for name in _listing(target)} == before
    assert _listing(tmp_path) == ["copy", "target"]  # no staging or replaced directory left
    merge(dirs["tp2"], str(target), overwrite=True)  # a complete merge replaces the whole directory
    assert _listing(target) == ["config.json", "generation_config.json", "mcore_rl_export.json", "model.safetensors"]


def test_merge_target_overlapping_the_model_dir_is_refused(dirs, tmp_path):
    from mcore_rl.conversion.merge import MergeError, merge

    copy = tmp_path / "model"
    shutil.copytree(dirs["tp2"], copy)
    before = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    for target in (copy, copy / "hf_out", tmp_path):
        with pytest.raises(MergeError, match=r"overlaps the model directory .* write the HF model outside it"):
            merge(str(copy), str(target), overwrite=True)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == before


def _blind_rank(hf: str, outs: list[str]) -> str:
    """Rank r converts into outs[r]: a different parent per rank, as a node-local disk would be."""
    from mcore_rl.conversion.convert import ConvertOptions, convert

    try:
        convert(ConvertOptions(hf, outs[torch.distributed.get_rank()], tp=2), progress=False)
    except Exception as e:  # noqa: BLE001 - the test checks type and message
        return f"{type(e).__name__}: {e}"
    return "no error"


def test_output_every_rank_cannot_see_is_refused_on_every_rank(dirs, tmp_path):
    outs = [str(tmp_path / "node0" / "out"), str(tmp_path / "node1" / "out")]
    for got in run_ranks(2, _blind_rank, dirs["hf"], outs):
        assert got.startswith("ConvertError: ") and "ranks [1] do not see the directory .out.staging-" in got \
            and "must be on a filesystem all ranks share" in got, got
    assert _listing(tmp_path) == []  # rank 0's staging directory and the parent it made are gone


# ---- dtype -------------------------------------------------------------------------------------------
def test_dtype_is_the_inputs_unless_asked_and_config_states_it(dirs, tmp_path):
    """bf16 HF -> convert (default) -> bf16 in dist_ckpt -> merge -> bf16 safetensors and a config
    saying bfloat16 (dtype and torch_dtype); --dtype fp16 / fp32 at conversion or at the merge."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.fileio.torch_dist_read import TorchDistReader

    source = _tensors(dirs["hf_bf16"])
    assert {t.dtype for t in source.values()} == {torch.bfloat16}
    cases = {"bf16": (torch.bfloat16, None), "bf16_to_fp16": (torch.float16, None),
             "bf16_to_fp32": (torch.float32, None), "bf16_merged_as_fp32": (torch.float32, "fp32")}
    for name, (dtype, merge_dtype) in cases.items():
        model_dir = dirs[name] if name in dirs else dirs["bf16"]
        stored = {info.dtype for info in TorchDistReader(os.path.join(model_dir, "dist_ckpt")).tensors.values()}
        assert stored == ({dtype} if merge_dtype is None else {torch.bfloat16}), (name, stored)
        summary = merge(model_dir, str(tmp_path / name), dtype=merge_dtype)
        config = json.loads((tmp_path / name / "config.json").read_text())
        hf_name = str(dtype).removeprefix("torch.")
        assert config["dtype"] == config["torch_dtype"] == summary.dtype == hf_name, (name, config)
        merged = _tensors(tmp_path / name)
        for key, value in source.items():
            assert merged[key].dtype == dtype and torch.equal(merged[key], value.to(dtype)), (name, key)
    assert [dirs["written"][dirs[n]] for n in ("bf16", "bf16_to_fp16", "bf16_to_fp32")] == ["bf16", "fp16", "fp32"]


# ---- reward model ------------------------------------------------------------------------------------
def _reward_model(hf: str, out: str, bad: str, bad_out: str) -> dict:
    """Converts the reward model; the in-memory critic load_hf builds from it, and its export;
    the --test logit check of the conversion; the error for two labels."""
    from converters.verify_logits import compare
    from mcore_rl.models.hf_config import model_args_from_hf
    from mcore_rl.models.hf_weights import export_hf
    from mcore_rl.parallel import ParallelLayout, destroy_parallel_state, initialize_parallel_state
    from mcore_rl.platform import active_platform
    from mcore_rl.rl.engine import ModelEngine

    converted = _convert([(hf, out, {}), (bad, bad_out, {})])
    if not os.path.isdir(out):
        return {"converted": converted}
    destroy_parallel_state()
    initialize_parallel_state(ParallelLayout())
    args = model_args_from_hf(hf)
    engine = ModelEngine(args, ParallelLayout(), "critic", active_platform(), hf_weights=hf)
    export = {k: v.clone() for k, v in export_hf(engine.model, args, "critic").items()}
    destroy_parallel_state()
    diff, cos, tol = compare(out, hf)
    return {"converted": converted, "export": export, "verify": (diff, cos, tol)}


def test_reward_model_converts_to_the_in_memory_critic(tmp_path):
    """A *ForSequenceClassification (score without bias) converts as a critic whose bias is 0, as
    load_hf does; merged back as a token classifier, every tensor equals the in-memory critic's
    export (merged as given: the same class, the zero bias left out); --test passes;
    num_labels=2 is refused by the same check as load_hf's."""
    from transformers import AutoModelForSequenceClassification

    from mcore_rl.conversion.merge import merge

    for name, labels in (("rm", 1), ("rm2", 2)):
        config = tiny_config("qwen2", num_hidden_layers=2, num_labels=labels)
        config.pad_token_id = 0
        torch.manual_seed(3)
        model = AutoModelForSequenceClassification.from_config(config, attn_implementation="eager")
        assert model.score.bias is None
        model.save_pretrained(tmp_path / name)
    out, bad_out = str(tmp_path / "out"), str(tmp_path / "out2")
    got = run_ranks(1, _reward_model, str(tmp_path / "rm"), out, str(tmp_path / "rm2"), bad_out)[0]
    assert got["converted"][out] == "fp32", got["converted"]
    assert got["converted"][bad_out].startswith("ConfigError: score.weight has 2 outputs (num_labels=2); a "
                                                "critic's value head has one"), got["converted"]
    assert not os.path.exists(bad_out)
    diff, cos, tol = got["verify"]
    assert diff <= tol and cos > 0.9999, got["verify"]
    merge(out, str(tmp_path / "merged"), model_class="token_classification")
    merged = _tensors(tmp_path / "merged")
    assert set(merged) == set(got["export"]) and torch.equal(merged["score.bias"], torch.zeros(1))
    assert all(torch.equal(merged[k], got["export"][k]) for k in merged)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"] and config["num_labels"] == 1
    merge(out, str(tmp_path / "as_given"))  # auto: the class it came as, without the zero bias (issue #29)
    assert set(_tensors(tmp_path / "as_given")) == set(got["export"]) - {"score.bias"}
    assert json.loads((tmp_path / "as_given" / "config.json").read_text())["architectures"] == \
        ["Qwen2ForSequenceClassification"]


# ---- non-finite values -------------------------------------------------------------------------------
def test_nan_and_inf_always_fail_the_comparison(dirs, tmp_path):
    """A NaN or inf in the checkpoint or in the reference is a mismatch (max(0.0, nan) is 0.0),
    also when both sides hold the same non-finite values."""
    from safetensors.torch import save_file

    from mcore_rl.conversion.merge import compare

    cli = subprocess.Popen([sys.executable, os.path.join(ROOT, "converters", "mcore_to_hf.py"), "test",
                            "--local_dir", dirs["nonfinite"], "--test_hf_dir", dirs["hf_nonfinite"]],
                           env={**os.environ, "PYTHONPATH": ROOT}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    diffs, problems = compare(dirs["nonfinite"], dirs["hf_nonfinite"])  # the same NaN and inf on both sides
    bad = sorted(p.split(":")[0] for p in problems)
    assert bad == ["model.layers.0.self_attn.o_proj.weight", "model.layers.1.mlp.up_proj.weight"], problems
    assert all("non-finite values (NaN or inf) in the merged and reference" in p for p in problems)
    assert diffs["model.layers.*.mlp.up_proj.weight"] == float("inf")
    assert compare(dirs["nonfinite"], dirs["hf"])[1] != []  # checkpoint side only
    ref = _tensors(dirs["hf"])
    ref["model.norm.weight"] = ref["model.norm.weight"].clone()
    ref["model.norm.weight"][5] = float("nan")
    (tmp_path / "ref").mkdir()
    save_file(ref, str(tmp_path / "ref" / "model.safetensors"))
    diffs, problems = compare(dirs["tp2"], str(tmp_path / "ref"))  # reference side only
    assert problems == ["model.norm.weight: non-finite values (NaN or inf) in the reference"], problems
    code, (out, err) = cli.wait(timeout=300), cli.communicate()
    assert code == 1 and "MISMATCH max|diff| inf  model.layers.*.mlp.up_proj.weight" in out and \
        "FAILED: 2 tensor classes above atol=0.0" in out, out + err


def test_nonfinite_input_is_written_as_it_is_and_named(dirs, tmp_path):
    """NaN/inf already in the input are copied as they are (a diverged run can still be converted,
    merged and compared) and named in a NonFiniteWarning by the converter and the merge."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.mapping.casts import NonFiniteWarning

    said = dirs["written"][f"{dirs['nonfinite']} warned"]
    assert len(said) == 1 and "2 tensor(s) hold NaN/inf values, copied as they are: ['model.layers.0.self_attn." \
        "o_proj.weight', 'model.layers.1.mlp.up_proj.weight'] (model.layers.0.self_attn.o_proj.weight: 1 value(s), " \
        "the first inf at [0, 0])" in said[0], said
    assert dirs["written"][f"{dirs['bf16']} warned"] == []
    with pytest.warns(NonFiniteWarning, match=r"2 tensor\(s\) hold NaN/inf values, copied as they are: .*up_proj.*"
                                              r"\(model.layers.0.self_attn.o_proj.weight: 1 value\(s\), the first inf"):
        merge(dirs["nonfinite"], str(tmp_path / "merged"))
    assert torch.isnan(_tensors(tmp_path / "merged")["model.layers.1.mlp.up_proj.weight"][2, 3])


# ---- issue #37: values a narrower dtype cannot hold; converting into its own earlier output ---------------
def test_fp16_overflow_is_refused_by_the_converter_and_the_merge(dirs, tmp_path):
    """--dtype fp16 of a weight beyond +-65504 (converter and merge) is refused naming the tensor,
    the value and the fix, nothing written; 65519 rounds to 65504 and passes; bf16 holds -1e5."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.mapping.casts import CastOverflowError

    said = dirs["written"][dirs["big_to_fp16"]]
    assert said.startswith("CastOverflowError: HF tensor 'model.layers.1.mlp.down_proj.weight': 1 value(s) beyond "
                           "float16's range +-65504, the first -100000 at [3, 5], would be written as inf; pass "
                           "--dtype bf16 or --dtype fp32"), said
    assert not os.path.exists(dirs["big_to_fp16"]) and dirs["written"][dirs["big"]] == "fp32"
    with pytest.raises(CastOverflowError, match=r"^model.layers.1.mlp.down_proj.weight: 1 value\(s\) beyond "
                                                r"float16's range \+-65504, the first -100000 at \[3, 5\]"):
        merge(dirs["big"], str(tmp_path / "fp16"), dtype="fp16")
    assert not os.path.exists(tmp_path / "fp16")
    merge(dirs["big"], str(tmp_path / "bf16"), dtype="bf16")
    down = _tensors(tmp_path / "bf16")["model.layers.1.mlp.down_proj.weight"]
    assert down[3, 5].item() == torch.tensor(-1e5).bfloat16().item() and down[4, 6].item() == 65536.0


def test_cast_checked_refuses_only_what_the_cast_made_inf():
    from mcore_rl.mapping.casts import CastOverflowError, cast_checked

    t = torch.tensor([[1.0, 65519.0], [float("nan"), -float("inf")]])
    out = cast_checked(t, torch.float16, "x", "fix it")
    assert out.dtype == torch.float16 and out[0, 1] == 65504 and torch.isnan(out[1, 0]) and out[1, 1] == -float("inf")
    assert cast_checked(t, torch.float32, "x", "fix it") is t
    with pytest.raises(CastOverflowError, match=r"^x: 1 value\(s\) beyond float16's range \+-65504, the first 65520 at "
                                                r"\[0, 1\], would be written as inf; fix it\.$"):
        cast_checked(t + torch.tensor([[0.0, 1.0], [0.0, 0.0]]), torch.float16, "x", "fix it")
    with pytest.raises(CastOverflowError, match=r"beyond bfloat16's range"):
        cast_checked(torch.tensor([3.4e38]), torch.bfloat16, "x", "pass --dtype fp32")
    assert cast_checked(torch.tensor([float("inf")], dtype=torch.float16), torch.bfloat16, "x", "").isinf().all()


def test_converting_into_its_own_earlier_output_with_overwrite(dirs):
    """hf_to_mcore --overwrite replaces its own earlier output (its RECORD is no stranger); the
    result is complete (every file matches its RECORD, every tensor the input's); without
    --overwrite the same output is refused."""
    from mcore_rl.conversion.merge import compare

    written = dirs["written"]
    assert (written["first"], written["overwritten"]) == ("fp32", "fp32"), written
    assert written["without_overwrite"].startswith(f"ConvertError: --output_path {dirs['again']!r} is not empty; pass "
                                                   "--overwrite"), written["without_overwrite"]
    assert sorted(os.listdir(dirs["again"])) == ["RECORD", "dist_ckpt", "huggingface", "mcore_rl.json"]
    diffs, problems = compare(dirs["again"], dirs["hf"])  # verifies every file against RECORD first
    assert problems == [] and diffs and set(diffs.values()) == {0.0}, (diffs, problems)


# ---- a damaged or hostile .metadata ------------------------------------------------------------------
def _rewrite_metadata(model_dir, edit) -> None:
    """Loads ``dist_ckpt/.metadata`` (a plain pickle of torch DCP dataclasses: this test wrote
    it), applies ``edit(metadata)`` and writes it back."""
    path = os.path.join(model_dir, "dist_ckpt", ".metadata")
    with open(path, "rb") as f:
        meta = pickle.load(f)  # noqa: S301 - our own test checkpoint
    edit(meta)
    with open(path, "wb") as f:
        pickle.dump(meta, f)


def _move_chunk(meta, key: str, old: tuple, new: tuple) -> None:
    """Moves one chunk of ``key`` to ``new`` offsets (storage entry re-keyed to match)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    md = meta.state_dict_metadata[key]
    md.chunks = [ChunkStorageMetadata(torch.Size(new), c.sizes) if tuple(c.offsets) == old else c
                 for c in md.chunks]
    meta.storage_data = {(MetadataIndex(idx.fqn, torch.Size(new), idx.index)
                          if idx.fqn == key and tuple(idx.offset or ()) == old else idx): info
                         for idx, info in meta.storage_data.items()}


def _relocate(meta, name: str, new: str) -> None:
    """Every storage entry in the file ``name`` now names ``new``."""
    meta.storage_data = {idx: dataclasses.replace(info, relative_path=new) if info.relative_path == name else info
                         for idx, info in meta.storage_data.items()}


def test_overlapping_chunks_are_refused_naming_the_key(dirs, tmp_path):
    """TP=2 splits linear_proj's input dim in two chunks; moving the second one element left makes
    an overlap and a gap with the same element count (the old fill count passed it, leaving
    uninitialised memory in the merged tensor)."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.fileio.torch_dist_read import TorchDistReadError

    key = "decoder.layers.self_attention.linear_proj.weight"
    copy = tmp_path / "copy"
    shutil.copytree(dirs["tp2"], copy)
    _rewrite_metadata(copy, lambda m: _move_chunk(m, key, (0, 0, 32), (0, 0, 31)))
    with pytest.raises(TorchDistReadError, match=rf"'{key}' at index \(0,\): chunks at \(0, 0\) and \(0, 31\) overlap; "
                                                 r"the checkpoint is incomplete .* or its .metadata is damaged"):
        merge(str(copy), str(tmp_path / "out"), verify=False)  # the reader's own check, not the record's
    assert not os.path.exists(tmp_path / "out")


def _escapes(tp2: str, tmp_path) -> dict[str, tuple[str, str]]:
    """Copies of the checkpoint whose rank-1 shard is only reachable outside dist_ckpt/ (a valid
    file, so only the containment check can stop the merge): name -> (model dir, error text)."""
    out = {}
    for name in ("dotdot", "absolute", "symlink"):
        copy = tmp_path / name
        shutil.copytree(tp2, copy)
        shard = copy / "dist_ckpt" / "__1_0.distcp"
        outside = tmp_path / f"outside_{name}.distcp"
        shutil.move(shard, outside)
        if name == "dotdot":
            shutil.copyfile(outside, copy / "x.distcp")
            _rewrite_metadata(copy, lambda m: _relocate(m, "__1_0.distcp", "../x.distcp"))
            out[name] = (str(copy), "names the file '../x.distcp', which leaves")
        elif name == "absolute":
            _rewrite_metadata(copy, lambda m, p=str(outside): _relocate(m, "__1_0.distcp", p))
            out[name] = (str(copy), f"names the file '{outside}', which leaves")
        else:
            shard.symlink_to(outside)
            out[name] = (str(copy), f"names the file '__1_0.distcp', which resolves to {outside} outside")
    return out


def test_file_names_leaving_the_checkpoint_are_refused(dirs, tmp_path):
    """relative_path '../x.distcp', an absolute path, a shard symlinked outside: each is refused
    naming the entry (library and CLI: one error line, exit code 2), nothing is merged."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.fileio.paths import UnsafePathError

    cases = _escapes(dirs["tp2"], tmp_path)
    env = {**os.environ, "PYTHONPATH": ROOT}
    script = os.path.join(ROOT, "converters", "mcore_to_hf.py")
    cli = subprocess.Popen([sys.executable, script, "merge", "--local_dir", cases["dotdot"][0], "--target_dir",
                            str(tmp_path / "cli_out"), "--skip_verify"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True)
    for name, (model_dir, text) in cases.items():
        with pytest.raises(UnsafePathError) as e:
            merge(model_dir, str(tmp_path / f"out_{name}"), verify=False)  # the reader's containment check
        assert text in str(e.value), (name, str(e.value))
        assert not os.path.exists(tmp_path / f"out_{name}")
    code, (_, err) = cli.wait(timeout=300), cli.communicate()
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: ") and cases["dotdot"][1] in err, err
    assert not os.path.exists(tmp_path / "cli_out")


def test_merge_overwrite_keeps_what_it_did_not_write(dirs, tmp_path):
    """Issue #29 defect 6: a model directory whose dist_ckpt is a link into the target (resolved,
    the target overlaps the input), and a target holding a sibling model (not an earlier
    export): merge --overwrite refuses both and changes nothing; an earlier export is replaced."""
    from mcore_rl.conversion.merge import MergeError, merge

    target, model, models = tmp_path / "target", tmp_path / "model", tmp_path / "models"
    merge(dirs["tp2"], str(target))
    shutil.copytree(os.path.join(dirs["tp2"], "dist_ckpt"), target / "dist_ckpt")
    model.mkdir()
    shutil.copytree(os.path.join(dirs["tp2"], "huggingface"), model / "huggingface")
    shutil.copy(os.path.join(dirs["tp2"], "mcore_rl.json"), model)
    (model / "dist_ckpt").symlink_to(target / "dist_ckpt")
    merge(dirs["tp2"], str(models / "other"))
    before = {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()}
    with pytest.raises(MergeError, match=rf"target_dir {target} overlaps the model directory {model} \(its entry "
                                         rf"{model}/dist_ckpt resolves to {target}/dist_ckpt\)"):
        merge(str(model), str(target), overwrite=True, verify=False)  # (verified, its link out is refused too)
    with pytest.raises(MergeError, match=rf"target_dir {models} was not written by this command: it holds "
                                         r"\['other'\] and no mcore_rl_export.json record"):
        merge(dirs["tp2"], str(models), overwrite=True)
    assert {p: p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file()} == before
    merge(str(model), str(models / "other"), overwrite=True, verify=False)  # an earlier export: replaced
    merged, reference = _tensors(models / "other"), _tensors(target)
    assert merged.keys() == reference.keys() and all(torch.equal(merged[k], reference[k]) for k in merged)


def test_merge_killed_between_the_renames_is_finished_by_the_next_run(dirs, tmp_path):
    """Issue #29 defect 5 through the CLI: merge --overwrite killed after the old export was moved
    aside (no target, two hidden copies); the next run of the same command puts the complete
    copy in place first, then replaces it: the target is the full model, nothing hidden is left."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.fileio.faults import ENV

    target, reference = tmp_path / "target", tmp_path / "reference"
    merge(dirs["tp2"], str(reference))
    merge(dirs["tp2"], str(target), max_shard_size=40_000)  # the old export: several shards
    argv = [sys.executable, "converters/mcore_to_hf.py", "merge", "--local_dir", dirs["tp2"], "--target_dir",
            str(target), "--overwrite"]
    killed = subprocess.run(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, ENV: "stage_aside"},
                            capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert sorted(n.split("-")[0] for n in _listing(tmp_path)) == [".target.replaced", ".target.staging",
                                                                    "reference"]
    merge(dirs["tp2"], str(target), overwrite=True)  # the next run (the CLI's library call)
    assert _listing(tmp_path) == ["reference", "target"]
    merged, want = _tensors(target), _tensors(reference)
    assert merged.keys() == want.keys() and all(torch.equal(merged[k], want[k]) for k in merged)


def test_merge_without_overwrite_keeps_an_export_that_appeared_meanwhile(dirs, tmp_path, monkeypatch):
    """Issue #37 item 7: two runs writing one target. The other run's export appears after this
    merge checked the target (at its commit): without --overwrite the commit refuses, naming the
    target; the other export stays byte-identical and this run's staging directory is removed."""
    from mcore_rl.conversion.merge import merge
    from mcore_rl.fileio import staging

    target, other = tmp_path / "target", tmp_path / "other"
    merge(dirs["tp2"], str(other), max_shard_size=40_000)  # the other run's export (several shards)
    before = {str(p.relative_to(other)): p.read_bytes() for p in sorted(other.rglob("*")) if p.is_file()}
    real = staging.fault_point

    def other_run_lands(phase: str) -> None:
        if phase == "stage_commit" and not target.exists():
            shutil.copytree(other, target)
        real(phase)

    monkeypatch.setattr(staging, "fault_point", other_run_lands)
    with pytest.raises(staging.StagingError, match=rf"{target} appeared while this output was written .* not "
                                                   r"replaced without --overwrite: it is left as it is"):
        merge(dirs["tp2"], str(target))
    assert {str(p.relative_to(target)): p.read_bytes() for p in sorted(target.rglob("*")) if p.is_file()} == before
    assert _listing(tmp_path) == ["other", "target"]  # no staging directory left


def _convert_while_another_lands(hf: str, out: str, other: str) -> str:
    """In a rank world: hf_to_mcore into ``out`` without --overwrite while another run's output
    (a copy of ``other``) lands at ``out`` just before the commit: the error on this rank."""
    from mcore_rl.fileio import staging

    real = staging.fault_point

    def other_run_lands(phase: str) -> None:
        if phase == "stage_commit" and not os.path.exists(out):
            shutil.copytree(other, out)
        real(phase)

    staging.fault_point = other_run_lands
    try:
        return _convert([(hf, out, dict(tp=2))])[out]
    finally:
        staging.fault_point = real


def test_convert_without_overwrite_keeps_an_output_that_appeared_meanwhile(dirs, tmp_path):
    """Issue #37 item 7 for hf_to_mcore: the commit refuses on rank 0 and every rank raises it (none
    waits in the barrier); the other run's output stays byte-identical, no staging is left."""
    out = tmp_path / "out"
    before = {str(p.relative_to(dirs["tp2"])): p.read_bytes() for p in sorted(Path(dirs["tp2"]).rglob("*"))
              if p.is_file()}
    said = run_ranks(2, _convert_while_another_lands, dirs["hf"], str(out), dirs["tp2"])
    for text in said:
        assert text.startswith(f"StagingError: {out} appeared while this output was written"), text
    assert {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    assert _listing(tmp_path) == ["out"]
