"""The export path trusts nothing it did not verify (issue #29): ``mcore_to_hf.py merge`` and
``test`` check a model dir against its record first (a step's COMPLETE marker, a converter's
RECORD: size and checksum of every file) and refuse a flipped byte, a torn step, a copy without a
record and a step copied under another number, each as one ``error:`` line, exit 2
(``--skip_verify`` reads it anyway and says so); a step replaced while it is merged is an error,
never a mix of two saves; damaged files behind ``--skip_verify`` are still one error line each."""
from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import shutil
import struct

import pytest
import torch

from tests.read_fixtures import build, flip_in_up_proj

UP = "model.layers.1.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return build(tmp_path_factory.getbasetemp())


def cli(*argv: str) -> tuple[int, str, str]:
    """converters/mcore_to_hf.py's main() in this process: (exit code, stdout, stderr)."""
    from converters.mcore_to_hf import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def one_error(code: int, err: str, *texts: str) -> None:
    assert code == 2 and err.count("\n") == 1 and err.startswith("error: "), (code, err)
    for text in texts:
        assert text in err, (text, err)


def _step_copy(dirs, tmp_path, name: str = "global_step_1") -> str:
    """A copy of the whole step (marker included) under ``tmp_path/root/name``; its actor dir."""
    dst = tmp_path / "root" / name
    shutil.copytree(os.path.dirname(dirs["step"]), dst)
    return str(dst / "actor")


@pytest.mark.parametrize("kind", ["step", "conv"])
def test_flipped_byte_in_a_shard_is_refused_naming_it(dirs, tmp_path, kind):
    local = _step_copy(dirs, tmp_path) if kind == "step" else shutil.copytree(dirs["conv"], tmp_path / "conv")
    local = str(local)
    flip_in_up_proj(local)
    code, _, err = cli("merge", "--local_dir", local, "--target_dir", str(tmp_path / "out"))
    one_error(code, err, "dist_ckpt/__0_0.distcp has checksum", "COMPLETE" if kind == "step" else "RECORD")
    assert not os.path.exists(tmp_path / "out")
    code, _, err = cli("test", "--local_dir", local, "--test_hf_dir", dirs["hf"])
    one_error(code, err, "dist_ckpt/__0_0.distcp has checksum")
    code, out, err = cli("merge", "--local_dir", local, "--target_dir", str(tmp_path / "out"), "--skip_verify")
    assert code == 0 and "WITHOUT checking" in out, (out, err)
    from mcore_rl.mapping.hf_io import SafetensorsReader

    ref = dirs["export"] if kind == "step" else SafetensorsReader(dirs["hf"])
    assert not torch.equal(SafetensorsReader(str(tmp_path / "out"))[UP], ref[UP])  # the flip is in up_proj


def test_torn_step_unrecorded_copy_and_renumbered_step_are_refused(dirs, tmp_path):
    local = _step_copy(dirs, tmp_path)
    os.remove(os.path.join(os.path.dirname(local), "COMPLETE"))
    code, _, err = cli("merge", "--local_dir", local, "--target_dir", str(tmp_path / "a"))
    one_error(code, err, "is not a complete checkpoint: it has no COMPLETE marker")
    loose = shutil.copytree(dirs["step"], tmp_path / "loose")  # a role dir taken out of its step
    code, _, err = cli("test", "--local_dir", str(loose), "--test_hf_dir", dirs["hf"])
    one_error(code, err, "has no RECORD", "--skip_verify")
    code, out, _ = cli("test", "--local_dir", str(loose), "--test_hf_dir", dirs["hf"], "--skip_verify")
    assert code == 1 and "WITHOUT checking" in out  # read: the trained weights differ from the HF start
    renamed = _step_copy(dirs, tmp_path / "b", "global_step_7")
    code, _, err = cli("merge", "--local_dir", renamed, "--target_dir", str(tmp_path / "b_out"))
    one_error(code, err, "is the marker of step 1, not of step 7")
    code, _, err = cli("merge", "--local_dir", dirs["step"], "--target_dir", str(tmp_path / "ok"))
    assert code == 0, err
    planted = _step_copy(dirs, tmp_path / "c")  # a file added after the save would be copied out
    open(os.path.join(planted, "huggingface", "tokenizer.json"), "w").write("{}")
    code, _, err = cli("merge", "--local_dir", planted, "--target_dir", str(tmp_path / "c_out"))
    one_error(code, err, "['huggingface/tokenizer.json'] is not in its record")


def test_resume_refuses_a_step_copied_under_another_number(tmp_path):
    from mcore_rl.checkpoint.inventory import Marker
    from mcore_rl.checkpoint.load_checks import check_step_number
    from mcore_rl.errors import CheckpointError

    marker = Marker(3, ("actor",), 1, {})
    check_step_number(str(tmp_path / "global_step_3"), marker)
    check_step_number(str(tmp_path / "backup"), marker)  # a name that claims no number
    with pytest.raises(CheckpointError, match="marker of step 3, but the directory is named for step 4"):
        check_step_number(str(tmp_path / "global_step_4"), marker)


def test_step_replaced_while_merging_is_an_error_not_a_mix(dirs, tmp_path, monkeypatch):
    """The step is swapped for another save (as the manager replaces a step: the new dir renamed
    into place, the old one removed) after the merge read its third tensor."""
    from mcore_rl.conversion import merge as merge_mod
    from mcore_rl.fileio.torch_dist_read import TorchDistReader

    local = _step_copy(dirs, tmp_path)
    step = os.path.dirname(local)
    new = shutil.copytree(os.path.dirname(dirs["step_new"]), tmp_path / "root" / ".global_step_1.incoming")
    original, reads = TorchDistReader.read, []

    def read(self, key, index=()):
        reads.append(key)
        if len(reads) == 3:
            os.rename(step, step + ".outgoing")
            os.rename(new, step)
            shutil.rmtree(step + ".outgoing")
        return original(self, key, index)

    monkeypatch.setattr(TorchDistReader, "read", read)
    with pytest.raises(merge_mod.MergeError, match="was replaced or removed while it was read"):
        merge_mod.merge(local, str(tmp_path / "out"))
    assert len(reads) > 3 and not os.path.exists(tmp_path / "out")


# ---- damaged files the reader itself must refuse (behind --skip_verify, and with the check) --------
def _meta_pickle(obj) -> bytes:
    return pickle.dumps(obj)


def _damage(model_dir: str, what: str) -> None:
    meta = os.path.join(model_dir, "mcore_rl.json")
    dist = os.path.join(model_dir, "dist_ckpt")
    shard = os.path.join(dist, "__0_0.distcp")
    if what == "meta_not_json":
        open(meta, "w").write("{not json")
    elif what == "meta_list":
        open(meta, "w").write("[1, 2]")
    elif what == "contents_not_list":
        data = json.load(open(meta))
        open(meta, "w").write(json.dumps({**data, "contents": "model"}))
    elif what == "metadata_truncated":
        raw = open(os.path.join(dist, ".metadata"), "rb").read()
        open(os.path.join(dist, ".metadata"), "wb").write(raw[: len(raw) // 2])
    elif what == "metadata_int":
        open(os.path.join(dist, ".metadata"), "wb").write(_meta_pickle(7))
    elif what == "metadata_huge":  # BINBYTES8 claiming 2**62 bytes
        open(os.path.join(dist, ".metadata"), "wb").write(b"\x80\x04\x8e" + struct.pack("<Q", 2 ** 62) + b"ab.")
    elif what == "shard_garbled":  # the head (zip header, pickle) of every record
        from mcore_rl.fileio.torch_dist_read import TorchDistReader

        reader = TorchDistReader(dist)
        data = bytearray(open(shard, "rb").read())
        for info in reader._storage.values():
            data[info.offset + 30:info.offset + 130] = bytes(range(100, 200))
        del reader
        open(shard, "wb").write(bytes(data))
    elif what == "shard_huge":  # every record a tiny pickle claiming 2**62 bytes
        size = os.path.getsize(shard)
        tiny = b"\x80\x04\x8e" + struct.pack("<Q", 2 ** 62) + b"ab."
        open(shard, "wb").write((tiny * (size // len(tiny) + 1))[:size])


@pytest.mark.parametrize("what", ["meta_not_json", "meta_list", "contents_not_list", "metadata_truncated",
                                  "metadata_int", "metadata_huge", "shard_garbled", "shard_huge"])
def test_damaged_model_dir_is_one_error_line(dirs, tmp_path, what):
    local = str(shutil.copytree(dirs["conv"], tmp_path / "conv"))
    _damage(local, what)
    for flags in ((), ("--skip_verify",)):
        code, _, err = cli("merge", "--local_dir", local, "--target_dir", str(tmp_path / "out"), *flags)
        one_error(code, err)
        assert not os.path.exists(tmp_path / "out")


def _damage_hf(hf: str, what: str) -> None:
    st = os.path.join(hf, "model.safetensors")
    index = os.path.join(hf, "model.safetensors.index.json")
    if what == "truncated":
        with open(st, "r+b") as f:
            f.truncate(os.path.getsize(st) // 2)
    elif what == "bad_index":
        open(index, "w").write("{oops")
    elif what == "index_without_weight_map":
        open(index, "w").write(json.dumps({"metadata": {}}))
    elif what == "array_header":
        raw = open(st, "rb").read()
        n = int.from_bytes(raw[:8], "little")
        header = b"[]".ljust(n)
        open(st, "wb").write(raw[:8] + header + raw[8 + n:])
    elif what == "huge_header":
        with open(st, "r+b") as f:  # a header length past the 100 MB cap, in a (sparse) file that long
            f.write(struct.pack("<Q", 200_000_000))
            f.truncate(200_000_100)


@pytest.mark.parametrize("what", ["truncated", "bad_index", "index_without_weight_map", "array_header",
                                  "huge_header"])
def test_damaged_reference_is_one_error_line(dirs, tmp_path, what):
    hf = str(shutil.copytree(dirs["hf"], tmp_path / "hf"))
    _damage_hf(hf, what)
    code, _, err = cli("test", "--local_dir", dirs["conv"], "--test_hf_dir", hf)
    one_error(code, err, os.path.join(hf, ""), *(["headers are at most 100000000"] if what == "huge_header" else []))


def test_unsealed_role_part_is_vouched_for_by_its_part_record(dirs, tmp_path):
    """verl's newest step stays unsealed (no COMPLETE) until the next save: its role part's PART
    record (files with checksums) vouches for it; a PART of another step or role does not."""
    from mcore_rl.checkpoint.role_parts import PartRecord, read_part, write_part

    local = _step_copy(dirs, tmp_path, "global_step_3")
    step = os.path.dirname(local)
    marker = json.load(open(os.path.join(step, "COMPLETE")))
    files = {rel: (e["size"], e["checksum"]) for rel, e in marker["files"].items() if rel.startswith("actor/")}
    os.remove(os.path.join(step, "COMPLETE"))
    write_part(os.path.join(local, "PART"), PartRecord(3, "actor", 1.0, files))
    code, _, err = cli("merge", "--local_dir", local, "--target_dir", str(tmp_path / "ok"))
    assert code == 0, err
    write_part(os.path.join(local, "PART"), PartRecord(2, "actor", 1.0, files))
    assert read_part(os.path.join(local, "PART")).step == 2
    code, _, err = cli("merge", "--local_dir", local, "--target_dir", str(tmp_path / "bad"))
    one_error(code, err, "records the actor part of step 2, not the actor part of step 3")


def test_load_model_dir_verifies_the_record_first(dirs):
    """A job's model.mcore_dir (and verl's) is checked like a merge: the fixture's 1-rank world
    loaded the converter output, a copy with a flipped byte and a step without its marker."""
    out = dirs["load_model_dir"]
    assert out["good"] == "loaded"
    assert "CheckpointError" in out["flipped"] and "dist_ckpt/__0_0.distcp has checksum" in out["flipped"], out
    assert "CheckpointError" in out["torn"] and "it has no COMPLETE marker" in out["torn"], out


def test_tiling_check_is_bounded(tmp_path):
    """A crafted .metadata with thousands of chunks per key: the tiling check takes milliseconds
    (it was pairwise: 8M box comparisons here), and a grid of more than MAX_CELLS cells is refused."""
    import time

    from mcore_rl.fileio.torch_dist_read import TorchDistReadError, check_tiling

    me = str(tmp_path)
    n = 4000
    chunks = [((i,), (1,)) for i in range(n)]
    start = time.monotonic()
    check_tiling(me, "k", (), (n,), chunks)
    assert time.monotonic() - start < 1.0
    with pytest.raises(TorchDistReadError, match=r"chunks at \(5,\) and \(5,\) overlap"):
        check_tiling(me, "k", (), (n,), chunks[:-1] + [((5,), (1,))])
    rows = [box for i in range(3000) for box in (((i, 0), (1, i + 1)), ((i, i + 1), (1, 3000 - i - 1)))]
    with pytest.raises(TorchDistReadError, match="more than 4194304 cells"):  # each row cut elsewhere
        check_tiling(me, "k", (), (3000, 3000), rows)


@pytest.mark.parametrize("fault, text", [
    ("stat:EIO@global_step_1/COMPLETE", "cannot check"),  # an error while looking is not "absent"
    ("stat:ESTALE@actor/RECORD", "cannot check"),
    ("open:EIO@dist_ckpt/__0_0.distcp", "dist_ckpt/__0_0.distcp is unreadable"),
    ("open:EIO@dist_ckpt/.metadata", "dist_ckpt/.metadata is unreadable"),
])
def test_io_errors_while_verifying_are_one_error_line(dirs, tmp_path, monkeypatch, fault, text):
    monkeypatch.setenv("MCORE_RL_CKPT_IO_FAULT", fault)
    code, _, err = cli("merge", "--local_dir", dirs["step"], "--target_dir", str(tmp_path / "out"))
    one_error(code, err, text)
    assert not os.path.exists(tmp_path / "out")
