"""The background HF export's core (checkpoint/hf_export*.py, conversion/hf_export_step.py and the
worker): a step whose config.json the save wrote with ``write_export_config`` exports into its HF
dir the bytes ``mcore_to_hf.py merge`` writes (fp32 with shards + index, bf16, FP8 from an
FP8-sourced model, a critic started from a causal-LM config; MXFP4's config); its record makes it
complete, a short, missing or (verified) damaged file makes it partial; a partial export left in
the HF dir changes nothing a merge writes; the worker killed at each phase leaves a partial
export transformers never half-loads, which ``clean_partial`` and a rerun make complete; the
worker runs niced and at idle IO priority and refuses bad input in one line.

Steps here are converter outputs placed as ``global_step_N/<role>`` with a ``COMPLETE`` marker
recording their files (what a CheckpointManager step is to every reader): no engine is built.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.dist import run_ranks
from tests.tiny import tiny_config, tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FP8_QUANT = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[32, 48])


def _convert(jobs: list[tuple[str, str, str | None]]) -> None:
    from mcore_rl.conversion.convert import ConvertOptions, convert

    for hf, dst, dtype in jobs:
        convert(ConvertOptions(hf, dst, dtype=dtype), progress=False)


@pytest.fixture(scope="module")
def conv(tmp_path_factory):
    """name -> converter output: a tiny llama in fp32, a tiny llama critic, an FP8-sourced llama
    (block FP8, other tensors bf16: converted with the FP8 record), a tiny gpt-oss (bf16, no record)."""
    from tests.test_fp8_import import write_fp8

    base = str(tmp_path_factory.mktemp("hf_export"))
    hf = {n: os.path.join(base, f"hf_{n}") for n in ("llama", "critic", "src_fp8", "gpt_oss")}
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2)).save_pretrained(hf["llama"])
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2), "critic").save_pretrained(hf["critic"])
    tiny_hf_model(tiny_config("llama", num_hidden_layers=2), seed=3).save_pretrained(hf["src_fp8"])
    hf["fp8"] = os.path.join(base, "hf_fp8")
    write_fp8(hf["src_fp8"], hf["fp8"], os.path.join(base, "ref_fp8"), "llama", FP8_QUANT, "block", torch.float32)
    # hidden 48, expert ffn 40: no whole MXFP4 blocks, so merge --dtype mxfp4 writes the experts bf16 and lists them
    tiny_hf_model(tiny_config("gpt_oss", num_hidden_layers=2, hidden_size=48, intermediate_size=40)).to(
        torch.bfloat16).save_pretrained(hf["gpt_oss"])
    out = {n: os.path.join(base, f"conv_{n}") for n in ("llama", "critic", "fp8", "gpt_oss")}
    run_ranks(1, _convert, [(hf[n], out[n], "fp32" if n in ("llama", "critic") else None) for n in out],
              daemon=False)
    out["causal_config"] = hf["llama"]
    return out


def make_step(conv_dir: str, root: str, role: str = "actor", spec=None, config_from: str | None = None,
              step: int = 1, verl_v2: bool = False) -> str:
    """``conv_dir`` as ``root/global_step_<step>/<role>`` (``config_from``: its huggingface/config.json
    taken from there; ``verl_v2``: in verl's layout, ``model/dist_ckpt`` + ``model/huggingface``),
    config.json rewritten by ``write_export_config(spec)`` when given, then a COMPLETE marker
    recording every file: the order a save writes them in."""
    from mcore_rl.checkpoint.hf_export import write_export_config
    from mcore_rl.checkpoint.inventory import Marker
    from mcore_rl.checkpoint.step_dirs import write_marker
    from mcore_rl.fileio.checksum import file_checksum

    step_dir = os.path.join(root, f"global_step_{step}")
    role_dir = os.path.join(step_dir, role)
    shutil.copytree(conv_dir, role_dir)
    os.remove(os.path.join(role_dir, "RECORD"))
    if verl_v2:
        from mcore_rl.fileio.model_layout import LAYOUT_KEY

        os.makedirs(os.path.join(role_dir, "model"))
        for name in ("dist_ckpt", "huggingface"):
            os.rename(os.path.join(role_dir, name), os.path.join(role_dir, "model", name))
        meta_path = os.path.join(role_dir, "mcore_rl.json")
        meta = json.load(open(meta_path))
        json.dump({**meta, LAYOUT_KEY: "verl_v2"}, open(meta_path, "w"))
    if config_from is not None:
        shutil.copyfile(os.path.join(config_from, "config.json"), os.path.join(role_dir, "huggingface", "config.json"))
    if spec is not None:
        params = json.load(open(os.path.join(role_dir, "mcore_rl.json")))["params_dtype"]
        write_export_config(role_dir, role, spec, getattr(torch, params.removeprefix("torch.")))
    files = {}
    for top, _, names in os.walk(role_dir):
        for name in names:
            path = os.path.join(top, name)
            files[os.path.relpath(path, step_dir)] = file_checksum(path)
    write_marker(os.path.join(step_dir, "COMPLETE"), Marker(step, (role,), 1, files))
    return role_dir


def _merge(role_dir: str, target: str, spec) -> str:
    from mcore_rl.conversion.merge import merge

    merge(role_dir, target, max_shard_size=spec.max_shard_size, dtype=spec.dtype, fp8=spec.fp8)
    return target


def _files(directory: str) -> dict[str, bytes]:
    from mcore_rl.fileio.output_dir import EXPORT_RECORD

    return {n: open(os.path.join(directory, n), "rb").read() for n in sorted(os.listdir(directory))
            if n != EXPORT_RECORD}


def _spec(**kw):
    from mcore_rl.checkpoint.hf_export import ExportSpec

    return ExportSpec(**kw)


CASES = {  # name -> (converter output, role, spec kwargs, config.json taken from)
    "fp32_shards": ("llama", "actor", dict(max_shard_size="40KB"), None),
    "verl_v2_layout": ("llama", "actor", dict(max_shard_size="80KB"), None),
    "bf16": ("llama", "actor", dict(dtype="bf16"), None),
    "fp8_sourced": ("fp8", "actor", dict(dtype="fp8"), None),
    "critic_from_causal_config": ("critic", "critic", {}, "causal_config"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_export_equals_merge_byte_for_byte(conv, tmp_path, name):
    from mcore_rl.conversion.hf_export_step import export_step
    from mcore_rl.checkpoint.hf_export_record import export_state, hf_dir_of, staging_dir
    from mcore_rl.fileio.output_dir import EXPORT_RECORD

    source, role, kw, config_from = CASES[name]
    spec = _spec(**kw)
    config_from = conv[config_from] if config_from else None
    v2 = name == "verl_v2_layout"
    plain = make_step(conv[source], str(tmp_path / "plain"), role, None, config_from, verl_v2=v2)  # the run's config
    ref = _merge(plain, str(tmp_path / "ref"), spec)
    role_dir = make_step(conv[source], str(tmp_path / "run"), role, spec, config_from, verl_v2=v2)
    hf = hf_dir_of(role_dir)
    assert hf == os.path.join(role_dir, "model", "huggingface") if v2 else os.path.join(role_dir, "huggingface")
    assert open(os.path.join(hf, "config.json"), "rb").read() == open(os.path.join(ref, "config.json"), "rb").read()
    assert export_state(role_dir) == "absent"
    result = export_step(role_dir, spec, 1)
    assert _files(hf) == _files(ref) and EXPORT_RECORD in os.listdir(hf)
    assert export_state(role_dir) == export_state(role_dir, verify=True) == "complete"
    assert not os.path.exists(staging_dir(role_dir))
    weights = sorted(n for n in os.listdir(ref) if n.startswith("model"))
    assert sorted(result.files) == weights and result.bytes == sum(len(_files(ref)[n]) for n in weights)
    assert result.step_bytes > 0 and result.peak_rss_mb > 0
    if name == "fp32_shards":
        assert len(weights) > 3 and result.files[-1] == "model.safetensors.index.json"
    record = json.load(open(os.path.join(hf, EXPORT_RECORD)))
    assert (record["step"], record["role"], record["writer"], record["dtype"]) == (1, role, "background export",
                                                                                   kw.get("dtype"))
    assert sorted(record["files"]) == sorted(_files(hf))
    assert export_step(role_dir, spec, 1).skipped  # complete: nothing written again
    merged = str(tmp_path / "merged")  # the step with its export beside its files merges as before
    assert _files(_merge(role_dir, merged, spec)) == _files(ref)


def test_write_export_config_equals_merge_and_is_idempotent(conv, tmp_path):
    """MXFP4's quantization_config (gpt-oss, no record: the rule picks), FP8 at a block size, fp16,
    each as merge writes it for the step; a second call changes no byte; a wrong role and an
    adapter-only step under a quantized dtype are refused naming the fix."""
    from mcore_rl.checkpoint.hf_export import ExportError, write_export_config
    from mcore_rl.checkpoint.hf_export_record import hf_dir_of
    from mcore_rl.mapping.fp8_quant import BlockFp8

    for i, (source, kw) in enumerate([("gpt_oss", dict(dtype="mxfp4")), ("llama", dict(dtype="fp8", fp8=BlockFp8(
            (64, 32), "ue8m0"))), ("llama", dict(dtype="fp16"))]):
        spec = _spec(**kw)
        ref = _merge(make_step(conv[source], str(tmp_path / f"plain{i}")), str(tmp_path / f"ref{i}"), spec)
        role_dir = make_step(conv[source], str(tmp_path / f"run{i}"), spec=spec)
        config = os.path.join(hf_dir_of(role_dir), "config.json")
        assert open(config, "rb").read() == open(os.path.join(ref, "config.json"), "rb").read(), kw
        params = torch.float32 if source == "llama" else torch.bfloat16
        write_export_config(role_dir, "actor", spec, params)
        assert open(config, "rb").read() == open(os.path.join(ref, "config.json"), "rb").read(), kw
        if source == "gpt_oss":  # the experts modules merge writes unquantized, from the shapes alone
            assert json.load(open(config))["quantization_config"]["modules_to_not_convert"][-2:] == [
                "model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert json.load(open(config))["dtype"] == "float16"
    with pytest.raises(ExportError, match="says role 'actor', not 'critic'"):
        write_export_config(role_dir, "critic", spec, torch.float32)
    meta_path = os.path.join(role_dir, "mcore_rl.json")
    meta = json.load(open(meta_path))
    json.dump({**meta, "lora": {"adapter_only": True}}, open(meta_path, "w"))
    with pytest.raises(ExportError, match="holds LoRA adapters: their export .* not quantized, but checkpoint.hf_dtype "
                       "is 'fp8'; set checkpoint.hf_dtype to fp32"):
        write_export_config(role_dir, "actor", _spec(dtype="fp8"), torch.float32)


def test_step_saved_without_the_export_config_is_refused_unchanged(conv, tmp_path):
    """A step whose config.json is the run's (not written by write_export_config for this dtype):
    the staged config differs, the export stops naming it, nothing is moved or left."""
    from mcore_rl.checkpoint.hf_export import ExportError
    from mcore_rl.conversion.hf_export_step import export_step
    from mcore_rl.checkpoint.hf_export_record import export_state, hf_dir_of

    for i, (saved, asked) in enumerate([(None, _spec()), (_spec(), _spec(dtype="bf16"))]):
        role_dir = make_step(conv["critic" if i == 0 else "llama"], str(tmp_path / f"run{i}"), "critic" if i == 0
                             else "actor", saved, conv["causal_config"] if i == 0 else None)
        before = _files(hf_dir_of(role_dir))
        with pytest.raises(ExportError, match=r"the merge of the step writes \['config.json'\] differently from the "
                                              r"step's files: the step's config.json was not written for this export"):
            export_step(role_dir, asked, 1)
        assert _files(hf_dir_of(role_dir)) == before and export_state(role_dir) == "absent"
        assert sorted(os.listdir(os.path.dirname(role_dir))) == ["COMPLETE", os.path.basename(role_dir)]


def test_step_replaced_while_exported_gets_no_weights(conv, tmp_path, monkeypatch):
    """A save replacing the step while it is merged (its marker rewritten): nothing is moved, the
    staging dir is removed, the export is absent."""
    import mcore_rl.conversion.hf_export_step as step_mod
    from mcore_rl.checkpoint.hf_export import ExportError
    from mcore_rl.checkpoint.hf_export_record import export_state, hf_dir_of, staging_dir
    from mcore_rl.checkpoint.inventory import Marker, read_marker
    from mcore_rl.checkpoint.step_dirs import write_marker

    spec = _spec()
    role_dir = make_step(conv["llama"], str(tmp_path / "run"), spec=spec)
    marker_path = os.path.join(os.path.dirname(role_dir), "COMPLETE")
    old = read_marker(marker_path)

    def replaced(phase: str) -> None:  # at the merge's hold point: another save's marker
        if phase == "hf_export_merge":
            write_marker(marker_path, Marker(old.step, old.roles, 2, old.files))

    monkeypatch.setattr(step_mod, "hold_point", replaced)
    with pytest.raises(ExportError, match="changed while it was exported .* nothing was moved: export the step again"):
        step_mod.export_step(role_dir, spec, 1)
    assert export_state(role_dir) == "absent" and not os.path.exists(staging_dir(role_dir))
    assert sorted(os.listdir(hf_dir_of(role_dir))) == ["config.json", "generation_config.json"]


def _plant_partial(role_dir: str, ref: str) -> list[str]:
    """What an export killed in its move phase leaves: a shard of the merge and a stale record."""
    from mcore_rl.checkpoint.hf_export_record import hf_dir_of
    from mcore_rl.fileio.output_dir import EXPORT_RECORD

    hf = hf_dir_of(role_dir)
    shard = sorted(n for n in os.listdir(ref) if n.startswith("model-"))[0]
    shutil.copyfile(os.path.join(ref, shard), os.path.join(hf, shard))
    with open(os.path.join(hf, EXPORT_RECORD), "w") as f:
        json.dump({"written_by": "mcore_rl", "writer": "background export", "step": 1, "files": {}}, f)
    return [shard, EXPORT_RECORD]


def test_partial_export_in_the_hf_dir_changes_nothing_merge_writes(conv, tmp_path):
    from mcore_rl.checkpoint.hf_export_record import clean_partial, export_state, hf_dir_of

    spec = _spec(max_shard_size="40KB")
    role_dir = make_step(conv["llama"], str(tmp_path / "run"), spec=spec)
    ref = _merge(role_dir, str(tmp_path / "ref"), spec)
    planted = _plant_partial(role_dir, ref)
    assert export_state(role_dir) == "partial"
    assert _files(_merge(role_dir, str(tmp_path / "again"), spec)) == _files(ref)
    removed = clean_partial(role_dir)
    assert sorted(removed) == sorted(f"actor/huggingface/{n}" for n in planted)
    assert export_state(role_dir) == "absent"
    assert sorted(os.listdir(hf_dir_of(role_dir))) == ["config.json", "generation_config.json"]


def test_record_of_a_missing_short_or_damaged_file_is_partial(conv, tmp_path):
    from mcore_rl.checkpoint.hf_export import ExportError
    from mcore_rl.conversion.hf_export_step import export_step
    from mcore_rl.checkpoint.hf_export_record import clean_partial, export_state, hf_dir_of
    from mcore_rl.fileio.output_dir import EXPORT_RECORD

    spec = _spec(max_shard_size="40KB")
    role_dir = make_step(conv["llama"], str(tmp_path / "run"), spec=spec)
    export_step(role_dir, spec, 1)
    hf = hf_dir_of(role_dir)
    shard = os.path.join(hf, sorted(n for n in os.listdir(hf) if n.startswith("model-"))[1])
    data = open(shard, "rb").read()
    os.rename(shard, shard + ".away")
    assert export_state(role_dir) == "partial"
    os.rename(shard + ".away", shard)
    open(shard, "wb").write(data[:-1])
    assert export_state(role_dir) == "partial"
    open(shard, "wb").write(data[:-1] + bytes([data[-1] ^ 1]))  # same size, one bit flipped
    assert export_state(role_dir) == "complete" and export_state(role_dir, verify=True) == "partial"
    record = json.load(open(os.path.join(hf, EXPORT_RECORD)))
    open(shard, "wb").write(data)
    json.dump({**record, "source": "xxh3_128:" + "0" * 32}, open(os.path.join(hf, EXPORT_RECORD), "w"))
    assert export_state(role_dir) == "partial"  # exported from another save of the step
    with pytest.raises(ExportError, match=r"the HF export of step 1 is partial .* clean_partial\(\) removes"):
        export_step(role_dir, spec, 1)
    json.dump(record, open(os.path.join(hf, EXPORT_RECORD), "w"))
    open(shard, "wb").write(data[:-1] + bytes([data[-1] ^ 1]))
    removed = clean_partial(role_dir, verify=True)
    assert removed[0] == f"actor/huggingface/{EXPORT_RECORD}" and removed[1].endswith("index.json")
    assert "actor/huggingface/config.json" not in removed and export_state(role_dir) == "absent"
    assert export_step(role_dir, spec, 1).files and export_state(role_dir, verify=True) == "complete"


def _worker(role_dir: str, *args: str, env: dict | None = None, wait: bool = True):
    cmd = [sys.executable, "-m", "mcore_rl.conversion.hf_export_worker", "--role_dir", role_dir, *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT, **(env or {})},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if not wait:
        return proc
    out, err = proc.communicate(timeout=300)
    return proc.returncode, out, err


def _loads_complete_or_fails(hf: str, ref: str) -> str:
    """transformers' from_pretrained of ``hf``: "fails", or "complete" when it loads ref's tensors."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(hf)
    except (OSError, ValueError, RuntimeError, KeyError, FileNotFoundError):
        return "fails"
    expected = {}
    for name in os.listdir(ref):
        if name.endswith(".safetensors"):
            expected.update(load_file(os.path.join(ref, name)))
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in expected.items()), "loaded a model other than the export"
    return "complete"


def _held(proc, hold) -> None:
    """Waits until the worker announces it holds at the merge phase (``MCORE_RL_CKPT_HOLD``)."""
    for _ in range(30000):
        if any(n.startswith("hf_export_merge.") for n in os.listdir(hold)) or proc.poll() is not None:
            break
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()


@pytest.mark.parametrize("phase", ["merge", "move", "record"])
def test_worker_killed_at_each_phase_then_cleaned_and_rerun(conv, tmp_path, phase):
    """merge: the worker holds with the merge staged (nothing moved), runs niced (by 10, the
    default) at IO class idle (or best-effort 7), and is SIGKILLed from outside;
    move / record: it kills itself after its first weight file moved / before its record. Each
    leaves a partial export (shards first: never the index without every shard) that transformers
    loads only complete; clean_partial and a rerun (the worker: exit 0, its summary line) complete it."""
    from mcore_rl.checkpoint.child_process import IOPRIO_CLASS_BE, IOPRIO_CLASS_IDLE, ioprio_get
    from mcore_rl.checkpoint.hf_export_record import INDEX, clean_partial, export_state, hf_dir_of
    from mcore_rl.conversion.hf_export_step import export_step

    spec = _spec(max_shard_size="40KB")
    role_dir = make_step(conv["llama"], str(tmp_path / "run"), spec=spec)
    ref = _merge(role_dir, str(tmp_path / "ref"), spec)
    args = ["--step", "1", "--max_shard_size", "40KB"]
    if phase == "merge":
        hold = tmp_path / "hold"
        hold.mkdir()
        proc = _worker(role_dir, *args, env={"MCORE_RL_CKPT_HOLD": str(hold)}, wait=False)
        try:
            _held(proc, hold)
            stat = open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()
            assert int(stat[16]) >= os.nice(0) + 10, (stat[16], os.nice(0))  # field 19: nice
            assert ioprio_get(proc.pid) in ((IOPRIO_CLASS_IDLE, 0), (IOPRIO_CLASS_BE, 7)), ioprio_get(proc.pid)
        finally:
            proc.kill()
        rc = proc.wait()
    else:
        rc, out, err = _worker(role_dir, *args, "--nice", "0", env={"MCORE_RL_CKPT_FAULT": f"hf_export_{phase}"})
    assert rc == -signal.SIGKILL, (rc, phase == "merge" or err)
    hf = hf_dir_of(role_dir)
    assert export_state(role_dir) == export_state(role_dir, verify=True) == "partial"
    moved = sorted(n for n in os.listdir(hf) if n.startswith("model"))
    shards = sorted(n for n in os.listdir(ref) if n.startswith("model-"))
    expect = {"merge": [], "move": shards[:1], "record": sorted(shards + [INDEX])}[phase]
    assert moved == expect, f"after a kill at {phase}: {moved}"  # shards first, the index last
    assert _loads_complete_or_fails(hf, ref) == ("complete" if phase == "record" else "fails")
    assert clean_partial(role_dir) and export_state(role_dir) == "absent"
    if phase == "record":
        rc, out, err = _worker(role_dir, *args, "--nice", "0", "--threads", "2")
        assert rc == 0 and err == "" and out.startswith(f"exported step 1 actor: {len(shards) + 1} file(s)"), (out, err)
        assert "peak RSS" in out and "(nice " in out and "2 torch thread(s)" in out, out
    else:
        export_step(role_dir, spec, 1)
    assert export_state(role_dir, verify=True) == "complete" and _files(hf) == _files(ref)
    assert _loads_complete_or_fails(hf, ref) == "complete"


def test_worker_refuses_in_one_line(conv, tmp_path, capsys, monkeypatch):
    """Bad input: one ``error:`` line, exit 2, checked before the worker lowers its priority
    (in-process here: this process keeps its nice value); as ``python -m``: no traceback."""
    from mcore_rl.conversion.hf_export_worker import main

    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # main sets them for the export's threads
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    role_dir = make_step(conv["llama"], str(tmp_path / "run"), spec=_spec())
    nowhere = str(tmp_path / "nowhere" / "global_step_1" / "actor")
    nice = os.nice(0)
    for args, message in [
        (["--role_dir", role_dir, "--step", "1", "--threads", "0"], "argument --threads: '0' is not an integer >= 1"),
        (["--role_dir", role_dir, "--step", "2"], f"error: {role_dir} is not a role dir of step 2"),
        (["--role_dir", role_dir, "--step", "1", "--dtype", "bf16", "--fp8_block_size", "64"],
         "error: --fp8_block_size given with --dtype bf16; they apply to --dtype fp8 only"),
        (["--role_dir", nowhere, "--step", "1"], f"error: {nowhere} is not a directory; pass a role dir of a step"),
    ]:
        try:
            rc = main(args)
        except SystemExit as e:  # argparse
            rc = e.code
        out, err = capsys.readouterr()
        assert rc == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error: "), (args, err)
        assert message in err and out == "", (args, err)
    assert os.nice(0) == nice and sorted(os.listdir(os.path.dirname(role_dir))) == ["COMPLETE", "actor"]
    rc, out, err = _worker(role_dir, "--step", "1", "--dtpye", "bf16")
    assert rc == 2 and err == "error: hf_export_worker: unrecognized arguments: --dtpye bf16 (see hf_export_worker " \
        "--help)\n", err


def test_inline_weights_of_an_older_step_are_complete_as_they_are(conv, tmp_path):
    """A step written before background exports records its HF weights itself: ``inline``, never
    exported over, and clean_partial removes none of them."""
    from mcore_rl.checkpoint.hf_export import ExportError
    from mcore_rl.checkpoint.hf_export_record import clean_partial, export_state
    from mcore_rl.conversion.hf_export_step import export_step

    ref = _merge(make_step(conv["llama"], str(tmp_path / "plain")), str(tmp_path / "ref"), _spec())
    conv_copy = str(tmp_path / "conv_inline")
    shutil.copytree(conv["llama"], conv_copy)
    shutil.copyfile(os.path.join(ref, "model.safetensors"), os.path.join(conv_copy, "huggingface", "model.safetensors"))
    role_dir = make_step(conv_copy, str(tmp_path / "run"))
    assert export_state(role_dir) == "inline" and clean_partial(role_dir) == []
    with pytest.raises(ExportError, match="is inline .* the step holds its HF weights itself; nothing to export"):
        export_step(role_dir, _spec(), 1)


def test_worker_fp8_options_make_the_spec():
    from mcore_rl.checkpoint.hf_export import ExportSpec
    from mcore_rl.conversion.hf_export_worker import _parser, _spec
    from mcore_rl.mapping.fp8_quant import BlockFp8

    args = _parser().parse_args(["--role_dir", "d", "--step", "3", "--dtype", "fp8", "--fp8_block_size", "64", "32",
                                 "--scale_fmt", "ue8m0", "--max_shard_size", "1GB"])
    assert _spec(args) == ExportSpec("fp8", "1GB", BlockFp8((64, 32), "ue8m0"))
    assert _spec(_parser().parse_args(["--role_dir", "d", "--step", "3", "--dtype", "fp8"])).fp8 == BlockFp8()


def test_child_dies_with_its_parent(tmp_path):
    """``die_with_parent_preexec`` as Popen's preexec_fn: SIGKILL of the parent takes the child."""
    code = ("import subprocess, sys\n"
            "from mcore_rl.checkpoint.child_process import die_with_parent_preexec\n"
            "child = subprocess.Popen(['sleep', '60'], preexec_fn=die_with_parent_preexec())\n"
            "print(child.pid, flush=True)\n"
            "child.wait()\n")
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT},
                              stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert open(f"/proc/{child}/cmdline").read().startswith("sleep")
    parent.kill()
    parent.wait()
    for _ in range(500):
        try:
            state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break
        if state == "Z":  # killed, not yet reaped by init
            break
        time.sleep(0.01)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail(f"the child {child} outlived its parent")


def test_peak_rss_of_an_execd_exporter_is_its_own():
    """The exporter is exec'd by a large rank: getrusage's maxrss carries the rank's peak across
    exec (a 4 GB "peak" for an 0.9 GB export was reported); peak_rss_mb reads the program's own
    high-water mark. A parent touching 400 MiB, then exec: the child reports far less."""
    child = "from mcore_rl.fileio.files import peak_rss_mb; print(peak_rss_mb())"
    parent = ("import os, sys, numpy as np; a = np.ones(400 * 2**20 // 8); "
              f"os.execv(sys.executable, [sys.executable, '-c', {child!r}])")
    out = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()}).stdout
    assert float(out) < 200, out
